"""Model checkpoints in and out: a directory with a `params` item (the parameter tree) and a
`meta` item (JSON: the model config and provenance). Used by training, evaluation and
conversion alike, so it sits below all three.

Training checkpoints (olmo3.train.run_checkpoints) add items beside these (optimizer state, data
position) in the same layout, so a converted checkpoint and a training step directory restore
the same way. Orbax writes into a temporary directory and renames it when complete, so a crash
never leaves a checkpoint that looks complete.

Verified: the meta records every saved array's shape, dtype and checksum (`arrays`) and a
digest of itself, and a save of NaN/Inf is refused. A restore first checks that the checkpoint
fits the target (a mismatch is a CheckpointError naming the parameter and both shapes: a
config mistake, the files are fine), then reads and verifies: unreadable files, a checksum or
digest that does not match, or NaN/Inf are CheckpointDamaged, in one form whatever the cause:
`<step dir> is damaged: <array> in <item dir>: <cause>`, the cause being e.g. `checksum
mismatch (saved .., read ..)` or `unreadable (<first line of the library's error>)`.
The checksum is a function of the global array (each element's bits and position, summed
modulo 2^32 in two lanes), so it is computed where the arrays live, in one pass on their
devices, and verifies a checkpoint restored onto any mesh.

Which checkpoint module does what (open this one first):
- here: a checkpoint directory's items, their records and verification, in and out;
- olmo3.io.orbax_s3: Orbax on S3 (its conditional writes and a failed save seen at once);
- olmo3.io.olmo_core_checkpoints: finding AI2's OLMo-core checkpoints (a save folder, a step);
- olmo3.convert.olmo_core_import: converting an OLMo-core checkpoint into this layout;
- olmo3.train.run_checkpoints: a run's numbered steps (save async, keep, quarantine the damaged);
- olmo3.train.state: which checkpoint a run starts from (resume, fall back, init_from) and what
  a save records (step, data position, skip statistics, the layout it was written on).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from olmo3.io import orbax_s3, pathnames

PARAMS, META = "params", "meta"
# Adam's count and moments ({"count", "mu", "nu"}, optax's names) in a checkpoint imported from
# another trainer (olmo3.convert.olmo_core_import); a run's own steps hold its optimizer's whole
# state instead (olmo3.train.run_checkpoints), which a run builds from these.
ADAM = "adam"
ARRAYS, DIGEST = "arrays", "digest"  # meta keys: per-item array records; the meta's own digest
_HOST_CHUNK = 1 << 22  # elements per step when checksumming a host (numpy) array
_CAUSE_CHARS = 200  # the most of a library's error a damage message quotes
# Errors of the machine or the storage service, not of the files: never a reason to set a
# checkpoint aside.
_ENVIRONMENT = ("RESOURCE_EXHAUSTED", "Out of memory", "UNAVAILABLE", "DEADLINE_EXCEEDED",
                "PERMISSION_DENIED", "UNAUTHENTICATED")


class CheckpointError(ValueError):
  """A checkpoint is missing, incomplete or does not fit the model. The message says which."""


class CheckpointDamaged(CheckpointError):
  """A checkpoint's files are damaged: unreadable, or not what was saved (a checksum or digest
  does not match, NaN/Inf). The message names the directory and the array."""


@dataclasses.dataclass(frozen=True)
class ArraySummary:
  checksum: str  # 16 hex digits (two 32-bit lanes)
  finite: bool  # no NaN/Inf (always True for integer arrays)


def array_name(path: tuple) -> str:
  """A leaf's name as Orbax's metadata tree spells it: dict keys and attributes alike as
  ['key'], positions as [i] (so a NamedTuple's fields read back under the same names)."""
  parts = []
  for key in path:
    match key:
      case jax.tree_util.SequenceKey(idx=idx):
        parts.append(f"[{idx}]")
      case jax.tree_util.DictKey(key=name) | jax.tree_util.GetAttrKey(name=name):
        parts.append(f"[{name!r}]")
      case _:
        parts.append(str(key))
  return "".join(parts)


def _named_leaves(tree: Any) -> dict[str, Any]:
  return {array_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _fmix32(h):
  """MurmurHash3's finalizer: a bijection of uint32 in which every input bit moves every
  output bit (numpy or jax arrays alike)."""
  h = h ^ (h >> np.uint32(16))
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> np.uint32(13))
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> np.uint32(16))


