"""The clients that reach the stores, set up so that outages end in bounded time: fsspec's
(gcsfs for `gs://`, s3fs for `s3://`, its aiohttp one for `http(s)://`; etils.epath, which Orbax
and the run's writers use for directories, reaches `gs://` and `s3://` through the same fsspec
filesystems) and TensorStore's (Orbax's arrays: `tensorstore_context`).

Every request has a deadline (`OLMO3_STORAGE_TIMEOUT_S`: connecting, and each read of the
answer), and each request gcsfs and s3fs send is retried within the retry budget
(`OLMO3_STORAGE_RETRY_S`, olmo3.io.retry), whoever sends it; the libraries' own retries are
turned off or counted with their timeouts, so that a store that stalls (accepts connections,
never answers) ends an operation within the budget plus about one request timeout.
Credentials and endpoints are each store's own: Application Default Credentials (or
`STORAGE_EMULATOR_HOST` for an emulator) for GCS, anonymous at once where no source of them can
exist (`google_credentials_possible`), the `AWS_*` variables (`AWS_ENDPOINT_URL` for
S3-compatible stores) for S3.

The budget reaches gcsfs and s3fs through patches of their private attributes (the one place
these clients are patched: `_patch_gcsfs`, `_patch_s3fs`, each saying why). A library upgrade
that removes or reshapes what a patch replaces makes `configure_clients` raise LibraryChanged,
naming the library's version, and fails tests/test_client_patches.py by name.
"""

from __future__ import annotations

import functools
import logging as py_logging
import math
import os
from typing import Any

from olmo3.io import errors, pathnames, retry, settings

_DERIVED_ENV = "OLMO3_TENSORSTORE_CURL_DERIVED"  # the TENSORSTORE_CURL_* olmo3 set
_DMI = "/sys/class/dmi/id"  # the machine's vendor and product, as Linux reads them


class LibraryChanged(RuntimeError):
  """An installed gcsfs, s3fs or botocore lacks what a patch here replaces (another version
  than pyproject.toml pins): the message names the library, its version and the attribute."""


def _changed(library: str, what: str) -> LibraryChanged:
  from importlib import metadata  # pylint: disable=g-import-not-at-top

  return LibraryChanged(
      f"{library} {metadata.version(library)}: {what}; olmo3.io.clients patches it to retry the "
      "store's requests within the retry budget, as in the version pyproject.toml pins "
      "(tests/test_client_patches.py says what changed)")


def client_options() -> dict[str, dict[str, Any]]:
  """Per protocol, the fsspec options that give every request a deadline (gcsfs's
  `requests_timeout`; s3fs's connect / read timeouts, botocore's retries left to us: one
  attempt per request, budgeted retries) and keep
  no directory listings (`use_listings_cache`). fsspec keeps each listing for the life of the
  process by default and answers `exists` from it: a file another process had removed since
  (a crashed save's, removed by process 0 of the relaunched job) still existed for process 1,
  which read it back to extend it (Orbax's array metadata) and failed the save."""
  timeout = settings.request_timeout_s()
  gcs_token = {"token": "anon"} if not google_credentials_possible() else {}
  # botocore's `total_max_attempts` counts the first attempt, its `max_attempts` only the
  # retries: {"max_attempts": 1} was two attempts, so a stalled store's request took twice
  # the request timeout, a retry the budget never saw.
  return {"gcs": {"requests_timeout": timeout, "use_listings_cache": False, **gcs_token},
          "s3": {"config_kwargs": {"connect_timeout": timeout, "read_timeout": timeout,
                                   "retries": {"total_max_attempts": 1, "mode": "standard"}},
                 "use_listings_cache": False}}


