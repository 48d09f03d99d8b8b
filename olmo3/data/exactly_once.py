"""python -m olmo3.data.exactly_once: prove the input pipeline reads every instance exactly once.

  python -m olmo3.data.exactly_once --paths FILE [FILE ...] --seq_len T --global_batch B --seed S \\
      --processes P [--devices_per_process D] --steps N [--start_step K] [--dump DIR] \\
      [--max_target_seq_len M]
  python launch/audit.py --fdl_config=REF --processes P ... (an experiment's own pipeline)

Launches P real OS processes joined by jax.distributed on CPU, each with D simulated devices and
the trainer's own loader and global-array assembly; reads steps K..K+N-1; and reports instances
read, duplicates within an epoch, instances never read (for epochs the steps cover completely),
rows read by two processes, and whether every step's global batch equals the one computed
directly from the global order in a single process. Exits 1 on any duplicate, gap or mismatch.
With --dump DIR, process p writes DIR/step{s:06d}.process{p:03d}.npy: the input_ids rows it
holds for step s. The last line is the report as JSON (with a digest per step).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from olmo3 import program
from olmo3.config import DataConfig


def _data_config(args: argparse.Namespace) -> DataConfig:
  if args._data:  # a worker: the parent's exact config
    return DataConfig(**json.loads(args._data))
  if not args.paths or not args.seq_len or not args.global_batch:
    raise SystemExit("error: give --paths, --seq_len and --global_batch (or audit an "
                     "experiment's own pipeline: python launch/audit.py --fdl_config=REF)")
  return DataConfig(paths=tuple(args.paths), seq_len=args.seq_len,
                    max_target_seq_len=args.max_target_seq_len,
                    global_batch_size=args.global_batch, seed=args.seed, num_workers=args.workers,
                    validate_tokens=False)


def _digest(array: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def worker(args: argparse.Namespace) -> None:
  """One process of the audit: the trainer's loader, then checks against the direct order."""
  import jax
  from jax.experimental import multihost_utils

  if args.processes > 1:
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.processes, process_id=args.process_id)
  from olmo3 import sharding as sharding_lib
  from olmo3.data import pipeline

  cfg = dataclasses.replace(_data_config(args), validate_tokens=False)
  mesh = sharding_lib.make_mesh({"data": -1})
  batch_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None))
  loader = pipeline.Loader(cfg, batch_sharding, start_step=args.start_step, num_steps=args.steps)
  me = jax.process_index()
  steps = {}
  for batch in loader.host_batches():
    step = int(batch.pop("step"))
    if args.dump:
      np.save(os.path.join(args.dump, f"step{step:06d}.process{me:03d}.npy"), batch["input_ids"])
    global_batch = loader.host_rows.to_global(batch)  # the path training batches take
    instances = multihost_utils.process_allgather(global_batch["instance"], tiled=True)
    tokens = multihost_utils.process_allgather(global_batch["input_ids"], tiled=True)
    expected = loader.order.batch(step)
    direct = np.stack([loader.source[i] for i in expected])
    steps[step] = {
        "read": batch["instance"].tolist(),
        "global": np.asarray(instances).tolist(),
        "matches_direct": bool(np.array_equal(instances, expected)
                               and np.array_equal(tokens, direct)),
        "digest": _digest(np.asarray(tokens)),
    }
  result = {"process": me, "devices": jax.local_device_count(),
            "instances": len(loader.source), "batches_per_epoch": loader.order.batches_per_epoch,
            "steps": steps}
  with open(os.path.join(args.out, f"process{me:03d}.json"), "w") as f:
    json.dump(result, f)


