"""A run's record as history: which config revision produced each checkpoint (plain JSON, no
Fiddle, so `python -m olmo3.eval` and the launcher read it alike).

The launcher writes, in the workdir, revision 0 as `config.json` / `config.txt` /
`experiment.json` / `command.txt` at the first launch, and each later config revision n (a
resume with a resumable change, or one forced with --force_workdir) as `config.<n>.json` /
`config.<n>.txt` / `experiment.<n>.json`; no file of a revision is ever rewritten. Every launch
that trains appends one line to `history.jsonl`: its number, the revision it ran, the step it
resumed from, the revision's files and its command line. A launch that trains nothing (the
run is complete) writes nothing.

The rule: checkpoint step s was written by the last launch that started before it
(`start_step < s`). A launch that resumed at s or later did not write s, and one that resumed
before s wrote (or rewrote) it. `start_step` is the newest committed checkpoint when the launch
began; the one case the rule misreads is a launch whose newest checkpoint then proved damaged
(the trainer quarantines it and resumes earlier): the steps it rewrote up to the damaged one
are attributed to the launch before it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from etils import epath

HISTORY = "history.jsonl"


class RecordError(ValueError):
  """An unreadable run record. The message names the file (and line)."""


@dataclasses.dataclass(frozen=True)
class Launch:
  """One line of history.jsonl: a launch that trained."""

  launch: int  # 1, 2, ... in the order the launches started
  revision: int  # the config revision it ran (0: config.json)
  start_step: int  # the newest committed checkpoint when it started (0: none)
  config: str  # the revision's Fiddle config, relative to the workdir
  experiment: str  # the revision's plain Experiment JSON, relative to the workdir
  command: tuple[str, ...]  # its command line
  time: str  # when it started (UTC, ISO 8601)

  def to_json(self) -> str:
    return json.dumps({**dataclasses.asdict(self), "command": list(self.command)})


def revision_files(revision: int) -> tuple[str, str, str]:
  """(config, config text, experiment) file names of a revision."""
  if revision == 0:
    return "config.json", "config.txt", "experiment.json"
  return f"config.{revision}.json", f"config.{revision}.txt", f"experiment.{revision}.json"


def _launch(line: str, where: str) -> Launch:
  try:
    record: dict[str, Any] = json.loads(line)
    launch = Launch(**{**record, "command": tuple(record["command"])})
  except (ValueError, TypeError, KeyError) as e:
    raise RecordError(f"{where}: not a launch record ({type(e).__name__}: {e})") from None
  if not all(isinstance(getattr(launch, f), int) for f in ("launch", "revision", "start_step")):
    raise RecordError(f"{where}: launch, revision and start_step must be integers")
  return launch


def read_history(workdir: str | os.PathLike) -> list[Launch]:
  """The launches recorded in WORKDIR/history.jsonl, oldest first ([] when there is none: a
  run recorded before history existed, whose config.json is its only revision)."""
  path = epath.Path(workdir) / HISTORY
  if not path.exists():
    return []
  lines = path.read_text().splitlines()
  return [_launch(line, f"{path}:{i}") for i, line in enumerate(lines, start=1) if line.strip()]


def producer(history: list[Launch], step: int) -> Launch | None:
  """The launch that wrote checkpoint `step` (the module docstring's rule); None when the
  history names none (no history, or every launch started at or after `step`)."""
  found = None
  for launch in history:
    if launch.start_step < step:
      found = launch
  return found


def experiment_file(workdir: str | os.PathLike, step: int | None) -> epath.Path:
  """The plain Experiment JSON of the revision that produced checkpoint `step` (None: the
  latest launch's); experiment.json when the history names none."""
  history = read_history(workdir)
  launch = (history[-1] if history else None) if step is None else producer(history, step)
  return epath.Path(workdir) / (launch.experiment if launch else revision_files(0)[2])
