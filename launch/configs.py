"""Experiment references, overrides, run records and diffs: what the launch scripts share.

A reference is `package.module:function` (or the dotted `package.module.function`) naming a
no-argument function that returns fdl.Config[Experiment]. Overrides are `path=value` with a
Python literal value (strings quoted), as Fiddle's own flags take them; fiddlers are functions
of the config in the experiment's module (`name`, `name(arg=1)`) or given as `module:function`.
A sweep is a function returning a list of override dicts ({"model.remat": "full", ...}).

Nothing here touches sys.path: `olmo3`, `experiments` and `launch` import because
`pip install -e .` installs them, and each launch script's entry point calls
`make_cwd_importable()` once so a user's own module in the working directory imports too.

A run's config.json never runs code: every symbol it names is checked against an allow-list
(`check_symbols`) before Fiddle deserializes anything, and Fiddle then imports with a policy
that rechecks each one (`_Policy`).
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import difflib
import enum
import importlib
import inspect
import json
import os
import pkgutil
import re
import sys
import typing
from typing import Any

import fiddle as fdl
from etils import epath
from fiddle import daglish, diffing, printing
from fiddle._src import config as config_lib
from fiddle.experimental import serialization

# `experiments` is imported here, before any launch script calls make_cwd_importable, so the
# installed package (not an `experiments` directory in the working directory) is the one a
# config.json's references resolve in; `olmo3` is imported just below for the same reason.
import experiments  # noqa: F401
from olmo3.config import resumable_fields
from olmo3.eval import revisions

# What a config.json may name: the config classes and enums of these modules (an experiment is
# a tree of them; a function, which building would call, is never needed)...
ALLOWED_MODULES = ("olmo3.config", "olmo3.remat")
# ... and exactly these, which Fiddle's format itself needs (fdl.Config, its traverser
# metadata, the containers it rebuilds).
ALLOWED_SYMBOLS = {("builtins", "tuple"): tuple, ("builtins", "list"): list,
                   ("builtins", "dict"): dict, ("fiddle._src.config", "Config"): fdl.Config,
                   ("fiddle._src.config", "BuildableTraverserMetadata"):
                       config_lib.BuildableTraverserMetadata}


def usage_error(message: str, script: str) -> typing.NoReturn:
  """A command-line mistake: its one line, then where the flags are described (not the whole
  --help, which would bury it). `script` is the program's path as a user types it."""
  sys.exit(f"error: {message}\nRun 'python {script} --help' for the flags.")


class ConfigRefError(ValueError):
  """A bad experiment reference, override or fiddler. The message names it."""


def split_ref(ref: str) -> tuple[str, str]:
  if ":" in ref:
    module, _, name = ref.partition(":")
  else:
    module, _, name = ref.rpartition(".")
  if not module or not name:
    raise ConfigRefError(f"--fdl_config={ref!r}: expected 'package.module:function'")
  return module, name


def make_cwd_importable() -> None:
  """Appends the working directory to sys.path.

  The one place the launch scripts change sys.path; each script's entry point calls it (library
  functions never do). `python launch/X.py` puts launch/ on sys.path, not the directory it is run
  from, so without this a user's own experiment, fiddler or sweep module there
  (`--fdl_config=my_exp:stage1`) would not import. Appended, not put first: a file in the
  working directory never shadows the standard library or an installed package. `olmo3`,
  `experiments` and `launch` need no path at all: `pip install -e .` installs them.
  """
  cwd = os.getcwd()
  if cwd not in sys.path:
    sys.path.append(cwd)


def experiment_modules() -> list[str]:
  """The modules of the `experiments` package that define experiments (what a misspelt
  reference is told exists)."""
  names = [f"experiments.{m.name}" for m in pkgutil.iter_modules(experiments.__path__)]
  return sorted(n for n in names if module_functions(importlib.import_module(n), Kind.EXPERIMENT))


class Kind(enum.Enum):
  """What a function named on the command line must be."""

  EXPERIMENT = "experiment"  # no arguments -> fdl.Config[Experiment]
  FIDDLER = "fiddler"  # (cfg, **options) -> the config
  SWEEP = "sweep"  # no arguments -> list of override dicts


