"""The launcher, experiments and run records, through the real command line."""

import json
import os
import re
import shutil
import subprocess
import sys

import fiddle as fdl
import pytest

from launch import config_changes, config_files, rankings, refs
from olmo3.run import record
from olmo3.io import metrics as metrics_lib
from tests import forked
from tests.test_reliability import straight  # noqa: F401  (the trained run, shared)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The README's command runs on the plain CPU device; tests give JAX 8 fake ones.
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
# The tiny recipe at the reliability tests' half-length instances (tests/test_reliability.py's
# TINY): the session's compilation cache holds their train step after the first launch.
TINY_FAST = ["--fdl_set=data.global_batch_size=8", "--fdl_set=data.seq_len=128",
             "--fdl_set=eval.max_documents=8", "--fdl_set=eval.batch_size=8",
             "--fdl_set=eval.task_limit=2"]


def _main(*args, timeout=600, check=True):
  done = forked.completed("main", list(args), ENV, timeout=timeout)
  if check:
    assert done.returncode == 0, done.stderr[-3000:]
  return done


def _record(workdir, cfg):
  """A run record as the launcher's first launch writes it."""
  record.RunRecord(str(workdir)).begin(config_files.revision(None, cfg), fdl.build(cfg).to_dict(),
                                       ["x"], 0)


@pytest.mark.slow(seconds=4)
def test_7b_stage2_dry_run():
  out = _main("--fdl_config=experiments.olmo3_7b:stage2", "--dry_run").stdout
  assert "parameters          7,298,617,344" in out
  assert "tokens per step     256 x 8192 = 2,097,152" in out
  assert "steps               47,684" in out
  assert "peak LR             0.00020712352850360292" in out
  assert "data.mix: str | None = 'OLMo-midtraining-mix-0625-100B'" in out
  # The configured mesh, and what it resolves to on this machine (one CPU device here).
  assert ("mesh                {'data': 1, 'fsdp': -1, 'sequence': 1, 'tensor': 1} -> "
          "{'data': 1, 'fsdp': 1, 'sequence': 1, 'tensor': 1} on 1 cpu devices") in out


@pytest.mark.slow(seconds=4)
def test_7b_stage3_dry_run_shows_yarn_packing_and_its_start():
  out = _main("--fdl_config=experiments.olmo3_7b:stage3", "--dry_run").stdout
  assert "tokens per step     64 x 65536 = 4,194,304" in out
  assert "steps               11,921 (schedule over 11,921)" in out
  assert "peak LR             0.00020712352850360292 (linear, warmup 200)" in out
  assert ("RoPE                YaRN x8 over 8,192 tokens (beta_fast 32, beta_slow 1, attention "
          "factor 1.207944) on 8 of 32 layers (full_attention: 3, 7, 11, 15, 19, 23, 27, 31); "
          "the others plain, theta 500000") in out
  assert ("packing             documents packed into 65,536-token instances (best-fit "
          "decreasing in groups of 8 files, shuffled with seed 123; long documents: truncate); "
          "attention within each document, RoPE positions per instance") in out
  assert "data.mix: str | None = 'OLMo-longmino-mix-0625'" in out
  assert ("start               from runs/olmo3_7b.stage2 (checkpoint.init_mode=new_stage: its "
          "parameters, and its AdamW moments when it holds them (else fresh ones); step, "
          "schedule and data position start from 0) unless runs/olmo3_7b.stage3 holds a "
          "checkpoint of its own") in out


@pytest.mark.slow(seconds=4)
def test_7b_sft_dry_runs_print_ai2_s_settings():
  """AI2's Think and Instruct SFT (OLMo-core 38f66526c and 9e9747105, open-instruct's
  7b_*_sft.sh): what each starts from and whether the moments come with it, the template, 2
  epochs of 32 x 32,768 tokens, LinearWithWarmup(3%) to 0, no weight decay or z-loss, the loss
  averaged over AI2's 32 and 16 data-parallel ranks."""
  think = _main("--fdl_config=experiments.olmo3_7b:sft_think", "--dry_run").stdout
  for line in ("tokens per step     32 x 32768 = 1,048,576",
               "steps               until the end of epoch 2 (schedule over the stage's epochs)",
               "peak LR             5e-05 (linear, warmup 3% of the schedule)",
               "loss                cross-entropy: each of 32 data-parallel ranks' token mean, "
               "averaged (OLMo-core's), no z-loss",
               "chat template       olmo3_think (the data's manifest must record it); the loss on "
               "the assistant's tokens only (the data's label masks)",
               "optimizer.weight_decay: float = 0.0",
               "start               from runs/olmo3_7b.stage3 (checkpoint.init_mode=new_stage: its "
               "parameters, and its AdamW moments when it holds them (else fresh ones)"):
    assert line in think, line
  assert "in groups of 1 files, in mix order; long documents: truncate" in think
  instruct = _main("--fdl_config=experiments.olmo3_7b:sft_instruct", "--dry_run").stdout
  for line in ("peak LR             8e-05 (linear, warmup 3% of the schedule)",
               "each of 16 data-parallel ranks' token mean",
               "start               from runs/olmo3_7b.sft_think (checkpoint.init_mode=new_stage"):
    assert line in instruct, line


