"""The evaluation the loop runs on its cadence (train.eval_every and the stage's last step):
held-out loss per set, downstream tasks and RULER (olmo3.eval.evaluator), one line for people,
the scores into the metric rows, and the alarms (olmo3.eval.alarm: the generalization gap, and
with RULER the long context), which stop the run when eval.stop_on_alarm says so. A run that
scores RULER and starts from another run's checkpoint scores it once before its first step too:
the long-context alarm's reference."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
from absl import logging

from olmo3.eval import ruler_scores
from olmo3.eval.alarm import GapAlarm, LongContextAlarm
from olmo3.eval.evaluator import Evaluator, Stopped
from olmo3.run.plan import RunPlan
from olmo3.placement import ShardedModel
from olmo3.train import logs
from olmo3.train.rows import MetricRows


class LoopEvaluation:
  def __init__(self, plan: RunPlan, model: ShardedModel):
    exp = plan.exp
    self.stop_on_alarm = exp.eval.stop_on_alarm
    with logs.Heartbeat(f"preparing evaluation: held-out {[s.name for s in plan.heldout]}, "
                        f"{len(exp.eval.tasks)} tasks (tokenizer {exp.eval.tokenizer})"):
      self.evaluator = Evaluator(exp, model, {s.name: s.paths for s in plan.heldout})
    self.alarm = GapAlarm(exp.eval.alarm_window, exp.eval.alarm_margin)
    self.long_alarm = LongContextAlarm(exp.eval.ruler.alarm_drop)
    self._ahead: threading.Thread | None = None
    self._stop_ahead = threading.Event()

  @staticmethod
  def wanted(plan: RunPlan) -> bool:
    exp = plan.exp
    return bool(exp.train.eval_every and (plan.heldout or exp.eval.tasks
                                          or exp.eval.ruler.enabled))

  def start(self, step: int, params: Any, stop: Callable[[], bool] | None = None) -> None:
    """RULER on the parameters the run starts from (another run's checkpoint), logged and kept
    as the long-context alarm's reference; nothing when RULER is off, or when `stop()` says so
    before a length (a signal: the run then stops before its first step)."""
    if self.evaluator.ruler is None:
      return
    try:
      with logs.Heartbeat(f"RULER on the starting checkpoint (step {step})"):
        scores = self.evaluator.ruler_metrics(params, stop)
    except Stopped:
      logging.warning("RULER on the starting checkpoint abandoned: interrupted")
      return
    self._log_ruler(f"step {step} (the starting checkpoint)", scores)
    self.long_alarm.observe(step, ruler_scores.means(scores))

  @staticmethod
  def _log_ruler(when: str, scores: dict[str, float]) -> None:
    logging.info("%s RULER: %s", when, ", ".join(
        f"{n} {100 * v:.1f}" for n, v in sorted(ruler_scores.means(scores).items())))

  def compile_ahead(self) -> None:
    """Starts compiling the evaluation's programs (`Evaluator.compile_ahead`, on the shapes
    of the model's parameters) in a thread, so the run's first evaluation does not: the loop
    calls it as its startup begins, whose train-state initialisation and train-step compile
    keep about one core busy (a cold tiny run: 12 s of its startup, and the evaluation's five
    programs took 6 CPU s). The thread takes no part in the run's outcome: a failure there
    is compiled again, and raised, by the evaluation itself. One process only: in a job of
    several, each compile is one the processes make together (olmo3.compilation_cache), in
    the same order."""
    if jax.process_count() > 1:
      return
    self._ahead = threading.Thread(target=self._compile_ahead, name="evaluation-compile",
                                   daemon=True)
    self._ahead.start()

  def _compile_ahead(self) -> None:
    try:
      self.evaluator.compile_ahead(self.evaluator.model.param_target, self._stop_ahead.is_set)
    except Exception as e:  # pylint: disable=broad-except  # the evaluation meets it again
      logging.vlog(1, "compiling the evaluation ahead failed: %s", e)

  def close(self) -> None:
    """Stops compiling ahead after the compile under way (a run that ends never waits for
    more than that one)."""
    self._stop_ahead.set()
    if self._ahead is not None:
      self._ahead.join()

  def __call__(self, step: int, params: Any, rows: MetricRows,
               stop: Callable[[], bool] | None = None) -> bool | None:
    """Evaluates `params` at `step` after the step's row is written; True: the alarm stops the
    run; None: `stop()` said to stop (a signal) before the evaluation finished, which is then
    abandoned, nothing logged."""
    if self._ahead is not None:  # its programs, compiled once (long done by now, as a rule)
      self._ahead.join()
    try:
      with logs.Heartbeat(f"evaluating at step {step}"):
        evals = self.evaluator.evaluate(params, stop)
    except Stopped:
      logging.warning("evaluation at step %d abandoned: interrupted", step)
      return None
    logging.info("step %d held-out: %s", step, ", ".join(
        f"{k.split('/')[1]} CE {v:.4f}" for k, v in evals.items()
        if k.startswith("eval/") and k.endswith("/ce_loss")) or "none")
    warning = self.alarm.observe(step, rows.since_eval, evals)
    if self.evaluator.ruler is not None:
      self._log_ruler(f"step {step}", evals)
      lost = self.long_alarm.observe(step, ruler_scores.means(evals), evals)
      warning = "\n".join(w for w in (warning, lost) if w) or None
    rows.add_evaluation(step, evals)
    rows.restart_clock(step)
    if not warning:
      return False
    logging.warning("%s", warning)
    if self.stop_on_alarm:
      logging.warning("stopping at step %d (eval.stop_on_alarm)", step)
    return self.stop_on_alarm
