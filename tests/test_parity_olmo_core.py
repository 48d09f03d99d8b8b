"""Parity with AI2's own training code (ai2-olmo-core's OLMo 3 transformer), a second reference
independent of the Hugging Face port: the model must agree with what actually trained OLMo 3."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from olmo_core.nn.transformer import TransformerConfig

from olmo3 import config
from olmo3.convert import olmo_core_params, parity

from conftest import benchmark_result, random_params
from harness import train_parity_olmo_core

MICRO = config.olmo3_micro()


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
  reference = olmo_core_params.transformer_config(cfg).build(init_device="cpu")
  reference.load_state_dict(olmo_core_params.state_dict(cfg, params))
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


@pytest.mark.seconds(20)
def test_training_steps_match_olmo_cores_train_module():
  """The benchmark's run shortened to 28 steps, with a 16-step skip window so that the rule
  acts from step 8 and the odd batch at step 26 trips it: the same weights and batches through
  our train step and through OLMo-core's TransformerTrainModule (its model, loss, 2
  micro-batches, clipping, SkipStepAdamW and schedulers), in float32."""
  result = train_parity_olmo_core.main(
      ["--steps", "28", "--spike_window", "16", "--spike_step", "26"])
  assert result["steps"] == 28 and result["skip_decisions_equal"]
  assert result["skipped_steps"] == [26]  # the odd batch trips the rule on both sides
  assert result["max_abs_loss_diff"] < 1e-5
  assert result["max_rel_grad_norm_diff"] < 1e-4
  assert result["max_abs_lr_diff"] < 1e-9  # float32 rounding of LRs near 1e-3
  assert result["within"]


@pytest.mark.seconds(15)
def test_float64_training_steps_match_olmo_cores_train_module_to_1e9():
  """The same in float64 (JAX x64, OLMo-core's model and optimizer state in float64), 12 steps
  with the odd batch at 10: the losses agree to 1e-9 only if every float32 rounding OLMo-core
  makes in its update (its step factor's products) is made alike, and the clipping is torch's."""
  result = train_parity_olmo_core.main(
      ["--dtype", "float64", "--steps", "12", "--spike_window", "16", "--spike_step", "10"])
  assert result["skipped_steps"] == [10] and result["skip_decisions_equal"]
  assert result["max_abs_loss_diff"] < 1e-9 and result["max_rel_grad_norm_diff"] < 1e-8
  assert result["within"]


# Stage 3's model shrunk: YaRN over an original context of 64 tokens, run at 4x that, with a
# head dimension (32) whose frequencies span the ramp (dimensions 0..3 blend, the rest are
# divided by the factor).
YARN = MICRO.replace(d_model=128, n_heads=4, n_kv_heads=2, n_layers=8, sliding_window=24,
                     rope_scaling=config.Yarn(factor=8.0, original_context=64))


def _olmo_core_logits(reference_cfg, params, tokens):
  reference = olmo_core_params.transformer_config(reference_cfg).build(init_device="cpu")
  reference.load_state_dict(olmo_core_params.state_dict(reference_cfg, params))
  reference.eval()
  with torch.no_grad():
    return reference(torch.from_numpy(tokens.astype(np.int64))).float().numpy()


def test_yarn_on_full_attention_layers_matches_olmo_cores_stage3_model():
  """OLMo-core's OLMo 3 with `with_rope_scaling(YaRNRoPEScalingConfig(...))` (full-attention
  layers only, as AI2's stage 3) against ours at 4x the original context: equal logits. YaRN on
  every layer, or none, is visibly another model (the mutations this test must catch)."""
  params = random_params(YARN, seed=5)
  tokens = parity.random_tokens(YARN, 2, 4 * YARN.rope_scaling.original_context)
  ref_logits = _olmo_core_logits(YARN, params, tokens)
  ours, _ = parity.our_forward(YARN, params, tokens)
  metrics = parity.compare_logits(ref_logits, ours)
  assert metrics["ref_logit_std"] > 2.0
  assert metrics["max_kl"] <= 1e-6 and metrics["top1_agreement"] == 1.0, metrics
  every_layer = YARN.replace(rope_scaling=YARN.rope_scaling.replace(
      layers=config.ScaledLayers.ALL))
  for wrong in (every_layer, YARN.replace(rope_scaling=None)):
    theirs, _ = parity.our_forward(wrong, params, tokens)
    assert parity.compare_logits(ref_logits, theirs)["max_kl"] > 1e-3, wrong.rope_scaling


def test_yarn_on_every_layer_matches_olmo_core_with_every_layer_scaled():
  """The comparison option (`ScaledLayers.ALL`) is OLMo-core's `full_attn_layers_only=False`."""
  cfg = YARN.replace(rope_scaling=YARN.rope_scaling.replace(layers=config.ScaledLayers.ALL))
  params = random_params(cfg, seed=6)
  tokens = parity.random_tokens(cfg, 1, 4 * cfg.rope_scaling.original_context)
  metrics = parity.compare_logits(_olmo_core_logits(cfg, params, tokens),
                                  parity.our_forward(cfg, params, tokens)[0])
  assert metrics["max_kl"] <= 1e-6 and metrics["top1_agreement"] == 1.0, metrics


@pytest.mark.parametrize("positions", list(config.RopePositions))
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "yarn"])
def test_rope_positions_of_packed_documents_are_olmo_cores(positions, scaled):
  """Each token's rotation in a packed row, against OLMo-core's RotaryEmbedding: without
  document lengths (2.4.0, which never passes them to RoPE: AI2's stage 3) for
  `RopePositions.INSTANCE`, with `cu_doc_lens` (3.0.0's intra-document RoPE) for `DOCUMENT`.
  Rotations are absolute, so the other choice is far off (the mutation this test catches),
  though attention scores, which depend on position differences, hardly move."""
  from olmo_core.nn.rope import RotaryEmbedding, YaRNRoPEScalingConfig

  from olmo3 import attention as attention_lib

  cfg = YARN.replace(rope_positions=positions)
  yarn = cfg.rope_scaling if scaled else None
  lengths = [70, 130, 56]  # documents of a 256-token row (the last runs to the end)
  segments = np.repeat(np.arange(1, len(lengths) + 1), lengths)[None].astype(np.int32)
  ropes = attention_lib.layer_ropes(cfg, segments.shape[1], jnp.asarray(segments))
  x = np.random.default_rng(0).standard_normal((1, segments.shape[1], 2, cfg.head_dim))
  ours = np.asarray(attention_lib.apply_rope(jnp.asarray(x, jnp.float32), *ropes[scaled]))
  reference = RotaryEmbedding(head_size=cfg.head_dim, theta=int(cfg.rope_theta),
                              scaling=None if yarn is None else YaRNRoPEScalingConfig(
                                  factor=yarn.factor, beta_fast=yarn.beta_fast,
                                  beta_slow=yarn.beta_slow, old_context_len=yarn.original_context))
  q = torch.from_numpy(x).float()
  cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
  per_document, _ = reference(q, q, head_first=False, cu_doc_lens=cu)
  per_instance, _ = reference(q, q, head_first=False)
  right, wrong = ((per_document, per_instance) if positions == config.RopePositions.DOCUMENT
                  else (per_instance, per_document))
  np.testing.assert_allclose(ours, right.numpy(), atol=2e-5)
  assert np.abs(ours - wrong.numpy()).max() > 0.5


