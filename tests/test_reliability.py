"""Preemption and multi-process runs through the real launcher (real OS processes)."""

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from olmo3 import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "launch", "main.py")
BASE = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
# Half-length instances: these tests are about stopping and resuming, and cheap steps let the
# SIGKILL test land its 20 kills sooner.
TINY = ["--fdl_config=experiments.olmo3_tiny:stage1", "--fdl_set=data.global_batch_size=8",
        "--fdl_set=data.seq_len=128",
        "--fdl_set=train.log_every=1", "--fdl_set=train.eval_every=0",
        "--fdl_set=eval.tasks=()", "--fdl_set=checkpoint.every=3"]


def _env(devices):
  return dict(BASE, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _run(workdir, steps, devices=1, processes=1, extra=()):
  """The launcher on `processes` local processes of `devices` CPU devices each."""
  args = [sys.executable, MAIN, *TINY, f"--fdl_set=train.steps={steps}", f"--workdir={workdir}",
          "--force_workdir", *extra]
  if processes == 1:
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=_env(devices),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(_env(devices), JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                                                JAX_NUM_PROCESSES=str(processes),
                                                JAX_PROCESS_ID=str(i)))
           for i in range(processes)]
  logs = [p.communicate(timeout=600)[0] for p in procs]
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]


def _losses(workdir):
  return {r["step"]: r["loss"] for r in metrics_lib.read_jsonl(workdir / "metrics.jsonl")
          if "loss" in r}


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
  """The uninterrupted run's losses, step by step: trained once per test session, whichever
  xdist worker asks first (the others wait on the lock and read its result)."""
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent  # this session's directory, the same for every worker
  with open(shared / "straight.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = shared / "straight.json"
    if not done.exists():
      workdir = shared / "straight"
      _run(workdir, steps=9, extra=["--fdl_set=checkpoint.every=100"])
      done.write_text(json.dumps(_losses(workdir)))
    return {int(k): v for k, v in json.loads(done.read_text()).items()}


def test_sigterm_saves_exits_zero_and_resumes(tmp_path, straight):
  args = [sys.executable, MAIN, *TINY, "--fdl_set=train.steps=9", f"--workdir={tmp_path}"]
  proc = subprocess.Popen(args, cwd=ROOT, env=_env(1), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while not (tmp_path / "checkpoints" / "3").exists():
    assert proc.poll() is None and time.time() < deadline
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  assert "preempted (signal 15): saved step" in err
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert saved[-1] >= 4  # the step it agreed to stop at, past the last periodic save
  _run(tmp_path, steps=9)  # the same command resumes
  assert _losses(tmp_path) == straight


@pytest.mark.slow(seconds=70)
def test_two_processes_train_save_and_resume_on_another_mesh(tmp_path, straight):
  # 8 devices in 2 processes -> 2 devices in 1 process.
  _run(tmp_path / "a", steps=6, devices=4, processes=2)
  _run(tmp_path / "a", steps=9, devices=2)
  # 2 devices in 1 process -> 8 devices in 2 processes.
  _run(tmp_path / "b", steps=6, devices=2)
  _run(tmp_path / "b", steps=9, devices=4, processes=2)
  for workdir in (tmp_path / "a", tmp_path / "b"):
    losses = _losses(workdir)
    assert sorted(losses) == list(range(1, 10))
    # The same global data sequence; float32 reductions in another order on another mesh.
    np.testing.assert_allclose([losses[s] for s in range(1, 10)],
                               [straight[s] for s in range(1, 10)], rtol=2e-4)


def _logged_steps(workdir):
  path = workdir / "metrics.jsonl"
  return len(path.read_text().splitlines()) if path.exists() else 0


KILLS = 20  # each restart costs a process start; the session's compilation cache (conftest)
# spares it the compile


@pytest.mark.slow(seconds=200)
def test_sigkill_at_random_points_never_corrupts_the_run(tmp_path, straight):
  """Kills land mid-step and mid-async-save (checkpoints every 3 steps); every restart of the
  same command ends with the uninterrupted run's losses."""
  rng = np.random.default_rng(0)
  kills, episode = 0, 0
  while kills < KILLS:
    workdir = tmp_path / f"episode{episode}"
    for _ in range(7):  # up to 7 kills in one run, then let it finish
      proc = subprocess.Popen([sys.executable, MAIN, *TINY, "--fdl_set=train.steps=9",
                               f"--workdir={workdir}"], cwd=ROOT, env=_env(1),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
      seen, target = _logged_steps(workdir), int(rng.integers(1, 4))
      while proc.poll() is None and _logged_steps(workdir) < seen + target:
        time.sleep(0.01)
      time.sleep(float(rng.uniform(0, 0.3)))
      if proc.poll() is not None:
        break  # it finished first
      proc.kill()
      proc.wait()
      kills += 1
    _run(workdir, steps=9)
    assert _losses(workdir) == straight, f"episode {episode} after {kills} kills"
    episode += 1