def _lanes(bits, index):
  """Two per-element terms whose sums form the checksum. For a fixed position each term is a
  bijection of the element's bits, so any change of one element changes both sums; the
  position enters each term, so moved elements change them too."""
  h = _fmix32(bits ^ (index * np.uint32(0x9E3779B9)))
  return h, h * (index | np.uint32(1))


def _bits(x, xp):
  """The element bits as uint32 (1-, 2- and 4-byte dtypes; JAX runs without 64-bit types)."""
  if x.dtype == np.bool_:
    x = x.astype(np.uint8)
  width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[np.dtype(x.dtype).itemsize]
  if xp is np:
    return x.view(width).astype(np.uint32)
  return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _hex(sums) -> str:
  return "".join(f"{int(s):08x}" for s in np.asarray(sums, np.uint32))


@functools.lru_cache(maxsize=8)
def _summarizer(replicated: jax.sharding.Sharding | None):
  """The jitted checksum pass; its results replicated over the arrays' mesh, so every process
  can read them."""
  return jax.jit(_device_summaries, out_shardings=replicated)


def _device_summaries(leaves: list[jax.Array]) -> list[tuple[jax.Array, jax.Array]]:
  out = []
  for x in leaves:
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(x.ndim)):
      # The flat position modulo 2^32, built from per-dimension iotas: no reshape, so each
      # device computes its own shard's positions.
      index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim) * np.uint32(stride % 2**32)
      stride *= x.shape[dim]
    a, b = _lanes(_bits(x, jnp), index)
    finite = jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    out.append((jnp.stack([a.sum(dtype=jnp.uint32), b.sum(dtype=jnp.uint32)]), finite))
  return out


def _host_summary(x: np.ndarray) -> ArraySummary:
  """The same checksum of a host array (e.g. a memory-mapped 29 GB import), streamed."""
  flat = np.asarray(x).reshape(-1)
  sums = np.zeros(2, np.uint32)
  finite = True
  for start in range(0, flat.size, _HOST_CHUNK):
    chunk = flat[start:start + _HOST_CHUNK]
    index = (np.arange(start, start + chunk.size, dtype=np.uint64) % 2**32).astype(np.uint32)
    a, b = _lanes(_bits(chunk, np), index)
    sums += np.array([a.sum(dtype=np.uint32), b.sum(dtype=np.uint32)], np.uint32)
    if jnp.issubdtype(chunk.dtype, jnp.inexact):  # numpy's own test misses bfloat16
      finite = finite and bool(np.isfinite(chunk).all())
  return ArraySummary(_hex(sums), finite)


def summarize(tree: Any) -> dict[str, ArraySummary]:
  """Checksum and finiteness of every array of `tree`, by name: jax.Arrays on their devices
  (one jitted pass; the results are replicated, so every process gets them), others on the
  host."""
  leaves = _named_leaves(tree)
  on_device = {n: x for n, x in leaves.items() if isinstance(x, jax.Array)}
  out = {n: _host_summary(x) for n, x in leaves.items() if n not in on_device}
  if on_device:
    sharding = next(iter(on_device.values())).sharding
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()) if (
        isinstance(sharding, jax.sharding.NamedSharding)) else None
    results = jax.device_get(_summarizer(replicated)(list(on_device.values())))
    out.update({n: ArraySummary(_hex(sums), bool(finite))
                for n, (sums, finite) in zip(on_device, results)})
  return out


