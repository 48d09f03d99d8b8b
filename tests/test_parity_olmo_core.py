"""Parity with AI2's own training code (ai2-olmo-core's OLMo 3 transformer), a second reference
independent of the Hugging Face port: the model must agree with what actually trained OLMo 3."""

import dataclasses

import numpy as np
import pytest
import torch
from olmo_core.nn.attention import AttentionBackendName
from olmo_core.nn.transformer import TransformerConfig

from olmo3 import config
from olmo3.convert import parity

from conftest import random_params

MICRO = config.olmo3_micro()
# OLMo-core name -> our path inside the stacked layers.
_LINEAR = {"attention.w_q": ("self_attn", "q_proj"), "attention.w_k": ("self_attn", "k_proj"),
           "attention.w_v": ("self_attn", "v_proj"), "attention.w_out": ("self_attn", "o_proj"),
           "feed_forward.w1": ("mlp", "gate_proj"), "feed_forward.w3": ("mlp", "up_proj"),
           "feed_forward.w2": ("mlp", "down_proj")}
_NORM = {"attention.q_norm": ("self_attn", "q_norm"), "attention.k_norm": ("self_attn", "k_norm"),
         "attention_norm": ("post_attention_layernorm",),
         "feed_forward_norm": ("post_feedforward_layernorm",)}


def _olmo_core_7b_shrunk(cfg: config.ModelConfig) -> TransformerConfig:
  """OLMo-core's own `olmo3_7B` preset with only the sizes changed (and torch SDPA, which runs
  on CPU, instead of flash-attn): every other setting is what AI2 trained with."""
  big = TransformerConfig.olmo3_7B(vocab_size=100_352)
  attn = big.block.sequence_mixer
  window = dataclasses.replace(attn.sliding_window, pattern=[cfg.sliding_window] * 3 + [-1])
  attn = dataclasses.replace(attn, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                             sliding_window=window, backend=AttentionBackendName.torch)
  block = dataclasses.replace(big.block, sequence_mixer=attn, feed_forward=dataclasses.replace(
      big.block.feed_forward, hidden_size=cfg.mlp_hidden))
  return dataclasses.replace(big, d_model=cfg.d_model, n_layers=cfg.n_layers,
                             vocab_size=cfg.padded_vocab_size, block=block)


def _olmo_core_state(cfg: config.ModelConfig, params: dict) -> dict[str, torch.Tensor]:
  layers = params["layers"]

  def get(path):
    x = layers
    for key in path:
      x = x[key]
    return x

  state = {"embeddings.weight": params["embed_tokens"]["embedding"],
           "lm_head.norm.weight": params["norm"]["weight"],
           "lm_head.w_out.weight": params["lm_head"]["kernel"].T}
  for i in range(cfg.n_layers):
    state.update({f"blocks.{i}.{k}.weight": get(p + ("kernel",))[i].T for k, p in _LINEAR.items()})
    state.update({f"blocks.{i}.{k}.weight": get(p + ("weight",))[i] for k, p in _NORM.items()})
  return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}


def test_7b_preset_matches_olmo_core():
  big = TransformerConfig.olmo3_7B(vocab_size=100_352)
  ours = config.olmo3_7b()
  assert big.num_params == ours.param_count == 7_298_617_344
  assert big.block.sequence_mixer.sliding_window.pattern == [4096, 4096, 4096, -1]
  assert [big.block.sequence_mixer.sliding_window._get_window_size(i, 32) == -1
          for i in range(32)] == list(ours.layer_is_global)


@pytest.mark.parametrize("cfg", [MICRO, MICRO.replace(n_layers=8, n_heads=4, n_kv_heads=4)],
                         ids=["gqa_6_layers", "mha_8_layers"])
def test_float32_parity_with_olmo_core(cfg):
  params = random_params(cfg, seed=3)
  reference = _olmo_core_7b_shrunk(cfg).build(init_device="cpu")
  reference.load_state_dict(_olmo_core_state(cfg, params))
  reference.eval()
  tokens = parity.random_tokens(cfg, 2, parity.default_seq_len(cfg))
  with torch.no_grad():
    ref_logits = reference(torch.from_numpy(tokens.astype(np.int64))).float().numpy()
  ours, _ = parity.our_forward(cfg, params, tokens)
  # OLMo-core, like us, computes logits over the padded vocabulary: compare all of them.
  assert ref_logits.shape == ours.shape == (2, tokens.shape[1], cfg.padded_vocab_size)
  metrics = parity.compare_logits(ref_logits, ours)
  assert metrics["ref_logit_std"] > 2.0
  assert metrics["max_kl"] <= 1e-6 and metrics["top1_agreement"] == 1.0, metrics
