"""What a restarted 7B stage-1 job waits for before its first batch, and what its loader holds.

  python benchmarks/startup_7b.py [--root DIR] [--workers N]

Lays out AI2's stage-1 mix (OLMo-mix-0625-official: its 1,016 token files at their paths) as
sparse files of 23.3 GB on average, 5.93T tokens in all (723,876,444 instances of 8,192, as
AI2's run counted them; nothing is downloaded, nothing is written but the files' lengths),
then measures in separate processes, as launches of the real job would:
- the plan: sizing the 1,016 files and cutting them into instances;
- the first batch (the experiment's global batch of 512 x 8192, all on this host: the worst
  case for one host) with the experiment's loader workers, at step 0 on a machine that never
  ran the job (cold: the epoch's order computed) and after a restart (warm: the order kept by
  the first launch), and at step 1,000,000 after a restart;
- the peak resident memory (VmHWM) of every process of each launch: the main process and each
  loader worker.
Then, the run's workdir in a bucket (a GCS emulator): a launch keeps the order beside the run,
and a host new to the run (an empty cache) reads its first batch's block of it from there.
Prints one JSON object: first_batch_cold_s, first_batch_restart_s (step 0 and 1,000,000),
first_batch_new_host_beside_s, keeping_beside_s,
plan_s, max_rss_gb_per_process (per launch), instances.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTANCES = 723_876_444  # AI2's stage 1: OLMo-mix-0625-official at 8,192 tokens
SEQ_LEN = 8192


def lay_out(root: str) -> int:
  """The mix's files as sparse files whose instance counts sum to INSTANCES (sizes drawn around
  the mean, seeded); returns how many."""
  import fiddle as fdl
  import numpy as np

  from launch import refs
  from olmo3.data import sources

  exp = fdl.build(refs.resolve("experiments.olmo3_7b:stage1"))
  files = sources.read_mix(exp.data.mix, root, exp.data.tokenizer_id)
  weights = np.random.default_rng(0).uniform(0.5, 1.5, len(files))
  counts = np.floor(weights / weights.sum() * INSTANCES).astype(np.int64)
  counts[: INSTANCES - counts.sum()] += 1
  for f, n in zip(files, counts):
    os.makedirs(os.path.dirname(f.path), exist_ok=True)
    with open(f.path, "wb") as out:
      out.truncate(int(n) * SEQ_LEN * 4)  # uint32 tokens, all zeros (a valid id), no blocks
  return len(files)


def _descendants(pid: int) -> list[int]:
  children = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry))
      except (OSError, IndexError, ValueError):
        pass
  return children + [d for c in children for d in _descendants(c)]


def _hwm_gb(pid: int) -> float | None:
  try:
    with open(f"/proc/{pid}/status") as f:
      line = next(l for l in f if l.startswith("VmHWM:"))
    return int(line.split()[1]) / 1e6
  except (OSError, StopIteration):
    return None


def launch(root: str, step: int, workers: int, beside: str | None = None) -> dict:
  """One launch's loader, measured in its own process (`beside`: the run's kept order in a
  bucket, as a run whose workdir is there has it)."""
  import fiddle as fdl
  import jax
  import numpy as np

  from launch import refs
  from olmo3 import sharding
  from olmo3.data import pipeline, sources

  peaks: dict[int, float] = {}
  done = threading.Event()

  def watch():  # every process of this launch: this one and its loader workers
    while not done.is_set():
      for pid in [os.getpid(), *_descendants(os.getpid())]:
        gb = _hwm_gb(pid)
        if gb is not None:
          peaks[pid] = max(peaks.get(pid, 0.0), gb)
      time.sleep(0.1)

  threading.Thread(target=watch, daemon=True).start()
  exp = fdl.build(refs.resolve("experiments.olmo3_7b:stage1", [f"data.root={root!r}",
                                                               f"data.num_workers={workers}"]))
  start = time.perf_counter()
  source = sources.token_files(exp.data, exp.model.vocab_size)
  plan_s = time.perf_counter() - start
  mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
  batch_sharding = jax.sharding.NamedSharding(
      mesh, sharding.logical_to_spec(("batch", "seq"), sharding.FSDP_RULES))
  loader = pipeline.Loader(exp.data, batch_sharding, start_step=step, num_steps=2, source=source,
                           order_beside=beside)
  batch = next(loader.host_batches())
  first_s = time.perf_counter() - start
  assert int(batch["step"]) == step and batch["input_ids"].shape == (512, SEQ_LEN)
  instance = np.asarray(batch["instance"])[:4].tolist()
  time.sleep(0.3)
  done.set()
  return {"step": step, "plan_s": round(plan_s, 2), "first_batch_s": round(first_s, 2),
          "instances": len(source), "first_instances": instance,
          "rss_gb": sorted((round(v, 2) for v in peaks.values()), reverse=True)}


def _child(root: str, cache: str, step: int, workers: int, beside: str | None = None,
           env: dict[str, str] | None = None) -> dict:
  env = dict(os.environ, OLMO3_CACHE=cache, **(env or {}))
  done = subprocess.run([sys.executable, __file__, "--child", str(step), "--root", root,
                         "--workers", str(workers)] + (["--beside", beside] if beside else []),
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
  if done.returncode:
    raise RuntimeError(done.stderr[-3000:])
  return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", help="where to lay out the sparse files (default: a temp dir)")
  parser.add_argument("--workers", type=int, default=None,
                      help="loader workers (default: the experiment's, 2)")
  parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--beside", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  sys.path.insert(0, ROOT)
  from olmo3 import platforms

  platforms.choose()  # the CPU: no TPU probing
  if args.child is not None:
    print(json.dumps(launch(args.root, args.child, args.workers, args.beside)))
    return
  if args.workers is None:
    import fiddle as fdl

    from launch import refs

    args.workers = fdl.build(refs.resolve("experiments.olmo3_7b:stage1")).data.num_workers
  work = tempfile.mkdtemp(prefix="olmo3-startup-")
  try:
    root = args.root or os.path.join(work, "data")
    files = lay_out(root)
    cache = os.path.join(work, "cache")  # the machine's cache: empty, as a new host's
    cold = _child(root, cache, 0, args.workers)
    warm = _child(root, cache, 0, args.workers)
    later = _child(root, cache, 1_000_000, args.workers)
    # A run in a bucket (a GCS emulator here): its first launch's process 0 keeps the order
    # beside it; a host new to the run (its cache empty) reads the block it needs from there.
    from harness import storage_servers as servers

    server = servers.GcsServer(os.path.join(work, "gcs"))
    server.start()
    try:
      server.make_bucket("run")
      beside = "gs://run/workdir/order"
      start = time.perf_counter()
      _child(root, cache, 0, args.workers, beside, server.env)
      keep_s = time.perf_counter() - start - warm["first_batch_s"]
      new_host = _child(root, os.path.join(work, "new-host-cache"), 1_000_000, args.workers,
                        beside, server.env)
    finally:
      server.close()
  finally:
    shutil.rmtree(work, ignore_errors=True)
  # The kept order is the order: the batches the launches read are those of the permutation
  # computed here, in this process, as before it was shared.
  import fiddle as fdl

  from launch import refs
  from olmo3.data.order import epoch_permutation

  data = fdl.build(refs.resolve("experiments.olmo3_7b:stage1")).data
  order = epoch_permutation(INSTANCES, data.seed, 1, data.chunk_instances)
  b = data.global_batch_size
  batch = lambda step: order[step * b:step * b + 4].tolist()
  assert cold["first_instances"] == warm["first_instances"] == batch(0), (cold, batch(0))
  assert later["first_instances"] == new_host["first_instances"] == batch(1_000_000), (
      later, new_host, batch(1_000_000))
  print(json.dumps({
      "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
      f"{os.cpu_count()} CPUs", "files": files, "instances": cold["instances"],
      "workers": args.workers, "plan_s": warm["plan_s"],
      "first_batch_cold_s": cold["first_batch_s"],
      "first_batch_restart_s": {"step_0": warm["first_batch_s"],
                                "step_1000000": later["first_batch_s"]},
      # a host new to a run in a bucket, at step 1,000,000; and what keeping the order there
      # cost the first launch (about: the launch less a warm one's first batch)
      "first_batch_new_host_beside_s": new_host["first_batch_s"],
      "keeping_beside_s": round(keep_s, 1),
      "max_rss_gb_per_process": {"cold": cold["rss_gb"], "restart": warm["rss_gb"],
                                 "restart_step_1000000": later["rss_gb"]}}))


if __name__ == "__main__":
  main()