def module_functions(module: Any, kind: Kind) -> list[str]:
  """The functions of `module` that can serve as `kind` (what a misspelt name is told exists):
  public, defined there, taking the arguments `kind` passes and, where annotated, returning
  what it needs (a config, or a list for a sweep)."""
  found = []
  for name, fn in vars(module).items():
    if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__:
      continue
    try:
      params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
      continue
    required = [p for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    returns = str(fn.__annotations__.get("return", ""))
    if kind is Kind.FIDDLER:
      fits = len(required) == 1
    else:
      fits = not required and (not returns or (returns.startswith("list") == (
          kind is Kind.SWEEP)))
    if fits:
      found.append(name)
  return sorted(found)


def _suggest(name: str, valid: list[str], what: str) -> str:
  """'did you mean X? <what>: A, B' (the closest valid name, and all of them)."""
  close = difflib.get_close_matches(name, valid, n=1)
  return (f"did you mean {close[0]!r}? " if close else "") + (
      f"{what}: {', '.join(valid)}" if valid else f"it defines no {what}")


def import_module(module: str, what: str):
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    if e.name is not None and module != e.name and not module.startswith(f"{e.name}."):
      # The module exists but imports something missing: that is its own error.
      raise ConfigRefError(f"{what}: importing {module!r} failed: {e}") from None
    raise ConfigRefError(f"{what}: no module {module!r}; "
                         + _suggest(module, experiment_modules(), "experiment modules")) from None


def load(ref: str) -> fdl.Config:
  """The config an experiment reference builds (module:function or module.function)."""
  module_name, name = split_ref(ref)
  module = import_module(module_name, f"--fdl_config={ref!r}")
  fn = getattr(module, name, None)
  if not callable(fn):
    raise ConfigRefError(f"--fdl_config={ref!r}: {module_name} has no experiment {name!r}; "
                         + _suggest(name, module_functions(module, Kind.EXPERIMENT), "experiments"))
  cfg = fn()
  if not isinstance(cfg, fdl.Buildable):
    raise ConfigRefError(f"--fdl_config={ref!r}: {name}() returned {type(cfg).__name__}, "
                         "not a fdl.Config")
  return cfg


def apply_fiddler(cfg: fdl.Config, spec: str, default_module: str) -> fdl.Config:
  """`name`, `name(k=v, ...)`, or `module:name(...)`: calls fn(cfg, **kwargs)."""
  match = re.fullmatch(r"\s*([\w.:]+)\s*(?:\((.*)\))?\s*", spec)
  if not match:
    raise ConfigRefError(f"--fiddler={spec!r}: expected 'name' or 'name(key=value, ...)'")
  target, args = match.groups()
  module_name, name = target.split(":") if ":" in target else (default_module, target)
  module = import_module(module_name, f"--fiddler={spec!r}")
  fn = getattr(module, name, None)
  if not callable(fn):
    raise ConfigRefError(f"--fiddler={spec!r}: {module_name} has no fiddler {name!r}; "
                         + _suggest(name, module_functions(module, Kind.FIDDLER), "fiddlers"))
  kwargs = {}
  if args:
    call = ast.parse(f"f({args})", mode="eval").body
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
  return fn(cfg, **kwargs) or cfg


def set_field(cfg: fdl.Buildable, path: str, value: Any, where: str | None = None) -> None:
  """Sets `a.b.c` to `value`: each of a, a.b is a config and c is one of its fields, or
  ConfigRefError names the path (`where` prefixes the message; default the path itself)."""
  where = where or repr(path)
  names = path.strip().split(".")
  if not all(n.isidentifier() for n in names):
    raise ConfigRefError(f"{where}: {path!r} is not a dotted field path")
  *parents, leaf = names
  node = cfg
  for i, name in enumerate(parents):
    node = getattr(node, name, None)
    if not isinstance(node, fdl.Buildable):
      raise ConfigRefError(f"{where}: {'.'.join(parents[:i + 1])} is not a config "
                           f"(setting {path})")
  fn = fdl.get_callable(node)
  if dataclasses.is_dataclass(fn):
    fields = {f.name for f in dataclasses.fields(fn) if f.init}
    if leaf not in fields:
      raise ConfigRefError(f"{where}: {fn.__name__} has no field {leaf!r} "
                           f"(fields: {', '.join(sorted(fields))})")
  try:
    setattr(node, leaf, value)
  except (AttributeError, TypeError) as e:  # Fiddle checks the callable's own parameters
    raise ConfigRefError(f"{where}: {e}") from None


def apply_set(cfg: fdl.Config, assignment: str) -> None:
  """`a.b.c=value`: sets the field; the value is a Python literal ('"text"' for strings)."""
  path, sep, text = assignment.partition("=")
  if not sep or not path.strip():
    raise ConfigRefError(f"--fdl_set={assignment!r}: expected 'path=value'")
  try:
    value = ast.literal_eval(text.strip())
  except (ValueError, SyntaxError):
    raise ConfigRefError(f"--fdl_set={assignment!r}: {text!r} is not a Python literal "
                         "(quote strings: path='\"text\"')") from None
  set_field(cfg, path, value, f"--fdl_set={assignment!r}")


def resolve(ref: str, sets: list[str] = (), fiddlers: list[str] = ()) -> fdl.Config:
  cfg = load(ref)
  module_name, _ = split_ref(ref)
  for spec in fiddlers:
    cfg = apply_fiddler(cfg, spec, module_name)
  for assignment in sets:
    apply_set(cfg, assignment)
  return cfg


def message(error: BaseException) -> str:
  """An error's own message. Fiddle appends to an error raised while building a config the
  call's arguments (every field of the class), which buries the one line naming the field."""
  return str(getattr(error, "proxy_base_exception", error))


def load_sweep(ref: str) -> list[dict[str, Any]]:
  """The variants a sweep reference (module:function) returns: a list of override dicts."""
  module, name = split_ref(ref)
  found = import_module(module, f"--sweep={ref!r}")
  fn = getattr(found, name, None)
  if not callable(fn):
    raise ConfigRefError(f"--sweep={ref!r}: {module} has no sweep {name!r}; "
                         + _suggest(name, module_functions(found, Kind.SWEEP), "sweeps"))
  return list(fn())


def variant_name(overrides: dict[str, Any]) -> str:
  """A sweep variant's name (its row in results.csv; `launch/sweep.py --variant NAME`)."""
  def short(v):
    if isinstance(v, (tuple, list)):
      return "on" if v else "off"
    return str(getattr(v, "value", v))

  return ",".join(f"{k}={short(v)}" for k, v in overrides.items())


# --- run records ---------------------------------------------------------------------------


def dump(cfg: fdl.Config) -> str:
  return serialization.dump_json(cfg, indent=2)


def _allowed(module: Any, name: Any) -> bool:
  """Whether a config.json may name `name` in `module` (before anything is imported)."""
  if not (isinstance(module, str) and isinstance(name, str)):
    return False
  if (module, name) in ALLOWED_SYMBOLS:
    return True
  # Public names only: a private or dunder attribute (`__class__`, `_x`) could lead anywhere.
  return module in ALLOWED_MODULES and all(p.isidentifier() and not p.startswith("_")
                                           for p in name.split("."))


def check_symbols(tree: Any, where: str) -> None:
  """Every module and name a parsed config.json references is allowed, or ConfigRefError
  names it. Fiddle reads a reference from any object holding "module"/"name" keys (a "pyref");
  checking every object with either key, anywhere in the tree, misses none."""
  stack = [tree]
  while stack:
    node = stack.pop()
    if isinstance(node, dict):
      if "module" in node or "name" in node or node.get("type") == "pyref":
        module, name = node.get("module"), node.get("name")
        if not _allowed(module, name):
          raise ConfigRefError(
              f"{where}: refers to module {module!r}, name {name!r}, which a config may not "
              f"name (only the classes and enums of {' and '.join(ALLOWED_MODULES)}, and the "
              "containers Fiddle's format needs); "
              "nothing was imported")
      stack.extend(node.values())
    elif isinstance(node, list):
      stack.extend(node)


class _Policy(serialization.PyrefPolicy):
  """Fiddle's check at import time, after check_symbols: the same allow-list, and the imported
  value must be one of the exact symbols or a class or enum member defined in an allowed module
  (an allowed module's attribute could be something it imported from elsewhere)."""

  def allows_import(self, module: str, symbol: str) -> bool:
    return _allowed(module, symbol)

  def allows_value(self, value: Any) -> bool:
    if any(value is v for v in ALLOWED_SYMBOLS.values()):
      return True
    home = getattr(type(value) if isinstance(value, enum.Enum) else value, "__module__", None)
    return isinstance(value, (type, enum.Enum)) and home in ALLOWED_MODULES


def loads(text: str, where: str = "config.json") -> fdl.Config:
  """Loads a serialized config. Every symbol it names is checked before anything is imported;
  Fiddle deserializes the very tree that was checked (re-encoded), so no parser difference
  (spacing, escapes, a key given twice) can slip a name past the check."""
  try:
    tree = json.loads(text)
  except (ValueError, RecursionError) as e:
    raise ConfigRefError(f"{where}: not JSON ({e})") from None
  check_symbols(tree, where)
  try:
    return serialization.load_json(json.dumps(tree), pyref_policy=_Policy())
  except serialization.PyrefPolicyError as e:
    raise ConfigRefError(f"{where}: refers to {e.module}.{e.symbol}, which is not a class or "
                         f"enum member of {' or '.join(ALLOWED_MODULES)}") from None
  except Exception as e:  # a malformed tree: Fiddle raises KeyError, TypeError, ...
    raise ConfigRefError(f"{where}: not a loadable config ({type(e).__name__}: {e})") from None


def _write(path: epath.Path, text: str) -> None:
  """Writes a record file whole or not at all: a temporary beside it, then renamed."""
  tmp = path.parent / f".{path.name}.tmp"
  tmp.write_text(text)
  tmp.replace(path)


class RunRecord:
  """A workdir's run record (olmo3.eval.revisions has the layout and the rule): `begin` writes
  this launch's revision (if its config is new) and history line, `undo` removes exactly what
  `begin` wrote (a launch that stops before its first step leaves nothing behind)."""

  def __init__(self, workdir: str | os.PathLike):
    self.workdir = epath.Path(workdir)
    self._written: list[epath.Path] = []
    self._history_before: str | None = None

  def history(self) -> list[revisions.Launch]:
    """The recorded launches; a run recorded before history.jsonl existed reads as one launch
    of revision 0 from step 0 (its command.txt)."""
    try:
      history = revisions.read_history(self.workdir)
    except revisions.RecordError as e:
      raise ConfigRefError(str(e)) from None
    if history or not (self.workdir / "config.json").exists():
      return history
    command = self.workdir / "command.txt"
    config, _, experiment = revisions.revision_files(0)
    return [revisions.Launch(1, 0, 0, config, experiment,
                             tuple(command.read_text().split()) if command.exists() else (), "")]

  def latest(self) -> fdl.Config | None:
    """The config of the latest revision (None: no run recorded here)."""
    history = self.history()
    return read_config(self.workdir / history[-1].config) if history else None

  def begin(self, cfg: fdl.Config, experiment: dict[str, Any], argv: list[str],
            start_step: int) -> revisions.Launch:
    """Records a launch that is about to train from `start_step`: a new revision when `cfg`
    differs from the latest one (never rewriting an earlier revision), and its history line.
    `experiment` is the plain Experiment (Experiment.to_dict) the run executes."""
    self.workdir.mkdir(parents=True, exist_ok=True)
    history = self.history()
    previous = read_config(self.workdir / history[-1].config) if history else None
    revision = history[-1].revision if history else 0
    if previous is None or diff(previous, cfg):
      revision = (max(h.revision for h in history) + 1) if history else 0
      config, text, exp_file = revisions.revision_files(revision)
      files = [(config, dump(cfg)), (text, printing.as_str_flattened(cfg)),
               (exp_file, json.dumps(experiment, indent=1))]
      if revision == 0:
        files.append(("command.txt", " ".join(argv)))
      for name, body in files:
        # experiment.json as olmo3.train.loop writes it (no newline): one set of bytes.
        _write(self.workdir / name, body if name == exp_file else body + "\n")
        self._written.append(self.workdir / name)
    config, _, exp_file = revisions.revision_files(revision)
    launch = revisions.Launch(
        len(history) + 1, revision, start_step, config, exp_file, tuple(argv),
        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    path = self.workdir / revisions.HISTORY
    self._history_before = path.read_text() if path.exists() else None
    # Object stores cannot append: the file is rewritten with every earlier line as it was.
    lines = "".join(h.to_json() + "\n" for h in history)
    _write(path, lines + launch.to_json() + "\n")
    self._written.append(path)
    return launch

  def undo(self) -> None:
    """Removes what `begin` wrote (the history as it was before)."""
    path = self.workdir / revisions.HISTORY
    for written in reversed(self._written):
      if written == path and self._history_before is not None:
        _write(path, self._history_before)
      else:
        written.unlink(missing_ok=True)
    self._written, self._history_before = [], None


def read_config(path: epath.Path) -> fdl.Config:
  """A run record's config file (checked as `loads` checks it)."""
  if not path.exists():
    raise ConfigRefError(f"{path}: missing (the run's history.jsonl names it)")
  return loads(path.read_text(), os.fspath(path))


def split_step(ref_or_workdir: str) -> tuple[str, int | None]:
  """`WORKDIR@STEP` -> (WORKDIR, STEP); anything else -> (it, None)."""
  head, sep, step = ref_or_workdir.rpartition("@")
  return (head, int(step)) if sep and head and step.isdigit() else (ref_or_workdir, None)


def from_workdir(workdir: str | os.PathLike, step: int | None = None) -> fdl.Config:
  """A run's config: the revision that produced checkpoint `step` (None: its newest
  checkpoint, or the latest revision when there is none), by olmo3.eval.revisions' rule."""
  directory = epath.Path(workdir)
  if not directory.is_dir():
    raise ConfigRefError(f"{workdir}: no such run directory")
  record = RunRecord(directory)
  history = record.history()
  if not history:
    raise ConfigRefError(f"{workdir}: no config.json (not a run workdir)")
  if step is None:
    from olmo3.checkpoint import run_steps  # JAX: only for a workdir named without a step

    steps = run_steps(directory / "checkpoints")
    step = steps[-1] if steps else None
  launch = history[-1] if step is None else revisions.producer(history, step)
  if launch is None:
    raise ConfigRefError(f"{workdir}@{step}: no launch of this run wrote step {step} (the first "
                         f"started at step {history[0].start_step})")
  return read_config(directory / launch.config)


def is_workdir_like(ref_or_workdir: str) -> bool:
  """A path (it has a '/', or exists here) rather than an experiment reference (which never
  has a '/')."""
  return "/" in ref_or_workdir or os.sep in ref_or_workdir or epath.Path(
      ref_or_workdir).exists()


def load_any(ref_or_workdir: str) -> fdl.Config:
  """An experiment reference, or a run workdir (`WORKDIR@STEP`: the revision that produced
  that checkpoint; see from_workdir)."""
  path, step = split_step(ref_or_workdir)
  if is_workdir_like(path):
    return from_workdir(path, step)
  try:
    split_ref(ref_or_workdir)
  except ConfigRefError:
    raise ConfigRefError(f"{ref_or_workdir!r} is neither a run directory (none is there) nor an "
                         "experiment reference (package.module:function)") from None
  return load(ref_or_workdir)


# --- diffs -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Change:
  path: str
  a: Any
  b: Any


_MISSING = "<unset>"


def diff(a: fdl.Config, b: fdl.Config) -> list[Change]:
  """Each field that differs between two configs, with both values (Fiddle's diffing)."""
  out = []
  for op in diffing.build_diff(a, b).changes:
    path = daglish.path_str(op.target).lstrip(".")
    try:
      old = daglish.follow_path(a, op.target)
    except (AttributeError, KeyError, IndexError):
      old = _MISSING
    new = getattr(op, "new_value", _MISSING)
    out.append(Change(path, old, new))
  return sorted(out, key=lambda c: c.path)


def _plain(value: Any) -> Any:
  if isinstance(value, enum.Enum):
    return value.value
  if isinstance(value, fdl.Buildable):
    return printing.as_str_flattened(value)
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  return repr(value)


def diff_json(changes: list[Change]) -> str:
  return json.dumps([{"path": c.path, "a": _plain(c.a), "b": _plain(c.b)} for c in changes],
                    indent=2)


def unresumable_changes(previous: fdl.Config, cfg: fdl.Config) -> list[Change]:
  """The changes from a workdir's config to `cfg` that a resumed run cannot take: every field
  not marked resumable in olmo3.config (`olmo3.config.resumable_fields`)."""
  allowed = resumable_fields()
  return [c for c in diff(previous, cfg)
          if not any(c.path == p or c.path.startswith((f"{p}.", f"{p}[")) for p in allowed)]
