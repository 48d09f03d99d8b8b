"""Sliding-window layers under context parallelism by gathering: each sequence shard reads the
keys its window reaches (a halo of chunks from the shards that hold them), not the whole
sequence.

Laid out for context parallelism (olmo3.sharding.balanced_order), each of the `shards` holds
`slots` contiguous chunks of `chunk` positions. A query at the start of a chunk sees keys back to
`window - 1` positions before it: `hops` = ceil((window - 1) / chunk) chunks. Each shard receives
those chunks from their holders (collective permutes, one per (slot, hop, source slot)), so a
sliding layer moves hops / (shards - 1) of what gathering whole moves: for the 7B's stage 3
(65,536 tokens over 8 shards, chunks of 4,096, the window 4,096) one chunk a slot, a seventh.
Every query chunk then attends its own chunk and the `hops` before it: one [chunk,
(hops + 1)·chunk] causal sliding mask for every chunk, the rows being (batch row, chunk) pairs
split over the batch's and the sequence's mesh axes (olmo3.sharding.chunk_rows_spec). Chunks
before position 0 do not exist; their keys are zeros and their document id one that no query of
that shard has, so the document mask hides them.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import spmd

from olmo3.sharding import chunk_rows_spec, logical_to_spec, sequence_axes


@dataclasses.dataclass(frozen=True)
class Halo:
  """Which chunks each shard receives for a sliding layer (static: from the layout alone)."""
  shards: int
  slots: int  # contiguous chunks a shard holds
  chunk: int  # positions a chunk
  hops: int  # chunks before its own a query chunk reads
  # One collective permute each: (destination slot, hop, source slot, ((from, to) shard, ...)).
  permutes: tuple[tuple[int, int, int, tuple[tuple[int, int], ...]], ...]
  # present[shard][slot][hop - 1]: the chunk `hop` before that slot's exists (not before 0).
  present: tuple[tuple[tuple[bool, ...], ...], ...]

  @property
  def positions_C(self) -> np.ndarray:
    """A query chunk's positions among the keys it reads (its own chunk is the last)."""
    return np.arange(self.hops * self.chunk, (self.hops + 1) * self.chunk)


