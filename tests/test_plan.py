"""RunPlan (olmo3.run.plan): a launch's facts worked out once. The mix files and manifests are
read once per launch (counted in a real launch), the start is decided from the workdir's
committed checkpoints, and the stage's end from train.steps and the epoch."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from olmo3.io.checkpoint import CheckpointError
from olmo3.run.plan import RunPlan, Start, decide_start, stage_end
from olmo3.run.record import Workdir, read_history
from tests.test_launch import TINY_FAST

from train_helpers import micro_experiment, write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The launcher's main in this process, with olmo3.data.sources' two readers counted: `prepared`
# (a prepared directory's manifest) and `_listed` (a mix's files), by the mix they read.
_DRIVER = """
import atexit, collections, json, sys
from olmo3.data import sources
counts = collections.Counter()
for name in ("prepared", "_listed"):
  def counted(mix, *args, _real=getattr(sources, name), _name=name, **kwargs):
    counts[f"{_name} {mix}"] += 1
    return _real(mix, *args, **kwargs)
  setattr(sources, name, counted)
atexit.register(lambda: print("COUNTS " + json.dumps(counts)))
from absl import app
from launch import main
sys.argv = ["launch/main.py", *sys.argv[1:]]
app.run(main.main)
"""


@pytest.mark.slow(seconds=25)
def test_each_mix_is_read_once_per_launch(tmp_path):
  """A tiny launch that trains, evaluates its held-out split and checkpoints: the training mix
  and the held-out mix are each listed once, and no manifest is read twice for one mix."""
  done = subprocess.run(
      [sys.executable, "-c", _DRIVER, "--fdl_config=experiments.olmo3_tiny:stage1",
       f"--workdir={tmp_path / 'run'}", "--fdl_set=train.steps=2",
       "--fdl_set=train.eval_every=2", "--fdl_set=eval.tasks=()",
       *TINY_FAST],  # test_launch's tiny shapes: the session's compilation cache serves both
      capture_output=True, text=True, cwd=ROOT, timeout=600,
      env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})  # 1 device, as launches
  assert done.returncode == 0, done.stderr[-3000:]
  counts = json.loads(done.stdout.split("COUNTS ")[-1])
  assert counts == {"prepared embedded": 1, "prepared embedded-heldout": 1,
                    "_listed embedded": 1, "_listed embedded-heldout": 1}
  assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])[
      "eval/embedded/ce_loss"] > 0  # the held-out set was evaluated
  plan = read_history(tmp_path / "run")[0].plan  # the record keeps what the launch worked out
  assert (plan["start"], plan["step"], plan["end"], plan["files"]) == ("fresh", 0, 2, 1)
  assert plan["heldout"]["embedded"] > 0 and plan["instances"] > 0


def test_the_start_follows_the_committed_checkpoints(tmp_path):
  workdir = Workdir(str(tmp_path / "run"))
  assert decide_start(workdir, None, end=10).start is Start.FRESH
  with pytest.raises(CheckpointError, match="no checkpoint"):
    decide_start(workdir, str(tmp_path / "nothing"), end=10)
  (workdir.checkpoints / "4").mkdir(parents=True)
  (workdir.checkpoints / "8.damaged-1").mkdir()  # set aside: not a step
  resume = decide_start(workdir, str(tmp_path / "nothing"), end=10)  # its own checkpoint wins
  assert (resume.start, resume.step) == (Start.RESUME, 4)
  (workdir.checkpoints / "10").mkdir()
  resume = decide_start(workdir, None, end=10)
  assert (resume.start, resume.step) == (Start.COMPLETE, 10)


def test_a_plan_sizes_the_files_and_ends_at_the_epoch_it_is_told(tmp_path):
  exp = micro_experiment(write_corpus(tmp_path), steps=1000, every=1000)
  plan = RunPlan.build(exp, str(tmp_path / "run"))
  assert plan.resume.start is Start.FRESH and plan.end == 1000
  assert plan.identity["files"] == [[exp.data.paths[0], int(plan.train_files.file_tokens[0])]]
  once = dataclasses.replace(exp, train=dataclasses.replace(exp.train, stop_at_epoch=1))
  assert RunPlan.build(once, str(tmp_path / "run")).end == plan.steps_per_epoch
  assert stage_end(once, 7) == 7 and stage_end(exp, 7) == 1000
  assert not (tmp_path / "run").exists()  # building a plan writes nothing


def test_a_schedule_over_the_stage_s_epochs_is_worked_out_as_olmo_core_does(tmp_path):
  """AI2's SFT: LinearWithWarmup(warmup_fraction=0.03) over a 2-epoch duration. decay_steps None
  is 2 x the steps per epoch; the warmup round(0.03 x that), Python's rounding as OLMo-core's
  (half to even); a limited run (train.steps) keeps that schedule. OLMo-core's own scheduler
  gives the same learning rates."""
  from olmo_core.optim.scheduler import LinearWithWarmup

  from olmo3.config import OptimizerConfig, Schedule
  from olmo3.train import optim

  exp = micro_experiment(write_corpus(tmp_path), steps=1000, every=1000)
  exp = dataclasses.replace(
      exp, optimizer=OptimizerConfig(peak_lr=5e-5, schedule=Schedule.LINEAR, warmup_steps=0,
                                     warmup_fraction=0.03, final_lr=0.0, decay_steps=None),
      train=dataclasses.replace(exp.train, stop_at_epoch=2, steps=10))
  plan = RunPlan.build(exp, str(tmp_path / "run"))
  length = 2 * plan.steps_per_epoch
  assert plan.exp.optimizer.decay_steps == length and plan.end == 10
  assert plan.exp.optimizer.warmup_steps == round(0.03 * length) > 0
  theirs = LinearWithWarmup(warmup_fraction=0.03, alpha_f=0.0)
  for update in (1, 2, plan.exp.optimizer.warmup_steps, length // 2, length - 1, length):
    # OLMo-core advances its step before the update (olmo3.train.optim.learning_rate)
    assert float(optim.learning_rate(plan.exp.optimizer, update)) == pytest.approx(
        float(theirs.get_lr(5e-5, update, length)), rel=1e-6, abs=1e-12)
  with pytest.raises(ValueError, match="optimizer.decay_steps.*needs train.stop_at_epoch"):
    dataclasses.replace(exp, train=dataclasses.replace(exp.train, stop_at_epoch=None))


def _history(workdir, *launches):
  """history.jsonl of launches (start_step, the stage end its plan set)."""
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "history.jsonl").write_text("".join(json.dumps(
      {"launch": n, "revision": 0, "start_step": start, "config": "config.json",
       "experiment": "experiment.json", "command": [], "time": "", "plan": {"end": end}})
      + "\n" for n, (start, end) in enumerate(launches, start=1)))


def test_init_from_a_run_means_the_checkpoint_at_the_end_of_its_stage(tmp_path):
  from olmo3.run.plan import InitFromError, init_from_step

  run = tmp_path / "s1"
  for step in (50, 100, 110):
    (run / "checkpoints" / str(step)).mkdir(parents=True)
  # Launch 1 trained to its end (100); launch 2, raised to 120, stopped at 110.
  _history(run, (0, 100), (100, 120))
  assert init_from_step(str(run)) == str(run / "checkpoints" / "100")
  assert init_from_step(str(run / "checkpoints")) == str(run / "checkpoints" / "100")
  (run / "checkpoints" / "110" / "params").mkdir()  # a step directory names itself
  assert init_from_step(str(run / "checkpoints" / "110")) == str(run / "checkpoints" / "110")
  (run / "checkpoints" / "120").mkdir()  # the extension finished: its end is the stage's
  assert init_from_step(str(run)) == str(run / "checkpoints" / "120")
  # A run that never reached its end: refused, naming the step to give instead.
  unfinished = tmp_path / "half"
  (unfinished / "checkpoints" / "40").mkdir(parents=True)
  _history(unfinished, (0, 100))
  with pytest.raises(InitFromError, match=r"has not reached the end of its stage \(step 100; "
                                          r"its newest checkpoint is step 40\).*checkpoints/40"):
    init_from_step(str(unfinished))
  # No history (trained without the launcher): its newest checkpoint.
  bare = tmp_path / "bare"
  (bare / "checkpoints" / "7").mkdir(parents=True)
  assert init_from_step(str(bare)) == str(bare / "checkpoints" / "7")


def test_raising_train_steps_on_a_finished_run_is_announced(tmp_path):
  from olmo3.run.plan import Resume, stage_change

  workdir = Workdir(str(tmp_path))
  _history(tmp_path, (0, 100))
  assert stage_change(workdir, Resume(Start.RESUME, 100), 120) == (
      "extending the run from 100 to 120 steps (it was complete at step 100; the stage's end "
      "is now step 120)")
  assert stage_change(workdir, Resume(Start.RESUME, 60), 120) == (
      "the stage now ends at step 120, not 100 as the last launch set it")
  assert stage_change(workdir, Resume(Start.RESUME, 60), 100) is None  # unchanged
  assert stage_change(workdir, Resume(Start.COMPLETE, 100), 100) is None
