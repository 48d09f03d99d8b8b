"""The training loop: `train(exp, workdir)` trains an Experiment on the current devices until
`exp.train.steps` (or the end of epoch `train.stop_at_epoch`), resuming from the workdir's
latest checkpoint (olmo3.train.state), logging metrics, evaluating (olmo3.eval.evaluator) and
checkpointing on the configured cadences, and stopping cleanly at a step boundary on SIGTERM /
SIGINT. Besides the step's scalars it logs each data source's loss over the log interval
(`train/<source>/ce_loss`, the mix's labels).

The host never waits for a step it does not need: batches reach the devices ahead of their
step (`pipeline.DevicePrefetch`), a log step's row is fetched after the next step is dispatched,
and the consecutive-skip count is checked with the rows and before evaluating or saving. Only
evaluation and checkpoint steps (and a preemption's save) wait for their own step.
"""

from __future__ import annotations

import contextlib
import json
import time

import jax
import numpy as np
from absl import logging
from etils import epath

from olmo3.config import Experiment
from olmo3.data import pipeline, sources
from olmo3.eval.alarm import GapAlarm
from olmo3.eval.evaluator import Evaluator
from olmo3.flops import peak_flops_per_device
from olmo3.sharded import ShardedModel
from olmo3 import metrics as metrics_lib
from olmo3 import storage
from olmo3.train import state as state_lib
from olmo3.train import logs
from olmo3.train.checkpoints import RunCheckpoints
from olmo3.train.lease import Lease, LeaseHeld
from olmo3.train.preemption import EXCHANGE_EVERY, Preemption
from olmo3.train.step import jit_train_step

FILE_SIZES = "file_sizes.json"  # in the workdir: remote token files' sizes, looked up once


class TrainingStopped(RuntimeError):
  """The run cannot continue (too many consecutive skipped steps). The message says why."""


def _write_experiment(exp: Experiment, workdir: str) -> None:
  """WORKDIR/experiment.json (plain JSON, so tools read a run without Fiddle), unless the
  launcher's run record wrote it (with each config revision's own file: never rewritten)."""
  path = epath.Path(workdir) / "experiment.json"
  if jax.process_index() == 0 and not path.exists():
    path.write_text(json.dumps(exp.to_dict(), indent=1))


def stage_end(exp: Experiment, source) -> int:
  """The step this stage ends at: train.steps, or the end of epoch train.stop_at_epoch of its
  data when that comes first. Says so when the two disagree."""
  end = exp.train.steps
  if exp.train.stop_at_epoch is not None:
    per_epoch = pipeline.steps_per_epoch(exp.data, source)
    epoch_end = exp.train.stop_at_epoch * per_epoch
    if epoch_end != end:
      logging.warning("train.steps=%d but epoch %d of the data ends at step %d (%d instances, "
                      "%d steps per epoch): the stage ends at step %d", end,
                      exp.train.stop_at_epoch, epoch_end, len(source), per_epoch,
                      min(end, epoch_end))
    end = min(end, epoch_end)
  return end


def source_losses(names: tuple[str, ...], sums: list) -> dict[str, float]:
  """train/<source>/ce_loss: each source's token-mean CE over the steps whose (ce_sum [S],
  tokens [S]) are in `sums`; a source without tokens in them is left out."""
  ce_S, tokens_S = np.asarray(sums, np.float64).sum(axis=0)
  return {f"train/{name}/ce_loss": ce / n for name, ce, n in zip(names, ce_S, tokens_S) if n}


def train(exp: Experiment, workdir: str, name: str = "",
          model: ShardedModel | None = None,
          preemption: Preemption | None = None,
          size_cache: storage.SizeCache | None = None) -> dict[str, float]:
  """Trains to exp.train.steps; returns the last logged metrics. `model` (default: the
  experiment's mesh over all devices) chooses the devices and the forward function;
  `preemption` (default: installed here) lets a launcher catch SIGTERM / SIGINT from its own
  start; `size_cache` (default: the workdir's FILE_SIZES) the remote sizes a launcher already
  looked up, written to the workdir's cache now. Holds the workdir's lease
  (olmo3.train.lease) while it runs."""
  preemption = preemption or Preemption()
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  lease = Lease(workdir)
  _hold(lease)
  try:
    return _train(exp, workdir, name, model, preemption, size_cache)
  finally:
    preemption.restore()
    if jax.process_index() == 0:
      lease.release()


