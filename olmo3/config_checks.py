"""The configs' checker, home-made by choice (WORKSPACE.md's config rules say why): every field's
value is checked against its annotation (bools are bools, ints ints, floats finite numbers, enums
members, tuples tuples) and put in its canonical form (JSON and command-line forms accepted:
lists for tuples, a mapping for a tuple of pairs, values for enums, dicts for configs), every
number against the bounds its field declares (`bounded`, `resumable`), then the class's own
`_check` runs the rules between its fields (`require`, `fail`, `nonempty`). A bad value is a
`ConfigError` naming `Class.field=value` and why, in one line.

`olmo3.config` declares the configs on `Validated`; this module knows none of them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
import operator
import os
import types
import typing
from typing import Any


class ConfigError(ValueError):
  """A configuration field holds an invalid value. The message names the field."""


RESUMABLE = "resumable"  # field metadata: may change between runs in one workdir
# Field metadata: a number's bounds (None passes, if the field allows it), each with its test and
# how a message states it.
BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="),
          "lt": (operator.lt, "<")}


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, resumable: bool = False) -> Any:
  """A numeric field and its bounds. Every int and float field declares some
  (tests/test_config.py checks), so a new field cannot go unchecked."""
  meta = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
  if resumable:
    meta[RESUMABLE] = True
  return dataclasses.field(default=default, metadata=meta)


def resumable(default: Any, **bounds: float) -> Any:
  """A field that may change when a run resumes in the same workdir (a longer run, another
  cadence, another slice): the launcher accepts a changed value instead of refusing the
  workdir. Every other field must match the run's config.json."""
  return bounded(default, resumable=True, **bounds)


class _Mismatch(Exception):
  """A value that does not fit its field; the message says why."""


# Scalar annotations: how a message names each and what it accepts (a bool is not a number, an
# int is a float, a path is its text).
_SCALARS = {bool: ("True or False (bool)", bool), int: ("an integer (int)", numbers.Integral),
            float: ("a number (float)", numbers.Real), str: ("a string (str)", (str, os.PathLike))}


def _type_name(tp: Any) -> str:
  return "None" if tp is type(None) else tp.__name__ if isinstance(tp, type) else str(tp)


def _conform(value: Any, tp: Any, bounds: typing.Mapping[str, Any]) -> Any:
  """`value` as annotation `tp` and a number's `bounds` (field metadata) allow, in canonical
  form: JSON and command-line forms are accepted (lists for tuples, a mapping for a tuple of
  pairs, values for enums, dicts for configs). Anything else raises _Mismatch."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    arms = [a for a in args if a is not type(None)]
    for arm in arms:
      try:
        return _conform(value, arm, bounds)
      except _Mismatch as e:
        why = str(e)
    raise _Mismatch(why if len(arms) == 1 else "expected " + " or ".join(map(_type_name, args)))
  if origin is tuple:
    if isinstance(value, dict) and typing.get_origin(args[0]) is tuple:  # a mapping for pairs
      value = tuple(value.items())
    if not isinstance(value, (tuple, list)):
      raise _Mismatch(f"expected a tuple ({_type_name(tp)})")
    kinds = [args[0]] * len(value) if args[1:] == (Ellipsis,) else args
    if len(kinds) != len(value):
      raise _Mismatch(f"expected {len(kinds)} entries ({_type_name(tp)})")
    out = []
    for i, (v, kind) in enumerate(zip(value, kinds)):
      try:
        out.append(_conform(v, kind, {}))
      except _Mismatch as e:
        raise _Mismatch(f"entry {i} ({v!r}): {e}") from None
    return tuple(out)
  if tp in _SCALARS:
    name, kinds = _SCALARS[tp]
    if not isinstance(value, kinds) or (isinstance(value, bool) and tp is not bool):
      raise _Mismatch(f"must be {name}, not {type(value).__name__}")
    try:
      value = os.fspath(value) if tp is str else tp(value)  # int(np.int64(5)) is 5
    except OverflowError:  # an int beyond float's range
      value = math.inf
    if tp is float and not math.isfinite(value):
      raise _Mismatch("must be a finite number")
    limits = [(bounds[k], test, sign) for k, (test, sign) in BOUNDS.items() if k in bounds]
    if not all(test(value, limit) for limit, test, _ in limits):
      raise _Mismatch("must be " + " and ".join(f"{sign} {limit}" for limit, _, sign in limits))
    return value
  if isinstance(tp, type) and issubclass(tp, enum.Enum):
    try:
      return tp(value)
    except (ValueError, TypeError):
      raise _Mismatch("expected one of " + ", ".join(repr(m.value) for m in tp)) from None
  if dataclasses.is_dataclass(tp):
    if not isinstance(value, (tp, dict)):
      raise _Mismatch(f"expected a {tp.__name__}")
    try:  # a dict from JSON (a ConfigError inside names the nested field)
      return value if isinstance(value, tp) else tp(**value)
    except TypeError as e:  # an unknown or missing key
      raise _Mismatch(str(e)) from None
  raise TypeError(f"olmo3.config cannot check a field annotated {tp!r}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def fail(obj: Any, name: str, why: str, value: Any = dataclasses.MISSING) -> typing.NoReturn:
  value = getattr(obj, name) if value is dataclasses.MISSING else value
  raise ConfigError(f"{type(obj).__name__}.{name}={value!r}: {why}")


def require(obj: Any, name: str, ok: bool, why: str) -> None:
  if not ok:
    fail(obj, name, why)


def nonempty(obj: Any, *names: str) -> None:
  """Strings (or every string of a tuple) in these fields are non-empty."""
  for name in names:
    value = getattr(obj, name)
    texts = value if isinstance(value, tuple) else () if value is None else (value,)
    require(obj, name, all(texts), "must be a non-empty string"
            if isinstance(value, str) else "entries must be non-empty strings")


class Validated:
  """Base of every config: checks each field against its annotation and declared bounds,
  stores its canonical form, then runs the class's `_check` (constraints between fields).
  Subclasses define `_check`, never `__post_init__`."""

  def __post_init__(self) -> None:
    hints = _hints(type(self))
    for f in dataclasses.fields(self):  # type: ignore[arg-type]
      tp = hints[f.name]
      try:
        object.__setattr__(self, f.name, _conform(getattr(self, f.name), tp, f.metadata))
      except _Mismatch as e:  # "(or None)": the field itself may also be None
        fail(self, f.name, str(e) + (" (or None)" if type(None) in typing.get_args(tp) else ""))
    self._check()

  def _check(self) -> None:
    """Constraints between fields and on contents (non-empty strings, unique names)."""

