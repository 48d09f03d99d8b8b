"""Logit and per-layer parity with transformers' Olmo3ForCausalLM on CPU (float32: rounding error
only), and proof that the check catches the bugs it exists for."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from olmo3 import config
from olmo3 import attention as attention_lib
from olmo3 import model as model_lib
from olmo3.convert import hf, parity
from olmo3.convert.__main__ import main as convert_main

from conftest import write_random_hf_dir
from hf_reference import save_transformers_model

MICRO = config.olmo3_micro()
SHAPES = {
    # 4 layers of plain MHA; 4.5 windows of tokens.
    "mha_4_layers": MICRO.replace(n_layers=4, n_heads=4, n_kv_heads=4),
    # 6 layers (not a multiple of 4: a tail of 2 layers after one scanned group), GQA 8 / 2.
    "gqa_6_layers": MICRO,
    # 5 layers, multi-query attention, window 8, 128-row vocabulary padding.
    "mqa_5_layers": MICRO.replace(n_layers=5, n_heads=4, n_kv_heads=1, sliding_window=8,
                                  vocab_size=390, padded_vocab_size=512),
    # Unrolled layers, wider heads (head_dim 32).
    "unscanned": MICRO.replace(n_layers=7, n_heads=2, n_kv_heads=2, scan_layers=False),
}


def _check(tmp_path, cfg, seq_len=None, dtype="float32", seed=0):
  path = tmp_path / "hf"
  if not path.exists():
    write_random_hf_dir(path, cfg, seed=seed)
  imported, params, _ = hf.read_hf_dir(path)
  imported = imported.replace(scan_layers=cfg.scan_layers, attention=cfg.attention)
  return parity.check(imported, params, path, dtype=dtype, batch=2, seq_len=seq_len)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_float32_parity(tmp_path, name):
  cfg = SHAPES[name]
  report = _check(tmp_path, cfg)
  assert report.seq_len > 3 * cfg.sliding_window  # crosses the window several times
  assert report.ref_logit_std > 2.0  # logits spread over several nats: predictions are decisive
  assert report.max_kl <= 1e-6, report.format()
  assert report.top1_agreement == 1.0, report.format()
  assert len(report.layer_rel_diff) == cfg.n_layers
  assert max(report.layer_rel_diff) < 1e-4, report.format()


def test_parity_of_a_model_transformers_built_and_saved(tmp_path):
  save_transformers_model(tmp_path / "hf", MICRO, dtype=torch.float32, std=0.3)
  cfg, params, _ = hf.read_hf_dir(tmp_path / "hf")
  report = parity.check(cfg, params, tmp_path / "hf", batch=1, seq_len=70)
  assert report.ref_logit_std > 2.0
  assert report.max_kl <= 1e-6 and report.top1_agreement == 1.0, report.format()


@pytest.mark.seconds(5)
def test_bfloat16_parity_is_measured(tmp_path, capsys):
  report = _check(tmp_path, MICRO, dtype="bfloat16")
  with capsys.disabled():
    print(f"\n[bfloat16 compute vs float32 reference] {report.format()}")
  # bf16 keeps 8 bits of mantissa; the KL is small but far from float32's rounding error.
  assert 1e-7 < report.max_kl < 5e-2, report.format()
  assert report.top1_agreement > 0.9


@pytest.mark.seconds(6)
def test_cli_exits_nonzero_past_the_threshold(tmp_path, capsys):
  write_random_hf_dir(tmp_path / "hf", MICRO)
  assert convert_main(["import-hf", "--hf_dir", str(tmp_path / "hf"),
                       "--out", str(tmp_path / "ckpt")]) == 0
  args = ["parity", "--hf_dir", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "ckpt")]
  assert convert_main(args + ["--json"]) == 0
  out = capsys.readouterr().out
  assert "PASS" in out and "top-1 agreement" in out and "max |Δlogit|" in out
  assert convert_main(args + ["--max_kl", "1e-30", "--seq_len", "40"]) == 1
  assert "FAIL" in capsys.readouterr().out


# --- the check must catch the bugs it exists for ---------------------------------------------


def _window_off_by_one(seq_len, window, positions=None):
  q = jnp.arange(seq_len)[:, None] if positions is None else jnp.asarray(positions)[:, None]
  s = jnp.arange(seq_len)[None, :]
  mask = s <= q
  return mask & (s > q - window - 1) if window is not None else mask


def _rope_interleaved(x_BTNK, cos_TK, sin_TK):
  """GPT-J convention (pairs 2i, 2i+1) instead of NeoX rotate-half (pairs i, i + K/2)."""
  x = x_BTNK.astype(jnp.float32)
  half = x.shape[-1] // 2
  cos, sin = cos_TK[None, :, None, :half], sin_TK[None, :, None, :half]
  even, odd = x[..., 0::2], x[..., 1::2]
  out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
  return out.reshape(x.shape).astype(x_BTNK.dtype)


def _norm_before_sublayer(self, x, rope, window, segments=None, order=None):
  h = x + self.self_attn(self.post_attention_layernorm(x), rope, window, segments, order)
  return h + self.mlp(self.post_feedforward_layernorm(h))


@pytest.mark.parametrize("target, attr, bug", [
    (attention_lib, "attention_mask", _window_off_by_one),
    (attention_lib, "apply_rope", _rope_interleaved),
    (model_lib.Block, "__call__", _norm_before_sublayer),
], ids=["window_off_by_one", "rope_interleaved", "norm_before_sublayer"])
def test_parity_catches_bugs(tmp_path, monkeypatch, target, attr, bug):
  monkeypatch.setattr(target, attr, bug)
  report = _check(tmp_path, MICRO)
  assert report.max_kl > 1e-3, report.format()
  assert report.top1_agreement < 1.0, report.format()


# Stage 3's shape shrunk: YaRN over an original context of 64 tokens, run at 4x that.
YARN = MICRO.replace(d_model=128, n_heads=4, n_kv_heads=2, n_layers=8, sliding_window=24,
                     max_seq_len=256, rope_scaling=config.Yarn(factor=8.0, original_context=64))


@pytest.mark.seconds(5)
def test_yarn_export_round_trips_and_says_what_transformers_5_3_runs(tmp_path, capsys):
  """An export of a YaRN model reads back as the same model (full-attention layers scaled);
  transformers 5.3 runs it with YaRN on every layer, which is ours with ScaledLayers.ALL to
  float32 rounding and another model than the one trained: the measured gap is the warning's."""
  write_random_hf_dir(tmp_path / "hf", YARN, seed=4)
  imported, params, _ = hf.read_hf_dir(tmp_path / "hf")
  assert imported.rope_scaling == YARN.rope_scaling
  assert "transformers 5.0-5.3 apply YaRN to every layer" in hf.hf_runs_differently(YARN)
  every_layer = YARN.replace(rope_scaling=YARN.rope_scaling.replace(
      layers=config.ScaledLayers.ALL))
  assert "transformers 4.57 applies YaRN to the full-attention layers only" in (
      hf.hf_runs_differently(every_layer))
  assert hf.hf_runs_differently(YARN.replace(rope_scaling=None)) is None
  tokens = parity.random_tokens(YARN, 1, 4 * YARN.rope_scaling.original_context)
  ref = parity.reference_forward(tmp_path / "hf", tokens)
  as_hf_runs = parity.compare_logits(ref.logits, parity.our_forward(every_layer, params,
                                                                    tokens)[0])
  as_trained = parity.compare_logits(ref.logits, parity.our_forward(YARN, params, tokens)[0])
  print(f"transformers 5.3 vs YaRN on full-attention layers only: max KL "
        f"{as_trained['max_kl']:.3e}, top-1 {as_trained['top1_agreement']:.4f}")
  assert as_hf_runs["max_kl"] <= 1e-6 and as_hf_runs["top1_agreement"] == 1.0, as_hf_runs
  assert as_trained["max_kl"] > 1e-3
  # Its RoPE per layer says the same, without the logits: ours with YaRN on every layer.
  assert parity.rope_differences(every_layer, ref.ropes, ref.version) == ()
  assert len(parity.rope_differences(YARN, ref.ropes, ref.version)) == 1


