"""Training-step parity with AI2's trainer code: the same small OLMo 3, trained side by side.

  python benchmarks/train_parity_olmo_core.py [--steps 100] [--batch 4] [--seq_len 64]
      [--peak_lr 1e-3] [--dtype float32|float64] [--spike_window 128] [--spike_step 90]

Both sides start from the same weights (ours, freshly initialised in float32, moved into OLMo-core's
OLMo 3 transformer by olmo3.convert.olmo_core_params) and see the same batches, on CPU. The model: 6
layers (sliding, sliding, sliding, global, sliding, global), grouped-query attention. The optimizer
as AI2's first stage-1 script (OLMo-3-1025-7B-pretrain-1.py) configures it, shrunk to the run:
SkipStepAdamW (0.9, 0.95, eps 1e-8, weight decay 0.1 except the input embedding, the recipe's
128-step window), clipping at 1.0, z-loss 1e-5, a warmup and AI2's stitched schedule (part 1
CosWithWarmup, part 2 HalfCosWithWarmup from its resume step on), each step's batch in 2
micro-batches. One odd batch (a first row of one token repeated, at --spike_step, after the rule's
64 steps of history) trips the skip rule with a gradient-norm spike.

OLMo-core side: its own `TransformerTrainModule` (built from `TransformerTrainModuleConfig`,
as the script builds it), stepped as its `Trainer` steps it: the global step advances, then
`train_batch`, `optim_step`, `zero_grads`. No process group is needed: in a single process
that is not distributed the module wraps nothing (no DDP/FSDP mesh) and reduces nothing.
The `_Trainer` below is the part of OLMo-core's `Trainer` the module reads (its step, the
schedule's length, the batch size, the metric records). Ours: olmo3.train.step.jit_train_step.

--dtype float64 runs both sides in float64 (JAX x64; OLMo-core's model and optimizer state in
float64), to see differences that float32 rounding hides. OLMo-core does not run wholly in
float64 by itself, and four of its float32 casts are taken out there: its RMSNorms and RoPE
are built with `full_precision=False` (full precision means "cast to float32"), its loss
function (`cross_entropy_loss` casts the logits to float32) is called on float64 logits by an
equal function without the cast, its RoPE frequencies (float32 whatever the model's dtype) are
computed in float64, and SkipStepAdamW's step counts (float32 tensors whatever the parameters'
dtype) start in float64 (`_float64_state` says why). What stays float32 is what olmo3 rounds
alike (olmo3.train.optim): the products of SkipStepAdamW's float32 step factor (the moments'
weights, the weight-decay factor) and its skip window's losses. The module records its CE loss
in a float32 accumulator, so the losses compared are the model's own float64 outputs, summed
over the micro-batches.

Prints per-step loss, grad norm, LR and skip decision from both, then one JSON object:
max_abs_loss_diff, max_rel_grad_norm_diff, max_abs_lr_diff, skip_decisions_equal, within
(the dtype's tolerances); exits 1 when a tolerance is exceeded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

SCHEDULE_STEPS = 100  # the schedule is laid out for this many updates whatever --steps
# Largest differences allowed, per dtype: |loss|, relative grad norm, |LR|.
TOLERANCES = {"float32": {"max_abs_loss_diff": 1e-5, "max_rel_grad_norm_diff": 1e-4,
                          "max_abs_lr_diff": 1e-9},  # float32 rounding of LRs near 1e-3
              "float64": {"max_abs_loss_diff": 1e-9, "max_rel_grad_norm_diff": 1e-8,
                          "max_abs_lr_diff": 1e-15}}


def _batches(steps: int, batch: int, seq_len: int, vocab: int, spike_step: int) -> np.ndarray:
  """[steps, batch, seq_len] token ids: windows of a noisy repeating sequence (learnable, so
  the loss falls), and at spike_step a first row of one token repeated. Step s's batch depends
  on s alone, so a shorter run sees the same first batches."""
  base = np.random.default_rng(0).integers(2, vocab, 97)
  stream = np.tile(base, seq_len // 97 + 2)
  out = np.empty((steps, batch, seq_len), np.int64)
  for s in range(steps):
    rng = np.random.default_rng((1, s))
    starts = rng.integers(0, 97, batch)
    out[s] = np.stack([stream[i:i + seq_len] for i in starts])
    noise = rng.random(out[s].shape) < 0.05
    out[s][noise] = rng.integers(2, vocab, int(noise.sum()))
    if s + 1 == spike_step:  # one row of one token repeated: far outside what the model has seen
      out[s, 0] = 7
  return out


def _experiment(steps: int, batch: int, seq_len: int, peak_lr: float, dtype: str = "float32",
                spike_window: int = 128):
  from olmo3 import config
  from olmo3.config import (DataConfig, DType, Experiment, OptimizerConfig, Schedule,
                            TrainConfig)

  model = config.olmo3_micro().replace(compute_dtype=DType(dtype), max_seq_len=seq_len)
  # AI2's stitch, shrunk: part 1's cosine aims at 3/4 of the layout, part 2 resumes midway
  # through it (as AI2's did, at (first - 1) // 2 - 2 here) and aims at 5/4.
  first, warmup = SCHEDULE_STEPS * 3 // 4, SCHEDULE_STEPS // 10
  optimizer = OptimizerConfig(
      peak_lr=peak_lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, no_decay=("embed_tokens",),
      clip_grad_norm=1.0, schedule=Schedule.STITCHED_COSINE, warmup_steps=warmup,
      final_lr=peak_lr / 10, decay_steps=SCHEDULE_STEPS, stitch_first_steps=first,
      stitch_resumed_at=(first - 1) // 2 - 2, stitch_at=(first - 1) // 2 + warmup // 2,
      stitch_second_steps=SCHEDULE_STEPS * 5 // 4, skip_spikes=True, spike_sigma=6.0,
      spike_window=spike_window, spike_min_history=max(2, spike_window // 2))
  return Experiment(model=model, data=DataConfig(paths=("unused",), seq_len=seq_len,
                                                 global_batch_size=batch),
                    optimizer=optimizer,
                    train=TrainConfig(steps=steps, z_loss_weight=1e-5, microbatches=2))


def ours(exp, tokens: np.ndarray) -> tuple[dict, list[dict]]:
  """(initial parameters as numpy, per-step rows) from our train step."""
  import jax

  from olmo3.config import DType
  from olmo3.loss import IGNORE
  from olmo3.placement import ShardedModel
  from olmo3.train.state import StateLayout
  from olmo3.train.step import jit_train_step

  rows = []
  # x64 for this run only (a test calls main() in a process that goes on in float32).
  with jax.enable_x64(exp.model.compute_dtype == DType.FLOAT64):
    model = ShardedModel.for_experiment(exp, jax.devices()[:1])
    layout = StateLayout(exp, model)
    step = jit_train_step(exp, model, layout)
    with model.context():
      state = layout.fresh()
      initial = jax.tree.map(np.asarray, state.params)
      for ids in tokens:
        labels = np.concatenate([ids[:, 1:], np.full((len(ids), 1), IGNORE)], axis=1)
        batch = {"input_ids": jax.device_put(ids.astype(np.int32), model.batch_sharding),
                 "labels": jax.device_put(labels.astype(np.int32), model.batch_sharding),
                 "filtered": np.zeros(len(ids), bool),  # no repetition filter here
                 "source": np.zeros(len(ids), np.int32)}
        state, metrics = step(state, batch)
        m = jax.device_get(metrics)
        rows.append({"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                     "lr": float(m["lr"]), "skipped": bool(m["skipped"])})
  return initial, rows


class _Trainer:
  """What TransformerTrainModule reads from OLMo-core's Trainer: the global step (advanced
  before each batch), the schedule's length in steps (the Trainer's max_steps), the global
  batch in tokens, the data-parallel group (none) and the metrics the module records."""

  def __init__(self, global_batch_size: int, max_steps: int):
    self.global_batch_size, self.max_steps = global_batch_size, max_steps
    self.global_step = 0
    self.dp_process_group = None
    self.metrics: dict[str, Any] = {}

  def record_metric(self, name: str, value: Any, reduce_type: Any = None,
                    namespace: str | None = None, merge_strategy: Any = None) -> None:
    del reduce_type, merge_strategy  # one process: nothing to reduce
    self.metrics[f"{namespace}/{name}" if namespace else name] = value

  def record_ce_loss(self, value: Any, reduce_type: Any = None) -> None:
    from olmo_core.train.common import TRAIN_CE_LOSS_METRIC

    self.record_metric(TRAIN_CE_LOSS_METRIC, value, reduce_type)


def _float64_model_config(tc):
  """OLMo-core's transformer config with its norms' and RoPE's float32 casts turned off."""
  from olmo3.convert.olmo_core_params import attention_field

  block, head = tc.block, tc.lm_head
  field = attention_field(block)
  attn = getattr(block, field)
  exact = lambda c: dataclasses.replace(c, full_precision=False)
  attn = dataclasses.replace(attn, rope=exact(attn.rope), qk_norm=exact(attn.qk_norm))
  block = dataclasses.replace(block, **{field: attn}, layer_norm=exact(block.layer_norm))
  return dataclasses.replace(tc, block=block,
                             lm_head=dataclasses.replace(head, layer_norm=exact(head.layer_norm)))


