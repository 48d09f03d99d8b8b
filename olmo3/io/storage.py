"""Files, local or remote, behind one small API: whether a file is there, its size (and version),
its bytes (whole or by range), a whole file written so that a reader never sees a part of it
(the one whole-file writer, `write_bytes_atomic`, each caller choosing its `Durability`), and
its removal. Local paths, `gs://`, `s3://` (read and write) and `http(s)://` (read only, how
AI2 serves its token files publicly), through the clients olmo3.io.clients sets up.

Reads of token files are ranged (only the bytes an instance needs), concurrent (a bounded number
of requests in flight per host, `OLMO3_STORAGE_CONCURRENCY`, default 64), batched (one call reads a
whole step's rows) and retried with exponential backoff on transient errors (olmo3.io.retry). A
file that is not there is a `FileNotFoundError` at once. An HTTP server must answer Range
requests: the first look at a file over HTTP (its size, whether it exists) checks that it does.

Outages end in bounded time: every request has a deadline (`OLMO3_STORAGE_TIMEOUT_S`, default
60 s) and an operation's transient failures are retried within one budget
(`OLMO3_STORAGE_RETRY_S`, default 180 s: olmo3.io.settings); past it the operation raises
`StorageError` naming itself and its URL. Missing or refused credentials are `NoAccess`, naming
the URL and what to set. Beside this module: `pathnames` (how names are spelt), `file_sizes`
(the sizes a run recorded), `conditional` (writes that check nobody else wrote).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import os
import shutil
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from olmo3.io import clients, errors, pathnames, retry, settings

def concurrently(calls: Sequence[tuple[str, Callable[[Any, str], Awaitable[Any]]]],
                 what: str = "reading") -> list[Any]:
  """`await call(fs, url)` for each (url, call), all at once: at most `settings.concurrency()`
  in flight per host, each retried on transient errors. The results, in order."""
  from fsspec import asyn  # pylint: disable=g-import-not-at-top

  limit = settings.concurrency()
  out: list[Any] = [None] * len(calls)
  by_protocol: dict[str, list[int]] = {}
  for i, (url, _) in enumerate(calls):
    by_protocol.setdefault(pathnames.scheme(url).replace("https", "http"), []).append(i)
  for indices in by_protocol.values():
    fs = clients.filesystem(calls[indices[0]][0])

    async def gather():
      gates = {pathnames.host(calls[i][0]): asyncio.Semaphore(limit) for i in indices}

      async def one(i):
        url, call = calls[i]
        async with gates[pathnames.host(url)]:
          return await retry.retried_async(lambda: call(fs, url), url, what)()

      return await asyncio.gather(*(one(i) for i in indices))

    for i, result in zip(indices, asyn.sync(fs.loop, gather)):
      out[i] = result
  return out


def exists(path: str | os.PathLike) -> bool:
  text = os.fspath(path)
  if not pathnames.is_url(text):
    return os.path.exists(text)
  if pathnames.scheme(text) in pathnames.READ_ONLY_SCHEMES:
    # fsspec's HTTP `exists` takes a refused connection for a missing file; the size lookup
    # retries it, and proves the server answers Range requests (`_http_size`).
    return sizes([text])[0] is not None
  fs = clients.filesystem(text)
  return bool(retry.retried(lambda: fs.exists(text), text, "looking up"))


def is_dir(path: str | os.PathLike) -> bool:
  text = os.fspath(path)
  if not pathnames.is_url(text):
    return os.path.isdir(text)
  if pathnames.scheme(text) in pathnames.READ_ONLY_SCHEMES:
    return False  # HTTP has files only
  fs = clients.filesystem(text)
  return bool(retry.retried(lambda: fs.isdir(text), text, "looking up"))


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
      raise errors.StorageError(
          f"{url}: the server does not support HTTP Range requests (asked for one byte, it "
          "sent the whole file); data is read over http(s):// by range: serve it with a server "
          "that does (python -m olmo3.data.serve DIR)")
    if response.status != 416:  # 416: an empty file has no first byte
      response.raise_for_status()  # aiohttp.ClientResponseError: retried when transient
    total = response.headers.get("Content-Range", "").rpartition("/")[2]
    if not total.isdigit():
      raise errors.StorageError(f"{url}: the server does not report the file's size")
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
  if pathnames.scheme(url) in pathnames.READ_ONLY_SCHEMES:
    size = await _http_size(fs, url)
    return None if size is None else Stat(size)
  try:
    found = await fs._info(url)  # pylint: disable=protected-access
  except FileNotFoundError:
    return None
  if found.get("type") == "directory":
    return None
  if found.get("size") is None:
    raise errors.StorageError(f"{url}: the server does not report the file's size")
  version = found.get("generation") or found.get("ETag")
  return Stat(int(found["size"]), None if version is None else str(version))


def stats(paths: Sequence[str | os.PathLike]) -> list[Stat | None]:
  """Each file's Stat (None: it does not exist), remote ones looked up concurrently."""
  texts = [os.fspath(p) for p in paths]
  out = [None if pathnames.is_url(t) else (Stat(os.path.getsize(t)) if os.path.isfile(t)
                                           else None) for t in texts]
  remote = [i for i, t in enumerate(texts) if pathnames.is_url(t)]
  for i, found in zip(remote, concurrently([(texts[i], _stat) for i in remote], "looking up")):
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
        raise errors.ChangedSince(
            f"{url}: bytes [{start:,}, {end:,}) start past the file's end (the store answered "
            "416): it is shorter than when its size was looked up") from None
      raise
    if len(data) < end - start:
      raise errors.ChangedSince(
          f"{url}: asked for bytes [{start:,}, {end:,}), got {len(data):,}: the file is shorter "
          "than when its size was looked up")
    if len(data) > end - start:
      # A server that ignores Range sends the whole file: never take it for the range.
      raise errors.StorageError(f"{url}: asked for bytes [{start}, {end}), got {len(data)} "
                                "bytes (does the server support HTTP Range requests?)")
    return data
  return call