class _QuietStorageTracebacks(py_logging.Filter):
  """Library records that carry a storage failure the run reports itself, once, in one line:
  gcsfs's traceback each time its own retries run out, and asyncio's "Task exception was never
  retrieved" for a request a library started and abandoned when another part of the same
  operation failed first (Orbax's save while the store stalls: its temporary directory's look
  at the store, a StorageError of ours, printed with its traceback before the run's own error
  line). Both are dropped; any other exception asyncio reports is kept."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno < py_logging.WARNING or record.exc_info is None:
      return True
    if record.name.startswith("gcsfs"):
      return False
    return not (record.name == "asyncio"
                and isinstance(record.exc_info[1], errors.StorageError))


def _quiet_storage_tracebacks() -> None:
  for name in ("gcsfs", "asyncio"):
    logger = py_logging.getLogger(name)
    if not any(isinstance(f, _QuietStorageTracebacks) for f in logger.filters):
      logger.addFilter(_QuietStorageTracebacks())


def google_credentials_possible() -> bool:
  """Whether any source gcsfs tries for credentials can exist on this machine: the
  GOOGLE_APPLICATION_CREDENTIALS file, gcloud's application-default login, gcsfs's token
  cache, or a Google Cloud machine's metadata server (a Compute Engine VM, which GKE nodes,
  TPU VMs and Colab are, by its DMI vendor; Cloud Run, Cloud Functions, App Engine by their
  variables). Where none can, gcsfs ends anonymous anyway, but only after asking the
  metadata server with google-auth's backoff, about 15 s per process (without credentials a
  run's first error, or every process reading a public bucket from a laptop, waited that
  long): `client_options` then asks for anonymous access at once."""
  if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
    return True
  gcloud = os.environ.get("CLOUDSDK_CONFIG") or os.path.expanduser("~/.config/gcloud")
  if os.path.exists(os.path.join(gcloud, "application_default_credentials.json")):
    return True
  if os.path.exists(os.path.expanduser("~/.gcs_tokens")):
    return True
  if any(os.environ.get(k) for k in ("K_SERVICE", "CLOUD_RUN_JOB", "FUNCTION_TARGET",
                                     "GAE_APPLICATION")):
    return True
  for name in ("sys_vendor", "product_name"):
    try:
      with open(os.path.join(_DMI, name)) as f:
        if f.read().strip().startswith("Google"):
          return True
    except OSError:
      pass
  return False


def configure_clients() -> None:
  """Puts `client_options` into fsspec's configuration, so every gcsfs / s3fs instance (etils'
  and Orbax's too) gets them, budgets the clients' requests (`_budget_client_requests`) and
  keeps the storage failures libraries log with tracebacks out of the log
  (`_QuietStorageTracebacks`). Idempotent; options already configured (a user's FSSPEC_*
  variables) win."""
  import fsspec.config  # pylint: disable=g-import-not-at-top

  for protocol, options in client_options().items():
    aliases = ("gs", "gcs") if protocol == "gcs" else ("s3", "s3a")
    for alias in aliases:
      conf = fsspec.config.conf.setdefault(alias, {})
      for key, value in options.items():
        conf.setdefault(key, value)
  _quiet_storage_tracebacks()
  _budget_client_requests()
  # TensorStore (Orbax's array reads and writes) takes no deadline per request from Python;
  # its curl transport reads these when it makes its first request: a connection that does
  # not open, or that carries less than a byte a second, for the request timeout fails (and
  # is retried within the budget: `tensorstore_context`) instead of waiting for ever. A
  # user's own values win; those a parent process derived (listed in _DERIVED_ENV) are derived
  # again here, so a child given another OLMO3_STORAGE_TIMEOUT_S does not inherit the parent's.
  timeout = str(max(1, math.ceil(settings.request_timeout_s())))
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


def _patch_gcsfs(gcsfs) -> None:
  """Every request gcsfs sends (`GCSFileSystem._request`, async: self, method, path, *args)
  retried within the budget instead of by gcsfs's own retry decorator, whose undecorated
  function (`__wrapped__`) is what gets budgeted. Why: gcsfs retries 6 times on a fixed
  schedule of its own (about 35 s per call with the server down, a traceback logged each
  time), and that cannot be configured per instance."""
  # pylint: disable-next=protected-access
  inner = getattr(gcsfs.GCSFileSystem._request, "__wrapped__", None)
  if inner is None:
    raise _changed("gcsfs", "GCSFileSystem._request has no __wrapped__ (the request without "
                   "gcsfs's own retry decorator)")
  gcsfs.GCSFileSystem._request = retry.budgeted(  # pylint: disable=protected-access
      inner, _gcs_operation)


def _patch_s3fs(s3fs, handlers, asyn) -> None:
  """Every call s3fs makes (`S3FileSystem._call_s3`, async: self, method, **kwargs) retried
  within the budget, and s3fs's and botocore's own retries and waits taken out. Why: s3fs
  does not retry a refused connection at all, and that cannot be configured per instance.
  `handlers` is botocore.handlers, `asyn` fsspec.asyn."""
  for name in ("_call_s3", "call_s3", "retries"):
    if not hasattr(s3fs.S3FileSystem, name):
      raise _changed("s3fs", f"S3FileSystem has no {name}")
  expect = getattr(handlers, "add_expect_header", None)
  if not any(h[1] is expect for h in handlers.BUILTIN_HANDLERS):
    raise _changed("botocore", "handlers.add_expect_header is not among handlers."
                   "BUILTIN_HANDLERS")
  s3fs.S3FileSystem._call_s3 = retry.budgeted(  # pylint: disable=protected-access
      s3fs.S3FileSystem._call_s3, _s3_operation)  # pylint: disable=protected-access
  # Its synchronous twin (what s3fs's files call to upload) was made from the original.
  s3fs.S3FileSystem.call_s3 = asyn.sync_wrapper(
      s3fs.S3FileSystem._call_s3)  # pylint: disable=protected-access
  # botocore asks S3 to accept each upload's body first ("Expect: 100-continue"), and
  # aiohttp waits for that answer with no deadline: an upload to a store that accepts
  # connections and never answers waited for ever, whatever the read timeout (etils'
  # write_text, Orbax's commit of a save). Bodies are sent at once instead; sessions made
  # from here on lack the header.
  handlers.BUILTIN_HANDLERS[:] = [h for h in handlers.BUILTIN_HANDLERS if h[1] is not expect]
  # s3fs also retries each call 5 times itself (a class attribute, no option), around the
  # budgeted call above and around its reads: on a store that accepts connections and never
  # answers, one operation tried once (a run's cleanup) took 5 x 2 x the request timeout,
  # and a read 5 budgets. The budget is the only retrier.
  s3fs.S3FileSystem.retries = 1


@functools.cache
def _budget_client_requests() -> None:
  """Every request gcsfs and s3fs send, whoever calls them (this package, etils.epath for the
  run's directories and records, Orbax's file operations), is retried within the retry budget:
  the clients that are installed are patched, once per process."""
  try:
    import gcsfs  # pylint: disable=g-import-not-at-top
  except ImportError:
    pass
  else:
    _patch_gcsfs(gcsfs)
  try:
    import s3fs  # pylint: disable=g-import-not-at-top

    from botocore import handlers  # pylint: disable=g-import-not-at-top
    from fsspec import asyn  # pylint: disable=g-import-not-at-top
  except ImportError:
    pass
  else:
    _patch_s3fs(s3fs, handlers, asyn)


def tensorstore_retries(budget_s: float, timeout_s: float) -> tuple[int, float]:
  """(retries, first delay in seconds) of TensorStore's request retries, delays doubling: the
  last retry starts within the budget even when every attempt runs to the request timeout
  (a store that accepts connections and never answers), as `retry.budgeted`'s retries do.
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
  retries, first = tensorstore_retries(settings.retry_budget_s(), settings.request_timeout_s())
  spec = {"max_retries": retries, "initial_delay": f"{first:.3f}s",
          "max_delay": f"{first * 2 ** (retries - 1):.3f}s"}
  context = {**base, "gcs_request_retries": dict(spec), "s3_request_retries": dict(spec)}
  if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
    # Credentials in the environment come first in AWS's chain anyway; naming them keeps
    # TensorStore's AWS SDK from looking for ~/.aws/config and logging, at ERROR, that it is
    # missing (twice per file, per thread).
    context["aws_credentials"] = {"type": "environment"}
  return context


