import ast
import dataclasses
import enum
import importlib
import inspect
import json
import math
import pathlib
import re
import types
import typing

import numpy as np
import pytest

from olmo3 import config
from olmo3 import model as model_lib
from olmo3.config import ConfigError, ModelConfig
from olmo3.config_checks import BOUNDS, Validated


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
    ({"compute_dtype": "float16"}, "compute_dtype"),
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


def _defined_in_config_modules() -> dict[str, str]:
  """{class name: module} of every class olmo3/config/*.py defines, read from the source (after
  the import, every re-homed class says olmo3.config, wherever it is defined)."""
  found = {}
  for path in sorted(pathlib.Path(config.__file__).parent.glob("*.py")):
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, ast.ClassDef):
        found[node.name] = f"olmo3.config.{path.stem}"
  return found


def test_every_config_class_and_enum_is_olmo3_config_name():
  """A run's config.json, a pickle and Fiddle's serialization name each class and enum
  olmo3.config.<Name> (the only names launch/config_files admits): every Validated class and
  enum that olmo3/config/*.py defines is that attribute, says that module, and is exported."""
  recorded = {name: getattr(importlib.import_module(module), name)
              for name, module in _defined_in_config_modules().items()}
  recorded = {name: cls for name, cls in recorded.items()
              if issubclass(cls, (Validated, enum.Enum))}
  assert {"Experiment", "DataConfig", "Yarn", "InitMode", "LongDocuments"} <= set(recorded)
  for name, cls in recorded.items():
    assert getattr(config, name, None) is cls, f"{name} is not imported into olmo3.config"
    assert cls.__module__ == config.__name__, f"{name} says {cls.__module__}"
    assert name in config.__all__, f"{name} is not in olmo3.config.__all__"


# --- every field of every config is checked ------------------------------------------------------

CLASSES = [c for _, c in inspect.getmembers(config, inspect.isclass)
           if dataclasses.is_dataclass(c) and c.__module__ == config.__name__]
BASE = {config.DataConfig: {"paths": ("a.npy",)}}  # the one class with no valid defaults
# Strings that may be empty: "" means "as given, relative to the working directory".
EMPTY_OK = {("DataConfig", "root"), ("EvalConfig", "heldout_root")}
FIELDS = [(cls, f) for cls in CLASSES for f in dataclasses.fields(cls)]
IDS = [f"{cls.__name__}.{f.name}" for cls, f in FIELDS]


def _annotation(cls, name):
  return typing.get_type_hints(cls)[name]


def _arms(tp):
  """The non-None types of an annotation."""
  args = typing.get_args(tp)
  return [a for a in args if a is not type(None)] if typing.get_origin(tp) in (
      typing.Union, types.UnionType) else [tp]


