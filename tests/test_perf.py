import csv
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo3 import config
from olmo3 import model as model_lib
from olmo3.config import DataConfig, Experiment, Remat
from olmo3.perf import aot
from olmo3.perf import flops as flops_lib
from olmo3.perf import remat as remat_lib
from olmo3.perf.flags import FLAG_SETS
from olmo3.train.loss import lm_loss

from conftest import random_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Compile-only needs no TPU; let several test processes load libtpu at once.
ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
       "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def test_flop_conventions_for_the_7b():
  cfg = config.olmo3_7b()
  C = flops_lib.Convention
  got = {c: flops_lib.flops_per_token(cfg, 8192, c) / 1e9 for c in C}
  assert got[C.EXACT] == pytest.approx(46.56, abs=0.01)
  assert got[C.MAXTEXT] == pytest.approx(47.77, abs=0.01)
  assert got[C.OLMO_CORE_LEGACY] == pytest.approx(49.38, abs=0.01)
  assert got[C.PALM] == pytest.approx(54.21, abs=0.01)


def test_exact_count_agrees_with_installed_olmo_core():
  from olmo_core.nn.transformer import TransformerConfig

  theirs = TransformerConfig.olmo3_7B(vocab_size=100_352).build(init_device="meta")
  # OLMo-core 3.0 halves for causality and windows like us; it also counts the QK-norm weights
  # (32 layers x 8192) and the final norm (4096) in 6N: that is the whole difference.
  norms = 6 * (32 * (4096 + 4096) + 4096)
  assert theirs.num_flops_per_token(8192) == config.olmo3_7b().flops_per_token(8192) + norms


def test_analytic_flops_match_the_compiled_step():
  model = config.olmo3_micro().replace(d_model=256, n_heads=4, n_kv_heads=4, mlp_hidden=512,
                                       vocab_size=512, padded_vocab_size=512, n_layers=2,
                                       max_seq_len=64, sliding_window=32)
  exp = Experiment(model=model, data=DataConfig(paths=("unused",), seq_len=64,
                                                global_batch_size=8))
  report = aot.compile_train_step(exp)
  # XLA computes masked attention over all T keys: compare with the full-attention (PaLM)
  # count; elementwise work (softmax, norms, AdamW) is the small remainder.
  palm = flops_lib.flops_per_token(model, 64, flops_lib.Convention.PALM) * exp.tokens_per_step
  assert report.compiled_tflops_per_step * 1e12 == pytest.approx(palm, rel=0.03)
  assert report.analytic_tflops_per_step < report.compiled_tflops_per_step
  assert report.total_gb > 0 and "compiled train step" in report.format()


@pytest.mark.parametrize("remat", ["full", "minimal", "save_dot_except_mlp", "custom"])
def test_remat_policies_give_the_same_gradients(remat):
  cfg = config.olmo3_micro()
  params = random_params(cfg, 0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 48)))

  def grads(c):
    graphdef = nnx.graphdef(model_lib.abstract_model(c))
    return jax.jit(jax.grad(lambda p: lm_loss(nnx.merge(graphdef, p)(tokens), tokens)[0]))(params)

  custom = (("query_proj", "device"), ("mlpwi_1", "remat"), ("mlpwo", "device"))
  plain, checkpointed = grads(cfg), grads(cfg.replace(remat=remat, remat_custom=custom))
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(checkpointed)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  graphdef = nnx.graphdef(model_lib.abstract_model(cfg.replace(remat=remat, remat_custom=custom)))
  jaxpr = str(jax.make_jaxpr(jax.grad(
      lambda p: lm_loss(nnx.merge(graphdef, p)(tokens), tokens)[0]))(params))
  assert "checkpoint" in jaxpr or "remat" in jaxpr


def test_custom_remat_names_are_checked():
  with pytest.raises(ValueError, match="unknown names"):
    remat_lib.policy(Remat.CUSTOM, (("qkv", "device"),))
  assert remat_lib.policy(Remat.NONE) is None


def _compile_tiny(topologies, libtpu_args=""):
  """Compiles the tiny train step for each topology in one process (libtpu reads its flags
  once per process)."""
  code = ("import sys; sys.path.insert(0, '.'); from launch import configs; import fiddle as fdl;"
          "from olmo3.perf import aot;"
          "exp = fdl.build(configs.resolve('experiments.olmo3_tiny:stage1', "
          "['data.global_batch_size=8']));"
          f"[print(aot.compile_train_step(exp, t).format()) for t in {list(topologies)!r}]")
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                        env=dict(ENV, LIBTPU_INIT_ARGS=libtpu_args), timeout=600)


