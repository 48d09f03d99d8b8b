"""A run's workdir: its file names, the run-name convention, and the record as history (which
config revision produced each checkpoint), in plain JSON: no Fiddle, so `python -m
olmo3.eval` and the launcher read it alike.

The launcher writes revision 0 as `config.json` / `config.txt` / `experiment.json` /
`command.txt` at the first launch, and each later config revision n (a resume with a
resumable change, or one forced with --force_workdir) as `config.<n>.json` / `config.<n>.txt`
/ `experiment.<n>.json`; no file of a revision is ever rewritten. Every launch that trains
appends one line to `history.jsonl`: its number, the revision it ran, the step it resumed
from, the revision's files, its command line and its plan's summary (where it started, the
stage's end, the data's size). A launch that trains nothing (the run is
complete) writes nothing. A run trained without the launcher (`olmo3.train.loop.train`) has
`experiment.json` alone (`write_experiment`).

The rule: checkpoint step s was written by the last launch that started before it
(`start_step < s`). A launch that resumed at s or later did not write s, and one that resumed
before s wrote (or rewrote) it. `start_step` is the newest committed checkpoint when the launch
began; the one case the rule misreads is a launch whose newest checkpoint then proved damaged
(the trainer quarantines it and resumes earlier): the steps it rewrote up to the damaged one
are attributed to the launch before it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any, Callable

from absl import logging
from etils import epath

from olmo3.io import pathnames, storage

RUNS = "runs"  # where a run's workdir goes by default (relative to the working directory)
OLMO_CORE_IMPORT = "olmo_core_import"  # in a workdir: the converted OLMo-core init_from
LEASE = "lease.json"  # in a workdir: who holds it (olmo3.run.lease)


def default_workdir(module: str, function: str) -> str:
  """The run-name convention: runs/<last part of the module>.<function>
  (experiments.olmo3_tiny, stage1 -> runs/olmo3_tiny.stage1)."""
  return os.path.join(RUNS, f"{module.rsplit('.', 1)[-1]}.{function}")


def workdir_of(experiment: Callable[..., Any]) -> str:
  """The default workdir of an experiment function (what its stage 2 initialises from)."""
  return default_workdir(experiment.__module__, experiment.__name__)


def named_by_convention(workdir: str | os.PathLike) -> tuple[str, str] | None:
  """(module's last part, function) when `workdir`'s name follows the convention."""
  module, _, function = epath.Path(workdir).name.rpartition(".")
  return (module, function) if module and function else None


@dataclasses.dataclass(frozen=True)
class Workdir:
  """The files of a run's workdir (a local path or a gs:// / s3:// URL)."""

  root: str

  def path(self, name: str) -> epath.Path:
    return epath.Path(self.root) / name

  @property
  def checkpoints(self) -> epath.Path:
    return self.path("checkpoints")

  @property
  def olmo_core_import(self) -> str:
    """Where an OLMo-core checkpoint that checkpoint.init_from names is converted, once: a
    launch that finds it there reads it (olmo3.train.state)."""
    return pathnames.join(self.root, OLMO_CORE_IMPORT)

  @property
  def file_sizes(self) -> str:
    """The remote token files' sizes and versions the run trained on, checked again at every
    launch (olmo3.io.file_sizes.SizeCache)."""
    return pathnames.join(self.root, "file_sizes.json")

  @property
  def kept_order(self) -> str | None:
    """Where a run in a bucket keeps its epochs' global orders (olmo3.data.order.KeptOrder), so
    that a host new to the run reads them instead of computing them; None for a workdir on a
    disk (the machine's own kept order is as near)."""
    return pathnames.join(self.root, "order") if pathnames.is_url(self.root) else None

  @property
  def history(self) -> epath.Path:
    return self.path("history.jsonl")

  @property
  def overlap(self) -> epath.Path:
    """How much of the run's held-out sets and task documents its training data holds, as
    `launch/audit.py --overlap` last measured it (olmo3.data.overlap)."""
    return self.path("overlap.json")

  @property
  def lease(self) -> epath.Path:
    return self.path(LEASE)

  @property
  def metrics(self) -> epath.Path:
    return self.path("metrics.jsonl")

  def listing(self) -> set[str]:
    """The workdir's entries, and those of its directories but checkpoints/ (paths relative
    to the workdir; empty when there is no workdir): what a launch compares with to take back
    what it added (`RunRecord.undo`). Inside checkpoints/ a launch that trained nothing adds
    nothing of its own; it may set a damaged step aside there, which must stay. A converted
    OLMo-core checkpoint stays too (committed whole, as checkpoints are): converting it again
    would cost its download."""
    root = epath.Path(self.root)
    if not root.exists():
      return set()
    found = set()
    for entry in root.iterdir():
      if entry.name == OLMO_CORE_IMPORT:
        continue
      found.add(entry.name)
      if entry.name != "checkpoints" and entry.is_dir():
        found.update(f"{entry.name}/{child.name}" for child in entry.iterdir())
    return found


def _lease_file(name: str) -> bool:
  """lease.json and its temporaries (olmo3.io.conditional's): the lease's own, which only the
  lease removes."""
  return name == LEASE or name.startswith(f"{LEASE}.")


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
  plan: dict[str, Any] = dataclasses.field(default_factory=dict)  # RunPlan.summary()

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


SET_ASIDE = ".set-aside"  # history.jsonl.set-aside: lines no launch record, as metrics.jsonl's


def _read_history(path: epath.Path) -> tuple[list[Launch], list[str], str | None]:
  """(the launches of a history file, oldest first; its lines that are no launch record, each
  logged with its number and why; its text, None when there is none)."""
  if not path.exists():
    return [], [], None
  text = path.read_bytes().decode(errors="replace")
  launches, garbled = [], []
  for number, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      launches.append(_launch(line, f"{path}:{number}"))
    except RecordError as e:
      garbled.append(line)
      logging.warning("%s; skipped (the next launch sets it aside in %s%s)", e, path.name,
                      SET_ASIDE)
  return launches, garbled, text


def read_history(workdir: str | os.PathLike) -> list[Launch]:
  """The launches recorded in WORKDIR/history.jsonl, oldest first ([] when there is none). A
  line that is no launch record (cut short, edited) is skipped with a warning, as metrics.jsonl's
  are, rather than blocking every tool and resume until edited by hand; the checkpoints of the
  launch it recorded are then attributed to the launch before it."""
  return _read_history(Workdir(os.fspath(workdir)).history)[0]


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
  return Workdir(os.fspath(workdir)).path(launch.experiment if launch else revision_files(0)[2])


def experiment_json(experiment: dict[str, Any]) -> str:
  """The bytes of an experiment file (Experiment.to_dict): one writer, one format."""
  return json.dumps(experiment, indent=1)


def _write(path: epath.Path, text: str) -> None:
  """Writes a record file whole or not at all. Synced: the record is the history later launches
  trust unchecked (which revision wrote which checkpoint), written once or twice a launch."""
  storage.write_bytes_atomic(path, text.encode(), durability=storage.Durability.SYNCED)


def write_experiment(workdir: str, experiment: dict[str, Any]) -> None:
  """experiment.json for a run trained without the launcher's record (which writes each
  revision's own file): written only where none is, never rewritten."""
  path = Workdir(workdir).path(revision_files(0)[2])
  if not path.exists():
    _write(path, experiment_json(experiment))


class RunRecord:
  """A workdir's run record: `begin` writes this launch's revision (if its config is new) and
  history line, `undo` takes back what `begin` wrote and everything else the launch added to
  the workdir since (a launch that stops before its first step leaves the workdir as it found
  it). Both run only while the launch holds the workdir's lease (olmo3.run.lease, taken before
  `begin`): then no other launch writes there, so what the workdir gained is this launch's
  alone. The config files' texts come from the launcher (Fiddle lives there): this class only
  lays them out."""

  def __init__(self, workdir: str):
    self.workdir = Workdir(workdir)
    self._written: list[epath.Path] = []
    self._history_before: str | None = None
    self._found: set[str] | None = None  # the workdir's listing when `begin` started
    self._import_found = False  # and whether it held a converted OLMo-core checkpoint

  def history(self) -> list[Launch]:
    """The recorded launches; a workdir holding config.json without a history (lost, or
    written by hand) reads as one launch of revision 0 from step 0, so its config is still
    the one a resume is checked against."""
    return self._or_config_alone(read_history(self.workdir.root))

  def _or_config_alone(self, history: list[Launch]) -> list[Launch]:
    """`history`; when it is empty beside revision 0's config, the one launch that implies."""
    if history or not self.workdir.path(revision_files(0)[0]).exists():
      return history
    config, _, experiment = revision_files(0)
    return [Launch(1, 0, 0, config, experiment, (), "")]

  def latest_config(self) -> epath.Path | None:
    """The latest revision's config file (None: no run recorded here)."""
    history = self.history()
    return self.workdir.path(history[-1].config) if history else None

  def begin(self, new_config: dict[str, str] | None, experiment: dict[str, Any],
            argv: list[str], start_step: int, plan: dict[str, Any] | None = None) -> Launch:
    """Records a launch that is about to train from `start_step`. `new_config` is None when
    the config equals the latest revision's, else {"json": ..., "text": ...}: the config as
    Fiddle serializes and prints it, written as a new revision (never rewriting an earlier
    one). `experiment` is the plain Experiment (Experiment.to_dict) the run executes, `plan`
    what the launch worked out (olmo3.run.plan.RunPlan.summary), kept in its history line."""
    self._found = self.workdir.listing()
    self._import_found = self.workdir.path(OLMO_CORE_IMPORT).exists()
    epath.Path(self.workdir.root).mkdir(parents=True, exist_ok=True)
    # One read gives the launches, the lines to set aside and the text `undo` restores.
    path = self.workdir.history
    history, garbled, self._history_before = _read_history(path)
    history = self._or_config_alone(history)
    revision = history[-1].revision if history else 0
    if not history or new_config is not None:
      if new_config is None:
        raise ValueError("the first launch of a run records its config")
      revision = (max(h.revision for h in history) + 1) if history else 0
      config, text, exp_file = revision_files(revision)
      files = [(config, new_config["json"] + "\n"), (text, new_config["text"] + "\n"),
               (exp_file, experiment_json(experiment))]
      if revision == 0:
        files.append(("command.txt", " ".join(argv) + "\n"))
      for name, body in files:
        _write(self.workdir.path(name), body)
        self._written.append(self.workdir.path(name))
    config, _, exp_file = revision_files(revision)
    launch = Launch(
        len(history) + 1, revision, start_step, config, exp_file, tuple(argv),
        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), plan or {})
    if garbled:  # kept beside it, never deleted: the history is rewritten without them
      aside = path.parent / (path.name + SET_ASIDE)
      before = aside.read_text() if aside.exists() else ""
      _write(aside, before + "".join(line + "\n" for line in garbled))
    # Object stores cannot append: the file is rewritten with every earlier line as it was.
    lines = "".join(h.to_json() + "\n" for h in history)
    _write(path, lines + launch.to_json() + "\n")
    self._written.append(path)
    return launch

  def undo(self) -> None:
    """Removes what `begin` wrote (the history as it was before) and every entry the workdir
    gained since `begin` started (`Workdir.listing`: the trainer's event file, metrics.jsonl,
    an empty checkpoints/, ...), for a launch that trained nothing; in a workdir that held
    nothing but this launch's lease then, a converted OLMo-core checkpoint too. Only while
    the launch still holds the lease it took before `begin` (the caller proves it just
    before): then all of that is its own. The lease's own files are left to the lease, which
    removes them last (its release). Files it rewrote keep their new contents (metrics.jsonl
    without the rows after the newest checkpoint, which any resume drops)."""
    path = self.workdir.history
    for written in reversed(self._written):
      if written == path and self._history_before is not None:
        _write(path, self._history_before)
      else:
        written.unlink(missing_ok=True)
    if self._found is not None:
      gained = {name for name in self.workdir.listing() - self._found if not _lease_file(name)}
      if not any(not _lease_file(name) for name in self._found) and not self._import_found:
        gained.add(OLMO_CORE_IMPORT)  # a new workdir: converted by this launch, if it is there
      for name in sorted(gained, reverse=True):  # children first
        entry = self.workdir.path(name)
        if entry.is_dir():
          entry.rmtree(missing_ok=True)
        else:
          entry.unlink(missing_ok=True)
    self._written, self._history_before, self._found = [], None, None
    self._import_found = False
