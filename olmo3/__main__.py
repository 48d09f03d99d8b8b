"""python -m olmo3 [--preset NAME] [--seq_len T]: build a preset on this machine and run it.

Until the training launcher lands, this is the embedded default end to end: it builds the tiny
OLMo 3 (no download), prints its shape, parameter count and training FLOPs per token, and runs
a forward pass and next-token loss on random tokens (≈ ln(vocab) at initialisation).
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from olmo3 import config, sharding
from olmo3 import model as model_lib


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m olmo3", description=__doc__)
  parser.add_argument("--preset", default="olmo3_tiny", choices=sorted(config.PRESETS))
  parser.add_argument("--seq_len", type=int, default=None)
  parser.add_argument("--batch", type=int, default=2)
  args = parser.parse_args(argv)
  cfg = config.PRESETS[args.preset]()
  seq_len = args.seq_len or cfg.max_seq_len
  print(f"{args.preset}: {cfg}")
  print(f"parameters {cfg.param_count:,}; training FLOPs/token at T={seq_len}: "
        f"{cfg.flops_per_token(seq_len) / 1e9:.3f} G (exact causal + sliding-window count)")
  print(f"layers: " + "".join("G" if g else "s" for g in cfg.layer_is_global)
        + f"  (s: sliding window {cfg.sliding_window}, G: global)")
  with sharding.use_mesh(sharding.make_mesh()):
    model = model_lib.Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, seq_len + 1))

    @nnx.jit
    def loss_fn(model, tokens):
      logits = model(tokens[:, :-1]).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    start = time.perf_counter()
    loss = float(loss_fn(model, jnp.asarray(tokens)))
    print(f"forward on {args.batch} x {seq_len} random tokens ({jax.device_count()} "
          f"{jax.default_backend()} devices): loss {loss:.4f} (ln vocab = "
          f"{math.log(cfg.vocab_size):.4f}), {time.perf_counter() - start:.1f} s with compile")


if __name__ == "__main__":
  main()