@pytest.mark.slow(seconds=6)
def test_7b_stage1_dry_run_dotted_form_and_overrides():
  out = _main("--fdl_config=experiments.olmo3_7b.stage1", "--dry_run").stdout
  assert "tokens per step     512 x 8192 = 4,194,304" in out
  assert ("steps               1,413,814 (stitched: part 1 aimed at 1,192,093, part 2 from "
          "update 596,048 aimed at 1,668,931)") in out
  assert "peak LR             0.0003 (stitched_cosine, warmup 2000)" in out
  out = _main("--fdl_config=experiments.olmo3_7b.stage1", "--dry_run", "--fdl_set=train.steps=10",
              "--fiddler=single_cosine").stdout
  assert "steps               10 (schedule over 1,413,814)" in out  # the first 10 steps of it
  assert "peak LR             0.0003 (cosine, warmup 2000)" in out
  assert "FLOPs per token     46.557 G" in out


@pytest.mark.slow(seconds=4)
def test_7b_dry_run_lists_ai2_s_held_out_sets_and_tasks():
  from experiments.olmo3_7b import FAST_TASKS

  out = _main("--fdl_config=experiments.olmo3_7b:stage1", "--dry_run").stdout
  assert ("held-out            v3-small-ppl-validation: 11 sets, every 10,000 steps: "
          "c4_en-validation, dolma_books-validation,") in out
  assert f"downstream tasks    26, every 10,000 steps: {', '.join(FAST_TASKS)}\n" in out
  assert "arc_challenge_test_mc_5shot_fast" in FAST_TASKS


@pytest.mark.slow(seconds=15)
def test_a_bad_task_stops_the_launch_in_one_line(tmp_path):
  """Before any step: a task in the old `task:variant` form is a config error; an unknown
  label is refused when the evaluator is built, as one line naming it, and the new workdir is
  removed again."""
  done = _main("--fdl_config=experiments.olmo3_tiny:stage1",
               "--fdl_set=eval.tasks=('nosuch:rc_0shot',)", f"--workdir={tmp_path / 'a'}",
               check=False)
  assert done.returncode != 0 and "EvalConfig.tasks=('nosuch:rc_0shot',)" in done.stderr
  done = _main("--fdl_config=experiments.olmo3_tiny:stage1",
               "--fdl_set=eval.tasks=('nosuch_rc_0shot',)", f"--workdir={tmp_path / 'b'}",
               check=False)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1].startswith(
      "error: EvalConfig.tasks: unknown task 'nosuch_rc_0shot'")
  # Found when the run starts (inside train()): the workdir this launch created is taken back.
  assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("flag, message", [
    ("--fdl_set=train.stepz=3", "TrainConfig has no field 'stepz'"),
    ("--fdl_set=train.steps=abc", "'abc' is not a Python literal"),
    ("--fdl_set=data.seq_len=100000", "data.seq_len=100000: exceeds model.max_seq_len"),
    ("--fiddler=nope", "has no fiddler 'nope'; fiddlers: flag_set, gpu, single_cosine"),
])
@pytest.mark.slow(seconds=2)
def test_bad_overrides_fail_clearly(flag, message):
  done = _main("--fdl_config=experiments.olmo3_7b:stage1", "--dry_run", flag, check=False)
  assert done.returncode != 0 and message in done.stderr


@pytest.mark.slow(seconds=4)
def test_diff_stage1_stage2_lists_exactly_the_recipe_changes():
  changes = config_changes.diff(refs.load("experiments.olmo3_7b:stage1"),
                         refs.load("experiments.olmo3_7b:stage2"))
  assert {c.path for c in changes} == {
      "data.global_batch_size", "data.mix", "data.seed", "optimizer.peak_lr",
      "optimizer.schedule", "optimizer.warmup_steps", "optimizer.final_lr",
      "optimizer.decay_steps", "train.steps", "train.stop_at_epoch", "train.loss_ranks",
      "checkpoint.init_from"}
  done = forked.completed("diff", ["experiments.olmo3_7b:stage1", "experiments.olmo3_7b:stage2",
                                   "--json"], ENV)
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout
  assert {r["path"]: (r["a"], r["b"]) for r in json.loads(out)} == {
      "checkpoint.init_from": (None, "runs/olmo3_7b.stage1"),
      "data.global_batch_size": (512, 256),
      "data.mix": ("OLMo-mix-0625-official", "OLMo-midtraining-mix-0625-100B"),
      "data.seed": (34521, 1337),
      "optimizer.decay_steps": (1413814, 47684),
      "optimizer.final_lr": (3e-05, 0.0),
      "optimizer.peak_lr": (0.0003, 0.00020712352850360292),
      "optimizer.schedule": ("stitched_cosine", "linear"),
      "optimizer.warmup_steps": (2000, 0),
      "train.loss_ranks": (512, 128),
      "train.steps": (1413814, 47684),
      "train.stop_at_epoch": (1, None)}
  # The table (flags after the positional arguments, as absl parses them).
  done = forked.completed("diff", ["experiments.olmo3_7b:stage1", "experiments.olmo3_7b:stage2"],
                          ENV)
  assert done.returncode == 0, done.stderr[-3000:]
  table = done.stdout.splitlines()
  assert table[0].split() == ["field", "experiments.olmo3_7b:stage1", "->",
                              "experiments.olmo3_7b:stage2"]
  assert len(table) == 13
  assert table[2].split() == ["data.global_batch_size", "512", "->", "256"]
  assert "optimizer.schedule" in table[8] and table[8].endswith(
      "<Schedule.STITCHED_COSINE: 'stitched_cosine'>  ->  <Schedule.LINEAR: 'linear'>")


