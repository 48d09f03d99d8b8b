"""Retrying a storage operation: which failures are worth another attempt (the network's or the
service's: a connection refused or reset, a timeout, HTTP 408 / 429 / 5xx; never a missing file),
which say the credentials are missing or refused (`NoAccess`, naming what to set), and the one
retry loop, `budgeted`: attempts with exponential backoff within the retry budget
(OLMO3_STORAGE_RETRY_S), past it a StorageError naming the operation. The loop is async (the
clients' requests and this package's concurrent reads are coroutines); synchronous calls go
through it too (`retried`). A run's cleanup after a failure runs under `attempts_once()`: one
attempt per operation, so it ends quickly and never hides the error that stopped the run."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging as py_logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from olmo3.io import errors, settings

_FIRST_BACKOFF_S = 0.25  # then doubled (+ jitter) up to _MAX_BACKOFF_S, within the budget
_MAX_BACKOFF_S = 15.0

# What to set, per store, when a store's credentials are missing or refused.
_S3_CREDENTIALS = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, a profile "
                   "of ~/.aws/credentials), and AWS_ENDPOINT_URL for an S3-compatible store")
_GCS_CREDENTIALS = ("set GOOGLE_APPLICATION_CREDENTIALS to a service account's key file or run "
                    "`gcloud auth application-default login` (STORAGE_EMULATOR_HOST for an "
                    "emulator)")
# S3's answers to a request signed with credentials it does not accept.
_S3_REFUSED_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                     "InvalidToken", "TokenRefreshRequired")

_once_lock = threading.Lock()
_once_depth = 0  # > 0 inside `attempts_once()` blocks


@contextlib.contextmanager
def attempts_once():
  """Within the block (in any thread), remote operations are tried once, without retries: a
  run's cleanup after a failure (the store may be down) ends quickly and never replaces the
  error that stopped the run."""
  global _once_depth
  with _once_lock:
    _once_depth += 1
  try:
    yield
  finally:
    with _once_lock:
      _once_depth -= 1


# How TensorStore's errors say its requests failed for good (its retries ran out).
_TENSORSTORE_TRANSPORT = ("CURL error", "retry attempts failed")


def _storage_failure(error: BaseException) -> bool:
  """Whether `error`, or an error it was raised from, is the storage's: an OSError (this
  package's, the clients'), or TensorStore's transport giving up (Orbax's saves raise those as
  ValueErrors, wrapped in the run's CheckpointError)."""
  seen: list[BaseException] = []
  e: BaseException | None = error
  while e is not None and all(e is not s for s in seen):
    if isinstance(e, OSError) or any(m in str(e) for m in _TENSORSTORE_TRANSPORT):
      return True
    seen.append(e)
    e = e.__cause__ if e.__cause__ is not None else (
        None if e.__suppress_context__ else e.__context__)
  return False


def cleanup_after(error: BaseException) -> contextlib.AbstractContextManager:
  """Where the cleanup after `error` runs: after a storage failure (the store may be down; a
  failed save's CheckpointError counts by its cause) each remote operation is tried once, so
  the program ends quickly with that error."""
  return attempts_once() if _storage_failure(error) else contextlib.nullcontext()


def quietly(what: str, cleanup: Callable[[], None]) -> None:
  """Runs a cleanup whose failure must not replace the error that stopped the program: its
  failure is logged, one line."""
  try:
    cleanup()
  except Exception as e:  # pylint: disable=broad-except  # logged; the first error is raised
    py_logging.getLogger("olmo3").warning("%s failed too: %s: %s", what, type(e).__name__,
                                          errors.first_line(e))


def _budget() -> float:
  return 0.0 if _once_depth else settings.retry_budget_s()


class OutOfBudget(errors.StorageError):
  """An operation's transient failures outlasted the retry budget."""

  def __init__(self, operation: str, error: BaseException, attempts: int, seconds: float):
    self.cause_text = f"{type(error).__name__}: {errors.first_line(error)}"
    self.tail = (f"(after {attempts} attempt{'s' * (attempts > 1)} in {seconds:.0f} s; "
                 f"transient errors are retried for {settings.RETRY_ENV}="
                 f"{settings.retry_budget_s():g} s)")
    super().__init__(f"{operation} failed: {self.cause_text} {self.tail}")

  def named(self, operation: str) -> errors.StorageError:
    """The same failure, named as the caller knows the operation (a gs:// URL, not the
    request's)."""
    return errors.StorageError(f"{operation} failed: {self.cause_text} {self.tail}")


def _transient_types() -> tuple[type, ...]:
  """The network's errors as each client raises them (imported only where installed)."""
  types: list[type] = [ConnectionError, TimeoutError, asyncio.TimeoutError]
  try:
    import aiohttp  # pylint: disable=g-import-not-at-top

    types.append(aiohttp.ClientError)
  except ImportError:
    pass
  try:  # s3fs hands botocore's own (EndpointConnectionError for a refused connection)
    from botocore import exceptions  # pylint: disable=g-import-not-at-top

    types += [exceptions.ConnectionError, exceptions.HTTPClientError]
  except ImportError:
    pass
  try:  # gcsfs's (a 502 becomes requests' ProxyError; a token refresh may fail on the way)
    from google.auth import exceptions as auth_exceptions  # pylint: disable=g-import-not-at-top
    from requests import exceptions as requests_exceptions  # pylint: disable=g-import-not-at-top

    types += [requests_exceptions.ConnectionError, requests_exceptions.Timeout,
              requests_exceptions.ChunkedEncodingError, auth_exceptions.RefreshError]
  except ImportError:
    pass
  return tuple(types)


