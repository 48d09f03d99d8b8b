"""AI2's OLMo-core checkpoints -> olmo3 checkpoints (`python -m olmo3.convert import-olmo-core`).

Read with torch's own distributed-checkpoint code (torch.distributed.checkpoint: its
FileSystemReader, its planner, `load`), changed in two ways: files are read through
olmo3.io.storage (local paths, gs://, s3://, http(s)://: one ranged request per chunk, retried
within the storage budget), and nothing is unpickled beyond plain data and the format's own
classes (the metadata, the trainer state and the optimizer's hyperparameters are pickles, often
from a server). Tensors are loaded one parameter of one kind at a time, straight into
memory-mapped float32 arrays in a staging directory: host memory holds one chunk at a time,
never the model, let alone its moments.

What is imported (olmo3.io.olmo_core_checkpoints says where OLMo-core keeps it):
- the weights, `model.<name>` (olmo3.convert.olmo_core_params maps the names; linear weights are
  transposed, layers stacked);
- SkipStepAdamW's moments, `optim.state.<name>.exp_avg` / `exp_avg_sq`, as Adam's mu / nu, and
  its per-parameter `step` as Adam's count. SkipStepAdamW counts only the updates it did not
  skip, as optax's count does under our skip (olmo3.train.step keeps the old state), and every
  parameter's count must agree: optax keeps one;
- the optimizer's hyperparameters, `optim.param_groups.<name>.{betas, eps, weight_decay}`: on
  loading, OLMo-core keeps the checkpoint's, not its config's (all but `initial_lr`), so a run
  continuing it checks its own optimizer config against them (olmo3.train.continuation). AI2's
  groups leave the input embedding undecayed; olmo3 masks decay per top-level parameter group
  (OptimizerConfig.no_decay), so the checkpoint's decay must be uniform within each of ours;
- the trainer state (train/rank0.pt; absent in a model-and-optimizer checkpoint): the global
  step, epoch, and the data loader's position and data fingerprint.

The output is a model checkpoint (olmo3.io.checkpoint: checksums, a digest, committed as a
whole) with `params`, `adam` ({count, mu, nu}) and the meta: the model config, the source,
`step` (the trainer's global step) and `olmo_core` (`facts`: the count, the hyperparameters per
group, the trainer state). `checkpoint.init_from` takes it, or the source itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from olmo3 import model as model_lib
from olmo3.config import ModelConfig
from olmo3.convert import olmo_core_params, olmo_core_config
from olmo3.convert.hf import ConversionError, memmap_allocator
from olmo3.io import checkpoint, pathnames, storage
from olmo3.io.olmo_core_checkpoints import METADATA, OlmoCoreCheckpoint, locate

try:
  import torch
  import torch.distributed.checkpoint as dcp
  from torch.distributed.checkpoint import filesystem as dcp_filesystem
  from torch.distributed.checkpoint import metadata as dcp_metadata
  from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
except ImportError as e:  # torch is an extra: only this reader needs it
  raise ConversionError("reading OLMo-core checkpoints needs torch: pip install -e "
                        "'.[olmo_core]'") from e

# What the moments and the step are called in OLMo-core's flattened optimizer state.
MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq"}
HYPERPARAMETERS = ("betas", "eps", "weight_decay")
# The most chunk bytes one read holds at once (a larger chunk is read alone): reads of a group
# are concurrent, and host memory stays bounded whatever the checkpoint's size.
_GROUP_BYTES = 256 << 20
# The metadata's classes, by the (module, name) its pickle names; OLMo-core's writer pickles its
# own copy of torch's per-chunk storage record.
_METADATA_CLASSES = {
    **{("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
       for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                    "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                    "_MEM_FORMAT_ENCODING")},
    ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): dict,
}
# The trainer state holds NumPy's RNG state (an array) besides plain data and tensors; older
# NumPy pickles its reconstructor under numpy.core.
_TRAINER_STATE_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype,
                          type(np.dtype(np.uint32)),
                          (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct")]
_TRAINER_FIELDS = ("global_step", "global_train_tokens_seen", "max_steps", "epoch", "world_size")


def _why(error: BaseException) -> str:
  """An error in one line: torch's refusal to unpickle says why on its WeightsUnpickler line."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
  marker = "WeightsUnpickler error:"
  at = next((i for i, line in enumerate(lines) if marker in line), None)
  if at is None:
    return f"{type(error).__name__}: {lines[0]}"
  reason = lines[at].partition(marker)[2].strip() or (lines[at + 1:] or [""])[0]
  return f"{type(error).__name__}: {reason}"


