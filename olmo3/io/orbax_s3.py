"""Orbax checkpoints on S3, and within the storage retry budget: the one place this repo works
around Orbax.

Why: orbax-checkpoint 0.12.8 writes arrays through TensorStore, whose `s3` key-value driver is
complete, but Orbax builds a TensorStore spec only for `gs://` URLs and local absolute paths: an
`s3://` directory fails with "Checkpoint path should be absolute" (its `_normalize_path` also
collapses `s3://` to `s3:/`). And only for `gs://` does it mark a finished save with a
`commit_success.txt` file instead of a rename: an object store has no atomic directory rename,
so on S3 a save must be committed the way it is on GCS.

`install()` teaches Orbax's spec builder the `s3` driver (bucket and key prefix from the URL;
`AWS_ENDPOINT_URL` / `AWS_REGION` into the spec, credentials from the `AWS_*` environment, as
TensorStore reads them), and
`temporary_path_class(directory)` is what every checkpoint manager and checkpointer here passes,
so object-store saves are committed by that file everywhere (Orbax's own default for gs://).
`is_committed` is the matching check for readers that list step directories themselves.
`failed_save` reads the error of this process's part of an async save as soon as it failed
(`install` has Orbax keep a copy of it).
tests/test_storage.py saves, lists and restores through a real S3 server (moto).

`install()` also bounds TensorStore's own retries on GCS and S3 (Orbax builds every
TensorStore context from two module dicts): by default TensorStore retries a request 32 times
up to 32 s apart, so a save into a store that went down would outlast the storage retry budget
(`OLMO3_STORAGE_RETRY_S`, olmo3.io.settings) by a quarter of an hour. The retries are counted
with their request timeouts (`clients.tensorstore_retries`): a store that stalls (accepts
connections, never answers) fails a save's requests within the budget plus one timeout.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from etils import epath
from orbax.checkpoint._src.checkpointers import async_checkpointer
from orbax.checkpoint._src.path import atomicity, gcs_utils, step as step_lib
from orbax.checkpoint._src.serialization import tensorstore_utils

from olmo3.io import clients, pathnames

_S3 = "s3://"
_FAILED = "olmo3_failed"  # where `install` keeps a failed commit's error (`failed_save`)


def _s3_kvstore(path: str) -> dict[str, Any]:
  bucket, _, key = path[len(_S3):].partition("/")
  if not bucket:
    raise ValueError(f"{path}: an s3:// URL needs a bucket name")
  spec = {"driver": "s3", "bucket": bucket, "path": key}
  # TensorStore reads the AWS credentials from the environment but not the endpoint: an
  # S3-compatible store (or an emulator) given as AWS_ENDPOINT_URL goes into the spec.
  endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
  if endpoint:
    spec["endpoint"] = endpoint
  region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
  if region:
    spec["aws_region"] = region
  return spec


@functools.cache
def install() -> None:
  """Patches Orbax (once per process) so `s3://` directories use TensorStore's s3 driver, its
  retries end within the budget and a failed commit's error can be read (`failed_save`)."""
  normalize, use_native, for_gcs = (tensorstore_utils._normalize_path,  # pylint: disable=protected-access
                                    tensorstore_utils._use_gcs_driver,  # pylint: disable=protected-access
                                    gcs_utils.get_kvstore_for_gcs)

  def _normalize_path(path: str) -> str:
    if path.startswith(_S3):
      return _S3 + os.path.normpath(path[len(_S3):])
    return normalize(path)

  def _use_gcs_driver(directory: str) -> bool:  # "a native object-store driver", in effect
    return directory.startswith(_S3) or use_native(directory)

  def get_kvstore_for_gcs(path: str) -> dict[str, Any]:
    return _s3_kvstore(path) if str(path).startswith(_S3) else for_gcs(path)

  tensorstore_utils._normalize_path = _normalize_path  # pylint: disable=protected-access
  tensorstore_utils._use_gcs_driver = _use_gcs_driver  # pylint: disable=protected-access
  gcs_utils.get_kvstore_for_gcs = get_kvstore_for_gcs
  for name in ("_BASE_TS_CONTEXT", "_DEFAULT_OCDBT_TS_CONTEXT"):  # deep-copied at each use
    base = getattr(tensorstore_utils, name)
    setattr(tensorstore_utils, name, clients.tensorstore_context(base))
  _keep_commit_failures()


def temporary_path_class(directory: str | os.PathLike):
  """How a save into `directory` is committed: a `commit_success.txt` on object stores, a
  rename on local disks (None: Orbax's default, which is that)."""
  install()
  if not pathnames.is_url(os.fspath(directory)):
    return None
  clients.configure_clients()  # Orbax's own file operations (through etils) are budgeted too
  return atomicity.CommitFileTemporaryPath


def is_committed(step_dir: str | os.PathLike) -> bool:
  """Whether a step directory holds a finished save (see `temporary_path_class`)."""
  path = epath.Path(step_dir)
  return step_lib.is_path_finalized(path, temporary_path_cls=temporary_path_class(path) or
                                    atomicity.AtomicRenameTemporaryPath)


def failed_save(manager: Any) -> BaseException | None:
  """The error of this process's part of `manager`'s (an ocp.CheckpointManager) latest async
  save, once that part has failed; None while it runs or after it succeeded. Why: when one
  process's part of a multi-process save fails, Orbax's background commit skips the barrier at
  which the other processes then wait for it, and this process's finalize thread takes the
  error and waits at another barrier: every process waits for Orbax's async timeout (20
  minutes) before any raises, and `wait_until_finished` with them. `install` keeps the error
  where this reads it."""
  async_manager = getattr(getattr(manager, "_checkpointer", None), "_async_manager", None)
  return getattr(async_manager, _FAILED, None)


def _keep_commit_failures() -> None:
  """Orbax's background commit keeps its error until the finalize thread takes it; a copy
  stays on the async manager (`failed_save`), made before the commit thread ends."""
  manager_class = async_checkpointer._AsyncManager  # pylint: disable=protected-access
  commit = manager_class._thread_func  # pylint: disable=protected-access

  def thread_func(self, *args, **kwargs):
    setattr(self, _FAILED, None)
    commit(self, *args, **kwargs)
    setattr(self, _FAILED, self._exception)  # pylint: disable=protected-access

  manager_class._thread_func = thread_func  # pylint: disable=protected-access