def test_a_flat_yarn_config_is_read_as_olmo_3_was_trained():
  """AI2's released config (transformers' flat layout, one yarn entry) is YaRN on the
  full-attention layers, as OLMo-core trained it; per-type entries say which layers."""
  flat = hf.model_config_to_hf(YARN)
  yarn_entry = flat["rope_parameters"]["full_attention"]
  flat["rope_parameters"] = yarn_entry
  assert hf.model_config_from_hf(flat).rope_scaling == YARN.rope_scaling
  both = hf.model_config_to_hf(YARN)
  both["rope_parameters"]["sliding_attention"] = dict(yarn_entry)
  assert hf.model_config_from_hf(both).rope_scaling.layers == config.ScaledLayers.ALL
  odd = hf.model_config_to_hf(YARN)
  odd["rope_parameters"]["full_attention"]["rope_type"] = "longrope"
  with pytest.raises(hf.ConversionError, match="longrope"):
    hf.model_config_from_hf(odd)


def test_the_export_spells_rope_for_transformers_4_57_as_ai2_released_configs_do():
  """`rope_theta` and a flat yarn `rope_scaling` without theta (4.57 reads only these, and warns
  about keys a yarn entry does not have), as AI2's released OLMo 3 7B config; a config whose two
  spellings disagree is refused: transformers versions would run different models from it."""
  written = hf.model_config_to_hf(YARN)
  assert written["rope_theta"] == YARN.rope_theta
  assert written["rope_scaling"] == {
      "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
      "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": YARN.rope_scaling.attention_factor}
  assert hf.model_config_to_hf(MICRO)["rope_scaling"] is None
  released = {k: v for k, v in written.items() if k != "rope_parameters"}
  released["rope_scaling"] = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32,
                              "beta_slow": 1, "original_max_position_embeddings": 64,
                              "attention_factor": 1.2079441541679836}
  assert hf.model_config_from_hf(released) == hf.model_config_from_hf(written)
  for key, value in (("rope_theta", 10_000.0), ("rope_scaling", None)):
    disagree = {**written, key: value}
    with pytest.raises(hf.ConversionError, match="disagree: transformers 4.57 reads the first"):
      hf.model_config_from_hf(disagree)


