"""A restart of the 7B stage 1 on tpu7x:4x8x8 after a lost host, priced phase by phase, and the
goodput of the whole run at one preemption a day with the checkpoint cadence that maximises it.

  python benchmarks/restart_7b.py [--quick] [--startup_json FILE] [--out FILE.json]

Measured here, each in a process of its own as a restarted host would run it:
- detection: the real launcher as a 2-process CPU job, one process SIGKILLed (a crash: its
  sockets close, and the survivor's next collective fails at once) or SIGSTOPped (a lost host:
  its connections stay open, and only the coordination service's heartbeat timeout, the 30 s
  that launch/cluster.py renders, finds it) mid-run; the seconds until the survivor has
  exited, for a lost worker and a lost coordinator; the price takes the SIGSTOPped ones;
- imports: a fresh interpreter importing the launcher and everything a launch imports;
- the plan: the sizes of 1,016 objects looked up in a GCS emulator bucket (fake-gcs-server on
  this machine), as every launch looks up its remote token files;
- tracing and lowering the 7B's train step for the topology's 512 devices (the host's share of
  a compile that the persistent cache otherwise serves);
- one host's share of the train state (the 7B's parameters and both Adam moments, 87.6 GB in
  all, split 64 ways: every array of the 7B's tree, its largest axis cut by 64, over this
  machine's 8 simulated devices as one tpu7x host's 8): saved through the run's checkpointer
  (async, as training saves) and restored through its verified restore, on local disk and in
  the GCS emulator;
- the first batch: benchmarks/startup_7b.py (run here unless --startup_json gives its JSON);
  the lost host's replacement starts with an empty cache, so it computes the epoch's order
  (startup's cold figure) while the surviving hosts read theirs (its restart figures).
What this machine cannot measure is assumed and named in the output (`assumed`): the step time
(the analytic FLOPs at the TPU reproduction's 44.5% MFU), a lost host's replacement (JobSet
recreating the pods), loading the compiled program from the persistent cache, and that every
host reads its share from the bucket at the rate measured here, in parallel.
Prints a Markdown table and one JSON object (`--out` writes it too).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # olmo3/, launch/ and harness/ (the price, the storage servers)

from harness import restart_price  # noqa: E402
from launch import peers  # noqa: E402


def _child(phase: str, *args: str, env: dict[str, str] | None = None, timeout: int = 1800
           ) -> dict:
  """Runs `phase` of this script in a fresh process; its last stdout line is its JSON."""
  done = subprocess.run([sys.executable, os.path.abspath(__file__), "--phase", phase, *args],
                        cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True,
                        text=True, timeout=timeout)
  if done.returncode != 0:
    raise RuntimeError(f"phase {phase} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


# ---- phases (each in its own process) ---------------------------------------------------------

def phase_imports() -> dict:
  start = time.perf_counter()
  # What a launch imports before it reads its config: the launcher and the training stack.
  import launch.main  # noqa: F401  pylint: disable=unused-import
  import olmo3.train.loop  # noqa: F401  pylint: disable=unused-import
  return {"imports_s": time.perf_counter() - start}


def phase_sizes(bucket_url: str) -> dict:
  from olmo3.io import file_sizes

  urls = [f"{bucket_url}/mix/part-{i:04d}.npy" for i in range(restart_price.MIX_FILES)]
  start = time.perf_counter()
  sizes = file_sizes.SizeCache(None).sizes(urls)
  seconds = time.perf_counter() - start
  assert all(s is not None for s in sizes), "an object was not found"
  return {"sizes_s": seconds, "files": len(urls)}


def phase_lower(topology: str) -> dict:
  import fiddle as fdl

  from launch import refs
  from olmo3.placement import ShardedModel
  from olmo3.train import aot
  from olmo3.train.state import StateLayout
  from olmo3.train.step import abstract_inputs, jit_train_step

  exp = fdl.build(refs.resolve("experiments.olmo3_7b:stage1"))
  model = ShardedModel.for_experiment(exp, aot.topology_devices(topology))
  start = time.perf_counter()
  layout = StateLayout(exp, model)
  with model.context():
    jit_train_step(exp, model, layout).lower(*abstract_inputs(exp, model, layout))
  return {"trace_and_lower_s": time.perf_counter() - start}


def _host_share():
  """(params, opt_state, params_target, opt_target, bytes): one tpu7x host's share of the 7B's
  train state on this machine's 8 devices: each array of the 7B's parameter tree with its
  largest axis cut by the hosts, sharded over the devices along it; the moments (mu, nu) alike; the
  targets a restore reads them onto."""
  import fiddle as fdl
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  from launch import refs
  from olmo3.placement import ShardedModel

  exp = fdl.build(refs.resolve("experiments.olmo3_7b:stage1"))
  shapes = ShardedModel.for_experiment(exp, jax.devices()[:1]).param_shapes
  mesh = jax.make_mesh((len(jax.devices()),), ("host",), devices=jax.devices())

  def share(s, seed):
    shape = list(s.shape)
    axis = int(np.argmax(shape))
    shape[axis] //= restart_price.HOSTS
    spec = [None] * len(shape)
    if shape[axis] % mesh.size == 0:
      spec[axis] = "host"
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    make = jax.jit(lambda: jax.random.normal(jax.random.key(seed), shape, s.dtype) * 0.02,
                   out_shardings=sharding)
    return make(), jax.ShapeDtypeStruct(tuple(shape), s.dtype, sharding=sharding)

  leaves, treedef = jax.tree.flatten(shapes)
  made = [[share(s, 3 * i + k) for i, s in enumerate(leaves)] for k in range(3)]
  trees = [jax.tree.unflatten(treedef, [m[0] for m in kind]) for kind in made]
  targets = [jax.tree.unflatten(treedef, [m[1] for m in kind]) for kind in made]
  nbytes = sum(x.nbytes for t in trees for x in jax.tree.leaves(t))
  jax.block_until_ready(trees)
  return trees[0], {"mu": trees[1], "nu": trees[2]}, targets[0], {"mu": targets[1],
                                                                  "nu": targets[2]}, nbytes


def phase_checkpoint(directory: str) -> dict:
  from olmo3.train.run_checkpoints import RunCheckpoints, restore_train_state

  from olmo3.io import checkpoint

  params, opt_state, params_target, opt_target, nbytes = _host_share()
  # The checksums a save records and a restore verifies: computed by the devices (here the
  # CPU; a TPU's at HBM speed), timed apart once their programs are compiled.
  checkpoint.array_records(directory, {"params": params, "opt_state": opt_state})
  start = time.perf_counter()
  checkpoint.array_records(directory, {"params": params, "opt_state": opt_state})
  checksums = time.perf_counter() - start
  # The copy off the devices, which is what an asynchronous save blocks the loop on (its
  # checksums run on the devices: at HBM speed on a TPU): timed by itself, as a copy to host
  # memory, never as the save less an estimate of the checksums, which a busy machine made
  # negative ("math domain error" in Young's interval). A CPU device's arrays are host memory
  # already (jax.device_get returns them without a copy, and a second call its cached result:
  # 0.4 ms for 1.37 GB, which priced a save at nothing), so the stand-in is a copy of the
  # host's share into host memory already mapped, as a TPU's DMA fills staging buffers.
  import jax
  import numpy as np

  views = jax.tree.leaves(jax.device_get((params, opt_state)))
  staging = [np.ones_like(v) for v in views]  # mapped and touched before the clock starts
  start = time.perf_counter()
  for out, v in zip(staging, views):
    np.copyto(out, v)
  copy = time.perf_counter() - start
  del staging, views
  checkpoints = RunCheckpoints(directory, keep=2, async_save=True)
  start = time.perf_counter()
  checkpoints.save(1000, params, opt_state, {"step": 1000})
  blocking = time.perf_counter() - start  # what the training loop waits for
  checkpoints.wait()
  total = time.perf_counter() - start
  del params, opt_state
  start = time.perf_counter()
  restored = restore_train_state(checkpoints.step_dir(1000), params_target, opt_target)
  jax.block_until_ready(restored[:2])
  restore = time.perf_counter() - start
  gb = nbytes / 1e9
  return {"gb": gb, "checksums_s": checksums, "save_blocking_s": blocking,
          "copy_off_devices_s": copy, "save_s": total,
          "restore_s": restore,
          # the storage's share: the whole less the checksums (one pass each way)
          "save_io_gb_per_s": gb / max(total - checksums, 1e-9),
          "restore_io_gb_per_s": gb / max(restore - checksums, 1e-9)}


def phase_detection(workdir: str, lost: int, how: str = "SIGKILL", heartbeat_s: str = "100"
                    ) -> dict:
  """The tiny stage 1 as a 2-process job of the real launcher; process `lost` sent `how` after
  its second logged step (SIGKILL: its sockets close with it, as a crashed process's; SIGSTOP:
  it stops answering with its connections open, as a host that lost power or its network);
  seconds from the signal until the other process has exited, at the coordination service's
  heartbeat timeout `heartbeat_s` (OLMO3_HEARTBEAT_TIMEOUT_S)."""
  port = _free_port()
  procs, logs = [], []
  for rank in range(2):
    env = {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(rank),
           "OLMO3_HEARTBEAT_TIMEOUT_S": heartbeat_s,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    log = open(os.path.join(workdir, f"rank{rank}.log"), "w")
    logs.append(log)
    procs.append(subprocess.Popen(
        [sys.executable, "launch/main.py", "--fdl_config=experiments.olmo3_tiny:stage1",
         f"--workdir={workdir}/run", "--fdl_set=train.steps=100000", "--fdl_set=train.log_every=1",
         "--fdl_set=train.eval_every=0", "--fdl_set=checkpoint.every=100000",
         "--fdl_set=data.global_batch_size=8", "--fdl_set=data.seq_len=128"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
  metrics = os.path.join(workdir, "run", "metrics.jsonl")
  deadline = time.time() + 600
  while not (os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= 2):
    if time.time() > deadline or any(p.poll() is not None for p in procs):
      raise RuntimeError("the job did not reach its second step: "
                         + open(logs[0].name).read()[-2000:])
    time.sleep(0.2)
  procs[lost].send_signal(getattr(signal, how))
  killed = time.perf_counter()
  survivor = procs[1 - lost]
  survivor.wait(timeout=600)
  seconds = time.perf_counter() - killed
  procs[lost].kill()
  procs[lost].wait()
  for log in logs:
    log.close()
  last = [l for l in open(logs[1 - lost].name).read().splitlines() if l.strip()][-1:]
  return {"detect_s": seconds, "survivor_exit": survivor.returncode,
          "survivor_last_line": last[0] if last else ""}


def phase_lease(workdir_url: str) -> dict:
  """The restarted job's lease in the bucket: the lost attempt's lease (attempt 0, another host,
  renewed no more) taken at once by the JobSet's next attempt (olmo3.run.lease); seconds from
  the new launch's first read of it to its own lease written."""
  from olmo3.run import lease

  os.environ.update({lease.JOB_ENV: "jobset-uid", lease.ATTEMPT_ENV: "0"})
  lost = lease.Lease(workdir_url)
  lost.record.update(host="the-lost-host")
  lost.acquire()
  lost._stop.set()  # pylint: disable=protected-access  # the host is gone: no more renewals
  os.environ[lease.ATTEMPT_ENV] = "1"
  start = time.perf_counter()
  later = lease.Lease(workdir_url)
  later.acquire()
  took = time.perf_counter() - start
  later.release()
  return {"takeover_s": took}


