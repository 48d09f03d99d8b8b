"""The training input pipeline: global order -> this process's rows -> Grain -> global jax.Array.

Sharding happens exactly once, here: `HostRows` asks the batch sharding which rows of the
global batch this process's devices hold, and each step reads only those rows. Nothing else
splits the data: no Grain shard options, no per-host sampler. Grain runs the reading (worker
processes, bounded prefetch); each element is one global step's host-local rows, so Grain's
workers divide steps, never rows. The position stored in checkpoints is the global step alone.

The one exit: iterating a `Loader` yields what the train step consumes, global jax.Arrays
  input_ids [B, T] int32   the instances' tokens
  labels    [B, T] int32   input_ids shifted left; IGNORE (-1) where there is no target (the
                           last position, and every position of an instance the repetition
                           filter masks)
  filtered  [B]    bool    the repetition filter masked this instance (the loss divisor still
                           counts its T tokens, as OLMo-core's does)
  source    [B]    int32   the instance's source: an index into `Loader.source.source_names`
                           (the mix's labels, sorted)
`DevicePrefetch` runs that iteration ahead of the step on a background thread. Audits read
`Loader.host_batches()` instead: this process's rows as numpy arrays, with the
global step and each row's global instance index (`instance` [R] int64), which stay on the host.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator

import grain
import jax
import numpy as np

from olmo3.config import DataConfig, RepetitionFilter
from olmo3.data import embedded, filters, grain_compat, sources
from olmo3.data.order import GlobalOrder
from olmo3.data.packing import PackedInstances
from olmo3.data.tokens import DataError, TokenFiles
from olmo3.loss import IGNORE


# What the train step consumes; "segments" (a document id per token) only of packed instances.
STEP_KEYS = ("input_ids", "labels", "filtered", "source", "segments")


def labels_for(tokens_RT: np.ndarray) -> np.ndarray:
  """Next-token labels: tokens shifted left, the last position without a target."""
  labels = np.empty_like(tokens_RT)
  labels[:, :-1] = tokens_RT[:, 1:]
  labels[:, -1] = IGNORE
  return labels


@dataclasses.dataclass(frozen=True)
class HostRows:
  """The rows of a global batch this process's devices hold, and the one way host rows become
  a global jax.Array (training batches and evaluation batches alike)."""

  sharding: jax.sharding.NamedSharding  # of [global_batch, seq_len] arrays
  global_batch: int
  seq_len: int
  rows: np.ndarray  # sorted global row indices held by this process's devices
  shards: tuple[tuple[jax.Device, np.ndarray, slice], ...]  # (device, positions in rows, cols)

  @classmethod
  def of(cls, sharding: jax.sharding.NamedSharding, global_batch: int, seq_len: int) -> HostRows:
    index_map = sharding.addressable_devices_indices_map((global_batch, seq_len))
    per_device = {d: (np.arange(global_batch)[idx[0]], idx[1]) for d, idx in index_map.items()}
    rows = np.unique(np.concatenate([r for r, _ in per_device.values()]))
    shards = tuple((d, np.searchsorted(rows, r), cols) for d, (r, cols) in per_device.items())
    return cls(sharding, global_batch, seq_len, rows, shards)

  def take(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's rows of a whole global batch that every process built alike."""
    return {k: v[self.rows] for k, v in batch.items()}

  def to_global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Global arrays [global_batch, ...] from this process's rows (no cross-host traffic).
    [R, seq_len] arrays take the batch sharding; others (e.g. [R] vectors, [R, K] choices)
    its batch dimension's."""
    out = {}
    for key, local in batch.items():
      shape = (self.global_batch, *local.shape[1:])
      by_token = local.ndim == 2 and local.shape[1] == self.seq_len
      sharding = self.sharding if by_token else batch_only(self.sharding)
      arrays = [jax.device_put(local[pos][:, cols] if by_token else local[pos], device)
                for device, pos, cols in self.shards]
      out[key] = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    return out


