"""Input pipeline throughput per host: olmo3's Grain loader vs OLMo-core's numpy dataset/loader,
on the same token files, in the same run.

  python benchmarks/data_loader.py [--files 8] [--tokens_per_file 33554432] [--seq_len 8192]
      [--global_batch 64] [--steps 40] [--workers 0 2]

  python benchmarks/data_loader.py --source http --latency_ms 20   # remote, as AI2 serves them

Writes random uint32 token files to a temporary directory (OLMo's format), then for each worker
count reads `--steps` global batches with each loader (this host holding every row, the worst
case for one host) and reports tokens/s after one warm-up step. Our loader is measured twice:
host batches alone, and host batches assembled into a global jax.Array (what the trainer sees).
With `--source http` both loaders read the same files from a local HTTP server with Range
support that adds `--latency_ms` to every request (olmo3/data/serve.py): the cost
of reading AI2's files from its public host, or a bucket, one region away.
Prints a table and ends with one JSON line of headline figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

from olmo3 import platforms


def _write_files(directory: str, files: int, tokens_per_file: int) -> list[str]:
  from olmo3.data.tokens import write_token_file

  rng = np.random.default_rng(0)
  paths = []
  for i in range(files):
    path = os.path.join(directory, f"{i:05d}.npy")
    write_token_file(path, rng.integers(0, 100_278, tokens_per_file, dtype=np.uint32))
    paths.append(path)
  return paths


def _rate(batches, steps: int, tokens_per_step: int) -> float:
  it = iter(batches)
  next(it)  # warm-up: worker start, first file opens
  start = time.perf_counter()
  for _ in range(steps):
    next(it)
  return steps * tokens_per_step / (time.perf_counter() - start)


def ours(paths, args, workers: int, to_global: bool) -> float:
  import jax

  from olmo3 import sharding
  from olmo3.config import DataConfig
  from olmo3.data import pipeline

  cfg = DataConfig(paths=tuple(paths), seq_len=args.seq_len, global_batch_size=args.global_batch,
                   seed=34521, num_workers=workers, validate_tokens=False, prefetch=4)
  mesh = sharding.make_mesh({"data": -1})
  batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  loader = pipeline.Loader(cfg, batch_sharding, start_step=0, num_steps=args.steps + 1)
  batches = (jax.block_until_ready(b) for b in loader) if to_global else loader.host_batches()
  return _rate(batches, args.steps, args.global_batch * args.seq_len)


def olmo_core(paths, args, workers: int, work_dir: str) -> float:
  from olmo_core.data import DataCollator, NumpyFSLDataLoader
  from olmo_core.data.numpy_dataset import NumpyFSLDataset

  dataset = NumpyFSLDataset(*paths, sequence_length=args.seq_len, pad_token_id=100_277,
                            eos_token_id=100_257, vocab_size=100_278, dtype=np.uint32)
  dataset.prepare()
  loader = NumpyFSLDataLoader(dataset, collator=DataCollator(pad_token_id=100_277),
                              global_batch_size=args.global_batch * args.seq_len,
                              work_dir=work_dir, seed=34521, num_workers=workers,
                              prefetch_factor=4 if workers else None)
  loader.reshuffle(epoch=1)
  return _rate(loader, args.steps, args.global_batch * args.seq_len)


def main() -> None:
  platforms.choose()  # the CPU where there is no accelerator: no TPU probing
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--files", type=int, default=8)
  parser.add_argument("--tokens_per_file", type=int, default=1 << 25)
  parser.add_argument("--seq_len", type=int, default=8192)
  parser.add_argument("--global_batch", type=int, default=64)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
  parser.add_argument("--source", choices=["local", "http"], default="local",
                      help="read the files from disk, or from a local HTTP server")
  parser.add_argument("--latency_ms", type=float, default=20.0,
                      help="with --source http: latency the server adds to each request")
  args = parser.parse_args()
  from olmo3.data import grain_compat

  grain_compat.ensure_flags_parsed()
  rows = []
  with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
    paths = _write_files(tmp, args.files, args.tokens_per_file)
    if args.source == "http":
      sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # harness/
      from harness.storage_servers import InstrumentedRangeServer

      server = stack.enter_context(InstrumentedRangeServer(tmp,
                                                           latency_s=args.latency_ms / 1000))
      paths = [f"{server.url}/{os.path.basename(p)}" for p in paths]
    for workers in args.workers:
      rows.append(("olmo3 (Grain), host batches", workers, ours(paths, args, workers, False)))
      rows.append(("olmo3 (Grain), global jax.Array", workers, ours(paths, args, workers, True)))
      rows.append(("OLMo-core NumpyFSLDataLoader", workers,
                   olmo_core(paths, args, workers, os.path.join(tmp, f"work{workers}"))))
  where = (f"HTTP, {args.latency_ms:g} ms per request" if args.source == "http"
           else "local disk (page cache)")
  machine = platform.processor() or platform.machine()
  print(f"\n{where}: {args.files} files x {args.tokens_per_file:,} tokens, seq_len "
        f"{args.seq_len}, {args.global_batch} instances/step, {args.steps} steps; {machine}, "
        f"{os.cpu_count()} CPUs")
  print("| loader | workers | tokens/s per host |\n|---|---|---|")
  for name, workers, rate in rows:
    print(f"| {name} | {workers} | {rate:,.0f} |")
  best = {name: max(r for n, _, r in rows if n == name) for name, _, _ in rows}
  print(json.dumps({"olmo3_tokens_per_s": best["olmo3 (Grain), host batches"],
                    "olmo3_global_array_tokens_per_s": best["olmo3 (Grain), global jax.Array"],
                    "olmo_core_tokens_per_s": best["OLMo-core NumpyFSLDataLoader"],
                    "seq_len": args.seq_len, "global_batch": args.global_batch,
                    "source": args.source,
                    **({"latency_ms": args.latency_ms} if args.source == "http" else {})}))


if __name__ == "__main__":
  main()
