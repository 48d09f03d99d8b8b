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
whole step's rows) and retried with exponential backoff on transient errors (connection resets,
timeouts, HTTP 429 / 5xx). A file that is not there is a `FileNotFoundError` at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

READ_WRITE_SCHEMES = ("gs", "s3")
READ_ONLY_SCHEMES = ("http", "https")
ATTEMPTS = 6  # a transient error is retried 5 times: 0.25, 0.5, 1, 2, 4 s (+ jitter) apart
_FIRST_BACKOFF_S = 0.25


class StorageError(OSError):
  """A remote read or write failed for good (after retries). The message names the URL."""


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


@functools.cache
def _filesystem(protocol: str, pid: int):
  """One fsspec filesystem per protocol and process (async filesystems keep an event loop and
  sessions that must not cross a fork)."""
  del pid
  import fsspec  # pylint: disable=g-import-not-at-top  # only runs that touch URLs pay for it

  if protocol in READ_ONLY_SCHEMES:
    # fsspec's default HTTP session has a 5-minute total timeout per request and no retries
    # (retries are ours, below); a range read that stalls for a minute is a transient error.
    import aiohttp  # pylint: disable=g-import-not-at-top

    return fsspec.filesystem("http", client_kwargs={
        "timeout": aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=60)})
  return fsspec.filesystem(protocol, skip_instance_cache=True)


def filesystem(path: str | os.PathLike):
  """The fsspec filesystem serving `path` (a URL)."""
  s = scheme(path)
  check_supported(path)
  return _filesystem("http" if s == "https" else s, os.getpid())


def _host(path: str) -> str:
  return path.partition("://")[2].partition("/")[0]


def _is_transient(error: BaseException) -> bool:
  """Worth retrying: the network or the service, not the request."""
  if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
    return False
  status = getattr(error, "status", None) or getattr(error, "code", None)
  if isinstance(status, int):
    return status == 408 or status == 429 or status >= 500
  try:
    import aiohttp  # pylint: disable=g-import-not-at-top

    if isinstance(error, aiohttp.ClientError):
      return True
  except ImportError:
    pass
  return isinstance(error, (ConnectionError, TimeoutError, asyncio.TimeoutError))


def _backoff(attempt: int) -> float:
  return _FIRST_BACKOFF_S * 2 ** attempt * (1 + 0.25 * random.random())


def concurrency() -> int:
  """Requests in flight per host (OLMO3_STORAGE_CONCURRENCY, default 64)."""
  value = os.environ.get("OLMO3_STORAGE_CONCURRENCY", "64")
  if not value.isdigit() or int(value) < 1:
    raise ValueError(f"OLMO3_STORAGE_CONCURRENCY={value!r}: expected a positive integer")
  return int(value)


def _retried(call, url: str):
  """An async factory: `call()` awaited, retried on transient errors with backoff."""
  async def attempt_all():
    for attempt in range(ATTEMPTS):
      try:
        return await call()
      except Exception as e:  # pylint: disable=broad-except  # classified just below
        if not _is_transient(e):
          raise
        if attempt == ATTEMPTS - 1:
          raise StorageError(f"{url}: {type(e).__name__}: {e} (after {ATTEMPTS} attempts)"
                             ) from e
        await asyncio.sleep(_backoff(attempt))
    raise AssertionError("unreachable")

  return attempt_all


def _remote_all(calls: Sequence[tuple[str, Callable[[Any, str], Awaitable[Any]]]]) -> list[Any]:
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
          return await _retried(lambda: call(fs, url), url)()

      return await asyncio.gather(*(one(i) for i in indices))

    for i, result in zip(indices, asyn.sync(fs.loop, gather)):
      out[i] = result
  return out


def _sync_retried(call, url: str):
  """`call()` retried on transient errors, for the synchronous filesystems' calls."""
  for attempt in range(ATTEMPTS):
    try:
      return call()
    except Exception as e:  # pylint: disable=broad-except  # classified just below
      if not _is_transient(e):
        raise
      if attempt == ATTEMPTS - 1:
        raise StorageError(f"{url}: {type(e).__name__}: {e} (after {ATTEMPTS} attempts)") from e
      time.sleep(_backoff(attempt))
  raise AssertionError("unreachable")


