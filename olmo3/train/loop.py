"""The training loop: `train(plan)` trains a RunPlan's experiment on the current devices to the
stage's end, starting where the plan says (olmo3.train.state restores, verifies and falls
back), writing metric rows (olmo3.train.rows), evaluating (olmo3.train.evaluation) and
checkpointing on the configured cadences, and stopping cleanly at a step boundary on SIGTERM /
SIGINT or past train.max_consecutive_skips (olmo3.train.skips). It holds the workdir's lease
(olmo3.train.lease) while it runs.

The host never waits for a step it does not need: batches reach the devices ahead of their
step (`pipeline.DevicePrefetch`), a log step's row is fetched after the next step is dispatched,
and the consecutive-skip count is checked with the rows and before evaluating or saving. Only
evaluation and checkpoint steps (and a preemption's save) wait for their own step.
"""

from __future__ import annotations

import contextlib

import jax
from absl import logging
from etils import epath

from olmo3.data import pipeline
from olmo3.run import record
from olmo3.run.plan import RunPlan
from olmo3.sharded_model import ShardedModel
from olmo3.train import logs
from olmo3.train import state as state_lib
from olmo3.train.run_checkpoints import RunCheckpoints
from olmo3.train.evaluation import LoopEvaluation
from olmo3.train.lease import Lease, hold
from olmo3.train.preemption import EXCHANGE_EVERY, Preemption
from olmo3.train.rows import MetricRows, open_writer
from olmo3.train.skips import SkipLimit
from olmo3.train.step import jit_train_step


def train(plan: RunPlan, model: ShardedModel | None = None,
          preemption: Preemption | None = None) -> dict[str, float]:
  """Trains to plan.end; returns the last logged metrics ({} when there was nothing to
  train). `model` (default: the experiment's mesh over all devices) chooses the devices and
  the forward function; `preemption` (default: installed here) lets a launcher catch SIGTERM /
  SIGINT from its own start."""
  preemption = preemption or Preemption()
  epath.Path(plan.workdir.root).mkdir(parents=True, exist_ok=True)
  lease = Lease(plan.workdir.root)
  hold(lease)
  try:
    return _train(plan, model or ShardedModel.for_experiment(plan.exp), preemption)
  finally:
    preemption.restore()
    if jax.process_index() == 0:
      lease.release()


def _train(plan: RunPlan, model: ShardedModel, preemption: Preemption) -> dict[str, float]:
  exp = plan.exp
  layout = state_lib.StateLayout(exp, model)
  evaluation = LoopEvaluation(plan, model) if LoopEvaluation.wanted(plan) else None
  checkpoints = RunCheckpoints(plan.workdir.checkpoints, exp.checkpoint.keep,
                               exp.checkpoint.async_save)
  if jax.process_index() == 0:
    record.write_experiment(plan.workdir.root, exp.to_dict())  # unless the launcher's record did
    plan.size_cache.save()  # the remote sizes the plan looked up, for the next launch
  with model.context():
    source = plan.train_files
    logging.info("training data: %d files, sources %s, %d instances of %d tokens",
                 len(source.paths), list(source.source_names), len(source), exp.data.seq_len)
    step_fn = jit_train_step(exp, model, layout, len(source.source_names))
    with logs.Heartbeat("initialising or restoring the train state"):
      state, data_position = state_lib.restore_or_init(layout, checkpoints, plan)
    start, end = int(state.step), plan.end
    if start >= end:
      logging.info("already at step %d of %d: nothing to do", start, end)
      return {}
    if preemption.agreed():  # signalled during startup: nothing new to save
      logging.warning("preempted (signal %s) before step %d: stopping; rerun the same command "
                      "to resume", preemption.signal, start + 1)
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
    try:
      with contextlib.closing(batches):
        for step, batch in enumerate(batches, start=start + 1):
          checkpoints.check()  # a failed async save stops the run here, not a save later
          if step == start + 1:  # the first call traces and compiles (minutes for the 7B)
            with logs.Heartbeat(f"compiling the train step (steps {start + 1}-{end} to go)"):
              state, step_metrics = step_fn(state, batch)
            rows.restart_clock(start)  # step times and the ETA are the steps', not the compile's
          else:
            state, step_metrics = step_fn(state, batch)
          if rows.pending:
            wait_for_step()  # the previous step's row, while this step runs
          if skips is not None:
            skips.add(step, step_metrics)
          last_step = step == end
          rows.add(step, step_metrics, row=step % exp.train.log_every == 0 or last_step)
          evaluate = evaluation is not None and (step % exp.train.eval_every == 0 or last_step)
          checkpoint = step % exp.checkpoint.every == 0 or last_step
          stop = False
          if evaluate:
            wait_for_step()  # the alarm compares this step's row with the evaluation
            stop = evaluation(step, state.params, rows)
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
            state_lib.save(checkpoints, state, plan, data_position)
          if preempted:
            logging.warning("preempted (signal %s): saved step %d; rerun the same command to "
                            "resume", preemption.signal, step)
          if stop or preempted:
            break
    finally:
      checkpoints.wait()
      writer.flush()
  return rows.last
