"""Meshes and logical-axis rules. The model names axes; this module decides where they live.

Parameters and activations carry logical axis names (`embed`, `q_heads`, `mlp`, `vocab`,
`layers`, `batch`, ...). A rule set maps each logical name to mesh axes (or None: replicated).
Rules are plain data, so an experiment can swap them without touching the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from flax.core import spmd  # holds the rules that nnx.logical_axis_rules sets
from jax.sharding import AxisType, Mesh, PartitionSpec

from olmo3.config import MeshConfig, heads_split_problem

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

MESH_AXES = ("data", "fsdp", "sequence", "tensor")

# Pure FSDP (the 7B default): weights sharded on their model dimension over `fsdp` and
# `sequence` together, batch over (data, fsdp), activations' sequence dimension over `sequence`
# (context parallelism; size 1 unless a mesh asks for it). With the sequence split, a weight's
# gradient is a sum over both axes, so sharding the weights over both makes it one
# reduce-scatter (torchtitan's FSDP over data x context); sharded over fsdp alone, the
# parameters, moments and gradients were replicated over the sequence axis and the gradients
# all-reduced across it. The embedding table is sharded on vocab, not embed: sharding it over
# fsdp while the batch is sharded over (data, fsdp) makes XLA rematerialise the whole gather
# (docs/performance.md#sharding), so the table has axis names of its own.
FSDP_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("seq", "sequence"),
    ("layers", None),
    ("table_vocab", ("fsdp", "sequence", "tensor")),  # the input embedding table's rows
    ("table_embed", None),
    ("vocab", "tensor"),  # the LM head's output dimension
    ("embed", ("fsdp", "sequence")),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def make_mesh(shape: dict[str, int] | None = None,
              devices: Sequence[jax.Device] | None = None,
              dcn: dict[str, int] | None = None) -> Mesh:
  """A mesh over `MESH_AXES`. One size may be -1 (fill the devices); default: all on fsdp.

  `shape` is the mesh within a slice (ICI). Devices from several slices (multi-slice TPU pods)
  add `dcn`, the axes that span slices over the data-center network; by default the slices
  form the data axis (pure data parallelism across slices, the usual choice: only gradient
  all-reduces cross DCN). Each mesh axis is ICI size x DCN size.
  """
  devices = list(devices if devices is not None else jax.devices())
  slices = len({getattr(d, "slice_index", 0) or 0 for d in devices})
  dcn = dict(dcn or ({"data": slices} if slices > 1 else {}))
  shape = dict(shape or {"fsdp": -1})
  unknown = (set(shape) | set(dcn)) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"mesh axes {sorted(unknown)} unknown; axes are {MESH_AXES}")
  dcn_sizes = [dcn.get(a, 1) for a in MESH_AXES]
  if any(n < 1 for n in dcn_sizes) or int(np.prod(dcn_sizes)) != slices:
    raise ValueError(f"mesh dcn {dcn}: the devices come from {slices} slice(s); the DCN sizes "
                     f"must multiply to that")
  per_slice = len(devices) // slices
  sizes = [shape.get(a, 1) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh {shape}: at most one axis may be -1")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if per_slice % known:
      raise ValueError(f"mesh {shape}: {per_slice} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = per_slice // known
  if int(np.prod(sizes)) != per_slice:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices; "
                     f"{per_slice} are available" + (" per slice" if slices > 1 else ""))
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  if slices == 1:
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=axis_types, devices=devices)
  from jax.experimental import mesh_utils

  grid = mesh_utils.create_hybrid_device_mesh(sizes, dcn_sizes, devices)
  return Mesh(grid, MESH_AXES, axis_types=axis_types)


def experiment_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """An experiment's mesh (MeshConfig: its ICI shape and DCN axes) over `devices` (default:
  all): what a run trains on, and what its launch records."""
  return make_mesh(dict(cfg.shape), devices=devices, dcn=dict(cfg.dcn))


def layout(mesh: Mesh) -> dict[str, object]:
  """What a checkpoint records of the mesh it was written on (plain JSON): the axes of size > 1,
  the devices, their kind and how many processes held them. Orbax reshards every array onto the
  reader's mesh, so this is for people: the dry run and the restore say what changed."""
  return {"mesh": {a: int(n) for a, n in mesh.shape.items() if n > 1},
          "devices": int(mesh.devices.size),
          "device_kind": str(mesh.devices.flat[0].device_kind),
          "processes": len({d.process_index for d in mesh.devices.flat})}