@pytest.mark.parametrize("args, message", [
    (["experiments.olmo3_7b:stage1"], "expected two experiments or run workdirs"),
    (["experiments.olmo3_7b:stage1", "experiments.olmo3_7b:nope"],
     "has no experiment 'nope'; experiments: sft_instruct, sft_think, stage1, stage2"),
])
@pytest.mark.slow(seconds=2)
def test_diff_bad_arguments_fail_clearly(args, message):
  done = forked.completed("diff", args, ENV)
  assert done.returncode != 0 and message in done.stderr and not done.stdout


def test_set_field_checks_the_whole_path():
  cfg = refs.load("experiments.olmo3_tiny:stage1")
  refs.set_field(cfg, "train.steps", 7)
  assert cfg.train.steps == 7
  with pytest.raises(refs.ConfigRefError, match=r"^'trian.steps': trian is not a config"):
    refs.set_field(cfg, "trian.steps", 7)
  with pytest.raises(refs.ConfigRefError,
                     match=r"^'mesh.shape.data': mesh.shape is not a config"):
    refs.set_field(cfg, "mesh.shape.data", 2)
  with pytest.raises(refs.ConfigRefError, match=r"^'train.stepz': TrainConfig has no field"):
    refs.set_field(cfg, "train.stepz", 7)
  assert not hasattr(cfg.train, "stepz") and cfg.train.steps == 7


@pytest.mark.slow(seconds=2)
def test_sweep_with_a_bad_override_path_fails_naming_it(tmp_path):
  """Sweep overrides go through the same checked walker as --fdl_set: a misspelt path stops the
  sweep before any variant runs, and the error names the variant and the path. The sweep module
  sits in the working directory, which the launch scripts make importable."""
  (tmp_path / "bad_sweep.py").write_text(
      "def sweep():\n  return [{'train.steps': 2}, {'model.rematt': 'full'}]\n")
  done = forked.completed("sweep", ["--fdl_config=experiments.olmo3_tiny:stage1",
                                    "--sweep=bad_sweep:sweep", "--compile_only=local", "--out",
                                    str(tmp_path / "out")], ENV, cwd=tmp_path, timeout=300)
  assert done.returncode != 0
  assert ("variant model.rematt=full: sweep override 'model.rematt': ModelConfig has no field "
          "'rematt'") in done.stderr
  assert not (tmp_path / "out").exists()  # nothing ran


def test_sweep_ranks_by_heldout_loss_lowest_first(tmp_path):
  """--rank_by=heldout: what fits first, then the lowest held-out CE (the mean over the sets
  the loop evaluated); the default still ranks by MFU. Misuse stops before any variant runs."""
  from launch import sweep

  assert sweep.heldout_columns({"loss": 5.0, "eval/a/ce_loss": 6.0, "eval/a/ppl": 403.4}) == {
      "heldout_ce": 6.0}
  assert sweep.heldout_columns({"eval/a/ce_loss": 6.0, "eval/b/ce_loss": 5.0}) == {
      "heldout_ce": 5.5, "heldout_ce/a": 6.0, "heldout_ce/b": 5.0}
  rows = [{"variant": "fast", "fits": True, "mfu": 0.5, "heldout_ce": 6.1},
          {"variant": "crashed", "fits": False, "error": "variant process exited 1"},
          {"variant": "best", "fits": True, "mfu": 0.3, "heldout_ce": 5.9},
          {"variant": "middle", "fits": True, "mfu": 0.4, "heldout_ce": 6.0}]

  def ranked(*rank_by):
    out = tmp_path / "_".join(rank_by or ("default",))
    rankings.write_results(str(out), rows, *rank_by)
    assert (out / "results.png").exists()
    return [line.split(" | ")[1] for line in (out / "results.md").read_text().splitlines()[2:]]

  assert ranked("heldout") == ["best", "middle", "fast", "crashed"]
  assert ranked() == ranked("mfu") == ["fast", "middle", "best", "crashed"]
  # Compiled, not run: by the bound's MFU ceiling, ties (compute bounds both) by the time with
  # nothing overlapped; what does not fit last.
  rows = [{"variant": "slow_tie", "fits": True, "mfu_ceiling": 1.0, "serial_s": 1.1},
          {"variant": "memory_bound", "fits": True, "mfu_ceiling": 0.9, "serial_s": 1.2},
          {"variant": "too_big", "fits": False, "error": "ran out of device memory"},
          {"variant": "fast_tie", "fits": True, "mfu_ceiling": 1.0, "serial_s": 0.9}]
  assert ranked("mfu") == ["fast_tie", "slow_tie", "memory_bound", "too_big"]

  def run(compile_only, steps, *sets):
    return sweep.run_sweep(sweep.Sweep(
        "experiments.olmo3_tiny:stage1", "experiments.olmo3_tiny:head_shape_sweep", sets,
        compile_only, steps, str(tmp_path / "out"), rank_by="heldout"))

  with pytest.raises(refs.ConfigRefError, match="--rank_by=heldout needs --steps"):
    run("local", None)
  with pytest.raises(refs.ConfigRefError, match=r"^--steps=7 with --repeats=3: needs at "
                     r"least 8 steps \(an untimed first window"):
    run(None, 7)
  with pytest.raises(refs.ConfigRefError, match=r"eval.heldout is empty"):
    run(None, 8, "eval.heldout=()")
  assert not (tmp_path / "out").exists()


