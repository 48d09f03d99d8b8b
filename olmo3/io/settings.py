"""The storage's settings, read from the environment when they are needed (a child process given
other values gets its own): the retry budget (`OLMO3_STORAGE_RETRY_S`, default 180 s), each
request's deadline (`OLMO3_STORAGE_TIMEOUT_S`, default 60 s) and the requests in flight per host
(`OLMO3_STORAGE_CONCURRENCY`, default 64). Read as every program's settings are
(`olmo3.program`); the two durations are read inside the storage's retries, whose callers
handle a store's failures (OSError), so a bad one is a StorageError naming the variable.
"""

from __future__ import annotations

from olmo3 import program
from olmo3.io import errors

RETRY_ENV, TIMEOUT_ENV = "OLMO3_STORAGE_RETRY_S", "OLMO3_STORAGE_TIMEOUT_S"
CONCURRENCY_ENV = "OLMO3_STORAGE_CONCURRENCY"
DEFAULT_RETRY_S, DEFAULT_TIMEOUT_S, DEFAULT_CONCURRENCY = 180.0, 60.0, 64


def _storage_seconds(name: str, default: float) -> float:
  try:
    return program.seconds_setting(name, default)
  except program.SettingError as e:
    raise errors.StorageError(str(e)) from None


def retry_budget_s() -> float:
  """How long an operation's transient failures are retried (OLMO3_STORAGE_RETRY_S)."""
  return _storage_seconds(RETRY_ENV, DEFAULT_RETRY_S)


def request_timeout_s() -> float:
  """Each request's deadline to connect and to read its answer (OLMO3_STORAGE_TIMEOUT_S)."""
  return _storage_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def concurrency() -> int:
  """Requests in flight per host (OLMO3_STORAGE_CONCURRENCY, default 64)."""
  return program.count_setting(CONCURRENCY_ENV, DEFAULT_CONCURRENCY)