def _wrong(tp):
  """Values no field annotated `tp` may hold."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    arms = _arms(tp)
    if len(arms) > 1:  # MeshConfig.rules' mesh axes: a name, names, or None
      return [1, 1.5, [1]]
    return [w for w in _wrong(arms[0]) if w is not None]
  if typing.get_origin(tp) is tuple:
    args = typing.get_args(tp)
    if args[1:] == (Ellipsis,):
      return ["ab", 1, None] + [(w,) for w in _wrong(args[0])[:2]]
    return [(), tuple(_wrong(a)[0] for a in args)]
  if tp is bool:
    return [1, 0, "True", None]
  if tp is int:
    return [1.0, True, "1", None]
  if tp is float:
    return [math.nan, math.inf, -math.inf, 10**400, True, "1.0", None]
  if tp is str:
    return [1, b"x", None]
  if isinstance(tp, type) and issubclass(tp, enum.Enum):
    return ["nosuch", 1, None]
  if dataclasses.is_dataclass(tp):
    return [1, "x", {"nosuch": 1}, None]
  raise AssertionError(f"no wrong values for {tp!r}")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_config_validates_through_the_base(cls):
  """Each checks its fields in _Validated.__post_init__ (a class's own would skip them)."""
  assert issubclass(cls, Validated) and cls.__post_init__ is Validated.__post_init__
  assert cls.__dataclass_params__.frozen
  cls(**BASE.get(cls, {}))  # the defaults are valid


@pytest.mark.parametrize("cls, f", FIELDS, ids=IDS)
def test_every_field_refuses_wrong_types_and_non_finite_numbers(cls, f):
  for value in _wrong(_annotation(cls, f.name)):
    with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.{f.name}="):
      cls(**{**BASE.get(cls, {}), f.name: value})
      pytest.fail(f"{cls.__name__}.{f.name}={value!r} accepted")


@pytest.mark.parametrize("cls, f", [(c, f) for c, f in FIELDS if set(
    _arms(_annotation(c, f.name))) & {int, float}], ids=lambda x: getattr(x, "name", None))
def test_every_number_declares_bounds_and_refuses_values_outside(cls, f):
  bounds = {k: f.metadata[k] for k in BOUNDS if k in f.metadata}
  assert bounds, f"{cls.__name__}.{f.name}: declare its bounds (config.bounded / resumable)"
  is_int = int in _arms(_annotation(cls, f.name))
  outside = []
  for key, bound in bounds.items():
    step = 1 if is_int else abs(bound) * 1e-9 or 1e-300
    outside.append({"ge": bound - step, "gt": bound, "le": bound + step, "lt": bound}[key])
  for value in outside:
    with pytest.raises(ConfigError,
                       match=rf"^{cls.__name__}\.{f.name}={re.escape(repr(value))}: must be"):
      cls(**{**BASE.get(cls, {}), f.name: value})


def _with_empty_string(tp):
  """A value of annotation `tp` holding "" where a string goes, or None if none does."""
  for arm in _arms(tp):
    if arm is str:
      return ""
    if typing.get_origin(arm) is tuple:
      args = typing.get_args(arm)
      inner = _with_empty_string(args[0])
      if inner is not None:
        return (inner,) if args[1:] == (Ellipsis,) else (inner, *(
            "x" if str in _arms(a) else 1 for a in args[1:]))
  return None


@pytest.mark.parametrize("cls, f", [
    (c, f) for c, f in FIELDS if _with_empty_string(_annotation(c, f.name)) is not None
    and (c.__name__, f.name) not in EMPTY_OK], ids=lambda x: getattr(x, "name", None))
def test_strings_may_not_be_empty(cls, f):
  value = _with_empty_string(_annotation(cls, f.name))
  base = {**BASE.get(cls, {}), **({"paths": ()} if f.name == "mix" else {})}
  with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.{f.name}="):
    cls(**{**base, f.name: value})


@pytest.mark.parametrize("cls, change, message", [
    (config.OptimizerConfig, {"peak_lr": 1e-4, "final_lr": 2e-4}, "final_lr=0.0002: must be in"),
    (config.OptimizerConfig, {"warmup_steps": 10, "decay_steps": 10}, "decay_steps=10: must be >"),
    (config.OptimizerConfig, {"spike_window": 8, "spike_min_history": 10},
     "spike_min_history=10: must be in [2, spike_window + 1=9]"),
    (config.OptimizerConfig, {"schedule": "stitched_cosine", "stitch_resumed_at": 1},
     "stitch_resumed_at=1: must lie between"),
    (config.OptimizerConfig, {"schedule": "stitched_cosine", "stitch_at": 1}, "stitch_at=1:"),
    (config.DataConfig, {"paths": ("a",), "mix": "m"}, "paths=('a',): give token files in"),
    (config.DataConfig, {"paths": ("a",), "global_batch_size": 8, "max_instances": 4},
     "max_instances=4: must hold at least one global batch (8)"),
    (config.RepetitionFilter, {"min_period": 5, "max_period": 4}, "max_period=4: must be >="),
    (config.MeshConfig, {"shape": (("data", 2), ("data", 4))}, "shape="),
    (config.MeshConfig, {"shape": (("data", -1), ("fsdp", -1))}, "at most one axis may be -1"),
    (config.MeshConfig, {"shape": (("data", 0),)}, "sizes must be >= 1, or -1"),
    (config.MeshConfig, {"dcn": (("data", 0),)}, "dcn=(('data', 0),): sizes must be >= 1"),
    (config.MeshConfig, {"rules": (("batch", "data"), ("batch", None))}, "rules="),
    (config.EvalConfig, {"tasks": ("arc:rc",)}, "tasks=('arc:rc',): each task is"),
    (config.Experiment, {"xla_flags": ("xla_foo=1",)}, "xla_flags=('xla_foo=1',): each entry"),
    (config.Experiment, {"libtpu_flags": ("--a=1 --b=2",)}, "libtpu_flags="),
    (config.Experiment, {"env": (("A=B", "1"),)}, "env=(('A=B', '1'),): names must be"),
    (config.Experiment, {"data": config.DataConfig(paths=("a",), seq_len=9000)},
     "data.seq_len=9000: exceeds model.max_seq_len (8192)"),
])
def test_constraints_between_fields_name_the_field(cls, change, message):
  with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.") as e:
    cls(**change)
  assert message in str(e.value)


def test_command_line_and_json_forms_are_stored_canonically():
  opt = config.OptimizerConfig(peak_lr=1, final_lr=0, warmup_steps=np.int64(5), no_decay=["a"])
  assert (type(opt.peak_lr), type(opt.final_lr), type(opt.warmup_steps), opt.no_decay) == (
      float, float, int, ("a",))
  mesh = config.MeshConfig(shape={"data": 2, "fsdp": -1}, rules=[["batch", ["data", "fsdp"]]])
  assert mesh.shape == (("data", 2), ("fsdp", -1))
  assert mesh.rules == (("batch", ("data", "fsdp")),)
  exp = config.Experiment(data=config.DataConfig(paths=("a",), seq_len=128, repetition_filter={}),
                          env=[["A", ""]], model=config.olmo3_micro())
  assert config.Experiment.from_dict(json.loads(json.dumps(exp.to_dict()))) == exp


def test_the_new_opt_in_fields_default_off_and_may_change_on_resume():
  assert config.CheckpointConfig().allow_restart_from_scratch is False
  assert config.DataConfig(paths=("a",)).allow_changed_data is False
  assert {"checkpoint.allow_restart_from_scratch", "data.allow_changed_data"} <= set(
      config.resumable_fields())


@pytest.mark.parametrize("cls, f", [(c, f) for c, f in FIELDS if set(
    _arms(_annotation(c, f.name))) & {int, float}], ids=lambda x: getattr(x, "name", None))
def test_a_wrong_type_is_named_with_the_expected_type_before_any_bound_is_compared(cls, f):
  """`train.steps='"ten"'` is a type error naming the field and the type it takes (never the
  comparison with its bound that a string would fail), as is a float for an int."""
  is_int = int in _arms(_annotation(cls, f.name))
  expected = r"an integer \(int\)" if is_int else r"a number \(float\)"
  for value, kind in [("ten", "str")] + ([(2.5, "float")] if is_int else []):
    with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.{f.name}={value!r}: must be "
                                          rf"{expected}, not {kind}"):
      cls(**{**BASE.get(cls, {}), f.name: value})