def test_sweep_times_steady_state_repeats_and_ranks_by_their_median(tmp_path):
  """The window holding the compile is never timed; the repeats after it give the median
  (ranked by) and the range; a trailing partial window is not a repeat. The chart shows the
  range as error bars."""
  from launch import sweep

  def rows(per_window):  # one row every 4 steps: tokens/s of each window, MFU in proportion
    return [{"step": 4 * (i + 1), "tokens_per_s": t, "mfu": t / 1e4, "step_time_s": 1e3 / t,
             "loss": 5.0} for i, t in enumerate(per_window)]

  # The first window (compile) is slowest; 18 steps: 4 windows of 4, then 2 steps not timed
  # (the loop's row at the last step).
  got = sweep.steady_state(rows([10.0, 200.0, 100.0, 300.0]) + [
      {"step": 18, "tokens_per_s": 1.0, "loss": 5.0}], 4, 3)
  assert (got["tokens_per_s"], got["tokens_per_s_min"], got["tokens_per_s_max"]) == (
      200.0, 100.0, 300.0)
  assert got["mfu"] == pytest.approx(0.02) and got["step_time_s_max"] == pytest.approx(10.0)
  with pytest.raises(RuntimeError, match="2 timed windows of 4 steps logged, expected 3"):
    sweep.steady_state(rows([10.0, 200.0, 100.0]), 4, 3)
  # Ranked by the median, not by a lucky repeat.
  ranked = [{"variant": "steady", "fits": True, "tokens_per_s": 200.0, "tokens_per_s_min": 190.0,
             "tokens_per_s_max": 210.0},
            {"variant": "noisy", "fits": True, "tokens_per_s": 150.0, "tokens_per_s_min": 50.0,
             "tokens_per_s_max": 400.0}]
  rankings.write_results(str(tmp_path / "out"), ranked)
  table = (tmp_path / "out" / "results.md").read_text().splitlines()
  assert [line.split(" | ")[1] for line in table[2:]] == ["steady", "noisy"]
  assert "tokens_per_s_max" in table[0] and "tokens_per_s_min" in table[0]
  assert (tmp_path / "out" / "results.png").stat().st_size > 5_000


def _losses(workdir):
  return {r["step"]: r["loss"] for r in metrics_lib.read_jsonl(workdir / "metrics.jsonl")
          if "loss" in r}


@pytest.mark.slow(seconds=65)
def test_tiny_stages_1_2_3_end_to_end(tmp_path):
  s1, s2 = tmp_path / "s1", tmp_path / "s2"
  done = _main("--fdl_config=experiments.olmo3_tiny:stage1", f"--workdir={s1}", *TINY_FAST,
               "--fdl_set=train.steps=12", "--fdl_set=train.eval_every=4",
               "--fdl_set=train.log_every=1")
  # The closing summary: what the run came to, from its workdir, and what to run next.
  summary = done.stdout.splitlines()
  assert summary[0] == f"run complete: {s1} (1 launch)", done.stdout
  assert summary[2].startswith("  held-out CE     embedded ") and "(step 12)" in summary[2]
  assert len(re.findall(r"\w+_rc_0shot (acc|len_norm)_v2 [\d.]+", done.stdout)) == 8
  assert "  alarm           quiet over 3 evaluations" in summary
  assert f"  checkpoint      {s1}/checkpoints/12" in summary
  assert (f"python launch/main.py --fdl_config=experiments.olmo3_tiny:stage2 "
          f"\"--fdl_set=checkpoint.init_from='{s1}'\"") in done.stdout
  # (Its programs went to the session's compilation cache; that a relaunch loads them, in
  # every process: tests/test_compilation_cache.py.)
  rows = metrics_lib.read_jsonl(s1 / "metrics.jsonl")
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 12 and losses[-1] < losses[0] - 1.0  # clearly falling
  assert all("train/embedded/ce_loss" in r for r in rows if "loss" in r)  # the corpus's source
  evals = [r["eval/embedded/ce_loss"] for r in rows if "eval/embedded/ce_loss" in r]
  assert len(evals) == 3 and evals[2] < evals[1] < evals[0]
  assert [r["alarm/generalization_gap"] for r in rows if "alarm/generalization_gap" in r] == [
      0, 0, 0]  # a clean run never fires the alarm
  tasks = {k.split("/")[1] for r in rows for k in r if k.startswith("downstream/")}
  assert len(tasks) == 8  # OLMo's default suite, in the loop
  assert {"lr", "grad_norm", "z_loss", "tokens_per_s", "step_time_s",
          "tflops_per_device"} <= set(rows[-1])
  from tensorboard.backend.event_processing import event_accumulator

  events = event_accumulator.EventAccumulator(str(s1 / "tensorboard"))
  events.Reload()
  assert [e.step for e in events.Scalars("loss")] == list(range(1, 13))
  assert "eval/embedded/ce_loss" in events.Tags()["scalars"]
  # The run record loads back and builds the same experiment.
  record = config_files.from_workdir(str(s1))
  cfg = refs.resolve("experiments.olmo3_tiny:stage1",
                        [a.removeprefix("--fdl_set=") for a in TINY_FAST]
                        + ["train.steps=12", "train.eval_every=4", "train.log_every=1"])
  assert fdl.build(record) == fdl.build(cfg)
  assert "--fdl_config=experiments.olmo3_tiny:stage1" in (s1 / "command.txt").read_text()
  # Stage 2 on other hardware: the dry run for a TPU slice says how the checkpoint's layout
  # changes (the restore itself on another mesh: tests/test_train.py).
  stage2 = ["--fdl_config=experiments.olmo3_tiny:stage2", f"--workdir={s2}", *TINY_FAST,
            f"--fdl_set=checkpoint.init_from='{s1}'"]
  dry = _main(*stage2, "--dry_run", "--compile_only=v5p:2x2x1").stdout
  assert ("checkpoint layout   written on one cpu device; restored onto {'fsdp': 4} of 4 TPU v5 "
          "devices in 1 process, each array resharded as it is read") in dry, dry[-2000:]
  # Stage 2 anneals from stage 1's final checkpoint.
  _main("--fdl_config=experiments.olmo3_tiny:stage2", f"--workdir={s2}", *TINY_FAST,
        f"--fdl_set=checkpoint.init_from='{s1}'", "--fdl_set=train.steps=4",
        "--fdl_set=eval.tasks=()")
  rows2 = metrics_lib.read_jsonl(s2 / "metrics.jsonl")
  assert [r["step"] for r in rows2 if "loss" in r] == [4]  # log_every 5: the last step only
  assert rows2[-1]["eval/embedded/ce_loss"] < evals[-1] + 0.5  # continues from stage 1
  assert sorted(p.name for p in (s2 / "checkpoints").iterdir()) == ["4"]
  changes = {c.path for c in config_changes.diff(config_files.from_workdir(str(s1)),
                                           config_files.from_workdir(str(s2)))}
  assert {"data.seed", "checkpoint.init_from", "optimizer.schedule"} <= changes
  # Stage 3 extends stage 2's context (here 2x, to 512 tokens): packed documents, YaRN, the
  # summary's held-out CE per band of the original context's 256 positions, and RULER (one
  # needle task at 512) on the starting checkpoint and at the stage's end.
  s3 = tmp_path / "s3"
  done = _main("--fdl_config=experiments.olmo3_tiny:stage3", f"--workdir={s3}",
               f"--fdl_set=checkpoint.init_from='{s2}'", "--fdl_set=data.seq_len=512",
               "--fdl_set=model.max_seq_len=512", "--fdl_set=train.steps=1",
               "--fdl_set=eval.tasks=()", "--fdl_set=eval.max_documents=4",
               "--fdl_set=eval.ruler.lengths=(512,)",
               "--fdl_set=eval.ruler.tasks=('niah_single_1',)")
  bands = [line for line in done.stdout.splitlines() if line.startswith("  by position")]
  assert len(bands) == 1 and re.fullmatch(
      r"  by position     embedded: 0-256 [\d.]+, 256-512 [\d.]+", bands[0]), done.stdout
  assert "packed" in done.stderr and "initialised from" in done.stderr, done.stderr[-3000:]
  assert "step 0 (the starting checkpoint) RULER: 512 " in done.stderr, done.stderr[-3000:]
  assert re.search(r"  RULER           512 [\d.]+ \(mean over its tasks, step 1\)", done.stdout)
  assert any("ruler/niah_single_1/512" in r for r in metrics_lib.read_jsonl(s3 / "metrics.jsonl"))
  # (Standalone evaluation of a checkpoint equals the in-loop numbers:
  # tests/test_reliability.py::test_two_processes_train_save_and_resume_on_another_mesh.)


