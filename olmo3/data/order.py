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

import functools

import numpy as np


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


class GlobalOrder:
  """Which instances make up each global step's batch."""

  def __init__(self, n_instances: int, global_batch_size: int, seed: int, chunk: int = 1):
    if n_instances < global_batch_size:
      raise ValueError(f"{n_instances} instances cannot fill one global batch of "
                       f"{global_batch_size}")
    self.n_instances = n_instances
    self.global_batch_size = global_batch_size
    self.seed = seed
    self.chunk = chunk
    self.batches_per_epoch = n_instances // global_batch_size

  @functools.lru_cache(maxsize=2)
  def _epoch_batches(self, epoch: int) -> np.ndarray:
    kept = self.batches_per_epoch * self.global_batch_size
    return epoch_permutation(self.n_instances, self.seed, epoch, self.chunk)[:kept].reshape(
        self.batches_per_epoch, self.global_batch_size)

  def epoch_of(self, step: int) -> int:
    return step // self.batches_per_epoch + 1

  def batch(self, step: int) -> np.ndarray:
    """Instance indices [global_batch_size] of global step `step` (from 0)."""
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    return self._epoch_batches(self.epoch_of(step))[step % self.batches_per_epoch]