def plan(order_T: np.ndarray, shards: int, window: int | None) -> Halo | None:
  """The halo of a sliding layer with `window` for the layout `order_T` (column j is position
  order_T[j], cut into `shards` contiguous pieces), or None where reading a halo would not move
  less than gathering (a global layer, one shard, a window reaching shards - 1 chunks back) or
  the layout is not whole chunks of one size."""
  t = len(order_T)
  if window is None or shards < 2 or t % shards:
    return None
  per = t // shards
  order_T = np.asarray(order_T)
  # Where a contiguous run of positions starts: each shard's first column, and every break.
  runs = np.flatnonzero((np.arange(t) % per == 0) | np.r_[True, np.diff(order_T) != 1])
  chunk = int(np.gcd.reduce(np.diff(np.r_[runs, t])))  # the runs cut into equal chunks
  starts = range(0, t, chunk)
  if (order_T[starts] % chunk).any():
    return None
  hops = -(-(window - 1) // chunk)
  if hops >= shards - 1:
    return None
  slots = per // chunk
  holder = {int(order_T[j]) // chunk: (j // per, (j % per) // chunk) for j in starts}
  pairs = collections.defaultdict(list)
  present = np.zeros((shards, slots, hops), bool)
  for j in starts:
    shard, slot = j // per, (j % per) // chunk
    for hop in range(1, hops + 1):
      before = int(order_T[j]) // chunk - hop
      if before >= 0:
        source_shard, source_slot = holder[before]
        pairs[(slot, hop, source_slot)].append((source_shard, shard))
        present[shard, slot, hop - 1] = True
  return Halo(shards, slots, chunk, hops,
              tuple((*key, tuple(p)) for key, p in sorted(pairs.items())),
              tuple(tuple(tuple(bool(b) for b in row) for row in s) for s in present))


def _with_halo(x, halo: Halo, axes: tuple[str, ...], fill=None):
  """Inside a shard_map: a shard's [b, slots·chunk, ...] -> [b·slots, (hops + 1)·chunk, ...],
  each chunk after the `hops` chunks before it (zeros, or `fill`, where none exists)."""
  own = jnp.split(x, halo.slots, axis=1)
  shard = jax.lax.axis_index(axes)
  if fill is not None:
    present = jnp.asarray(halo.present)[shard]
  rows = []
  for slot in range(halo.slots):
    parts = []
    for hop in range(halo.hops, 0, -1):
      got = []
      for to, h, source, pairs in halo.permutes:
        if (to, h) != (slot, hop):
          continue
        # A shard that holds the chunk itself copies it (a permute would count it as moved).
        moved = [(a, b) for a, b in pairs if a != b]
        kept = [b for a, b in pairs if a == b]
        if moved:
          got.append(jax.lax.ppermute(own[source], axes, moved))
        if kept:
          got.append(jnp.where(jnp.isin(shard, jnp.asarray(kept)), own[source], 0))
      part = sum(got[1:], got[0]) if got else jnp.zeros_like(own[slot])
      parts.append(part if fill is None else jnp.where(present[slot, hop - 1], part, fill))
    rows.append(jnp.concatenate(parts + [own[slot]], axis=1))
  stacked = jnp.stack(rows, axis=1)  # [b, slots, (hops + 1)·chunk, ...]
  return stacked.reshape(-1, *stacked.shape[2:])


def _per_shard(fn, in_specs, out_specs, *args):
  return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs,
                       out_specs=out_specs, check_vma=False)(*args)


def _specs():
  """[B, T, H, K] split along the sequence, [N, C, H, K] rows of one chunk, and their
  documents' [B, T] and [N, C]."""
  P = jax.sharding.PartitionSpec
  spec = logical_to_spec(("batch", "seq", "act_heads", None), spmd.get_logical_axis_rules())
  rows = chunk_rows_spec()
  return spec, P(rows, None, spec[2], None), P(spec[0], spec[1]), P(rows, None)


def chunked(x_BTHK: jax.Array, halo: Halo) -> jax.Array:
  """[B, T, H, K] split along the sequence -> [N, C, H, K], a row per (batch row, chunk)."""
  spec, rows, _, _ = _specs()
  return _per_shard(lambda x: x.reshape(-1, halo.chunk, *x.shape[2:]), spec, rows, x_BTHK)


def unchunked(x_NCHK: jax.Array, halo: Halo) -> jax.Array:
  """`chunked`'s inverse."""
  spec, rows, _, _ = _specs()
  return _per_shard(lambda x: x.reshape(-1, halo.slots * halo.chunk, *x.shape[2:]), rows, spec,
                    x_NCHK)


def keys_read(k_BTGK: jax.Array, v_BTGK: jax.Array, halo: Halo) -> tuple[jax.Array, jax.Array]:
  """The keys and values each chunk of queries reads, [N, (hops + 1)·C, G, K]: the chunks
  before it (received from their shards) and its own. Only these move between devices (one
  shard_map, so that a remat policy keeping its outputs never permutes them again)."""
  spec, rows, _, _ = _specs()
  axes = sequence_axes()
  return _per_shard(lambda k, v: (_with_halo(k, halo, axes), _with_halo(v, halo, axes)),
                    (spec, spec), (rows, rows), k_BTGK, v_BTGK)


def documents_read(segments_BT: jax.Array | None, batch: int, halo: Halo
                   ) -> tuple[jax.Array, jax.Array]:
  """Each chunk's queries' documents [N, C] and its keys' [N, (hops + 1)·C] (unpacked rows:
  one document). A chunk before position 0 gets an id no query of its shard has."""
  _, _, spec, rows = _specs()
  if segments_BT is None:
    segments_BT = jnp.zeros((batch, halo.shards * halo.slots * halo.chunk), jnp.int32)
  axes = sequence_axes()

  def local(ids):
    return (ids.reshape(-1, halo.chunk), _with_halo(ids, halo, axes, fill=ids.min() - 1))

  return _per_shard(local, spec, (rows, rows), segments_BT)
