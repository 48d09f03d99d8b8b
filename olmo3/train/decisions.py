"""What a training step does, decided apart from doing it: `decide` is one pure function from
what a step knows (its number and the cadences, a stop the processes agreed on, whether that
stop is the run's own because its lease is lost, the evaluation's outcome, a stop agreed once
its save was made) to what it does (evaluate, save, stop, leave without the lease) and what it
says; `take_step` asks the loop's I/O for that knowledge in the order the step learns it.

A step learns in phases, and each decision is made only from what is known by then:
  1. its number and the cadences (`Cadences.due`): a row? an evaluation? a checkpoint? a
     barrier among the processes at the signal check?
  2. the signal check: a stop agreed here cancels the evaluation and forces a save (but at the
     last step, where the run ends anyway, it only matters when it cuts the evaluation short);
  3. the evaluation's outcome: abandoned by a signal (interrupted), or the gap alarm (stop);
  4. before the save, the lease: a stop that is the run's own (its lease is lost) leaves
     through `lease.stop_without_lease`, which saves only while the workdir is still the run's;
  5. after the save: a signal during it stops the run there (unless the run stops anyway).
The consecutive-skip limit is not decided here: the loop reads a step's skip flags with its row
(`wait_for_step`), and a reached limit raises there. What is decided is that the step's own row
and skip flags are read before its evaluation and before its save, so a step that reaches the
limit neither evaluates nor saves.

Pure: no JAX, no clock, no storage; `tests/test_step_decisions.py` tables every combination.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NoReturn, Protocol

from olmo3.train.preemption import EXCHANGE_EVERY


@dataclasses.dataclass(frozen=True)
class Due:
  """What a step's number and the cadences call for, before anything is asked."""

  step: int
  last: bool  # the stage's last step: it always writes a row, evaluates (when on) and saves
  row: bool  # fetch and write the step's metric row
  evaluate: bool  # evaluate after the step (train.eval_every, or the last step)
  checkpoint: bool  # save the step (checkpoint.every, or the last step)
  # Share the signals Python caught among the processes at the check (a host barrier): at
  # steps that wait anyway, and every EXCHANGE_EVERY steps so a signal is not held long.
  exchange: bool


@dataclasses.dataclass(frozen=True)
class Cadences:
  end: int  # the stage's last step
  log_every: int
  checkpoint_every: int
  eval_every: int | None  # None: the run evaluates nothing (no held-out sets, no tasks)
  exchange_every: int = EXCHANGE_EVERY

  def saves_after(self, start: int) -> int:
    """How many checkpoints a run from `start` to the end saves (the cadence's and the last)."""
    if start >= self.end:
      return 0
    every = self.checkpoint_every
    return self.end // every - start // every + (1 if self.end % every else 0)

  def due(self, step: int) -> Due:
    last = step == self.end
    evaluate = self.eval_every is not None and (step % self.eval_every == 0 or last)
    checkpoint = step % self.checkpoint_every == 0 or last
    return Due(step=step, last=last, row=step % self.log_every == 0 or last, evaluate=evaluate,
               checkpoint=checkpoint,
               exchange=evaluate or checkpoint or step % self.exchange_every == 0)


class Outcome(enum.Enum):
  """How the step's evaluation ended."""

  PASSED = "passed"  # scores logged; the run goes on
  ALARM = "alarm"  # the generalization-gap alarm stops the run (eval.stop_on_alarm)
  ABANDONED = "abandoned"  # a signal came during it: abandoned between batches, nothing logged

  @classmethod
  def of(cls, result: bool | None) -> Outcome:
    """LoopEvaluation's answer (True: the alarm stops the run; None: abandoned)."""
    return cls.ABANDONED if result is None else cls.ALARM if result else cls.PASSED


class Leave(enum.Enum):
  """How a step whose agreed stop is the run's own (its lease is lost) leaves the run."""

  SAVING = "saving"  # before its save, which stop_without_lease makes if the workdir allows
  WAITING = "waiting"  # after its save (the lease was lost during it): the save lands first


@dataclasses.dataclass(frozen=True)
class Known:
  """What a step knows at one phase; the loop adds to it as the step goes."""

  due: Due
  signalled: bool  # the processes agreed on a stop at the step's check (a signal, a lost lease)
  # The agreed stop is the run's own request (Preemption.stop_requested): its lease is lost.
  # Read again at each phase: a barrier after the save can bring another process's.
  lease_lost: bool = False
  outcome: Outcome | None = None  # the evaluation's, once it ran
  saved: bool = False  # the step's save was made
  signal_in_save: bool | None = None  # a stop agreed once the save was made (None: not asked)


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the step does, as far as it knows (`knowing` adds to that)."""

  known: Known
  evaluate: bool  # run the evaluation (due, and no stop agreed at the check)
  save: bool  # save the step: due by the cadence, or the run stops here
  ask_after_save: bool  # a signal during the save stops the run: ask once it is made
  interrupted: bool  # a signal (or a lost lease) stops the run at this step, saved
  stop: bool  # the evaluation's alarm stops the run at this step, saved
  leave: Leave | None  # the lease is lost: stop_without_lease, before or after the save

  def knowing(self, **more) -> Decision:
    """The decision once the step knows `more` (fields of Known)."""
    return decide(dataclasses.replace(self.known, **more))

  @property
  def due(self) -> Due:
    return self.known.due

  @property
  def step(self) -> int:
    return self.known.due.step

  @property
  def ends(self) -> bool:
    """The run stops after this step (the loop breaks)."""
    return self.stop or self.interrupted

  @property
  def completed(self) -> bool:
    """The stage's last step, trained and saved, no signal or alarm having stopped it."""
    return self.due.last and not self.ends

  @property
  def evaluation_skipped(self) -> bool:
    """Progress.evaluation_skipped of an interrupted step: its evaluation was due and did not
    complete (cancelled at the check, or abandoned); one that ran before a signal during the
    save was not skipped."""
    return (self.interrupted and self.due.evaluate
            and self.known.outcome is not Outcome.PASSED)

  @property
  def saving(self) -> str:
    return f"saving the checkpoint of step {self.step}"

  @property
  def notice(self) -> str:
    """What a signal during the save leads to, said at once (Preemption.notice)."""
    return (f"the run stops once the checkpoint of step {self.step} is saved"
            + (", the run's last: the run is then complete" if self.due.last else ""))

  @property
  def notice_after_save(self) -> str | None:
    """The final save's notice holds until its async part has landed (the loop's end)."""
    return self.notice if self.due.last else None

  def report(self, signal: str) -> str:
    """The warning of an interrupted step; `signal` is the signal's name."""
    step = self.step
    return (f"interrupted ({signal}) at step {step}: saved"
            + (f"; step {step}'s evaluation did not run" if self.evaluation_skipped else "")
            + ("; the run is complete" if self.due.last else "; rerun the same command to resume"))


