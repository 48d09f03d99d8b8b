"""Experiment references, overrides, fiddlers and sweeps: how the launch scripts turn command
lines into configs.

A reference is `package.module:function` (or the dotted `package.module.function`) naming a
no-argument function that returns fdl.Config[Experiment]. Overrides are `path=value` with a
Python literal value (strings quoted), as Fiddle's own flags take them; fiddlers are functions
of the config in the experiment's module (`name`, `name(arg=1)`) or given as `module:function`.
A sweep is a function returning a list of override dicts ({"model.remat": "full", ...}).

Nothing here touches sys.path but `make_cwd_importable`: `olmo3`, `experiments` and `launch`
import because `pip install -e .` installs them, and each launch script's entry point calls it
once so a user's own module in the working directory imports too.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
import typing
from typing import Any, Callable

import fiddle as fdl
from absl import flags

# `experiments` is imported here, before any launch script calls make_cwd_importable, so the
# installed package (not an `experiments` directory in the working directory) is the one a
# reference resolves in.
import experiments  # noqa: F401
from olmo3 import config as config_lib
from olmo3.run import record


def usage_error(message: str, script: str) -> typing.NoReturn:
  """A command-line mistake: its one line, then where the flags are described (not the whole
  --help, which would bury it). `script` is the program's path as a user types it."""
  sys.exit(f"error: {message}\nRun 'python {script} --help' for the flags.")


def config_fields(cls: type | None = None, prefix: str = "") -> list[str]:
  """Every leaf field of the experiment's config tree as `--fdl_set` names it (train.steps,
  model.n_layers, ...)."""
  cls = cls or config_lib.Experiment
  out = []
  for field in dataclasses.fields(cls):
    kind = typing.get_type_hints(cls).get(field.name)
    if dataclasses.is_dataclass(kind):
      out += config_fields(kind, f"{prefix}{field.name}.")
    else:
      out.append(f"{prefix}{field.name}")
  return out


def parse_flags(argv: list[str], script: str) -> list[str]:
  """absl's flag parsing for a launch script (app.run's `flags_parser`), its mistakes in one
  line: a flag that is a config field's name (--steps) points to --fdl_set (absl's own message
  said only "Unknown command line flag", and where to find help on flags)."""
  try:
    return flags.FLAGS(argv)
  except flags.UnrecognizedFlagError as e:
    name = e.flagname.split("=")[0]
    fields = [f for f in config_fields() if f.rsplit(".", 1)[-1] == name]
    close = difflib.get_close_matches(name, list(flags.FLAGS), n=1)
    hint = (f": a config field is set with --fdl_set, e.g. --fdl_set={fields[0]}=VALUE"
            + (f" (fields of that name: {', '.join(fields)})" if len(fields) > 1 else "")
            if fields else f"; did you mean --{close[0]}?" if close else "")
    usage_error(f"unknown flag --{name}{hint}", script)
  except flags.Error as e:
    usage_error(str(e), script)


class ConfigRefError(ValueError):
  """A bad experiment reference, override or fiddler. The message names it."""


def split_ref(ref: str) -> tuple[str, str]:
  if ":" in ref:
    module, _, name = ref.partition(":")
  else:
    _refuse_a_bare_module(ref)
    module, _, name = ref.rpartition(".")
  if not module or not name:
    raise ConfigRefError(f"--fdl_config={ref!r}: expected 'package.module:function'")
  return module, name


def _refuse_a_bare_module(ref: str) -> None:
  """`--fdl_config=experiments.olmo3_tiny` names a module, not one of its experiments: said
  as such, with them listed (read as module.function it said that `experiments` has no
  experiment 'olmo3_tiny')."""
  try:
    found = importlib.util.find_spec(ref) is not None
  except (ImportError, ValueError):  # a parent that is no package, an empty name
    found = False
  if found:
    names = module_functions(import_module(ref, f"--fdl_config={ref!r}"), Kind.EXPERIMENT)
    raise ConfigRefError(
        f"--fdl_config={ref!r} names a module: add ':' and one of its experiments"
        + (f", e.g. --fdl_config={ref}:{'stage1' if 'stage1' in names else names[0]} (it "
           f"defines {', '.join(names)})" if names
           else " (it defines none)"))


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


def find(module_name: str, name: str, kind: Kind, flag: str) -> Callable[..., Any]:
  """The function `name` of `module_name` that a command line names as a `kind`, or
  ConfigRefError naming `flag` (e.g. "--fdl_config='x:y'") with the closest valid names."""
  module = import_module(module_name, flag)
  fn = getattr(module, name, None)
  if not callable(fn):
    raise ConfigRefError(f"{flag}: {module_name} has no {kind.value} {name!r}; "
                         + _suggest(name, module_functions(module, kind), f"{kind.value}s"))
  return fn


def load(ref: str) -> fdl.Config:
  """The config an experiment reference builds (module:function or module.function)."""
  module_name, name = split_ref(ref)
  flag = f"--fdl_config={ref!r}"
  cfg = find(module_name, name, Kind.EXPERIMENT, flag)()
  if not isinstance(cfg, fdl.Buildable):
    raise ConfigRefError(f"{flag}: {name}() returned {type(cfg).__name__}, not a fdl.Config")
  return cfg


def default_workdir(ref: str) -> str:
  """Where a run of an experiment reference goes unless --workdir says (olmo3.run.record's
  convention: experiments.olmo3_tiny:stage1 -> runs/olmo3_tiny.stage1)."""
  return record.default_workdir(*split_ref(ref))


def apply_fiddler(cfg: fdl.Config, spec: str, default_module: str) -> fdl.Config:
  """`name`, `name(k=v, ...)`, or `module:name(...)`: calls fn(cfg, **kwargs)."""
  match = re.fullmatch(r"\s*([\w.:]+)\s*(?:\((.*)\))?\s*", spec)
  if not match:
    raise ConfigRefError(f"--fiddler={spec!r}: expected 'name' or 'name(key=value, ...)'")
  target, args = match.groups()
  module_name, name = target.split(":") if ":" in target else (default_module, target)
  fn = find(module_name, name, Kind.FIDDLER, f"--fiddler={spec!r}")
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
  return list(find(*split_ref(ref), Kind.SWEEP, f"--sweep={ref!r}")())


def variant_name(overrides: dict[str, Any]) -> str:
  """A sweep variant's name (its row in results.csv; `launch/sweep.py --variant NAME`)."""
  def short(v):
    if isinstance(v, (tuple, list)) and v and all(
        isinstance(p, (tuple, list)) and len(p) == 2 for p in v):  # pairs: a mesh shape, rules
      return "/".join(f"{k}{short(n)}" for k, n in v)
    if isinstance(v, (tuple, list)):  # flags
      return "on" if v else "off"
    return str(getattr(v, "value", v))

  return ",".join(f"{k}={short(v)}" for k, v in overrides.items())
