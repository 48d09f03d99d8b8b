"""Training-step throughput on CPU: our jitted train step vs transformers' Olmo3ForCausalLM
(torch, AdamW), the same tiny OLMo 3, batch and machine, runs alternated.

  python benchmarks/train_step_vs_hf.py [--preset olmo3_tiny] [--batch 16] [--seq_len 256]
      [--rounds 3] [--steps 5]

Each round times `--steps` steps of each side after a warm-up (compile / first step); the
table reports the median tokens/s per side. Ends with one JSON line of headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ours(cfg, tokens, steps):
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from olmo3 import model as model_lib
  from olmo3 import sharding
  from olmo3.loss import lm_loss

  with sharding.use_mesh(sharding.make_mesh(devices=jax.devices()[:1])):
    model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  params = nnx.to_pure_dict(state)
  tx = optax.adamw(1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
  opt = tx.init(params)
  x = jnp.asarray(tokens)

  @jax.jit
  def step(params, opt):
    def loss_fn(p):
      return lm_loss(nnx.merge(graphdef, p)(x[:, :-1]), x[:, 1:])[0]

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss

  params, opt, loss = step(params, opt)
  loss.block_until_ready()

  def run():
    nonlocal params, opt
    start = time.perf_counter()
    for _ in range(steps):
      params, opt, loss = step(params, opt)
    loss.block_until_ready()
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
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="olmo3_tiny")
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()
  from olmo3 import config

  cfg = config.PRESETS[args.preset]().replace(compute_dtype="float32")
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq_len + 1))
  sides = {"olmo3 (JAX, jit)": ours(cfg, tokens, args.steps),
           "transformers Olmo3ForCausalLM (torch)": reference(cfg, tokens, args.steps)}
  times = {name: [] for name in sides}
  for _ in range(args.rounds):  # alternate: each round runs both sides
    for name, run in sides.items():
      times[name].append(run())
  tokens_per_step = args.batch * args.seq_len
  rate = {n: args.steps * tokens_per_step / statistics.median(t) for n, t in times.items()}
  import torch

  print(f"\n{args.preset} ({cfg.param_count:,} parameters), batch {args.batch} x {args.seq_len}, "
        f"float32, {args.rounds} alternated rounds of {args.steps} steps; "
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
  print("| implementation | tokens/s (median) | step time (s) |\n|---|---|---|")
  for name, r in rate.items():
    print(f"| {name} | {r:,.0f} | {tokens_per_step / r:.3f} |")
  ours_rate, ref_rate = rate["olmo3 (JAX, jit)"], rate["transformers Olmo3ForCausalLM (torch)"]
  print(json.dumps({"olmo3_tokens_per_s": ours_rate, "transformers_tokens_per_s": ref_rate,
                    "speedup": ours_rate / ref_rate, "preset": args.preset,
                    "batch": args.batch, "seq_len": args.seq_len}))


if __name__ == "__main__":
  main()