def layout_change(written: dict[str, object] | None, mesh: Mesh) -> str:
  """One line: the layout a checkpoint was written on (`layout`) against `mesh`'s."""
  here = layout(mesh)

  def words(l: dict[str, object]) -> str:
    processes = f"{l['processes']:,} process{'es' if l['processes'] != 1 else ''}"
    if l["devices"] == 1:
      return f"one {l['device_kind']} device"
    return f"{l['mesh']} of {l['devices']:,} {l['device_kind']} devices in {processes}"

  if not written:
    return (f"not recorded (an older checkpoint); restored onto {words(here)}, each array "
            "resharded as it is read")
  if written == here:
    return f"written on {words(written)}: the same layout"
  return (f"written on {words(written)}; restored onto {words(here)}, each array resharded as "
          "it is read")


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules = FSDP_RULES) -> Iterator[None]:
  """Build and run sharded modules inside this context (Auto axes, logical rules active)."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    yield


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
  table = dict(rules)
  missing = [n for n in names if n is not None and n not in table]
  if missing:
    raise ValueError(f"logical axes {missing} have no rule; rules cover {sorted(table)}")
  return PartitionSpec(*(table[n] if n is not None else None for n in names))


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
  """A PartitionSpec entry as the tuple of mesh axes it names."""
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def sequence_axes() -> tuple[str, ...]:
  """The mesh axes the active rules split the `seq` axis over, those of size > 1 (none
  outside a mesh context): context parallelism when there are any."""
  mesh = jax.sharding.get_abstract_mesh()
  active = spmd.get_logical_axis_rules()
  if mesh.empty or not active:
    return ()
  return tuple(a for a in _axes(logical_to_spec(("seq",), active)[0]) if mesh.shape[a] > 1)


def sequence_shards() -> int:
  """How many pieces the active mesh cuts each sequence into (1: no context parallelism)."""
  mesh = jax.sharding.get_abstract_mesh()
  return int(np.prod([mesh.shape[a] for a in sequence_axes()], dtype=int))


def heads_over_sequence_spec() -> PartitionSpec:
  """[B, T, H, K] as all-to-all context parallelism lays it out for attention: rows as the
  batch, the whole sequence on every device, the heads split over their own mesh axes and the
  sequence's (olmo3.config.ContextParallel.ALL_TO_ALL). Needs an active mesh and rules."""
  rules = spmd.get_logical_axis_rules()
  mesh = jax.sharding.get_abstract_mesh()
  batch, heads = logical_to_spec(("batch", "act_heads"), rules)
  split = tuple(a for a in _axes(heads) if mesh.shape[a] > 1) + sequence_axes()
  return PartitionSpec(batch, None, split or None, None)


def head_major_cache_spec(kv_heads: int) -> PartitionSpec | None:
  """[B, G, S, K] (olmo3.decode's KV cache) with the key/value heads split over their own mesh
  axes and the sequence's, as all-to-all context parallelism splits them: each device then
  attends its heads over every position, and no softmax spans devices. None when the mesh does
  not split the sequence, or the heads do not divide over it."""
  if sequence_shards() == 1:
    return None
  spec = heads_over_sequence_spec()
  mesh = jax.sharding.get_abstract_mesh()
  if heads_split_problem(kv_heads, int(np.prod([mesh.shape[a] for a in _axes(spec[2])]))):
    return None
  return PartitionSpec(spec[0], spec[2], None, None)


def chunk_rows_spec() -> str | tuple[str, ...] | None:
  """The row axis of [N, C, ...] arrays whose rows are (batch row, sequence chunk) pairs
  (olmo3.halo): split over the batch's mesh axes and then the sequence's, so that each device's
  rows are its own batch rows' own chunks. Needs an active mesh and rules."""
  batch, seq = logical_to_spec(("batch", "seq"), spmd.get_logical_axis_rules())
  return (_axes(batch) + _axes(seq)) or None


def heads_over_sequence(x_BTHK: jax.Array) -> jax.Array:
  """`x_BTHK` constrained to `heads_over_sequence_spec` (from the sequence split: an
  all-to-all), refusing in one line a head count the split does not divide."""
  spec = heads_over_sequence_spec()
  mesh = jax.sharding.get_abstract_mesh()
  shards = int(np.prod([mesh.shape[a] for a in _axes(spec[2])], dtype=int))
  problem = heads_split_problem(x_BTHK.shape[2], shards)
  if problem:
    raise ValueError(f"mesh axes {_axes(spec[2])}: {problem}")
  return jax.lax.with_sharding_constraint(x_BTHK, spec)


def balanced_order(seq_len: int, shards: int) -> np.ndarray:
  """The positions of a sequence laid out for `shards` devices so that causal attention costs
  each the same: the sequence cut into 2·shards chunks, device i holding chunks i and
  2·shards - 1 - i (the zig-zag split of OLMo-core's and Llama 3's context parallelism). Column j
  of the laid-out sequence is position order[j]; cut into `shards` contiguous pieces as the
  mesh cuts it. One shard: 0..seq_len-1."""
  if shards == 1:
    return np.arange(seq_len)
  chunks = 2 * shards
  if seq_len % chunks:
    raise ValueError(f"a sequence of {seq_len} tokens cannot be split into {chunks} equal chunks "
                     f"for {shards}-way context parallelism (mesh axes {sequence_axes()}): "
                     f"seq_len must be a multiple of {chunks}")
  chunk_CX = np.arange(seq_len).reshape(chunks, seq_len // chunks)
  return np.concatenate([np.concatenate([chunk_CX[i], chunk_CX[chunks - 1 - i]])
                         for i in range(shards)])


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Sharding constraint by logical names; a no-op outside a mesh context."""
  mesh = jax.sharding.get_abstract_mesh()
  active = spmd.get_logical_axis_rules()
  if mesh.empty or not active:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, active))