def array_records(path: str | os.PathLike, items: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """What the meta records of items about to be saved (item name -> tree): each array's shape,
  dtype and checksum. NaN/Inf is refused (CheckpointError): such a checkpoint could only ever
  be resumed into a broken run."""
  summaries = summarize(items)  # one pass (one compilation) for all items
  bad = [n for n, s in summaries.items() if not s.finite]
  if bad:
    raise CheckpointError(f"{path}: refusing to save {_some(bad)}: NaN/Inf")
  return {item: {n: {"shape": list(np.shape(x)), "dtype": str(np.dtype(x.dtype)),
                     "checksum": summaries[array_name((jax.tree_util.DictKey(item),)) + n].checksum}
                 for n, x in _named_leaves(tree).items()}
          for item, tree in items.items()}


def _some(names: list[str]) -> str:
  return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _digest(meta: dict[str, Any]) -> str:
  return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def sealed(meta: dict[str, Any]) -> dict[str, Any]:
  """`meta` (made JSON-plain) with its digest: a flipped bit in it is found when it is read."""
  meta = json.loads(json.dumps(meta))
  return {**meta, DIGEST: _digest(meta)}


def save_model(path: str | os.PathLike, cfg: Any, params: Any,
               meta: dict[str, Any] | None = None, items: dict[str, Any] | None = None) -> None:
  """Saves a parameter tree (nested dict of arrays), other `items` beside it (name -> tree,
  e.g. ADAM) and its model config (a dataclass: a ModelConfig, recorded as
  meta["model_config"]); refuses to overwrite."""
  path = pathnames.absolute(path)
  if path.exists():
    raise CheckpointError(f"{path} already exists; refusing to overwrite")
  trees = {PARAMS: params, **(items or {})}
  meta = sealed({"model_config": dataclasses.asdict(cfg), **(meta or {}),
                 ARRAYS: array_records(path, trees)})
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(),
                                 temporary_path_class=orbax_s3.temporary_path_class(path))
  checkpointer.save(path, args=ocp.args.Composite(
      **{name: ocp.args.StandardSave(tree) for name, tree in trees.items()},
      **{META: ocp.args.JsonSave(meta)}))


def _chain(error: BaseException) -> list[BaseException]:
  """`error` and the errors it was raised from, outermost first (as a traceback shows them)."""
  chain = []
  while error is not None and all(error is not e for e in chain):
    chain.append(error)
    error = error.__cause__ if error.__cause__ is not None else (
        None if error.__suppress_context__ else error.__context__)
  return chain


def is_environmental(error: BaseException) -> bool:
  """An error of the machine or the storage service (memory, network, permissions), which says
  nothing about the files. The whole chain is read: Orbax wraps TensorStore's read errors in
  one that names only the array."""
  return any(isinstance(e, MemoryError) or any(s in str(e) for s in _ENVIRONMENT)
             for e in _chain(error))


def _cause(error: BaseException) -> str:
  """Why a read failed, in the library's words and one short line: the first line of the
  innermost error (TensorStore's: it names the key, the file and what failed, where Orbax's
  wrapper names the array's whole spec), without the spec TensorStore appends
  (`[tensorstore_spec='{...}']`), its middle elided past _CAUSE_CHARS."""
  inner = _chain(error)[-1]
  line = str(inner).strip().split("\n")[0].split(" See full TensorStore details")[0]
  line = re.split(r" \[\w+='", line)[0]  # TensorStore's payloads: the spec, source locations
  line = f"{type(inner).__name__}: {line}" if line else type(inner).__name__
  if len(line) > _CAUSE_CHARS:
    half = _CAUSE_CHARS // 2
    line = f"{line[:half]} … {line[-half:]}"
  return line


def _damaged(path: epath.Path, found: list[tuple[str | None, str]], cause: str
             ) -> CheckpointDamaged:
  """The one form of every damage message: the step directory, the first damaged array (or
  item) and the file holding it (its item's directory; the step directory when the item is not
  known), the cause, and how many more arrays are damaged."""
  (item, name), more = found[0], len(found) - 1
  return CheckpointDamaged(f"{path} is damaged: {name} in {path / item if item else path}: "
                           f"{cause}" + (f" (and {more} more arrays)" if more else ""))


