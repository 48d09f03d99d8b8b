"""The storage's settings, read from the environment when they are needed (a child process given
other values gets its own): the retry budget (`OLMO3_STORAGE_RETRY_S`, default 180 s), each
request's deadline (`OLMO3_STORAGE_TIMEOUT_S`, default 60 s) and the requests in flight per host
(`OLMO3_STORAGE_CONCURRENCY`, default 64)."""

from __future__ import annotations

import math
import os

from olmo3.io import errors

RETRY_ENV, TIMEOUT_ENV = "OLMO3_STORAGE_RETRY_S", "OLMO3_STORAGE_TIMEOUT_S"
DEFAULT_RETRY_S, DEFAULT_TIMEOUT_S = 180.0, 60.0


def seconds_setting(name: str, default: float) -> float:
  """A positive number of seconds from the environment variable `name` (default when unset);
  StorageError naming the variable when it is not one."""
  value = os.environ.get(name)
  if value is None or value == "":
    return default
  try:
    seconds = float(value)
  except ValueError:
    seconds = math.nan
  if not (math.isfinite(seconds) and seconds > 0):
    raise errors.StorageError(f"{name}={value!r}: expected a positive number of seconds")
  return seconds


def retry_budget_s() -> float:
  """How long an operation's transient failures are retried (OLMO3_STORAGE_RETRY_S)."""
  return seconds_setting(RETRY_ENV, DEFAULT_RETRY_S)


def request_timeout_s() -> float:
  """Each request's deadline to connect and to read its answer (OLMO3_STORAGE_TIMEOUT_S)."""
  return seconds_setting(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def concurrency() -> int:
  """Requests in flight per host (OLMO3_STORAGE_CONCURRENCY, default 64)."""
  value = os.environ.get("OLMO3_STORAGE_CONCURRENCY", "64")
  if not value.isdigit() or int(value) < 1:
    raise ValueError(f"OLMO3_STORAGE_CONCURRENCY={value!r}: expected a positive integer")
  return int(value)
