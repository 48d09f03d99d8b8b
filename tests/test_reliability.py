"""Preemption and multi-process runs through the real launcher (real OS processes)."""

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import fiddle as fdl
import numpy as np
import pytest

from launch import jobs, refs, slurm
from olmo3.io import metrics as metrics_lib
from tests import forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "launch", "main.py")
SRUN_STANDIN = os.path.join(ROOT, "harness", "slurm_standin")
# No XLA_FLAGS (each test sets its devices), and nothing that would join the processes other
# than the SLURM environment the srun stand-in gives them.
BASE = {k: v for k, v in os.environ.items()
        if k != "XLA_FLAGS" and not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES",
                                                  "JAX_PROCESS_ID", "SLURM_"))}
# Half-length instances: these tests are about stopping and resuming, and cheap steps let the
# SIGKILL test land its 20 kills sooner.
TINY = ["--fdl_config=experiments.olmo3_tiny:stage1", "--fdl_set=data.global_batch_size=8",
        "--fdl_set=data.seq_len=128",
        "--fdl_set=train.log_every=1", "--fdl_set=train.eval_every=0",
        "--fdl_set=eval.tasks=()", "--fdl_set=checkpoint.every=3"]


def _env(devices):
  return dict(BASE, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _run(workdir, steps, devices=1, processes=1, extra=()):
  """The launcher on `processes` local processes of `devices` CPU devices each. Several
  processes run as a SLURM job would: the batch script `launch/cluster.py --target=slurm`
  renders (one node per process, its `devices` as the node's GPUs), run by bash with the srun
  stand-in (harness/slurm_standin/srun) first on PATH; JAX's own SLURM detection joins them."""
  args = [*TINY, f"--fdl_set=train.steps={steps}", f"--workdir={workdir}", "--force_workdir",
          *extra]
  if processes == 1:
    done = forked.completed("main", args, _env(devices))
    assert done.returncode == 0, done.stderr[-3000:]
    return
  command = jobs.command_from_args(args, python=sys.executable)
  exp = fdl.build(refs.resolve(command.fdl_config, command.fdl_sets, command.fiddlers))
  job = slurm.SlurmJob("reliability", nodes=processes, gpus_per_node=devices,
                       processes=jobs.Processes.PER_NODE, command=command, env=jobs.job_env(exp))
  jobs.check_experiment(exp, jobs.Target.SLURM, job.devices, 1)
  script = workdir.parent / f"{workdir.name}.{steps}.sbatch"
  script.write_text(slurm.slurm_script(job))
  env = dict(_env(devices), PATH=os.pathsep.join([SRUN_STANDIN, os.environ["PATH"]]))
  done = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=ROOT, env=env,
                        timeout=600)
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
  # Every task trained on all the job's devices: jax.distributed joined them.
  for rank in range(processes):
    assert re.search(rf"^{rank}: .* on {processes * devices} cpu devices$", done.stderr,
                     re.MULTILINE), done.stderr[-3000:]


def _losses(workdir):
  return {r["step"]: r["loss"] for r in metrics_lib.read_jsonl(workdir / "metrics.jsonl")
          if "loss" in r}


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
  """The uninterrupted run's losses, step by step: trained once per test session, whichever
  xdist worker asks first (the others wait on the lock and read its result). Tests that only
  compare with it at the end ask for it there (`request.getfixturevalue("straight")`), not as
  an argument: the other worker, meanwhile training it, then never holds them up."""
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


