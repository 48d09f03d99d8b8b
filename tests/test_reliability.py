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


@pytest.mark.slow(seconds=90)
def test_two_processes_train_save_and_resume_on_another_mesh(tmp_path, straight):
  """Resumes across meshes and process counts continue the same data sequence; the last
  2-process run also evaluates (the 7B's held-out sets and task kinds) as 1 process does."""
  labels = _v3_small_stand_in(tmp_path / "data")
  # 8 devices in 2 processes -> 2 devices in 1 process.
  _run(tmp_path / "a", steps=6, devices=4, processes=2)
  _run(tmp_path / "a", steps=9, devices=2)
  # 2 devices in 1 process -> 8 devices in 2 processes, evaluating at step 9.
  _run(tmp_path / "b", steps=6, devices=2)
  _run(tmp_path / "b", steps=9, devices=4, processes=2, extra=_eval_7b(tmp_path / "data"))
  for workdir in (tmp_path / "a", tmp_path / "b"):
    losses = _losses(workdir)
    assert sorted(losses) == list(range(1, 10))
    # The same global data sequence; float32 reductions in another order on another mesh.
    np.testing.assert_allclose([losses[s] for s in range(1, 10)],
                               [straight[s] for s in range(1, 10)], rtol=2e-4)
  _check_evaluated_as_one_process(tmp_path / "b", 9, labels)


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


def _v3_small_stand_in(root):
  """AI2's v3-small-ppl-validation layout under `root`, each of its 11 sets holding a slice of
  the embedded corpus's held-out documents (AI2's files are not downloadable in a test, and the
  tiny model needs its own tokenizer's ids)."""
  from olmo3.data import sources  # pylint: disable=import-outside-toplevel

  tokens = np.fromfile(sources.read_mix("embedded-heldout")[0].path, np.uint32)
  docs = np.split(tokens, np.flatnonzero(tokens == 0) + 1)[:-1]  # EOS is 0
  sets = sources.read_mix("v3-small-ppl-validation", str(root), "dolma2-tokenizer")
  for i, (_, path) in enumerate(sets):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.concatenate(docs[i::len(sets)][:8]).astype(np.uint32).tofile(path)
  return [label for label, _ in sets]


# The 7B's evaluation on the tiny run: AI2's v3-small held-out sets (a stand-in under a local
# root) and, to keep the test short, one 7B task of each kind (one-pass multiple choice, gold
# bits per byte, cloze), prepared with the tiny tokenizer.
TASKS_7B = ("copycolors_10way_fast", "hellaswag_bpb_5shot", "basic_skills_pattern_rc_5shot")


def _eval_7b(root):
  return ["--fdl_set=eval.heldout=('v3-small-ppl-validation',)",
          f"--fdl_set=eval.heldout_root='{root}'", f"--fdl_set=eval.tasks={TASKS_7B!r}",
          "--fdl_set=eval.task_limit=4", "--fdl_set=eval.max_documents=16",
          "--fdl_set=train.eval_every=3"]


def _check_evaluated_as_one_process(workdir, step, labels):
  """The evaluation logged by a multi-process run (each process checked that it computed every
  metric exactly as process 0) equals `python -m olmo3.eval` of the same checkpoint in 1
  process on 2 devices."""
  logged = {k: v for r in metrics_lib.read_jsonl(workdir / "metrics.jsonl")
            if r["step"] == step for k, v in r.items()}
  assert {f"eval/{label}/ce_loss" for label in labels} <= logged.keys()
  assert {"downstream/copycolors_10way_fast/acc_v1", "downstream/hellaswag_bpb_5shot/bpb_v2",
          "downstream/basic_skills_pattern_rc_5shot/soft_log_v1"} <= logged.keys()
  report = workdir / "report.json"
  done = subprocess.run([sys.executable, "-m", "olmo3.eval", f"--workdir={workdir}",
                         f"--step={step}", f"--out={report}"], cwd=ROOT, env=_env(2),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(report.read_text())["steps"][str(step)]
  again = {f"eval/{s}/{k}": v for s, r in result["heldout"].items() for k, v in r.items()
           if k != "tokens"}
  again.update({f"downstream/{t}/{k}": v for t, r in result["tasks"].items() for k, v in r.items()
                if k != "docs"})
  assert again.keys() == {k for k in logged if k.startswith(("eval/", "downstream/"))}
  for key, value in again.items():  # float32 sums in another order on another mesh
    assert value == pytest.approx(logged[key], rel=1e-5, abs=1e-6), key