@pytest.mark.parametrize("topologies, flag_set", [(["tpu7x:2x2x1"], "tpu7x"),
                                                  (["v5p:2x2x1", "v5p:2x2x1*2"], "v5p")])
def test_compile_for_tpu_topologies_with_their_flag_sets(topologies, flag_set):
  assert FLAG_SETS["v5p"] == FLAG_SETS["v6e"]  # the v5p compile validates the v6e set too
  done = _compile_tiny(topologies, " ".join(FLAG_SETS[flag_set].libtpu))
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.count("FITS") == len(topologies)
  assert all(t in done.stdout for t in topologies)
  if "v5p:2x2x1*2" in topologies:  # two slices over DCN: the slices form the data axis
    assert "8 x TPU v5, mesh {'data': 2, 'fsdp': 4, 'sequence': 1, 'tensor': 1}" in done.stdout


def test_libtpu_rejects_an_unknown_flag():
  done = _compile_tiny(["v5p:2x2x1"], "--xla_tpu_this_flag_does_not_exist=true")
  assert done.returncode != 0


@pytest.mark.slow(seconds=80)
def test_sweep_compiles_named_variants_and_ranks_them(tmp_path):
  done = subprocess.run([sys.executable, "launch/sweep.py",
                         "--fdl_config=experiments.olmo3_tiny:stage1",
                         "--sweep=experiments.olmo3_tiny:mfu_sweep", "--compile_only=local",
                         "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                        env=ENV, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(tmp_path / "results.csv") as f:
    rows = list(csv.DictReader(f))
  from experiments import olmo3_tiny
  from launch.sweep import variant_name

  assert len(rows) == 12
  assert {r["variant"] for r in rows} == {variant_name(v) for v in olmo3_tiny.mfu_sweep()}
  assert all(r["fits"] == "True" and float(r["memory_gb"]) > 0 for r in rows)
  assert (tmp_path / "results.md").read_text().count("\n") == 2 + 12
  assert (tmp_path / "results.png").stat().st_size > 5_000
  one = subprocess.run([sys.executable, "launch/sweep.py",
                        "--fdl_config=experiments.olmo3_tiny:stage1",
                        "--sweep=experiments.olmo3_tiny:mfu_sweep", "--steps", "2",
                        "--variant", "model.remat=full,data.global_batch_size=8,model.attention=xla",
                        "--out", str(tmp_path / "one")], capture_output=True, text=True, cwd=ROOT,
                       env=ENV, timeout=600)
  assert one.returncode == 0, one.stderr[-3000:]
  assert "tokens_per_s" in (tmp_path / "one" / "results.csv").read_text()


def test_each_sweep_variant_gets_its_own_flag_set(tmp_path):
  """Flags only apply before JAX starts, so every variant runs in a process of its own: an
  unknown XLA flag aborts that variant's process (XLA refuses it), the other variant compiles."""
  (tmp_path / "flag_sweep.py").write_text(
      "def sweep():\n"
      "  return [{'xla_flags': ()}, {'xla_flags': ('--xla_this_flag_does_not_exist=1',)}]\n")
  def sweep(*extra):
    done = subprocess.run([sys.executable, "launch/sweep.py",
                           "--fdl_config=experiments.olmo3_tiny:stage1",
                           "--sweep=flag_sweep:sweep", "--fdl_set=data.global_batch_size=8",
                           "--compile_only=local", "--out", str(tmp_path / "out"), *extra],
                          capture_output=True, text=True, cwd=ROOT,
                          env=dict(ENV, PYTHONPATH=str(tmp_path)), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "out" / "results.csv") as f:
      return {r["variant"]: r for r in csv.DictReader(f)}

  first = sweep("--variant", "xla_flags=off")  # one variant alone
  assert list(first) == ["xla_flags=off"]
  rows = sweep("--resume")  # keeps it, runs the other
  assert {k: v for k, v in rows["xla_flags=off"].items() if v} == first["xla_flags=off"]
  assert rows["xla_flags=off"]["fits"] == "True" and float(rows["xla_flags=off"]["memory_gb"]) > 0
  assert rows["xla_flags=on"]["fits"] == "False"
  assert "exited" in rows["xla_flags=on"]["error"]


def test_mfu_gpu_benchmark_smoke_mode():
  done = subprocess.run([sys.executable, "benchmarks/mfu_gpu.py", "--smoke", "--steps", "2"],
                        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  import json

  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result["tokens_per_s"] > 0 and result["tflops_exact"] > 0
  assert result["mfu_exact"] is None  # a CPU has no known peak: no made-up MFU