def _float64_cross_entropy(logits, labels, *, ignore_index: int, reduction: str,
                           compute_z_loss: bool, z_loss_multiplier: float):
  """OLMo-core's `cross_entropy_loss` (CE and z-loss = multiplier × squared log-partition over
  unmasked labels, summed as the train module asks, or per token) in the logits' own dtype."""
  import torch.nn.functional as F

  loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)
  if not compute_z_loss:
    return loss, None
  z_squared = logits.logsumexp(-1).pow(2) * (labels != ignore_index)
  z_squared = {"sum": z_squared.sum(), "none": z_squared}[reduction]
  return loss, z_loss_multiplier * z_squared


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
  """A model this small runs no faster on more threads, and OpenMP's spinning threads crawl on a
  CPU shared with other work (3x slower here); the caller's setting comes back after."""
  import torch

  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    yield
  finally:
    torch.set_num_threads(threads)


def _float64_state(optim) -> None:
  """SkipStepAdamW creates each step count as a float32 tensor whatever the parameters' dtype,
  which puts its bias corrections through torch's float32 pow and sqrt: on CPU not always
  correctly rounded (sqrt(1 - 0.95f**2) is one ulp off with the AVX512 kernels), so no other
  code could reproduce them. In float64 its state starts as a float64 checkpoint would hold
  it: zero moments and step counts in float64."""
  import torch

  for group in optim.param_groups:
    for p in group["params"]:
      optim.state[p] = {"step": torch.zeros((), dtype=torch.float64),
                        "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def olmo_core_run(exp, initial: dict, tokens: np.ndarray) -> list[dict]:
  """The same run through OLMo-core's TransformerTrainModule: its model, loss, micro-batches,
  clipping, SkipStepAdamW and schedulers."""
  import unittest.mock

  import torch
  from olmo_core.nn import lm_head, rope
  from olmo_core.optim import (CosWithWarmup, HalfCosWithWarmup, OptimGroupOverride,
                               SkipStepAdamWConfig)
  from olmo_core.train.train_module import TransformerTrainModule, TransformerTrainModuleConfig

  from olmo3.config import DType
  from olmo3.convert import olmo_core_params

  float64 = exp.model.compute_dtype == DType.FLOAT64
  o, seq_len = exp.optimizer, tokens.shape[2]
  outputs = []  # each micro-batch's loss as the model returns it
  Recorded = recording(TransformerTrainModule, outputs)
  part1 = CosWithWarmup(warmup=o.warmup_steps, alpha_f=o.final_lr / o.peak_lr)
  part2 = HalfCosWithWarmup(warmup=o.stitch_at, alpha_f=o.final_lr / o.peak_lr)
  config = TransformerTrainModuleConfig(
      rank_microbatch_size=len(tokens[0]) * seq_len // exp.train.microbatches,
      max_sequence_length=seq_len,
      optim=SkipStepAdamWConfig(
          lr=o.peak_lr, weight_decay=o.weight_decay, betas=(o.b1, o.b2), eps=o.eps,
          group_overrides=[OptimGroupOverride(params=["embeddings.weight"],
                                              opts={"weight_decay": 0.0})],
          rolling_interval_length=o.spike_window, sigma_factor=int(o.spike_sigma)),
      scheduler=part1, z_loss_multiplier=exp.train.z_loss_weight,
      max_grad_norm=o.clip_grad_norm)
  trainer = _Trainer(global_batch_size=tokens[0].size, max_steps=o.stitch_first_steps)
  rows = []
  with _one_torch_thread(), contextlib.ExitStack() as patches:
    if float64:
      patches.enter_context(unittest.mock.patch.object(
          lm_head, "cross_entropy_loss", _float64_cross_entropy))
      patches.enter_context(unittest.mock.patch.object(
          rope, "compute_inv_freqs", lambda theta, dim, device: 1.0 / (theta ** (
              torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))))
    torch.manual_seed(0)
    tc = olmo_core_params.transformer_config(exp.model)
    model = (_float64_model_config(tc) if float64 else tc).build(init_device="cpu")
    # The module initialises the weights (and fills the RoPE cache); the Trainer then loads a
    # checkpoint: ours.
    module = Recorded(model=model.to(torch.float64) if float64 else model,
                      device=torch.device("cpu"),
                      **config.as_dict(exclude_none=True, recurse=False))
    module.model.load_state_dict(olmo_core_params.state_dict(exp.model, initial))
    if float64:
      _float64_state(module.optim)
    module._attach_trainer(trainer)
    module.pre_train()
    module.zero_grads()
    for ids in tokens:
      trainer.global_step += 1
      if trainer.global_step == o.stitch_resumed_at + 1:
        # AI2's second script resumed here with HalfCosWithWarmup aimed at its longer run.
        module.scheduler, trainer.max_steps = part2, o.stitch_second_steps
      trainer.metrics.clear()
      outputs.clear()
      rows.append(olmo_core_step(module, trainer, outputs, {"input_ids": torch.from_numpy(ids)}))
  return rows


def recording(module_class: type, outputs: list) -> type:
  """OLMo-core's train module class, its model's loss of each micro-batch appended to
  `outputs` as the forward pass returns it (the module records its CE in a float32
  accumulator: these are the model's own, in its dtype)."""

  class Recorded(module_class):
    def model_forward(self, input_ids, labels=None, **kwargs):
      out = super().model_forward(input_ids, labels=labels, **kwargs)
      outputs.append(out.loss.detach())
      return out

  return Recorded


def olmo_core_step(module, trainer, outputs: list, batch: dict) -> dict:
  """One step as OLMo-core's Trainer takes it (train_batch, optim_step, zero_grads) and what
  it recorded: the summed CE of `outputs` (the loss function's, filled during the step), the
  grad norm, the LR and whether SkipStepAdamW skipped."""
  module.train_batch(batch)
  module.optim_step()
  module.zero_grads()
  m = trainer.metrics
  return {"loss": sum(x.item() for x in outputs), "grad_norm": float(m["optim/total grad norm"]),
          "lr": float(m["optim/LR (group 0)"]),
          "skipped": float(m["optim/step skipped"]) == 1.0}


def compare(a: list[dict], b: list[dict]) -> dict:
  return {
      "steps": len(a),
      "max_abs_loss_diff": max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)),
      "max_rel_grad_norm_diff": max(abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"]
                                    for x, y in zip(a, b)),
      "max_abs_lr_diff": max(abs(x["lr"] - y["lr"]) for x, y in zip(a, b)),
      "skip_decisions_equal": [x["skipped"] for x in a] == [y["skipped"] for y in b],
      "skipped_steps": [i + 1 for i, y in enumerate(b) if y["skipped"]],
  }


