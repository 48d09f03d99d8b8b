"""A training step's decisions (olmo3.train.decisions), in process and without JAX: what each
step's number calls for, then, for every case the loop can meet, what `take_step` asks and does
through a scripted I/O (the order of its questions and acts, how the step ends, what it says),
and the same invariants over every combination of what a step can learn."""

import dataclasses
import itertools

import pytest

from olmo3.train import decisions
from olmo3.train.decisions import Cadences, Known, Leave, Outcome

# The cadences of the table: a row every step, an evaluation every 6, a checkpoint every 4,
# the signal exchange every 10 (olmo3.train.preemption.EXCHANGE_EVERY), the stage ending at 50.
CADENCES = Cadences(end=50, log_every=1, checkpoint_every=4, eval_every=6, exchange_every=10)
NO_EVALUATION = dataclasses.replace(CADENCES, eval_every=None)


@pytest.mark.parametrize("cadences, step, row, evaluate, checkpoint, exchange", [
    (CADENCES, 1, True, False, False, False),  # an ordinary step
    (CADENCES, 4, True, False, True, True),  # the checkpoint cadence
    (CADENCES, 6, True, True, False, True),  # the evaluation cadence
    (CADENCES, 10, True, False, False, True),  # the exchange cadence alone
    (CADENCES, 12, True, True, True, True),  # both cadences
    (CADENCES, 50, True, True, True, True),  # the last step: everything
    (NO_EVALUATION, 6, True, False, False, False),  # no held-out sets or tasks
    (NO_EVALUATION, 50, True, False, True, True),
    (dataclasses.replace(CADENCES, log_every=5), 3, False, False, False, False),
    (dataclasses.replace(CADENCES, log_every=5), 5, True, False, False, False),
    (dataclasses.replace(CADENCES, log_every=7), 50, True, True, True, True),  # last: a row
])
def test_what_a_step_number_calls_for(cadences, step, row, evaluate, checkpoint, exchange):
  due = cadences.due(step)
  assert (due.row, due.evaluate, due.checkpoint, due.exchange) == (
      row, evaluate, checkpoint, exchange)
  assert due.last == (step == cadences.end)


class SkipLimitReached(Exception):
  """What the scripted wait raises where SkipLimit.check would raise TrainingStopped."""


class Left(Exception):
  """What the scripted leave raises where lease.stop_without_lease raises LeaseLost."""


@dataclasses.dataclass
class Script:
  """What a step learns, as a scripted decisions.StepIO records what is asked and done."""

  signal: str | None = None  # "check", "evaluation" or "save": when a signal is agreed
  lease: str | None = None  # "check" (lost before the step) or "save" (another process's,
  #                           learnt at the barrier after the save)
  alarm: bool = False  # the evaluation's gap alarm stops the run
  skip_limit: bool = False  # the step's skip flags reach the limit (at the step's own read)
  trace: list[str] = dataclasses.field(default_factory=list)
  asked: int = 0
  notices: list = dataclasses.field(default_factory=list)

  def agreed(self, exchange: bool) -> bool:
    self.trace.append(f"agreed(exchange={exchange})")
    self.asked += 1
    at = "check" if self.asked == 1 else "save"
    return self.signal == at or self.lease == at

  def stop_requested(self) -> bool:
    return self.lease == "check" or (self.lease == "save" and self.asked > 1)

  def wait_for_step(self) -> None:
    self.trace.append("wait")
    if self.skip_limit:
      raise SkipLimitReached()

  def evaluate(self, step: int) -> bool | None:
    del step
    self.trace.append("evaluate")
    return None if self.signal == "evaluation" else self.alarm

  def save(self, decision: decisions.Decision) -> None:
    self.trace.append("save")
    self.notices.append((decision.notice, decision.notice_after_save))

  def leave(self, decision: decisions.Decision):
    self.trace.append(f"leave({decision.leave.value})")
    raise Left()

  def report(self, decision: decisions.Decision) -> None:
    self.trace.append("report")