def test_rope_differences_name_what_transformers_runs():
  """Tables as transformers 4.57.1 built them from a config.json without `rope_theta`: theta
  10,000 everywhere and no YaRN, named per layer type; ours: no line."""
  n = 40

  def tables(theta, scaling):
    cos, sin = attention_lib.rope_tables(n, YARN.head_dim, theta, jnp.float32, scaling)
    return np.stack([np.asarray(cos), np.asarray(sin)])

  ours = [tables(YARN.rope_theta, YARN.rope_scaling if YARN.layer_rope_scaled(i) else None)
          for i in range(YARN.n_layers)]
  assert parity.rope_differences(YARN, ours, "4.57.1") == ()
  misread = [tables(10_000.0, None)] * YARN.n_layers
  assert parity.rope_differences(YARN, misread, "4.57.1") == (
      "sliding-window layers [0, 1, 2, 4, 5, 6]: transformers 4.57.1 runs plain RoPE, theta "
      "10,000; ours plain RoPE, theta 500,000",
      "full-attention layers [3, 7]: transformers 4.57.1 runs plain RoPE, theta 10,000; ours "
      "YaRN (factor 8, original context 64), theta 500,000")
  other = [tables(123.0, None)] + ours[1:]
  assert parity.rope_differences(YARN, other, "x")[0].startswith(
      "sliding-window layers [0]: transformers x runs none of plain RoPE, theta 500,000; ")
