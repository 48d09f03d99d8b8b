"""Every rejected config raises a clear validation error naming the field, never a trace from
deep inside JAX; every accepted one builds an abstract model and computes a forward shape."""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from olmo3 import model as model_lib
from olmo3.config import ConfigError, ModelConfig

FIELDS = {
    "vocab_size": st.integers(-2, 300),
    "padded_vocab_size": st.integers(-2, 320),
    "d_model": st.integers(-2, 96),
    "n_layers": st.integers(-1, 6),
    "n_heads": st.integers(-1, 12),
    "n_kv_heads": st.integers(-1, 12),
    "mlp_hidden": st.integers(-1, 64),
    "sliding_window": st.integers(-2, 40),
    "global_every": st.integers(-1, 5),
    "norm_eps": st.sampled_from([-1e-6, 0.0, 1e-6]),
    "rope_theta": st.sampled_from([-1.0, 0.0, 10_000.0]),
    "compute_dtype": st.sampled_from(["float32", "bfloat16", "float16", "int8"]),
    "attention": st.sampled_from(["xla", "dot_product", "flash"]),
    "remat": st.sampled_from(["none", "full", "minimal", "everything"]),
    "eos_token_id": st.sampled_from([None, 0, 5, 10_000]),
    "pad_token_id": st.sampled_from([None, 1, -1]),
    "max_seq_len": st.integers(-1, 64),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=FIELDS))
def test_any_model_config_is_valid_or_names_the_field(kwargs):
  try:
    cfg = ModelConfig(**kwargs)
  except ConfigError as e:
    field = str(e).split("=", 1)[0].removeprefix("ModelConfig.")
    assert field in ModelConfig.__dataclass_fields__, str(e)
    return
  model = model_lib.abstract_model(cfg)
  tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  out = jax.eval_shape(lambda m, t: m(t), model, tokens)
  assert out.shape == (2, 8, cfg.padded_vocab_size)


from olmo3.config import (CheckpointConfig, DataConfig, EvalConfig, OptimizerConfig,  # noqa: E402
                          TrainConfig)

_BY_TYPE = {
    "int": st.integers(-3, 3000),
    "float": st.floats(-1.0, 2.0, allow_nan=False),
    "bool": st.booleans(),
    "int | None": st.one_of(st.none(), st.integers(-3, 3000)),
}


def _strategy(cls):
  fields = {f.name: _BY_TYPE[f.type] for f in cls.__dataclass_fields__.values()
            if f.type in _BY_TYPE}
  return st.fixed_dictionaries({}, optional=fields)


@pytest.mark.parametrize("cls, base", [
    (OptimizerConfig, {}), (TrainConfig, {}), (CheckpointConfig, {}), (EvalConfig, {}),
    (DataConfig, {"paths": ("a.npy",)})])
def test_other_configs_are_valid_or_name_the_field(cls, base):
  @settings(max_examples=100, deadline=None)
  @given(_strategy(cls))
  def check(kwargs):
    try:
      cls(**{**base, **kwargs})
    except ConfigError as e:
      field = str(e).split("=", 1)[0].removeprefix(f"{cls.__name__}.")
      assert field in cls.__dataclass_fields__, str(e)

  check()


def test_mesh_that_does_not_match_the_devices_is_refused_clearly():
  from olmo3 import sharding

  with pytest.raises(ValueError, match=r"needs 6 devices; 8 are available"):
    sharding.make_mesh({"data": 2, "fsdp": 3})
  with pytest.raises(ValueError, match=r"8 devices are not divisible by 3"):
    sharding.make_mesh({"data": 3, "fsdp": -1})
  with pytest.raises(ValueError, match=r"mesh axes \['model'\] unknown"):
    sharding.make_mesh({"model": 8})
  with pytest.raises(ValueError, match=r"devices come from 1 slice\(s\)"):
    sharding.make_mesh({"fsdp": 4}, dcn={"data": 2})  # one host's CPU devices are one slice
  with pytest.raises(ValueError, match=r"mesh axes \['pipeline'\] unknown"):
    sharding.make_mesh({"fsdp": -1}, dcn={"pipeline": 1})