class ReadStep(grain.transforms.Map):
  """Global step -> this process's rows of that step's batch."""

  def __init__(self, source: TokenFiles | PackedInstances, order: GlobalOrder, rows: np.ndarray,
               repetition: RepetitionFilter | None):
    self.source, self.order, self.rows, self.repetition = source, order, rows, repetition

  def map(self, step: int) -> dict[str, np.ndarray]:
    instance = self.order.batch(int(step))[self.rows].astype(np.int64)
    if isinstance(self.source, PackedInstances):
      packed = self.source.read(instance)  # one batch of reads (concurrent when remote)
      return {"step": np.int64(step), "input_ids": packed.tokens,
              "labels": packed.labels(IGNORE), "filtered": np.zeros(len(instance), bool),
              "source": self.source.source_of(instance), "segments": packed.segment_ids,
              "instance": instance}
    tokens = self.source.read(instance)  # one batch of reads (concurrent when remote)
    labels = labels_for(tokens)
    filtered = np.zeros(len(tokens), bool)
    if self.repetition is not None:
      for r, row in enumerate(tokens):
        if filters.is_repetitive(row, self.repetition):
          labels[r] = IGNORE  # keeps its slot: the order is unchanged
          filtered[r] = True
    return {"step": np.int64(step), "input_ids": tokens, "labels": labels,
            "filtered": filtered, "source": self.source.source_of(instance),
            "instance": instance}


def instances(cfg: DataConfig, source: TokenFiles) -> int:
  """The instances one epoch draws from: all of `source`, or its first `max_instances` cut to
  whole runs of `cfg.chunk_instances` (OLMo-core's chunks)."""
  n = len(source) if cfg.max_instances is None else min(len(source), cfg.max_instances)
  return n // cfg.chunk_instances * cfg.chunk_instances


def steps_per_epoch(cfg: DataConfig, source: TokenFiles) -> int:
  """Global steps in one epoch of `source` (the tail that does not fill a batch is dropped)."""
  return instances(cfg, source) // cfg.global_batch_size


SHARED_ORDER_MIN_INSTANCES = 1 << 20  # below: milliseconds to compute, kept in process


def order_for(cfg: DataConfig, source: TokenFiles | PackedInstances,
              beside: str | None = None) -> GlobalOrder:
  """The global order `source`'s instances are drawn in. A large one takes seconds to compute
  (AI2's stage 1, 724M instances: 48 s, 2.9 GB) in every process and loader worker, at each
  launch: computed once per machine instead, and shared through the page cache
  (olmo3.data.order.KeptOrder); with `beside` (a directory of the run's, in its bucket), also
  kept there by process 0, for hosts new to the run to read instead of computing it."""
  n = instances(cfg, source)
  if n < cfg.global_batch_size:
    packed = " (documents packed)" if isinstance(source, PackedInstances) else ""
    raise DataError(f"the training data holds {n} instance(s) of DataConfig.seq_len="
                    f"{cfg.seq_len} tokens{packed}, fewer than one global batch "
                    f"(DataConfig.global_batch_size={cfg.global_batch_size}): give more data "
                    "or a smaller global_batch_size")
  shared = embedded.cache_root() / "order" if n >= SHARED_ORDER_MIN_INSTANCES else None
  return GlobalOrder(n, cfg.global_batch_size, cfg.seed, cfg.chunk_instances, shared,
                     beside=beside if shared is not None else None,
                     keeps_beside=jax.process_index() == 0)