@pytest.mark.slow(seconds=2)
def test_workdir_of_another_experiment_is_refused(tmp_path):
  _record(tmp_path, refs.load("experiments.olmo3_tiny:stage1"))
  done = _main("--fdl_config=experiments.olmo3_tiny:stage2", f"--workdir={tmp_path}", *TINY_FAST,
               "--fdl_set=train.steps=1", check=False)
  assert done.returncode != 0 and "holds a run of a different config" in done.stderr


@pytest.mark.slow(seconds=20)
def test_memorize_fires_the_generalization_gap_alarm(tmp_path):
  # Half-length instances, 16 of them (2 steps an epoch, as the recipe's 32 at its batch of 16)
  # at the shared batch of 8, and an evaluation every 5 steps: the alarm fired at step 20 when
  # measured (2026-12-02), inside the 30 steps.
  done = _main("--fdl_config=experiments.olmo3_tiny:memorize", f"--workdir={tmp_path}",
               *TINY_FAST, "--fdl_set=data.max_instances=16", "--fdl_set=train.eval_every=5",
               "--fdl_set=train.steps=30")
  assert "generalization gap" in done.stderr
  rows = metrics_lib.read_jsonl(tmp_path / "metrics.jsonl")
  flags = {r["step"]: r["alarm/generalization_gap"] for r in rows
           if "alarm/generalization_gap" in r}
  assert flags[5] == flags[10] == 0 and flags[30] == 1, flags


@pytest.mark.slow(seconds=2)
def test_a_non_finite_hyperparameter_stops_the_launch_in_one_line(tmp_path):
  """1e999 reads as inf: refused when the config is built, before anything is written."""
  done = _main("--fdl_config=experiments.olmo3_tiny:stage1", "--fdl_set=optimizer.peak_lr=1e999",
               f"--workdir={tmp_path / 'run'}", check=False)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-2:] == [
      "error: OptimizerConfig.peak_lr=inf: must be a finite number",
      "Run 'python launch/main.py --help' for the flags."]
  assert "Fiddle context" not in done.stderr and "Traceback" not in done.stderr
  assert not (tmp_path / "run").exists()


