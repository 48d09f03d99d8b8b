"""What a run's end prints, owned here alone: the closing summary (`lines`: what the run came
to, then what to run next) that a launch prints when it finishes, when a finished run is
launched again, and that `--dry_run` of a finished run prints (olmo3.train.dry_run calls the
same `lines`), or the line a launch a signal stopped ends with (`interruption`).

What the run came to (`RunSummary`) comes from the workdir alone (metrics.jsonl, history.jsonl,
the committed checkpoints), so it is the same whichever launch prints it: the last training
loss, the last evaluation's held-out CE per set and each task's headline metric, the
generalization-gap alarm's state, the tokens trained on, the time spent, where the files are.

What to run next (`NextSteps`, data) follows from the plan and the next stage the launcher found
in the experiment's module (`NextStage`; this library imports no experiment): the next stage
(stage<n+1>), evaluation, sampling, export to Hugging Face. The next stage's command
initialises from this run's workdir (unless that stage's default already is it), trains on this
run's data where the run was given other data than its experiment's (a user's own corpus: the
next stage's default is the embedded corpus or AI2's), and, unless this run is its experiment's
default (default workdir and data), goes to a workdir of its own beside this run's: the next
stage's default workdir may hold another run, and a launch there would be refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import typing

from olmo3.config import DataConfig, Experiment
from olmo3.data import sources
from olmo3.eval import ruler_scores
from olmo3.eval.alarm import LONG_CONTEXT_METRIC as LONG_CONTEXT_ALARM
from olmo3.eval.alarm import METRIC as ALARM
from olmo3.eval.tasks import headline_of
from olmo3.io import checkpoint, metrics, pathnames
from olmo3.run import record
from olmo3.run.plan import RunPlan
from olmo3.run.record import Workdir, read_history
from olmo3.train.logs import duration

if typing.TYPE_CHECKING:
  from olmo3.train.loop import Progress


@dataclasses.dataclass(frozen=True)
class NextStage:
  """The stage after a run's, as the launcher found it: `module`:`function` is the run's
  experiment (stage<n>), `module`:`following` the next one (stage<n+1>)."""

  module: str
  function: str
  following: str
  init_from: str | None  # the next stage's checkpoint.init_from, as its experiment sets it
  data: DataConfig  # the run's experiment's data, without the run's own overrides


def following_function(function: str) -> str | None:
  """stage<n+1> of stage<n>: the name the next stage would have (None: `function` ends in no
  number)."""
  match = re.fullmatch(r"(.*?)(\d+)", function)
  return None if match is None else f"{match[1]}{int(match[2]) + 1}"


@dataclasses.dataclass(frozen=True)
class NextSteps:
  """What a user runs after the run in a plan's workdir (the module docstring), worked out once
  from the plan and the next stage the launcher found."""

  stage: str | None  # module:function of the next stage (None: the experiment has none)
  # The next stage's command, its overrides as facts: the checkpoint.init_from it sets (None:
  # its default already is this run), the data fields it carries over from this run, and its
  # workdir (None: the next stage's default).
  init_from: str | None
  data: tuple[tuple[str, typing.Any], ...]
  workdir: str | None
  commands: tuple[tuple[str, str], ...]  # (what, command) pairs, the next stage's first

  @classmethod
  def of(cls, plan: RunPlan, stage: NextStage | None) -> NextSteps:
    workdir = plan.workdir.root
    quoted = shlex.quote(workdir)
    chat = plan.train_files.conversations
    follow_ups = (("evaluate", f"python -m olmo3.eval --workdir {quoted}"),
                  ("sample", f"python -m olmo3.sample --workdir {quoted} "
                             + (f"--chat --prompt {shlex.quote(sources.CHAT_PROMPT)}" if chat else
                                f"--prompt {shlex.quote(sources.sample_prompt(plan.exp.data))}")),
                  ("export to HF", f"python -m olmo3.convert export-hf --ckpt {quoted} --out "
                                   f"{shlex.quote(workdir.rstrip('/') + '-hf')}"))
    if stage is None:
      return cls(None, None, (), None, follow_ups)
    init_from = (workdir if stage.init_from is None or _key(stage.init_from) != _key(workdir)
                 else None)
    data = tuple((f, getattr(plan.exp.data, f)) for f in ("paths", "mix", "root", "tokenizer_id")
                 if getattr(plan.exp.data, f) != getattr(stage.data, f))
    own = None
    if data or _key(workdir) != _key(record.default_workdir(stage.module, stage.function)):
      # runs/mine -> runs/mine.stage2; runs/x.stage1 -> runs/x.stage2
      base = workdir.rstrip("/")
      own = (base[:-len(stage.function)] + stage.following
             if base.endswith(f".{stage.function}") else f"{base}.{stage.following}")
    command = [f"python launch/main.py --fdl_config={stage.module}:{stage.following}"]
    if init_from is not None:
      command.append(_assignment("checkpoint.init_from", init_from))
    command += [_assignment(f"data.{f}", value) for f, value in data]
    if own is not None:
      command.append(f"--workdir={shlex.quote(own)}")
    return cls(f"{stage.module}:{stage.following}", init_from, data, own,
               (("next stage", " ".join(command)),) + follow_ups)


def lines(plan: RunPlan, next_stage: NextStage | None,
          launch_seconds: float | None = None) -> list[str]:
  """The closing summary of the run in plan.workdir: what it came to, and the commands to run
  next (`NextSteps`); `launch_seconds`: this launch's wall time, when it trained. The one
  rendering: a launch's end and a dry run of a finished run both print this."""
  steps = NextSteps.of(plan, next_stage)
  return RunSummary.read(plan.workdir.root, plan.exp, end=plan.end,
                        conversations=plan.train_files.conversations).lines(
                            launch_seconds=launch_seconds,
                                                            next_commands=steps.commands)


