"""Training-step throughput on CPU: the train step `launch/main.py` runs vs transformers'
Olmo3ForCausalLM (torch, AdamW), on the same tiny OLMo 3, batch and machine, runs alternated.

  python benchmarks/train_step_vs_hf.py [--fdl_config experiments.olmo3_tiny:stage1]
      [--vocab_chunk N|none] [--rounds 3] [--steps 5]

Our side is the shipped step: the experiment's `jit_train_step` on its `StateLayout` (loss with
z-loss through the fused vocabulary-chunked cross-entropy, clipping, AdamW with the scheduled
learning rate, step skipping), on one device, with the experiment's model, batch, sequence
length (the tiny stage 1: 16 x 256 tokens) and XLA flags. The peer trains transformers' model of the same
shape with torch's AdamW on the same tokens. Each round times `--steps` steps of each side
after a warm-up (compile / first step); the table reports the median tokens/s per side. Ends
with one JSON line of headline figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time

import numpy as np

from olmo3 import platforms, xla_flags as flags_lib


def ours(exp, tokens, steps):
  import jax

  from olmo3.data import pipeline
  from olmo3.placement import ShardedModel
  from olmo3.train.state import StateLayout
  from olmo3.train.step import jit_train_step

  model = ShardedModel.for_experiment(exp, devices=jax.devices()[:1])
  layout = StateLayout(exp, model)
  b, t = exp.data.global_batch_size, exp.data.seq_len
  rows = pipeline.HostRows.of(model.batch_sharding, b, t)
  batch = rows.to_global({"input_ids": tokens[:, :-1].astype(np.int32),
                          "labels": tokens[:, 1:].astype(np.int32),
                          "filtered": np.zeros(b, bool), "source": np.zeros(b, np.int32)})
  with model.context():
    state = layout.fresh()
    step = jit_train_step(exp, model, layout)
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)

  def run():
    nonlocal state
    start = time.perf_counter()
    with model.context():
      for _ in range(steps):
        state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
    return time.perf_counter() - start

  return run


def reference(cfg, tokens, steps):
  import torch
  import transformers

  from olmo3.convert import hf

  fields = {k: v for k, v in hf.model_config_to_hf(cfg).items()
            if k not in ("architectures", "model_type", "dtype")}
  torch.manual_seed(0)
  model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**fields))
  model.config._attn_implementation = "sdpa"
  model.train()
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.1)
  x = torch.from_numpy(tokens.astype(np.int64))

  def one():
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # HF shifts labels itself
    loss.backward()
    optimizer.step()

  one()

  def run():
    start = time.perf_counter()
    for _ in range(steps):
      one()
    return time.perf_counter() - start

  return run


def main() -> None:
  platforms.choose()  # the CPU where there is no accelerator: no TPU probing
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--fdl_config", default="experiments.olmo3_tiny:stage1")
  parser.add_argument("--vocab_chunk", default=None,
                      help="override model.vocab_chunk: columns per chunk, or 'none' (full logits)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()
  import fiddle as fdl

  from launch import refs

  exp = fdl.build(refs.resolve(args.fdl_config))
  if args.vocab_chunk is not None:
    chunk = None if args.vocab_chunk == "none" else int(args.vocab_chunk)
    exp = dataclasses.replace(exp, model=exp.model.replace(vocab_chunk=chunk))
  # As the launcher does, before JAX starts its backend: the experiment's XLA flags (the tiny
  # stages: the `cpu` set).
  flags_lib.apply_to_environ(exp.xla_flags, exp.libtpu_flags, exp.env)
  cfg, b, t = exp.model, exp.data.global_batch_size, exp.data.seq_len
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t + 1))
  sides = {"olmo3 (JAX, the shipped train step)": ours(exp, tokens, args.steps),
           "transformers Olmo3ForCausalLM (torch)": reference(cfg, tokens, args.steps)}
  times = {name: [] for name in sides}
  for _ in range(args.rounds):  # alternate: each round runs both sides
    for name, run in sides.items():
      times[name].append(run())
  tokens_per_step = b * t
  rate = {n: args.steps * tokens_per_step / statistics.median(v) for n, v in times.items()}
  import torch

  print(f"\n{args.fdl_config} ({cfg.param_count:,} parameters, vocab_chunk {cfg.vocab_chunk}), "
        f"batch {b} x {t}, {cfg.compute_dtype}, {args.rounds} alternated rounds of {args.steps} "
        f"steps; {platform.machine()}, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}")
  print("| implementation | tokens/s (median) | step time (s) |\n|---|---|---|")
  for name, r in rate.items():
    print(f"| {name} | {r:,.0f} | {tokens_per_step / r:.3f} |")
  ours_rate, ref_rate = rate["olmo3 (JAX, the shipped train step)"], rate[
      "transformers Olmo3ForCausalLM (torch)"]
  print(json.dumps({"olmo3_tokens_per_s": ours_rate, "transformers_tokens_per_s": ref_rate,
                    "speedup": ours_rate / ref_rate, "fdl_config": args.fdl_config,
                    "vocab_chunk": cfg.vocab_chunk, "batch": b, "seq_len": t}))


if __name__ == "__main__":
  main()