EVILMOD = "open({side!r}, 'w').close()\n\ndef run(cmd):\n  open({side!r}, 'w').close()\n"
# Ways past a check that reads config.json as text (the old regex) or parses it differently
# from Fiddle; building any of them would run `touch SIDE` (or import evilmod, which does).
BYPASSES = {
    "plain": lambda t: t,
    "space before the colon": lambda t: t.replace('"module": "subprocess"',
                                                  '"module" : "subprocess"'),
    "escaped key": lambda t: t.replace('"module": "subprocess"', '"\\u006dodule": "subprocess"'),
    "escaped value": lambda t: t.replace('"module": "subprocess"', '"module": "\\u0073ubprocess"'),
    "key given twice": lambda t: t.replace('"module": "subprocess"',
                                           '"module": "olmo3.config", "module": "subprocess"'),
    "evilmod in the cwd": lambda t: t.replace('"module": "subprocess"', '"module" : "evilmod"')
                                     .replace('"name": "getoutput"', '"name": "run"'),
    "private name": lambda t: t.replace('"module": "subprocess"', '"module": "olmo3.config"')
                               .replace('"name": "getoutput"', '"name": "_conform.__globals__"'),
}


def _evil_workdir(tmp_path, bypass):
  """A run record whose train.steps is fdl.Config(subprocess.getoutput, 'touch SIDE'), passed
  through `bypass`; evilmod.py (which touches SIDE when imported) beside it. Returns SIDE."""
  side = tmp_path / "side_effect"
  (tmp_path / "evilmod.py").write_text(EVILMOD.format(side=str(side)))
  cfg = refs.load("experiments.olmo3_tiny:stage1")
  cfg.train.steps = fdl.Config(subprocess.getoutput, f"touch {side}")
  dumped = config_files.dump(cfg)
  text = BYPASSES[bypass](dumped)
  assert dumped.count('"module": "subprocess"') == 1 and (text != dumped or bypass == "plain")
  (tmp_path / "wd").mkdir()
  (tmp_path / "wd" / "config.json").write_text(text)
  return side


@pytest.mark.parametrize("bypass", sorted(BYPASSES))
def test_a_config_json_naming_other_code_is_refused_before_any_import(tmp_path, monkeypatch,
                                                                     bypass):
  side = _evil_workdir(tmp_path, bypass)
  monkeypatch.syspath_prepend(str(tmp_path))  # evilmod.py would import: the worst case
  wanted = {"evilmod in the cwd": "'evilmod'", "private name": "'_conform.__globals__'"}
  with pytest.raises(refs.ConfigRefError, match=r"wd/config\.json: refers to module") as e:
    config_files.from_workdir(str(tmp_path / "wd"))
  assert wanted.get(bypass, "'subprocess'") in str(e.value)
  assert "nothing was imported" in str(e.value)
  assert not side.exists() and "evilmod" not in sys.modules


@pytest.mark.parametrize("module, name", [("olmo3.io.metrics", "os.popen"),
                                          ("olmo3.config", "model.math.exp"),
                                          ("olmo3.config", "experiment.dataclasses.replace"),
                                          ("olmo3.config", "ConfigError")])
def test_a_config_json_reaching_other_code_through_an_allowed_module_is_refused(
    tmp_path, module, name):
  """Only olmo3.config and olmo3.remat may be named, and what Fiddle imports from them must be
  a class or enum member of theirs: olmo3.config's modules import math, so `math.exp` (any
  module they import, any function) is reachable through it, a function (which building would
  call) is never a config's, and a class it imports from elsewhere (ConfigError) is not one."""
  side = _evil_workdir(tmp_path, "plain")
  path = tmp_path / "wd" / "config.json"
  path.write_text(path.read_text().replace('"module": "subprocess"', f'"module": "{module}"')
                  .replace('"name": "getoutput"', f'"name": "{name}"'))
  with pytest.raises(refs.ConfigRefError, match=(
      r"refers to module 'olmo3\.io\.metrics'.*which a config may not name"
      if module == "olmo3.io.metrics"
      else rf"refers to olmo3\.config\.{name}, which is not a class or enum member of "
      r"olmo3\.config or olmo3\.remat")):
    config_files.from_workdir(str(tmp_path / "wd"))
  assert not side.exists()


def test_a_run_record_loads_back_and_builds_the_same_experiment(tmp_path):
  cfg = refs.load("experiments.olmo3_7b:stage1")
  _record(tmp_path, cfg)
  assert fdl.build(config_files.from_workdir(str(tmp_path))) == fdl.build(cfg)
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(refs.ConfigRefError, match=r"config\.json: not JSON"):
    config_files.from_workdir(str(tmp_path))


@pytest.mark.slow(seconds=2)
def test_resuming_in_a_workdir_with_a_hostile_config_json_stops_in_one_line(tmp_path):
  """Through the launcher, run from the directory holding evilmod.py."""
  side = _evil_workdir(tmp_path, "evilmod in the cwd")
  done = forked.completed("main", ["--fdl_config=experiments.olmo3_tiny:stage1", "--workdir=wd"],
                          ENV, cwd=tmp_path, timeout=300)
  assert done.returncode == 1
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("error: wd/config.json: refers to module 'evilmod', name 'run'")
  assert not side.exists() and sorted(p.name for p in (tmp_path / "wd").iterdir()) == [
      "config.json"]


def test_the_working_directory_goes_last_on_the_import_path(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, "path", list(sys.path))
  monkeypatch.chdir(tmp_path)
  refs.make_cwd_importable()
  assert sys.path[-1] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1


def _snapshot(root):
  """Every path under `root` with its kind, bytes and modification time."""
  out = {}
  for path in sorted(root.rglob("*")):
    stat = path.stat()
    out[os.fspath(path.relative_to(root))] = (
        "dir" if path.is_dir() else path.read_bytes(), stat.st_mtime_ns)
  return out


