"""What the 7B stage 3's in-loop RULER costs: one evaluation's time on tpu7x:4x8x8 against the
training steps between two.

  python benchmarks/ruler_price_7b.py [--fdl_config experiments.olmo3_7b:stage3]
      [--compile tpu7x:4x8x8] [--lengths 4096 65536] [--smoke]

For each of the experiment's RULER lengths, the batch the evaluation runs (`olmo3.decode.
greedy_program`: eval.batch_size prompts of that length, prefilled eval.ruler.prefill_chunk
positions at a time, then 128 tokens decoded, one compiled program) is compiled for the
topology, and priced as the train step is (olmo3.train.aot.step_bound): its FLOPs (counted
exactly, below) at the device's peak, the compiled program's memory traffic at peak HBM
bandwidth and its collectives at the links' bandwidth, the largest of the three: a lower bound
on the batch's time. The evaluation at a length runs ceil(tasks x samples / rows) such batches.
Against it: the train step's compute at peak (the stage's step is bound by compute:
benchmarks/RESULTS.md), times train.eval_every.

FLOPs of a batch (what the code computes, not a minimal count): each prefilled position runs
the matmuls (2 N, N the matmul weights less the LM head) and attends every position of the
cache (4 H K S a layer, S the cache's length: the decode masks, it does not skip, so sliding
layers pay the whole cache too); the LM head runs once a row after the prompt and once a
decoded token (2 d V); each decoded token runs the same per-token work. `--smoke` prices the
tiny stage 3 on the local CPU (no peaks: the compile and the FLOPs only): the tests run it.

Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from olmo3 import platforms  # noqa: E402


def batch_flops(cfg, rows: int, length: int, cache: int, new_tokens: int) -> float:
  """The FLOPs of one RULER batch as olmo3.decode computes it (the module docstring)."""
  head = 2 * cfg.d_model * cfg.padded_vocab_size
  body = 2 * cfg.matmul_param_count - head
  attend = cfg.n_layers * 4 * cfg.n_heads * cfg.head_dim * cache
  return rows * (length * (body + attend) + new_tokens * head + (new_tokens - 1) * (body + attend))


def price(exp, topology: str | None, lengths: list[int]) -> dict:
  import jax
  import jax.numpy as jnp

  from olmo3 import decode, flops as flops_lib
  from olmo3.placement import ShardedModel
  from olmo3.train import aot

  ruler_cfg, cfg = exp.eval.ruler, exp.model
  model = ShardedModel.for_experiment(exp, aot.topology_devices(topology) if topology else None)
  rows, new_tokens, n = exp.eval.batch_size, 128, model.mesh.devices.size
  kind = model.mesh.devices.flat[0].device_kind
  peaks = flops_lib.device_peaks(kind)
  per_length = []
  for length in lengths:
    chunk = min(ruler_cfg.prefill_chunk, length)
    cache = -(-(length + new_tokens - 1) // chunk) * chunk
    program = decode.greedy_program(model, new_tokens, chunk)
    tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=model.batch_sharding)
    lengths_b = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=decode.row_sharding(model))
    start = time.perf_counter()
    with model.context():
      compiled = program.lower(model.param_target, tokens, lengths_b).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    total_gb = sum(getattr(mem, f"{k}_size_in_bytes", 0) for k in
                   ("argument", "temp", "output")) / 1e9 if mem is not None else None
    text = compiled.as_text()
    moved, _ = aot.collective_bytes(text)
    traffic = aot.memory_traffic_bytes(text)
    flop = batch_flops(cfg, rows, length, cache, new_tokens)
    bound = (aot.step_bound(flop / n, traffic, aot.link_bytes(moved), peaks)
             if peaks is not None else None)
    batches = math.ceil(len(ruler_cfg.tasks) * ruler_cfg.samples / rows)
    per_length.append({
        "length": length, "batches": batches, "batch_pflop": flop / 1e15,
        "device_gb": total_gb, "collective_gb": sum(moved.values()) / 1e9,
        "memory_traffic_gb": traffic / 1e9, "compile_s": round(compile_s, 1),
        "batch_bound_s": bound.bound_s if bound else None,
        "limit": bound.limit if bound else None,
        "eval_s": bound.bound_s * batches if bound else None})
    print(f"compiled RULER at {length} for {topology or 'local devices'} in {compile_s:.0f} s",
          file=sys.stderr, flush=True)
  result = {"topology": topology, "devices": n, "rows": rows, "lengths": per_length}
  if peaks is not None:
    train_s = cfg.flops_per_token(exp.data.seq_len) * exp.tokens_per_step / n / peaks.flops
    eval_s = sum(p["eval_s"] for p in per_length)
    result.update(train_step_s=train_s, eval_s=eval_s, eval_every=exp.train.eval_every,
                  share_of_interval=eval_s / (exp.train.eval_every * train_s))
  return result


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--fdl_config", default="experiments.olmo3_7b:stage3")
  parser.add_argument("--compile", default="tpu7x:4x8x8")
  parser.add_argument("--lengths", type=int, nargs="*", default=None)
  parser.add_argument("--smoke", action="store_true")
  args = parser.parse_args(argv)
  platforms.choose()
  import fiddle as fdl

  from launch import refs

  exp = fdl.build(refs.load("experiments.olmo3_tiny:stage3" if args.smoke else args.fdl_config))
  topology = None if args.smoke else args.compile
  lengths = args.lengths or list(exp.eval.ruler.lengths)
  result = price(exp, topology, lengths)
  print("| length | batches | PFLOP a batch | GB a device | collectives GB | bound a batch (s) "
        "| limit | RULER at this length (s) |")
  print("|---|---|---|---|---|---|---|---|")
  for p in result["lengths"]:
    fmt = lambda v, f: "-" if v is None else format(v, f)
    print(f"| {p['length']:,} | {p['batches']} | {p['batch_pflop']:.2f} | "
          f"{fmt(p['device_gb'], '.1f')} | {p['collective_gb']:.1f} | "
          f"{fmt(p['batch_bound_s'], '.3f')} | {p['limit'] or '-'} | {fmt(p['eval_s'], '.2f')} |")
  if "eval_s" in result:
    print(f"\nOne RULER evaluation: {result['eval_s']:.1f} s against {result['eval_every']:,} "
          f"train steps of {result['train_step_s']:.3f} s: {result['share_of_interval']:.3%} "
          "of the interval (bounds at the published peaks).")
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