def _free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--phase", help=argparse.SUPPRESS)
  parser.add_argument("--arg", action="append", default=[], help=argparse.SUPPRESS)
  parser.add_argument("--quick", action="store_true",
                      help="skip tracing the 7B and the startup benchmark (use --startup_json)")
  parser.add_argument("--startup_json", help="benchmarks/startup_7b.py's JSON, not rerun")
  parser.add_argument("--topology", default="tpu7x:4x8x8")
  parser.add_argument("--preemptions_per_day", type=float, default=1.0)
  parser.add_argument("--out", help="also write the JSON here")
  args = parser.parse_args()
  from olmo3 import platforms

  platforms.choose()  # the CPU: no TPU probing (the topology is compiled for, not run on)
  if args.phase:
    phases = {"imports": phase_imports, "sizes": phase_sizes, "lower": phase_lower,
              "checkpoint": phase_checkpoint, "lease": phase_lease,
              "detection": lambda w, lost, *rest: phase_detection(w, int(lost), *rest)}
    print(json.dumps(phases[args.phase](*args.arg)))
    return
  from harness import storage_servers as servers

  eight = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  measured: dict = {}
  with tempfile.TemporaryDirectory() as tmp:
    measured["imports"] = _child("imports")
    # A crashed process (its sockets closed with it) and a lost host (frozen: its connections
    # stay open, so only the heartbeat timeout the rendered jobs set finds it).
    for how in ("SIGKILL", "SIGSTOP"):
      for lost in (1, 0):
        workdir = os.path.join(tmp, f"detect{lost}{how}")
        os.makedirs(workdir)
        measured[f"detection_{how}_{'worker' if lost else 'coordinator'}"] = _child(
            "detection", "--arg", workdir, "--arg", str(lost), "--arg", how, "--arg",
            str(peers.CLUSTER_HEARTBEAT_S))
    server = servers.GcsServer(os.path.join(tmp, "gcs"))
    server.start()
    try:
      server.make_bucket("run")
      _upload_empty_objects(server, "run", restart_price.MIX_FILES)
      measured["plan"] = _child("sizes", "--arg", "gs://run", env=server.env)
      measured["lease"] = _child("lease", "--arg", "gs://run/workdir", env=server.env)
      measured["checkpoint_local"] = _child("checkpoint", "--arg", os.path.join(tmp, "ckpt"),
                                            env=eight)
      measured["checkpoint_gcs"] = _child("checkpoint", "--arg", "gs://run/ckpt",
                                          env={**server.env, **eight})
    finally:
      server.close()
  if not args.quick:
    measured["lower"] = _child("lower", "--arg", args.topology)
  if args.startup_json:
    with open(args.startup_json) as f:
      startup = json.load(f)
  elif not args.quick:
    done = subprocess.run([sys.executable, "benchmarks/startup_7b.py"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    startup = json.loads(done.stdout.strip().splitlines()[-1])
  else:
    startup = {"first_batch_new_host_beside_s": float("nan")}
  result = restart_price.price(measured, startup, args.preemptions_per_day)
  print(restart_price.markdown(result))
  print(json.dumps(result))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


def _upload_empty_objects(server, bucket: str, n: int) -> None:
  """n small objects under mix/ (a lookup costs the same whatever the object's size)."""
  import concurrent.futures
  import urllib.request

  def put(i: int) -> None:
    url = (f"{server.url}/upload/storage/v1/b/{bucket}/o?uploadType=media"
           f"&name=mix/part-{i:04d}.npy")
    request = urllib.request.Request(url, data=b"\0" * 64, method="POST",
                                     headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(request, timeout=30).close()

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    list(pool.map(put, range(n)))


if __name__ == "__main__":
  main()