def read_ranges(requests: Sequence[tuple[str | os.PathLike, int, int]]) -> list[bytes]:
  """The bytes [start, end) of each (path, start, end), in order. Local files are read
  directly; remote ones with one ranged request each, concurrently, retried."""
  texts = [os.fspath(path) for path, _, _ in requests]
  out: list[bytes | None] = [None] * len(requests)
  for i, (text, (_, start, end)) in enumerate(zip(texts, requests)):
    if not pathnames.is_url(text):
      with open(text, "rb") as f:
        f.seek(start)
        out[i] = f.read(end - start)
  remote = [i for i, t in enumerate(texts) if pathnames.is_url(t)]
  chunks = concurrently([(texts[i], _ranged(*requests[i][1:])) for i in remote])
  for i, chunk in zip(remote, chunks):
    out[i] = chunk
  return out  # type: ignore[return-value]


def read_bytes(path: str | os.PathLike) -> bytes:
  text = os.fspath(path)
  if not pathnames.is_url(text):
    with open(text, "rb") as f:
      return f.read()
  fs = clients.filesystem(text)
  return retry.retried(lambda: fs.cat_file(text), text)


def read_text(path: str | os.PathLike) -> str:
  return read_bytes(path).decode()


class Durability(enum.Enum):
  """How far a whole-file write goes before it returns, chosen by each caller (a line says why).
  Either way the file is whole or absent; the difference is a machine's crash or power loss
  (a process's crash loses nothing the write returned from)."""

  # The bytes are the operating system's: a reader sees them at once, but a power loss may
  # lose them (the old file, an empty one or none in their place). For what is rewritten often,
  # cached, or checked when read (metrics, caches, prepared data checked against its manifest).
  FLUSHED = "flushed"
  # The file and its directory entry fsynced: on the disk when the write returns. For what a
  # later launch relies on unchecked (the run record) or is costly to redo (an epoch's order).
  SYNCED = "synced"


def write_bytes_atomic(path: str | os.PathLike, data: bytes | memoryview, *,
                       durability: Durability) -> None:
  """Writes a whole file so that a reader sees the old contents or the new, never a part.
  Local: into a temporary file of a name no other writer uses, in the same directory (the
  rename stays within one filesystem), renamed over `path` (POSIX rename is atomic); the
  temporary removed if anything fails. An object (gs://, s3://): one upload, which object
  stores publish only when it completes, durable once acknowledged (`durability` is met). The
  one whole-file writer: `olmo3.io.conditional`'s writes that check nobody else wrote are
  another job."""
  text = os.fspath(path)
  clients.check_supported(text, writable=True)
  if pathnames.is_url(text):
    fs = clients.filesystem(text)
    payload = data if isinstance(data, bytes) else bytes(data)
    retry.retried(lambda: fs.pipe_file(text, payload), text, "writing")
    return
  directory, name = os.path.split(os.path.abspath(text))
  os.makedirs(directory, exist_ok=True)
  # Hidden, and unique ("x": created here or an error, never another writer's file): two
  # writers of one file (two processes of a job, two runs of a tool) never share a temporary.
  tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:16]}.tmp")
  try:
    with open(tmp, "xb") as f:
      f.write(data)
      if durability is Durability.SYNCED:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, text)
  except BaseException as e:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    if isinstance(e, OSError) and e.filename in (None, tmp):
      # A full disk's ENOSPC names no file (and the temporary is gone): say which file was
      # being written, keeping the error's type and errno for whoever handles it.
      raise type(e)(e.errno, f"writing {text}: {e.strerror}") from None
    raise
  if durability is Durability.SYNCED:  # the rename itself: the directory's entry
    descriptor = os.open(directory, os.O_RDONLY)
    try:
      os.fsync(descriptor)
    finally:
      os.close(descriptor)


def copy_file(local: str | os.PathLike, path: str | os.PathLike) -> None:
  """Copies the local file `local` to `path`, whole or not at all, streamed (a file of
  gigabytes is never held in memory): one upload to an object store (published when it
  completes), or a temporary renamed into place on a disk."""
  text = os.fspath(path)
  clients.check_supported(text, writable=True)
  if pathnames.is_url(text):
    fs = clients.filesystem(text)
    retry.retried(lambda: fs.put_file(os.fspath(local), text), text, "writing")
    return
  directory, name = os.path.split(os.path.abspath(text))
  os.makedirs(directory, exist_ok=True)
  tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:16]}.tmp")
  try:
    shutil.copyfile(local, tmp)
    os.replace(tmp, text)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


def remove(path: str | os.PathLike) -> None:
  """Removes a file (nothing if it is not there)."""
  text = os.fspath(path)
  if not pathnames.is_url(text):
    with contextlib.suppress(FileNotFoundError):
      os.unlink(text)
    return
  fs = clients.filesystem(text)

  def rm():
    with contextlib.suppress(FileNotFoundError):
      fs.rm_file(text)

  retry.retried(rm, text, "removing")