def _hold(lease: Lease) -> None:
  """The job's first process takes the lease; every process learns whether it did, so a refused
  job stops on all of them."""
  error = None
  if jax.process_index() == 0:
    try:
      lease.acquire()
    except LeaseHeld as e:
      error = e
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    refused = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
    if refused and error is None:
      raise LeaseHeld(f"{lease.path.parent} is in use by another run (see process 0's error)")
  if error is not None:
    raise error


class _Log:
  """The metrics rows. A log step's metrics stay on the devices until the loop fetches them:
  one step late (`write` after the next step is dispatched, so the devices work while the host
  waits, formats and writes) or, where the loop waits for the step anyway, at once. A crash
  can lose only the pending row, of a step after the latest checkpoint, which a resumed run
  logs again."""

  def __init__(self, exp: Experiment, writer: metrics_lib.interface.MetricWriter,
               names: tuple[str, ...], start: int, end: int):
    self.exp, self.writer, self.names, self.end = exp, writer, names, end
    self.flops_per_step = exp.model.flops_per_token(exp.data.seq_len) * exp.tokens_per_step
    self.peak = peak_flops_per_device(jax.devices()[0].device_kind)
    # Each step's per-source (ce_sum [S], tokens [S]) since the last row, on the devices.
    self.per_source: list[tuple[jax.Array, jax.Array]] = []
    # (step, metrics, its interval's per-source sums) of a row not fetched yet.
    self.pending: tuple[int, dict[str, jax.Array], list] | None = None
    self.clock = (time.perf_counter(), start)  # (when, step): the last step timed
    self.last: dict[str, float] = {}  # the last row (and evaluation) written
    self.train_logs: list[dict[str, float]] = []  # written since the last evaluation

  def add(self, step: int, step_metrics: dict[str, jax.Array], row: bool) -> None:
    self.per_source.append((step_metrics.pop("source_ce_sum"), step_metrics.pop("source_tokens")))
    if row:
      self.pending, self.per_source = (step, step_metrics, self.per_source), []

  def write(self) -> None:
    """The pending row, if any: waits for its step (only)."""
    if self.pending is None:
      return
    (step, step_metrics, sums), self.pending = self.pending, None
    fetched, sums = jax.device_get((step_metrics, sums))
    # The fetch returned when the step ended: its duration is the devices', the host's reading
    # and dispatching hidden behind it unless they are the slower.
    now = time.perf_counter()
    values = {k: float(v) for k, v in fetched.items()}
    values.update(source_losses(self.names, sums))
    elapsed = (now - self.clock[0]) / (step - self.clock[1])
    per_device = self.flops_per_step / elapsed / jax.device_count()
    values.update({"step_time_s": elapsed, "tokens_per_s": self.exp.tokens_per_step / elapsed,
                   "tflops_per_device": per_device / 1e12})
    if self.peak:
      values["mfu"] = per_device / self.peak
    self.writer.write_scalars(step, values)
    # For people: where the run is and when it ends at this pace (evaluations not counted).
    logging.info("step %d/%d: loss %.4f, %.0f tokens/s, %.3g s/step, ETA %s", step, self.end,
                 values["loss"], values["tokens_per_s"], elapsed,
                 logs.duration(elapsed * (self.end - step)))
    self.last = values
    self.train_logs.append(values)
    self.clock = (now, step)

  def restart_clock(self, step: int) -> None:
    """Time the steps after `step` from now (evaluation is not a step's time)."""
    self.clock = (time.perf_counter(), step)


