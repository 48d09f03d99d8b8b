"""Conditional writes: a writer changes a file only if nobody else did meanwhile
(`read_versioned`, then `create_exclusive` or `replace_if`; PreconditionFailed when another
writer got there first). A local file through a link (create) or a rename-aside (replace); GCS
with an `ifGenerationMatch` precondition, S3 with `If-None-Match` / `If-Match` (both stores
check them on the server). Remote ones are retried on transient errors within the retry budget
(olmo3.io.retry). `olmo3.run.lease` uses them."""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import json
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from olmo3.io import clients, errors, pathnames, storage


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
  if isinstance(error, (FileExistsError, errors.PreconditionFailed)):
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
  if pathnames.scheme(url) == "gs":
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
  clients.check_supported(text, writable=True)
  if not pathnames.is_url(text):
    try:
      with open(text, "rb") as f:
        return Versioned(f.read(), "", os.fstat(f.fileno()).st_mtime)
    except FileNotFoundError:
      return None
  return storage.concurrently([(text, _read_versioned)])[0]


def _conditional(text: str, write: Callable[[Any, str], Awaitable[str]]) -> str:
  """A remote conditional write, retried on transient errors; PreconditionFailed when refused."""
  try:
    return storage.concurrently([(text, write)], "writing")[0]
  except Exception as e:  # pylint: disable=broad-except  # classified just below
    if _is_precondition_failure(e):
      raise errors.PreconditionFailed(f"{text} was changed by another writer") from e
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
      raise errors.PreconditionFailed(f"{text} exists") from None
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)


def create_exclusive(path: str | os.PathLike, data: bytes) -> str:
  """Creates the file with `data` only if it does not exist (PreconditionFailed if it does);
  its version."""
  text = os.fspath(path)
  clients.check_supported(text, writable=True)
  if not pathnames.is_url(text):
    _link_new(text, data)
    return ""
  if pathnames.scheme(text) == "gs":
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
  clients.check_supported(text, writable=True)
  if not pathnames.is_url(text):
    aside = f"{text}.{uuid.uuid4().hex}.aside"
    try:
      os.rename(text, aside)
    except FileNotFoundError:
      raise errors.PreconditionFailed(f"{text} was removed by another writer") from None
    try:
      with open(aside, "rb") as f:
        moved = f.read()
      if moved != expected.data:
        with contextlib.suppress(FileExistsError):
          os.link(aside, text)  # put back what another writer wrote (unless a third did)
        raise errors.PreconditionFailed(f"{text} was changed by another writer")
    finally:
      os.unlink(aside)
    _link_new(text, data)
    return ""
  if pathnames.scheme(text) == "gs":
    return _conditional(text, lambda fs, url: _gcs_upload(fs, url, data, expected.version))

  async def s3_replace(fs, url):
    # pylint: disable-next=protected-access
    out = await fs._pipe_file(url, data, IfMatch=expected.version)
    return str(out["ETag"])

  return _conditional(text, s3_replace)

