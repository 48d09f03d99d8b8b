"""What stage 3 and the 7B need of a GPU, checked in one command (benchmarks/gpu_check.sh runs
this under a time limit): prints one JSON line.

  python benchmarks/gpu_check.py            # on a GPU: everything below; on a CPU: its CPU part

Checks, each a key of the JSON line (`skipped` lists what this machine could not run, and why):

- `probe`: each attention kernel this machine has, against the XLA kernel, on a small packed
  batch (documents of uneven lengths crossing the sliding window), float32: the largest
  difference of outputs, and whether documents were honoured (a kernel that attends across
  documents differs by far more than rounding). The cuDNN kernel takes no packed documents
  (`model.attention='cudnn'` refuses segments in one line), so stage 3 does not run on GPUs:
  the probe records that refusal as its verdict for cuDNN.
- `cudnn_vs_dot_product` (GPU): JAX's cuDNN attention against its XLA one, causal and sliding
  window, float32 and bfloat16, at 8,192 and 16,384 tokens, the 7B's multi-head shape (32 x 128)
  and a grouped-query one (32 query heads, 8 key/value heads).
- `mfu` (GPU): `benchmarks/mfu_gpu.py` at 8,192 tokens (4 of the 7B's layers) and at 65,536
  (as many layers as fit, from 4 down): tokens/s and MFU.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time


def _packed_inputs(t: int, heads: int, kv_heads: int, k: int, seed: int = 0):
  import jax
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(seed)
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (2, t, heads, k), jnp.float32)
  kk = jax.random.normal(keys[1], (2, t, kv_heads, k), jnp.float32)
  v = jax.random.normal(keys[2], (2, t, kv_heads, k), jnp.float32)
  segments = jnp.asarray(np.sort(rng.integers(0, 7, (2, t)), axis=1), jnp.int32)
  return q, kk, v, segments


def probe(kernels: list[str]) -> dict[str, dict]:
  """Each kernel against XLA's on a packed batch: max |difference| and the verdict."""
  import jax.numpy as jnp

  from olmo3 import attention
  from olmo3.config import AttentionKernel

  q, k, v, segments = _packed_inputs(256, 4, 2, 32)
  window = 48
  reference = attention.attend(q, k, v, window, AttentionKernel.XLA, segments)
  unmasked = attention.attend(q, k, v, window, AttentionKernel.XLA, None)
  across = float(jnp.abs(unmasked - reference).max())  # what ignoring documents costs
  out = {}
  for name in kernels:
    try:
      got = attention.attend(q, k, v, window, AttentionKernel(name), segments,
                             splash_block=128)
    except ValueError as e:
      out[name] = {"verdict": "refused", "why": str(e).splitlines()[0]}
      continue
    diff = float(jnp.abs(got - reference).max())
    out[name] = {"max_abs_diff": diff, "across_documents_would_be": across,
                 "verdict": "ok" if diff <= 1e-4 else "WRONG: documents not honoured"
                 if diff > 0.1 * across else "WRONG: off by more than rounding"}
  return out


def cudnn_vs_dot_product() -> list[dict]:
  import jax
  import jax.numpy as jnp

  rows = []
  for t in (8192, 16384):
    for heads, kv_heads in ((32, 32), (32, 8)):
      for dtype in (jnp.float32, jnp.bfloat16):
        keys = jax.random.split(jax.random.key(t + kv_heads), 3)
        q = jax.random.normal(keys[0], (1, t, heads, 128), dtype)
        k = jax.random.normal(keys[1], (1, t, kv_heads, 128), dtype)
        v = jax.random.normal(keys[2], (1, t, kv_heads, 128), dtype)
        for window in (None, 4096):
          args = dict(scale=128 ** -0.5, is_causal=True,
                      local_window_size=None if window is None else (window - 1, 0))
          row = {"tokens": t, "heads": heads, "kv_heads": kv_heads,
                 "dtype": jnp.dtype(dtype).name, "window": window}
          try:
            got = jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **args)
            ref = jax.nn.dot_product_attention(q, k, v, implementation="xla", **args)
            row["max_abs_diff"] = float(jnp.abs(got.astype(jnp.float32)
                                                - ref.astype(jnp.float32)).max())
          except Exception as e:  # a shape or dtype cuDNN does not take: say which
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
          rows.append(row)
  return rows


def _mfu_gpu(args: list[str]) -> dict:
  """benchmarks/mfu_gpu.py's result, its own table sent to stderr (one JSON line here)."""
  sys.path.insert(0, __file__.rsplit("/", 1)[0])
  import mfu_gpu  # pylint: disable=import-outside-toplevel

  with contextlib.redirect_stdout(sys.stderr):
    return mfu_gpu.main(args)


def mfu() -> list[dict]:
  results = [_mfu_gpu(["--layers", "4", "--seq_len", "8192", "--steps", "5"])]
  for layers in (4, 2, 1):  # 65,536 tokens: as many layers as fit
    try:
      results.append(_mfu_gpu(["--layers", str(layers), "--seq_len", "65536", "--steps", "3"]))
      break
    except Exception as e:  # out of memory at this depth: one layer fewer
      results.append({"seq_len": 65536, "layers": layers,
                      "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
  return results


def main() -> dict:
  from olmo3 import platforms

  platforms.choose()
  import jax

  start = time.perf_counter()
  on_gpu = jax.default_backend() == "gpu"
  report: dict = {"device": jax.devices()[0].device_kind, "skipped": {}}
  kernels = ["dot_product"] + (["cudnn"] if on_gpu else [])
  report["probe"] = probe(kernels)
  if on_gpu:
    report["cudnn_vs_dot_product"] = cudnn_vs_dot_product()
    report["mfu"] = mfu()
  else:
    why = "no GPU on this machine"
    report["skipped"] = {"probe of cudnn": why, "cudnn_vs_dot_product": why, "mfu": why}
    report["mfu_smoke"] = _mfu_gpu(["--smoke", "--steps", "2"])
  report["ok"] = all(p.get("verdict") in ("ok", "refused") for p in report["probe"].values())
  report["seconds"] = round(time.perf_counter() - start, 1)
  print(json.dumps(report))
  return report


if __name__ == "__main__":
  main()