def _launch(workdir, *extra):
  """The launcher in the background (the 9-step run unless `extra` says otherwise)."""
  return subprocess.Popen([sys.executable, MAIN, *TINY, "--fdl_set=train.steps=9",
                           f"--workdir={workdir}", *extra], cwd=ROOT, env=_env(1),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for(path, proc, seconds=300):
  deadline = time.time() + seconds
  while not path.exists():
    assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
    time.sleep(0.05)


@pytest.mark.slow(seconds=20)
def test_a_live_workdir_is_refused_and_sigterm_stops_cleanly_even_at_startup(tmp_path):
  """A second launch on a live run's workdir is refused, naming the holder; SIGTERM saves the
  step the run stopped at and exits 0, releasing the workdir; a SIGTERM while the launcher is
  still starting is a clean exit too. (Every cadence, and resuming: the soak test below.)"""
  proc = _launch(tmp_path / "held", "--fdl_set=train.steps=1000")
  _wait_for(tmp_path / "held" / "checkpoints" / "3", proc)
  second = forked.completed("main", [*TINY, "--fdl_set=train.steps=1000",
                                     f"--workdir={tmp_path / 'held'}"], _env(1), timeout=300)
  assert second.returncode != 0
  assert f"is in use by pid {proc.pid} on host {socket.gethostname()}" in second.stderr
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0 and "interrupted (SIGTERM) at step" in err, err[-3000:]
  assert _committed(tmp_path / "held")[-1] == max(_losses(tmp_path / "held"))
  assert not (tmp_path / "held" / "lease.json").exists()  # released on the way out
  # Resuming on other data (another seed) is refused before a step, naming the change.
  stopped = max(_losses(tmp_path / "held"))
  again = [*TINY, f"--fdl_set=train.steps={stopped + 1}", f"--workdir={tmp_path / 'held'}",
           "--force_workdir", "--fdl_set=data.seed=7"]
  refused = forked.completed("main", again, _env(1), timeout=300)
  assert refused.returncode == 1 and "seed" in refused.stderr.strip().splitlines()[-1]
  assert max(_losses(tmp_path / "held")) == stopped
  # (Continuing with data.allow_changed_data: tests/test_checkpoints.py.)
  proc = _launch(tmp_path / "startup")
  time.sleep(1.0)  # still importing
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  assert "before step 1: stopping" in err


@pytest.mark.slow(seconds=25)
def test_when_the_coordinator_dies_the_other_process_ends_in_one_line_naming_it(tmp_path):
  """Process 0 of a 2-process job (the coordinator) SIGKILLed while both train: process 1
  ends non-zero within seconds, its last line an `error:` line naming process 0, without
  jaxlib's abort dump or a traceback (launch/peers.py)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs, errs = [], []
  for rank in (0, 1):
    # 2 devices each: the job shape of the pod rehearsal and the two-process test below, whose
    # programs the session's compilation cache then holds once for all three
    env = dict(_env(2), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(rank))
    errs.append(open(tmp_path / f"stderr{rank}", "w+"))
    procs.append(subprocess.Popen([sys.executable, MAIN, *TINY, "--fdl_set=train.steps=500",
                                   f"--workdir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=errs[-1]))
  try:
    deadline = time.time() + 120
    while "step 3/500" not in (tmp_path / "stderr1").read_text():
      assert all(p.poll() is None for p in procs) and time.time() < deadline, (
          (tmp_path / "stderr1").read_text()[-3000:])
      time.sleep(0.2)
    procs[0].kill()
    code = procs[1].wait(60)
  finally:
    for p in procs:
      p.kill()
      p.wait()
  time.sleep(0.5)  # the filter writes its line as the launcher's stderr closes
  text = (tmp_path / "stderr1").read_text()
  assert code != 0
  assert text.strip().splitlines()[-1].startswith(
      "error: process 0 of 2 (the coordinator) left the job, so process 1 of 2 stops too"), text
  for dump in ("Terminating process", "Traceback", "Check failure", "Gloo"):
    assert dump not in text, text


@pytest.mark.slow(seconds=90)
def test_two_processes_train_save_and_resume_on_another_mesh(tmp_path, request):
  """A run resumed on more devices and processes continues the same data sequence, and the
  2-process run evaluates (the 7B's held-out sets and task kinds) as 1 process does. (The other
  way, 2 processes resumed on 1: tests/test_pod_rehearsal.py; 4 on 1: the full
  benchmarks/pod_rehearsal.py.)"""
  labels = _v3_small_stand_in(tmp_path / "data")
  # 1 device in 1 process (the shape of the soak's and `straight`'s launches, whose programs it
  # loads from the compilation cache)
  _run(tmp_path, steps=4, devices=1)
  # -> 4 devices in 2 processes (the shape of tests/test_pod_rehearsal.py's job, whose
  # programs it then shares in the compilation cache), evaluating at step 9.
  _run(tmp_path, steps=9, devices=2, processes=2, extra=_eval_7b(tmp_path / "data"))
  losses = _losses(tmp_path)
  straight = request.getfixturevalue("straight")  # only now: see `straight`
  assert sorted(losses) == list(range(1, 10))
  # The same global data sequence; float32 reductions in another order on another mesh.
  np.testing.assert_allclose([losses[s] for s in range(1, 10)],
                             [straight[s] for s in range(1, 10)], rtol=2e-4)
  _check_evaluated_as_one_process(tmp_path, 9, labels)
  _check_replayed_as_logged(tmp_path)


def _check_replayed_as_logged(workdir):
  """`python -m olmo3.inspect_step --replay` in one process of 4 devices trains a step again as the
  run logged it, bit for bit, and says so: step 5 from checkpoint 4, after the resume onto 4
  devices in 2 processes (the replay sums across its devices with the run's cross-process
  collectives, gloo, whose order differs from XLA:CPU's in-process ones: olmo3/train/replay.py);
  step 4 from the stage's start, on 1 device as launch 1 trained it (its layout taken from the
  run's record, not from the devices in view)."""
  logged = {r["step"]: r for r in metrics_lib.read_jsonl(workdir / "metrics.jsonl") if "loss" in r}
  replayed = {}
  for step, start, mesh, processes in ((5, 4, {"fsdp": 4}, 2), (4, 0, {}, 1)):
    done = forked.completed("olmo3.inspect_step", [f"--workdir={workdir}", f"--step={step}",
                                              "--replay", "--json"], _env(4))
    assert done.returncode == 0, done.stderr[-3000:]
    out = replayed[step] = json.loads(done.stdout)  # gloo's lines went to stderr
    # Its phases say they are running (a 7B's replay compiles for minutes), on stderr.
    assert f"restoring the train state at {f'checkpoint {start}' if start else 'the stage'}" in (
        done.stderr) and f"training step {step} again ({step - start} of {step - start}" in (
        done.stderr), done.stderr[-3000:]
    r = out["replay"]
    assert (r["from_step"], r["layout"]["mesh"], r["layout"]["processes"]) == (start, mesh, 1)
    assert (r["run_layout"]["mesh"], r["run_layout"]["processes"]) == (mesh, processes)
    assert (r["expected"], "gloo" in r["why"]) == ("bit for bit", processes > 1), r["why"]
    assert r["matches_log"] == dict.fromkeys(("loss", "ce_loss", "grad_norm", "skipped"), True), r
    metrics = ("loss", "ce_loss", "grad_norm")
    assert [out[k] for k in metrics] == [logged[step][k] for k in metrics]
    # Equal to this step's log and to no neighbour's: the check tells a step from another.
    assert all(out[k] != logged[s][k] for s in (step - 1, step + 1) for k in metrics)
    assert len(out["rows"]) == 8 and all(r["scored_tokens"] == 127 for r in out["rows"])
    # the rows' losses make up the step's: summed over the batch's 8 x 127 scored tokens
    assert sum(r["loss"] * r["scored_tokens"] for r in out["rows"]) / 1016 == pytest.approx(
        out["ce_loss"], rel=1e-6)
  # Listing a step needs no replay, and no checkpoint of its launch: the same rows.
  done = forked.completed("olmo3.inspect_step", [f"--workdir={workdir}", "--step=4", "--json"],
                          _env(1))
  assert done.returncode == 0, done.stderr[-3000:]
  listed = json.loads(done.stdout)["rows"]
  assert [r["instance"] for r in listed] == [r["instance"] for r in replayed[4]["rows"]]
  # Steps 1..5 were trained on two meshes: a replay across the change is refused, in one line.
  done = forked.completed("olmo3.inspect_step", [f"--workdir={workdir}", "--step=5", "--replay",
                                            "--from_step=0"], _env(4))
  assert (done.returncode, done.stderr.splitlines()[-1]) == (1, (
      "error: steps 1..5 were trained by two launches (launch 1 and launch 2, which started at "
      "step 4) on different configs or meshes: replay from step 4 or later (--from_step)")), (
          done.stderr[-3000:])


def _logged_steps(workdir):
  path = workdir / "metrics.jsonl"
  return len(path.read_text().splitlines()) if path.exists() else 0


def _committed(workdir):
  directory = workdir / "checkpoints"
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if (
      directory.exists()) else []


def _flip_bytes(step_dir, rng):
  """16 bytes of the largest array data file of a committed step, flipped in place (the
  file's length unchanged): what a bad disk or a torn copy leaves."""
  files = [p for p in step_dir.rglob("*") if p.is_file() and "/d/" in str(p)]
  path = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(path.read_bytes())
  at = int(rng.integers(0, len(data) - 16))
  data[at:at + 16] = bytes(b ^ 0xFF for b in data[at:at + 16])
  path.write_bytes(bytes(data))


def _resumed_from(log_path):
  found = re.findall(r"resumed from \S+/(\d+) \(step", log_path.read_text())
  return int(found[-1]) if found else None


@pytest.fixture
def driver():
  """Launches forked from one driver in these tests' environment (1 device): tests/forked.py."""
  with forked.Driver(_env(1)) as launches:
    yield launches


KILLS, TERMS, DAMAGES = 4, 2, 2  # each restart costs a launch: a process forked from one
# driver (tests/forked.py) spares it the interpreter's start, the session's compilation cache
# (conftest) the compile


@pytest.mark.slow(seconds=105)
def test_soak_kills_signals_and_damage_never_lose_a_checkpoint(tmp_path, request, driver):
  """One tiny run after another, each interrupted at random: SIGKILL mid-step or mid-async-save,
  SIGTERM (exit 0 at the next step boundary, every=1 and every=3), 16 flipped bytes in the
  newest checkpoint between launches. Every restart of the same command resumes from the newest
  intact checkpoint (a damaged one is named and quarantined, never restored), no checkpoint is
  ever lost, no step is logged twice, and every run ends with the uninterrupted run's losses."""
  rng = np.random.default_rng(0)
  done = {"kill": 0, "term": 0, "damage": 0}
  episode, launches = 0, 0
  while done["kill"] < KILLS or done["term"] < TERMS or done["damage"] < DAMAGES:
    workdir = tmp_path / f"episode{episode}"
    every, damaged, flipped = (3, 1)[episode % 2], 0, set()  # flipped: not yet quarantined
    for event in ("kill", "term", "damage", "kill", "finish"):
      intact = [s for s in _committed(workdir) if s not in flipped]
      if event == "damage":
        if len(intact) >= 2:
          _flip_bytes(workdir / "checkpoints" / str(intact[-1]), rng)
          done["damage"] += 1
          damaged += 1
          flipped.add(intact[-1])
        continue
      log = tmp_path / f"launch{launches}.log"
      launches += 1
      proc = driver.start("main", [*TINY, "--fdl_set=train.steps=9", f"--workdir={workdir}",
                                   f"--fdl_set=checkpoint.every={every}"], out=log)
      if event != "finish":
        # 1-2 new rows: the loop writes a step's row once the next step is dispatched, so
        # the signal lands 2-3 steps in, and most of the 9 steps are left for later events.
        seen, target = _logged_steps(workdir), int(rng.integers(1, 3))
        while proc.poll() is None and _logged_steps(workdir) < seen + target:
          time.sleep(0.01)
        time.sleep(float(rng.uniform(0, 0.1)))  # a step takes about 0.2 s
        if proc.poll() is None:
          proc.send_signal(signal.SIGKILL if event == "kill" else signal.SIGTERM)
          done[event] += 1
      code = proc.wait(timeout=300)
      text = log.read_text()
      assert code == 0 or (event == "kill" and code == -signal.SIGKILL), text[-3000:]
      if "quarantined it as" in text:
        flipped.clear()
      resumed = _resumed_from(log)
      if intact and (resumed is not None or event == "finish"):
        assert resumed == intact[-1], (event, intact, text[-3000:])  # the newest intact one
      if event == "term" and code == 0 and "interrupted (SIGTERM) at step" in text:
        assert _committed(workdir)[-1] == max(_losses(workdir))  # saved where it stopped
    straight = request.getfixturevalue("straight")  # only now: see `straight`
    assert _losses(workdir) == straight, f"episode {episode}"
    steps = [r["step"] for r in metrics_lib.read_jsonl(workdir / "metrics.jsonl")]
    assert steps == sorted(set(steps)), steps  # no step logged twice across the restarts
    # Each damaged step was set aside once, under its own name, never deleted.
    assert len(list((workdir / "checkpoints").glob("*.damaged-*"))) == damaged
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
          "--fdl_set=train.eval_every=9"]


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
  done = forked.completed("olmo3.eval", [f"--workdir={workdir}", f"--step={step}",
                                         f"--out={report}"], _env(2))
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(report.read_text())["steps"][str(step)]
  again = result["metrics"]  # the report's own names for what the run logs
  assert again.keys() == {k for k in logged if k.startswith(("eval/", "downstream/"))}
  for key, value in again.items():  # float32 sums in another order on another mesh
    assert value == pytest.approx(logged[key], rel=1e-5, abs=1e-6), key
