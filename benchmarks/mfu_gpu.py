"""MFU of a 7B-width OLMo 3 train step on one GPU: full layer shapes (d_model 4096, 32 heads,
MLP 11008, vocab 100352), fewer layers, seq 8192, bf16, cuDNN attention with the sliding
window, a chosen remat policy.

  python benchmarks/mfu_gpu.py [--layers 4] [--batch 1] [--remat minimal] [--steps 10]
  python benchmarks/mfu_gpu.py --smoke        # CPU-sized shapes, XLA attention (tests)

Reports step time, tokens/s and MFU under the exact count and OLMo-core's legacy convention,
against the device's peak bf16 FLOP/s. Ends with one JSON line of headline figures.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq_len", type=int, default=8192)
  parser.add_argument("--remat", default="minimal")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device")
  args = parser.parse_args(argv)

  import jax

  from olmo3 import config
  from olmo3 import flops as flops_lib
  from olmo3.config import (AttentionKernel, DataConfig, DType, Experiment, OptimizerConfig,
                            TrainConfig)
  from olmo3.placement import ShardedModel
  from olmo3.train.state import StateLayout
  from olmo3.train.step import jit_train_step

  on_gpu = jax.default_backend() == "gpu"
  model = config.olmo3_7b().replace(
      n_layers=args.layers, remat=args.remat, compute_dtype=DType.BFLOAT16,
      attention=AttentionKernel.CUDNN if on_gpu else AttentionKernel.XLA)
  seq_len, batch = args.seq_len, args.batch
  if args.smoke:
    model = config.olmo3_micro().replace(n_layers=args.layers, remat=args.remat)
    seq_len, batch = 64, 2
  exp = Experiment(model=model, data=DataConfig(paths=("unused",), seq_len=seq_len,
                                                global_batch_size=batch),
                   optimizer=OptimizerConfig(warmup_steps=0, decay_steps=1000),
                   train=TrainConfig(steps=args.steps))
  sharded = ShardedModel.for_experiment(exp, jax.devices()[:1])
  layout = StateLayout(exp, sharded)
  train_step = jit_train_step(exp, sharded, layout)
  state = layout.fresh()
  rng = jax.random.key(0)
  tokens = jax.random.randint(rng, (batch, seq_len), 0, model.vocab_size)
  batch_arrays = {"input_ids": jax.device_put(tokens, sharded.batch_sharding),
                  "labels": jax.device_put(tokens, sharded.batch_sharding),
                  "filtered": jax.numpy.zeros((batch,), bool),
                  "source": jax.numpy.zeros((batch,), jax.numpy.int32)}
  with sharded.context():
    state, metrics = train_step(state, batch_arrays)  # compile + warm up
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(args.steps):
      state, metrics = train_step(state, batch_arrays)
    jax.block_until_ready(metrics)
  step_s = (time.perf_counter() - start) / args.steps
  tokens_per_step = batch * seq_len
  kind = jax.devices()[0].device_kind
  peak = flops_lib.peak_flops_per_device(kind)
  result = {"device": kind, "layers": model.n_layers, "seq_len": seq_len, "batch": batch,
            "remat": str(model.remat), "attention": str(model.attention),
            "step_time_s": step_s, "tokens_per_s": tokens_per_step / step_s}
  for convention in (flops_lib.Convention.EXACT, flops_lib.Convention.OLMO_CORE_LEGACY):
    achieved = flops_lib.flops_per_token(model, seq_len, convention) * tokens_per_step / step_s
    result[f"tflops_{convention.value}"] = achieved / 1e12
    result[f"mfu_{convention.value}"] = achieved / peak if peak else None
  print("| metric | value |\n|---|---|")
  for k, v in result.items():
    print(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