@pytest.mark.slow(seconds=12)
def test_a_finished_run_rerun_changes_nothing_and_a_resumed_change_is_a_new_revision(
    straight, tmp_path_factory, tmp_path):
  """Rerunning a finished run (here with a shorter train.steps) trains nothing and leaves the
  workdir byte-identical, mtimes included; a resume with a resumable change appends revision 1
  (config.1.json, experiment.1.json, a history line) without touching revision 0, and diff
  and eval read each checkpoint's own revision."""
  from tests import test_reliability as reliability
  from olmo3.eval.__main__ import load_experiment

  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent  # where the `straight` fixture trained its run (9 steps)
  workdir = tmp_path / "run"
  shutil.copytree(shared / "straight", workdir, ignore=shutil.ignore_patterns("lease.json"))
  args = [*reliability.TINY, f"--workdir={workdir}", "--fdl_set=checkpoint.every=100"]

  def launch(*extra):
    return forked.completed("main", [*args, *extra], reliability._env(1))

  before = _snapshot(workdir)
  # An override on the finished run (the rerun of its own command takes the same path: the
  # newest verified checkpoint already reaches the end, so nothing is opened for writing).
  done = launch("--fdl_set=train.steps=5")
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip().splitlines()[-1] == (
      f"{workdir}: the run is complete at step 9 (train.steps=5); nothing to train, nothing "
      "written")
  assert f"run complete: {workdir}" in done.stdout  # its closing summary, again
  assert f"run complete: {workdir}" in launch("--dry_run", "--fdl_set=train.steps=9").stdout
  assert _snapshot(workdir) == before
  done = launch("--fdl_set=train.steps=10")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "extending the run from 9 to 10 steps" in done.stderr  # raised steps: announced
  history = record.read_history(workdir)
  assert [(h.launch, h.revision, h.start_step, h.config, h.experiment) for h in history] == [
      (1, 0, 0, "config.json", "experiment.json"),
      (2, 1, 9, "config.1.json", "experiment.1.json")]
  assert "--fdl_set=train.steps=10" in history[1].command
  after = _snapshot(workdir)
  for name in ("config.json", "config.txt", "command.txt", "experiment.json"):
    assert after[name] == before[name], f"{name} of revision 0 was rewritten"
  # diff: a workdir means its newest checkpoint's revision; WORKDIR@STEP a given one.
  assert [(c.path, c.a, c.b) for c in config_changes.diff(config_files.load_any(f"{workdir}@9"),
                                                   config_files.load_any(f"{workdir}@10"))] == [
      ("train.steps", 9, 10)]
  assert fdl.build(config_files.load_any(str(workdir))).train.steps == 10
  # eval: each checkpoint with the experiment that wrote it.
  assert load_experiment(str(workdir), 9).train.steps == 9
  assert load_experiment(str(workdir), 10).train.steps == 10


def test_readme_first_command_installs_what_later_commands_use():
  """The README's first command (`pip install -e .`, no extras) brings every program its later
  commands call: TensorBoard is a main dependency, pinned, and installs the `tensorboard`
  command."""
  import importlib.metadata
  import re
  import tomllib

  readme = open(os.path.join(ROOT, "README.md")).read()
  first = re.search(r"```bash\n(.*?)```", readme, re.DOTALL).group(1)
  assert "pip install -q -e . &&" in first
  assert "tensorboard --logdir runs" in readme
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    main_deps = tomllib.load(f)["project"]["dependencies"]
  pins = [d for d in main_deps if d.startswith("tensorboard==")]
  assert pins == [f"tensorboard=={importlib.metadata.version('tensorboard')}"]
  scripts = importlib.metadata.distribution("tensorboard").entry_points.select(
      group="console_scripts")
  assert "tensorboard" in scripts.names


# Two processes of a job, started with the launcher's own start_jax, train a step together (a
# collective); then process 1 fails (an `error:` line) while process 0 waits for it in the next.
_FAILING_JOB = """
import sys
from absl import flags
from launch import main as launcher
flags.FLAGS(["launch/main.py"])
launcher.start_jax()
import jax
from jax.experimental import multihost_utils
with launcher.leaving_at_once_on_failure():
  multihost_utils.sync_global_devices("a step together")
  if jax.process_index() == 1:
    sys.exit("error: process 1 failed")
  multihost_utils.sync_global_devices("process 1 never comes")
"""


