"""The global instance order, with OLMo-core's semantics (docs/data.md#global-order).

Epoch e (from 1) shuffles arange(N // C) with PCG64(seed + e), each index k standing for the C
consecutive instances k·C ... k·C + C - 1 (C = DataConfig.chunk_instances, 1 unless
max_target_seq_len exceeds seq_len: OLMo-core's chunked order); the tail that does not fill a
global batch is dropped; global batch b is the b-th block of `global_batch_size` indices. Global
step s is batch s % batches_per_epoch of epoch s // batches_per_epoch + 1. Everything is a
function of (files, seq_len, max_target_seq_len, seed, global batch, step): no world size
anywhere, so any number of processes and devices sees the same sequence, and a checkpoint needs
only the step.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import zlib
from pathlib import Path

import numpy as np
from absl import logging

from olmo3.io import errors, pathnames, storage


def epoch_permutation(n_instances: int, seed: int, epoch: int, chunk: int = 1) -> np.ndarray:
  """All instance indices of `epoch` (from 1) in training order (uint32, as OLMo-core): the
  shuffled runs of `chunk` consecutive instances, each in its own order (n_instances is a
  multiple of `chunk`)."""
  if epoch < 1:
    raise ValueError(f"epoch must be >= 1, got {epoch}")
  if n_instances >= np.iinfo(np.uint32).max:
    raise ValueError(f"{n_instances} instances do not fit uint32 indices")
  if chunk < 1 or n_instances % chunk:
    raise ValueError(f"{n_instances} instances are not whole runs of {chunk}")
  runs = np.arange(n_instances // chunk, dtype=np.uint32)
  np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(runs)
  if chunk == 1:
    return runs
  return (runs[:, None] * np.uint32(chunk) + np.arange(chunk, dtype=np.uint32)).reshape(-1)


_BLOCK_BYTES = 1 << 26  # a kept order is checked in blocks of 64 MiB (16M indices)


def _block_crcs(data: memoryview | np.ndarray) -> list[int]:
  view = memoryview(data).cast("B")
  return [zlib.crc32(view[i:i + _BLOCK_BYTES]) for i in range(0, len(view), _BLOCK_BYTES)]


def order_path(n_instances: int, seed: int, epoch: int, chunk: int,
               cache_dir: str | os.PathLike) -> Path:
  return Path(cache_dir) / f"order-{n_instances}-{seed}-{epoch}-{chunk}.u32"


class KeptOrder:
  """An epoch's order kept in `cache_dir`, computed once per machine and read from there, so
  every process and loader worker of a job on that machine shares one copy in the page cache (AI2's
  stage 1: 724M instances, 2.9 GB, about a minute to compute). Never trusted unchecked: its
  sidecar (JSON) names the order's inputs, its size and a CRC-32 per 64 MiB block, and each
  block is checked the first time this process reads it (`rows`), so a restart reads the blocks
  it needs, not 2.9 GB. A missing or foreign file, a wrong size, or a block that does not match
  its CRC is computed again (under a lock: one process computes, the others wait and read) and
  replaced atomically.

  `beside` (a run whose workdir is in a bucket: WORKDIR/order): the order is kept there too, so
  that a host new to the run (a lost host's replacement, its cache empty) reads the blocks its
  steps need from the bucket, each checked against the copy's sidecar as it arrives, instead of
  computing the whole order first (a minute and a half at AI2's size). A copy that is missing,
  foreign (another order's sidecar) or damaged (a block that does not match) is never used:
  the order is computed here as without one. `keep_beside` puts this machine's order there."""

  def __init__(self, n_instances: int, seed: int, epoch: int, chunk: int,
               cache_dir: str | os.PathLike, beside: str | None = None):
    self.args = (n_instances, seed, epoch, chunk)
    self.key = {"n_instances": n_instances, "seed": seed, "epoch": epoch, "chunk": chunk}
    self.path = order_path(n_instances, seed, epoch, chunk, cache_dir)
    self.meta_path = self.path.with_suffix(".json")
    self.beside = None if beside is None else pathnames.join(beside, self.path.name)
    self.fetched: dict[int, np.ndarray] = {}  # blocks read from the copy beside the run
    blocks = None if self._blocks_recorded() is not None else self._blocks_beside()
    if blocks is None:
      self._open(recompute=False)
    else:  # read from beside the run; this machine keeps none
      self.blocks, self.checked, self.inode = blocks, set(), None
    self.reading_beside = blocks is not None

  def _blocks_valid(self, meta: dict, size: int | None) -> list[int] | None:
    blocks = meta.get("block_crc32")
    expected = -(-4 * self.args[0] // _BLOCK_BYTES)
    if (meta.get("key") == self.key and size == meta.get("bytes") == 4 * self.args[0]
        and isinstance(blocks, list) and len(blocks) == expected):
      return blocks
    return None

  def _blocks_recorded(self) -> list[int] | None:
    """The sidecar's block CRCs when it names this order and the file has its size."""
    try:
      return self._blocks_valid(json.loads(self.meta_path.read_text()), self.path.stat().st_size)
    except (OSError, ValueError, AttributeError):
      return None

  def _blocks_beside(self) -> list[int] | None:
    """The block CRCs of the copy beside the run, when there is one of this order; None (the
    order is computed here) when there is none, it is another order's, or it cannot be read."""
    if self.beside is None:
      return None
    sidecar = self.beside.removesuffix(".u32") + ".json"
    try:
      if not storage.exists(sidecar):
        return None
      size = storage.sizes([self.beside])[0]
      return self._blocks_valid(json.loads(storage.read_text(sidecar)), size)
    except Exception as e:  # pylint: disable=broad-except  # a copy is a shortcut, never needed
      logging.warning("the order kept beside the run (%s) cannot be read (%s: %s); computing it "
                      "here", self.beside, type(e).__name__, errors.first_line(e))
      return None

  def keep_beside(self) -> None:
    """Puts this machine's order beside the run (data first, then its sidecar, which makes it
    a copy) unless one of this order is there already. A job's process 0 does, once a run."""
    if self.beside is None or self.reading_beside or self._blocks_beside() == self.blocks:
      return
    try:
      storage.copy_file(self.path, self.beside)
      storage.write_bytes_atomic(self.beside.removesuffix(".u32") + ".json", json.dumps(
          {"key": self.key, "bytes": 4 * self.args[0], "block_crc32": self.blocks}).encode(),
          durability=storage.Durability.SYNCED)
    except Exception as e:  # pylint: disable=broad-except  # the run goes on without the copy
      logging.warning("could not keep the order beside the run (%s: %s: %s); a new host will "
                      "compute it", self.beside, type(e).__name__, errors.first_line(e))

  def _open(self, recompute: bool, seen: int | None = None) -> None:
    """Maps the file, computing it first when it is missing, foreign or (`recompute`) found
    damaged: unless another process replaced the file `seen` (an inode) meanwhile."""
    blocks = None if recompute else self._blocks_recorded()
    if blocks is None:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      with open(self.path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, a crash included
        blocks = self._blocks_recorded()
        replaced = seen is not None and self.path.exists() and self.path.stat().st_ino != seen
        if blocks is None or (recompute and not replaced):
          order = epoch_permutation(*self.args)
          blocks = _block_crcs(order)
          # Synced: a minute of computing for AI2's 7B, shared by every process on the machine.
          # (order.data: no copy, the order alone is 2.9 GB.)
          storage.write_bytes_atomic(self.path, order.data, durability=storage.Durability.SYNCED)
          storage.write_bytes_atomic(self.meta_path, json.dumps(
              {"key": self.key, "bytes": order.nbytes, "block_crc32": blocks}).encode(),
              durability=storage.Durability.SYNCED)
    self.blocks, self.checked = blocks, set()
    self.inode = self.path.stat().st_ino

  def _read(self, start: int, stop: int) -> np.ndarray | None:
    """Indices [start, stop) as the file holds them now, or None when it holds fewer. Read, not
    memory-mapped: a kept order cut short in place while a run maps it killed the run with
    SIGBUS; read, it is one more damaged order, computed again. (Reads go through the page
    cache all the same: the processes of a machine still share one copy.)"""
    if stop <= start:
      return np.zeros(0, np.uint32)
    with open(self.path, "rb") as f:
      data = os.pread(f.fileno(), 4 * (stop - start), 4 * start)
    return np.frombuffer(data, np.uint32) if len(data) == 4 * (stop - start) else None

  def _rows_beside(self, start: int, stop: int) -> np.ndarray | None:
    """Indices [start, stop) from the copy beside the run, each block read once and checked
    (the last two kept), or None when a block is short or does not match its CRC."""
    per_block, n, parts = _BLOCK_BYTES // 4, self.args[0], []
    for block in range(start // per_block, -(-stop // per_block)):
      lo, hi = block * per_block, min((block + 1) * per_block, n)
      data = self.fetched.get(block)
      if data is None:
        (raw,) = storage.read_ranges([(self.beside, 4 * lo, 4 * hi)])
        if len(raw) != 4 * (hi - lo) or zlib.crc32(raw) != self.blocks[block]:
          return None
        data = np.frombuffer(raw, np.uint32)
        self.fetched = {**dict(list(self.fetched.items())[-1:]), block: data}
      parts.append(data[max(start, lo) - lo:min(stop, hi) - lo])
    return np.concatenate(parts) if parts else np.zeros(0, np.uint32)

  def rows(self, start: int, stop: int) -> np.ndarray:
    """Indices [start, stop) of the order, their blocks checked (once per process)."""
    if self.reading_beside:
      out = self._rows_beside(start, stop)
      if out is not None:
        return out
      logging.warning("the order kept beside the run (%s) is damaged; computing it here",
                      self.beside)
      self.reading_beside, self.fetched = False, {}
      self._open(recompute=False)
    per_block, n = _BLOCK_BYTES // 4, self.args[0]
    for block in range(start // per_block, -(-stop // per_block)):
      if block in self.checked:
        continue
      data = self._read(block * per_block, min((block + 1) * per_block, n))
      if data is None or zlib.crc32(memoryview(data).cast("B")) != self.blocks[block]:
        self._open(recompute=True, seen=self.inode)  # damaged: computed again, then re-read
        return self.rows(start, stop)
      self.checked.add(block)
    out = self._read(start, stop)
    if out is None:  # cut short since its blocks were checked
      self._open(recompute=True, seen=self.inode)
      return self.rows(start, stop)
    return out


class GlobalOrder:
  """Which instances make up each global step's batch. With `cache_dir`, each epoch's order
  is kept once per machine and shared (`KeptOrder`); without, computed in this process."""

  def __init__(self, n_instances: int, global_batch_size: int, seed: int, chunk: int = 1,
               cache_dir: str | os.PathLike | None = None, beside: str | None = None,
               keeps_beside: bool = False):
    if n_instances < global_batch_size:
      raise ValueError(f"{n_instances} instances cannot fill one global batch of "
                       f"{global_batch_size}")
    self.n_instances = n_instances
    self.global_batch_size = global_batch_size
    self.seed = seed
    self.chunk = chunk
    self.cache_dir = cache_dir
    self.beside, self.keeps_beside = beside, keeps_beside
    self.batches_per_epoch = n_instances // global_batch_size

  def prepare(self, epoch: int) -> None:
    """Computes `epoch`'s kept order here when the machine has none yet and none is kept
    beside the run (the loader's process, before its workers start: they then only read it);
    with `keeps_beside` (a job's process 0), also puts it beside the run when it is not there."""
    if self.cache_dir is not None:
      order = self._epoch(epoch)
      if self.keeps_beside:
        order.keep_beside()

  @functools.lru_cache(maxsize=2)
  def _epoch(self, epoch: int) -> np.ndarray | KeptOrder:
    if self.cache_dir is None:
      return epoch_permutation(self.n_instances, self.seed, epoch, self.chunk)
    return KeptOrder(self.n_instances, self.seed, epoch, self.chunk, self.cache_dir, self.beside)

  def epoch_of(self, step: int) -> int:
    return step // self.batches_per_epoch + 1

  def batch(self, step: int) -> np.ndarray:
    """Instance indices [global_batch_size] of global step `step` (from 0)."""
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    order = self._epoch(self.epoch_of(step))
    start = (step % self.batches_per_epoch) * self.global_batch_size
    stop = start + self.global_batch_size
    return order.rows(start, stop) if isinstance(order, KeptOrder) else order[start:stop]