def print_rows(our_rows: list[dict], their_rows: list[dict], dtype: str,
               skipped: bool = False) -> None:
  """Each step's loss, grad norm and LR from both sides (`skipped`: and whether each skipped the
  step): the table of this harness and of those that share its pieces."""
  digits = 7 if dtype == "float32" else 13
  print(f"{'step':>4}  {'loss (ours)':>{digits + 5}} {'loss (OLMo-core)':>{digits + 5}}  "
        f"{'grad norm':>10} {'grad norm':>10}  {'LR':>10} {'LR':>10}" + "  skipped" * skipped)
  for i, (x, y) in enumerate(zip(our_rows, their_rows), start=1):
    print(f"{i:>4}  {x['loss']:>{digits + 5}.{digits}f} {y['loss']:>{digits + 5}.{digits}f}  "
          f"{x['grad_norm']:>10.6f} {y['grad_norm']:>10.6f}  {x['lr']:>10.4e} {y['lr']:>10.4e}"
          + (f"  {int(x['skipped'])} {int(y['skipped'])}" if skipped else ""))


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=SCHEDULE_STEPS)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq_len", type=int, default=64)
  parser.add_argument("--peak_lr", type=float, default=1e-3)
  parser.add_argument("--dtype", choices=sorted(TOLERANCES), default="float32")
  parser.add_argument("--spike_window", type=int, default=128,
                      help="SkipStepAdamW's rolling window (the rule acts from half of it on)")
  parser.add_argument("--spike_step", type=int, default=90, help="the step of the odd batch")
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: both sides on the CPU
  exp = _experiment(args.steps, args.batch, args.seq_len, args.peak_lr, args.dtype,
                    args.spike_window)
  tokens = _batches(args.steps, args.batch, args.seq_len, exp.model.vocab_size, args.spike_step)
  initial, our_rows = ours(exp, tokens)
  their_rows = olmo_core_run(exp, initial, tokens)
  print_rows(our_rows, their_rows, args.dtype, skipped=True)
  result = {"dtype": args.dtype, **compare(our_rows, their_rows)}
  result["within"] = result["skip_decisions_equal"] and all(
      result[k] <= bound for k, bound in TOLERANCES[args.dtype].items())
  print(json.dumps(result))
  return result