def step_of(script: Script, cadences: Cadences, step: int) -> tuple[str, object]:
  """How the step ended ("continues", "completes", "interrupted", "alarm", "left",
  "skip limit") and its decision (None where it raised)."""
  try:
    decision = decisions.take_step(cadences.due(step), script)
  except SkipLimitReached:
    return "skip limit", None
  except Left:
    return "left", None
  ended = ("interrupted" if decision.interrupted else "alarm" if decision.stop
           else "completes" if decision.completed else "continues")
  assert decision.ends == (ended in ("interrupted", "alarm"))
  return ended, decision


CHECK, CHECK_EXCHANGE = "agreed(exchange=False)", "agreed(exchange=True)"
ASK_AFTER_SAVE = "agreed(exchange=True)"
W, EV, SV, REPORT = "wait", "evaluate", "save", "report"
RESUME, COMPLETE = "; rerun the same command to resume", "; the run is complete"
NOT_RUN = "; step {}'s evaluation did not run"

# name, cadences, step, script, what the step asks and does, how it ends, its warning's tail
# (interrupted steps: after "interrupted (SIGTERM) at step N: saved"), the evaluation skipped
CASES = [
    ("ordinary step", CADENCES, 1, Script(), [CHECK], "continues", None, False),
    ("exchange step", CADENCES, 10, Script(), [CHECK_EXCHANGE], "continues", None, False),
    ("checkpoint cadence step", CADENCES, 4, Script(),
     [CHECK_EXCHANGE, W, SV, ASK_AFTER_SAVE], "continues", None, False),
    ("evaluation step", CADENCES, 6, Script(), [CHECK_EXCHANGE, W, EV], "continues", None,
     False),
    ("evaluation and checkpoint step", CADENCES, 12, Script(),
     [CHECK_EXCHANGE, W, EV, W, SV, ASK_AFTER_SAVE], "continues", None, False),
    ("last step", CADENCES, 50, Script(), [CHECK_EXCHANGE, W, EV, W, SV], "completes", None,
     False),
    ("last step, no evaluation", NO_EVALUATION, 50, Script(), [CHECK_EXCHANGE, W, SV],
     "completes", None, False),
    # Signals: the step's save, whatever the cadence, no evaluation, no step more.
    ("signal at an ordinary step", CADENCES, 1, Script(signal="check"),
     [CHECK, W, SV, REPORT], "interrupted", RESUME, False),
    ("signal at a checkpoint step", CADENCES, 4, Script(signal="check"),
     [CHECK_EXCHANGE, W, SV, REPORT], "interrupted", RESUME, False),
    ("signal at an evaluation step", CADENCES, 6, Script(signal="check"),
     [CHECK_EXCHANGE, W, SV, REPORT], "interrupted", NOT_RUN.format(6) + RESUME, True),
    ("signal during evaluation", CADENCES, 6, Script(signal="evaluation"),
     [CHECK_EXCHANGE, W, EV, W, SV, REPORT], "interrupted", NOT_RUN.format(6) + RESUME, True),
    ("signal during a save", CADENCES, 4, Script(signal="save"),
     [CHECK_EXCHANGE, W, SV, ASK_AFTER_SAVE, REPORT], "interrupted", RESUME, False),
    # (the evaluation ran, yet counts as skipped: the report reads the cadence, as it always has)
    ("signal during a save after an evaluation", CADENCES, 12, Script(signal="save"),
     [CHECK_EXCHANGE, W, EV, W, SV, ASK_AFTER_SAVE, REPORT], "interrupted", RESUME, False),
    # The last step: a signal that cuts nothing short changes nothing (the run's end says it).
    ("signal at the last step, no evaluation", NO_EVALUATION, 50, Script(signal="check"),
     [CHECK_EXCHANGE, W, SV], "completes", None, False),
    ("signal at the last step", CADENCES, 50, Script(signal="check"),
     [CHECK_EXCHANGE, W, SV, REPORT], "interrupted", NOT_RUN.format(50) + COMPLETE, True),
    ("signal during the last evaluation", CADENCES, 50, Script(signal="evaluation"),
     [CHECK_EXCHANGE, W, EV, W, SV, REPORT], "interrupted", NOT_RUN.format(50) + COMPLETE,
     True),
    ("signal during the last save", CADENCES, 50, Script(signal="save"),
     [CHECK_EXCHANGE, W, EV, W, SV], "completes", None, False),
    # The gap alarm: saved, stopped, nothing reported as an interruption.
    ("evaluation alarm stop", CADENCES, 6, Script(alarm=True), [CHECK_EXCHANGE, W, EV, W, SV],
     "alarm", None, False),
    ("evaluation alarm stop at the last step", CADENCES, 50, Script(alarm=True),
     [CHECK_EXCHANGE, W, EV, W, SV], "alarm", None, False),
    # The lease: stop_without_lease saves (or waits for the save) and raises LeaseLost.
    ("lease lost at an ordinary step", CADENCES, 1, Script(lease="check"),
     [CHECK, W, "leave(saving)"], "left", None, False),
    ("lease lost at a save step", CADENCES, 4, Script(lease="check"),
     [CHECK_EXCHANGE, W, "leave(saving)"], "left", None, False),
    ("lease lost at an evaluation step", CADENCES, 6, Script(lease="check"),
     [CHECK_EXCHANGE, W, "leave(saving)"], "left", None, False),
    ("lease lost during a save", CADENCES, 4, Script(lease="save"),
     [CHECK_EXCHANGE, W, SV, ASK_AFTER_SAVE, "leave(waiting)"], "left", None, False),
    ("lease lost at the last step", CADENCES, 50, Script(lease="check"),
     [CHECK_EXCHANGE, W, "leave(saving)"], "left", None, False),
    # (the last save too: the workdir may be another launch's now)
    ("lease lost at the last step, no evaluation", NO_EVALUATION, 50, Script(lease="check"),
     [CHECK_EXCHANGE, W, "leave(saving)"], "left", None, False),
    ("lease lost and a signal during a save", CADENCES, 4, Script(signal="save", lease="save"),
     [CHECK_EXCHANGE, W, SV, ASK_AFTER_SAVE, "leave(waiting)"], "left", None, False),
    # The skip limit: read with the step's own row, before anything is evaluated or saved.
    ("skip limit at an ordinary step (seen at a later read)", CADENCES, 1,
     Script(skip_limit=True), [CHECK], "continues", None, False),
    ("skip limit at an evaluation step", CADENCES, 6, Script(skip_limit=True),
     [CHECK_EXCHANGE, W], "skip limit", None, False),
    ("skip limit at a checkpoint step", CADENCES, 4, Script(skip_limit=True),
     [CHECK_EXCHANGE, W], "skip limit", None, False),
    ("skip limit at the last step", CADENCES, 50, Script(skip_limit=True),
     [CHECK_EXCHANGE, W], "skip limit", None, False),
    ("skip limit at a signalled step", CADENCES, 1, Script(signal="check", skip_limit=True),
     [CHECK, W], "skip limit", None, False),
    ("skip limit at a step whose lease is lost", CADENCES, 1,
     Script(lease="check", skip_limit=True), [CHECK, W], "skip limit", None, False),
]