def _is_transient(error: BaseException) -> bool:
  """Worth retrying: the network or the service, not the request."""
  if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, FileExistsError,
                        errors.StorageError)):  # StorageError: retried (or refused) already
    return False
  status = getattr(error, "status", None) or getattr(error, "code", None)
  if isinstance(status, int):  # an expired token is refreshed by the next attempt (as gcsfs)
    return (status in (408, 429) or status >= 500
            or (status == 401 and "Invalid Credentials" in str(error)))
  if isinstance(error, _transient_types()):
    return True
  # s3fs wraps what botocore raised in an OSError of its own: the cause says what it was.
  cause = error.__cause__
  return cause is not None and cause is not error and _is_transient(cause)


def _credentials_problem(error: BaseException, operation: str) -> errors.NoAccess | None:
  """NoAccess naming `operation` when `error` is a client's "no credentials" (botocore's
  NoCredentialsError and kin: a traceback of 70 lines from the depths of botocore) or a
  store's refusal of the credentials it was given (S3's InvalidAccessKeyId, a GCS 401);
  None for any other error."""
  try:
    from botocore import exceptions  # pylint: disable=g-import-not-at-top

    missing = (exceptions.NoCredentialsError, exceptions.PartialCredentialsError,
               exceptions.CredentialRetrievalError, exceptions.ProfileNotFound,
               exceptions.TokenRetrievalError, exceptions.SSOError)
  except ImportError:
    missing = ()
  for e in (error, error.__cause__):
    if e is None:
      continue
    if missing and isinstance(e, missing):
      return errors.NoAccess(f"{operation} failed: no S3 credentials ({errors.first_line(e)}): "
                             f"{_S3_CREDENTIALS}")
    response = getattr(e, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    if code in _S3_REFUSED_CODES:
      return errors.NoAccess(f"{operation} failed: the store refused the S3 credentials ({code}: "
                             f"{errors.first_line(e)}): {_S3_CREDENTIALS}")
    if (getattr(e, "code", None) == 401 and type(e).__module__.startswith("gcsfs")
        and "Invalid Credentials" not in str(e)):  # that one: an expired token, refreshed
      return errors.NoAccess(f"{operation} failed: the store refused the request's credentials "
                             f"(HTTP 401: {errors.first_line(e)}): {_GCS_CREDENTIALS}")
  return None


def _backoff(attempt: int) -> float:
  return min(_FIRST_BACKOFF_S * 2 ** attempt, _MAX_BACKOFF_S) * (1 + 0.25 * random.random())


def budgeted(call: Callable[..., Awaitable[Any]], operation: Callable[..., str], *,
             pause: Callable[[float], Awaitable[Any]] = asyncio.sleep,
             name_refusals: bool = True) -> Callable[..., Awaitable[Any]]:
  """`call` retried on transient errors with backoff within the retry budget; past it
  OutOfBudget naming `operation(*args, **kwargs)`. The one retry loop: the clients' requests
  (olmo3.io.clients), this package's concurrent calls (`retried_async`) and synchronous calls
  (`retried`, with a blocking `pause`) all go through it. With `name_refusals`, missing or
  refused credentials are NoAccess naming the operation at once (synchronous calls leave them
  as the clients' own requests named them)."""
  @functools.wraps(call)
  async def attempt_all(*args, **kwargs):
    start, budget = time.monotonic(), _budget()
    for attempt in itertools.count():
      try:
        return await call(*args, **kwargs)
      except Exception as e:  # pylint: disable=broad-except  # classified just below
        if name_refusals and (
            refused := _credentials_problem(e, operation(*args, **kwargs))) is not None:
          raise refused from e
        if not _is_transient(e):
          raise
        wait = _backoff(attempt)
        if time.monotonic() - start + wait > budget:
          raise OutOfBudget(operation(*args, **kwargs), e, attempt + 1,
                            time.monotonic() - start) from e
        await pause(wait)
    raise AssertionError("unreachable")

  return attempt_all


def _named(attempts: Callable[[], Awaitable[Any]], operation: str
           ) -> Callable[[], Coroutine[Any, Any, Any]]:
  """`attempts` whose running out of the budget (its own, or a client's request's) is a
  StorageError naming `operation` as the caller knows it."""
  async def named():
    try:
      return await attempts()
    except OutOfBudget as e:
      raise e.named(operation) from e.__cause__

  return named


def retried_async(call: Callable[[], Awaitable[Any]], url: str, what: str = "reading"
                  ) -> Callable[[], Coroutine[Any, Any, Any]]:
  """An async factory: `call()` awaited, retried on transient errors with backoff within the
  retry budget (the clients' own requests are budgeted too: olmo3.io.clients); the error
  names `what` and `url`."""
  return _named(budgeted(call, lambda: f"{what} {url}"), f"{what} {url}")


def retried(call: Callable[[], Any], url: str, what: str = "reading") -> Any:
  """`call()` (any client's call on `url`, e.g. through etils.epath) retried on transient
  errors within the retry budget; StorageError naming `what` and `url` past it. Runs
  `budgeted`'s loop in this thread with a blocking call and a blocking pause: nothing in it
  suspends, so it needs no event loop (and runs where one is already running)."""
  async def attempt():
    return call()

  async def pause(seconds: float) -> None:
    time.sleep(seconds)

  attempts = budgeted(attempt, lambda: f"{what} {url}", pause=pause, name_refusals=False)
  coroutine = _named(attempts, f"{what} {url}")()
  try:
    coroutine.send(None)
  except StopIteration as done:
    return done.value
  coroutine.close()
  raise AssertionError("a synchronous retry suspended")