def _two_process_job(script: str, *args: str, cache) -> tuple[list, list, float]:
  """`script` run as a job of 2 processes of 1 CPU device each (the heartbeat timeout 5 s):
  the processes, their (stdout, stderr) and the seconds until both ended (at most 120)."""
  import socket
  import time

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = []
  started = time.monotonic()
  for rank in range(2):
    env = dict(ENV, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(rank), JAX_PLATFORMS="cpu", OLMO3_HEARTBEAT_TIMEOUT_S="5",
               XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_COMPILATION_CACHE_DIR=os.fspath(cache))
    procs.append(subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  try:
    outs = [p.communicate(timeout=120) for p in procs]
  finally:
    for p in procs:
      p.kill()
  return procs, outs, time.monotonic() - started


@pytest.mark.slow(seconds=20)
def test_a_failing_process_ends_the_whole_job_at_once(tmp_path):
  """A process whose launch fails exits once it has said why, instead of waiting at exit for
  the others at jax.distributed's shutdown barrier (300 s) while they wait for it in a
  collective: process 0 stops within the heartbeat timeout (OLMO3_HEARTBEAT_TIMEOUT_S)."""
  procs, outs, took = _two_process_job(_FAILING_JOB, cache=tmp_path / "cache")
  assert procs[1].returncode == 1, outs[1][1][-3000:]
  assert outs[1][1].strip().splitlines()[-1] == "error: process 1 failed"
  assert procs[0].returncode != 0, outs[0][1][-3000:]
  assert took < 90, (took, outs[0][1][-3000:])  # 300 s and more when process 1 waited


# Two processes save one checkpoint of a 2-device array; process 1's part of the save fails (its
# store refuses its array metadata, a write of Orbax's background commit); both then check the
# save at every "step", as the train loop does.
_SAVE_FAILS_IN_ONE_PROCESS = """
import sys
import time
import numpy as np
from absl import flags
from launch import main as launcher
flags.FLAGS(["launch/main.py"])
launcher.start_jax()
import jax
from orbax.checkpoint._src.metadata import array_metadata_store
from olmo3 import program
from olmo3.io.checkpoint import CheckpointError
from olmo3.train.run_checkpoints import RunCheckpoints

# Process 1's commit threads wait at a barrier process 0 never reaches: its exit need not wait
# the launcher's 10 s for them (tests/test_one_line_errors.py tests that grace).
program.EXIT_GRACE_S = 2.0
if jax.process_index() == 1:
  async def refused(*args, **kwargs):
    raise PermissionError("the store refused process 1's write")
  array_metadata_store.Store.write = refused

def main():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  x = jax.make_array_from_callback((8,), sharding, lambda i: np.arange(8.0, dtype=np.float32)[i])
  with launcher.leaving_at_once_on_failure():
    checkpoints = RunCheckpoints(sys.argv[1], keep=3, async_save=True)
    checkpoints.save(1, {"w": x}, {"m": x}, {"step": 1})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
      checkpoints.check()
      time.sleep(0.1)

program.reported(main, lambda: (CheckpointError,))()
"""


@pytest.mark.slow(seconds=10, waits=True)
def test_a_save_that_fails_in_one_process_ends_the_whole_job_at_once(tmp_path):
  """The process whose part of a save failed stops at its next check, with the save's error;
  the others stop within the heartbeat timeout. (Orbax's background commit of the failed part
  skips the barrier where the others wait, and its own finalize waits at another one: every
  process waited there for Orbax's async timeout, 20 minutes, before the job stopped.)"""
  procs, outs, took = _two_process_job(
      _SAVE_FAILS_IN_ONE_PROCESS, os.fspath(tmp_path / "checkpoints"), cache=tmp_path / "cache")
  assert procs[1].returncode == 1, outs[1][1][-3000:]
  last = outs[1][1].strip().splitlines()[-1]
  assert last.startswith("error: saving checkpoint step 1 to ") and (
      "the store refused process 1's write" in last), outs[1][1][-6000:]
  assert procs[0].returncode != 0, outs[0][1][-3000:]
  assert took < 90, (took, outs[0][1][-3000:])
  assert not (tmp_path / "checkpoints" / "1").exists()  # never committed (renamed into place)


def test_a_dry_run_on_a_multislice_topology_shows_the_experiment_s_dcn_axes(tmp_path):
  """`--compile_only=KIND:AxBxC*SLICES --dry_run` builds the mesh the run would train on: the
  experiment's DCN axes (here fsdp across the 2 slices), not the default (slices as data)."""
  from olmo3.train import dry_run
  from olmo3.train import aot

  cfg = refs.resolve("experiments.olmo3_tiny:stage1",
                     ["mesh.shape=(('fsdp', 4),)", "mesh.dcn=(('fsdp', 2),)"])
  lines = list(dry_run.lines(fdl.build(cfg), os.fspath(tmp_path / "run"), "tiny",
                             topology="v5p:2x2x1*2", topology_devices=aot.topology_devices))
  mesh = [line for line in lines if line.startswith("mesh ")]
  assert mesh == ["mesh                {'fsdp': 4} x DCN {'fsdp': 2} -> {'data': 1, 'fsdp': 8, "
                  "'sequence': 1, 'tensor': 1} on 8 TPU v5 devices (v5p:2x2x1*2)"], mesh


@pytest.mark.slow(seconds=8)
def test_ctrl_c_and_sigterm_stop_a_7b_compile_only_at_once_in_one_line(tmp_path):
  """A compile-only launch writes nothing, so a signal ends it there and then: the 7B's compile
  takes minutes, during which Python's handlers never ran (two Ctrl-Cs over 150 s did
  nothing), and libtpu's own SIGTERM handler printed a C++ stack dump."""
  import signal
  import time

  for sig in (signal.SIGINT, signal.SIGTERM):
    run = forked.background("tests.launch_stand_ins", [
        "compiling", "--fdl_config=experiments.olmo3_7b:stage1", "--compile_only=tpu7x:4x8x8"],
        ENV)
    try:
      run.wait_for("XLA is compiling")
      time.sleep(1.0)  # well inside the compiler's call (minutes for the 7B)
      run.proc.send_signal(sig)
      assert run.finish(seconds=30) == 128 + sig
    finally:
      run.kill()
    name = signal.Signals(sig).name
    assert run.lines[-1] == (f"interrupted ({name}) while compiling the train step for "
                             "tpu7x:4x8x8; nothing was written"), run.log()
    assert not any("*** SIG" in line or "@ 0x" in line for line in run.lines), run.log()
