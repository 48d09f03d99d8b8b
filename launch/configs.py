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
import enum
import importlib
import json
import os
import re
import sys
from typing import Any

import fiddle as fdl
from fiddle import daglish, diffing, printing
from fiddle._src import config as config_lib
from fiddle.experimental import serialization

# `experiments` is imported here, before any launch script calls make_cwd_importable, so the
# installed package (not an `experiments` directory in the working directory) is the one a
# config.json's references resolve in; `olmo3` is imported just below for the same reason.
import experiments  # noqa: F401
from olmo3.config import resumable_fields

# What a config.json may name: the config classes and enums of these modules (an experiment is
# a tree of them; a function, which building would call, is never needed)...
ALLOWED_MODULES = ("olmo3.config", "olmo3.remat")
# ... and exactly these, which Fiddle's format itself needs (fdl.Config, its traverser
# metadata, the containers it rebuilds).
ALLOWED_SYMBOLS = {("builtins", "tuple"): tuple, ("builtins", "list"): list,
                   ("builtins", "dict"): dict, ("fiddle._src.config", "Config"): fdl.Config,
                   ("fiddle._src.config", "BuildableTraverserMetadata"):
                       config_lib.BuildableTraverserMetadata}


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


def import_module(module: str, what: str):
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    raise ConfigRefError(f"{what}: cannot import module {module!r} ({e})") from None


def load(ref: str) -> fdl.Config:
  """The config an experiment reference builds (module:function or module.function)."""
  module_name, name = split_ref(ref)
  module = import_module(module_name, f"--fdl_config={ref!r}")
  fn = getattr(module, name, None)
  if not callable(fn):
    raise ConfigRefError(f"--fdl_config={ref!r}: {module_name} has no function {name!r}")
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
  fn = getattr(import_module(module_name, f"--fiddler={spec!r}"), name, None)
  if not callable(fn):
    raise ConfigRefError(f"--fiddler={spec!r}: {module_name} has no function {name!r}")
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
  fn = getattr(import_module(module, f"--sweep={ref!r}"), name, None)
  if not callable(fn):
    raise ConfigRefError(f"--sweep={ref!r}: {module} has no function {name!r}")
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


def write_run_record(workdir: str, cfg: fdl.Config, argv: list[str]) -> None:
  os.makedirs(workdir, exist_ok=True)
  for name, text in (("config.json", dump(cfg)), ("config.txt", printing.as_str_flattened(cfg)),
                     ("command.txt", " ".join(argv))):
    tmp = os.path.join(workdir, f".{name}.tmp")
    with open(tmp, "w") as f:
      f.write(text + "\n")
    os.replace(tmp, os.path.join(workdir, name))


def from_workdir(workdir: str) -> fdl.Config:
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise ConfigRefError(f"{workdir}: no config.json (not a run workdir)")
  with open(path) as f:
    return loads(f.read(), path)


def load_any(ref_or_workdir: str) -> fdl.Config:
  """An experiment reference, or a run workdir (its config.json)."""
  if os.path.isdir(ref_or_workdir):
    return from_workdir(ref_or_workdir)
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
