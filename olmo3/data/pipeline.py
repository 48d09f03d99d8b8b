"""The training input pipeline: global order -> this process's rows -> Grain -> global jax.Array.

Sharding happens exactly once, here: `HostRows` asks the batch sharding which rows of the
global batch this process's devices hold, and each step reads only those rows. Nothing else
splits the data: no Grain shard options, no per-host sampler. Grain runs the reading (worker
processes, bounded prefetch); each element is one global step's host-local rows, so Grain's
workers divide steps, never rows. The position stored in checkpoints is the global step alone.

A batch is a dict of numpy arrays over this process's rows:
  input_ids [R, T] int32   the instance's tokens
  labels    [R, T] int32   input_ids shifted left; -1 where there is no target (the last
                           position, and every position of an instance the repetition filter masks)
  instance  [R]    int64   global instance index (for audits)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grain
import jax
import numpy as np
from etils import epath

from olmo3.config import DataConfig, RepetitionFilter
from olmo3.data import filters, grain_compat
from olmo3.data.order import GlobalOrder
from olmo3.data.tokens import DataError, TokenFiles, read_mix

IGNORE = -1  # label of a position with no target


def token_files(cfg: DataConfig, vocab_size: int | None) -> TokenFiles:
  """The configured token files (from `paths`, or a mix), checked at startup."""
  if cfg.mix:
    paths = read_mix(cfg.mix, cfg.root, cfg.tokenizer_id)
  else:
    paths = [epath.Path(cfg.root) / p if cfg.root else epath.Path(p) for p in cfg.paths]
  return TokenFiles(paths, cfg.seq_len, vocab_size, validate_tokens=cfg.validate_tokens)


def labels_for(tokens_RT: np.ndarray) -> np.ndarray:
  """Next-token labels: tokens shifted left, the last position without a target."""
  labels = np.empty_like(tokens_RT)
  labels[:, :-1] = tokens_RT[:, 1:]
  labels[:, -1] = IGNORE
  return labels


@dataclasses.dataclass(frozen=True)
class HostRows:
  """The rows of the global batch this process reads, and where each local device's shard is."""

  rows: np.ndarray  # sorted global row indices held by this process's devices
  shards: tuple[tuple[jax.Device, np.ndarray, slice], ...]  # (device, positions in rows, cols)

  @classmethod
  def of(cls, sharding: jax.sharding.Sharding, global_batch: int, seq_len: int) -> HostRows:
    index_map = sharding.addressable_devices_indices_map((global_batch, seq_len))
    per_device = {d: (np.arange(global_batch)[idx[0]], idx[1]) for d, idx in index_map.items()}
    rows = np.unique(np.concatenate([r for r, _ in per_device.values()]))
    shards = tuple((d, np.searchsorted(rows, r), cols) for d, (r, cols) in per_device.items())
    return cls(rows, shards)


class ReadStep(grain.transforms.Map):
  """Global step -> this process's rows of that step's batch."""

  def __init__(self, source: TokenFiles, order: GlobalOrder, rows: np.ndarray,
               repetition: RepetitionFilter | None):
    self.source, self.order, self.rows, self.repetition = source, order, rows, repetition

  def map(self, step: int) -> dict[str, np.ndarray]:
    instance = self.order.batch(int(step))[self.rows].astype(np.int64)
    tokens = np.stack([self.source[i] for i in instance])
    labels = labels_for(tokens)
    if self.repetition is not None:
      for r, row in enumerate(tokens):
        if filters.is_repetitive(row, self.repetition):
          labels[r] = IGNORE  # keeps its slot: the order is unchanged
    return {"step": np.int64(step), "input_ids": tokens, "labels": labels,
            "instance": instance}


class Loader:
  """Steps [start_step, start_step + num_steps) of the global sequence, host-local rows."""

  def __init__(self, cfg: DataConfig, sharding: jax.sharding.Sharding, *, start_step: int,
               num_steps: int, vocab_size: int | None = None, source: TokenFiles | None = None):
    check_divisible(cfg, sharding)
    self.cfg = cfg
    self.source = source or token_files(cfg, vocab_size)
    n_instances = len(self.source)
    if cfg.max_instances is not None:
      n_instances = min(n_instances, cfg.max_instances)
    self.order = GlobalOrder(n_instances, cfg.global_batch_size, cfg.seed)
    self.sharding = sharding
    self.host_rows = HostRows.of(sharding, cfg.global_batch_size, cfg.seq_len)
    self.start_step, self.num_steps = start_step, num_steps
    dataset = grain.MapDataset.range(start_step, start_step + num_steps).map(
        ReadStep(self.source, self.order, self.host_rows.rows, cfg.repetition_filter))
    dataset = dataset.to_iter_dataset(grain.ReadOptions(
        num_threads=1 if cfg.num_workers else cfg.prefetch, prefetch_buffer_size=cfg.prefetch))
    if cfg.num_workers:
      grain_compat.ensure_flags_parsed()
      dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(
          num_workers=cfg.num_workers, per_worker_buffer_size=cfg.prefetch))
    self.dataset = dataset

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return iter(self.dataset)

  def to_global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Global arrays [global_batch, ...] from this process's rows (no cross-host traffic)."""
    out = {}
    for key, local in batch.items():
      if key == "step":
        continue
      shape = (self.cfg.global_batch_size, *local.shape[1:])
      sharding = self.sharding if local.ndim == 2 else batch_only(self.sharding)
      arrays = [jax.device_put(local[pos][:, cols] if local.ndim == 2 else local[pos], device)
                for device, pos, cols in self.host_rows.shards]
      out[key] = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    return out


def batch_only(sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
  """The sharding of a per-row vector laid out like the batch dimension of `sharding`."""
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(sharding.spec[0]))


def check_divisible(cfg: DataConfig, sharding: jax.sharding.NamedSharding,
                    microbatches: int = 1) -> None:
  """The global batch (each microbatch of it) must split evenly over the devices that shard
  the batch dimension."""
  axes = sharding.spec[0] if sharding.spec else None
  axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
  ways = int(np.prod([sharding.mesh.shape[a] for a in axes])) if axes else 1
  if cfg.global_batch_size % (ways * microbatches):
    split = f" x TrainConfig.microbatches={microbatches}" if microbatches > 1 else ""
    raise DataError(f"DataConfig.global_batch_size={cfg.global_batch_size} is not divisible by "
                    f"the data-parallel size {ways} (mesh axes {axes}){split}")
