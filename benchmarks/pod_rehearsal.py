"""The pod in a box: the real launcher as a 4-process x 2-device job, started the way a SLURM
cluster starts it, taken through the faults a weeks-long run meets, in order:

  a. SIGTERM to one process only: all four stop at the step they agree on, save it, exit 0;
  b. SIGKILL of one process: the other three exit non-zero within a bounded time (JAX's
     coordination heartbeat, OLMO3_HEARTBEAT_TIMEOUT_S), and the same job requeued (its job id,
     restart count 1, the same hostnames, the lease the dead job left behind, taken over by
     that attempt number) resumes from the newest checkpoint;
  c. the store down mid-run (during a checkpoint save: connections refused, those open cut)
     and back within the retry budget (OLMO3_STORAGE_RETRY_S): nothing lost;
  d. the run resumed on 1 process x 2 devices (a quarter of the devices): the same data order;
  e. stage 2 initialised from the bucket's stage-1 checkpoint, evaluating its held-out set and
     tasks on 4 processes: equal to `python -m olmo3.eval` of that checkpoint in 1 process.

  python benchmarks/pod_rehearsal.py          # the whole rehearsal (RESULTS.md: its time)
  python benchmarks/pod_rehearsal.py --quick  # a-d on a 2 x 2 job: tests/test_pod_rehearsal.py

The quick mode is the test's: the same faults and checks on 2 processes x 2 devices (the
signals to task 1; d resizes to 1 process of 1 device, the shape of the suite's single-process
launches, whose programs the session's compilation cache holds), fewer steps, no audit, no
stage 2. On 2 cores an 8-device step of the tiny model costs about twice a 4-device one
(XLA:CPU runs a collective per sharded weight), and every process of a job starts, imports
and compiles on the same cores: the full job's shape is measured here, not in every suite run.

The run is the tiny recipe (experiments.olmo3_tiny:stage1, with the half-length instances the
reliability tests use). Every job is the sbatch script `launch/slurm.py` renders for its nodes
(a process of 2 devices each), run by bash with harness/slurm_standin/srun first on PATH (as
tests/test_reliability.py runs its SLURM jobs): JAX's SLURM detection joins the tasks. The
workdir is in a bucket of fake-gcs-server (its filesystem backend, so its objects outlive the
server's restart); the token files, held-out split and tokenizer come over HTTP from
olmo3.data.serve's Range server, 20 ms away, answering 5% of requests with HTTP 500.

Checks: against an uninterrupted job of the same sharding, the parameters and Adam moments where
the job ends bit-equal, and its losses equal but for at most one unit in the last place
(XLA:CPU's sum across processes does not always round alike); the resized steps' losses within
1e-6 (relative); every instance read at most once in the epoch and each step's batch the global
order's (launch/audit.py, on both meshes, over the same faulty HTTP server); no committed
checkpoint ever lost (beyond rotation); a history.jsonl line per launch; stage 2's 4-process
evaluation equal to the 1-process one. Prints one JSON object:
each fault with the steps it cost and the seconds from fault to exit or recovery, the checks,
and `failures` (empty when every check passed); exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from olmo3 import platforms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRUN_STANDIN = os.path.join(ROOT, "harness", "slurm_standin")
sys.path.insert(0, ROOT)  # harness/ (the storage servers), beside benchmarks/
DEVICES = 2  # per process
BUCKET = "rehearsal"
STAGE1, STAGE2 = f"gs://{BUCKET}/stage1", f"gs://{BUCKET}/stage2"
LATENCY_S, ERROR_RATE = 0.02, 0.05
# The budgets the jobs run under. A dead peer stops the others after the plan's heartbeat_s
# (JAX's default is 100 s; a cluster's scheduler usually kills them sooner: srun's KillWait, a
# JobSet's restart). The store's outage (the plan's outage_s) stays well inside the retry
# budget; a lease whose holder this machine cannot prove dead would be taken over after
# TAKEOVER_S.
RETRY_S, TIMEOUT_S, TAKEOVER_S = 60, 10, 120
# Across the resize, float32 sums run in another order on another mesh: the losses may differ
# by rounding. 1e-6 relative is a few float32 ulps of a loss near 8 (tests/test_reliability.py's
# resize test allows 2e-4 over 8 steps on other meshes); measured: benchmarks/RESULTS.md.
RESIZE_RTOL = 1e-6
# The reliability tests' half-length instances; every row logged; evaluation only in stage 2.
RECIPE = ("--fdl_set=data.global_batch_size=8", "--fdl_set=data.seq_len=128",
          "--fdl_set=train.log_every=1")


@dataclasses.dataclass(frozen=True)
class Plan:
  """The job's processes (of DEVICES each) and the tasks signalled; step counts. The job trains
  stage 1 to `job_steps` (SIGTERM, SIGKILL and the outage fall inside it), the resized run
  continues to `steps`; then, unless `faults_only`, the audit, and stage 2 trains
  `stage2_steps` and evaluates at its last step."""

  processes: int
  resized_devices: int  # d: the one process's devices
  term_task: int  # a: SIGTERM to this task alone
  kill_task: int  # b: SIGKILL of this task
  steps: int
  job_steps: int
  every: int  # checkpoint.every
  stage2_steps: int
  tasks: tuple[str, ...]
  task_limit: int
  max_documents: int
  heartbeat_s: int  # b: a killed task's peers stop this long after its last heartbeat
  outage_s: float  # c: the store is down this long
  faults_only: bool = False


FULL = Plan(processes=4, resized_devices=DEVICES, term_task=2, kill_task=1, steps=20,
            job_steps=15, every=2, stage2_steps=4,
            tasks=("arc_easy_rc_0shot", "boolq_rc_0shot", "hellaswag_rc_0shot", "piqa_rc_0shot"),
            task_limit=20, max_documents=32, heartbeat_s=20, outage_s=8.0)
# The test's: every fault (a-d) and its checks on a 2 x 2 job, resized to 1 x 1, fewer steps,
# no audit and no stage 2 (e), which tests/test_data_exactly_once.py and tests/test_reliability.py's
# 2-process evaluation cover in part; shorter waits (b's heartbeat, c's outage: 10 s of the
# suite's wall time, a core idle), the same checks.
QUICK = Plan(processes=2, resized_devices=1, term_task=1, kill_task=1, steps=12, job_steps=10,
             every=2, stage2_steps=0, tasks=(), task_limit=0, max_documents=0, heartbeat_s=10,
             outage_s=4.0, faults_only=True)


class Failed(Exception):
  """A check failed in a way the rehearsal cannot go on from."""


class Checks:
  """Every check's outcome, by name; `failures` lists those that did not hold, with what was
  found (the numbers of those that held are in the faults' records)."""

  def __init__(self):
    self.results: dict[str, bool] = {}
    self.failures: list[str] = []

  def __call__(self, name: str, ok: bool, found: Any = None) -> bool:
    self.results[name] = ok
    if not ok:
      self.failures.append(f"{name}: {found}" if found is not None else name)
    return ok


# --- the job -------------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
  """Every process below `pid` (Linux /proc)."""
  children: dict[int, list[int]] = {}
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      with contextlib.suppress(OSError):
        with open(f"/proc/{entry}/stat") as f:
          parent = int(f.read().rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
  found, todo = [], [pid]
  while todo:
    kids = children.get(todo.pop(), [])
    found += kids
    todo += kids
  return found


def _environ(pid: int) -> dict[str, str]:
  with contextlib.suppress(OSError):
    with open(f"/proc/{pid}/environ", "rb") as f:
      pairs = [item.partition(b"=") for item in f.read().split(b"\0") if item]
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}
  return {}


class Job:
  """A SLURM job of the launcher: the sbatch script launch/slurm.py renders for `nodes` nodes of
  `devices` CPU devices (one task each), run by bash with the srun stand-in first on PATH. Its
  lines (each task's prefixed with its rank) are collected as they come and kept in a log."""

  def __init__(self, name: str, args: list[str], nodes: int, devices: int,
               env: dict[str, str], logdir: str):
    import fiddle as fdl

    from launch import jobs, refs, slurm

    command = jobs.command_from_args(args, python=sys.executable)
    exp = fdl.build(refs.resolve(command.fdl_config, command.fdl_sets, command.fiddlers))
    job = slurm.SlurmJob(f"rehearsal-{name}", nodes=nodes, gpus_per_node=devices,
                         processes=jobs.Processes.PER_NODE, command=command,
                         env=jobs.job_env(exp))
    jobs.check_experiment(exp, jobs.Target.SLURM, job.devices, 1)
    script = os.path.join(logdir, f"{name}.sbatch")
    with open(script, "w") as f:
      f.write(slurm.slurm_script(job))
    self.name, self.log = name, os.path.join(logdir, f"{name}.log")
    self.lines: list[str] = []
    env = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PATH=os.pathsep.join([SRUN_STANDIN, os.environ["PATH"]]))
    # Its own session: whatever is left of it at the end is stopped as one group.
    self.proc = subprocess.Popen(["bash", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    with open(self.log, "w") as log:
      for line in self.proc.stdout:
        self.lines.append(line.rstrip("\n"))
        log.write(line)
        log.flush()

  def tail(self, n: int = 60) -> str:
    return "\n".join(self.lines[-n:])

  def find(self, pattern: str, rank: int | None = 0) -> list[re.Match]:
    """Matches of `pattern` in the lines of task `rank` (None: the job's own lines, srun's)."""
    prefix = f"{rank}: " if rank is not None else ""
    found = []
    for line in list(self.lines):
      if rank is None and re.match(r"\d+: ", line):
        continue
      if line.startswith(prefix):
        match = re.search(pattern, line[len(prefix):])
        if match:
          found.append(match)
    return found

  def wait_for(self, pattern: str, rank: int | None = 0, seconds: float = 600) -> re.Match:
    """The first match; Failed if the job ends or time runs out first."""
    deadline = time.monotonic() + seconds
    while True:
      found = self.find(pattern, rank)
      if found:
        return found[0]
      ended = self.proc.poll()
      if ended is not None or time.monotonic() > deadline:
        self._reader.join(timeout=10)
        why = f"it ended with {ended}" if ended is not None else "timed out"
        raise Failed(f"job {self.name}: no line matching {pattern!r} from task {rank} "
                     f"({why}):\n{self.tail()}")
      time.sleep(0.05)

  def last_step(self, rank: int = 0) -> int:
    found = self.find(r"\] step (\d+)/\d+: loss", rank)
    return int(found[-1][1]) if found else 0

  def task_pid(self, rank: int) -> int:
    for pid in _descendants(self.proc.pid):
      env = _environ(pid)
      if env.get("SLURM_PROCID") == str(rank) and "launch/main.py" in _cmdline(pid):
        return pid
    raise Failed(f"job {self.name}: no process of task {rank}")

  def signal(self, rank: int, sig: signal.Signals) -> float:
    """Sends `sig` to task `rank`'s process alone; the moment it was sent."""
    os.kill(self.task_pid(rank), sig)
    return time.monotonic()

  def finish(self, seconds: float) -> int:
    try:
      code = self.proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
      self.stop()
      raise Failed(f"job {self.name} still running after {seconds:.0f} s:\n{self.tail()}")
    self._reader.join(timeout=30)
    return code

  def stop(self) -> None:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(self.proc.pid, signal.SIGKILL)
    self.proc.wait()

  def task_failures(self) -> dict[int, str]:
    """The srun stand-in's line for each task that failed: rank -> how it ended."""
    return {int(m[1]): m[2] for m in self.find(r"^srun: error: \S+: task (\d+): (.*)$", None)}


def _cmdline(pid: int) -> str:
  with contextlib.suppress(OSError):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().replace(b"\0", b" ").decode(errors="replace")
  return ""


# --- the rehearsal -------------------------------------------------------------------------


class Rehearsal:
  """The servers, the jobs in order and their checks, under `directory` (the jobs' scripts and
  logs in logs/, the bucket's objects in gcs/, the served corpus in served/)."""

  def __init__(self, plan: Plan, directory: str):
    import fiddle as fdl

    from harness import storage_servers as servers
    from launch import refs
    from olmo3.data import embedded

    self.plan, self.dir = plan, directory
    self.logs = os.path.join(directory, "logs")
    os.makedirs(self.logs)
    # The embedded corpus as a prepared directory named "embedded" on the HTTP server.
    served = os.path.join(directory, "served")
    shutil.copytree(embedded.corpus_dir(), os.path.join(served, "embedded"),
                    ignore=shutil.ignore_patterns(".lock"))
    self.http = servers.InstrumentedRangeServer(served, latency_s=LATENCY_S,
                                                error_rate=ERROR_RATE, seed=0)
    self.gcs = servers.GcsServer(os.path.join(directory, "gcs"))
    self.checks = Checks()
    self.keep = fdl.build(refs.resolve("experiments.olmo3_tiny:stage1")).checkpoint.keep
    self.faults: list[dict[str, Any]] = []
    self.committed_seen: set[int] = set()  # every step seen committed after a phase
    self.jobs: list[Job] = []
    self.resize_diff: dict[str, float] = {}  # the losses after d against the straight job's
    self.same_sharding: dict[str, int] = {}  # the job's losses against the straight job's
    self.state_equal: bool | None = None  # the job's last state against the straight job's
    self.kill_job_id = ""  # b's SLURM job id, which its requeue keeps

  @contextlib.contextmanager
  def servers(self) -> Iterator[None]:
    with self.http:
      self.gcs.start()
      try:
        self.gcs.make_bucket(BUCKET)
        yield
      finally:
        for job in self.jobs:
          if job.proc.poll() is None:
            job.stop()
        self.gcs.close()

  # --- helpers ---

  @property
  def mix(self) -> str:
    return f"{self.http.url}/embedded"

  def env(self) -> dict[str, str]:
    from olmo3.io import settings
    from olmo3.run import lease

    from launch import peers

    base = {k: v for k, v in os.environ.items()
            if k != "XLA_FLAGS" and not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES",
                                                      "JAX_PROCESS_ID", "SLURM_"))}
    return dict(base, **self.gcs.env, **{
        settings.RETRY_ENV: str(RETRY_S), settings.TIMEOUT_ENV: str(TIMEOUT_S),
        lease.TAKEOVER_ENV: str(TAKEOVER_S), peers.HEARTBEAT_ENV: str(self.plan.heartbeat_s)})

  def stage1_args(self, steps: int, workdir: str, every: int) -> list[str]:
    return ["--fdl_config=experiments.olmo3_tiny:stage1", *RECIPE,
            f"--fdl_set=data.mix='{self.mix}'", "--fdl_set=train.eval_every=0",
            "--fdl_set=eval.tasks=()", f"--fdl_set=checkpoint.every={every}",
            f"--fdl_set=train.steps={steps}", f"--workdir={workdir}"]

  def job(self, name: str, args: list[str], nodes: int | None = None,
          devices: int = DEVICES, env: dict[str, str] | None = None) -> Job:
    job = Job(name, args, nodes or self.plan.processes, devices, {**self.env(), **(env or {})},
              self.logs)
    self.jobs.append(job)
    return job

  def committed(self, workdir: str) -> list[int]:
    prefix = workdir.removeprefix(f"gs://{BUCKET}/") + "/checkpoints/"
    return sorted(int(m[1]) for name in self.gcs.list(BUCKET, prefix)
                  if (m := re.fullmatch(re.escape(prefix) + r"(\d+)/commit_success\.txt", name)))

  def exists(self, workdir: str, name: str) -> bool:
    path = workdir.removeprefix(f"gs://{BUCKET}/") + "/" + name
    return path in self.gcs.list(BUCKET, path)

  def read(self, workdir: str, name: str) -> bytes:
    return self.gcs.read(BUCKET, workdir.removeprefix(f"gs://{BUCKET}/") + "/" + name)

  def rows(self, workdir: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in self.read(workdir, "metrics.jsonl").decode().splitlines()
            if line.strip()]

  def snapshot(self, phase: str) -> None:
    """No committed checkpoint lost: every step seen committed after an earlier phase is still
    committed, unless rotation removed it (older than the newest checkpoint.keep)."""
    now = self.committed(STAGE1)
    newest = now[-self.keep:]
    lost = sorted(s for s in self.committed_seen if s not in now and s > min(newest, default=0))
    self.checks(f"no checkpoint lost ({phase})", not lost, {"committed": now, "lost": lost})
    self.committed_seen.update(now)

  # --- the phases ---

  def straight(self) -> dict[int, float]:
    """The uninterrupted job of the same sharding (a local workdir; the same HTTP data), saving
    at the step the faulty job ends too, to compare their states there."""
    from olmo3.io import metrics

    workdir = os.path.join(self.dir, "straight")
    job = self.job("straight", self.stage1_args(self.plan.steps, workdir,
                                                every=self.plan.job_steps))
    code = job.finish(1800)
    if code != 0:
      raise Failed(f"the uninterrupted job exited {code}:\n{job.tail()}")
    return {r["step"]: r["loss"] for r in metrics.read_jsonl(os.path.join(workdir,
                                                                          "metrics.jsonl"))}

  def sigterm(self) -> int:
    """a: SIGTERM to one task alone (term_task), once the first checkpoint is saved."""
    p = self.plan
    job = self.job("a-sigterm", self.stage1_args(p.job_steps, STAGE1, p.every))
    job.wait_for(rf"\] step {p.every + 1}/")
    at = job.last_step()
    sent = job.signal(p.term_task, signal.SIGTERM)
    code = job.finish(600)
    took = time.monotonic() - sent
    stops = {rank: [int(m[2]) for m in job.find(r"interrupted \((\w+)\) at step (\d+): saved",
                                                rank)] for rank in range(p.processes)}
    stopped = stops[0][0] if stops[0] else None
    self.checks("a: every task stopped at the same step", all(
        s == [stopped] for s in stops.values()) and stopped is not None, stops)
    self.checks("a: the job exited 0", code == 0, {"code": code, "tasks": job.task_failures()})
    committed = self.committed(STAGE1)
    logged = max(r["step"] for r in self.rows(STAGE1))
    self.checks("a: the step it stopped at is saved", stopped in committed and logged == stopped,
                {"stopped": stopped, "committed": committed, "logged": logged})
    self.checks("a: the lease was released", not self.exists(STAGE1, "lease.json"))
    self.faults.append({"fault": f"SIGTERM to task {p.term_task} only", "signalled_at_step": at,
                        "stopped_at_step": stopped, "exit_code": code,
                        "steps_lost": logged - max(committed),
                        "seconds_from_signal_to_exit": round(took, 1)})
    self.snapshot("a")
    return stopped

  def sigkill(self, resumed_at: int) -> int:
    """b: SIGKILL of one task (kill_task) after the job's first save since resuming."""
    p = self.plan
    job = self.job("b-sigkill", self.stage1_args(p.job_steps, STAGE1, p.every))
    resumed = int(job.wait_for(r"resumed from \S+/(\d+) \(step")[1])
    # The id the job's tasks got (srun's stand-in chose one): its requeue keeps it.
    self.kill_job_id = _environ(job.task_pid(0))["SLURM_JOB_ID"]
    self.checks("b: resumed from the step the SIGTERM saved", resumed == resumed_at,
                {"resumed": resumed, "expected": resumed_at})
    saved = int(job.wait_for(r"saving the checkpoint of step (\d+)")[1])
    job.wait_for(rf"\] step {saved + 1}/")
    at = job.last_step()
    sent = job.signal(p.kill_task, signal.SIGKILL)
    code = job.finish(p.heartbeat_s + 300)
    took = time.monotonic() - sent
    failures = job.task_failures()
    self.checks("b: the job failed, every task non-zero", code != 0 and sorted(failures) == list(
        range(p.processes)), {"code": code, "tasks": failures})
    self.checks("b: the others stopped within the heartbeat timeout + 60 s",
                took < p.heartbeat_s + 60, {"seconds": round(took, 1)})
    committed = self.committed(STAGE1)
    left = self.exists(STAGE1, "lease.json")
    self.faults.append({"fault": f"SIGKILL of task {p.kill_task}", "killed_at_step": at,
                        "exit_code": code, "tasks": {str(k): v for k, v in failures.items()},
                        "newest_checkpoint": committed[-1], "steps_lost": at - committed[-1],
                        "lease_left_behind": left,
                        "seconds_from_kill_to_exit": round(took, 1)})
    self.snapshot("b")
    return committed[-1]

  def relaunch_with_outage(self, newest: int) -> None:
    """b's relaunch (the same script, requeued: the same job id, restart count 1, the same
    hostnames, the lease behind) and c: the store taken down during a save and brought back
    within the budget."""
    p = self.plan
    left = self.exists(STAGE1, "lease.json")
    start = time.monotonic()
    # Requeued, as SLURM gives it to its tasks: the killed job's id, restart count 1 (a launch
    # of it is a later attempt of the killed one's).
    job = self.job("b-relaunch-c-outage", self.stage1_args(p.job_steps, STAGE1, p.every),
                   env={"SLURM_JOB_ID": self.kill_job_id, "SLURM_RESTART_COUNT": "1"})
    resumed = int(job.wait_for(r"resumed from \S+/(\d+) \(step")[1])
    job.wait_for(rf"\] step {resumed + 1}/")
    first_s = time.monotonic() - start
    took_over = bool(job.find("taking over the workdir lease"))
    by_attempt = bool(job.find(r"\(attempt 0 of job slurm-\d+\) and this launch is attempt 1"))
    self.checks("b: the relaunch resumed from the newest checkpoint", resumed == newest,
                {"resumed": resumed, "newest": newest})
    self.checks("b: the lease left behind was taken over at once, by the requeued job's "
                "restart count", not left or (took_over and by_attempt and not job.find(
                    "waiting up to")), {"left": left, "taken_over": took_over,
                                        "by_attempt": by_attempt})
    self.faults.append({"fault": "relaunch of the killed job", "lease_left_behind": left,
                        "lease_taken_over": took_over, "resumed_from": resumed,
                        "seconds_from_start_to_first_step": round(first_s, 1)})
    saving = int(job.wait_for(r"saving the checkpoint of step (\d+)")[1])
    self.gcs.stop()
    down = time.monotonic()
    time.sleep(p.outage_s)
    self.gcs.start()
    up = time.monotonic()
    # Recovered: the save under way when the store went down is committed.
    deadline = up + RETRY_S + 60
    while saving not in self.committed(STAGE1) and job.proc.poll() is None and (
        time.monotonic() < deadline):
      time.sleep(0.2)
    recovered = time.monotonic() - down if saving in self.committed(STAGE1) else None
    steps_in_outage = [s for s in range(saving + 1, p.job_steps + 1)
                       if job.find(rf"\] step {s}/")]
    code = job.finish(900)
    self.checks("c: the job ended 0 after the outage", code == 0,
                {"code": code, "tasks": job.task_failures()})
    committed = self.committed(STAGE1)
    # (Rotation, checkpoint.keep, may have removed it by the job's end.)
    self.checks("c: the save under way in the outage was committed", recovered is not None,
                {"saving": saving, "committed": committed})
    self.checks("c: the job reached its end, saved", committed[-1] == p.job_steps, committed)
    self.faults.append({"fault": f"store down for {p.outage_s:g} s during the save of "
                        f"step {saving}", "retry_budget_s": RETRY_S,
                        "steps_lost": 0 if recovered is not None else None,
                        "steps_trained_while_down": len(steps_in_outage),
                        "seconds_from_down_to_recovery": None if recovered is None
                        else round(recovered, 1),
                        "seconds_store_down": round(up - down, 1)})
    self.snapshot("c")

  def resize(self) -> None:
    """d: the rest of stage 1 on 1 process of resized_devices."""
    p = self.plan
    job = self.job("d-resize", self.stage1_args(p.steps, STAGE1, p.every), nodes=1,
                   devices=p.resized_devices)
    resumed = int(job.wait_for(r"resumed from \S+/(\d+) \(step")[1])
    code = job.finish(900)
    self.checks("d: the resized run resumed where the job ended", resumed == p.job_steps,
                {"resumed": resumed})
    self.checks("d: the resized run ended 0", code == 0, {"code": code})
    self.faults.append({"fault": f"resized to 1 process x {p.resized_devices} devices",
                        "resumed_from": resumed, "steps_lost": 0})
    self.snapshot("d")

  def check_job_state(self) -> None:
    """The job's state where it ended (after a, b and c) against the uninterrupted job's at the
    same step: every parameter and Adam moment bit-equal (the checksums of the global arrays
    that each checkpoint's meta records; read before rotation can remove the step)."""
    step = self.plan.job_steps
    with open(os.path.join(self.dir, "straight", "checkpoints", str(step), "meta",
                           "metadata")) as f:
      straight = json.load(f)["arrays"]
    here = json.loads(self.read(STAGE1, f"checkpoints/{step}/meta/metadata"))["arrays"]
    differ = sorted(f"{item} {name}" for item in straight for name in straight[item]
                    if here.get(item, {}).get(name) != straight[item][name])
    self.state_equal = not differ
    self.checks(f"parameters and moments at step {step} bit-equal to the uninterrupted job's",
                not differ, differ[:5])

  def check_stage1(self, straight: dict[int, float], launches: list[int]) -> None:
    """The losses, the record and the data."""
    p = self.plan
    rows = self.rows(STAGE1)
    steps = [r["step"] for r in rows]
    losses = {r["step"]: r["loss"] for r in rows}
    self.checks("every step logged once", steps == list(range(1, p.steps + 1)), steps)
    # The loss is a sum across the processes, and XLA:CPU's cross-process sum is not always
    # bit-reproducible: a loss may differ in its last bit while the parameters (above) do not.
    ulps = {s: int(abs(np.float32(losses[s]) - np.float32(straight[s]))
                   / np.spacing(np.float32(straight[s]))) for s in range(1, p.job_steps + 1)}
    self.same_sharding = {"steps": p.job_steps,
                          "bit_equal": sum(u == 0 for u in ulps.values()),
                          "max_ulps": max(ulps.values())}
    self.checks(f"losses of steps 1-{p.job_steps} ({p.processes} x {DEVICES}) equal to the "
                "uninterrupted job's (within one unit in the last place)",
                self.same_sharding["max_ulps"] <= 1,
                {s: (losses[s], straight[s]) for s, u in ulps.items() if u})
    resized = range(p.job_steps + 1, p.steps + 1)
    rel = max(abs(losses[s] - straight[s]) / abs(straight[s]) for s in resized)
    self.resize_diff = {"max_abs": max(abs(losses[s] - straight[s]) for s in resized),
                        "max_rel": rel}
    self.checks(f"losses of steps {p.job_steps + 1}-{p.steps} (1 x {p.resized_devices}) within "
                f"rtol {RESIZE_RTOL:g}", rel <= RESIZE_RTOL, self.resize_diff)
    history = [json.loads(line) for line in
               self.read(STAGE1, "history.jsonl").decode().splitlines() if line.strip()]
    record = [(h["launch"], h["start_step"]) for h in history]
    self.checks("history.jsonl: one line per launch, each with the step it resumed from",
                record == list(enumerate(launches, start=1)), record)

  def audit(self) -> dict[str, Any]:
    """launch/audit.py: the job's loader over the whole run, and the 1 x 2 one's over the
    resized part: each step exactly the global order's batch, no instance twice."""
    p = self.plan
    base = [sys.executable, os.path.join(ROOT, "launch", "audit.py"),
            "--fdl_config=experiments.olmo3_tiny:stage1", *RECIPE[:2],
            f"--fdl_set=data.mix='{self.mix}'"]
    reports = {}
    job = f"{p.processes}x{DEVICES}"
    for name, processes, start in ((job, p.processes, 0), ("1x2", 1, p.job_steps)):
      done = subprocess.run([*base, "--processes", str(processes), "--devices_per_process",
                             str(DEVICES), "--start_step", str(start),
                             "--steps", str(p.steps - start)],
                            cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=900)
      if done.returncode not in (0, 1):
        raise Failed(f"the {name} audit failed:\n{done.stderr[-3000:]}")
      reports[name] = json.loads(done.stdout.strip().splitlines()[-1])
    whole, resized = reports[job], reports["1x2"]
    for name, report in reports.items():
      self.checks(f"audit {name}: each step the global order's batch, no instance twice",
                  report["ok"], {k: v for k, v in report.items() if k != "digests"})
    same = all(resized["digests"][s] == whole["digests"][s] for s in resized["digests"])
    self.checks(f"audit: the 1 x 2 loader reads the {job} job's batches", same)
    return {"steps": whole["steps"], "batches_per_epoch": whole["batches_per_epoch"],
            "instances_read": whole["instances_read"],
            "instances_read_per_process": whole["instances_read_per_process"],
            "duplicates_within_epoch": whole["duplicates_within_epoch"],
            "complete_epochs": whole["complete_epochs"]}

  def stage2(self) -> dict[str, Any]:
    """e: stage 2 from the bucket's stage 1, evaluating on the job's processes; then the same
    checkpoint evaluated by `python -m olmo3.eval` in 1 process."""
    p = self.plan
    args = ["--fdl_config=experiments.olmo3_tiny:stage2", *RECIPE,
            f"--fdl_set=data.mix='{self.mix}'", f"--fdl_set=checkpoint.init_from='{STAGE1}'",
            f"--fdl_set=train.steps={p.stage2_steps}",
            f"--fdl_set=train.eval_every={p.stage2_steps}",
            f"--fdl_set=checkpoint.every={p.stage2_steps}", f"--fdl_set=eval.tasks={p.tasks!r}",
            f"--fdl_set=eval.task_limit={p.task_limit}",
            f"--fdl_set=eval.max_documents={p.max_documents}", f"--workdir={STAGE2}"]
    job = self.job("e-stage2", args)
    init = job.wait_for(r"initialised from (\S+)")[1]
    code = job.finish(1800)
    self.checks("e: stage 2 initialised from stage 1's last checkpoint",
                init.rstrip("/").endswith(f"stage1/checkpoints/{p.steps}"), init)
    self.checks("e: stage 2 ended 0", code == 0, {"code": code, "tasks": job.task_failures()})
    step = p.stage2_steps
    logged = {k: v for r in self.rows(STAGE2) if r["step"] == step for k, v in r.items()
              if k.startswith(("eval/", "downstream/"))}
    report = os.path.join(self.dir, "eval_report.json")
    env = dict(self.env(), XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
    done = subprocess.run([sys.executable, "-m", "olmo3.eval", f"--workdir={STAGE2}",
                           f"--step={step}", f"--out={report}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
      raise Failed(f"python -m olmo3.eval failed:\n{done.stderr[-3000:]}")
    with open(report) as f:
      result = json.load(f)["steps"][str(step)]
    again = result["metrics"]  # olmo3.eval names what it scored as the run logs it
    self.checks(f"e: the {p.processes}-process evaluation logged every held-out set and task",
                bool(logged) and again.keys() == logged.keys() and any(
                    k.startswith("eval/") for k in logged) and all(
                    any(k.startswith(f"downstream/{t}/") for k in logged) for t in p.tasks),
                sorted(set(again) ^ set(logged)))
    diffs = {k: abs(again[k] - logged[k]) for k in again.keys() & logged.keys()}
    worst = max(diffs, key=lambda k: diffs[k] / max(abs(logged[k]), 1e-6)) if diffs else None
    # float32 sums in another order on another mesh (tests/test_reliability.py's tolerance).
    bad = [k for k in diffs if diffs[k] > 1e-5 * abs(logged[k]) + 1e-6]
    self.checks(f"e: {p.processes}-process evaluation equals 1-process evaluation (rel 1e-5, "
                "abs 1e-6)",
                not bad, {k: (logged[k], again[k]) for k in bad})
    return {"metrics_compared": len(diffs), "max_abs_diff": max(diffs.values(), default=None),
            "worst_metric": worst}

  def run(self) -> dict[str, Any]:
    p = self.plan
    straight = self.straight()
    stopped = self.sigterm()
    newest = self.sigkill(stopped)
    self.relaunch_with_outage(newest)
    self.check_job_state()
    self.resize()
    self.check_stage1(straight, [0, stopped, newest, p.job_steps])
    result = {"faults": self.faults,
              "losses_same_sharding": {**self.same_sharding, "state_bit_equal": self.state_equal},
              "losses_after_resize": self.resize_diff}
    if p.faults_only:
      return {**result, "left_out": ["the audit", "e: stage 2 and its evaluation"]}
    return {**result, "audit": self.audit(), "stage2_evaluation": self.stage2()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  platforms.choose()  # first, as every program: no TPU probing on a CPU machine
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="every fault (a-d) and its checks in fewer steps, without the audit "
                      "and stage 2 (the test's mode)")
  parser.add_argument("--keep", default=None,
                      help="a directory to keep the jobs' logs, scripts and the bucket in")
  args = parser.parse_args(argv)
  plan = QUICK if args.quick else FULL
  started = time.monotonic()
  with contextlib.ExitStack() as stack:
    directory = args.keep or stack.enter_context(tempfile.TemporaryDirectory(
        prefix="pod-rehearsal-"))
    rehearsal = Rehearsal(plan, directory)
    result: dict[str, Any] = {}
    error = None
    with rehearsal.servers():
      try:
        result = rehearsal.run()
      except Failed as e:
        error = str(e)
      http = {"requests": sum(rehearsal.http.requests.values()),
              "answered_500": rehearsal.http.errors_injected}
  failures = rehearsal.checks.failures + ([error] if error else [])
  return {
      "ok": not failures,
      "date": datetime.date.today().isoformat(),
      "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
      "mode": "quick" if args.quick else "full",
      "job": {"devices_per_process": DEVICES,
              "started_as": "launch/slurm.py's sbatch script, harness/slurm_standin/srun",
              "recipe": "experiments.olmo3_tiny:stage1 (+ stage2), 8 x 128 tokens per step",
              **dataclasses.asdict(plan)},
      "budgets_s": {"heartbeat": plan.heartbeat_s, "storage_retry": RETRY_S,
                    "storage_timeout": TIMEOUT_S, "lease_takeover": TAKEOVER_S},
      "http_data": {"latency_ms": LATENCY_S * 1000, "error_rate": ERROR_RATE, **http},
      **result,
      "checks": rehearsal.checks.results,
      "failures": failures,
      "wall_s": round(time.monotonic() - started, 1),
  }


if __name__ == "__main__":
  report = main()
  print(json.dumps(report))
  sys.exit(0 if report["ok"] else 1)
