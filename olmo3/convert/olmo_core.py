"""Our parameter tree <-> AI2's OLMo-core OLMo 3 transformer (ai2-olmo-core, the `test` extra).

OLMo-core is the code that trained OLMo 3; the parity tests and the training-step parity
benchmark run it beside our model on the same weights. Linear weights are (out, in) there and
(in, out) here; our layers are stacked on a leading axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from olmo3.config import ModelConfig

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
  on CPU, instead of flash-attn): every other setting is what AI2 trained with."""
  from olmo_core.nn.attention import AttentionBackendName
  from olmo_core.nn.transformer import TransformerConfig

  big = TransformerConfig.olmo3_7B(vocab_size=100_352)
  attn = big.block.sequence_mixer
  pattern = [cfg.sliding_window] * (cfg.global_every - 1) + [-1]
  window = dataclasses.replace(attn.sliding_window, pattern=pattern)
  attn = dataclasses.replace(attn, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                             sliding_window=window, backend=AttentionBackendName.torch)
  block = dataclasses.replace(big.block, sequence_mixer=attn, feed_forward=dataclasses.replace(
      big.block.feed_forward, hidden_size=cfg.mlp_hidden))
  return dataclasses.replace(big, d_model=cfg.d_model, n_layers=cfg.n_layers,
                             vocab_size=cfg.padded_vocab_size, block=block)


def state_dict(cfg: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
  """OLMo-core's state dict (torch tensors) holding our parameter tree's values."""
  import torch

  layers = params["layers"]

  def get(path):
    x = layers
    for key in path:
      x = x[key]
    return np.asarray(x)

  state = {"embeddings.weight": params["embed_tokens"]["embedding"],
           "lm_head.norm.weight": params["norm"]["weight"],
           "lm_head.w_out.weight": np.asarray(params["lm_head"]["kernel"]).T}
  for i in range(cfg.n_layers):
    state.update({f"blocks.{i}.{k}.weight": get(p + ("kernel",))[i].T for k, p in _LINEAR.items()})
    state.update({f"blocks.{i}.{k}.weight": get(p + ("weight",))[i] for k, p in _NORM.items()})
  return {k: torch.from_numpy(np.array(v, np.float32)) for k, v in state.items()}
