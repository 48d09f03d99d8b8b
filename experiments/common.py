"""Helpers shared by experiment modules."""

from __future__ import annotations

import dataclasses
from typing import Any

import fiddle as fdl


def as_config(value: Any) -> Any:
  """A frozen-dataclass tree as nested fdl.Config with every field set explicitly, so printed
  configs and diffs show every number, defaults included."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return fdl.Config(type(value), **{f.name: as_config(getattr(value, f.name))
                                      for f in dataclasses.fields(value)})
  return value