class _MetadataUnpickler(pickle.Unpickler):
  def find_class(self, module: str, name: str) -> Any:
    if (module, name) in _METADATA_CLASSES:
      return _METADATA_CLASSES[(module, name)]
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
      return getattr(torch, name)
    raise pickle.UnpicklingError(f"unexpected {module}.{name} in a checkpoint's metadata")


class _StorageFiles:
  """The file system torch's FileSystemReader goes through: olmo3.io.storage, for local paths
  and URLs alike. A file's "stream" is its path; `_Reader._slice_file` reads the bytes."""

  def init_path(self, path: str | os.PathLike) -> str:
    return os.fspath(path)

  def concat_path(self, path: str, suffix: str) -> str:
    return pathnames.join(path, suffix)

  @contextlib.contextmanager
  def create_stream(self, path: str, mode: str):
    del mode  # read only
    yield path


class _Reader(dcp_filesystem.FileSystemReader):
  """torch's reader over olmo3.io.storage: a load's chunks fetched concurrently (one ranged
  request each) in groups of at most _GROUP_BYTES, then placed by torch's own `read_data`; the
  metadata read once and unpickled with only the format's classes allowed."""

  def __init__(self, path: str):
    super().__init__(path)
    self.fs = _StorageFiles()
    self.path = path  # as given: torch's local FileSystem would take a URL's "//" apart
    self._metadata: dcp_metadata.Metadata | None = None
    self._fetched: dict[tuple[str, int], bytes] = {}

  def read_data(self, plan, planner):
    for group in self._groups(plan.items):
      requests = [(pathnames.join(self.path, s.relative_path), s.offset, s.offset + s.length)
                  for s in (self.storage_data[item.storage_index] for item in group)]
      self._fetched = {(path, start): data for (path, start, _), data
                       in zip(requests, storage.read_ranges(requests))}
      super().read_data(dataclasses.replace(plan, items=group), planner)
      self._fetched = {}
    done = torch.futures.Future()
    done.set_result(None)
    return done

  def _groups(self, items: list) -> Iterator[list]:
    group, size = [], 0
    for item in items:
      length = self.storage_data[item.storage_index].length
      if group and size + length > _GROUP_BYTES:
        yield group
        group, size = [], 0
      group.append(item)
      size += length
    if group:
      yield group

  def _slice_file(self, file: str, sinfo) -> io.BytesIO:
    return io.BytesIO(self._fetched[(file, sinfo.offset)])

  def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
    del args, kwargs
    if self._metadata is None:
      path = pathnames.join(self.path, METADATA)
      try:
        metadata = _MetadataUnpickler(io.BytesIO(storage.read_bytes(path))).load()
      except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
        raise ConversionError(f"{path}: not torch distributed-checkpoint metadata ({e})") from e
      if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
      metadata.storage_meta.load_id = self.load_id
      self._metadata = metadata
    return self._metadata

  def load(self, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Copies each tensor named in `state_dict` into the tensor it maps to; returns the pickled
    values it names (whatever they map to), by name."""
    planner = _Planner(flatten_state_dict=False)
    try:
      with warnings.catch_warnings():  # torch's note that it reads in one process (as asked)
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state_dict, storage_reader=self, planner=planner, no_dist=True)
    except dcp.api.CheckpointException as e:  # a BaseException wrapping what failed
      (cause, _), = e.failures.values()  # one process: one failure
      if isinstance(cause, (ConversionError, OSError)):  # ours, or the storage's: as they are
        raise cause from None
      names = sorted(state_dict)
      raise ConversionError(f"{self.path}: reading {names[0]}" + (
          f" (and {len(names) - 1} more)" if len(names) > 1 else "") +
          f" failed: {_why(cause)}") from None
    return planner.values


class _Planner(DefaultLoadPlanner):
  """torch's planner, with pickled values (the optimizer's hyperparameters) read as plain data
  (torch's own unpickles them without restriction) into `values`: `load` hands the planner a
  copy of its state dict."""

  def __init__(self, **kwargs: Any):
    super().__init__(**kwargs)
    self.values: dict[str, Any] = {}

  def load_bytes(self, read_item, value: io.BytesIO) -> None:
    self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _tensor(reader: _Reader, name: str) -> dcp_metadata.TensorStorageMetadata:
  found = reader.read_metadata().state_dict_metadata.get(name)
  if not isinstance(found, dcp_metadata.TensorStorageMetadata):
    raise ConversionError(f"{reader.path}: tensor {name} is not in the checkpoint"
                          + ("" if found is None else f" (a {type(found).__name__})"))
  return found


def _check_layout(reader: _Reader, cfg: ModelConfig) -> None:
  """ConversionError unless the checkpoint holds exactly our model's weights, with our shapes,
  and the optimizer's state for each (flattened, as OLMo-core saves it)."""
  names = reader.read_metadata().state_dict_metadata
  if "optim.param_groups.0.params" in names:
    raise ConversionError(f"{reader.path}: the optimizer state is not flattened "
                          "(optim.param_groups.0.params): an older OLMo-core layout, not read here")
  if not any(n.startswith("optim.state.") for n in names):
    raise ConversionError(f"{reader.path}: no optimizer state (optim.state.*): a weights-only "
                          "checkpoint; import its Hugging Face export with import-hf instead")
  shapes = model_lib.param_shapes(cfg)
  expected = {}
  for source in olmo_core_params.sources(cfg):
    shape = olmo_core_params.leaf(shapes, source.path).shape[1 if source.stacked else 0:]
    for name in source.names:
      expected[name] = tuple(reversed(shape)) if source.transposed else tuple(shape)
  for name, shape in expected.items():
    for full in (f"model.{name}", *(f"optim.state.{name}.{m}" for m in MOMENTS.values())):
      found = tuple(_tensor(reader, full).size)
      if found != shape:
        raise ConversionError(f"{reader.path}: tensor {full} has shape {found}; the model "
                              f"config ({cfg.param_count:,} parameters) expects {shape}")
  extra = sorted(n for n in names if n.startswith("model.") and n[len("model."):] not in expected)
  if extra:
    raise ConversionError(f"{reader.path}: the checkpoint holds tensors the model lacks: "
                          f"{extra[:5]}")


def _load_scalars(reader: _Reader, names: list[str]) -> dict[str, float]:
  tensors = {n: torch.empty(tuple(_tensor(reader, n).size), dtype=torch.float32) for n in names}
  reader.load(tensors)
  return {n: float(t) for n, t in tensors.items()}


def adam_count(reader: _Reader, cfg: ModelConfig) -> int:
  """The updates SkipStepAdamW made (every parameter's `step`, which must agree)."""
  names = [f"optim.state.{n}.step" for s in olmo_core_params.sources(cfg) for n in s.names]
  steps = _load_scalars(reader, names)
  first = steps[names[0]]
  for name, value in steps.items():
    if value != first:
      raise ConversionError(f"{reader.path}: tensor {name} is {value}, {names[0]} {first}: "
                            "parameters updated different numbers of times cannot share "
                            "Adam's one count")
  if first != int(first) or first < 0:
    raise ConversionError(f"{reader.path}: tensor {names[0]} is {first}, not a count of updates")
  return int(first)


def hyperparameters(reader: _Reader, cfg: ModelConfig) -> dict[str, dict[str, Any]]:
  """The optimizer's betas, eps and weight decay per top-level parameter group of ours
  (embed_tokens, layers, norm, lm_head), as the checkpoint gives them for each parameter."""
  sources = olmo_core_params.sources(cfg)
  wanted = {f"optim.param_groups.{n}.{h}": None for s in sources for n in s.names
            for h in HYPERPARAMETERS}
  missing = [n for n in wanted if n not in reader.read_metadata().state_dict_metadata]
  if missing:
    raise ConversionError(f"{reader.path}: {missing[0]} is not in the checkpoint")
  wanted = reader.load(wanted)
  groups: dict[str, dict[str, Any]] = {}
  for source in sources:
    for name in source.names:
      values = {h: wanted[f"optim.param_groups.{name}.{h}"] for h in HYPERPARAMETERS}
      values["betas"] = [float(b) for b in values["betas"]]
      values = {h: values[h] if h == "betas" else float(values[h]) for h in HYPERPARAMETERS}
      group = source.path[0]
      if groups.setdefault(group, values) != values:
        raise ConversionError(
            f"{reader.path}: parameter {name} has optimizer settings {values}, others of ours "
            f"in group {group!r} {groups[group]}: olmo3 sets them per top-level group")
  return groups


def trainer_state(located: OlmoCoreCheckpoint) -> dict[str, Any] | None:
  """What a continuation needs of the trainer state (None: the checkpoint has none): the
  trainer's step, tokens, epoch and world size, and the data loader's state."""
  if located.trainer_state is None:
    return None
  try:
    data = storage.read_bytes(located.trainer_state)
  except FileNotFoundError:
    return None
  try:
    with torch.serialization.safe_globals(_TRAINER_STATE_GLOBALS):
      state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
  except (pickle.UnpicklingError, RuntimeError, EOFError) as e:  # not plain data, not torch's
    raise ConversionError(f"{located.trainer_state}: not read: {_why(e)}") from e
  missing = [f for f in (*_TRAINER_FIELDS, "data_loader") if f not in state]
  if missing:
    raise ConversionError(f"{located.trainer_state}: no {missing[0]!r} in the trainer state")
  loader = {k: v for k, v in state["data_loader"].items()
            if v is None or isinstance(v, (bool, int, float, str))}
  return {**{f: state[f] for f in _TRAINER_FIELDS}, "data_loader": loader}


def facts(located: OlmoCoreCheckpoint, cfg: ModelConfig) -> dict[str, Any]:
  """What a run checks before it starts from the checkpoint (small reads only): Adam's count,
  the optimizer's settings per group, the trainer state (None without one)."""
  reader = _Reader(located.model_dir)
  _check_layout(reader, cfg)
  return {"adam_count": adam_count(reader, cfg), "optimizer": hyperparameters(reader, cfg),
          "trainer": trainer_state(located)}


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _read_arrays(reader: _Reader, cfg: ModelConfig, alloc) -> dict[str, dict[str, Any]]:
  """{"params", "mu", "nu"}: our trees, each leaf allocated by `alloc` and filled in place by
  torch's loader (one of our leaves of one kind per load: its layers' tensors)."""
  prefixes = {"params": "model.{}", **{ours: f"optim.state.{{}}.{theirs}"
                                       for ours, theirs in MOMENTS.items()}}
  shapes = model_lib.param_shapes(cfg)
  trees: dict[str, dict[str, Any]] = {kind: {} for kind in prefixes}
  for source in olmo_core_params.sources(cfg):
    for kind, prefix in prefixes.items():
      array = alloc(olmo_core_params.leaf(shapes, source.path).shape)
      parts = list(array) if source.stacked else [array]
      # Views into the array, in OLMo-core's layout (a transposed view for linear weights):
      # torch copies each chunk it reads straight into its place.
      targets = {prefix.format(name): torch.from_numpy(part.T if source.transposed else part)
                 for name, part in zip(source.names, parts)}
      reader.load(targets)
      _set(trees[kind], source.path, array)
  return trees


def import_checkpoint(source: str, out: str, cfg: ModelConfig, staging: str | None = None,
                      check: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
  """Writes the olmo3 checkpoint of the OLMo-core checkpoint `source` (olmo3.io.
  olmo_core_checkpoints.locate: a step directory, a save folder, a URL or an official name) to
  `out`; returns its meta. `check(facts)` runs before any tensor is read (a run refuses a
  mismatch there). The float32 arrays are staged under `staging` (default: beside a local
  `out`, else the system's temporary directory) until written. ConversionError names what does
  not fit: tensors of other shapes than `cfg`'s, or a model olmo3 cannot express (the
  checkpoint's own config.json says: its tensors could have our names and shapes, as a pre-norm
  block's do)."""
  located = located_or_refused(source)
  olmo_core_config.read(located)  # refuses a model olmo3 cannot express, whatever its shapes
  found = facts(located, cfg)
  if check is not None:
    check(found)
  if staging is None and not pathnames.is_url(out):
    staging = os.path.dirname(os.path.abspath(out))
  if staging is not None:
    os.makedirs(staging, exist_ok=True)
  meta = {"source": located.root,
          "step": found["trainer"]["global_step"] if found["trainer"] else None,
          "olmo_core": found}
  with tempfile.TemporaryDirectory(prefix=".import-", dir=staging) as tmp:
    trees = _read_arrays(_Reader(located.model_dir), cfg, memmap_allocator(tmp))
    adam = {"count": np.asarray(found["adam_count"], np.int32), "mu": trees["mu"],
            "nu": trees["nu"]}
    checkpoint.save_model(out, cfg, trees["params"], meta=meta, items={checkpoint.ADAM: adam})
  return meta


def located_or_refused(source: str) -> OlmoCoreCheckpoint:
  """locate(source), or a ConversionError saying what it is not."""
  located = locate(source)
  if located is None:
    raise ConversionError(f"{source}: not an OLMo-core checkpoint (no model_and_optim/"
                          f"{METADATA} or {METADATA} there, nor step directories) nor an "
                          "official name (--list)")
  return located


def describe(meta: dict[str, Any]) -> str:
  """One line on what an import holds (the CLI's report)."""
  trainer = meta["olmo_core"]["trainer"]
  where = ("no trainer state (a new stage only)" if trainer is None else
           f"global step {trainer['global_step']:,}, epoch {trainer['epoch']}, "
           f"{trainer['data_loader'].get('tokens_processed', 0):,} tokens into the epoch")
  return f"{where}; Adam's count {meta['olmo_core']['adam_count']:,}"

