"""The model an OLMo-core checkpoint holds, read from the checkpoint's own config.

OLMo-core's trainer writes the experiment's config beside every checkpoint it saves
(`ConfigSaverCallback`: `stepN/config.json`, the config as `Config.as_config_dict()` gives it,
after the checkpoint is complete), in the same layout in 2.4.0 and 3.0.0: `model` is the
TransformerConfig, `dataset.tokenizer` the tokenizer, `train_module.max_sequence_length` the
sequence length. Every config object there names its class (`_CLASS_`) and leaves out the
fields that are None, so an absent field means what OLMo-core does with None: for a bias or a
layer norm's kind, the torch module's own default (a bias; LayerNorm, not RMSNorm).

`model_config` maps it onto olmo3's ModelConfig and refuses, in one line naming the field and
its value, what olmo3's model cannot express: another block or attention kind, biases, a norm
that is not RMSNorm, an embedding norm or tied embeddings, a head dimension that is not
d_model / n_heads, norms with different eps, a sliding-window pattern that is not "every k-th
layer and the last are full attention", RoPE scaling other than YaRN (or YaRN on another set of
layers than all or the full-attention ones), and any other setting that changes the model's
function. Settings of how it was computed or first drawn (dtypes, kernels, initialisation,
frozen parameters) are not the model's: they are read past. A field of neither kind that holds
a value other than None, false, 0 or empty (a feature switched off) is refused as unknown.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from olmo3.config import ConfigError, ModelConfig, ScaledLayers, Yarn
from olmo3.convert.hf import ConversionError
from olmo3.io import pathnames, storage
from olmo3.io.olmo_core_checkpoints import OlmoCoreCheckpoint

CONFIG = "config.json"
# The fields the checkpoint's config sets (the others are the machine's: compute dtype, kernel,
# remat, ...), which --model must agree with.
MODEL_FIELDS = ("vocab_size", "padded_vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                "mlp_hidden", "sliding_window", "global_every", "rope_theta", "rope_scaling",
                "norm_eps", "max_seq_len", "eos_token_id", "pad_token_id")
_NORMS = ("rms", "fused_rms", "cute_rms")  # RMSNorm and its kernels: one function
_ROPES = ("default", "fused")  # rotate-half RoPE and flash-attn's kernel of it
# Fields that are not the model's function: how it was computed (dtypes, kernels, precision),
# first drawn (initialisation) or trained (frozen parameters, the loss kernel).
_NOT_THE_MODEL = {"dtype", "backend", "use_flash", "full_precision", "init_method", "init_seed",
                  "init_std", "embedding_init_std", "freeze_params", "loss_implementation",
                  "mxfp8_projections", "mxfp8_qkv_projection", "mxfp8_out_projection",
                  "mxfp8_save_qkv_for_backward", "use_recompute_qkv_prep", "_CLASS_", "type",
                  # YaRN's attention factor follows from its factor (OLMo-core ignores the field)
                  "attention_rescale_factor"}
# Each config class's fields (2.4.0's and 3.0.0's) that this module reads.
_READ = {
    "model": {"d_model", "vocab_size", "n_layers", "block", "lm_head", "embedding_norm", "name",
              "block_pattern", "block_overrides", "embed_scale", "tie_word_embeddings"},
    "block": {"sequence_mixer", "attention", "layer_norm", "feed_forward", "feed_forward_moe",
              "name", "dropout", "attention_residual_alpha", "feed_forward_residual_alpha"},
    "attention": {"name", "n_heads", "n_kv_heads", "head_dim", "bias", "gate", "rope", "clip_qkv",
                  "qk_norm", "dropout", "sliding_window", "use_head_qk_norm", "scalable_softmax",
                  "qk_norm_per_head_gains", "attention_sinks"},
    "rope": {"name", "theta", "no_global_rope", "scaling", "partial_rotary_factor"},
    "yarn": {"factor", "beta_fast", "beta_slow", "old_context_len"},
    "window": {"pattern", "force_full_attention_on_first_layer",
               "force_full_attention_on_last_layer"},
    "norm": {"name", "eps", "elementwise_affine", "bias"},
    "feed_forward": {"hidden_size", "name", "bias", "activation"},
    "lm_head": {"name", "layer_norm", "bias"},
}


def read(located: OlmoCoreCheckpoint) -> ModelConfig | None:
  """The model of the checkpoint `located` names, from its config.json; None when it has none
  (a checkpoint written without OLMo-core's trainer, or cut short before its config). A config
  olmo3's model cannot express is a ConversionError naming the field."""
  where = config_file(located)
  try:
    text = storage.read_text(where)
  except FileNotFoundError:
    return None
  try:
    config = json.loads(text)
  except ValueError as e:
    raise ConversionError(f"{where}: not JSON ({e})") from None
  return model_config(config, where)


def config_file(located: OlmoCoreCheckpoint) -> str:
  """Where the checkpoint's config is: its step directory's config.json."""
  return pathnames.join(located.root, CONFIG)


def _refuse(where: str, what: str, why: str) -> ConversionError:
  """The one-line refusal: the file, the field and its value (`what`), what olmo3 has instead."""
  return ConversionError(f"{where}: {what}: {why}; olmo3's model cannot express it")


class _Config:
  """One config object of the file: its fields read by name, refusals naming its path."""

  def __init__(self, where: str, path: str, kind: str, fields: Any):
    if not isinstance(fields, dict):
      raise ConversionError(f"{where}: {path}={fields!r}: not a config object")
    self.where, self.path, self.fields = where, path, fields
    unknown = sorted(k for k, v in fields.items() if k not in _READ[kind]
                     and k not in _NOT_THE_MODEL and v not in (None, 0, [], {}))
    if unknown:
      self.refuse(unknown[0], "a setting olmo3 does not know (it reads OLMo-core 2.4.0's and "
                              "3.0.0's)")

  def get(self, key: str, default: Any = None) -> Any:
    return self.fields.get(key, default)

  def child(self, key: str, kind: str) -> _Config:
    return _Config(self.where, f"{self.path}.{key}", kind, self.fields[key])

  def refuse(self, key: str, why: str, absent: Any = None) -> None:
    """Refuses field `key` (`absent`: OLMo-core's value for it when the file leaves it out)."""
    what = (f"{self.path}.{key}={self.fields[key]!r}" if key in self.fields
            else f"{self.path}.{key} absent ({absent})")
    raise _refuse(self.where, what, why)

  def refuse_set(self, *features: tuple[str, str]) -> None:
    """Refuses the first of `features` ((key, why olmo3 lacks it)) the config turns on."""
    for key, why in features:
      if self.get(key):
        self.refuse(key, why)

  def expect(self, key: str, allowed: tuple, why: str, absent: Any = None) -> Any:
    """The field's value, refused unless in `allowed`; `absent`: what OLMo-core does without
    it."""
    value = self.fields.get(key, absent)
    if value not in allowed:
      self.refuse(key, why, absent)
    return value


def _norm_eps(norm: _Config) -> float:
  norm.expect("name", _NORMS, "olmo3's norms are RMSNorm", absent="default (LayerNorm)")
  norm.expect("bias", (False,), "olmo3's norms have no bias", absent=True)
  norm.expect("elementwise_affine", (True,), "olmo3's norms have a weight", absent=True)
  return float(norm.get("eps", 1e-5))  # RMSNorm's own default


def _window(config: _Config, layer: int, n_layers: int) -> int:
  """The keys a query sees on `layer` (-1: all), as OLMo-core's SlidingWindowAttentionConfig
  decides it."""
  if config.get("sliding_window") is None:
    return -1
  window = config.child("sliding_window", "window")
  pattern = window.get("pattern")
  if not isinstance(pattern, list) or not pattern:
    window.refuse("pattern", "not a list of window sizes", "no pattern")
  first = window.get("force_full_attention_on_first_layer", True)
  if (first and layer == 0) or (window.get("force_full_attention_on_last_layer", True)
                                and layer == n_layers - 1):
    return -1
  size = pattern[(layer - 1 if first else layer) % len(pattern)]
  if size != -1 and (not isinstance(size, int) or size <= 0):
    window.refuse("pattern", "window sizes are positive or -1 (full attention)")
  return size


def _yarn(rope: _Config) -> Yarn | None:
  if rope.get("scaling") is None:
    return None
  scaling = rope.fields["scaling"]
  kind = scaling.get("_CLASS_", "") if isinstance(scaling, dict) else ""
  if not kind.endswith(".YaRNRoPEScalingConfig"):
    raise _refuse(rope.where, f"{rope.path}.scaling={kind or scaling!r}",
                  "olmo3's RoPE scaling is YaRN")
  yarn = rope.child("scaling", "yarn")
  try:  # (defaults: YaRNRoPEScalingConfig's)
    return Yarn(factor=float(yarn.get("factor", 8.0)), beta_fast=float(yarn.get("beta_fast", 32)),
                beta_slow=float(yarn.get("beta_slow", 1)),
                original_context=int(yarn.get("old_context_len", 8192)))
  except (ConfigError, TypeError, ValueError) as e:
    raise ConversionError(f"{rope.where}: {yarn.path}: {e}") from None


def _layer(block: _Config, d_model: int, layer: int, n_layers: int
           ) -> tuple[dict[str, Any], Yarn | None, int]:
  """What one block config says of layer `layer`: (its ModelConfig fields, its RoPE scaling, its
  window (-1: full attention))."""
  block.expect("name", ("reordered_norm",), "olmo3's blocks normalise each sublayer's output "
               "(OLMo 2 and 3's reordered_norm)", absent="default (pre-norm)")
  block.refuse_set(("feed_forward_moe", "olmo3's feed-forward is dense"),
                   ("dropout", "olmo3 has no dropout"),
                   ("attention_residual_alpha", "olmo3's residuals are not scaled"),
                   ("feed_forward_residual_alpha", "olmo3's residuals are not scaled"))
  mixer_key = "sequence_mixer" if "sequence_mixer" in block.fields else "attention"  # 3.0 / 2.4
  mixer = block.get(mixer_key)
  if not isinstance(mixer, dict):
    block.refuse(mixer_key, "olmo3's layers are attention layers", "no attention")
  for key, kind in (("type", "attention"), ("_CLASS_", "olmo_core.nn.attention.AttentionConfig")):
    if mixer.get(key, kind) != kind:  # 3.0.0's registered name; the class, in both
      raise _refuse(block.where, f"{block.path}.{mixer_key}.{key}={mixer[key]!r}",
                    "olmo3's layers are attention layers")
  attn = block.child(mixer_key, "attention")
  attn.expect("name", ("default",), "olmo3's attention has separate q, k, v projections",
              absent="default")
  attn.expect("bias", (False,), "olmo3's projections have no bias", absent=True)
  attn.refuse_set(("gate", "olmo3's attention has no output gate"),
                  ("clip_qkv", "olmo3 does not clip q, k, v"),
                  ("dropout", "olmo3 has no dropout"),
                  ("use_head_qk_norm", "olmo3's QK norm is over all heads at once"),
                  ("qk_norm_per_head_gains", "olmo3's QK norm is over all heads at once"),
                  ("scalable_softmax", "olmo3's softmax is plain"),
                  ("attention_sinks", "olmo3's attention has no sinks"))
  n_heads = attn.get("n_heads", 16)  # AttentionConfig's default
  head_dim = attn.get("head_dim")
  if not isinstance(n_heads, int) or n_heads < 1 or d_model % n_heads or (
      head_dim is not None and head_dim != d_model // n_heads):
    raise _refuse(attn.where, f"{attn.path}.n_heads={n_heads!r}, head_dim={head_dim!r}",
                  f"olmo3's head dimension is d_model / n_heads (d_model={d_model})")
  if attn.get("qk_norm") is None:
    attn.refuse("qk_norm", "olmo3's attention normalises queries and keys", "no QK norm")
  if attn.get("rope") is None:
    attn.refuse("rope", "olmo3's attention has RoPE", "no RoPE")
  rope = attn.child("rope", "rope")
  rope.expect("name", _ROPES, "olmo3's RoPE rotates the two halves of a head", absent="default")
  if rope.get("no_global_rope"):
    rope.refuse("no_global_rope", "olmo3's full-attention layers have RoPE")
  rope.expect("partial_rotary_factor", (1.0,), "olmo3's RoPE rotates the whole head",
              absent=1.0)
  if block.get("layer_norm") is None:
    block.refuse("layer_norm", "olmo3's blocks normalise their sublayers' outputs", "no norms")
  if block.get("feed_forward") is None:
    block.refuse("feed_forward", "olmo3's blocks have a dense feed-forward layer",
                 "no feed-forward")
  mlp = block.child("feed_forward", "feed_forward")
  mlp.expect("name", ("default",), "olmo3's feed-forward is SwiGLU", absent="default")
  mlp.expect("bias", (False,), "olmo3's feed-forward has no bias", absent=True)
  mlp.expect("activation", ("silu",), "olmo3's feed-forward is SwiGLU", absent="silu")
  fields = {"n_heads": n_heads, "n_kv_heads": attn.get("n_kv_heads") or n_heads,
            "mlp_hidden": mlp.get("hidden_size"), "rope_theta": float(rope.get("theta", 500_000)),
            "eps": {f"block.{mixer_key}.qk_norm.eps": _norm_eps(attn.child("qk_norm", "norm")),
                    "block.layer_norm.eps": _norm_eps(block.child("layer_norm", "norm"))}}
  return fields, _yarn(rope), _window(attn, layer, n_layers)


def _windows(where: str, path: str, windows: list[int]) -> dict[str, int]:
  """sliding_window and global_every giving OLMo-core's per-layer windows (-1: full attention),
  or a refusal naming the sliding-window config at `path`."""
  sizes = sorted({w for w in windows if w != -1})
  if not sizes:
    return {"global_every": 1}  # every layer full attention (the window is never used)
  full = [w == -1 for w in windows]
  n = len(windows)
  for every in range(1, n + 1):
    if len(sizes) == 1 and full == [i % every == every - 1 or i == n - 1 for i in range(n)]:
      return {"sliding_window": sizes[0], "global_every": every}
  raise _refuse(where, f"{path}: windows per layer {windows} (-1: full attention)",
                "olmo3's sliding layers share one window and its full-attention layers are "
                "every k-th and the last")


def _scaling(where: str, yarns: list[Yarn | None], full: list[bool]) -> Yarn | None:
  """The one YaRN scaling of the layers that have one, and which layers they are."""
  scaled = [y is not None for y in yarns]
  if not any(scaled):
    return None
  kinds = {y for y in yarns if y is not None}
  if len(kinds) == 1 and scaled == full:
    return kinds.pop().replace(layers=ScaledLayers.FULL_ATTENTION)
  if len(kinds) == 1 and all(scaled):
    return kinds.pop().replace(layers=ScaledLayers.ALL)
  raise _refuse(where, f"model.block_overrides: YaRN on layers "
                f"{[i for i, s in enumerate(scaled) if s]}, {len(kinds)} kind(s)",
                "olmo3 scales RoPE one way, on every layer or on the full-attention ones")


def _tokenizer(config: dict[str, Any]) -> dict[str, Any] | None:
  """vocab_size, eos_token_id, pad_token_id of the experiment's tokenizer (its dataset's)."""
  dataset = config.get("dataset")  # 3.0.0 also allows a list of sources: no tokenizer there
  tokenizer = dataset.get("tokenizer") if isinstance(dataset, dict) else None
  if not isinstance(tokenizer, dict):
    return None
  return {"vocab_size": tokenizer.get("vocab_size"),
          "eos_token_id": tokenizer.get("eos_token_id"),
          "pad_token_id": tokenizer.get("pad_token_id")}


def _sequence_length(config: dict[str, Any]) -> int | None:
  """The longest sequence the experiment trains on: its train module's, else its dataset's."""
  for part, key in (("train_module", "max_sequence_length"), ("dataset", "sequence_length")):
    value = config.get(part)
    if isinstance(value, dict) and value.get(key) is not None:
      return value[key]
  return None


def model_config(config: dict[str, Any], where: str) -> ModelConfig:
  """olmo3's ModelConfig of an OLMo-core experiment config (config.json's content; `where`
  names it in errors). Without a tokenizer in it the vocabulary is the embedding's rows and
  there are no EOS and pad ids; the machine's fields (compute dtype, kernel, remat) keep their
  defaults."""
  if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
    raise ConversionError(f"{where}: no 'model' in it: not an OLMo-core experiment config")
  model = _Config(where, "model", "model", config["model"])
  model.expect("name", ("default",), "olmo3's transformer is OLMo-core's default one",
               absent="default")
  for key in ("d_model", "n_layers", "vocab_size"):
    if not isinstance(model.get(key), int) or model.get(key) < 1:
      raise ConversionError(f"{where}: model.{key}={model.get(key)!r}: not a size")
  model.refuse_set(("embedding_norm", "olmo3 does not normalise its embeddings"),
                   ("embed_scale", "olmo3 does not scale its embeddings"),
                   ("tie_word_embeddings", "olmo3's LM head is its own matrix"),
                   ("block_pattern", "olmo3's layers are all of one kind"))
  d_model, n_layers, block = model.get("d_model"), model.get("n_layers"), model.get("block")
  if not isinstance(block, dict) or not {"sequence_mixer", "attention"} & set(block):
    raise _refuse(where, f"model.block: {sorted(block) if isinstance(block, dict) else block!r}"
                  " (named blocks: a hybrid model)", "olmo3's layers are all of one kind")
  overrides = {int(k): v for k, v in (model.get("block_overrides") or {}).items()}
  layers = [_layer(_Config(where, f"model.block_overrides.{i}" if i in overrides
                           else "model.block", "block", overrides.get(i, block)),
                   d_model, i, n_layers) for i in range(n_layers)]
  fields = layers[0][0]
  for i, (theirs, _, _) in enumerate(layers):
    for key, value in theirs.items():
      if value != fields[key]:
        raise _refuse(where, f"model.block_overrides.{i}: {key} {value!r}, layer 0's "
                      f"{fields[key]!r}", f"olmo3's layers share one {key}")
  head = model.child("lm_head", "lm_head")
  head.expect("name", ("default",), "olmo3's LM head is a plain linear layer", absent="default")
  head.expect("bias", (False,), "olmo3's LM head has no bias", absent=True)
  if head.get("layer_norm") is None:
    head.refuse("layer_norm", "olmo3 normalises before its LM head", "no norm")
  eps = {**fields.pop("eps"), "lm_head.layer_norm.eps": _norm_eps(head.child("layer_norm",
                                                                             "norm"))}
  if len(set(eps.values())) > 1:
    raise _refuse(where, ", ".join(f"model.{k}={v!r}" for k, v in eps.items()),
                  "olmo3's norms share one eps")
  windows = [w for _, _, w in layers]
  mixer = "sequence_mixer" if "sequence_mixer" in block else "attention"
  shape = _windows(where, f"model.block.{mixer}.sliding_window", windows)
  rope_scaling = _scaling(where, [y for _, y, _ in layers], [w == -1 for w in windows])
  vocab = _tokenizer(config) or {"vocab_size": model.get("vocab_size"), "eos_token_id": None,
                                 "pad_token_id": None}
  length = _sequence_length(config)
  try:
    return ModelConfig(padded_vocab_size=model.get("vocab_size"), d_model=d_model,
                       n_layers=n_layers, **fields, **shape, norm_eps=eps["block.layer_norm.eps"],
                       rope_scaling=rope_scaling, **vocab,
                       **({} if length is None else {"max_seq_len": length}))
  except (ConfigError, TypeError) as e:
    raise ConversionError(f"{where}: {e}") from None


def _shown(value: Any) -> str:
  """A field's value as the config files spell it: a Yarn's fields, enums by their values."""
  if isinstance(value, Yarn):
    return "Yarn(" + ", ".join(f"{f.name}={_shown(getattr(value, f.name))}"
                               for f in dataclasses.fields(value)) + ")"
  return repr(value.value if isinstance(value, enum.Enum) else value)


def differences(ours: ModelConfig, theirs: ModelConfig) -> list[str]:
  """The checkpoint's fields where `ours` differs from `theirs`, as `field=ours (theirs)`."""
  return [f"{f}={_shown(getattr(ours, f))} (the checkpoint's: {_shown(getattr(theirs, f))})"
          for f in MODEL_FIELDS if getattr(ours, f) != getattr(theirs, f)]


def describe(cfg: ModelConfig, presets: dict[str, Any]) -> str:
  """The preset `cfg` is (in the checkpoint's fields), or its fields that differ from the
  ModelConfig defaults (OLMo 3 7B)."""
  for name, preset in presets.items():
    if not differences(preset(), cfg):
      return name
  default = ModelConfig()
  return "not a preset: " + ", ".join(f"{f}={_shown(getattr(cfg, f))}" for f in MODEL_FIELDS
                                      if getattr(cfg, f) != getattr(default, f))
