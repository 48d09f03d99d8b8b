"""What a launch says last: its run's closing summary (`olmo3.train.summary`'s lines, then the
commands to run next: the next stage, evaluation, sampling, export to Hugging Face), or where a
signal stopped it.

The next stage's command follows from what the launcher found in the experiment's module
(`NextStage`; this library imports no experiment): initialised from this run's workdir (unless
that stage's default already is it), on this run's data where the run was given other data than
its experiment's (a user's own corpus: the next stage's default is the embedded corpus or
AI2's), and, unless this run is its experiment's default (default workdir and data), in a
workdir of its own beside this run's: the next stage's default workdir may hold another run,
and a launch there would be refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import typing

from olmo3.config import DataConfig
from olmo3.data import sources
from olmo3.io import pathnames
from olmo3.run import record
from olmo3.run.plan import RunPlan
from olmo3.train.summary import RunSummary

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


def summary_lines(plan: RunPlan, next_stage: NextStage | None,
                  launch_seconds: float | None = None) -> list[str]:
  """What the run in plan.workdir came to, and the commands to run next; `launch_seconds`:
  this launch's wall time, when it trained."""
  workdir = plan.workdir.root
  quoted = shlex.quote(workdir)
  commands = []
  if next_stage is not None:
    commands.append(("next stage", next_stage_command(plan, next_stage)))
  commands += [("evaluate", f"python -m olmo3.eval --workdir {quoted}"),
               ("sample", f"python -m olmo3.sample --workdir {quoted} --prompt "
                          f"{shlex.quote(sources.sample_prompt(plan.exp.data))}"),
               ("export to HF", f"python -m olmo3.convert export-hf --ckpt {quoted} --out "
                                f"{shlex.quote(workdir.rstrip('/') + '-hf')}")]
  return RunSummary.read(workdir, plan.exp).lines(launch_seconds=launch_seconds,
                                                  next_commands=tuple(commands))


def next_stage_command(plan: RunPlan, stage: NextStage) -> str:
  """The command that trains `stage.following` from this run (the module docstring)."""
  workdir = plan.workdir.root
  command = [f"python launch/main.py --fdl_config={stage.module}:{stage.following}"]
  if stage.init_from is None or _key(stage.init_from) != _key(workdir):
    command.append(_assignment("checkpoint.init_from", workdir))
  given = [f for f in ("paths", "mix", "root", "tokenizer_id")
           if getattr(plan.exp.data, f) != getattr(stage.data, f)]
  command += [_assignment(f"data.{f}", getattr(plan.exp.data, f)) for f in given]
  if given or _key(workdir) != _key(record.default_workdir(stage.module, stage.function)):
    # runs/mine -> runs/mine.stage2; runs/x.stage1 -> runs/x.stage2
    base = workdir.rstrip("/")
    mine = (base[:-len(stage.function)] + stage.following
            if base.endswith(f".{stage.function}") else f"{base}.{stage.following}")
    command.append(f"--workdir={shlex.quote(mine)}")
  return " ".join(command)


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
