"""Where a run's files live: local paths, `gs://`, `s3://` (read and write) and `http(s)://`
(read only), behind one small API.

Object stores are reached through fsspec (gcsfs, s3fs and fsspec's HTTP filesystem); etils.epath,
which Orbax and the run's writers use for directories, reaches `gs://` and `s3://` through the
same fsspec filesystems, so a workdir in a bucket and a data root in a bucket behave alike.
Credentials and endpoints are each store's own: Application Default Credentials (or
`STORAGE_EMULATOR_HOST` for an emulator) for GCS, the `AWS_*` variables (`AWS_ENDPOINT_URL` for
S3-compatible stores) for S3. HTTP(S) is how AI2 serves its token files publicly.

Reads of token files are ranged (only the bytes an instance needs), concurrent (a bounded number
of requests in flight per host, `OLMO3_STORAGE_CONCURRENCY`, default 64), batched (one call reads a
whole step's rows) and retried with exponential backoff on transient errors (connection refused
or reset, timeouts, HTTP 408 / 429 / 5xx). A file that is not there is a `FileNotFoundError` at
once. An HTTP server must answer Range requests: the first look at a file over HTTP (its size,
whether it exists) checks that it does.

Outages end in bounded time. Every request has a deadline (`OLMO3_STORAGE_TIMEOUT_S`, default
60 s: connecting, and each read of the answer), and an operation's transient failures are
retried with backoff within one budget (`OLMO3_STORAGE_RETRY_S`, default 180 s): a store that
comes back within it loses nothing; past it the operation raises `StorageError` naming itself
and its URL. The same limits reach the libraries' own clients (fsspec's gcsfs / s3fs, which
etils.epath uses, and TensorStore's, which Orbax uses: `tensorstore_context`), whose own retries
are turned off or counted with their timeouts, so that a store that stalls (accepts connections,
never answers) ends an operation within the budget plus about one request timeout. Missing or
refused credentials are `NoAccess`, naming the URL and what to set. A run's cleanup
after a failure runs under `attempts_once()` (one attempt per operation), so it ends quickly
and never hides the error that stopped the run.

Conditional writes (`read_versioned`, `create_exclusive`, `replace_if`) let a writer change a
file only if nobody else did meanwhile: a local file through a link (create) or a rename-aside
(replace); GCS with an `ifGenerationMatch` precondition, S3 with `If-None-Match` / `If-Match`
(both stores check them on the server). `olmo3.train.lease` uses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import functools
import itertools
import json
import logging as py_logging
import math
import os
import pathlib
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

READ_WRITE_SCHEMES = ("gs", "s3")
READ_ONLY_SCHEMES = ("http", "https")
RETRY_ENV, TIMEOUT_ENV = "OLMO3_STORAGE_RETRY_S", "OLMO3_STORAGE_TIMEOUT_S"
DEFAULT_RETRY_S, DEFAULT_TIMEOUT_S = 180.0, 60.0
_DERIVED_ENV = "OLMO3_TENSORSTORE_CURL_DERIVED"  # the TENSORSTORE_CURL_* olmo3 set
_FIRST_BACKOFF_S = 0.25  # then doubled (+ jitter) up to _MAX_BACKOFF_S, within the budget
_MAX_BACKOFF_S = 15.0


class StorageError(OSError):
  """A remote read or write failed for good (after retries). The message names the URL."""


class ChangedSince(StorageError):
  """A remote file is not what a run found it to be: shorter than a read of it needs, or of
  another size or version than the run's size cache records. The message names the file."""


class PreconditionFailed(StorageError):
  """A conditional write found the file changed (or present) since it was read."""


class NoAccess(StorageError):
  """The store refused, or the client could not find, the credentials a request needs. The
  message names the operation and URL and what to set."""


# What to set, per store, when a store's credentials are missing or refused.
_S3_CREDENTIALS = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, a profile "
                   "of ~/.aws/credentials), and AWS_ENDPOINT_URL for an S3-compatible store")
_GCS_CREDENTIALS = ("set GOOGLE_APPLICATION_CREDENTIALS to a service account's key file or run "
                    "`gcloud auth application-default login` (STORAGE_EMULATOR_HOST for an "
                    "emulator)")
# S3's answers to a request signed with credentials it does not accept.
_S3_REFUSED_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                     "InvalidToken", "TokenRefreshRequired")


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
    raise StorageError(f"{name}={value!r}: expected a positive number of seconds")
  return seconds


def retry_budget_s() -> float:
  """How long an operation's transient failures are retried (OLMO3_STORAGE_RETRY_S)."""
  return seconds_setting(RETRY_ENV, DEFAULT_RETRY_S)


def request_timeout_s() -> float:
  """Each request's deadline to connect and to read its answer (OLMO3_STORAGE_TIMEOUT_S)."""
  return seconds_setting(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


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
  module's, the clients'), or TensorStore's transport giving up (Orbax's saves raise those as
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
                                          first_line(e))


def _budget() -> float:
  return 0.0 if _once_depth else retry_budget_s()


