"""Our parameter tree <-> AI2's OLMo-core OLMo 3 transformer (ai2-olmo-core, the `test` extra).

OLMo-core is the code that trained OLMo 3; the parity tests and the training-step parity
benchmark run it beside our model on the same weights. Linear weights are (out, in) there and
(in, out) here; our layers are stacked on a leading axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from olmo3.config import ModelConfig, ScaledLayers

# OLMo-core name inside a block -> our path inside the stacked layers.
_LINEAR = {"attention.w_q": ("self_attn", "q_proj"), "attention.w_k": ("self_attn", "k_proj"),
           "attention.w_v": ("self_attn", "v_proj"), "attention.w_out": ("self_attn", "o_proj"),
           "feed_forward.w1": ("mlp", "gate_proj"), "feed_forward.w3": ("mlp", "up_proj"),
           "feed_forward.w2": ("mlp", "down_proj")}
_NORM = {"attention.q_norm": ("self_attn", "q_norm"), "attention.k_norm": ("self_attn", "k_norm"),
         "attention_norm": ("post_attention_layernorm",),
         "feed_forward_norm": ("post_feedforward_layernorm",)}


def transformer_config(cfg: ModelConfig):
  """OLMo-core's own `olmo3_7B` preset with only the sizes changed (and torch SDPA, which runs
  on CPU, instead of flash-attn): every other setting is what AI2 trained with. A YaRN
  `rope_scaling` goes through OLMo-core's `with_rope_scaling`, as AI2's stage-3 script applies
  it (`full_attn_layers_only` unless the scaling says every layer)."""
  from olmo_core.nn.attention import AttentionBackendName
  from olmo_core.nn.rope import YaRNRoPEScalingConfig
  from olmo_core.nn.transformer import TransformerConfig

  big = TransformerConfig.olmo3_7B(vocab_size=100_352)
  field = attention_field(big.block)
  attn = getattr(big.block, field)
  pattern = [cfg.sliding_window] * (cfg.global_every - 1) + [-1]
  window = dataclasses.replace(attn.sliding_window, pattern=pattern)
  attn = dataclasses.replace(attn, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                             sliding_window=window, backend=AttentionBackendName.torch)
  block = dataclasses.replace(big.block, **{field: attn}, feed_forward=dataclasses.replace(
      big.block.feed_forward, hidden_size=cfg.mlp_hidden))
  sized = dataclasses.replace(big, d_model=cfg.d_model, n_layers=cfg.n_layers,
                              vocab_size=cfg.padded_vocab_size, block=block)
  yarn = cfg.rope_scaling
  if yarn is None:
    return sized
  return sized.with_rope_scaling(
      YaRNRoPEScalingConfig(factor=yarn.factor, beta_fast=yarn.beta_fast,
                            beta_slow=yarn.beta_slow, old_context_len=yarn.original_context),
      full_attn_layers_only=yarn.layers == ScaledLayers.FULL_ATTENTION)


def attention_field(block: Any) -> str:
  """The attention config's field in OLMo-core's block config: `sequence_mixer` in 3.0.0 (its
  `attention` is a deprecated init-only alias), `attention` in 2.4.0, the version AI2 ran stage
  3 with (benchmarks/stage3_parity_olmo_core.py runs under both)."""
  return "sequence_mixer" if hasattr(block, "sequence_mixer") else "attention"


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one of our parameters is in OLMo-core's model: one tensor, or one per layer for
  the stacked layers (in layer order); linear weights are transposed."""

  path: tuple[str, ...]  # ours, e.g. ("layers", "mlp", "gate_proj", "kernel")
  names: tuple[str, ...]  # OLMo-core's state-dict names, e.g. blocks.0.feed_forward.w1.weight
  transposed: bool

  @property
  def stacked(self) -> bool:
    return self.path[0] == "layers"


def sources(cfg: ModelConfig) -> list[Source]:
  """Every parameter of ours and where OLMo-core keeps it."""
  out = [Source(("embed_tokens", "embedding"), ("embeddings.weight",), False),
         Source(("norm", "weight"), ("lm_head.norm.weight",), False),
         Source(("lm_head", "kernel"), ("lm_head.w_out.weight",), True)]
  for table, leaf, transposed in ((_LINEAR, "kernel", True), (_NORM, "weight", False)):
    out += [Source(("layers", *path, leaf),
                   tuple(f"blocks.{i}.{name}.weight" for i in range(cfg.n_layers)), transposed)
            for name, path in table.items()]
  return out


def leaf(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def state_dict(cfg: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
  """OLMo-core's state dict (torch tensors) holding our parameter tree's values."""
  import torch

  state = {}
  for source in sources(cfg):
    value = np.asarray(leaf(params, source.path))
    for name, part in zip(source.names, value if source.stacked else [value]):
      state[name] = part.T if source.transposed else part
  return {k: torch.from_numpy(np.array(v, np.float32)) for k, v in state.items()}
