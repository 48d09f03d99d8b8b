"""A run restarted mid-way, by OLMo-core and by olmo3 with each spike_window_on_restart.

  python benchmarks/restart_olmo_core.py [--restart_at 5] [--steps 13] [--spike_at 9]

OLMo-core's own Trainer (harness/continue_olmo_core.py's: TransformerTrainModule with
SkipStepAdamW and a 16-step window, CosWithWarmup, its data loader and Checkpointer) trains
olmo3_micro --steps steps without stopping, saving step 0 and step --restart_at. A second
Trainer restarts from step --restart_at as a relaunched job does (a new process: a new train
module and optimizer; `load_trainer_state=True`) and trains to --steps.

olmo3's side is its loop (olmo3.train.loop.train), launched as the launcher launches it: first
continuing OLMo-core's step 0 (init_mode=continue: the same initial weights) to step
--restart_at, where it saves; then launched again on that workdir to --steps, which resumes
from its own checkpoint (restore_or_init), once with `optimizer.spike_window_on_restart=empty`
and once, in a copy of the workdir, with `keep`.

SkipStepAdamW keeps its window (the CE losses and gradient norms of the last
`rolling_interval_length` steps) in lists on the optimizer object, which no state dict holds:
a restarted run starts them empty and skips nothing until half the window has been seen
again. The token files hold one odd batch (a single token repeated: a gradient-norm spike) at
step --spike_at, after the rule's 8 values of history but fewer than 8 steps after the
restart: the uninterrupted run skips it, the restarted one trains on it. (An epoch is 13
steps: in a longer run the odd instances come back in other batches.)

Prints each step's CE loss and skip decision of the four runs, then one JSON object: for
`keep` (against OLMo-core uninterrupted) and `empty` (against OLMo-core restarted) the
continue_olmo_core comparison (max |CE loss diff|, relative grad norm, |LR|, skip decisions)
and max_abs_param_diff, the largest difference of the final parameters; how far OLMo-core's
restart moved its final parameters from the uninterrupted run's; each run's skipped steps;
`ok` says all are within tolerance (continue_olmo_core's; parameters 1e-6 a step); exits 1
when not. The loop logs no instance ids: equal losses show the same batches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from typing import Any

import numpy as np

# Its data, OLMo-core Trainer and olmo3 experiment.
from harness import continue_olmo_core as c

# The parameters' float32 drift between the two trainers grows with the run: Adam's normalised
# update turns rounding into ~lr-sized steps where a gradient is near zero. Measured: 3.6e-6
# after 10, 13 and 50 steps, 1.9e-5 after 50 with the odd batch in each 13-step epoch. The odd
# batch, trained on or skipped, moves them by 2e-4 after 10 steps, 1e-3 after 13
# (`restart_moves_params_by`).
MAX_ABS_PARAM_DIFF_PER_STEP = 1e-6


def olmo_core_runs(model_cfg, paths: list[str], root: str, restart_at: int, steps: int
                   ) -> tuple[str, dict[str, tuple[list[dict], dict]]]:
  """(OLMo-core's step-0 checkpoint, {"uninterrupted" / "restarted": (rows, parameters)}):
  the restarted run's rows are the uninterrupted run's up to `restart_at`, then its own."""
  from olmo_core.optim import CosWithWarmup
  from olmo_core.train.common import LoadStrategy

  cosine = CosWithWarmup(warmup=4, alpha_f=0.1)
  common = dict(max_steps=steps, scheduler=cosine, lr=c.PEAK_LR)
  first, record = c.olmo_core_trainer(model_cfg, paths, c.STAGE1, os.path.join(root, "oc-run"),
                                      save_every=restart_at, **common)
  first.fit()
  uninterrupted = [record.rows[s] for s in sorted(record.rows)]
  restarted, record = c.olmo_core_trainer(
      model_cfg, paths, c.STAGE1, os.path.join(root, "oc-restarted"),
      load_path=os.path.join(first.save_folder, f"step{restart_at}"),
      load_strategy=LoadStrategy.always, load_trainer_state=True, load_optim_state=True,
      **common)
  restarted.fit()
  after = [record.rows[s] for s in sorted(record.rows)]
  params = lambda trainer: {k: v.detach().numpy() for k, v in
                            trainer.train_module.model.state_dict().items()}
  return os.path.join(first.save_folder, "step0"), {
      "uninterrupted": (uninterrupted, params(first)),
      "restarted": (uninterrupted[:restart_at] + after, params(restarted))}


def _launch(exp, workdir: str) -> None:
  """The loop, as the launcher runs it, on one CPU device (OLMo-core's side is one process)."""
  import jax

  from olmo3.placement import ShardedModel
  from olmo3.run.plan import RunPlan
  from olmo3.train.loop import train

  train(RunPlan.build(exp, workdir), model=ShardedModel.for_experiment(exp, jax.devices()[:1]))


def _finished(exp, workdir: str) -> tuple[list[dict], dict]:
  """(the run's logged rows, its final parameters in OLMo-core's names)."""
  import jax

  from olmo3.convert import olmo_core_params
  from olmo3.io import metrics
  from olmo3.placement import ShardedModel
  from olmo3.run.record import Workdir
  from olmo3.train.state import StateLayout

  run = Workdir(workdir)
  rows = [r for r in metrics.read_jsonl(run.metrics) if "loss" in r]
  model = ShardedModel.for_experiment(exp, jax.devices()[:1])
  with model.context():
    params, _, _ = StateLayout(exp, model).restore(run.checkpoints / str(exp.train.steps))
  return rows, {k: v.numpy() for k, v in olmo_core_params.state_dict(exp.model, params).items()}


def olmo3_runs(model_cfg, paths: list[str], step0: str, root: str, restart_at: int,
               steps: int) -> dict[str, tuple[list[dict], dict]]:
  """{"keep" / "empty": (rows, parameters)} of olmo3 restarted at `restart_at`."""
  from olmo3.config import SpikeWindowOnRestart

  exp = c.olmo3_experiment(model_cfg, paths, c.STAGE1, init_from=step0, mode="continue",
                           steps=restart_at, schedule="cosine", lr=c.PEAK_LR, decay_steps=steps)
  exp = dataclasses.replace(exp, checkpoint=dataclasses.replace(exp.checkpoint, every=restart_at))
  first = os.path.join(root, "olmo3-empty")
  _launch(exp, first)
  shutil.copytree(first, os.path.join(root, "olmo3-keep"),
                  ignore=shutil.ignore_patterns("lease.json"))
  runs = {}
  for mode in SpikeWindowOnRestart:
    relaunched = dataclasses.replace(
        exp, train=dataclasses.replace(exp.train, steps=steps),
        optimizer=dataclasses.replace(exp.optimizer, spike_window_on_restart=mode))
    workdir = os.path.join(root, f"olmo3-{mode.value}")
    _launch(relaunched, workdir)
    runs[mode.value] = _finished(relaunched, workdir)
  return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # float32 on the CPU on both sides
  from olmo3 import program

  parser = program.parser("python benchmarks/restart_olmo_core.py", __doc__)
  parser.add_argument("--restart_at", type=int, default=5, help="the step both restart from")
  parser.add_argument("--steps", type=int, default=13)
  parser.add_argument("--spike_at", type=int, default=9,
                      help="the step with the odd batch (0: none)")
  parser.add_argument("--workdir", help="keep everything here (default: a temporary directory)")
  args = parser.parse_args(argv)
  from olmo3 import config

  model_cfg = config.olmo3_micro()
  with tempfile.TemporaryDirectory(prefix="restart-olmo-core-") as tmp:
    root = args.workdir or tmp
    paths = c.write_tokens(os.path.join(root, "tokens"), c.STAGE1,
                           args.spike_at - 1 if args.spike_at else None, model_cfg.vocab_size)
    step0, theirs = olmo_core_runs(model_cfg, paths, root, args.restart_at, args.steps)
    ours = olmo3_runs(model_cfg, paths, step0, root, args.restart_at, args.steps)
  pairs = {"keep": "uninterrupted", "empty": "restarted"}
  runs = {**{f"olmo3 {k}": v for k, v in ours.items()},
          **{f"OLMo-core {k}": v for k, v in theirs.items()}}
  print(f"{'step':>4}" + "".join(f"  {name:>22}" for name in runs))
  for i in range(args.steps):
    print(f"{i + 1:>4}" + "".join(f"  {rows[i]['ce_loss']:>20.7f} {int(rows[i]['skipped'])}"
                                  for rows, _ in runs.values()))
  result: dict[str, Any] = {}
  for mode, reference in pairs.items():
    (rows, params), (their_rows, their_params) = ours[mode], theirs[reference]
    result[mode] = {"against": f"OLMo-core {reference}",
                    **c.compare(rows, their_rows, instances=False),
                    "max_abs_param_diff": max(float(np.abs(params[k] - their_params[k]).max())
                                              for k in their_params)}
  restarted = theirs["restarted"][1]
  result["restart_moves_params_by"] = max(
      float(np.abs(v - restarted[k]).max()) for k, v in theirs["uninterrupted"][1].items())
  result["skipped_steps"] = {name: [i + 1 for i, r in enumerate(rows) if r["skipped"]]
                             for name, (rows, _) in runs.items()}
  bounds = {**c.TOLERANCES, "max_abs_param_diff": MAX_ABS_PARAM_DIFF_PER_STEP * args.steps}
  result["ok"] = all(result[mode]["skip_decisions_equal"] and
                     result[mode]["steps"] == result[mode]["steps_olmo_core"] and
                     all(result[mode][k] <= v for k, v in bounds.items()) for mode in pairs)
  print(json.dumps(result))
  return result