class _SkipLimit:
  """train.max_consecutive_skips, counted on the host from each step's `skipped` flag. The
  flags stay on the devices until `check`, which the loop calls where it waits anyway (with a
  row, before evaluating or saving): a run of skips between two checks is still seen, and no
  checkpoint is written after the limit was reached."""

  def __init__(self, limit: int, consecutive: int):
    self.limit, self.consecutive = limit, consecutive
    self.steps: list[tuple[int, jax.Array, jax.Array]] = []  # (step, skipped, loss) unchecked

  def add(self, step: int, step_metrics: dict[str, jax.Array]) -> None:
    self.steps.append((step, step_metrics["skipped"], step_metrics["loss"]))

  def check(self) -> None:
    steps, self.steps = jax.device_get(self.steps), []
    for step, skipped, loss in steps:
      self.consecutive = self.consecutive + 1 if skipped else 0
      if self.consecutive >= self.limit:
        raise TrainingStopped(
            f"step {step}: {self.consecutive} consecutive steps skipped (NaN/Inf or loss / "
            f"gradient-norm spikes; the last loss was {float(loss)}): stopping. Parameters "
            f"at step {step} were those of step {step - self.consecutive}; the latest "
            f"checkpoint, from before step {step}, is intact. Lower the LR, check the data, or "
            "raise train.max_consecutive_skips.")


