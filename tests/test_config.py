import dataclasses

import pytest

from olmo3 import config
from olmo3 import model as model_lib
from olmo3.config import ConfigError, ModelConfig


def test_7b_parameter_count_computed_abstractly():
  cfg = config.olmo3_7b()
  assert cfg.param_count == 7_298_617_344
  assert cfg.block_param_count == 202_391_552
  # The same number from the NNX model's abstract parameters (nothing allocated).
  assert model_lib.param_count(model_lib.abstract_model(cfg)) == 7_298_617_344


@pytest.mark.parametrize("preset", sorted(config.PRESETS))
def test_presets_count_matches_model(preset):
  cfg = config.PRESETS[preset]()
  assert model_lib.param_count(model_lib.abstract_model(cfg)) == cfg.param_count


def test_7b_flops_per_token():
  cfg = config.olmo3_7b()
  assert 6 * cfg.matmul_param_count / 1e9 == pytest.approx(41.3223, abs=1e-4)
  assert cfg.flops_per_token(8192) / 1e9 == pytest.approx(46.557, abs=1e-3)
  # Sliding layers attend to (W(W+1)/2 + (T-W)W)/T keys on average (docs/flops.md#our-count).
  assert cfg.mean_keys_per_query(0, 8192) == 3072.25
  assert cfg.mean_keys_per_query(3, 8192) == 4096.5
  # A sequence shorter than the window: every layer is plain causal.
  assert cfg.mean_keys_per_query(0, 100) == cfg.mean_keys_per_query(3, 100) == 50.5


def test_7b_layer_pattern_and_32b_preset():
  cfg = config.olmo3_7b()
  assert [i for i in range(32) if cfg.is_global(i)] == [3, 7, 11, 15, 19, 23, 27, 31]
  big = config.olmo3_32b()
  assert (big.d_model, big.n_layers, big.n_heads, big.n_kv_heads, big.mlp_hidden,
          big.head_dim) == (5120, 64, 40, 8, 27648, 128)


def test_last_layer_is_always_global():
  cfg = ModelConfig(n_layers=6)
  assert cfg.layer_is_global == (False, False, False, True, False, True)


@pytest.mark.parametrize("change, field", [
    ({"d_model": 100, "n_heads": 3}, "d_model"),
    ({"n_kv_heads": 5}, "n_kv_heads"),
    ({"n_kv_heads": 64}, "n_kv_heads"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"padded_vocab_size": 100_000}, "padded_vocab_size"),
    ({"n_layers": 0}, "n_layers"),
    ({"d_model": 4096, "n_heads": 4096}, "n_heads"),  # head_dim 1 is odd: no RoPE pairs
    ({"norm_eps": 0.0}, "norm_eps"),
    ({"compute_dtype": "float64"}, "compute_dtype"),
    ({"attention": "flash"}, "attention"),
    ({"eos_token_id": 100_300}, "eos_token_id"),
    ({"mlp_hidden": 1.5}, "mlp_hidden"),
])
def test_invalid_configs_name_the_field(change, field):
  with pytest.raises(ConfigError, match=rf"ModelConfig\.{field}="):
    ModelConfig(**change)


def test_enums_accept_strings_and_config_is_frozen():
  cfg = ModelConfig(compute_dtype="float32", attention="splash")
  assert cfg.compute_dtype is config.DType.FLOAT32
  assert cfg.attention is config.AttentionKernel.SPLASH
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.d_model = 8  # type: ignore[misc]
  assert ModelConfig(**dataclasses.asdict(cfg)) == cfg  # JSON-friendly round trip