class Loader:
  """Steps [start_step, start_step + num_steps) of the global sequence."""

  def __init__(self, cfg: DataConfig, sharding: jax.sharding.NamedSharding, *, start_step: int,
               num_steps: int, vocab_size: int | None = None,
               source: TokenFiles | PackedInstances | None = None,
               microbatches: int = 1, order_beside: str | None = None):
    # The one check of the training batch's split (over devices, and into the train step's
    # microbatches: TrainConfig.microbatches).
    check_divisible(cfg.global_batch_size, sharding, "DataConfig.global_batch_size", microbatches)
    self.cfg = cfg
    self.source = source or sources.token_files(cfg, vocab_size)
    self.order = order_for(cfg, self.source, order_beside)
    self.order.prepare(self.order.epoch_of(start_step))  # computed here, not raced by workers
    self.host_rows = HostRows.of(sharding, cfg.global_batch_size, cfg.seq_len)
    dataset = grain.MapDataset.range(start_step, start_step + num_steps).map(
        ReadStep(self.source, self.order, self.host_rows.rows, cfg.repetition_filter))
    dataset = dataset.to_iter_dataset(grain.ReadOptions(
        num_threads=1 if cfg.num_workers else cfg.prefetch, prefetch_buffer_size=cfg.prefetch))
    if cfg.num_workers:
      grain_compat.ensure_flags_parsed()
      dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(
          num_workers=cfg.num_workers, per_worker_buffer_size=cfg.prefetch))
    self.dataset = dataset

  def host_batches(self) -> Iterator[dict[str, np.ndarray]]:
    """This process's rows of each step: step, the STEP_KEYS arrays, instance (for audits)."""
    return iter(self.dataset)

  def __iter__(self) -> Iterator[dict[str, jax.Array]]:
    """Each step's global batch, as the train step consumes it (STEP_KEYS)."""
    for batch in self.dataset:
      yield self.host_rows.to_global({k: batch[k] for k in STEP_KEYS if k in batch})


class DevicePrefetch:
  """Iterates `batches` (a Loader's global arrays) up to `depth` steps ahead of the consumer:
  a background thread reads and transfers them, so the next step's batch is already on the
  devices when the step is dispatched. The order is `batches`'s; an exception raised reading
  a batch is raised by the `next()` that would have returned it. `close()` (or leaving a `with`
  block) stops the thread once its current read ends, and joins it."""

  def __init__(self, batches: Iterator[dict[str, jax.Array]], depth: int):
    if depth < 1:
      raise ValueError(f"prefetch depth {depth} < 1")
    self._slots = threading.Semaphore(depth)  # batches read but not yet consumed, at most depth
    self._ready: queue.SimpleQueue = queue.SimpleQueue()  # (batch, None) | (None, error | None)
    self._stop = threading.Event()
    self._done = False
    self._thread = threading.Thread(target=self._fill, args=(batches,), name="device-prefetch",
                                    daemon=True)
    self._thread.start()

  def _fill(self, batches: Iterator[dict[str, jax.Array]]) -> None:
    try:
      while True:
        self._slots.acquire()
        if self._stop.is_set():
          return
        try:
          batch = next(batches)
        except StopIteration:
          self._ready.put((None, None))
          return
        self._ready.put((batch, None))
    except BaseException as e:  # pylint: disable=broad-except  # raised in the consumer
      self._ready.put((None, e))
    finally:
      if hasattr(batches, "close"):  # a generator (Loader.__iter__) releases its Grain iterator
        batches.close()

  def __iter__(self) -> DevicePrefetch:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    if self._done:
      raise StopIteration
    batch, error = self._ready.get()
    if batch is None:
      self._done = True
      if error is not None:
        raise error
      raise StopIteration
    self._slots.release()
    return batch

  def close(self) -> None:
    self._stop.set()
    self._slots.release()  # wakes a thread waiting for a slot
    self._thread.join()
    self._done = True

  def __enter__(self) -> DevicePrefetch:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def batch_only(sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
  """The sharding of a per-row vector laid out like the batch dimension of `sharding`."""
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(sharding.spec[0]))


def check_divisible(global_batch: int, sharding: jax.sharding.NamedSharding, field: str,
                    microbatches: int = 1) -> None:
  """A global batch (each microbatch of it) must split evenly over the devices that shard the
  batch dimension. `field` names the config field the batch size came from."""
  axes = sharding.spec[0] if sharding.spec else None
  axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
  ways = int(np.prod([sharding.mesh.shape[a] for a in axes])) if axes else 1
  if global_batch % (ways * microbatches):
    split = f" x TrainConfig.microbatches={microbatches}" if microbatches > 1 else ""
    raise DataError(f"{field}={global_batch} is not divisible by the data-parallel size {ways} "
                    f"(mesh axes {axes}){split}")