@pytest.mark.parametrize("cadences, step, script, trace, ended, tail, skipped",
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_every_case_a_step_can_meet(cadences, step, script, trace, ended, tail, skipped):
  how, decision = step_of(script, cadences, step)
  assert (script.trace, how) == (trace, ended)
  if decision is None:
    return
  assert decision.evaluation_skipped == skipped
  if tail is not None:
    assert decision.report("SIGTERM") == f"interrupted (SIGTERM) at step {step}: saved{tail}"
  assert decision.completed == (how == "completes")
  for notice, after in script.notices:  # said at once to a signal during the save
    assert notice == (f"the run stops once the checkpoint of step {step} is saved"
                      + (", the run's last: the run is then complete" if step == 50 else ""))
    assert after == (notice if step == 50 else None)  # the last holds until its save lands
  if SV in trace:
    assert decision.saving == f"saving the checkpoint of step {step}"


def test_every_combination_keeps_the_rules():
  """Whatever a step learns, in any order the loop can meet: the first question is the check
  at the step's exchange; an evaluation or a save follows the read of the step's own row and
  skip flags, and nothing follows a reached skip limit; a stop agreed at the check runs no
  evaluation; a run that stops here has saved here (or left through the lease's exit); and the
  only other question is the one after a save, asked only where the run would go on."""
  steps = [(c, s) for c in (CADENCES, NO_EVALUATION) for s in (1, 4, 6, 10, 12, 50)]
  for (cadences, step), signal, lease, alarm, skip_limit in itertools.product(
      steps, (None, "check", "evaluation", "save"), (None, "check", "save"), (False, True),
      (False, True)):
    script = Script(signal=signal, lease=lease, alarm=alarm, skip_limit=skip_limit)
    how, decision = step_of(script, cadences, step)
    due, trace = cadences.due(step), script.trace
    what = f"step {step} of {cadences}, {script}"
    assert trace[0] == f"agreed(exchange={due.exchange})", what
    for i, act in enumerate(trace):
      if act in (EV, SV):
        assert trace[i - 1] == W, what
    if how == "skip limit":
      assert trace[-1] == W and EV not in trace and SV not in trace, what
    stopped_at_check = signal == "check" or lease == "check"
    if stopped_at_check:
      assert EV not in trace and how != "continues", what
    if EV in trace:
      assert due.evaluate, what
    if how in ("interrupted", "alarm"):
      assert SV in trace, what
    if how == "left":
      assert lease is not None and trace[-1].startswith("leave("), what
    if lease == "check" and not skip_limit and not (due.last and not due.evaluate):
      assert how == "left", what  # never a step more than the processes agreed on
    asked_again = trace.count(ASK_AFTER_SAVE) - due.exchange
    assert asked_again in (0, 1), what
    if asked_again:
      assert trace[trace.index(SV) + 1] == ASK_AFTER_SAVE, what
      assert not (due.last or stopped_at_check
                  or (EV in trace and (alarm or signal == "evaluation"))), what
    assert ("report" in trace) == (how == "interrupted"), what
    if decision is not None and decision.completed:
      assert due.last and SV in trace, what


@pytest.mark.parametrize("known, why", [
    (Known(CADENCES.due(1), signalled=False, outcome=Outcome.PASSED), "no evaluation ran"),
    (Known(CADENCES.due(6), signalled=True, outcome=Outcome.PASSED), "no evaluation ran"),
    (Known(CADENCES.due(12), signalled=False, saved=True), "before its evaluation's outcome"),
    (Known(CADENCES.due(1), signalled=False, saved=True), "no save was due"),
    (Known(CADENCES.due(4), signalled=False, signal_in_save=True), "not made or not asked"),
    (Known(CADENCES.due(50), signalled=False, outcome=Outcome.PASSED, saved=True,
           signal_in_save=True), "not made or not asked"),
])
def test_knowledge_a_step_cannot_have_is_refused(known, why):
  with pytest.raises(ValueError, match=why):
    decisions.decide(known)


def test_what_the_step_knows_decides_alone():
  """`decide` is a function of what the step knows: the lease's state matters only for a stop
  (and before or after the save), an outcome replaces the check's verdict."""
  due = CADENCES.due(12)
  assert decisions.decide(Known(due, signalled=False, lease_lost=True)).leave is None
  assert decisions.decide(Known(due, signalled=True, lease_lost=True)).leave is Leave.SAVING
  after = Known(due, signalled=False, lease_lost=True, outcome=Outcome.PASSED, saved=True,
                signal_in_save=True)
  assert decisions.decide(after).leave is Leave.WAITING
  alarm = decisions.decide(Known(due, signalled=False, outcome=Outcome.ALARM))
  assert (alarm.stop, alarm.interrupted, alarm.save, alarm.ask_after_save) == (
      True, False, True, False)
  assert [Outcome.of(r) for r in (False, True, None)] == [
      Outcome.PASSED, Outcome.ALARM, Outcome.ABANDONED]
  assert decisions.signal_at_the_end("SIGTERM", 50) == (
      "SIGTERM received during step 50, the run's last, or its save: the checkpoint is saved "
      "and the run is complete")
