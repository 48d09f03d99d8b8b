"""Every rejected config raises a clear validation error naming the field, never a trace from
deep inside JAX; every accepted one builds an abstract model and computes a forward shape."""

import functools

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


import dataclasses  # noqa: E402
import math  # noqa: E402
import typing  # noqa: E402

from olmo3 import config  # noqa: E402
from olmo3.config_checks import BOUNDS  # noqa: E402
from olmo3.config import (CheckpointConfig, DataConfig, EvalConfig, OptimizerConfig,  # noqa: E402
                          RepetitionFilter, TrainConfig)

NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
# Each type's draws include what it must refuse: non-finite floats, huge numbers, bools or
# floats for ints, ints for bools.
_BY_TYPE = {
    "int": st.one_of(st.integers(-3, 3000), st.integers(), st.booleans(), st.floats(0, 10)),
    "float": st.one_of(st.floats(-1.0, 2.0, allow_nan=False), st.floats(), NON_FINITE,
                       st.integers(-1, 10**400)),
    "bool": st.one_of(st.booleans(), st.integers(0, 1)),
    "int | None": st.one_of(st.none(), st.integers(-3, 3000), st.integers(), st.booleans(),
                            NON_FINITE),
}
BASE = {DataConfig: {"paths": ("a.npy",)}}


def _strategy(cls):
  fields = {f.name: _BY_TYPE[f.type] for f in cls.__dataclass_fields__.values()
            if f.type in _BY_TYPE}
  return st.fixed_dictionaries({}, optional=fields)


@pytest.mark.parametrize("cls", [OptimizerConfig, TrainConfig, CheckpointConfig, EvalConfig,
                                 DataConfig, RepetitionFilter])
def test_other_configs_are_valid_or_name_the_field(cls):
  @settings(max_examples=100, deadline=None)
  @given(_strategy(cls))
  def check(kwargs):
    try:
      cfg = cls(**{**BASE.get(cls, {}), **kwargs})
    except ConfigError as e:
      field = str(e).split("=", 1)[0].removeprefix(f"{cls.__name__}.")
      assert field in cls.__dataclass_fields__, str(e)
      return
    for f in dataclasses.fields(cfg):  # what was accepted has its field's type and is finite
      value = getattr(cfg, f.name)
      assert value is None or type(value) is not bool or f.type == "bool", (f.name, value)
      assert not isinstance(value, float) or math.isfinite(value), (f.name, value)

  check()


def _outside(f, is_int):
  """Values outside a numeric field's declared bounds."""
  number = st.integers if is_int else functools.partial(st.floats, allow_nan=False)
  ge, gt, le, lt = (f.metadata.get(k) for k in BOUNDS)
  out = []
  if ge is not None:
    out.append(number(max_value=ge - 1) if is_int else number(max_value=ge, exclude_max=True))
  if gt is not None:
    out.append(number(max_value=gt))
  if le is not None:
    out.append(number(min_value=le + 1) if is_int else number(min_value=le, exclude_min=True))
  if lt is not None:
    out.append(number(min_value=lt))
  return out


def _invalid(cls, f):
  """Values `cls.f` must refuse whatever the other fields hold: non-finite numbers, wrong
  types, values outside its bounds."""
  arms = set(typing.get_args(typing.get_type_hints(cls)[f.name])) or {
      typing.get_type_hints(cls)[f.name]}
  out = []
  if int in arms:
    out += [st.floats(allow_nan=True), st.booleans(), st.text(max_size=2), *_outside(f, True)]
  if float in arms:
    out += [NON_FINITE, st.integers(min_value=2**1024), st.booleans(), st.text(max_size=2),
            *_outside(f, False)]
  if bool in arms:
    out += [st.integers(), st.floats(), st.text(max_size=2)]
  return st.one_of(out) if out else None


INVALID = {(cls, f.name): _invalid(cls, f) for cls in (
    config.ModelConfig, RepetitionFilter, DataConfig, OptimizerConfig, config.MeshConfig,
    TrainConfig, CheckpointConfig, EvalConfig) for f in dataclasses.fields(cls)}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted((k for k, v in INVALID.items() if v is not None),
                              key=lambda k: (k[0].__name__, k[1]))).flatmap(
    lambda key: st.tuples(st.just(key), INVALID[key])))
def test_a_non_finite_mistyped_or_out_of_range_number_is_always_refused(drawn):
  """Never accepted, never another exception: a ConfigError naming the field."""
  (cls, name), value = drawn
  try:
    cls(**{**BASE.get(cls, {}), name: value})
  except ConfigError as e:
    assert str(e).startswith(f"{cls.__name__}.{name}="), str(e)
  else:
    raise AssertionError(f"{cls.__name__}.{name}={value!r} accepted")


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
