"""Training-loop overhead: the real loop (`olmo3.train.loop.train`) vs the bare jitted step, the
same model and batches, in the same process.

  python benchmarks/loop_overhead.py [--fdl_config experiments.olmo3_tiny:stage1]
      [--batch 4] [--seq_len 256] [--steps 60] [--log_every 5] [--device_prefetch N]
      [--rounds 2]

The loop trains `--steps` steps in a temporary workdir (evaluation off, one checkpoint: the
last step's, after its row) with everything it does in a run: reading batches (ahead, on a
thread: data.device_prefetch), dispatching, per-source losses, rows every `--log_every` steps,
preemption checks. Its steady state is the median `step_time_s` of its rows after the first
(which holds the compilation). The bare step is `jit_train_step` on a fresh state, fed the same
loader's first `--steps` batches already on the device, timed over all of them in `--rounds`
rounds before the loop and as many after it (a compiling warm-up first); its figure is the
median round. Prints a table and
ends with one JSON line: loop_over_step is the loop's tokens/s over the step's (target >= 0.97).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

from olmo3 import platforms


def experiment(args: argparse.Namespace):
  """The experiment at the benchmark's size: evaluation off, checkpoints at the last step only."""
  import fiddle as fdl

  from launch import refs

  exp = fdl.build(refs.load(args.fdl_config))
  return dataclasses.replace(
      exp,
      data=dataclasses.replace(exp.data, global_batch_size=args.batch, seq_len=args.seq_len,
                               device_prefetch=(exp.data.device_prefetch
                                                if args.device_prefetch is None
                                                else args.device_prefetch)),
      train=dataclasses.replace(exp.train, steps=args.steps, log_every=args.log_every,
                                eval_every=0, stop_at_epoch=None),
      checkpoint=dataclasses.replace(exp.checkpoint, every=args.steps, init_from=None))


def loop_step_times(exp, workdir: str) -> list[float]:
  """The loop's logged step times (seconds per step), one per row after the first."""
  from olmo3.io import metrics as metrics_lib
  from olmo3.run.plan import RunPlan
  from olmo3.train.loop import train

  train(RunPlan.build(exp, workdir))
  rows = [r for r in metrics_lib.read_jsonl(f"{workdir}/metrics.jsonl") if "step_time_s" in r]
  return [r["step_time_s"] for r in rows[1:]]


def bare_step(exp) -> Callable[[], float]:
  """A function timing one round of the jitted step alone over the loader's batches (seconds
  per step), compiled and warmed up here."""
  import jax

  from olmo3.data import pipeline, sources
  from olmo3.placement import ShardedModel
  from olmo3.train.state import StateLayout
  from olmo3.train.step import jit_train_step

  model = ShardedModel.for_experiment(exp)
  with model.context():
    source = sources.token_files(exp.data, exp.model.vocab_size)
    layout = StateLayout(exp, model)
    step = jit_train_step(exp, model, layout, len(source.source_names))
    loader = pipeline.Loader(exp.data, model.batch_sharding, start_step=0,
                             num_steps=exp.train.steps, source=source)
    batches = jax.block_until_ready(list(loader))
    state = layout.fresh()
    state, metrics = step(state, batches[0])  # compiles
    jax.block_until_ready((state, metrics))

  def one_round() -> float:
    nonlocal state
    with model.context():
      start = time.perf_counter()
      for batch in batches:
        state, metrics = step(state, batch)
      jax.block_until_ready((state, metrics))
    return (time.perf_counter() - start) / len(batches)

  return one_round


def main() -> None:
  platforms.choose()  # the CPU where there is no accelerator: no TPU probing
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--fdl_config", default="experiments.olmo3_tiny:stage1")
  parser.add_argument("--batch", type=int, default=4)  # a quarter of the tiny batch: short steps
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--steps", type=int, default=60)  # 11 timed rows: a stable median
  parser.add_argument("--log_every", type=int, default=5)
  parser.add_argument("--device_prefetch", type=int, default=None,
                      help="data.device_prefetch of the loop (default: the experiment's)")
  parser.add_argument("--rounds", type=int, default=2, help="the step's, before and after")
  args = parser.parse_args()
  import jax

  # Both sides compile the same step: the second loads it from this run's cache.
  cache = tempfile.mkdtemp(prefix="loop_overhead_cache_")
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  exp = experiment(args)
  one_round = bare_step(exp)
  # The step's rounds before and after the loop: a machine whose speed drifts moves both sides.
  step_times = [one_round() for _ in range(args.rounds)]
  with tempfile.TemporaryDirectory(prefix="loop_overhead_") as workdir:
    loop_times = loop_step_times(exp, workdir)
  step_times += [one_round() for _ in range(args.rounds)]
  tokens = exp.tokens_per_step
  step_s, loop_s = statistics.median(step_times), statistics.median(loop_times)
  rate = {"bare jitted step (batches on device)": tokens / step_s,
          "training loop (olmo3.train.loop.train)": tokens / loop_s}
  print(f"\n{args.fdl_config} ({exp.model.param_count:,} parameters), batch {args.batch} x "
        f"{args.seq_len}, {args.steps} steps, a row every {args.log_every}, device_prefetch "
        f"{exp.data.device_prefetch}; {jax.device_count()} {jax.devices()[0].platform} "
        f"device(s), {platform.machine()}, {os.cpu_count()} CPUs")
  print("| what | tokens/s (median) | step time (s) |\n|---|---|---|")
  for name, r in rate.items():
    print(f"| {name} | {r:,.0f} | {tokens / r:.3f} |")
  print(f"\nloop / step: {step_s / loop_s:.3f}")
  print(json.dumps({"loop_tokens_per_s": tokens / loop_s, "step_tokens_per_s": tokens / step_s,
                    "loop_over_step": step_s / loop_s, "experiment": args.fdl_config,
                    "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps,
                    "log_every": args.log_every, "device_prefetch": exp.data.device_prefetch}))


if __name__ == "__main__":
  main()