def _train(exp: Experiment, workdir: str, name: str, model: ShardedModel | None,
           preemption: Preemption, size_cache: storage.SizeCache | None) -> dict[str, float]:
  # Held-out sets and the task tokenizer follow the training data unless set: experiment.json
  # records what ran, so `python -m olmo3.eval` evaluates the same sets.
  exp = sources.resolve(exp)
  model = model or ShardedModel.for_experiment(exp)
  pipeline.check_divisible(exp.data.global_batch_size, model.batch_sharding,
                           "DataConfig.global_batch_size", exp.train.microbatches)
  layout = state_lib.StateLayout(exp, model)
  evaluator = None
  if exp.train.eval_every and (exp.eval.heldout or exp.eval.tasks):
    with logs.Heartbeat(f"preparing evaluation: held-out {list(exp.eval.heldout)}, "
                        f"{len(exp.eval.tasks)} tasks (tokenizer {exp.eval.tokenizer})"):
      evaluator = Evaluator(exp, model)
  checkpoints = RunCheckpoints(f"{workdir}/checkpoints", exp.checkpoint.keep,
                               exp.checkpoint.async_save)
  _write_experiment(exp, workdir)
  with model.context():
    with logs.Heartbeat(f"reading the training data ({exp.data.mix or 'data.paths'})"):
      cache = size_cache or storage.SizeCache(storage.join(workdir, FILE_SIZES))
      source = sources.token_files(exp.data, exp.model.vocab_size, size_cache=cache)
      cache.save()
    logging.info("training data: %d files, sources %s, %d instances of %d tokens",
                 len(source.paths), list(source.source_names), len(source), exp.data.seq_len)
    step_fn = jit_train_step(exp, model, layout, len(source.source_names))
    end = stage_end(exp, source)
    with logs.Heartbeat("initialising or restoring the train state"):
      state, data_position = state_lib.restore_or_init(layout, checkpoints, source)
    start = int(state.step)
    if start >= end:
      logging.info("already at step %d of %d: nothing to do", start, end)
      return {}
    if preemption.agreed():  # signalled during startup: nothing new to save
      logging.warning("preempted (signal %s) before step %d: stopping; rerun the same command "
                      "to resume", preemption.signal, start + 1)
      return {}
    loader = pipeline.Loader(exp.data, model.batch_sharding,
                             start_step=data_position.data_step(start),
                             num_steps=end - start, source=source)
    batches = (pipeline.DevicePrefetch(iter(loader), exp.data.device_prefetch)
               if exp.data.device_prefetch else iter(loader))
    writer = metrics_lib.create_writer(workdir, jax.process_index() == 0, resumed_at=start)
    if exp.wandb.enabled and jax.process_index() == 0:  # beside TensorBoard, the same scalars
      writer = metrics_lib.metric_writers.MultiWriter([writer, metrics_lib.create_wandb_writer(
          workdir, mode=exp.wandb.mode.value, project=exp.wandb.project, entity=exp.wandb.entity,
          name=exp.wandb.name, config=exp.to_dict())])
    from clu import periodic_actions  # after olmo3.metrics: CLU then imports without TF

    progress = periodic_actions.ReportProgress(num_train_steps=end, writer=writer,
                                               every_steps=max(exp.train.log_every, 10))
    alarm = GapAlarm(exp.eval.alarm_window, exp.eval.alarm_margin)
    log = _Log(exp, writer, source.source_names, start, end)
    limit = exp.train.max_consecutive_skips
    skips = _SkipLimit(limit, int(state.skip.consecutive)) if limit is not None else None

    def wait_for_step() -> None:
      """The pending row and the skip count, where the loop needs the step's results anyway."""
      log.write()
      if skips is not None:
        skips.check()

    # Nothing below reads the devices except wait_for_step, evaluation and saving: the host
    # runs a step ahead, dispatching step s + 1 before it waits for step s's row.
    try:
      with contextlib.closing(batches):
        for step, batch in enumerate(batches, start=start + 1):
          checkpoints.check()  # a failed async save stops the run here, not a save later
          if step == start + 1:  # the first call traces and compiles (minutes for the 7B)
            with logs.Heartbeat(f"compiling the train step (steps {start + 1}-{end} to go)"):
              state, step_metrics = step_fn(state, batch)
            log.restart_clock(start)  # step times and the ETA are the steps', not the compile's
          else:
            state, step_metrics = step_fn(state, batch)
          if log.pending:
            wait_for_step()  # the previous step's row, while this step runs
          if skips is not None:
            skips.add(step, step_metrics)
          progress(step)
          last_step = step == end
          log.add(step, step_metrics, row=step % exp.train.log_every == 0 or last_step)
          evaluate = evaluator is not None and (step % exp.train.eval_every == 0 or last_step)
          checkpoint = step % exp.checkpoint.every == 0 or last_step
          stop = False
          if evaluate:
            wait_for_step()  # the alarm compares this step's row with the evaluation
            with logs.Heartbeat(f"evaluating at step {step}"):
              evals = evaluator.evaluate(state.params)
            logging.info("step %d held-out: %s", step, ", ".join(
                f"{k.split('/')[1]} CE {v:.4f}" for k, v in evals.items()
                if k.startswith("eval/") and k.endswith("/ce_loss")) or "none")
            warning = alarm.observe(step, log.train_logs, evals)
            log.train_logs = []
            writer.write_scalars(step, evals)
            log.last = {**log.last, **evals}
            if warning:
              logging.warning("%s", warning)
              stop = exp.eval.stop_on_alarm
              if stop:
                logging.warning("stopping at step %d (eval.stop_on_alarm)", step)
            log.restart_clock(step)
          # A signal seen at any point of this step (training, evaluation, or the save below) is
          # honoured here, whatever the checkpoint cadence; in a job of several processes, at
          # the step they agree on (a second or so later, or the next exchange for signals
          # Python caught: olmo3.train.preemption).
          preempted = not last_step and preemption.agreed(
              exchange=evaluate or checkpoint or step % EXCHANGE_EVERY == 0)
          if stop or preempted or checkpoint:
            wait_for_step()  # never a checkpoint after the skip limit was reached
            writer.flush()  # metrics up to a checkpoint are on disk before it can exist
            logging.info("saving the checkpoint of step %d", step)
            state_lib.save(checkpoints, state, exp, name, data_position)
          if preempted:
            logging.warning("preempted (signal %s): saved step %d; rerun the same command to "
                            "resume", preemption.signal, step)
            break
          if stop:
            break
    finally:
      checkpoints.wait()
      writer.flush()
  return log.last