def _item_name(item: str) -> str:
  return array_name((jax.tree_util.DictKey(item),))


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
  """A checkpoint's meta, its digest checked (CheckpointDamaged when it does not match)."""
  path = pathnames.absolute(path)
  if not (path / META).exists():
    raise CheckpointError(f"{path}: not a model checkpoint (no '{META}' item)")
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  try:
    meta = checkpointer.restore(
        path, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
  except Exception as e:  # Orbax raises many types for a damaged file
    if is_environmental(e):
      raise
    raise _damaged(path, [(META, _item_name(META))], f"unreadable ({_cause(e)})") from e
  digest = meta.pop(DIGEST, None) if isinstance(meta, dict) else None
  if digest is None or _digest(meta) != digest:
    raise _damaged(path, [(META, _item_name(META))], "digest mismatch (its content is not what "
                   "was saved)")
  return meta


def check_run_step(path: str | os.PathLike) -> None:
  """A committed step of a run's own checkpoints holds its meta (Orbax committed the step with
  every item in it): a step without it (emptied, or partly deleted) is damage, to be set aside
  like any other, where a directory given as a model checkpoint is merely not one."""
  path = pathnames.absolute(path)
  if not (path / META).exists():
    raise _damaged(path, [(META, _item_name(META))], "missing (the step was committed with it: "
                   "emptied or partly deleted since)")


def _check_fits(path: epath.Path, item: str, target: Any, records: dict) -> None:
  """Raises CheckpointError (nothing wrong with the files: the model or optimizer does not
  match) unless `item` holds exactly the target's arrays with its shapes and dtypes, as the
  meta's records say. Orbax's metadata must be readable and agree with the records
  (CheckpointDamaged)."""
  orbax = {n: (tuple(m.shape), str(np.dtype(m.dtype)))
           for n, m in _stored_metadata(path, item).items()}
  stored = {n: (tuple(r["shape"]), r["dtype"]) for n, r in records.items()}
  if orbax != stored:
    raise _damaged(path, [(item, _item_name(item))],
                   f"metadata mismatch (Orbax's differs from the arrays '{META}' records)")
  want = {n: (tuple(s.shape), str(np.dtype(s.dtype))) for n, s in _named_leaves(target).items()}
  what = "parameter" if item == PARAMS else f"'{item}' array"
  for name, (shape, dtype) in want.items():
    if name not in stored:
      raise CheckpointError(f"{path}: {what} {name} is not in the checkpoint")
    if stored[name][0] != shape:
      raise CheckpointError(f"{path}: {what} {name} has shape {stored[name][0]} in the "
                            f"checkpoint; the model expects {shape}")
    if stored[name][1] != dtype:
      raise CheckpointError(f"{path}: {what} {name} has dtype {stored[name][1]} in the "
                            f"checkpoint; the model expects {dtype}")
  extra = sorted(set(stored) - set(want))
  if extra:
    raise CheckpointError(f"{path}: checkpoint has {what}s the model lacks: {extra[:5]}")


def _stored_metadata(path: epath.Path, item: str) -> dict[str, Any]:
  try:
    return _named_leaves(ocp.StandardCheckpointHandler().metadata(path / item))
  except Exception as e:  # Orbax raises many types for a damaged file
    if is_environmental(e):
      raise
    raise _damaged(path, [(item, _item_name(item))],
                   f"metadata unreadable ({_cause(e)})") from e


def _stored_names(target: Any) -> dict[str, str]:
  """Each array's name (array_name) -> the name Orbax stores it under (its TensorStore key)."""
  stored = _named_leaves(ocp.tree.get_param_names(target))
  return {name: stored[name] for name in _named_leaves(target) if name in stored}


def _unreadable(path: epath.Path, targets: dict[str, Any], error: BaseException
                ) -> CheckpointDamaged:
  """A failed restore as damage, naming the arrays the error names: TensorStore's error quotes
  the key it could not read (`"<stored name>/<chunk>"`) and Orbax's wrapper the array's path.
  An error naming no array (e.g. an unreadable OCDBT manifest) names the item whose directory
  it names, else every item read."""
  text = "\n".join(str(e) for e in _chain(error))
  found = [(item, _item_name(item) + name)
           for item, target in targets.items() for name, key in _stored_names(target).items()
           if f'"{key}/' in text or f"'{key}/" in text]
  found = found or [(item, _item_name(item)) for item in targets if f"{path / item}/" in text]
  found = found or [(None, " or ".join(_item_name(item) for item in targets))]
  return _damaged(path, found, f"unreadable ({_cause(error)})")


def _any_process(flag: bool) -> bool:
  """True on every process when `flag` is True on any (one process may fail to read a file
  the others never touch; all must then agree before the next collective)."""
  if jax.process_count() == 1:
    return flag
  return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def restore_items(path: str | os.PathLike, targets: dict[str, Any]
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
  """(items, meta): each item of `targets` restored onto its target (a tree of
  jax.ShapeDtypeStruct with the shardings wanted; any mesh: Orbax reshards), checked and
  verified as the module docstring says."""
  path = pathnames.absolute(path)
  meta = load_meta(path)
  records = meta.get(ARRAYS, {})
  for item, target in targets.items():
    if item not in records:  # never saved (its meta records every item saved)
      raise CheckpointError(f"{path}: no '{item}' item" + (
          " (a converted model checkpoint holds parameters only)" if item != PARAMS else ""))
    if not (path / item).exists():  # saved, now gone
      raise _damaged(path, [(item, _item_name(item))], "missing")
    _check_fits(path, item, target, records[item])
  error = None
  try:
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    restored = checkpointer.restore(path, args=ocp.args.Composite(**{
        item: ocp.args.StandardRestore(target) for item, target in targets.items()}))
  except Exception as e:  # Orbax/TensorStore raise many types for damaged files
    if is_environmental(e):
      raise
    error = _unreadable(path, targets, e)
    error.__cause__ = e
  if _any_process(error is not None):
    raise error or CheckpointDamaged(f"{path} is damaged: another process could not read it "
                                     "(its log names the array and file)")
  out = {item: restored[item] for item in targets}
  _verify(path, out, records)
  return out, meta


def _verify(path: epath.Path, items: dict[str, Any], records: dict[str, dict]) -> None:
  """CheckpointDamaged unless every array's checksum is the one recorded (for checkpoints
  that record them) and no array holds NaN/Inf."""
  summaries = summarize(items)
  names = [(item, _item_name(item) + n) for item in items for n in _named_leaves(items[item])]
  saved = {_item_name(item) + n: r["checksum"]
           for item, arrays in records.items() if item in items for n, r in arrays.items()}
  bad = [(item, n) for item, n in names if n in saved and summaries[n].checksum != saved[n]]
  if bad:
    first = bad[0][1]
    raise _damaged(path, bad, f"checksum mismatch (saved {saved[first]}, read "
                              f"{summaries[first].checksum})")
  bad = [(item, n) for item, n in names if not summaries[n].finite]
  if bad:
    raise _damaged(path, bad, "NaN/Inf")


def restore_params(path: str | os.PathLike, target: Any) -> Any:
  """Restores `params` onto `target` (see `restore_items`)."""
  return restore_items(path, {PARAMS: target})[0][PARAMS]


def host_target(params_shapes: Any) -> Any:
  """A restore target that puts every leaf on the first local device (CPU tools)."""
  sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.dtype(x.dtype), sharding=sharding),
                      params_shapes)


