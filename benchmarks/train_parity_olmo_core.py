"""Training-step parity with AI2's trainer code: the same small OLMo 3, trained side by side.

  python benchmarks/train_parity_olmo_core.py [--steps 32] [--batch 4] [--seq_len 64] [--peak_lr 1e-3]

Both sides start from the same weights (ours, freshly initialised, moved into OLMo-core's OLMo 3
transformer by olmo3.convert.olmo_core) and see the same batches, on CPU in float32. The model:
6 layers (sliding, sliding, sliding, global, sliding, global), grouped-query attention. The
optimizer as AI2's scripts configure it, shrunk to the run: AdamW (0.9, 0.95, eps 1e-8, weight
decay 0.1 except the input embedding), clipping at 1.0, z-loss 1e-5, a warmup and AI2's stitched
schedule (part 1 CosWithWarmup, part 2 HalfCosWithWarmup from its resume step on), and
SkipStepAdamW's rule (a 16-step window here, so it is active within the run). One odd batch late
in the run (a single token repeated) trips the skip rule with a gradient-norm spike.

OLMo-core side: its Transformer (its own loss with z-loss, divided by the batch's token count,
as its train module does), torch's total-norm clipping, its SkipStepAdamW and its schedulers,
stepped as its TransformerTrainModule steps them. Ours: olmo3.train.step.jit_train_step.

Prints per-step loss, grad norm, LR and skip decision from both, then one JSON line:
max_abs_loss_diff, max_rel_grad_norm_diff, max_abs_lr_diff, skip_decisions_equal.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

SPIKE_STEP = 26  # the odd batch: its loss or gradient jumps far above the window's


def _batches(steps: int, batch: int, seq_len: int, vocab: int) -> np.ndarray:
  """[steps, batch, seq_len] token ids: windows of a noisy repeating sequence (learnable, so
  the loss falls), and one token repeated at SPIKE_STEP. Step s's batch depends on s
  alone, so a shorter run sees the same first batches."""
  base = np.random.default_rng(0).integers(2, vocab, 97)
  stream = np.tile(base, seq_len // 97 + 2)
  out = np.empty((steps, batch, seq_len), np.int64)
  for s in range(steps):
    rng = np.random.default_rng((1, s))
    starts = rng.integers(0, 97, batch)
    out[s] = np.stack([stream[i:i + seq_len] for i in starts])
    noise = rng.random(out[s].shape) < 0.05
    out[s][noise] = rng.integers(2, vocab, int(noise.sum()))
    if s + 1 == SPIKE_STEP:  # one token repeated: far outside what the model has seen
      out[s] = 7
  return out


def _experiment(steps: int, batch: int, seq_len: int, peak_lr: float):
  from olmo3 import config
  from olmo3.config import (DataConfig, DType, Experiment, OptimizerConfig, Schedule,
                            TrainConfig)

  model = config.olmo3_micro().replace(compute_dtype=DType.FLOAT32, max_seq_len=seq_len)
  # The schedule is laid out for 32 updates whatever --steps (a shorter run is its beginning):
  # part 1's cosine aims at 24, part 2 resumes midway (as AI2's did) and aims at 40.
  first = 24
  warmup = 4
  optimizer = OptimizerConfig(
      peak_lr=peak_lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, no_decay=("embed_tokens",),
      clip_grad_norm=1.0, schedule=Schedule.STITCHED_COSINE, warmup_steps=warmup,
      final_lr=peak_lr / 10, decay_steps=32, stitch_first_steps=first,
      stitch_resumed_at=(first - 1) // 2 - 2, stitch_at=(first - 1) // 2 + warmup // 2,
      stitch_second_steps=40, skip_spikes=True, spike_sigma=6.0, spike_window=16,
      spike_min_history=8)
  return Experiment(model=model, data=DataConfig(paths=("unused",), seq_len=seq_len,
                                                 global_batch_size=batch),
                    optimizer=optimizer, train=TrainConfig(steps=steps, z_loss_weight=1e-5))


def ours(exp, tokens: np.ndarray):
  """(initial parameters as numpy, per-step rows) from our train step."""
  import jax

  from olmo3.loss import IGNORE
  from olmo3.sharded_model import ShardedModel
  from olmo3.train.state import StateLayout
  from olmo3.train.step import jit_train_step

  model = ShardedModel.for_experiment(exp, jax.devices()[:1])
  layout = StateLayout(exp, model)
  step = jit_train_step(exp, model, layout)
  rows = []
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


def olmo_core_run(exp, initial: dict, tokens: np.ndarray) -> list[dict]:
  """The same run with OLMo-core's model, loss, clipping, SkipStepAdamW and schedulers."""
  import torch
  from olmo_core.optim import CosWithWarmup, HalfCosWithWarmup, SkipStepAdamW

  from olmo3.convert import olmo_core

  torch.manual_seed(0)
  o = exp.optimizer
  model = olmo_core.transformer_config(exp.model).build(init_device="cpu")
  model.load_state_dict(olmo_core.state_dict(exp.model, initial))
  model.train()
  embedding = [p for n, p in model.named_parameters() if n == "embeddings.weight"]
  rest = [p for n, p in model.named_parameters() if n != "embeddings.weight"]
  optim = SkipStepAdamW([{"params": embedding, "weight_decay": 0.0}, {"params": rest}],
                        lr=o.peak_lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay,
                        rolling_interval_length=o.spike_window, sigma_factor=int(o.spike_sigma))
  part1 = CosWithWarmup(warmup=o.warmup_steps, alpha_f=o.final_lr / o.peak_lr)
  part2 = HalfCosWithWarmup(warmup=o.stitch_at, alpha_f=o.final_lr / o.peak_lr)
  rows = []
  for global_step, ids in enumerate(tokens, start=1):  # the step advances before the update
    input_ids = torch.from_numpy(ids)
    labels = torch.cat([input_ids[:, 1:], torch.full((len(ids), 1), -100)], dim=1)
    n_tokens = (labels != -100).sum()
    out = model(input_ids, labels=labels, ignore_index=-100, loss_reduction="sum",
                z_loss_multiplier=exp.train.z_loss_weight, loss_div_factor=n_tokens)
    out.loss.backward()
    optim.latest_loss = out.ce_loss.detach()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, o.clip_grad_norm, grad_norm)
    optim.latest_grad_norm = grad_norm
    lr = (part1.get_lr(o.peak_lr, global_step, o.stitch_first_steps)
          if global_step <= o.stitch_resumed_at else
          part2.get_lr(o.peak_lr, global_step, o.stitch_second_steps))
    for group in optim.param_groups:
      group["lr"] = lr
    optim.step()
    rows.append({"loss": out.loss.item(), "grad_norm": grad_norm.item(), "lr": float(lr),
                 "skipped": bool(optim.step_skipped.item() == 1.0)})
    optim.zero_grad(set_to_none=True)
  return rows


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


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=32)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq_len", type=int, default=64)
  parser.add_argument("--peak_lr", type=float, default=1e-3)
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: both sides on the CPU
  exp = _experiment(args.steps, args.batch, args.seq_len, args.peak_lr)
  tokens = _batches(args.steps, args.batch, args.seq_len, exp.model.vocab_size)
  initial, our_rows = ours(exp, tokens)
  their_rows = olmo_core_run(exp, initial, tokens)
  print(f"{'step':>4}  {'loss (ours)':>12} {'loss (OLMo-core)':>16}  {'grad norm':>10} "
        f"{'grad norm':>10}  {'LR':>10} {'LR':>10}  skipped")
  for i, (x, y) in enumerate(zip(our_rows, their_rows), start=1):
    print(f"{i:>4}  {x['loss']:>12.7f} {y['loss']:>16.7f}  {x['grad_norm']:>10.6f} "
          f"{y['grad_norm']:>10.6f}  {x['lr']:>10.4e} {y['lr']:>10.4e}  "
          f"{int(x['skipped'])} {int(y['skipped'])}")
  result = compare(our_rows, their_rows)
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
