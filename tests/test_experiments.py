"""The experiments: the tiny recipe is the 7B's shrunk, so a 7B recipe change reaches it."""

import dataclasses

import fiddle as fdl
import pytest

from experiments import olmo3_7b, olmo3_tiny
from launch import config_changes, refs
from olmo3 import config

SIZE = {f"model.{f}" for f in olmo3_tiny.SIZE_FIELDS} | {
    "data.global_batch_size", "data.seq_len", "data.max_target_seq_len", "optimizer.peak_lr",
    "optimizer.final_lr", "optimizer.warmup_steps", "optimizer.decay_steps",
    "optimizer.stitch_first_steps", "optimizer.stitch_resumed_at", "optimizer.stitch_at",
    "optimizer.stitch_second_steps",
    "train.steps", "train.log_every", "train.loss_ranks",
    "train.eval_every", "checkpoint.every", "eval.batch_size",
    # RULER's lengths scaled as the context is, fewer instances, a smaller prefill on a CPU
    "eval.ruler.lengths", "eval.ruler.samples", "eval.ruler.prefill_chunk",
    "model.rope_scaling.original_context",  # stage 3: YaRN extends the tiny context
    "eval.position_band"}
DATA = {"data.mix", "data.root", "checkpoint.init_from", "eval.heldout", "eval.tokenizer",
        "eval.max_documents", "eval.tasks", "eval.task_limit", "eval.min_document_tokens"}
MACHINE = {"model.attention", "model.compute_dtype", "model.remat", "model.remat_custom",
           "xla_flags", "libtpu_flags", "env", "data.num_workers", "mesh.shape"}


def _field(path: str) -> str:
  return path.split("[")[0]


@pytest.mark.parametrize("stage", ["stage1", "stage2", "stage3"])
def test_tiny_differs_from_the_7b_only_in_size_data_and_machine(stage):
  changes = config_changes.diff(getattr(olmo3_7b, stage)(), getattr(olmo3_tiny, stage)())
  changed = {_field(c.path) for c in changes}
  assert changed - (SIZE | DATA | MACHINE) == set()
  # What it must change: the corpus, the shape, the steps; the recipe's numbers stay.
  assert {"data.mix", "model.d_model", "train.steps", "model.attention"} <= changed
  tiny, big = fdl.build(getattr(olmo3_tiny, stage)()), fdl.build(getattr(olmo3_7b, stage)())
  assert tiny.optimizer.peak_lr == pytest.approx(olmo3_tiny.LR_SCALE * big.optimizer.peak_lr)
  assert tiny.data.global_batch_size * olmo3_tiny.BATCH_DIVISOR == big.data.global_batch_size


@pytest.mark.parametrize("stage, ranks", [("stage1", 512), ("stage2", 128), ("stage3", 32)])
def test_the_loss_is_averaged_over_ai2s_data_parallel_ranks(stage, ranks):
  """OLMo-core's per-rank token mean over AI2's ranks: 512 H100 (stage 1), 128 (stage 2), 256
  with context parallelism 8 (stage 3: 32 ranks of 2 instances); the tiny stages over 2."""
  big, tiny = fdl.build(getattr(olmo3_7b, stage)()), fdl.build(getattr(olmo3_tiny, stage)())
  assert big.train.loss_mean is tiny.train.loss_mean is config.LossMean.PER_RANK
  assert (big.train.loss_ranks, tiny.train.loss_ranks) == (ranks, 2)


def test_a_change_to_the_7b_recipe_reaches_the_tiny_run(monkeypatch):
  base = olmo3_7b.stage2

  def changed():
    cfg = base()
    cfg.optimizer.b2, cfg.train.z_loss_weight, cfg.data.seed = 0.99, 3e-5, 7
    return cfg

  monkeypatch.setattr(olmo3_7b, "stage2", changed)
  tiny = fdl.build(olmo3_tiny.stage2())
  assert (tiny.optimizer.b2, tiny.train.z_loss_weight, tiny.data.seed) == (0.99, 3e-5, 7)