def run_steps(directory: str | os.PathLike) -> list[int]:
  """The committed steps of a run's checkpoints directory, oldest first (on disks Orbax names a
  step's directory by its number only once it is complete; on object stores it names it at once
  and commits it with a file written last)."""
  directory = pathnames.absolute(directory)
  if not directory.exists():
    return []
  steps = [p for p in directory.glob("*") if p.name.isdigit()]
  if pathnames.is_url(os.fspath(directory)):  # named before complete there: the commit file says
    steps = [p for p in steps if orbax_s3.is_committed(p)]
  return sorted(int(p.name) for p in steps)


def steps_directory(path: str | os.PathLike) -> epath.Path:
  """The directory of numbered steps a run's workdir or its checkpoints directory names."""
  path = pathnames.absolute(path)
  return path / "checkpoints" if (path / "checkpoints").exists() else path


def resolve_step_dir(path: str | os.PathLike) -> epath.Path:
  """A checkpoint step directory from a step directory, a run's checkpoints directory or a run
  workdir (their latest step)."""
  path = pathnames.absolute(path)
  if (path / PARAMS).exists():
    return path
  directory = steps_directory(path)
  steps = run_steps(directory)
  if not steps:
    raise CheckpointError(f"{path}: no checkpoint (expected a step directory holding "
                          f"'{PARAMS}', or a directory of numbered steps)")
  return directory / str(steps[-1])
