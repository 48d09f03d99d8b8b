"""Field-by-field differences of two configs (Fiddle's diffing): `launch/diff.py`, the
launcher's check of a resumed run's changes, sweeps' variant names.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

import fiddle as fdl
from fiddle import daglish, diffing, printing

from olmo3.config import resumable_fields

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