def analyze(results: list[dict[str, Any]], global_batch: int) -> dict[str, Any]:
  """Merges the processes' results into the audit report."""
  first = results[0]
  per_epoch = first["batches_per_epoch"]
  step_ids = sorted(int(s) for s in first["steps"])
  read_by = collections.Counter()  # (step, instance) -> processes that read it
  mismatched, reads = [], {}
  for r in results:
    reads[r["process"]] = sum(len(s["read"]) for s in r["steps"].values())
    for step, s in r["steps"].items():
      read_by.update((int(step), i) for i in s["read"])
      if not s["matches_direct"]:
        mismatched.append(int(step))
  process_views_differ = sorted(
      int(step) for step in first["steps"]
      if any(r["steps"][step]["global"] != first["steps"][step]["global"] for r in results))
  # Which instances the union of processes read at each step, and which the global batch holds.
  read_twice = sorted({step for (step, _), n in read_by.items() if n > 1})
  per_step_reads = collections.defaultdict(list)
  for (step, instance) in read_by:
    per_step_reads[step].append(instance)
  not_in_global = sorted(
      step for step in step_ids
      if sorted(per_step_reads[step]) != sorted(first["steps"][str(step)]["global"]))
  epochs = collections.defaultdict(list)
  for step in step_ids:
    epochs[step // per_epoch + 1].extend(first["steps"][str(step)]["global"])
  duplicates, never_read, complete = 0, 0, []
  for epoch, seen in epochs.items():
    counts = collections.Counter(seen)
    duplicates += sum(n - 1 for n in counts.values() if n > 1)
    if len(seen) == per_epoch * global_batch:  # every step of the epoch was read
      complete.append(epoch)
      never_read += len(seen) - len(counts)  # kept instances that a duplicate displaced
  ok = not (duplicates or never_read or mismatched or read_twice or not_in_global
            or process_views_differ)
  return {
      "ok": ok,
      "processes": len(results),
      "devices_per_process": first["devices"],
      "instances_in_files": first["instances"],
      "batches_per_epoch": per_epoch,
      "steps": [step_ids[0], step_ids[-1]] if step_ids else [],
      "instances_read": sum(reads.values()),
      "instances_read_per_process": [reads[p] for p in sorted(reads)],
      "duplicates_within_epoch": duplicates,
      "complete_epochs": sorted(complete),
      "never_read_in_complete_epochs": never_read,
      "steps_read_by_two_processes": read_twice,
      "steps_whose_reads_differ_from_global_batch": not_in_global,
      "steps_mismatching_single_process_order": sorted(mismatched),
      "steps_where_processes_disagree": process_views_differ,
      "digests": {s: first["steps"][str(s)]["digest"] for s in step_ids},
  }


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(args: argparse.Namespace, timeout: float = 600,
           data: DataConfig | None = None) -> dict[str, Any]:
  """Runs the P worker processes and returns the merged report."""
  data = data or _data_config(args)
  with tempfile.TemporaryDirectory() as out:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={args.devices_per_process}")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
    coordinator = f"localhost:{_free_port()}"
    base = [sys.executable, "-m", "olmo3.data.exactly_once", "--_worker", "--_out", out,
            "--_coordinator", coordinator, "--_data", json.dumps(dataclasses.asdict(data))
            ] + _forwarded(args)
    procs = [subprocess.Popen(base + ["--_process_id", str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(args.processes)]
    logs = []
    try:
      for p in procs:
        logs.append(p.communicate(timeout=timeout)[0])
    finally:
      for p in procs:
        p.kill()
    failed = [i for i, p in enumerate(procs) if p.returncode]
    if failed:
      raise RuntimeError(f"audit process {failed[0]} failed:\n{logs[failed[0]][-4000:]}")
    results = []
    for i in range(args.processes):
      with open(os.path.join(out, f"process{i:03d}.json")) as f:
        results.append(json.load(f))
  return analyze(results, data.global_batch_size)


def _forwarded(args: argparse.Namespace) -> list[str]:
  flags = ["--processes", str(args.processes), "--devices_per_process",
           str(args.devices_per_process), "--steps", str(args.steps), "--start_step",
           str(args.start_step)]
  return flags + (["--dump", args.dump] if args.dump else [])


def format_report(report: dict[str, Any]) -> str:
  rows = [(k, v) for k, v in report.items() if k not in ("digests", "ok")]
  width = max(len(k) for k, _ in rows)
  lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
  lines.append(("PASS: every instance read exactly once; every step equals the single-process "
                "order") if report["ok"] else "FAIL: see the non-empty fields above")
  return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
  parser = program.parser("python -m olmo3.data.exactly_once", __doc__)
  parser.add_argument("--paths", nargs="+", help="token files, in mix order")
  parser.add_argument("--seq_len", type=int)
  parser.add_argument("--max_target_seq_len", type=int, default=None,
                      help="shuffle runs of this many tokens (DataConfig.max_target_seq_len); "
                      "default: single instances")
  parser.add_argument("--global_batch", type=int, help="instances per step")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=2)
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--start_step", type=int, default=0)
  parser.add_argument("--workers", type=int, default=0, help="Grain worker processes per host")
  parser.add_argument("--dump", default=None, help="directory for per-process rows of each step")
  parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--_process_id", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--_coordinator", default="", help=argparse.SUPPRESS)
  parser.add_argument("--_out", default="", help=argparse.SUPPRESS)
  parser.add_argument("--_data", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.process_id, args.coordinator, args.out = args._process_id, args._coordinator, args._out
  return args


def main(argv: list[str] | None = None, data: DataConfig | None = None) -> int:
  """The CLI; `data` audits a given config (launch/audit.py passes an experiment's)."""
  args = parse(argv)  # the program's opening (olmo3.program.parser)
  if args._worker:
    worker(args)
    return 0
  data = data or _data_config(args)  # bad flags fail here, before any process starts
  if args.dump:
    os.makedirs(args.dump, exist_ok=True)
  report = launch(args, data=data)
  print(format_report(report))
  print(json.dumps(report))
  return 0 if report["ok"] else 1


if __name__ == "__main__":
  sys.exit(program.reported(main, lambda: ())())  # Ctrl-C and settings: one line
