"""Hugging Face OLMo 3 directories <-> our parameter tree. Reads and writes safetensors only.

Our parameter paths are Hugging Face's names, with two differences that this module owns:
layers are stacked on a leading axis, and linear weights are stored (in, out) where torch stores
(out, in). Vocabulary rows are padded to `padded_vocab_size` on import (zeros) and cut on export.
No torch is needed here.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
from etils import epath
from safetensors import safe_open
from safetensors.numpy import save_file

from olmo3.config import ConfigError, ModelConfig, ScaledLayers, Yarn

Params = dict[str, Any]  # nested dict of arrays, as nnx.State.to_pure_dict() gives

# (our path inside the stacked `layers`, HF name inside `model.layers.{i}.`, is a linear weight)
_LAYER_TENSORS: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("self_attn", "q_proj", "kernel"), "self_attn.q_proj.weight", True),
    (("self_attn", "k_proj", "kernel"), "self_attn.k_proj.weight", True),
    (("self_attn", "v_proj", "kernel"), "self_attn.v_proj.weight", True),
    (("self_attn", "o_proj", "kernel"), "self_attn.o_proj.weight", True),
    (("self_attn", "q_norm", "weight"), "self_attn.q_norm.weight", False),
    (("self_attn", "k_norm", "weight"), "self_attn.k_norm.weight", False),
    (("post_attention_layernorm", "weight"), "post_attention_layernorm.weight", False),
    (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", True),
    (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", True),
    (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", True),
    (("post_feedforward_layernorm", "weight"), "post_feedforward_layernorm.weight", False),
)

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}
_SHARD_BYTES = 5 * 2**30  # transformers' default max shard size


class ConversionError(ValueError):
  """A Hugging Face directory or checkpoint cannot be converted. The message names the cause."""


# --- config.json -------------------------------------------------------------------------------


_YARN_KEYS = {"factor": "factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
              "original_max_position_embeddings": "original_context"}


def _rope(hf: dict[str, Any], where: str) -> tuple[float, Yarn | None]:
  """RoPE theta (one for every layer type) and the YaRN scaling, if any, or a ConversionError.

  transformers 4.57 reads `rope_theta` and a flat `rope_scaling`, 5.0-5.3 one flat
  `rope_parameters` dict for every layer, later 5.x one per layer type. Per-type entries say
  which layers YaRN scales; a flat-only yarn config (AI2's released OLMo 3 7B, transformers
  4.57's `rope_scaling`) is taken as OLMo 3 was trained: YaRN on the full-attention layers only
  (docs/architecture.md#yarn). A config with both spellings must have them agree: else
  transformers versions would run different models from it."""
  legacy = {"rope_theta": hf.get("rope_theta", 500_000.0), **(hf.get("rope_scaling") or {})}
  if "rope_parameters" in hf and ("rope_theta" in hf or hf.get("rope_scaling")):
    both = [_read_rope(p, hf, where) for p in (legacy, hf["rope_parameters"])]
    said = [f"theta {theta:g}, " + ("no YaRN" if y is None else (
        f"YaRN factor {y.factor:g}, beta {y.beta_fast:g}/{y.beta_slow:g}, original context "
        f"{y.original_context}")) for theta, y in both]  # which layers: only per type
    if said[0] != said[1]:
      raise ConversionError(
          f"{where}: rope_theta / rope_scaling ({said[0]}) and rope_parameters ({said[1]}) "
          "disagree: transformers 4.57 reads the first, 5.x the second")
    return both[1]
  return _read_rope(hf.get("rope_parameters") or legacy, hf, where)


def _read_rope(params: dict[str, Any], hf: dict[str, Any], where: str
               ) -> tuple[float, Yarn | None]:
  """`_rope` of one spelling: a flat dict, per-layer-type dicts, or both in one."""
  per_type = {k: v for k, v in params.items() if isinstance(v, dict)}
  flat = {k: v for k, v in params.items() if not isinstance(v, dict)}
  if flat and (per_type.keys() != {"full_attention", "sliding_attention"}):
    per_type = {"all": flat, **per_type}
  thetas, yarns, scaled = set(), set(), set()
  for layer_type, p in per_type.items():
    kind = p.get("rope_type", p.get("type", "default"))
    if kind not in ("default", "yarn"):
      raise ConversionError(f"{where}: rope_parameters[{layer_type!r}] has rope_type {kind!r}; "
                            "only 'default' and 'yarn' RoPE are supported")
    thetas.add(float(p.get("rope_theta", hf.get("rope_theta", 500_000.0))))
    if kind == "yarn":
      missing = [k for k in ("factor", "original_max_position_embeddings") if k not in p]
      if missing:
        raise ConversionError(f"{where}: rope_parameters[{layer_type!r}] (yarn) lacks {missing}")
      yarns.add(tuple(float(p.get(k, default)) for k, default in (
          ("factor", 0), ("beta_fast", 32), ("beta_slow", 1),
          ("original_max_position_embeddings", 0))))
      scaled.add(layer_type)
  if len(thetas) != 1:
    raise ConversionError(f"{where}: RoPE theta differs between layer types ({sorted(thetas)})")
  if len(yarns) > 1:
    raise ConversionError(f"{where}: YaRN parameters differ between layer types")
  if not yarns:
    return thetas.pop(), None
  factor, beta_fast, beta_slow, original = yarns.pop()
  layers = ScaledLayers.ALL if "sliding_attention" in scaled else ScaledLayers.FULL_ATTENTION
  try:
    yarn = Yarn(factor=factor, beta_fast=beta_fast, beta_slow=beta_slow,
                original_context=int(original), layers=layers)
  except ConfigError as e:
    raise ConversionError(f"{where}: {e}") from None
  return thetas.pop(), yarn


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
  """Our ModelConfig for an HF Olmo3Config dict; rejects anything that is not OLMo 3 stages 1-2."""
  if hf.get("model_type") != "olmo3":
    raise ConversionError(f"{where}: model_type is {hf.get('model_type')!r}, not 'olmo3'")
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads"):
    if key not in hf:
      raise ConversionError(f"{where}: missing field {key!r}")
  checks = {"tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu"}
  for key, want in checks.items():
    if hf.get(key, want) != want:
      raise ConversionError(f"{where}: {key}={hf[key]!r} is not supported (OLMo 3 has {want!r})")
  heads, d = hf["num_attention_heads"], hf["hidden_size"]
  if hf.get("head_dim") not in (None, d // heads):
    raise ConversionError(f"{where}: head_dim={hf['head_dim']} != hidden_size / "
                          f"num_attention_heads = {d // heads}")
  n_layers = hf["num_hidden_layers"]
  layer_types = hf.get("layer_types") or [
      "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layers)]
  if len(layer_types) != n_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
    raise ConversionError(f"{where}: layer_types must list 'full_attention' or "
                          f"'sliding_attention' for each of the {n_layers} layers")
  is_global = [t == "full_attention" for t in layer_types]
  global_every = is_global.index(True) + 1 if True in is_global else n_layers
  eos = hf.get("eos_token_id")
  vocab = hf["vocab_size"]
  theta, yarn = _rope(hf, where)
  try:
    cfg = ModelConfig(
        vocab_size=vocab, padded_vocab_size=-(-vocab // 128) * 128, d_model=d,
        n_layers=n_layers, n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        mlp_hidden=hf["intermediate_size"],
        sliding_window=hf.get("sliding_window") or hf.get("max_position_embeddings", 8192),
        global_every=global_every, rope_theta=theta, rope_scaling=yarn,
        norm_eps=hf.get("rms_norm_eps", 1e-6), init_std=hf.get("initializer_range", 0.02),
        max_seq_len=hf.get("max_position_embeddings", 8192),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        pad_token_id=hf.get("pad_token_id"))
  except ConfigError as e:
    raise ConversionError(f"{where}: {e}") from None
  if list(cfg.layer_is_global) != is_global:
    first = next(i for i, (a, b) in enumerate(zip(cfg.layer_is_global, is_global)) if a != b)
    raise ConversionError(
        f"{where}: layer_types[{first}]={layer_types[first]!r} breaks OLMo 3's pattern (layer i "
        f"global when i % {global_every} == {global_every - 1}, the last layer global)")
  return cfg


def model_config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
  """An Olmo3Config dict that every transformers version with OLMo 3 reads as the same RoPE,
  written three ways because each reads another (docs/architecture.md#hugging-face-parity-
  settings):

  - 4.57 (the first with OLMo 3) reads `rope_theta` (its default 10,000) and the flat
    `rope_scaling`, which it applies to the full-attention layers only, as OLMo 3 was trained;
    it ignores `rope_parameters`. These two are what AI2's released configs carry.
  - 5.0-5.3 read `rope_scaling` when present, else the flat keys of `rope_parameters`
    (`rope_type`, `rope_theta`), with one rotary embedding for every layer: YaRN reaches the
    sliding layers too (`hf_runs_differently`). They warn "Unrecognized keys in
    `rope_parameters`" naming the two layer types.
  - Later 5.x (5.24 checked) read `rope_parameters[layer_type]`, merging `rope_scaling` into the
    full-attention entry; without the per-type entries the sliding layers' theta would be a
    default.

  YaRN (stage 3) is written per layer type as trained (the full-attention layers' entry
  scaled, the sliding layers' plain unless `ScaledLayers.ALL`); `rope_scaling` carries no
  theta (4.57 warns about keys a yarn entry does not have)."""
  plain = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  yarn = cfg.rope_scaling
  scaled = plain if yarn is None else {
      "rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": yarn.factor,
      "original_max_position_embeddings": yarn.original_context, "beta_fast": yarn.beta_fast,
      "beta_slow": yarn.beta_slow, "attention_factor": yarn.attention_factor}
  sliding = scaled if yarn is not None and yarn.layers == ScaledLayers.ALL else plain
  return {
      "architectures": ["Olmo3ForCausalLM"],
      "model_type": "olmo3",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_hidden,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len,
      "initializer_range": cfg.init_std,
      "rms_norm_eps": cfg.norm_eps,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "sliding_window": cfg.sliding_window,
      "layer_types": ["full_attention" if g else "sliding_attention" for g in cfg.layer_is_global],
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None if yarn is None else {
          k: v for k, v in scaled.items() if k != "rope_theta"},
      "rope_parameters": {**scaled, "full_attention": dict(scaled),
                          "sliding_attention": dict(sliding)},
      "tie_word_embeddings": False,
      "pad_token_id": cfg.pad_token_id,
      "eos_token_id": cfg.eos_token_id,
      "bos_token_id": None,
      "use_cache": True,
      "dtype": dtype,
  }


def hf_runs_differently(cfg: ModelConfig) -> str | None:
  """Which transformers versions run an export of `cfg` otherwise than it was trained, or None:
  5.0-5.3's Olmo3 builds one rotary embedding from the flat `rope_parameters` for every layer,
  so YaRN meant for the full-attention layers scales the sliding layers too; 4.57's gives the
  sliding layers plain RoPE whatever `rope_scaling` says."""
  if cfg.rope_scaling is None:
    return None
  if cfg.rope_scaling.layers == ScaledLayers.ALL:
    return ("transformers 4.57 applies YaRN to the full-attention layers only (its Olmo3 gives "
            "the sliding layers plain RoPE), but this model scales every layer: logits differ "
            "from training's; transformers 5.x run it as trained")
  return ("transformers 5.0-5.3 apply YaRN to every layer (their Olmo3 has one rotary "
          "embedding), but this model was trained with YaRN on its full-attention layers only: "
          "logits differ from training's (docs/architecture.md#yarn); transformers 4.57 and "
          "the 5.x that read rope_parameters per layer type (5.24) run it as trained")


# --- tensors -----------------------------------------------------------------------------------


def _expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  d, f, v = cfg.d_model, cfg.mlp_hidden, cfg.vocab_size
  q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  per_layer = {"self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
               "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
               "self_attn.q_norm.weight": (q,), "self_attn.k_norm.weight": (kv,),
               "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (f, d),
               "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
               "post_feedforward_layernorm.weight": (d,)}
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
            "lm_head.weight": (v, d)}
  for i in range(cfg.n_layers):
    shapes.update({f"model.layers.{i}.{k}": s for k, s in per_layer.items()})
  return shapes


class SafetensorsDir:
  """Random access to the tensors of an HF directory (one file, or shards with an index)."""

  def __init__(self, path: str | os.PathLike):
    self.path = epath.Path(path)
    index = self.path / "model.safetensors.index.json"
    if index.exists():
      weight_map = json.loads(index.read_text())["weight_map"]
      self._files = {name: self.path / f for name, f in weight_map.items()}
    else:
      files = sorted(self.path.glob("*.safetensors"))
      if not files:
        raise ConversionError(f"{self.path}: no *.safetensors files (only safetensors are read)")
      self._files = {}
      for file in files:
        with safe_open(os.fspath(file), framework="numpy") as f:
          self._files.update({name: file for name in f.keys()})

  def names(self) -> set[str]:
    return set(self._files)

  def get(self, name: str) -> np.ndarray:
    if name not in self._files:
      raise ConversionError(f"{self.path}: tensor {name!r} is missing")
    with safe_open(os.fspath(self._files[name]), framework="numpy") as f:
      return f.get_tensor(name)


def _set(tree: Params, path: tuple[str, ...], value: np.ndarray) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: Params, path: tuple[str, ...]) -> np.ndarray:
  for key in path:
    tree = tree[key]
  return np.asarray(tree)


Allocator = Callable[[tuple[int, ...]], np.ndarray]


def in_memory(shape: tuple[int, ...]) -> np.ndarray:
  return np.empty(shape, np.float32)


def params_from_hf(cfg: ModelConfig, tensors: SafetensorsDir, alloc: Allocator = in_memory
                   ) -> Params:
  """Our float32 parameter tree from HF tensors; checks every name and shape first.

  `alloc(shape)` makes each destination array: pass a memory-mapped allocator to import a model
  larger than RAM (the 7B is 29 GB in float32); tensors are read one at a time.
  """
  expected = _expected_hf_shapes(cfg)
  present = tensors.names()
  missing = sorted(set(expected) - present)
  unexpected = sorted(present - set(expected))
  if missing:
    raise ConversionError(f"{tensors.path}: missing tensors {missing[:5]}"
                          f"{' …' if len(missing) > 5 else ''} ({len(missing)} in all)")
  if unexpected:
    raise ConversionError(f"{tensors.path}: tensors not in an OLMo 3 model: {unexpected[:5]}"
                          f"{' …' if len(unexpected) > 5 else ''}")

  def load(name: str) -> np.ndarray:
    x = tensors.get(name)
    if tuple(x.shape) != expected[name]:
      raise ConversionError(f"{tensors.path}: tensor {name!r} has shape {tuple(x.shape)}, "
                            f"expected {expected[name]} from config.json")
    return x

  v, vp, d = cfg.vocab_size, cfg.padded_vocab_size, cfg.d_model
  params: Params = {}
  embedding = alloc((vp, d))
  embedding[:v], embedding[v:] = load("model.embed_tokens.weight"), 0  # padding rows: zeros
  _set(params, ("embed_tokens", "embedding"), embedding)
  head = alloc((d, vp))
  head[:, :v], head[:, v:] = load("lm_head.weight").T, 0
  _set(params, ("lm_head", "kernel"), head)
  norm = alloc((d,))
  norm[:] = load("model.norm.weight")
  _set(params, ("norm", "weight"), norm)
  for path, hf_name, linear in _LAYER_TENSORS:
    shape = expected[f"model.layers.0.{hf_name}"]
    stacked = alloc((cfg.n_layers, *(shape[::-1] if linear else shape)))
    for i in range(cfg.n_layers):
      x = load(f"model.layers.{i}.{hf_name}")
      stacked[i] = x.T if linear else x
    _set(params, ("layers", *path), stacked)
  return params


def params_to_hf(cfg: ModelConfig, params: Params, dtype: str = "float32"
                 ) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, tensor) pairs in HF layout and `dtype`; padded vocabulary rows are cut."""
  cast = DTYPES[dtype]
  v = cfg.vocab_size
  yield "model.embed_tokens.weight", _get(params, ("embed_tokens", "embedding"))[:v].astype(cast)
  yield "lm_head.weight", np.ascontiguousarray(_get(params, ("lm_head", "kernel"))[:, :v].T
                                              ).astype(cast)
  yield "model.norm.weight", _get(params, ("norm", "weight")).astype(cast)
  for path, hf_name, linear in _LAYER_TENSORS:
    stacked = _get(params, ("layers", *path))
    for i in range(cfg.n_layers):
      x = stacked[i].T if linear else stacked[i]
      yield f"model.layers.{i}.{hf_name}", np.ascontiguousarray(x).astype(cast)


def write_hf_dir(out: str | os.PathLike, cfg: ModelConfig, params: Params,
                 dtype: str = "float32", extra_files: dict[str, str] | None = None) -> None:
  """Writes config.json + safetensors (sharded past 5 GiB, with an index) and `extra_files`
  (name -> text: the tokenizer's and the chat template's) atomically: into a temporary sibling
  directory, renamed into place when complete, with a normal directory's and files'
  permissions (mkdtemp's are 0700, safetensors' files 0600: another user of a shared model
  directory could not read it)."""
  out = os.fspath(out)
  if os.path.exists(out):
    raise ConversionError(f"{out} already exists; refusing to overwrite")
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out) + "-", dir=parent)
  try:
    # Plan the shards from the shapes first, so each is written (and freed) as soon as it fills.
    itemsize = DTYPES[dtype].itemsize
    plan: list[list[str]] = [[]]
    size = 0
    for name, shape in _expected_hf_shapes(cfg).items():
      nbytes = int(np.prod(shape)) * itemsize
      if size and size + nbytes > _SHARD_BYTES:
        plan.append([])
        size = 0
      plan[-1].append(name)
      size += nbytes
    files = ["model.safetensors"] if len(plan) == 1 else [
        f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
    weight_map = {name: files[k] for k, names in enumerate(plan) for name in names}
    pending: dict[str, dict[str, np.ndarray]] = {f: {} for f in files}
    total = 0
    for name, x in params_to_hf(cfg, params, dtype):
      file = weight_map[name]
      pending[file][name] = x
      total += x.nbytes
      if len(pending[file]) == len(plan[files.index(file)]):
        save_file(pending.pop(file), os.path.join(tmp, file), metadata={"format": "pt"})
    if len(plan) > 1:
      with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(model_config_to_hf(cfg, dtype), f, indent=2)
    for name, text in (extra_files or {}).items():
      with open(os.path.join(tmp, name), "w", encoding="utf-8", newline="") as f:
        f.write(text)  # as given: a chat template's bytes are the ones it was hashed by
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for name in os.listdir(tmp):  # safetensors writes its files 0600 whatever the umask
      os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
  """Our ModelConfig from an HF directory's config.json."""
  config_file = epath.Path(path) / "config.json"
  if not config_file.exists():
    raise ConversionError(f"{path}: no config.json")
  try:
    hf = json.loads(config_file.read_text())
  except json.JSONDecodeError as e:
    raise ConversionError(f"{config_file}: not valid JSON ({e})") from None
  return model_config_from_hf(hf, where=os.fspath(config_file))


def read_hf_dir(path: str | os.PathLike, alloc: Allocator = in_memory
                ) -> tuple[ModelConfig, Params, str]:
  """(config, float32 params, the checkpoint's stored dtype) of an HF OLMo 3 directory."""
  cfg = read_hf_config(path)
  tensors = SafetensorsDir(path)
  stored = tensors.get("model.norm.weight").dtype
  dtype = next((k for k, v in DTYPES.items() if v == stored), None)
  if dtype is None:
    raise ConversionError(f"{path}: tensors stored as {stored}; expected one of {list(DTYPES)}")
  return cfg, params_from_hf(cfg, tensors, alloc), dtype


def memmap_allocator(directory: str | os.PathLike) -> Allocator:
  """Allocates float32 arrays as files under `directory` (for models larger than RAM)."""
  count = iter(range(1 << 30))

  def alloc(shape: tuple[int, ...]) -> np.ndarray:
    file = os.path.join(os.fspath(directory), f"{next(count):04d}.npy")
    return np.lib.format.open_memmap(file, mode="w+", dtype=np.float32, shape=shape)

  return alloc
