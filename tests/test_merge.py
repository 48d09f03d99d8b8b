"""python -m olmo3.convert merge: the weighted average of checkpoints' parameters as mergekit's
linear merge computes it (weights normalised), float64 accumulation; weights 1,0 give the first
checkpoint bit for bit; checkpoints of another model are refused naming the parameter; the
result is a checkpoint `export-hf` exports and `init_from` starts a new stage from, with fresh
optimizer moments (and refuses to continue, in one line)."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from olmo3 import config
from olmo3.convert.__main__ import main as convert_main
from olmo3.io import checkpoint

from conftest import random_params

MICRO = config.olmo3_micro()


def _leaves(tree) -> dict[str, np.ndarray]:
  return {checkpoint.array_name(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _restored(path) -> dict[str, np.ndarray]:
  cfg = config.ModelConfig(**checkpoint.load_meta(path)["model_config"])
  from olmo3 import model as model_lib

  return _leaves(checkpoint.restore_params(path, checkpoint.host_target(
      model_lib.param_shapes(cfg))))


@pytest.fixture
def two(tmp_path):
  a, b = tmp_path / "a", tmp_path / "b"
  checkpoint.save_model(a, MICRO, random_params(MICRO, 1))
  checkpoint.save_model(b, MICRO, random_params(MICRO, 2))
  return a, b


def test_merge_is_the_normalised_weighted_average(two, tmp_path, capsys):
  a, b = two
  out = tmp_path / "merged"
  assert convert_main(["merge", "--ckpt", str(a), "--ckpt", str(b), "--weights", "3,1",
                       "--out", str(out)]) == 0
  assert "0.75 x" in capsys.readouterr().out
  merged, pa, pb = _restored(out), _restored(a), _restored(b)
  assert merged.keys() == pa.keys()
  for name, x in merged.items():
    expected = np.average(np.stack([pa[name], pb[name]]).astype(np.float64), axis=0,
                          weights=[3, 1]).astype(np.float32)
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x, expected, name)
  meta = checkpoint.load_meta(out)
  assert [m["weight"] for m in meta["merged"]] == [3.0, 1.0] and meta["normalized"]
  assert checkpoint.ADAM not in meta[checkpoint.ARRAYS] and list(meta[checkpoint.ARRAYS]) == [
      checkpoint.PARAMS]


def test_weights_one_zero_give_the_first_bit_for_bit(two, tmp_path):
  a, b = two
  out = tmp_path / "merged"
  params = random_params(MICRO, 1)
  params["norm"]["weight"][:3] = [-0.0, 0.0, -0.0]  # signed zeros survive too
  checkpoint.save_model(tmp_path / "a0", MICRO, params)
  assert convert_main(["merge", "--ckpt", str(tmp_path / "a0"), "--ckpt", str(b), "--weights",
                       "1,0", "--out", str(out)]) == 0
  first, merged = _restored(tmp_path / "a0"), _restored(out)
  for name, x in merged.items():
    assert x.tobytes() == first[name].tobytes(), name


@pytest.mark.parametrize("argv, message", [
    (["--weights", "1"], "--weights '1': 1 weights for 2 --ckpt"),
    (["--weights", "1,-1"], "--weights '1,-1': each must be >= 0 and their sum > 0"),
    (["--weights", "a,b"], "--weights 'a,b': not comma-separated numbers"),
])
def test_bad_weights_are_one_line(two, tmp_path, capsys, argv, message):
  a, b = two
  assert convert_main(["merge", "--ckpt", str(a), "--ckpt", str(b), *argv, "--out",
                       str(tmp_path / "m")]) == 2
  assert capsys.readouterr().err.strip() == f"error: {message}"
  assert not (tmp_path / "m").exists()


def test_another_models_checkpoint_is_refused_naming_the_parameter(two, tmp_path, capsys):
  a, _ = two
  wider = MICRO.replace(mlp_hidden=MICRO.mlp_hidden * 2)
  checkpoint.save_model(tmp_path / "w", wider, random_params(wider, 3))
  assert convert_main(["merge", "--ckpt", str(a), "--ckpt", str(tmp_path / "w"), "--out",
                       str(tmp_path / "m")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "parameter layers.mlp.down_proj.kernel has shape" in err[0], err
  assert "only checkpoints of one model merge" in err[0]
  assert convert_main(["merge", "--ckpt", str(a), "--out", str(tmp_path / "m")]) == 2
  assert "merge needs two --ckpt or more" in capsys.readouterr().err


@pytest.mark.seconds(10)
def test_a_merge_exports_and_starts_a_new_stage_with_fresh_moments(two, tmp_path):
  from train_helpers import micro_experiment, write_corpus

  from olmo3.placement import ShardedModel
  from olmo3.run.plan import RunPlan
  from olmo3.train import state as state_lib
  from olmo3.train.run_checkpoints import RunCheckpoints

  a, b = two
  out = tmp_path / "merged"
  assert convert_main(["merge", "--ckpt", str(a), "--ckpt", str(b), "--out", str(out)]) == 0
  assert convert_main(["export-hf", "--ckpt", str(out), "--out", str(tmp_path / "hf")]) == 0
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 6
  exp = micro_experiment(write_corpus(tmp_path / "corpus"))
  exp = dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint,
                                                                init_from=str(out)))
  model = ShardedModel.for_experiment(exp)
  with model.context():
    state, _ = state_lib.restore_or_init(state_lib.StateLayout(exp, model),
                                         RunCheckpoints(f"{tmp_path}/run/checkpoints", 1, False),
                                         RunPlan.build(exp, str(tmp_path / "run")))
  assert int(state.step) == 0
  merged = _restored(out)
  for name, x in _leaves(state.params).items():
    np.testing.assert_array_equal(x, merged[name], name)
  adam = state.opt_state[1]
  assert int(adam.count) == 0
  assert all(not np.asarray(m).any() for m in jax.tree.leaves((adam.mu, adam.nu)))
  go_on = dataclasses.replace(exp, checkpoint=dataclasses.replace(
      exp.checkpoint, init_mode=config.InitMode.CONTINUE))
  with model.context(), pytest.raises(checkpoint.CheckpointError,
                                      match="holds parameters only .*init_mode='new_stage'"):
    state_lib.restore_or_init(state_lib.StateLayout(go_on, model),
                              RunCheckpoints(f"{tmp_path}/run2/checkpoints", 1, False),
                              RunPlan.build(go_on, str(tmp_path / "run2")))