def test_tiny_stages_keep_the_schedule_shape():
  one, two = fdl.build(olmo3_tiny.stage1()), fdl.build(olmo3_tiny.stage2())
  assert (one.optimizer.schedule, one.optimizer.warmup_steps, one.optimizer.stitch_first_steps,
          one.optimizer.stitch_at, one.optimizer.stitch_second_steps) == (
      config.Schedule.STITCHED_COSINE, olmo3_tiny.WARMUP_STEPS, 84, 46, 118)
  assert (two.optimizer.schedule, two.optimizer.warmup_steps, two.optimizer.final_lr) == (
      config.Schedule.LINEAR, 0, 0.0)
  assert two.checkpoint.init_from == "runs/olmo3_tiny.stage1"


def test_the_tiny_model_has_the_parameters_its_docs_say():
  assert config.olmo3_tiny().param_count == 2_902_144


def test_resumable_fields_are_the_marked_ones():
  """The launcher lets exactly these change when a run resumes in its workdir."""
  assert set(config.resumable_fields()) == {
      "train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
      "train.microbatches", "checkpoint.every", "checkpoint.keep", "checkpoint.async_save",
      "data.num_workers", "data.prefetch", "mesh.shape", "mesh.dcn",
      "checkpoint.allow_restart_from_scratch", "data.allow_changed_data", "model.vocab_chunk", "model.splash_block",
      "model.context_parallel",
      "data.device_prefetch", "wandb.mode", "wandb.project", "wandb.entity", "wandb.name",
      "optimizer.spike_window_on_restart", "eval.ruler.lengths", "eval.ruler.tasks",
      "eval.ruler.samples", "eval.ruler.seed", "eval.ruler.prefill_chunk", "eval.ruler.alarm_drop"}
  old, new = olmo3_tiny.stage1(), olmo3_tiny.stage1()
  new.train.steps, new.mesh.shape = 200, (("data", 2), ("fsdp", -1))
  new.optimizer.spike_window_on_restart = config.SpikeWindowOnRestart.EMPTY  # read at restarts
  assert config_changes.unresumable_changes(old, new) == []
  new.optimizer.peak_lr = 1e-3
  assert [c.path for c in config_changes.unresumable_changes(old, new)] == ["optimizer.peak_lr"]


def test_laptop_size_keeps_the_7b_evaluation():
  """The fiddler that runs the 7B's evaluation path at tiny size changes no eval field but the
  batch (16 rows split over 8 CPU devices)."""
  big = fdl.build(olmo3_7b.stage1())
  small = fdl.build(olmo3_tiny.laptop_size(olmo3_7b.stage1()))
  assert small.eval == dataclasses.replace(big.eval, batch_size=16)
  assert small.model.d_model == olmo3_tiny.olmo3_tiny().d_model and small.train.steps == 50
  assert big.eval.heldout == ("v3-small-ppl-validation",) and len(big.eval.tasks) == 26
  assert big.train.eval_every == 10_000


@pytest.mark.parametrize("module, shapes", [
    (olmo3_7b, {(8, 512), (16, 256), (32, 128), (64, 64)}),
    (olmo3_tiny, {(2, 64), (4, 32), (8, 16)})])
def test_head_shape_sweeps_change_the_heads_alone(module, shapes):
  """Each variant is stage 1 with (heads, head_dim) changed at the same d_model (and, at tiny
  size, the init seed): same parameters, same analytic FLOPs; distinct names (results never
  overwrite)."""
  base = fdl.build(module.stage1()).model
  seen, names = set(), set()
  for overrides in module.head_shape_sweep():
    cfg = module.stage1()
    for path, value in overrides.items():
      refs.set_field(cfg, path, value)
    assert {c.path for c in config_changes.diff(module.stage1(), cfg)} <= {
        "model.n_heads", "model.n_kv_heads", "train.seed"}
    exp = fdl.build(cfg)  # validates
    model = exp.model
    assert model.d_model == base.d_model and model.n_kv_heads == model.n_heads
    assert model.param_count == base.param_count
    assert model.flops_per_token(exp.data.seq_len) == base.flops_per_token(exp.data.seq_len)
    seen.add((model.n_heads, model.head_dim))
    names.add(refs.variant_name(overrides))
  assert seen == shapes and len(names) == len(module.head_shape_sweep())