class OutOfBudget(StorageError):
  """An operation's transient failures outlasted the retry budget."""

  def __init__(self, operation: str, error: BaseException, attempts: int, seconds: float):
    self.cause_text = f"{type(error).__name__}: {first_line(error)}"
    self.tail = (f"(after {attempts} attempt{'s' * (attempts > 1)} in {seconds:.0f} s; "
                 f"transient errors are retried for {RETRY_ENV}={retry_budget_s():g} s)")
    super().__init__(f"{operation} failed: {self.cause_text} {self.tail}")

  def named(self, operation: str) -> StorageError:
    """The same failure, named as the caller knows the operation (a gs:// URL, not the
    request's)."""
    return StorageError(f"{operation} failed: {self.cause_text} {self.tail}")


def first_line(error: BaseException) -> str:
  """An error's message, its first line only (libraries append request dumps)."""
  lines = str(error).strip().splitlines()
  return lines[0][:300] if lines else ""


class _QuietRetries(py_logging.Filter):
  """gcsfs logs a traceback each time its own retries run out; the error is ours to report
  (once, in one line), so those records are dropped."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    return not (record.name.startswith("gcsfs") and record.levelno >= py_logging.WARNING
                and record.exc_info is not None)


def _silence_library_retries() -> None:
  logger = py_logging.getLogger("gcsfs")
  if not any(isinstance(f, _QuietRetries) for f in logger.filters):
    logger.addFilter(_QuietRetries())


def client_options() -> dict[str, dict[str, Any]]:
  """Per protocol, the fsspec options that give every request a deadline (gcsfs's
  `requests_timeout`; s3fs's connect / read timeouts, botocore's retries left to us: one
  attempt per request, `_budgeted` retries) and keep
  no directory listings (`use_listings_cache`). fsspec keeps each listing for the life of the
  process by default and answers `exists` from it: a file another process had removed since
  (a crashed save's, removed by process 0 of the relaunched job) still existed for process 1,
  which read it back to extend it (Orbax's array metadata) and failed the save."""
  timeout = request_timeout_s()
  return {"gcs": {"requests_timeout": timeout, "use_listings_cache": False},
          "s3": {"config_kwargs": {"connect_timeout": timeout, "read_timeout": timeout,
                                   "retries": {"max_attempts": 1, "mode": "standard"}},
                 "use_listings_cache": False}}


def configure_clients() -> None:
  """Puts `client_options` into fsspec's configuration, so every gcsfs / s3fs instance (etils'
  and Orbax's too) gets them, budgets the clients' requests (`_budget_client_requests`) and
  keeps gcsfs's retry tracebacks out of the log. Idempotent; options already configured (a
  user's FSSPEC_* variables) win."""
  import fsspec.config  # pylint: disable=g-import-not-at-top

  for protocol, options in client_options().items():
    aliases = ("gs", "gcs") if protocol == "gcs" else ("s3", "s3a")
    for alias in aliases:
      conf = fsspec.config.conf.setdefault(alias, {})
      for key, value in options.items():
        conf.setdefault(key, value)
  _silence_library_retries()
  _budget_client_requests()
  # TensorStore (Orbax's array reads and writes) takes no deadline per request from Python;
  # its curl transport reads these when it makes its first request: a connection that does
  # not open, or that carries less than a byte a second, for the request timeout fails (and
  # is retried within the budget: `tensorstore_context`) instead of waiting for ever. A
  # user's own values win; those a parent process derived (listed in _DERIVED_ENV) are derived
  # again here, so a child given another OLMO3_STORAGE_TIMEOUT_S does not inherit the parent's.
  timeout = str(max(1, math.ceil(request_timeout_s())))
  derived = set(filter(None, os.environ.get(_DERIVED_ENV, "").split(",")))
  for key, value in (("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", timeout),
                     ("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", timeout),
                     ("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")):
    if key in derived or key not in os.environ:
      os.environ[key] = value
      derived.add(key)
  os.environ[_DERIVED_ENV] = ",".join(sorted(derived))


_VERBS = {"GET": "reading", "HEAD": "reading", "POST": "writing", "PUT": "writing",
          "PATCH": "writing", "DELETE": "removing"}


def _gcs_operation(fs, method: str, path: str, *args, **kwargs) -> str:
  """A gcsfs request in the user's words: what it does and to which gs:// object."""
  verb = _VERBS.get(method.upper(), method)
  if path.startswith("b/") and args:  # b/{bucket}/o/{object}, b/{bucket}/o (a listing)
    if path == "b/{}/o" and verb == "reading":
      verb = "listing"
    key = args[1] if len(args) > 1 else kwargs.get("prefix", "")
    return f"{verb} gs://{args[0]}/{key}".rstrip("/")
  if "/b/" in path:  # an upload: .../upload/storage/v1/b/{bucket}/o, the name in its body
    return f"{verb} an object in gs://{path.rsplit('/b/', 1)[1].split('/')[0]}"
  return f"{verb} {fs._format_path(path, args)}"  # pylint: disable=protected-access


def _s3_operation(fs, method, *args, **kwargs) -> str:
  """An s3fs call in the user's words: what it does and to which s3:// object."""
  del fs, args
  name = getattr(method, "__name__", str(method))
  verb = ("listing" if name.startswith("list") else "reading" if name.startswith(("get", "head"))
          else "removing" if name.startswith("delete") else "writing")
  return f"{verb} s3://{kwargs.get('Bucket', '')}/{kwargs.get('Key', kwargs.get('Prefix', ''))}"


@functools.cache
def _budget_client_requests() -> None:
  """Every request gcsfs and s3fs send, whoever calls them (this module, etils.epath for the
  run's directories and records, Orbax's file operations), is retried within the retry budget:
  the one place these clients are patched. Why: gcsfs retries 6 times on a fixed schedule of
  its own (about 35 s per call with the server down, a traceback logged each time), s3fs does
  not retry a refused connection at all, and neither can be configured per instance."""
  try:
    import gcsfs  # pylint: disable=g-import-not-at-top

    request = gcsfs.GCSFileSystem._request  # pylint: disable=protected-access
    inner = getattr(request, "__wrapped__", None)  # without gcsfs's own retry decorator
    if inner is not None:
      # pylint: disable-next=protected-access
      gcsfs.GCSFileSystem._request = _budgeted(inner, _gcs_operation)
  except ImportError:
    pass
  try:
    import s3fs  # pylint: disable=g-import-not-at-top

    from botocore import handlers  # pylint: disable=g-import-not-at-top
    from fsspec import asyn  # pylint: disable=g-import-not-at-top

    s3fs.S3FileSystem._call_s3 = _budgeted(  # pylint: disable=protected-access
        s3fs.S3FileSystem._call_s3, _s3_operation)  # pylint: disable=protected-access
    # Its synchronous twin (what s3fs's files call to upload) was made from the original.
    s3fs.S3FileSystem.call_s3 = asyn.sync_wrapper(
        s3fs.S3FileSystem._call_s3)  # pylint: disable=protected-access
    # botocore asks S3 to accept each upload's body first ("Expect: 100-continue"), and
    # aiohttp waits for that answer with no deadline: an upload to a store that accepts
    # connections and never answers waited for ever, whatever the read timeout (etils'
    # write_text, Orbax's commit of a save). Bodies are sent at once instead; sessions made
    # from here on lack the header.
    handlers.BUILTIN_HANDLERS[:] = [h for h in handlers.BUILTIN_HANDLERS
                                    if h[1] is not handlers.add_expect_header]
    # s3fs also retries each call 5 times itself (a class attribute, no option), around the
    # budgeted call above and around its reads: on a store that accepts connections and never
    # answers, one operation tried once (a run's cleanup) took 5 x 2 x the request timeout,
    # and a read 5 budgets. The budget is the only retrier.
    s3fs.S3FileSystem.retries = 1
  except ImportError:
    pass


def tensorstore_retries(budget_s: float, timeout_s: float) -> tuple[int, float]:
  """(retries, first delay in seconds) of TensorStore's request retries, delays doubling: the
  last retry starts within the budget even when every attempt runs to the request timeout
  (a store that accepts connections and never answers), as `_budgeted`'s retries do.
  TensorStore retries a fixed number of times and cannot see the clock, so the count is
  chosen here: the delays alone (a store that refuses at once) fill what the attempts leave,
  about half the budget. TensorStore adds up to 1 s of jitter to each delay (measured), taken
  out of the delays here. Why: retries counted by their delays alone (1, 2, 4 ... s up to
  the budget) spent 6 attempts x 10 s + 31 s of delays on a stalled store with a 30 s
  budget: a save ended 92 s after the store stalled, past the budget + 60 s."""
  retries = max(1, min(int(budget_s // (2 * (timeout_s + 1))), 8))
  delays = max(budget_s - retries * (timeout_s + 1), 0.5 * retries)
  return retries, delays / (2 ** retries - 1)


def tensorstore_context(base: dict[str, Any]) -> dict[str, Any]:
  """`base` (a TensorStore context spec) with GCS and S3 request retries that end within the
  retry budget plus one request timeout (`tensorstore_retries`; TensorStore's default, 32
  retries up to 32 s apart, outlasts an outage by a quarter of an hour), and AWS credentials
  from the environment when they are there."""
  retries, first = tensorstore_retries(retry_budget_s(), request_timeout_s())
  spec = {"max_retries": retries, "initial_delay": f"{first:.3f}s",
          "max_delay": f"{first * 2 ** (retries - 1):.3f}s"}
  context = {**base, "gcs_request_retries": dict(spec), "s3_request_retries": dict(spec)}
  if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
    # Credentials in the environment come first in AWS's chain anyway; naming them keeps
    # TensorStore's AWS SDK from looking for ~/.aws/config and logging, at ERROR, that it is
    # missing (twice per file, per thread).
    context["aws_credentials"] = {"type": "environment"}
  return context


def scheme(path: str | os.PathLike) -> str:
  """'' for a local path, else the URL's scheme ('gs', 's3', 'http', 'https')."""
  text = os.fspath(path)
  head, sep, _ = text.partition("://")
  return head.lower() if sep and head.isalnum() else ""


def is_url(path: str | os.PathLike) -> bool:
  return bool(scheme(path))


def check_supported(path: str | os.PathLike, *, writable: bool = False,
                    what: str = "path") -> None:
  """ValueError naming `path` unless this module can read it (and write it, with `writable`)."""
  s = scheme(path)
  if not s:
    return
  if s in READ_WRITE_SCHEMES:
    configure_clients()  # before etils or Orbax make their first client of the store
  if s in READ_ONLY_SCHEMES and writable:
    raise ValueError(f"{what} {os.fspath(path)}: {s}:// is read-only; a workdir or anything "
                     "written must be a local path, gs:// or s3://")
  if s not in READ_WRITE_SCHEMES + READ_ONLY_SCHEMES:
    raise ValueError(f"{what} {os.fspath(path)}: unsupported scheme {s}:// (supported: local "
                     "paths, gs://, s3://, http(s):// for reading)")


def absolute(path: str | os.PathLike):
  """`path` as an absolute etils.epath.Path: a URL as it is (epath's `absolute()` would make
  `gs://b/x` the local `$PWD/gs:/b/x`), a local path from the working directory."""
  from etils import epath  # pylint: disable=g-import-not-at-top

  text = os.fspath(path)
  return epath.Path(text if is_url(text) else os.path.abspath(text))


def join(base: str | os.PathLike, *parts: str) -> str:
  """`base/part/...` for a local path or a URL (URLs keep their `//` and use `/`)."""
  text = os.fspath(base)
  if not is_url(text):
    return os.path.join(text, *parts)
  for part in parts:
    text = text.rstrip("/") + "/" + part.lstrip("/")
  return text


def normalized(path: str | os.PathLike) -> str:
  """`path` spelt as etils.epath spells it (pathlib's rules for a local path: `./a/b/` is
  `a/b`; a URL's repeated and trailing slashes dropped), http(s):// URLs included, which etils
  cannot represent. Token-file paths built on it keep the spelling runs recorded them with."""
  text = os.fspath(path)
  if not is_url(text):
    return os.fspath(pathlib.PurePath(text))
  head, _, rest = text.partition("://")
  return f"{head}://" + "/".join(part for part in rest.split("/") if part)


def split(path: str | os.PathLike) -> tuple[str, str]:
  """(parent, name) of `normalized(path)`, as etils.epath's `parent` and `name`, URLs of every
  scheme alike: `http://host/a/b` is (`http://host/a`, `b`); a URL without a path (`http://host`,
  `gs://bucket`) is its own parent, named by its host or bucket."""
  text = normalized(path)
  if not is_url(text):
    pure = pathlib.PurePath(text)
    return os.fspath(pure.parent), pure.name
  head, _, rest = text.partition("://")
  parent, sep, name = rest.rpartition("/")
  return f"{head}://{parent if sep else rest}", name


@functools.cache
def _filesystem(protocol: str, pid: int):
  """One fsspec filesystem per protocol and process (async filesystems keep an event loop and
  sessions that must not cross a fork)."""
  del pid
  import fsspec  # pylint: disable=g-import-not-at-top  # only runs that touch URLs pay for it

  configure_clients()
  if protocol in READ_ONLY_SCHEMES:
    # fsspec's default HTTP session has a 5-minute total timeout per request and no retries
    # (retries are ours, below); a range read that stalls is a transient error.
    import aiohttp  # pylint: disable=g-import-not-at-top

    timeout = request_timeout_s()
    return fsspec.filesystem("http", client_kwargs={
        "timeout": aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)})
  return fsspec.filesystem(protocol, skip_instance_cache=True)


def filesystem(path: str | os.PathLike):
  """The fsspec filesystem serving `path` (a URL)."""
  s = scheme(path)
  check_supported(path)
  return _filesystem("http" if s == "https" else s, os.getpid())


def _host(path: str) -> str:
  return path.partition("://")[2].partition("/")[0]


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
                        StorageError)):  # StorageError: retried (or refused) already
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


def _credentials_problem(error: BaseException, operation: str) -> NoAccess | None:
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
      return NoAccess(f"{operation} failed: no S3 credentials ({first_line(e)}): "
                      f"{_S3_CREDENTIALS}")
    response = getattr(e, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    if code in _S3_REFUSED_CODES:
      return NoAccess(f"{operation} failed: the store refused the S3 credentials ({code}: "
                      f"{first_line(e)}): {_S3_CREDENTIALS}")
    if (getattr(e, "code", None) == 401 and type(e).__module__.startswith("gcsfs")
        and "Invalid Credentials" not in str(e)):  # that one: an expired token, refreshed
      return NoAccess(f"{operation} failed: the store refused the request's credentials "
                      f"(HTTP 401: {first_line(e)}): {_GCS_CREDENTIALS}")
  return None


def _backoff(attempt: int) -> float:
  return min(_FIRST_BACKOFF_S * 2 ** attempt, _MAX_BACKOFF_S) * (1 + 0.25 * random.random())


def concurrency() -> int:
  """Requests in flight per host (OLMO3_STORAGE_CONCURRENCY, default 64)."""
  value = os.environ.get("OLMO3_STORAGE_CONCURRENCY", "64")
  if not value.isdigit() or int(value) < 1:
    raise ValueError(f"OLMO3_STORAGE_CONCURRENCY={value!r}: expected a positive integer")
  return int(value)


def _budgeted(call: Callable[..., Awaitable[Any]], operation: Callable[..., str]
              ) -> Callable[..., Awaitable[Any]]:
  """`call` retried on transient errors with backoff within the retry budget; past it
  OutOfBudget naming `operation(*args, **kwargs)`."""
  @functools.wraps(call)
  async def attempt_all(*args, **kwargs):
    start, budget = time.monotonic(), _budget()
    for attempt in itertools.count():
      try:
        return await call(*args, **kwargs)
      except Exception as e:  # pylint: disable=broad-except  # classified just below
        if (refused := _credentials_problem(e, operation(*args, **kwargs))) is not None:
          raise refused from e
        if not _is_transient(e):
          raise
        pause = _backoff(attempt)
        if time.monotonic() - start + pause > budget:
          raise OutOfBudget(operation(*args, **kwargs), e, attempt + 1,
                            time.monotonic() - start) from e
        await asyncio.sleep(pause)
    raise AssertionError("unreachable")

  return attempt_all


def _retried(call, url: str, what: str = "reading"):
  """An async factory: `call()` awaited, retried on transient errors with backoff within the
  retry budget (the clients' own requests are budgeted too: `configure_clients`); the error
  names `what` and `url`."""
  budgeted = _budgeted(call, lambda: f"{what} {url}")

  async def named():
    try:
      return await budgeted()
    except OutOfBudget as e:
      raise e.named(f"{what} {url}") from e.__cause__

  return named


def _remote_all(calls: Sequence[tuple[str, Callable[[Any, str], Awaitable[Any]]]],
                what: str = "reading") -> list[Any]:
  """`await call(fs, url)` for each (url, call), all at once: at most `concurrency()` in flight
  per host, each retried on transient errors. The results, in order."""
  from fsspec import asyn  # pylint: disable=g-import-not-at-top

  limit = concurrency()
  out: list[Any] = [None] * len(calls)
  by_protocol: dict[str, list[int]] = {}
  for i, (url, _) in enumerate(calls):
    by_protocol.setdefault(scheme(url).replace("https", "http"), []).append(i)
  for indices in by_protocol.values():
    fs = filesystem(calls[indices[0]][0])

    async def gather():
      gates = {_host(calls[i][0]): asyncio.Semaphore(limit) for i in indices}

      async def one(i):
        url, call = calls[i]
        async with gates[_host(url)]:
          return await _retried(lambda: call(fs, url), url, what)()

      return await asyncio.gather(*(one(i) for i in indices))

    for i, result in zip(indices, asyn.sync(fs.loop, gather)):
      out[i] = result
  return out


def _sync_retried(call, url: str, what: str = "reading"):
  """`call()` retried on transient errors within the retry budget, for the synchronous
  filesystems' calls; the error names `what` and `url`."""
  start, budget = time.monotonic(), _budget()
  for attempt in itertools.count():
    try:
      return call()
    except OutOfBudget as e:  # a client's request ran out of the budget: name it as ours
      raise e.named(f"{what} {url}") from e.__cause__
    except Exception as e:  # pylint: disable=broad-except  # classified just below
      if not _is_transient(e):
        raise
      pause = _backoff(attempt)
      if time.monotonic() - start + pause > budget:
        raise OutOfBudget(f"{what} {url}", e, attempt + 1, time.monotonic() - start) from e
      time.sleep(pause)
  raise AssertionError("unreachable")


def retried(call: Callable[[], Any], url: str, what: str) -> Any:
  """`call()` (any client's call on `url`, e.g. through etils.epath) retried on transient
  errors within the retry budget; StorageError naming `what` and `url` past it."""
  return _sync_retried(call, url, what)


def exists(path: str | os.PathLike) -> bool:
  text = os.fspath(path)
  if not is_url(text):
    return os.path.exists(text)
  if scheme(text) in READ_ONLY_SCHEMES:
    # fsspec's HTTP `exists` takes a refused connection for a missing file; the size lookup
    # retries it, and proves the server answers Range requests (`_http_size`).
    return sizes([text])[0] is not None
  fs = filesystem(text)
  return bool(_sync_retried(lambda: fs.exists(text), text, "looking up"))


def is_dir(path: str | os.PathLike) -> bool:
  text = os.fspath(path)
  if not is_url(text):
    return os.path.isdir(text)
  if scheme(text) in READ_ONLY_SCHEMES:
    return False  # HTTP has files only
  fs = filesystem(text)
  return bool(_sync_retried(lambda: fs.isdir(text), text, "looking up"))


async def _http_size(fs, url: str) -> int | None:
  """The file's size (None: 404), from a GET of its first byte: the answer's `Content-Range`
  (`bytes 0-0/SIZE`; `bytes */0` with a 416 for an empty file) gives the size and shows that
  the server answers Range requests, as every read of a remote file is one. A server that
  ignores them answers 200 with the whole file (only its headers are read): refused here, at
  the first look at a file, naming it. Not fsspec's `_info`, which turns every failure, a
  transient 503 included, into FileNotFoundError."""
  session = await fs.set_session()
  async with session.get(url, allow_redirects=True,
                         headers={"Range": "bytes=0-0", "Accept-Encoding": "identity"}
                         ) as response:
    if response.status == 404:
      return None
    if response.status == 200:
      raise StorageError(f"{url}: the server does not support HTTP Range requests (asked for "
                         "one byte, it sent the whole file); data is read over http(s):// by "
                         "range: serve it with a server that does (python -m olmo3.data.serve "
                         "DIR)")
    if response.status != 416:  # 416: an empty file has no first byte
      response.raise_for_status()  # aiohttp.ClientResponseError: retried when transient
    total = response.headers.get("Content-Range", "").rpartition("/")[2]
    if not total.isdigit():
      raise StorageError(f"{url}: the server does not report the file's size")
    return int(total)


@dataclasses.dataclass(frozen=True)
class Stat:
  """What identifies a remote file's contents: its size, and its version where the store keeps
  one (a GCS object's generation, an S3 object's ETag; None over HTTP)."""

  size: int
  version: str | None = None

  def describe(self) -> str:
    return f"{self.size:,} bytes" + (f" (version {self.version})" if self.version else "")


async def _stat(fs, url: str) -> Stat | None:
  """A remote file's Stat (None: no such file)."""
  if scheme(url) in READ_ONLY_SCHEMES:
    size = await _http_size(fs, url)
    return None if size is None else Stat(size)
  try:
    found = await fs._info(url)  # pylint: disable=protected-access
  except FileNotFoundError:
    return None
  if found.get("type") == "directory":
    return None
  if found.get("size") is None:
    raise StorageError(f"{url}: the server does not report the file's size")
  version = found.get("generation") or found.get("ETag")
  return Stat(int(found["size"]), None if version is None else str(version))


def stats(paths: Sequence[str | os.PathLike]) -> list[Stat | None]:
  """Each file's Stat (None: it does not exist), remote ones looked up concurrently."""
  texts = [os.fspath(p) for p in paths]
  out = [None if is_url(t) else (Stat(os.path.getsize(t)) if os.path.isfile(t) else None)
         for t in texts]
  remote = [i for i, t in enumerate(texts) if is_url(t)]
  for i, found in zip(remote, _remote_all([(texts[i], _stat) for i in remote], "looking up")):
    out[i] = found
  return out


def sizes(paths: Sequence[str | os.PathLike]) -> list[int | None]:
  """Each file's size in bytes (None: it does not exist), remote ones looked up concurrently."""
  return [None if found is None else found.size for found in stats(paths)]


def _past_the_end(error: BaseException) -> bool:
  """A ranged read refused because the range starts past the file's end (HTTP 416), as each
  client reports it: gcsfs's HttpError(code=416), aiohttp's ClientResponseError(status=416),
  s3fs's OSError(EINVAL) from botocore's InvalidRange."""
  for e in (error, error.__cause__):
    if e is None:
      continue
    if 416 in (getattr(e, "code", None), getattr(e, "status", None)):
      return True
    response = getattr(e, "response", None)
    if isinstance(response, dict) and response.get("Error", {}).get("Code") == "InvalidRange":
      return True
    if isinstance(e, OSError) and "range is not satisfiable" in str(e):
      return True
  return False


def _ranged(start: int, end: int):
  async def call(fs, url: str) -> bytes:
    try:
      data = await fs._cat_file(url, start=start, end=end)  # pylint: disable=protected-access
    except Exception as e:  # pylint: disable=broad-except  # re-raised unless past the end
      if _past_the_end(e):
        raise ChangedSince(f"{url}: bytes [{start:,}, {end:,}) start past the file's end (the "
                           "store answered 416): it is shorter than when its size was looked "
                           "up") from None
      raise
    if len(data) < end - start:
      raise ChangedSince(f"{url}: asked for bytes [{start:,}, {end:,}), got {len(data):,}: the "
                         "file is shorter than when its size was looked up")
    if len(data) > end - start:
      # A server that ignores Range sends the whole file: never take it for the range.
      raise StorageError(f"{url}: asked for bytes [{start}, {end}), got {len(data)} bytes "
                         "(does the server support HTTP Range requests?)")
    return data
  return call


def read_ranges(requests: Sequence[tuple[str | os.PathLike, int, int]]) -> list[bytes]:
  """The bytes [start, end) of each (path, start, end), in order. Local files are read
  directly; remote ones with one ranged request each, concurrently, retried."""
  texts = [os.fspath(path) for path, _, _ in requests]
  out: list[bytes | None] = [None] * len(requests)
  for i, (text, (_, start, end)) in enumerate(zip(texts, requests)):
    if not is_url(text):
      with open(text, "rb") as f:
        f.seek(start)
        out[i] = f.read(end - start)
  remote = [i for i, t in enumerate(texts) if is_url(t)]
  chunks = _remote_all([(texts[i], _ranged(*requests[i][1:])) for i in remote])
  for i, chunk in zip(remote, chunks):
    out[i] = chunk
  return out  # type: ignore[return-value]


def read_bytes(path: str | os.PathLike) -> bytes:
  text = os.fspath(path)
  if not is_url(text):
    with open(text, "rb") as f:
      return f.read()
  fs = filesystem(text)
  return _sync_retried(lambda: fs.cat_file(text), text)


def read_text(path: str | os.PathLike) -> str:
  return read_bytes(path).decode()


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
  """Writes a whole file so that a reader sees the old contents or the new, never a part:
  a local file through a temporary file and a rename, an object with one upload (object
  stores publish an object only when its upload completes)."""
  text = os.fspath(path)
  check_supported(text, writable=True)
  if not is_url(text):
    os.makedirs(os.path.dirname(os.path.abspath(text)), exist_ok=True)
    tmp = f"{text}.tmp-{os.getpid()}"
    try:
      with open(tmp, "wb") as f:
        f.write(data)
      os.replace(tmp, text)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
    return
  fs = filesystem(text)
  _sync_retried(lambda: fs.pipe_file(text, data), text, "writing")


class SizeCache:
  """The remote files' sizes and versions a run trained on, kept in a JSON file (`path`, in
  the workdir) and checked again at every launch: each remote file is looked up once per
  launch (concurrently, with every other), and one whose size or version differs from the
  record is ChangedSince, naming the file and the record, unless `accept_changes`
  (data.allow_changed_data), when the new one is recorded. Without the check a file replaced
  under the same name would change the data a resumed run reads (shorter: reads past its end;
  other tokens: silently). Local files are never recorded: a stat costs nothing, and the
  loader checks their length before it maps them. `save` writes what was looked up (a
  launcher's checks look up without writing, before it has decided to write anything)."""

  def __init__(self, path: str | os.PathLike | None, *, accept_changes: bool = False):
    self.path = None if path is None else os.fspath(path)
    self.accept_changes = accept_changes
    self._recorded: dict[str, Stat] = {}
    self._checked: dict[str, Stat] = {}  # looked up by this launch
    if self.path is not None and exists(self.path):
      try:
        self._recorded = {str(url): Stat(int(size), None if version is None else str(version))
                          for url, (size, version) in json.loads(read_text(self.path)).items()}
      except (ValueError, TypeError, AttributeError):  # unreadable: looked up and rewritten
        self._recorded = {}

  def sizes(self, paths: Sequence[str | os.PathLike]) -> list[int | None]:
    texts = [os.fspath(p) for p in paths]
    unchecked = sorted({t for t in texts if is_url(t) and t not in self._checked})
    for url, found in zip(unchecked, stats(unchecked)):
      if found is None:
        continue
      was = self._recorded.get(url)
      if was is not None and not self.accept_changes and (
          was.size != found.size or None not in (was.version, found.version)
          and was.version != found.version):
        raise ChangedSince(
            f"{url} changed since this run recorded it in {self.path}: {was.describe()} then, "
            f"{found.describe()} now")
      self._checked[url] = found
    local = [t for t in texts if not is_url(t)]
    found_local = dict(zip(local, sizes(local)))
    return [self._checked[t].size if t in self._checked else found_local.get(t)
            for t in texts]

  def save(self) -> None:
    """Writes the record if this launch found a file it lacked or one changed (accepted)."""
    merged = {**self._recorded, **self._checked}
    if merged == self._recorded or self.path is None:
      return
    write_bytes_atomic(self.path, json.dumps(
        {url: [stat.size, stat.version] for url, stat in merged.items()}, indent=0,
        sort_keys=True).encode())
    self._recorded = merged


# --- conditional writes (olmo3.train.lease) ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Versioned:
  """A file's bytes as read, and what a conditional write checks they are still: the object's
  generation (GCS) or ETag (S3); on a local disk the bytes themselves."""

  data: bytes
  version: str
  modified: float  # seconds since the epoch by the store's clock (a local file's mtime)


def _is_precondition_failure(error: BaseException) -> bool:
  """A write refused because its precondition failed: gcsfs and s3fs's `mode="create"` raise
  FileExistsError; s3fs turns a failed If-Match into an OSError whose cause says 412."""
  if isinstance(error, (FileExistsError, PreconditionFailed)):
    return True
  for e in (error, error.__cause__):
    response = getattr(e, "response", None)
    if isinstance(response, dict):
      code = response.get("Error", {}).get("Code")
      status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
      if code == "PreconditionFailed" or status == 412:
        return True
  return False


async def _gcs_upload(fs, url: str, data: bytes, generation: str) -> str:
  """A GCS object written only if its generation is `generation` ("0": only if absent): the
  JSON API's multipart upload with ifGenerationMatch, as gcsfs's own `mode="create"` does it.
  The new generation."""
  bucket, key, _ = fs.split_path(url)
  metadata = json.dumps({"name": key})
  body = (f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{metadata}\n--==0==\n"
          "Content-Type: application/octet-stream\n\n").encode() + data + b"\n--==0==--"
  out = await fs._call(  # pylint: disable=protected-access
      "POST", f"{fs._location}/upload/storage/v1/b/{bucket}/o",  # pylint: disable=protected-access
      uploadType="multipart", headers={"Content-Type": 'multipart/related; boundary="==0=="'},
      data=body, json_out=True, ifGenerationMatch=generation)
  fs.invalidate_cache(url)
  return str(out["generation"])


async def _read_versioned(fs, url: str) -> Versioned | None:
  if scheme(url) == "gs":
    bucket, key, _ = fs.split_path(url)
    try:
      # pylint: disable-next=protected-access
      headers, data = await fs._call("GET", "b/{}/o/{}", bucket, key, alt="media")
    except FileNotFoundError:
      return None
    modified = email.utils.parsedate_to_datetime(headers["Last-Modified"]).timestamp()
    return Versioned(bytes(data), str(headers["X-Goog-Generation"]), modified)
  bucket, key, _ = fs.split_path(url)
  try:
    # pylint: disable-next=protected-access
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
  except FileNotFoundError:
    return None
  data = await response["Body"].read()
  return Versioned(data, str(response["ETag"]), response["LastModified"].timestamp())


def read_versioned(path: str | os.PathLike) -> Versioned | None:
  """The file's bytes and version (None: no such file)."""
  text = os.fspath(path)
  check_supported(text, writable=True)
  if not is_url(text):
    try:
      with open(text, "rb") as f:
        return Versioned(f.read(), "", os.fstat(f.fileno()).st_mtime)
    except FileNotFoundError:
      return None
  return _remote_all([(text, _read_versioned)])[0]


def _conditional(text: str, write: Callable[[Any, str], Awaitable[str]]) -> str:
  """A remote conditional write, retried on transient errors; PreconditionFailed when refused."""
  try:
    return _remote_all([(text, write)], "writing")[0]
  except Exception as e:  # pylint: disable=broad-except  # classified just below
    if _is_precondition_failure(e):
      raise PreconditionFailed(f"{text} was changed by another writer") from e
    raise


def _link_new(text: str, data: bytes) -> None:
  """Creates a local file holding `data`, whole, only if none is there: written beside it and
  linked into place (a link never replaces a file), so no reader ever sees it partial."""
  os.makedirs(os.path.dirname(os.path.abspath(text)), exist_ok=True)
  tmp = f"{text}.{uuid.uuid4().hex}.tmp"
  try:
    with open(tmp, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    try:
      os.link(tmp, text)
    except FileExistsError:
      raise PreconditionFailed(f"{text} exists") from None
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)


def create_exclusive(path: str | os.PathLike, data: bytes) -> str:
  """Creates the file with `data` only if it does not exist (PreconditionFailed if it does);
  its version."""
  text = os.fspath(path)
  check_supported(text, writable=True)
  if not is_url(text):
    _link_new(text, data)
    return ""
  if scheme(text) == "gs":
    return _conditional(text, lambda fs, url: _gcs_upload(fs, url, data, "0"))

  async def s3_create(fs, url):
    # pylint: disable-next=protected-access
    return str((await fs._pipe_file(url, data, mode="create"))["ETag"])

  return _conditional(text, s3_create)


def replace_if(path: str | os.PathLike, data: bytes, expected: Versioned) -> str:
  """Replaces the file with `data` only if it is still `expected` (as `read_versioned` gave it):
  PreconditionFailed if another writer changed or removed it meanwhile. The new version.

  A local file is renamed aside (of two renames of one file, one fails), compared, and the new
  file linked into place; one that changed meanwhile is put back."""
  text = os.fspath(path)
  check_supported(text, writable=True)
  if not is_url(text):
    aside = f"{text}.{uuid.uuid4().hex}.aside"
    try:
      os.rename(text, aside)
    except FileNotFoundError:
      raise PreconditionFailed(f"{text} was removed by another writer") from None
    try:
      with open(aside, "rb") as f:
        moved = f.read()
      if moved != expected.data:
        with contextlib.suppress(FileExistsError):
          os.link(aside, text)  # put back what another writer wrote (unless a third did)
        raise PreconditionFailed(f"{text} was changed by another writer")
    finally:
      os.unlink(aside)
    _link_new(text, data)
    return ""
  if scheme(text) == "gs":
    return _conditional(text, lambda fs, url: _gcs_upload(fs, url, data, expected.version))

  async def s3_replace(fs, url):
    # pylint: disable-next=protected-access
    out = await fs._pipe_file(url, data, IfMatch=expected.version)
    return str(out["ETag"])

  return _conditional(text, s3_replace)


def remove(path: str | os.PathLike) -> None:
  """Removes a file (nothing if it is not there)."""
  text = os.fspath(path)
  if not is_url(text):
    with contextlib.suppress(FileNotFoundError):
      os.unlink(text)
    return
  fs = filesystem(text)

  def rm():
    with contextlib.suppress(FileNotFoundError):
      fs.rm_file(text)

  _sync_retried(rm, text, "removing")