def interruption(plan: RunPlan, progress: Progress) -> str:
  """The last line of a launch a signal stopped (`progress.interrupted` is its step)."""
  step = progress.interrupted
  if progress.steps == 0:
    return (f"interrupted before step {step + 1}; nothing trained, nothing written; rerun the "
            f"same command to {'resume' if step else 'start'}")
  if step == plan.end:  # complete: the signal only cut its final evaluation short
    return (f"interrupted at step {step}, the last; saved; the run is complete but its final "
            f"evaluation did not run: python -m olmo3.eval --workdir {plan.workdir.root} "
            f"--step {step} scores it")
  return (f"interrupted at step {step}; saved; rerun the same command to resume"
          + (f" (step {step}'s evaluation did not run)" if progress.evaluation_skipped else ""))


def _assignment(path: str, value) -> str:
  """--fdl_set=path=value for a shell: in double quotes where the value holds nothing the
  shell reads there, so the Python literal's quotes reach the launcher."""
  assignment = f"--fdl_set={path}={value!r}"
  plain = re.fullmatch(r"[\w./:@,+'-]*", repr(value))
  return f'"{assignment}"' if plain else shlex.quote(assignment)


def _key(path: str) -> str:
  """A workdir as a comparable key (absolute, no trailing slash)."""
  return os.fspath(pathnames.absolute(path)).rstrip("/")