def exists(path: str | os.PathLike) -> bool:
  text = os.fspath(path)
  if not is_url(text):
    return os.path.exists(text)
  fs = filesystem(text)
  return bool(_sync_retried(lambda: fs.exists(text), text))


def is_dir(path: str | os.PathLike) -> bool:
  text = os.fspath(path)
  if not is_url(text):
    return os.path.isdir(text)
  if scheme(text) in READ_ONLY_SCHEMES:
    return False  # HTTP has files only
  fs = filesystem(text)
  return bool(_sync_retried(lambda: fs.isdir(text), text))


async def _http_size(fs, url: str) -> int | None:
  """A HEAD request's Content-Length (None: 404). Not fsspec's `_info`, which turns every
  failure, a transient 503 included, into FileNotFoundError."""
  session = await fs.set_session()
  async with session.head(url, allow_redirects=True,
                          headers={"Accept-Encoding": "identity"}) as response:
    if response.status == 404:
      return None
    response.raise_for_status()  # aiohttp.ClientResponseError: retried when transient
    if "Content-Length" not in response.headers:
      raise StorageError(f"{url}: the server does not report the file's size")
    return int(response.headers["Content-Length"])


async def _size(fs, url: str) -> int | None:
  """A remote file's size in bytes (None: no such file)."""
  if scheme(url) in READ_ONLY_SCHEMES:
    return await _http_size(fs, url)
  try:
    found = await fs._info(url)  # pylint: disable=protected-access
  except FileNotFoundError:
    return None
  if found.get("type") == "directory":
    return None
  if found.get("size") is None:
    raise StorageError(f"{url}: the server does not report the file's size")
  return int(found["size"])


def sizes(paths: Sequence[str | os.PathLike]) -> list[int | None]:
  """Each file's size in bytes (None: it does not exist), remote ones looked up concurrently."""
  texts = [os.fspath(p) for p in paths]
  out = [None if is_url(t) else (os.path.getsize(t) if os.path.isfile(t) else None)
         for t in texts]
  remote = [i for i, t in enumerate(texts) if is_url(t)]
  for i, size in zip(remote, _remote_all([(texts[i], _size) for i in remote])):
    out[i] = size
  return out


def _ranged(start: int, end: int):
  async def call(fs, url: str) -> bytes:
    data = await fs._cat_file(url, start=start, end=end)  # pylint: disable=protected-access
    if len(data) != end - start:
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
  _sync_retried(lambda: fs.pipe_file(text, data), text)


class SizeCache:
  """Remote files' sizes, read once and kept in a JSON file (`path`, e.g. in the workdir), so a
  resumed run does not look up thousands of files again (OLMo-core keeps the same kind of
  cache). Local files are never cached: a stat costs nothing. A cached URL is trusted as its
  size: replace a remote file under a new name. Sizes looked up are remembered; `save` writes
  them (a launcher's checks look up without writing, before it has decided to write anything)."""

  def __init__(self, path: str | os.PathLike | None):
    self.path = None if path is None else os.fspath(path)
    self._known: dict[str, int] = {}
    self._unsaved = False
    if self.path is not None and exists(self.path):
      try:
        self._known = {str(k): int(v) for k, v in json.loads(read_text(self.path)).items()}
      except (ValueError, AttributeError):  # unreadable: looked up again and rewritten
        self._known = {}

  def sizes(self, paths: Sequence[str | os.PathLike]) -> list[int | None]:
    texts = [os.fspath(p) for p in paths]
    missing = [t for t in texts if not (is_url(t) and t in self._known)]
    found = dict(zip(missing, sizes(missing)))
    fresh = {t: s for t, s in found.items() if is_url(t) and s is not None}
    if fresh:
      self._known.update(fresh)
      self._unsaved = True
    return [self._known[t] if t in self._known else found[t] for t in texts]

  def save(self) -> None:
    """Writes the sizes to `path` if any were looked up since it was read."""
    if self._unsaved and self.path is not None:
      write_bytes_atomic(self.path, json.dumps(self._known, indent=0, sort_keys=True).encode())
      self._unsaved = False