def decide(known: Known) -> Decision:
  """What a step does, given what it knows. Raises ValueError for knowledge the step cannot
  have (an outcome without an evaluation, a save that was not due, a question not asked)."""
  due = known.due
  # A stop agreed at the last step changes nothing (the run ends there, saved, anyway) unless
  # it cuts the evaluation short, or it is the run's own because its lease is lost: then the
  # last save too goes through stop_without_lease (the workdir may be another launch's).
  interrupted = known.signalled and (due.evaluate or not due.last or known.lease_lost)
  evaluate = due.evaluate and not interrupted
  stop = False
  if known.outcome is not None:
    if not evaluate:
      raise ValueError(f"step {due.step}: an evaluation outcome, but no evaluation ran")
    interrupted, stop = known.outcome is Outcome.ABANDONED, known.outcome is Outcome.ALARM
  elif evaluate and (known.saved or known.signal_in_save is not None):
    raise ValueError(f"step {due.step}: saved before its evaluation's outcome was known")
  save = stop or interrupted or due.checkpoint
  ask_after_save = save and not (stop or interrupted or due.last)  # else it stops anyway
  if known.saved and not save:
    raise ValueError(f"step {due.step}: saved, but no save was due")
  if known.signal_in_save is not None:
    if not (known.saved and ask_after_save):
      raise ValueError(f"step {due.step}: a signal after a save that was not made or not asked")
    interrupted = known.signal_in_save
  leave = None
  if interrupted and known.lease_lost:
    leave = Leave.WAITING if known.saved else Leave.SAVING
  return Decision(known=known, evaluate=evaluate, save=save, ask_after_save=ask_after_save,
                  interrupted=interrupted, stop=stop, leave=leave)


class StepIO(Protocol):
  """What only the loop can do or find out, for `take_step`."""

  def agreed(self, exchange: bool) -> bool:
    """Whether the processes agree to stop here (Preemption.agreed)."""

  def stop_requested(self) -> bool:
    """Whether the agreed stop is the run's own request: its lease is lost."""

  def wait_for_step(self) -> None:
    """The pending row and the skip flags (raises at the consecutive-skip limit)."""

  def evaluate(self, step: int) -> bool | None:
    """The evaluation (LoopEvaluation's answer), abandoned when a signal is agreed."""

  def save(self, decision: Decision) -> None:
    """Writes the metrics, then saves the step (saying `decision.saving`, `.notice`)."""

  def leave(self, decision: Decision) -> NoReturn:
    """lease.stop_without_lease, saving or waiting for the save as `decision.leave` says."""

  def report(self, decision: Decision) -> None:
    """The interrupted step's Progress and warning (`decision.report`)."""


def take_step(due: Due, io: StepIO) -> Decision:
  """What the step does after it was dispatched and its previous row read: `io` answers, in
  the order the step learns them, and acts. Every process makes the same `agreed` calls."""
  decision = decide(Known(due, signalled=io.agreed(exchange=due.exchange)))
  if decision.evaluate:
    io.wait_for_step()  # the alarm compares this step's row with the evaluation
    decision = decision.knowing(outcome=Outcome.of(io.evaluate(due.step)))
  if decision.save:
    io.wait_for_step()  # never a checkpoint after the skip limit was reached
    decision = decision.knowing(lease_lost=io.stop_requested())
    if decision.leave is not None:
      io.leave(decision)
    io.save(decision)
    decision = decision.knowing(saved=True)
    if decision.ask_after_save:  # a signal during the save: stop here
      decision = decision.knowing(signal_in_save=io.agreed(exchange=True))
  decision = decision.knowing(lease_lost=io.stop_requested())
  if decision.leave is not None:  # the lease was lost during the save
    io.leave(decision)
  if decision.interrupted:
    io.report(decision)
  return decision


def signal_at_the_end(signal: str, end: int) -> str:
  """The warning of a run that completed with a signal agreed during its last step or its
  save, which nothing stops (`signal` is its name)."""
  return (f"{signal} received during step {end}, the run's last, or its save: the checkpoint "
          "is saved and the run is complete")
