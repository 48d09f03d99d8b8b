"""What the storage raises: `StorageError` and its kinds, each naming the URL. How a program's
failure reaches its user (one `error:` line) is `olmo3.program`'s.
"""

from __future__ import annotations


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


def first_line(error: BaseException) -> str:
  """An error's message, its first line only (libraries append request dumps)."""
  lines = str(error).strip().splitlines()
  return lines[0][:300] if lines else ""
