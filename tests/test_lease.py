"""The workdir lease (olmo3.train.lease): who may take a workdir over and when, in process on a
local disk (in a bucket: tests/test_storage.py), then through the real launcher: a restarted
launcher takes over its own stale lease, an empty lease is taken over, and a run that cannot
renew its lease stops at a step boundary with one line."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from olmo3.train import lease as lease_lib
from olmo3.train.lease import Lease, LeaseHeld
from tests import forked
from tests.test_reliability import MAIN, ROOT, TINY, _env, _losses

TAKEOVER = 2.4  # seconds: the lease heartbeats every 0.2 s


def _holder(workdir, **fields):
  """Writes a lease.json as another launch on this machine would (this process's boot and pid
  namespace), with `fields` changed; returns the record."""
  record = {**Lease(workdir).record, "token": "theirs", "heartbeat": time.time(), **fields}
  (workdir / "lease.json").write_text(json.dumps(record))
  return record


def _takes(workdir) -> float:
  """Seconds a new launch took to take the lease (it must)."""
  start = time.monotonic()
  lease = Lease(workdir, takeover=TAKEOVER)
  lease.acquire()
  took = time.monotonic() - start
  assert json.loads((workdir / "lease.json").read_text())["token"] == lease.record["token"]
  lease.release()
  assert not (workdir / "lease.json").exists()
  return took


def test_a_live_holder_here_is_refused_at_once_and_the_lease_goes_with_its_run(tmp_path):
  held = Lease(tmp_path, takeover=TAKEOVER)
  held.acquire()
  start = time.monotonic()
  with pytest.raises(LeaseHeld, match=rf"in use by pid {os.getpid()} on host "
                     rf"{socket.gethostname()} .*when its heartbeat is 2.4 s old"):
    Lease(tmp_path, takeover=TAKEOVER).acquire()
  assert time.monotonic() - start < 1.0
  time.sleep(0.5)
  assert held.lost() is None  # renewed meanwhile
  held.release()
  assert sorted(os.listdir(tmp_path)) == []  # no lease, no temporary file


def test_dead_holders_are_taken_over_at_once_whatever_their_pid(tmp_path):
  # PID 1 (a container's launcher) recorded with another start: not this machine's PID 1.
  _holder(tmp_path, pid=1, pid_start="1")
  assert _takes(tmp_path) < 1.0
  # A live, unrelated process (this test's parent) under a reused pid.
  _holder(tmp_path, pid=os.getppid(), pid_start="12")
  assert _takes(tmp_path) < 1.0
  # A pid that runs nothing.
  _holder(tmp_path, pid=2**22 + 7)
  assert _takes(tmp_path) < 1.0
  # This launch's own pid (a restarted container's PID 1 finds its predecessor's lease).
  _holder(tmp_path, pid=os.getpid(), pid_start="3")
  assert _takes(tmp_path) < 1.0
  # A heartbeat older than the takeover age, on another host, with a live pid.
  _holder(tmp_path, host="elsewhere", pid=os.getppid(), heartbeat=time.time() - 10)
  assert _takes(tmp_path) < 1.0
  # An empty (or torn) lease last modified before the takeover age.
  (tmp_path / "lease.json").write_text("")
  os.utime(tmp_path / "lease.json", (time.time() - 10,) * 2)
  assert _takes(tmp_path) < 1.0


def test_a_holder_this_launch_cannot_check_is_watched_until_it_renews_or_goes_stale(tmp_path):
  # Another container on this host (another pid namespace), its heartbeat fresh: taken over
  # once it has not been renewed for the takeover age.
  _holder(tmp_path, pid=1, pid_ns="pid:[1]")
  assert TAKEOVER - 0.5 < _takes(tmp_path) < TAKEOVER + 2
  # An empty lease just written: the same wait, judged by its modification time.
  (tmp_path / "lease.json").write_text("")
  assert TAKEOVER - 0.5 < _takes(tmp_path) < TAKEOVER + 2
  # A live holder elsewhere renews its lease: refused as soon as it does.
  live = Lease(tmp_path, takeover=TAKEOVER)
  live.record.update(host="elsewhere")
  live.acquire()
  start = time.monotonic()
  with pytest.raises(LeaseHeld, match="in use by pid .* on host elsewhere"):
    Lease(tmp_path, takeover=TAKEOVER).acquire()
  assert time.monotonic() - start < 1.5
  live.release()


def test_a_lease_taken_over_or_not_renewed_is_lost(tmp_path):
  held = Lease(tmp_path, takeover=TAKEOVER)
  held.acquire()
  _holder(tmp_path, pid=4242)  # another launch took it over (say, after an outage)
  deadline = time.monotonic() + 2
  while held.lost() is None and time.monotonic() < deadline:
    time.sleep(0.05)
  assert "was taken over by pid 4242" in held.lost()
  held.release()
  assert json.loads((tmp_path / "lease.json").read_text())["pid"] == 4242  # theirs stays
  (tmp_path / "lease.json").unlink()
  held = Lease(tmp_path, takeover=TAKEOVER)
  held.acquire()
  (tmp_path / "lease.json").unlink()
  (tmp_path / "lease.json").mkdir()  # renewals fail from now on
  time.sleep(TAKEOVER / 2 - 0.5)
  assert held.lost() is None  # retried, not given up yet
  time.sleep(1.0)
  assert re.search(r"could not be renewed for \d s \(last error: IsADirectoryError",
                   held.lost())
  held.release()  # never raises
  (tmp_path / "lease.json").rmdir()


# --- through the launcher ----------------------------------------------------------------------


def _launch(workdir, steps, env=(), timeout=300):
  return forked.completed("main", [*TINY, f"--fdl_set=train.steps={steps}",
                                   f"--workdir={workdir}", "--force_workdir"],
                          dict(_env(1), **dict(env)), timeout=timeout)


@pytest.mark.slow(seconds=30)
def test_a_restarted_launcher_takes_over_its_stale_lease_and_an_empty_one(tmp_path):
  """A JobSet pod restarted after a SIGKILL keeps its hostname and is PID 1 again: its
  predecessor's lease (host this one, pid 1, heartbeat old) is taken over, and so is a lease
  left empty by a crash while it was written; neither launch is refused."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  _holder(workdir, pid=1, pid_start="1", heartbeat=time.time() - 3600)
  done = _launch(workdir, 3)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "taking over the workdir lease" in done.stderr
  (workdir / "lease.json").write_text("")
  os.utime(workdir / "lease.json", (time.time() - 3600,) * 2)
  done = _launch(workdir, 6)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "not a readable lease (empty or torn)" in done.stderr
  assert sorted(_losses(workdir)) == list(range(1, 7))
  assert not (workdir / "lease.json").exists()


@pytest.mark.slow(seconds=25)
def test_a_run_that_cannot_renew_its_lease_stops_at_a_step_boundary_in_one_line(tmp_path):
  """Renewals fail (the lease became a directory): past half the takeover age the run stops at
  its next step, saves it and exits 1 with one line saying why; it never trains on."""
  workdir = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, MAIN, *TINY, "--fdl_set=train.steps=100000",
                           f"--workdir={workdir}"], cwd=ROOT,
                          env=dict(_env(1), **{lease_lib.TAKEOVER_ENV: "6"}),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while not (workdir / "checkpoints" / "3").exists():
    assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
    time.sleep(0.05)
  (workdir / "lease.json").unlink()
  (workdir / "lease.json").mkdir()
  broken = time.monotonic()
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 1, err[-3000:]
  assert time.monotonic() - broken < 30
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"error: the workdir lease {workdir / 'lease.json'} could not be "
                         "renewed for "), err[-3000:]
  assert "Saved step" in last and "Traceback" not in err
  saved = int(last.split("Saved step ")[1].split(";")[0])
  committed = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert committed[-1] == saved == max(_losses(workdir))  # nothing trained after the stop
