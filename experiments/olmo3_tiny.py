"""The OLMo 3 recipe shrunk to a laptop CPU: the embedded default. No download.

  python launch/main.py --fdl_config=experiments.olmo3_tiny:stage1   # ≈ 3 minutes on 2 cores
  python launch/main.py --fdl_config=experiments.olmo3_tiny:stage2   # anneals from stage 1

Data: the embedded corpus (this Python's standard library and its documentation topics,
tokenised with an 8k BPE trained locally on first use); held-out loss on documents never
trained on. Same optimizer, clipping, z-loss and schedule shapes as the 7B (olmo3_7b.py),
with a learning rate and step counts for a 2.9M-parameter model.
"""

from __future__ import annotations

import fiddle as fdl

from experiments.common import as_config
from olmo3.config import (CheckpointConfig, DataConfig, EvalConfig, Experiment, MeshConfig,
                          OptimizerConfig, Schedule, TrainConfig, olmo3_tiny)

STAGE1_STEPS = 100
STAGE2_STEPS = 40
# OLMo's default in-loop suite, zero-shot (short contexts for a 256-token model), 20 documents.
TASKS = tuple(f"{t}:rc_0shot" for t in ("arc_easy", "arc_challenge", "boolq", "csqa", "hellaswag",
                                        "openbookqa", "piqa", "winogrande"))


def stage1() -> fdl.Config[Experiment]:
  """Stage 1: 16 x 256 tokens per step, 100 steps, peak LR 3e-3 (a small model takes a larger
  one), 10 warmup steps, cosine to 3e-4."""
  return as_config(Experiment(
      model=olmo3_tiny(),
      data=DataConfig(mix="embedded", seq_len=256, global_batch_size=16, seed=34521),
      mesh=MeshConfig(shape=(("data", 1), ("fsdp", -1), ("sequence", 1), ("tensor", 1))),
      optimizer=OptimizerConfig(peak_lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                no_decay=("embed_tokens",), clip_grad_norm=1.0,
                                schedule=Schedule.COSINE, warmup_steps=10, final_lr=3e-4,
                                decay_steps=STAGE1_STEPS),
      train=TrainConfig(steps=STAGE1_STEPS, seed=0, z_loss_weight=1e-5, log_every=5,
                        eval_every=25),
      checkpoint=CheckpointConfig(every=50, keep=2, async_save=True, init_from=None),
      eval=EvalConfig(heldout=(("embedded", "embedded-heldout"),), batch_size=16,
                      max_documents=32, tasks=TASKS, task_limit=20, tokenizer="embedded",
                      alarm_window=2, alarm_margin=0.05),
  ))


def stage2() -> fdl.Config[Experiment]:
  """Stage 2: stage 1 with half the batch, seed 1337, LR linear from 2/3 of stage 1's peak to
  0 without warmup, initialised from stage 1's final checkpoint (parameters and moments)."""
  cfg = stage1()
  cfg.data.seed = 1337
  cfg.data.global_batch_size = 8
  cfg.optimizer.peak_lr = 2e-3
  cfg.optimizer.schedule = Schedule.LINEAR
  cfg.optimizer.warmup_steps = 0
  cfg.optimizer.final_lr = 0.0
  cfg.optimizer.decay_steps = STAGE2_STEPS
  cfg.train.steps = STAGE2_STEPS
  cfg.checkpoint.init_from = "runs/olmo3_tiny.stage1"
  return cfg


def memorize() -> fdl.Config[Experiment]:
  """Stage 1 on a deliberately tiny slice (32 instances, 2 steps per epoch) repeated for 50
  epochs: train loss collapses while held-out loss stalls and rises, and the
  generalization-gap alarm must fire. Evaluates every 10 steps, held-out loss only."""
  cfg = stage1()
  cfg.data.max_instances = 32
  cfg.train.eval_every = 10
  cfg.eval.tasks = ()
  return cfg


def mfu_sweep() -> list[dict[str, object]]:
  """A CPU-sized sweep (12 variants): remat policy x batch x attention kernel. Run:
  python launch/sweep.py --fdl_config=experiments.olmo3_tiny:stage1
  --sweep=experiments.olmo3_tiny:mfu_sweep --compile_only=local --out sweeps/tiny"""
  return [{"model.remat": remat, "data.global_batch_size": batch, "model.attention": kernel}
          for remat in ("none", "full", "minimal")
          for batch in (8, 16)
          for kernel in ("xla", "dot_product")]