def check_supported(path: str | os.PathLike, *, writable: bool = False,
                    what: str = "path") -> None:
  """ValueError naming `path` unless a client here can read it (and write it, with
  `writable`). A `gs://` or `s3://` path configures the clients first."""
  s = pathnames.scheme(path)
  if not s:
    return
  if s in pathnames.READ_WRITE_SCHEMES:
    configure_clients()  # before etils or Orbax make their first client of the store
  if s in pathnames.READ_ONLY_SCHEMES and writable:
    raise ValueError(f"{what} {os.fspath(path)}: {s}:// is read-only; a workdir or anything "
                     "written must be a local path, gs:// or s3://")
  if s not in pathnames.READ_WRITE_SCHEMES + pathnames.READ_ONLY_SCHEMES:
    raise ValueError(f"{what} {os.fspath(path)}: unsupported scheme {s}:// (supported: local "
                     "paths, gs://, s3://, http(s):// for reading)")


@functools.cache
def _filesystem(protocol: str, pid: int):
  """One fsspec filesystem per protocol and process (async filesystems keep an event loop and
  sessions that must not cross a fork)."""
  del pid
  import fsspec  # pylint: disable=g-import-not-at-top  # only runs that touch URLs pay for it

  configure_clients()
  if protocol in pathnames.READ_ONLY_SCHEMES:
    # fsspec's default HTTP session has a 5-minute total timeout per request and no retries
    # (retries are olmo3.io.retry's); a range read that stalls is a transient error.
    import aiohttp  # pylint: disable=g-import-not-at-top

    timeout = settings.request_timeout_s()
    return fsspec.filesystem("http", client_kwargs={
        "timeout": aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)})
  return fsspec.filesystem(protocol, skip_instance_cache=True)


def filesystem(path: str | os.PathLike):
  """The fsspec filesystem serving `path` (a URL)."""
  s = pathnames.scheme(path)
  check_supported(path)
  return _filesystem("http" if s == "https" else s, os.getpid())