@dataclasses.dataclass(frozen=True)
class RunSummary:
  """What the run in a workdir came to, read from its files alone (the module docstring)."""

  workdir: str
  step: int  # the run's last logged step
  end: int  # the stage's last step
  launches: int
  train_loss: tuple[int, float] | None  # (step, loss) of the last row with a loss
  heldout: tuple[int, dict[str, float]] | None  # (step, {set: CE}) of the last evaluation
  # {set: {band: CE}} of that evaluation, per band of positions (eval.position_band)
  bands: dict[str, dict[str, float]]
  tasks: tuple[int, dict[str, tuple[str, float]]] | None  # (step, {task: (metric, value)})
  evaluations: int  # held-out evaluations the alarm watched
  alarm_fired: int | None  # the first step it fired at
  tokens: int
  step_seconds: float  # the logged steps' time, every launch (evaluations, compiles excluded)
  checkpoint: str | None  # the newest committed step's directory
  conversations: bool = False  # chat data: its held-out CE is over the assistant's tokens
  ruler: tuple[int, dict[int, float]] | None = None  # (step, {length: mean}) of the last RULER
  long_context_fired: int | None = None  # the first step the long-context alarm fired at

  @classmethod
  def read(cls, workdir: str, exp: Experiment, end: int | None = None,
           conversations: bool = False) -> RunSummary:
    """The summary of the run in `workdir`, trained by `exp` (its batch, cadence; its stage end
    unless `end`, the plan's, is given: a stage of epochs ends where its data does)."""
    files = Workdir(workdir)
    rows = metrics.read_jsonl(files.metrics) if files.metrics.exists() else []
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    scored = [r for r in rows if any(k.startswith("downstream/") for k in r)]
    step_seconds, previous = 0.0, 0
    for r in train:  # a row's step time is the mean over the steps since the row before it
      step_seconds += r.get("step_time_s", 0.0) * max(1, r["step"] - previous)
      previous = r["step"]
    fired = [r["step"] for r in rows if r.get(ALARM)]
    lost = [r["step"] for r in rows if r.get(LONG_CONTEXT_ALARM)]
    rulers = [r for r in rows if ruler_scores.means(r)]
    committed = checkpoint.run_steps(files.checkpoints)
    step = max((r["step"] for r in rows), default=0)
    return cls(
        workdir=workdir, step=step, end=exp.train.steps if end is None else end,
        launches=len(read_history(workdir)),
        train_loss=(train[-1]["step"], train[-1]["loss"]) if train else None,
        heldout=(evals[-1]["step"], {k[5:-8]: v for k, v in evals[-1].items()
                                     if k.startswith("eval/") and k.endswith("/ce_loss")}
                 ) if evals else None,
        bands=_bands(evals[-1]) if evals else {},
        tasks=(scored[-1]["step"], _headlines(scored[-1])) if scored else None,
        evaluations=sum(ALARM in r for r in rows), alarm_fired=fired[0] if fired else None,
        tokens=step * exp.tokens_per_step, step_seconds=step_seconds,
        checkpoint=(pathnames.join(str(files.checkpoints), str(committed[-1]))
                    if committed else None), conversations=conversations,
        ruler=(rulers[-1]["step"], ruler_scores.means(rulers[-1])) if rulers else None,
        long_context_fired=lost[0] if lost else None)

  def lines(self, *, launch_seconds: float | None = None,
            next_commands: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """The summary as lines for people; `launch_seconds`: this launch's wall time, when it
    trained; `next_commands`: (what, command) pairs."""
    state = "complete" if self.step >= self.end else f"stopped at step {self.step} of {self.end}"
    out = [f"run {state}: {self.workdir} ({self.launches} launch"
           f"{'es' * (self.launches != 1)})"]
    if self.train_loss:
      out.append(f"  train loss      {self.train_loss[1]:.4f} (step {self.train_loss[0]})")
    if self.heldout:
      step, sets = self.heldout
      shown = ", ".join(f"{name} {ce:.4f}" for name, ce in sorted(sets.items()))
      over = "the assistant's tokens, " if self.conversations else ""
      out.append(f"  held-out CE     {shown} ({over}step {step})")
      for name, bands in sorted(self.bands.items()):
        out.append(f"  by position     {name}: " + ", ".join(
            f"{band} {ce:.4f}" for band, ce in bands.items()))
    else:
      out.append("  held-out CE     none: the run evaluated no held-out set")
    if self.tasks:
      step, tasks = self.tasks
      shown = [f"{name} {metric} {value:.4f}" for name, (metric, value) in sorted(tasks.items())]
      shown[-1] += f" (step {step})"
      lines = [[]]  # a task per item, as many as fit in 100 characters per line
      for item in shown:
        if lines[-1] and len(", ".join(lines[-1] + [item])) > 100 - 18:
          lines.append([])
        lines[-1].append(item)
      out += [("  tasks           " if i == 0 else " " * 18) + ", ".join(items)
              + ("," if i < len(lines) - 1 else "") for i, items in enumerate(lines)]
    if self.alarm_fired is not None:
      out.append(f"  alarm           FIRED at step {self.alarm_fired}: train loss fell while "
                 "held-out loss did not (the log and metrics.jsonl say on what)")
    elif self.evaluations:
      out.append(f"  alarm           quiet over {self.evaluations} evaluation"
                 f"{'s' * (self.evaluations != 1)}")
    else:
      out.append("  alarm           off: without held-out evaluations it cannot fire")
    if self.ruler:
      step, means = self.ruler
      out.append("  RULER           " + ", ".join(f"{n} {100 * v:.1f}" for n, v in sorted(
          means.items())) + f" (mean over its tasks, step {step})")
      reference = {n: v for n, v in ruler_scores.AI2_OLMO3_7B.items() if n in means}
      if reference:
        out.append(" " * 18 + "AI2's OLMo 3 7B: " + ", ".join(
            f"{n} {100 * v:.1f}" for n, v in sorted(reference.items())))
      if self.long_context_fired is not None:
        out.append(f"  long context    alarm FIRED at step {self.long_context_fired}: RULER fell "
                   "at the longest length while the shortest held")
    out.append(f"  tokens          {self.tokens:,} ({self.step:,} steps)")
    spent = f"training steps {duration(self.step_seconds)}"
    if launch_seconds is not None:
      spent = f"{duration(launch_seconds)} this launch; {spent} over all launches"
    out.append(f"  time            {spent}")
    out.append(f"  checkpoint      {self.checkpoint or 'none committed'}")
    files = Workdir(self.workdir)
    out.append(f"  metrics         {files.metrics} (TensorBoard: "
               f"{pathnames.join(self.workdir, metrics.TENSORBOARD)})")
    if next_commands:
      out.append("next:")
      width = max(len(what) for what, _ in next_commands)
      out += [f"  {what.ljust(width)}  {command}" for what, command in next_commands]
    return out


def _headlines(row: dict[str, float]) -> dict[str, tuple[str, float]]:
  by_task: dict[str, dict[str, float]] = {}
  for key, value in row.items():
    if key.startswith("downstream/"):
      _, task, name = key.split("/", 2)
      by_task.setdefault(task, {})[name] = value
  out = {}
  for task, values in by_task.items():
    name = headline_of(set(values))
    if name is not None:
      out[task] = (name, values[name])
  return out


def _bands(row: dict) -> dict[str, dict[str, float]]:
  """{set: {"a-b": CE}} of an evaluation row's per-position-band CE (eval/<set>/ce_loss_posA_B),
  in position order."""
  out: dict[str, dict[str, float]] = {}
  for key, value in row.items():
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "eval" and parts[2].startswith("ce_loss_pos"):
      start, end = parts[2][len("ce_loss_pos"):].split("_")
      out.setdefault(parts[1], {})[(int(start), int(end))] = value
  return {name: {f"{a}-{b}": ce for (a, b), ce in sorted(bands.items())}
          for name, bands in out.items()}