def test_the_tiny_stage3_is_the_7bs_long_context_shrunk():
  """8x the tiny context, as 65,536 is 8x 8192; YaRN's factor and layers, the packing and the
  start are the 7B's."""
  big, tiny = fdl.build(olmo3_7b.stage3()), fdl.build(olmo3_tiny.stage3())
  assert big.data.seq_len == 8 * 8192 and tiny.data.seq_len == 8 * olmo3_tiny.SEQ_LEN
  assert tiny.model.max_seq_len == tiny.data.seq_len
  assert tiny.model.rope_scaling == big.model.rope_scaling.replace(
      original_context=config.olmo3_tiny().max_seq_len)
  assert tiny.data.packing == big.data.packing == config.Packing()
  assert (big.eval.position_band, tiny.eval.position_band) == (8192, olmo3_tiny.SEQ_LEN)
  assert (big.optimizer.warmup_steps, big.optimizer.decay_steps, big.train.steps) == (
      200, 11_921, 11_921)
  assert big.checkpoint.init_from == "runs/olmo3_7b.stage2"
  assert tiny.checkpoint.init_from == "runs/olmo3_tiny.stage2"
  assert tiny.checkpoint.init_mode == big.checkpoint.init_mode == config.InitMode.NEW_STAGE
  # AI2's context parallelism of 8 on the pod; a laptop's devices all on fsdp.
  assert dict(big.mesh.shape)["sequence"] == 8 and dict(tiny.mesh.shape)["sequence"] == 1


def test_the_context_parallel_sweep_builds_distinct_layouts_for_512_devices():
  """Every cp_sweep variant is stage 3 with its layout changed, fills tpu7x:4x8x8's 512
  devices with the 64 sequences a step splittable, and has a name of its own (a tuple value,
  such as a mesh shape, is named by its entries: results never overwrite one another)."""
  from launch import jobs

  names, layouts = set(), set()
  for overrides in olmo3_7b.cp_sweep():
    cfg = olmo3_7b.stage3()
    for path, value in overrides.items():
      refs.set_field(cfg, path, value)
    assert {c.path.split("[")[0] for c in config_changes.diff(olmo3_7b.stage3(), cfg)} <= {
        "mesh.shape", "model.remat", "model.splash_block", "model.context_parallel"}
    exp = fdl.build(cfg)
    jobs.check_experiment(exp, jobs.Target.GKE, 512, 1)
    sizes = jobs.filled_mesh(exp.mesh, 512, 1)
    assert exp.data.global_batch_size % (sizes["data"] * sizes["fsdp"]) == 0
    layouts.add((sizes["sequence"], sizes["tensor"]))
    names.add(refs.variant_name(overrides))
  assert len(names) == len(olmo3_7b.cp_sweep()) and layouts == {(8, 1), (16, 1), (4, 2)}


def test_all_to_all_context_parallelism_refuses_a_degree_that_does_not_divide_the_kv_heads():
  """Checked with the experiment, before anything starts: the tiny model's 4 key/value heads
  split 8 ways; a degree that divides them builds."""
  cfg = olmo3_tiny.stage3()
  cfg.model.context_parallel = config.ContextParallel.ALL_TO_ALL
  cfg.mesh.shape = (("fsdp", -1), ("sequence", 8))
  with pytest.raises(config.ConfigError, match=r"^Experiment.model.context_parallel='all_to_all'"
                     r": all-to-all context parallelism splits the heads 8 ways \(mesh sequence "
                     r"x tensor\), which does not divide 4 key/value heads \(model.n_kv_heads\)"):
    fdl.build(cfg)
  cfg.mesh.shape = (("fsdp", -1), ("sequence", 2), ("tensor", 2))
  fdl.build(cfg)
