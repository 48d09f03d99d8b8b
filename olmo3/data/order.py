"""The global instance order, with OLMo-core's semantics (docs/data.md#global-order).

Epoch e (from 1) shuffles arange(N) with PCG64(seed + e); the tail that does not fill a global
batch is dropped; global batch b is the b-th block of `global_batch_size` indices. Global step
s is batch s % batches_per_epoch of epoch s // batches_per_epoch + 1. Everything is a function
of (files, seq_len, seed, global batch, step): no world size anywhere, so any number of
processes and devices sees the same sequence, and a checkpoint needs only the step.
"""

from __future__ import annotations

import functools

import numpy as np


def epoch_permutation(n_instances: int, seed: int, epoch: int) -> np.ndarray:
  """All instance indices of `epoch` (from 1) in training order (uint32, as OLMo-core)."""
  if epoch < 1:
    raise ValueError(f"epoch must be >= 1, got {epoch}")
  if n_instances >= np.iinfo(np.uint32).max:
    raise ValueError(f"{n_instances} instances do not fit uint32 indices")
  indices = np.arange(n_instances, dtype=np.uint32)
  np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(indices)
  return indices


class GlobalOrder:
  """Which instances make up each global step's batch."""

  def __init__(self, n_instances: int, global_batch_size: int, seed: int):
    if n_instances < global_batch_size:
      raise ValueError(f"{n_instances} instances cannot fill one global batch of "
                       f"{global_batch_size}")
    self.n_instances = n_instances
    self.global_batch_size = global_batch_size
    self.seed = seed
    self.batches_per_epoch = n_instances // global_batch_size

  @functools.lru_cache(maxsize=2)
  def _epoch_batches(self, epoch: int) -> np.ndarray:
    kept = self.batches_per_epoch * self.global_batch_size
    return epoch_permutation(self.n_instances, self.seed, epoch)[:kept].reshape(
        self.batches_per_epoch, self.global_batch_size)

  def epoch_of(self, step: int) -> int:
    return step // self.batches_per_epoch + 1

  def batch(self, step: int) -> np.ndarray:
    """Instance indices [global_batch_size] of global step `step` (from 0)."""
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    return self._epoch_batches(self.epoch_of(step))[step % self.batches_per_epoch]