@pytest.mark.slow(seconds=20)
def test_restart_with_an_empty_window_is_olmo_cores_restart(tmp_path):
  """OLMo-core's Trainer and our loop, each restarted from its own checkpoint at step 5 of 10.
  SkipStepAdamW's window is in no checkpoint: restarted, it skips nothing until 8 values have
  been seen again, so the odd batch at step 9 is trained on, where the run that never stopped
  skips it. spike_window_on_restart=empty is the first (CE losses, skip decisions, final
  parameters), keep the second. Run as its benchmark command (benchmarks/restart_olmo_core.py),
  shortened: two trainers side by side are the slow tier's, not the edit loop's."""
  result = benchmark_result("restart_olmo_core", ["--restart_at", "5", "--steps", "10",
                                                 "--spike_at", "9", "--workdir", str(tmp_path)])
  assert result["skipped_steps"] == {"olmo3 keep": [9], "olmo3 empty": [],
                                     "OLMo-core uninterrupted": [9], "OLMo-core restarted": []}
  for mode in ("keep", "empty"):
    assert result[mode]["skip_decisions_equal"] and result[mode]["max_abs_loss_diff"] < 1e-5
    assert result[mode]["max_abs_param_diff"] < 1e-5, mode
  assert result["restart_moves_params_by"] > 1e-4  # far beyond the parameters' tolerance
  assert result["ok"]
