"""A run's configs on disk: Fiddle's JSON of each config revision (olmo3.run.record lays
them out), loaded back without running code, and the config a workdir (or WORKDIR@STEP)
names.

A run's config.json never runs code: every symbol it names is checked against an allow-list
(`check_symbols`) before Fiddle deserializes anything, and Fiddle then imports with a policy
that rechecks each one (`_Policy`).
"""

from __future__ import annotations

import enum
import json
import os
from typing import Any

import fiddle as fdl
from etils import epath
from fiddle import printing
from fiddle._src import config as config_lib
from fiddle.experimental import serialization

# `olmo3` is imported before any launch script calls make_cwd_importable, so the installed
# package is the one a config.json's references resolve in.
from launch import config_changes
from launch.refs import ConfigRefError, load, split_ref
from olmo3.run import record

# What a config.json may name: the config classes and enums of these modules (an experiment is
# a tree of them; a function, which building would call, is never needed)...
ALLOWED_MODULES = ("olmo3.config", "olmo3.remat")
# ... and exactly these, which Fiddle's format itself needs (fdl.Config, its traverser
# metadata, the containers it rebuilds).
ALLOWED_SYMBOLS = {("builtins", "tuple"): tuple, ("builtins", "list"): list,
                   ("builtins", "dict"): dict, ("fiddle._src.config", "Config"): fdl.Config,
                   ("fiddle._src.config", "BuildableTraverserMetadata"):
                       config_lib.BuildableTraverserMetadata}


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


def revision(previous: fdl.Config | None, cfg: fdl.Config) -> dict[str, str] | None:
  """The files of a new config revision for olmo3.run.record.RunRecord.begin ({"json": Fiddle's
  JSON, "text": the flattened printout}), or None when `cfg` equals the latest revision's
  config (`previous`)."""
  if previous is not None and not config_changes.diff(previous, cfg):
    return None
  return {"json": dump(cfg), "text": printing.as_str_flattened(cfg)}


def latest_config(workdir: str) -> fdl.Config | None:
  """The config of the latest revision recorded in `workdir` (None: no run recorded there)."""
  try:
    path = record.RunRecord(workdir).latest_config()
  except record.RecordError as e:
    raise ConfigRefError(str(e)) from None
  return None if path is None else read_config(path)


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
  checkpoint, or the latest revision when there is none), by olmo3.run.record's rule."""
  directory = epath.Path(workdir)
  if not directory.is_dir():
    raise ConfigRefError(f"{workdir}: no such run directory")
  try:
    history = record.RunRecord(os.fspath(workdir)).history()
  except record.RecordError as e:
    raise ConfigRefError(str(e)) from None
  if not history:
    raise ConfigRefError(f"{workdir}: no config.json (not a run workdir)")
  if step is None:
    from olmo3.io.checkpoint import run_steps  # JAX: only for a workdir named without a step

    steps = run_steps(record.Workdir(os.fspath(workdir)).checkpoints)
    step = steps[-1] if steps else None
  launch = history[-1] if step is None else record.producer(history, step)
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
