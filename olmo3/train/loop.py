"""The training loop: `train(plan)` trains a RunPlan's experiment on the current devices to the
stage's end, starting where the plan says (olmo3.train.state restores, verifies and falls
back), writing metric rows (olmo3.train.rows), evaluating (olmo3.train.evaluation) and
checkpointing on the configured cadences, and stopping cleanly at a step boundary on SIGTERM /
SIGINT or past train.max_consecutive_skips (olmo3.train.skips). It holds the workdir's lease
(olmo3.train.lease) while it runs, and reports what it got done in a `Progress`. A lease it
can no longer renew stops it at the next step boundary the processes agree on, saving that
step when the storage allows, with LeaseLost. Whatever stops a run, the cleanup on the way out
(the last async save, the metrics' upload, the lease's release) never replaces the error:
after a storage failure each remote operation is tried once, and a failure is logged.

A signal stops the run at the end of the step it came during: no further step and no
evaluation (one under way is abandoned between batches), then that step is saved, whatever
the checkpoint cadence; a signal during a save stops the run once that save is made (it is
acknowledged at once: `Preemption.notice`). A signal during the last step or its save changes
nothing (the run completes) and is reported as it ends.

The host never waits for a step it does not need: batches reach the devices ahead of their
step (`pipeline.DevicePrefetch`), a log step's row is fetched after the next step is dispatched,
and the consecutive-skip count is checked with the rows and before evaluating or saving. Only
evaluation and checkpoint steps (and a preemption's save) wait for their own step.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
from absl import logging
from etils import epath

from olmo3.data import pipeline
from olmo3.io import storage
from olmo3.run import record
from olmo3.run.plan import RunPlan
from olmo3.sharded_model import ShardedModel
from olmo3.train import logs
from olmo3.train import state as state_lib
from olmo3.train.run_checkpoints import RunCheckpoints
from olmo3.train.evaluation import LoopEvaluation
from olmo3.train.lease import Lease, LeaseLost, hold, stop_without_lease
from olmo3.train.preemption import EXCHANGE_EVERY, Preemption
from olmo3.train.rows import MetricRows, open_writer
from olmo3.train.skips import SkipLimit
from olmo3.train.step import jit_train_step


@dataclasses.dataclass
class Progress:
  """What a `train` call got done, for its caller to read when it returns or raises."""

  steps: int = 0  # steps it dispatched (0: it stopped before its first step: nothing trained)
  interrupted: int | None = None  # the step a signal stopped it at (saved, when steps > 0)
  # that signal's name (SIGINT, SIGTERM); also set, with `interrupted` None, for one that came
  # during the last step or its save, after which the run completed
  signal: str | None = None
  evaluation_skipped: bool = False  # that step's evaluation was due and did not run


def train(plan: RunPlan, model: ShardedModel | None = None,
          preemption: Preemption | None = None,
          progress: Progress | None = None) -> dict[str, float]:
  """Trains to plan.end; returns the last logged metrics ({} when there was nothing to
  train). `model` (default: the experiment's mesh over all devices) chooses the devices and
  the forward function; `preemption` (default: installed here) lets a launcher catch SIGTERM /
  SIGINT from its own start; `progress`, when given, is filled in as the run goes."""
  preemption = preemption or Preemption()
  progress = progress if progress is not None else Progress()
  storage.retried(lambda: epath.Path(plan.workdir.root).mkdir(parents=True, exist_ok=True),
                  plan.workdir.root, "creating the workdir")
  lease = Lease(plan.workdir.root)
  hold(lease)
  try:
    last = _train(plan, model or ShardedModel.for_experiment(plan.exp), preemption, progress,
                  lease)
  except BaseException as e:
    preemption.restore()
    if jax.process_index() == 0:
      with storage.cleanup_after(e):
        lease.release()  # never raises
    raise
  preemption.restore()
  if jax.process_index() == 0:
    lease.release()
  return last


def _train(plan: RunPlan, model: ShardedModel, preemption: Preemption,
           progress: Progress, lease: Lease) -> dict[str, float]:
  exp = plan.exp
  layout = state_lib.StateLayout(exp, model)
  evaluation = LoopEvaluation(plan, model) if LoopEvaluation.wanted(plan) else None
  checkpoints = RunCheckpoints(plan.workdir.checkpoints, exp.checkpoint.keep,
                               exp.checkpoint.async_save)
  if jax.process_index() == 0:
    record.write_experiment(plan.workdir.root, exp.to_dict())  # unless the launcher's record did
    plan.size_cache.save()  # the remote sizes the plan looked up, for the next launch
  with model.context(), contextlib.ExitStack() as cleanup:
    source = plan.train_files
    logging.info("training data: %d files, sources %s, %d %sinstances of %d tokens",
                 len(source.paths), list(source.source_names), len(source),
                 "packed " if exp.data.packing else "", exp.data.seq_len)
    if plan.alarm_off:
      logging.warning("%s", plan.alarm_off)
    step_fn = jit_train_step(exp, model, layout, len(source.source_names))
    if evaluation is not None:  # beside the startup below, which keeps about one core busy
      evaluation.compile_ahead()
      cleanup.callback(evaluation.close)
    with logs.Heartbeat("initialising or restoring the train state"):
      state, data_position = state_lib.restore_or_init(layout, checkpoints, plan)
    start, end = int(state.step), plan.end
    if start >= end:
      logging.info("already at step %d of %d: nothing to do", start, end)
      return {}
    if preemption.agreed():  # signalled during startup: nothing new to save
      progress.interrupted, progress.signal = start, preemption.signal_name
      logging.warning("interrupted (%s) before step %d: stopping; nothing trained",
                      progress.signal, start + 1)
      return {}
    loader = pipeline.Loader(exp.data, model.batch_sharding,
                             start_step=data_position.data_step(start), num_steps=end - start,
                             source=source, microbatches=exp.train.microbatches)
    batches = (pipeline.DevicePrefetch(iter(loader), exp.data.device_prefetch)
               if exp.data.device_prefetch else iter(loader))
    writer = open_writer(plan, start)
    rows = MetricRows(plan, model.mesh, writer, start)
    limit = exp.train.max_consecutive_skips
    skips = SkipLimit(limit, int(state.skip.consecutive)) if limit is not None else None

    def wait_for_step() -> None:
      """The pending row and the skip count, where the loop needs the step's results anyway."""
      rows.write()
      if skips is not None:
        skips.check()

    # Nothing below reads the devices except wait_for_step, evaluation and saving: the host
    # runs a step ahead, dispatching step s + 1 before it waits for step s's row.
    completed = False  # the last step trained and saved, no signal or alarm having stopped it
    try:
      with contextlib.closing(batches):
        for step, batch in enumerate(batches, start=start + 1):
          checkpoints.check()  # a failed async save stops the run here, not a save later
          if not preemption.stop_requested and (lost := lease.lost()):
            preemption.request_stop(lost)  # never a step more than the processes agree on
          if step == start + 1:  # the first call traces and compiles (minutes for the 7B)
            with logs.Heartbeat(f"compiling the train step (steps {start + 1}-{end} to go)"):
              state, step_metrics = step_fn(state, batch)
            rows.restart_clock(start)  # step times and the ETA are the steps', not the compile's
          else:
            state, step_metrics = step_fn(state, batch)
          progress.steps += 1
          if rows.pending:
            wait_for_step()  # the previous step's row, while this step runs
          if skips is not None:
            skips.add(step, step_metrics)
          last_step = step == end
          rows.add(step, step_metrics, row=step % exp.train.log_every == 0 or last_step)
          evaluate = evaluation is not None and (step % exp.train.eval_every == 0 or last_step)
          checkpoint = step % exp.checkpoint.every == 0 or last_step
          # A signal seen at any point of this step is honoured here: no evaluation, and a save
          # whatever the checkpoint cadence. In a job of several processes, at the step they
          # agree on (a second or so later, or the next exchange for signals Python caught:
          # olmo3.train.preemption).
          signalled = preemption.agreed(
              exchange=evaluate or checkpoint or step % EXCHANGE_EVERY == 0)
          interrupted = signalled and (evaluate or not last_step)  # else it ends here anyway
          stop = False
          if evaluate and not interrupted:
            wait_for_step()  # the alarm compares this step's row with the evaluation
            # Every process asks at the same evaluation batches: they abandon it together.
            outcome = evaluation(step, state.params, rows,
                                 stop=lambda: preemption.agreed(exchange=False))
            interrupted, stop = outcome is None, bool(outcome)
          if stop or interrupted or checkpoint:
            wait_for_step()  # never a checkpoint after the skip limit was reached
            if interrupted and preemption.stop_requested:
              stop_without_lease(preemption.reason, step, lambda: (
                  writer.flush(), state_lib.save(checkpoints, state, plan, data_position),
                  checkpoints.wait()))
            writer.flush()  # metrics up to a checkpoint are on disk before it can exist
            logging.info("saving the checkpoint of step %d", step)
            # (the final save's notice holds until its async part has landed, below the loop)
            preemption.notice = (f"the run stops once the checkpoint of step {step} is saved"
                                 + (", the run's last: the run is then complete" if last_step
                                    else ""))
            state_lib.save(checkpoints, state, plan, data_position)
            if not last_step:
              preemption.notice = None
            if not (stop or interrupted or last_step):  # a signal during the save: stop here
              interrupted = preemption.agreed()
          if interrupted and preemption.stop_requested:  # the lease was lost during the save
            stop_without_lease(preemption.reason, step, checkpoints.wait)
          if interrupted:
            progress.interrupted, progress.signal = step, preemption.signal_name
            progress.evaluation_skipped = evaluate
            logging.warning("interrupted (%s) at step %d: saved%s", progress.signal, step,
                            (f"; step {step}'s evaluation did not run" if evaluate else "")
                            + ("; the run is complete" if last_step
                               else "; rerun the same command to resume"))
          if stop or interrupted:
            break
          completed = last_step
    except BaseException as e:
      with storage.cleanup_after(e):
        storage.quietly("finishing the last checkpoint save", checkpoints.wait)
        # A run whose lease another launch took writes nothing more into the workdir: its
        # metrics would land in (in a bucket: replace) the new holder's metrics.jsonl.
        if not (isinstance(e, LeaseLost) and e.taken):
          storage.quietly("writing the metrics", writer.flush)
      raise
    checkpoints.wait()
    writer.flush()
    preemption.notice = None
    # A signal during the last step or its save (which nothing stops) was not acted on: say
    # that it was seen and how the run ended (every process asks here, as at a step).
    if completed and preemption.agreed():
      progress.signal = preemption.signal_name
      logging.warning("%s received during step %d, the run's last, or its save: the checkpoint "
                      "is saved and the run is complete", progress.signal, end)
  return rows.last
