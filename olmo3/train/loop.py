"""The training loop: `train(plan)` trains a RunPlan's experiment on the current devices to the
stage's end, starting where the plan says (olmo3.train.state restores, verifies and falls
back), writing metric rows (olmo3.train.rows), evaluating (olmo3.train.loop_evaluation) and
checkpointing on the configured cadences, and stopping cleanly at a step boundary on SIGTERM /
SIGINT or past train.max_consecutive_skips (olmo3.train.skips). It holds the workdir's lease
(olmo3.run.lease) while it runs, and reports what it got done in a `Progress`. A lease it
can no longer renew stops it at the next step boundary the processes agree on, saving that
step when the storage allows, with LeaseLost. Whatever stops a run, the cleanup on the way out
(the last async save, the metrics' upload, the lease's release) never replaces the error:
after a storage failure each remote operation is tried once, and a failure is logged.

A signal stops the run at the end of the step it came during: no further step and no
evaluation (one under way is abandoned between batches), then that step is saved, whatever
the checkpoint cadence; a signal during a save stops the run once that save is made (it is
acknowledged at once: `Preemption.notice`). A signal during the last step or its save changes
nothing (the run completes) and is reported as it ends.

The train step is compiled before the first step runs (a signal during the compile, which
can take minutes, is acknowledged at once and stops the run before step 1: nothing trained).
The host runs one step ahead of the devices and no further: it dispatches step s + 1, then
waits for step s to end (nothing is copied), so a signal stops the step under way or the one
queued behind it, never a run of steps queued long before. Otherwise the host never waits for
a step it does not need: batches reach the devices ahead of their step
(`pipeline.DevicePrefetch`), a log step's row is fetched after the next step is dispatched,
and the consecutive-skip count is checked with the rows and before evaluating or saving. Only
evaluation and checkpoint steps (and a preemption's save) wait for their own step.

What a step does (its row, evaluation, save, stop, and what it says) is decided apart from
doing it, by olmo3.train.decisions: the loop dispatches the step, reads the previous row, and
carries the step's decisions out (`_StepIO`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import jax
from absl import logging
from etils import epath

from olmo3 import program
from olmo3.data import pipeline
from olmo3.io import metrics as metrics_lib
from olmo3.io import retry
from olmo3.run import record
from olmo3.run.plan import RunPlan
from olmo3.placement import ShardedModel
from olmo3.train import decisions, logs
from olmo3.train import state as state_lib
from olmo3.train.run_checkpoints import RunCheckpoints, await_fenced_save
from olmo3.train.loop_evaluation import LoopEvaluation
from olmo3.run.lease import (Lease, LeaseLost, check_before_save, hold, stop_without_lease,
                             takeover_s)
from olmo3.train.preemption import Preemption
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
          progress: Progress | None = None, lease: Lease | None = None) -> dict[str, float]:
  """Trains to plan.end; returns the last logged metrics ({} when there was nothing to
  train). `model` (default: the experiment's mesh over all devices) chooses the devices and
  the forward function; `preemption` (default: installed here) lets a launcher catch SIGTERM /
  SIGINT from its own start; `progress`, when given, is filled in as the run goes. `lease`:
  the workdir's lease, already held (`hold`) by a caller that wrote into the workdir under it
  and releases it itself (the launcher, which takes it before it records the launch); by
  default the lease is taken here, before anything is written, and released on the way out."""
  preemption = preemption or Preemption()
  progress = progress if progress is not None else Progress()
  retry.retried(lambda: epath.Path(plan.workdir.root).mkdir(parents=True, exist_ok=True),
                plan.workdir.root, "creating the workdir")
  own = lease is None
  if lease is None:
    lease = Lease(plan.workdir.root)
    hold(lease)
  try:
    last = _train(plan, model or ShardedModel.for_experiment(plan.exp), preemption, progress,
                  lease)
  except BaseException as e:
    preemption.restore()
    if own and jax.process_index() == 0:
      with retry.cleanup_after(e):
        lease.release()  # never raises
    raise
  preemption.restore()
  if own and jax.process_index() == 0:
    lease.release()
  return last


def _train(plan: RunPlan, model: ShardedModel, preemption: Preemption,
           progress: Progress, lease: Lease) -> dict[str, float]:
  exp = plan.exp
  layout = state_lib.StateLayout(exp, model)
  evaluation = LoopEvaluation(plan, model) if LoopEvaluation.wanted(plan) else None
  if lease.fenced is not None:  # process 0: the others wait for it where the checkpoints open
    await_fenced_save(plan.workdir.checkpoints, lease.fenced, takeover_s())
  checkpoints = RunCheckpoints(plan.workdir.checkpoints, exp.checkpoint.keep,
                               exp.checkpoint.async_save)
  if jax.process_index() == 0:
    record.write_experiment(plan.workdir.root, exp.to_dict())  # unless the launcher's record did
    plan.size_cache.save()  # the remote sizes the plan looked up, for the next launch
  with model.context(), contextlib.ExitStack() as cleanup:
    step_fn = _compile(plan, model, layout, evaluation, cleanup)
    cadences = decisions.Cadences(plan.end, exp.train.log_every, exp.checkpoint.every,
                                  exp.train.eval_every if evaluation is not None else None)
    # Room for the saves to come, before a restore (minutes for a 7B) and an interval's steps.
    checkpoints.check_room(layout.abstract.params, layout.abstract.opt_state,
                           exp.checkpoint.keep, cadences.saves_after(plan.resume.step))
    with logs.Heartbeat("initialising or restoring the train state"):
      state, data_position = state_lib.restore_or_init(layout, checkpoints, plan)
    start, end = int(state.step), plan.end
    if start >= end:
      logging.info("already at step %d of %d: nothing to do", start, end)
      return {}
    if _stopped_before_step(start, preemption, progress):  # signalled during startup
      return {}
    io = _StepIO(plan, model, step_fn, start, state, data_position, preemption, progress,
                 checkpoints, evaluation)
    first = next(io.batches)
    io.compile(first, model)
    if _stopped_before_step(start, preemption, progress):  # signalled during the compile
      io.batches.close()
      return {}
    if evaluation is not None and start == 0 and exp.checkpoint.init_from:
      # The long-context alarm's reference; every process asks at the same lengths.
      evaluation.start(start, state.params, stop=lambda: preemption.agreed(exchange=False))
      if _stopped_before_step(start, preemption, progress):
        io.batches.close()
        return {}
    # Nothing below reads the devices except wait_for_step, evaluation and saving: the host
    # runs a step ahead, dispatching step s + 1 before it waits for step s's row.
    completed = False  # the last step trained and saved, no signal or alarm having stopped it
    with _cleanup_on_failure(checkpoints, io.writer), contextlib.closing(io.batches):
      for step, batch in enumerate(itertools.chain([first], io.batches), start=start + 1):
        checkpoints.check()  # a failed async save stops the run here, not a save later
        if not preemption.stop_requested and (lost := lease.lost()):
          preemption.request_stop(lost)  # never a step more than the processes agree on
        step_metrics = io.dispatch(step, batch)
        progress.steps += 1
        if io.rows.pending:
          io.wait_for_step()  # the previous step's row, while this step runs
        if io.skips is not None:
          io.skips.add(step, step_metrics)
        due = cadences.due(step)
        io.rows.add(step, step_metrics, row=due.row)
        decision = decisions.take_step(due, io)
        if decision.ends:
          break
        completed = decision.completed
    checkpoints.wait()
    io.writer.flush()
    preemption.notice = None
    # A signal during the last step or its save (which nothing stops) was not acted on: say
    # that it was seen and how the run ended (every process asks here, as at a step).
    if completed and preemption.agreed():
      progress.signal = preemption.signal_name
      logging.warning("%s", decisions.signal_at_the_end(progress.signal, end))
  return io.rows.last


def _stopped_before_step(start: int, preemption: Preemption, progress: Progress) -> bool:
  """Whether a signal before the first step stops the run (every process asks here): nothing
  trained, nothing new to save."""
  if not preemption.agreed():
    return False
  progress.interrupted, progress.signal = start, preemption.signal_name
  logging.warning("interrupted (%s) before step %d: stopping; nothing trained",
                  progress.signal, start + 1)
  return True


def compiled_step(step_fn: Any, state: state_lib.TrainState, batch: Any) -> Callable:
  """The jitted train step compiled for the loop's state and batch (the compiled program runs
  every step; tests wrap what this returns to act inside a chosen step)."""
  return step_fn.lower(state, batch).compile()


def _compile(plan: RunPlan, model: ShardedModel, layout: state_lib.StateLayout,
             evaluation: LoopEvaluation | None, cleanup: contextlib.ExitStack) -> Callable:
  """The train step, jitted (it compiles at its first call); the evaluation's programs start
  compiling beside the startup, which keeps about one core busy."""
  exp, source = plan.exp, plan.train_files
  logging.info("training data: %d files, sources %s, %d %sinstances of %d tokens",
               len(source.paths), list(source.source_names), len(source),
               "packed " if exp.data.packing else "", exp.data.seq_len)
  if plan.alarm_off:
    logging.warning("%s", plan.alarm_off)
  step_fn = jit_train_step(exp, model, layout, len(source.source_names))
  if evaluation is not None:
    evaluation.compile_ahead()
    cleanup.callback(evaluation.close)
  return step_fn


class _StepIO:
  """What the loop's steps act on (decisions.StepIO): the devices, the data, the metric rows,
  the checkpoints, the evaluation, the signals and the lease. The decisions are
  olmo3.train.decisions'; this only carries them out."""

  def __init__(self, plan: RunPlan, model: ShardedModel, step_fn: Callable, start: int,
               state: state_lib.TrainState, data_position: state_lib.DataPosition,
               preemption: Preemption, progress: Progress, checkpoints: RunCheckpoints,
               evaluation: LoopEvaluation | None):
    exp = plan.exp
    self.plan, self.step_fn, self.state, self.data_position = plan, step_fn, state, data_position
    self.preemption, self.progress = preemption, progress
    self.checkpoints, self.evaluation = checkpoints, evaluation
    self.start = start
    self.previous: dict[str, jax.Array] | None = None  # the last dispatched step's metrics
    loader = pipeline.Loader(exp.data, model.batch_sharding,
                             start_step=data_position.data_step(self.start),
                             num_steps=plan.end - self.start, source=plan.train_files,
                             microbatches=exp.train.microbatches,
                             order_beside=plan.workdir.kept_order)
    self.batches = (pipeline.DevicePrefetch(iter(loader), exp.data.device_prefetch)
                    if exp.data.device_prefetch else iter(loader))
    self.writer = open_writer(plan, self.start)
    self.rows = MetricRows(plan, model.mesh, self.writer, self.start)
    limit = exp.train.max_consecutive_skips
    self.skips = SkipLimit(limit, int(state.skip.consecutive)) if limit is not None else None

  def compile(self, batch: Any, model: ShardedModel) -> None:
    """Compiles the train step for the first batch (minutes for the 7B), on a thread so that a
    signal meanwhile is acknowledged at once; the run then stops before its first step."""
    first = self.start + 1
    self.preemption.notice = (f"stopping once the train step is compiled, before step {first}: "
                              "nothing will be trained")
    with logs.Heartbeat(f"compiling the train step (steps {first}-{self.plan.end} to go)"):
      self.step_fn = program.on_a_thread(lambda: _in(model, lambda: compiled_step(
          self.step_fn, self.state, batch)))
    self.preemption.notice = None
    self.rows.restart_clock(self.start)  # step times and the ETA are the steps', not the compile's

  def dispatch(self, step: int, batch: Any) -> dict[str, jax.Array]:
    """Dispatches the step (the devices run it while the host goes on), then waits for the
    step before it to end: the host stays one step ahead, so that a signal stops the step
    under way or the one queued behind it. Its metrics."""
    self.state, step_metrics = self.step_fn(self.state, batch)
    previous, self.previous = self.previous, step_metrics
    if previous is not None:
      jax.block_until_ready(previous)  # replicated scalars, never donated: nothing is copied
    return step_metrics

  def wait_for_step(self) -> None:
    """The pending row and the skip count, where the loop needs the step's results anyway."""
    self.rows.write()
    if self.skips is not None:
      self.skips.check()

  def agreed(self, exchange: bool) -> bool:
    return self.preemption.agreed(exchange=exchange)

  def stop_requested(self) -> bool:
    return self.preemption.stop_requested

  def evaluate(self, step: int) -> bool | None:
    # Every process asks at the same evaluation batches: they abandon it together.
    return self.evaluation(step, self.state.params, self.rows,
                           stop=lambda: self.preemption.agreed(exchange=False))

  def _save(self) -> None:
    state_lib.save(self.checkpoints, self.state, self.plan, self.data_position)

  def save(self, decision: decisions.Decision) -> None:
    check_before_save(decision.step)  # a fenced earlier attempt saves nothing (LeaseLost)
    self.writer.flush()  # metrics up to a checkpoint are on disk before it can exist
    logging.info("%s", decision.saving)
    self.preemption.notice = decision.notice
    self._save()
    # (the final save's notice holds until its async part has landed, below the loop)
    self.preemption.notice = decision.notice_after_save

  def leave(self, decision: decisions.Decision) -> NoReturn:
    save = ((lambda: (self.writer.flush(), self._save(), self.checkpoints.wait()))
            if decision.leave is decisions.Leave.SAVING else self.checkpoints.wait)
    stop_without_lease(self.preemption.reason, decision.step, save)

  def report(self, decision: decisions.Decision) -> None:
    progress = self.progress
    progress.interrupted, progress.signal = decision.step, self.preemption.signal_name
    progress.evaluation_skipped = decision.evaluation_skipped
    logging.warning("%s", decision.report(progress.signal))


def _in(model: ShardedModel, fn: Callable[[], Any]) -> Any:
  """`fn()` inside the model's context (mesh and rules are per thread)."""
  with model.context():
    return fn()


@contextlib.contextmanager
def _cleanup_on_failure(checkpoints: RunCheckpoints,
                        writer: metrics_lib.MetricWriter) -> Iterator[None]:
  """Whatever stops the steps, the last async save and the metrics are finished on the way out
  without replacing the error (after a storage failure, each tried once)."""
  try:
    yield
  except BaseException as e:
    with retry.cleanup_after(e):
      retry.quietly("finishing the last checkpoint save", checkpoints.wait)
      # A run whose lease another launch took writes nothing more into the workdir: its
      # metrics would land in (in a bucket: replace) the new holder's metrics.jsonl.
      if not (isinstance(e, LeaseLost) and e.taken):
        retry.quietly("writing the metrics", writer.flush)
    raise
