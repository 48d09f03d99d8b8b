"""Context parallelism (the sequence split over the mesh's `sequence` axis) trains exactly what
one device trains: in float64 to 1e-12 through the train step, and in float32 through the real
launcher (the tiny stage 3: packed documents, YaRN), with a checkpoint saved at one
sequence-axis size resumed at another. The kernels' and the layout's own tests are in
tests/test_model.py."""

import json
import os

import jax
import numpy as np
import pytest

from olmo3 import config, sharding
from olmo3.config import Packing, RopePositions
from olmo3.io import checkpoint
from olmo3.placement import ShardedModel
from olmo3.train import state as state_lib
from tests import forked
from tests.conftest import FAST_COMPILE_XLA_FLAGS
from tests.train_helpers import micro_experiment, write_corpus


def _documents_corpus(tmp_path):
  """The training corpus cut into documents of 5 to 60 tokens (EOS, token 0, ends each)."""
  from olmo3.data import tokens

  path = write_corpus(tmp_path)
  data = np.fromfile(path, dtype="<u4")  # raw uint32 tokens, as OLMo-core's .npy files
  rng = np.random.default_rng(0)
  data[np.cumsum(rng.integers(5, 60, len(data) // 5))[: len(data) // 40]] = 0
  tokens.write_token_file(path, data)
  return path


def _trained(exp, shape, steps):
  """`steps` train steps of `exp` on `shape` (8 simulated devices): metrics and parameters."""
  from olmo3.data import pipeline, sources
  from olmo3.train.step import jit_train_step

  model = ShardedModel(exp.model, sharding.make_mesh(shape))
  layout = state_lib.StateLayout(exp, model)
  out = []
  with model.context():
    state = layout.fresh()
    step = jit_train_step(exp, model, layout)
    source = sources.token_files(exp.data, exp.model.vocab_size, model=exp.model)
    for batch in pipeline.Loader(exp.data, model.batch_sharding, start_step=0, num_steps=steps,
                                 source=source):
      state, metrics = step(state, batch)
      out.append({k: float(metrics[k]) for k in ("loss", "grad_norm")})
  return out, jax.device_get(state.params)


@pytest.mark.seconds(30)
def test_float64_steps_with_the_sequence_split_equal_one_shard_to_1e_12(tmp_path):
  """Three float64 train steps of packed documents with per-document RoPE positions: losses,
  gradient norms and parameters (norm-wise) with the sequence over 4 x 2 fsdp gathering keys
  and values, and over 8 and over 4 x 2 fsdp swapping the sequence for heads (all-to-all: 8
  key/value heads here), equal the sequence unsplit, relative 1e-12 (float32 rounding would be
  1e-7)."""
  exp = micro_experiment(_documents_corpus(tmp_path))
  exp = exp.__class__(**{**exp.__dict__,
                         "model": exp.model.replace(compute_dtype=config.DType.FLOAT64,
                                                    rope_positions=RopePositions.DOCUMENT,
                                                    n_kv_heads=8),
                         "data": exp.data.replace(packing=Packing(), seq_len=64,
                                                  global_batch_size=2)})
  a2a = exp.__class__(**{**exp.__dict__, "model": exp.model.replace(
      context_parallel=config.ContextParallel.ALL_TO_ALL)})
  # (Gathering over 8 is the launcher test's, below, in float32.)
  runs = [(exp, {"fsdp": 2, "sequence": 4}), (a2a, {"sequence": 8}),
          (a2a, {"fsdp": 2, "sequence": 4})]
  with jax.enable_x64(True):
    ref_metrics, ref_params = _trained(exp, {"fsdp": 2, "tensor": 4}, 3)
    for exp, shape in runs:
      metrics, params = _trained(exp, shape, 3)
      for ours, ref in zip(metrics, ref_metrics):
        for key in ref:
          assert abs(ours[key] - ref[key]) <= 1e-12 * abs(ref[key]), (
              exp.model.context_parallel, shape, key, ours, ref)
      for p, r in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        # Norm-wise: Adam divides a gradient by its own size, so an entry whose gradient is
        # rounding noise moves by up to the LR either way (1.6e-13 seen, 2e-12 of the largest).
        assert np.linalg.norm(p - r) <= 1e-12 * np.linalg.norm(r), (exp.model.context_parallel,
                                                                   shape)


# The tiny stage 3 (packed instances, YaRN) at a quarter of its length (512 tokens: 32 per chunk
# of 8 shards' zig-zag, so the sliding window, 128, reaches across chunks of four shards), from
# fresh parameters, 3 steps; held-out evaluation at the end (CE per band of 256 positions) on 2
# documents; no downstream tasks and no RULER (tests/test_launch.py runs it through the
# launcher; here it cost 120 of the test's 150 s). (1024 tokens cost a third more: 80 CPU s
# against 60.)
STAGE3 = ["--fdl_config=experiments.olmo3_tiny:stage3", "--fdl_set=checkpoint.init_from=None",
          "--fdl_set=data.seq_len=512", "--fdl_set=train.log_every=1", "--fdl_set=eval.tasks=()",
          "--fdl_set=eval.max_documents=2", "--fdl_set=checkpoint.every=2",
          "--fdl_set=eval.ruler.lengths=()"]
# These launches compile much (a program per mesh) and run little.
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 "
           + FAST_COMPILE_XLA_FLAGS)


def _launch(workdir, mesh, steps, cp="all_gather"):
  shape = tuple(mesh.items())
  done = forked.completed("main", [*STAGE3, f"--workdir={workdir}", f"--fdl_set=train.steps={steps}",
                                   f"--fdl_set=mesh.shape={shape!r}",
                                   f"--fdl_set=model.context_parallel='{cp}'"], ENV)
  assert done.returncode == 0, done.stderr[-3000:]
  return done


def _metrics(workdir):
  """Each logged step's numbers: training's, and at the last step the held-out evaluation's."""
  lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {m["step"]: {k: v for k, v in m.items() if k in ("loss", "ce_loss", "grad_norm")
                      or k.startswith("eval/")} for m in lines}


def _params(workdir, step):
  from olmo3.config import Experiment

  exp = Experiment.from_dict(json.loads((workdir / "experiment.json").read_text()))
  model = ShardedModel(exp.model, sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
  return checkpoint.restore_params(workdir / "checkpoints" / str(step),
                                   checkpoint.host_target(model.param_shapes))


@pytest.mark.slow(seconds=40)
def test_stage3_through_the_launcher_equals_one_sequence_shard_and_resumes_resized(tmp_path):
  """Through the launcher on 8 CPU devices: the sequence split 8 ways (keys and values
  gathered) for 2 steps, then resumed from that checkpoint split 2 ways (x 2 data x 2 tensor)
  swapping the sequence for heads (all-to-all: the tiny model's 4 heads over sequence x
  tensor), logs the same losses, gradient norms and held-out CE (per position band too) as the
  sequence unsplit (2 fsdp x 4 tensor), and ends with the same parameters: float32 rounding
  (relative 1e-5). (Other splits, fsdp with the sequence among them, are compared in process:
  above and tests/test_model.py.)"""
  ref, resized = tmp_path / "ref", tmp_path / "resized"
  _launch(ref, {"fsdp": 2, "tensor": 4}, 3)
  _launch(resized, {"sequence": 8}, 2)
  done = _launch(resized, {"data": 2, "sequence": 2, "tensor": 2}, 3, cp="all_to_all")
  assert "checkpoints/2 (step 2, verified)" in done.stderr, done.stderr[-2000:]
  expected, logged = _metrics(ref), _metrics(resized)
  assert sorted(expected) == sorted(logged) == [1, 2, 3]
  assert any(k.startswith("eval/") for k in expected[3]) and logged[3].keys() == expected[3].keys()
  for step, numbers in expected.items():
    for key, value in numbers.items():
      assert abs(logged[step][key] - value) <= 1e-5 * abs(value), (step, key)
  for p, r in zip(jax.tree.leaves(_params(resized, 3)), jax.tree.leaves(_params(ref, 3))):
    assert np.linalg.norm(p - r) <= 1e-5 * np.linalg.norm(r)
