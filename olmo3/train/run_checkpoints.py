"""A training run's checkpoints: WORKDIR/checkpoints/<step>/{params, opt_state, meta}.

Each step directory is a model checkpoint (olmo3.io.checkpoint) with the optimizer state beside
the parameters, verified the same way (checksums, digest, no NaN/Inf). Orbax commits a step by
renaming its temporary directory (on object stores, where nothing renames atomically, by writing
a `commit_success.txt` last: olmo3.io.orbax_s3), so only complete steps are ever listed. Async saves overlap
training: a failed one is raised at the next step (`check`), with its cause, and is never
listed; its temporary directory is removed when the run restarts.

A damaged step is quarantined: renamed to `<step>.damaged-<n>` (a new n each time), kept for
inspection, never deleted. Rotation (checkpoint.keep) keeps the newest steps and also the step
this run resumed from, the newest one read back and verified, until the run ends.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from olmo3.io import orbax_s3, pathnames, retry
from olmo3.io.checkpoint import (ARRAYS, META, PARAMS, CheckpointError, array_records,
                              restore_items, sealed)

OPT_STATE = "opt_state"
# Room asked for beyond a checkpoint's arrays: Orbax's metadata, the step's temporary directory
# and the metrics written beside it.
ROOM_MARGIN = 1.1
_QUARANTINED = re.compile(r"(\d+)\.damaged-(\d+)")  # `<step>.damaged-<n>`


class _KeepVerified:
  """Orbax preservation policy: keeps the step this run resumed from (None: none)."""

  def __init__(self):
    self.step: int | None = None

  def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
    del context
    return [c.step == self.step for c in checkpoints]


QUIET_S = 30.0  # a save in flight that writes nothing for this long is taken as abandoned


def _in_flight(directory: epath.Path) -> dict[str, tuple[tuple[str, int], ...]]:
  """Orbax's temporary checkpoints in `directory`, each with what it holds so far (files and
  sizes): a save that is landing changes it."""
  def files(path: epath.Path):
    for p in path.iterdir():
      if p.is_dir():
        yield from files(p)
      else:
        yield os.fspath(p), p.stat().length

  found = {}
  for name in ocp.path.step.tmp_checkpoints(directory):
    with contextlib.suppress(FileNotFoundError):  # landed (renamed) while it was read
      found[name] = tuple(sorted(files(directory / name)))
  return found


def await_fenced_save(directory: str | os.PathLike, fenced: str, timeout_s: float,
                      quiet_s: float = QUIET_S) -> None:
  """Waits while a step is being written into `directory` (Orbax's temporary checkpoints), for
  a launch that took the lease from an earlier attempt of its job, `fenced`, which may still
  be running: that attempt stops at its next save, but a save it began while it held the lease
  lands after the takeover. Listing the checkpoints before it lands, this launch would resume
  from the step before it, delete its temporary files (Orbax cleans them up when a manager
  opens), and then write the same step over it. Called before the checkpoints are opened. The
  wait ends when nothing is in flight, when what is in flight has not changed for `quiet_s`
  (a save its writer abandoned: the attempt had died), or after `timeout_s`."""
  directory = pathnames.absolute(directory)
  what = "looking for a save in flight in"  # a store down: retried, then one StorageError
  if not retry.retried(directory.exists, os.fspath(directory), what):
    return
  look = lambda: retry.retried(lambda: _in_flight(directory), os.fspath(directory), what)
  if jax.process_count() > 1:
    # Only process 0 holds the lease and knows it fenced; the others wait for it at Orbax's
    # barrier where the checkpoints open, which fails after its coordination timeout.
    timeout_s = min(timeout_s, ocp.multihost.coordination_timeout() / 2)
  start = time.monotonic()
  pending = look()
  if pending:
    logging.info("%s has a save in flight (%s): this launch lists the checkpoints once it has "
                 "landed (at most %.0f s from now)", fenced, ", ".join(sorted(pending)), timeout_s)
  changed = start
  while pending and time.monotonic() - start < timeout_s:
    # Each look lists the save's files (RPCs on a bucket): once a second.
    time.sleep(1.0)
    now = look()
    if now != pending:
      pending, changed = now, time.monotonic()
    elif time.monotonic() - changed >= quiet_s:
      logging.warning("%s's save in flight (%s) wrote nothing for %.0f s: taken as abandoned; "
                      "resuming from the committed steps", fenced, ", ".join(sorted(pending)),
                      quiet_s)
      return
  if pending:
    logging.warning("%s still holds a save in flight after %.0f s (%s): resuming from the "
                    "committed steps", fenced, timeout_s, ", ".join(sorted(pending)))


class RunCheckpoints:
  def __init__(self, directory: str | os.PathLike, keep: int, async_save: bool):
    self.directory = pathnames.absolute(directory)
    self._verified = _KeepVerified()
    self._saving: int | None = None  # the step of an async save not yet known to have landed
    policies = ocp.checkpoint_managers
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(
                [policies.LatestN(n=keep), self._verified]),
            enable_async_checkpointing=async_save, cleanup_tmp_directories=True,
            temporary_path_class=orbax_s3.temporary_path_class(self.directory)))

  def steps(self) -> list[int]:
    """The committed steps, oldest first."""
    return sorted(self._manager.all_steps())

  def _listed(self) -> list[int] | str:
    """The committed steps as the directory lists them now (after a failed save, Orbax's own
    list had dropped the steps committed before it: a disk that filled during step 20's save
    said "the checkpoints are steps []" beside step 10)."""
    try:
      return sorted(self._manager.all_steps(read=True))
    except Exception as e:  # pylint: disable=broad-except  # the store may be what failed
      return f"unknown ({type(e).__name__} listing them)"

  def step_dir(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def quarantined(self) -> list[epath.Path]:
    """The damaged steps set aside, by step then by when."""
    found = [(int(m[1]), int(m[2]), p) for p in self.directory.glob("*")
             if (m := _QUARANTINED.fullmatch(p.name))] if self.directory.exists() else []
    return [p for *_, p in sorted(found)]

  def quarantine(self, step: int) -> epath.Path:
    """Moves a damaged step out of the list, to `<step>.damaged-<n>` with an n no earlier
    quarantine of this step used. Every process calls it; the first renames."""
    n = 1 + max((int(m[2]) for p in self.quarantined()
                 if (m := _QUARANTINED.fullmatch(p.name)) and int(m[1]) == step), default=0)
    if jax.process_count() > 1:
      n = int(multihost_utils.broadcast_one_to_all(np.int32(n)))
    aside = self.directory / f"{step}.damaged-{n}"
    if jax.process_index() == 0:
      self.step_dir(step).rename(aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"olmo3 quarantine {step}")
    self._manager.reload()
    return aside

  def keep_verified(self, step: int) -> None:
    """Rotation keeps `step` (read back and verified) while this run lasts: whatever may be
    wrong with the steps it writes, the last known good one survives."""
    self._verified.step = step

  def check_room(self, params: Any, opt_state: Any, keep: int, saves: int) -> None:
    """Before restoring and training toward a save (`params`, `opt_state`: arrays or their
    shapes; `saves`: the checkpoints the run has still to save): a local disk with less room
    than the checkpoints the run will add is a CheckpointError now, not after an interval's
    steps are trained and lost. Rotation (`keep`) removes an old step only once a new one has
    landed, so the directory grows to keep + 1 steps (fewer when fewer saves are to come).
    Buckets have no such bound to check."""
    if pathnames.is_url(os.fspath(self.directory)):
      return
    size = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize  # arrays or their shapes
               for x in jax.tree.leaves((params, opt_state)))
    present = len(self.steps()) if os.path.isdir(self.directory) else 0
    added = max(1, min(saves, keep + 1 - min(present, keep)))
    where = os.fspath(self.directory)
    while not os.path.exists(where):  # the workdir's checkpoints/ may not exist yet
      where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    if free >= size * added * ROOM_MARGIN:
      return
    takes = (f"a checkpoint of this run takes {size / 2**30:.2f} GiB" if added == 1 else
             f"this run adds {added} checkpoints of {size / 2**30:.2f} GiB before rotation "
             f"(checkpoint.keep={keep}) removes one")
    raise CheckpointError(
        f"{self.directory} has {free / 2**30:.2f} GiB free; {takes}: free space there"
        f"{', lower checkpoint.keep' if added > 1 else ''}, or give --workdir on a disk with "
        "room")

  def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
    """Saves a step with its arrays' records (refused, CheckpointError, if any holds NaN/Inf;
    nothing is written then). Async: `check` or `wait` raise a failure."""
    if self._saving is not None:  # Orbax would wait for it too, and raise its error unnamed
      self.wait()
    path = self.step_dir(step)
    meta = sealed({**meta, ARRAYS: array_records(path, {PARAMS: params,
                                                        OPT_STATE: opt_state})})
    self._manager.save(step, args=ocp.args.Composite(**{
        PARAMS: ocp.args.StandardSave(params),
        OPT_STATE: ocp.args.StandardSave(opt_state),
        META: ocp.args.JsonSave(meta),
    }), force=True)
    self._saving = step

  def check(self) -> None:
    """Raises a finished async save's failure now (Orbax would raise it only at the next save,
    up to checkpoint.every steps later), and this process's part of a save as soon as it has
    failed. Cheap: no wait while a save is still running."""
    if self._saving is not None and (not self._manager.is_saving_in_progress()
                                     or orbax_s3.failed_save(self._manager) is not None):
      self.wait()

  def wait(self) -> None:
    """Waits for an async save to land; CheckpointError with its cause if it failed. In a job
    of several processes, a process whose part failed raises at once: the others wait for it
    at a barrier it will not reach, and stop when it has gone (jax.distributed's heartbeat)."""
    step, self._saving = self._saving, None
    failed = orbax_s3.failed_save(self._manager) if jax.process_count() > 1 else None
    try:
      if failed is not None:
        raise failed
      self._manager.wait_until_finished()
    except Exception as e:  # whatever the storage raised: say which step, keep the cause
      error = CheckpointError(
          f"saving checkpoint step {step} to {self.directory} failed: {type(e).__name__}: {e}. "
          f"It is not listed; the checkpoints are steps {self._listed()}")
      if failed is None:
        # The save's other writers may still be running (Orbax's finalize stops at the first
        # error): let them end, so nothing writes into the directory after the run stops.
        with contextlib.suppress(Exception):
          self._manager.close()
      raise error from e


def restore_train_state(step_dir: str | os.PathLike, params_target: Any, opt_target: Any
                        ) -> tuple[Any, Any, dict[str, Any]]:
  """(params, opt_state, meta) of a training checkpoint, onto the targets' shardings, checked
  and verified (olmo3.io.checkpoint.restore_items)."""
  items, meta = restore_items(step_dir, {PARAMS: params_target, OPT_STATE: opt_target})
  return items[PARAMS], items[OPT_STATE], meta
