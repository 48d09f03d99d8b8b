"""The workdir lease (olmo3.run.lease): who may take a workdir over and when, in process on a
local disk (in a bucket: tests/test_storage.py), then through the real launcher: a restarted
launcher takes over its own stale lease at once and another container's once it has watched
it unchanged for the takeover age, a live holder whose clock lags is refused and never taken
over, a run whose lease another launch took stops without saving into that launch's run, a
renewal whose answer was lost (GCS, S3) is recognised as the run's own, and a run that cannot
renew its lease stops at a step boundary with one line."""

import collections
import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.request

import pytest

from olmo3.io import settings, storage
from olmo3.run import lease as lease_lib
from olmo3.run.lease import Lease, LeaseHeld, LeaseLost
from harness import storage_servers
from tests import forked
from tests.lagging_clock import LaggingClock
from tests.test_reliability import TINY, _env, _losses

TAKEOVER = 2.4  # seconds: the lease heartbeats every 0.2 s
STILL = 1.0  # the takeover age where no holder renews (only the watch is timed)
DAY = 86400.0


def _holder(workdir, **fields):
  """Writes a lease.json as another launch on this machine would (this process's boot and pid
  namespace), with `fields` changed; returns the record. Its takeover age is STILL: a taker
  waits the longer of its own and the holder's."""
  record = {**Lease(workdir).record, "token": "theirs", "heartbeat": time.time(),
            "takeover_s": STILL, **fields}
  # whole, as a launch writes it: a run renewing meanwhile never reads half a file (it then
  # said only "gone or unreadable", not who took the lease)
  storage.write_bytes_atomic(workdir / "lease.json", json.dumps(record).encode(),
                             durability=storage.Durability.FLUSHED)
  return record


def _takes(workdir, takeover=TAKEOVER) -> float:
  """Seconds a new launch took to take the lease (it must)."""
  start = time.monotonic()
  lease = Lease(workdir, takeover=takeover)
  lease.acquire()
  took = time.monotonic() - start
  assert json.loads((workdir / "lease.json").read_text())["token"] == lease.record["token"]
  lease.release()
  assert not (workdir / "lease.json").exists()
  return took


def test_a_live_holder_here_is_refused_at_once_and_the_lease_goes_with_its_run(
    tmp_path, monkeypatch):
  # Its clock a day behind (the times it writes): this machine's process table says it runs.
  monkeypatch.setattr(lease_lib, "time", LaggingClock(-DAY))
  held = Lease(tmp_path, takeover=TAKEOVER)
  held.acquire()
  assert json.loads((tmp_path / "lease.json").read_text())["heartbeat"] < time.time() - DAY + 60
  start = time.monotonic()
  with pytest.raises(LeaseHeld, match=rf"in use by pid {os.getpid()} on host "
                     rf"{socket.gethostname()} .*once the lease has not changed for 2.4 s"):
    Lease(tmp_path, takeover=TAKEOVER).acquire()
  assert time.monotonic() - start < 1.0
  time.sleep(0.5)
  assert held.lost() is None  # renewed meanwhile
  held.release()
  assert sorted(os.listdir(tmp_path)) == []  # no lease, no temporary file


def test_dead_holders_here_are_taken_over_at_once_whatever_their_pid(tmp_path):
  # PID 1 (a container's launcher) recorded with another start: not this machine's PID 1.
  _holder(tmp_path, pid=1, pid_start="1")
  assert _takes(tmp_path) < 1.0
  # A live, unrelated process (this test's parent) under a reused pid.
  _holder(tmp_path, pid=os.getppid(), pid_start="12")
  assert _takes(tmp_path) < 1.0
  # A pid that runs nothing, its clock a day ahead.
  _holder(tmp_path, pid=2**22 + 7, heartbeat=time.time() + DAY)
  assert _takes(tmp_path) < 1.0
  # This launch's own pid (a restarted container's PID 1 finds its predecessor's lease).
  _holder(tmp_path, pid=os.getpid(), pid_start="3")
  assert _takes(tmp_path) < 1.0


@pytest.mark.seconds(6, waits=True)
def test_a_holder_this_launch_cannot_check_is_taken_over_only_once_it_stops_renewing(
    tmp_path, monkeypatch):
  """Another host's or container's lease, or one that is not a lease, is watched on the taker's
  own clock: taken over once it has not changed for the takeover age, whatever the times in it
  or the file's modification time say, and refused as soon as it changes."""
  # Another container on this host (another pid namespace), its heartbeat fresh.
  _holder(tmp_path, pid=1, pid_ns="pid:[1]")
  assert STILL - 0.3 < _takes(tmp_path, STILL) < STILL + 2
  # Other hosts whose clocks lag or run ahead by a day: the times they wrote are not read.
  for heartbeat in (time.time() - DAY, time.time() + DAY):
    _holder(tmp_path, host="elsewhere", pid=os.getppid(), heartbeat=heartbeat)
    assert STILL - 0.3 < _takes(tmp_path, STILL) < STILL + 2
  # An empty lease, just written or last modified a day ago.
  for modified in (time.time(), time.time() - DAY):
    (tmp_path / "lease.json").write_text("")
    os.utime(tmp_path / "lease.json", (modified,) * 2)
    assert STILL - 0.3 < _takes(tmp_path, STILL) < STILL + 2
  # A live holder elsewhere, its clock a day behind, renews its lease: refused as soon as it
  # does, however often a launch tries, and its run never loses the lease.
  monkeypatch.setattr(lease_lib, "time", LaggingClock(-DAY))
  live = Lease(tmp_path, takeover=TAKEOVER)
  live.record.update(host="elsewhere")
  live.acquire()
  for _ in range(3):
    start = time.monotonic()
    with pytest.raises(LeaseHeld, match="in use by pid .* on host elsewhere"):
      Lease(tmp_path, takeover=TAKEOVER).acquire()
    assert time.monotonic() - start < 1.5
  assert live.lost() is None
  assert json.loads((tmp_path / "lease.json").read_text())["token"] == live.record["token"]
  live.release()


@pytest.mark.seconds(2, waits=True)
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


def test_a_run_stops_without_saving_once_another_launch_holds_its_lease(tmp_path):
  """The "save that step" of a run that lost its lease happens only while the lease is still
  its own: found taken by a renewal, or by the look just before the save (another launch took
  it while this run's renewals failed), the step is not saved into the other launch's run."""
  saved = []
  held = Lease(tmp_path, takeover=TAKEOVER)
  lease_lib.hold(held)
  with pytest.raises(LeaseLost, match=r"^not renewed\. Saved step 5;"):
    lease_lib.stop_without_lease("not renewed", 5, lambda: saved.append(5))
  assert saved == [5]  # still its own: saved
  _holder(tmp_path, pid=4242)
  with pytest.raises(LeaseLost, match=r"^not renewed\. Step 6 was not saved: another launch "
                     r"holds the workdir now \(pid 4242 on host .* holds the workdir lease"):
    lease_lib.stop_without_lease("not renewed", 6, lambda: saved.append(6))
  deadline = time.monotonic() + 2
  while held.lost() is None and time.monotonic() < deadline:
    time.sleep(0.05)
  with pytest.raises(LeaseLost, match=r"was taken over by pid 4242 .*\)\. Step 7 was not "
                     r"saved: another launch holds the workdir now, and its run"):
    lease_lib.stop_without_lease(held.lost(), 7, lambda: saved.append(7))
  assert saved == [5]
  held.release()
  assert json.loads((tmp_path / "lease.json").read_text())["pid"] == 4242  # theirs stays


def _attempt(monkeypatch, job, attempt):
  monkeypatch.setenv(lease_lib.JOB_ENV, job)
  monkeypatch.setenv(lease_lib.ATTEMPT_ENV, str(attempt))


@pytest.mark.seconds(3, waits=True)
def test_a_later_attempt_of_the_job_fences_a_live_holder_at_once_and_no_other_launch_does(
    tmp_path, monkeypatch):
  """JobSet's restart attempt (SLURM's restart count): attempt 1 of a job takes the lease of
  that job's attempt 0 at once, live and renewing, here or on another host; attempt 0's next
  renewal finds it taken, and its save checks first. The same attempt, an earlier one, another
  job's, or a launch that knows no attempt keeps the rules: watched (another host) and refused
  when renewed, or refused at once (a live holder here)."""
  _attempt(monkeypatch, "jobset-uid-1", 0)
  for host in (socket.gethostname(), "elsewhere"):
    held = Lease(tmp_path, takeover=TAKEOVER)
    held.record.update(host=host)
    lease_lib.hold(held)  # takes it
    lease_lib.check_before_save(1)  # its own: nothing raised
    _attempt(monkeypatch, "jobset-uid-1", 1)
    assert _takes_and_keeps(tmp_path) < 1.0
    with pytest.raises(LeaseLost, match=r"^pid \d+ on host .* \(attempt 1 of job jobset-uid-1\) "
                       r"holds the workdir lease .*\. Step 2 was not saved"):
      lease_lib.check_before_save(2)
    deadline = time.monotonic() + 2
    while held.lost() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    assert "taken over by pid" in held.lost() and "(attempt 1 of job jobset-uid-1)" in held.lost()
    held.release()
    (tmp_path / "lease.json").unlink()
    _attempt(monkeypatch, "jobset-uid-1", 0)
  # Not a later attempt of the same job: a live holder elsewhere is watched and refused.
  held = Lease(tmp_path, takeover=TAKEOVER)
  held.record.update(host="elsewhere", attempt=1)
  held.acquire()
  for job, attempt in (("jobset-uid-1", 1), ("jobset-uid-1", 0), ("jobset-uid-2", 5), (None, 0)):
    if job is None:
      monkeypatch.delenv(lease_lib.JOB_ENV)
      monkeypatch.delenv(lease_lib.ATTEMPT_ENV)
    else:
      _attempt(monkeypatch, job, attempt)
    with pytest.raises(LeaseHeld, match=r"in use by pid .* on host elsewhere \(attempt 1 of job "
                       r"jobset-uid-1\)"):
      Lease(tmp_path, takeover=TAKEOVER).acquire()
  assert held.lost() is None
  held.release()


def _takes_and_keeps(workdir) -> float:
  """Seconds a new launch took to take the lease (it must); it then stops renewing, keeping it."""
  start = time.monotonic()
  lease = Lease(workdir, takeover=TAKEOVER)
  lease.acquire()
  took = time.monotonic() - start
  lease._stop.set()  # pylint: disable=protected-access  # its holder, stopped renewing
  return took


def test_an_attempt_without_its_job_or_not_a_count_is_refused_naming_the_variable(monkeypatch):
  monkeypatch.setenv(lease_lib.ATTEMPT_ENV, "1")
  with pytest.raises(ValueError, match=r"^OLMO3_ATTEMPT='1' needs OLMO3_JOB"):
    lease_lib.attempt_setting()
  monkeypatch.setenv(lease_lib.JOB_ENV, "j")
  for bad in ("-1", "one", "1.0"):
    monkeypatch.setenv(lease_lib.ATTEMPT_ENV, bad)
    with pytest.raises(ValueError, match=rf"^OLMO3_ATTEMPT='{re.escape(bad)}': expected the "
                       "attempt of job 'j' as a count from 0"):
      lease_lib.attempt_setting()
  monkeypatch.setenv(lease_lib.ATTEMPT_ENV, "3")
  assert lease_lib.attempt_setting() == ("j", 3)
  # Neither set: SLURM's job id and restart count (a requeued job counts up), if any.
  monkeypatch.delenv(lease_lib.JOB_ENV)
  monkeypatch.delenv(lease_lib.ATTEMPT_ENV)
  monkeypatch.delenv("SLURM_JOB_ID", raising=False)
  monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
  assert lease_lib.attempt_setting() is None
  monkeypatch.setenv("SLURM_JOB_ID", "4242")
  assert lease_lib.attempt_setting() == ("slurm-4242", 0)
  monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
  assert lease_lib.attempt_setting() == ("slurm-4242", 2)


# --- through the launcher ----------------------------------------------------------------------


def _launch(workdir, steps, env=(), timeout=300):
  return forked.completed("main", [*TINY, f"--fdl_set=train.steps={steps}",
                                   f"--workdir={workdir}", "--force_workdir"],
                          dict(_env(1), **dict(env)), timeout=timeout)


def _background(args, env) -> forked.Running:
  return forked.background("main", [*TINY, *args], env)


@pytest.mark.slow(seconds=12, waits=True)
def test_a_restarted_launcher_takes_over_its_stale_lease_and_another_containers(tmp_path):
  """A JobSet pod restarted after a SIGKILL keeps its hostname and is PID 1 again: its
  predecessor's lease (this machine's pid namespace, pid 1 another process now) is taken over
  at once. A lease of another container (another pid namespace), its clock a day behind and
  no longer renewed, is taken over once the launch has watched it unchanged for the takeover
  age, not at once for its old times. Neither launch is refused."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  _holder(workdir, pid=1, pid_start="1", heartbeat=time.time() - 3600)
  done = _launch(workdir, 3)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "taking over the workdir lease" in done.stderr and "waiting up to" not in done.stderr
  _holder(workdir, pid=1, pid_ns="pid:[1]", heartbeat=time.time() - DAY,
          started=time.time() - DAY)
  done = _launch(workdir, 6, {lease_lib.TAKEOVER_ENV: "3"})
  assert done.returncode == 0, done.stderr[-3000:]
  assert re.search(r"it is held by pid 1 on host \S+, which this launch cannot check; waiting "
                   r"up to 3 s", done.stderr), done.stderr[-3000:]
  assert "and it did not change for the takeover age (3 s" in done.stderr
  assert sorted(_losses(workdir)) == list(range(1, 7))
  assert not (workdir / "lease.json").exists()


@pytest.mark.slow(seconds=25)
def test_a_live_run_whose_clock_lags_is_refused_and_one_whose_lease_was_taken_saves_nothing(
    tmp_path):
  """A run whose clock is a day behind (the times it writes into its lease) holds its workdir:
  the same command launched again on it is refused, naming the run, and the run trains on.
  Then another launch takes the lease (written as a taker would): the run stops at its next
  step in one line and saves nothing into the workdir it no longer holds."""
  workdir = tmp_path / "run"
  # The launcher through tests/lagging_clock.py: its lease's clock a day behind.
  run = forked.background("tests.lagging_clock", [str(-DAY), *TINY, "--fdl_set=train.steps=100000",
                                                  f"--workdir={workdir}"],
                          dict(_env(1), **{lease_lib.TAKEOVER_ENV: "6"}))
  try:
    run.until(lambda: (workdir / "checkpoints" / "3").exists())
    assert json.loads((workdir / "lease.json").read_text())["heartbeat"] < time.time() - DAY + 600
    again = _launch(workdir, 100000, timeout=120)
    assert again.returncode == 1, again.stderr[-3000:]
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {workdir} is in use by pid {run.proc.pid} on host "), last
    trained = max(_losses(workdir))
    run.until(lambda: max(_losses(workdir)) >= trained + 3)  # it trains on, holding its lease
    assert json.loads((workdir / "lease.json").read_text())["pid"] == run.proc.pid
    # Another launch takes the lease over (again until the run has seen it: a renewal under
    # way may replace it once).
    while run.proc.poll() is None:
      _holder(workdir, pid=os.getpid())
      time.sleep(0.2)
    assert run.finish() == 1, run.log()
  finally:
    run.kill()
  last = run.lines[-1]
  assert re.match(rf"error: the workdir lease {workdir / 'lease.json'} was taken over by pid "
                  rf"{os.getpid()} on host .*\. Step (\d+) was not saved: another launch holds "
                  "the workdir now", last), run.log()
  assert "Traceback" not in run.log(1000)
  stopped = int(re.search(r"Step (\d+) was not saved", last)[1])
  committed = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
  assert stopped not in committed and max(committed) < stopped, (committed, stopped)
  assert json.loads((workdir / "lease.json").read_text())["pid"] == os.getpid()  # theirs stays


@pytest.mark.slow(seconds=20)
def test_a_later_attempt_takes_over_a_live_run_at_once_and_the_earlier_saves_nothing_more(
    tmp_path):
  """Through the launcher, as JobSet's restart attempts (or SLURM's requeue count) number them:
  attempt 0 trains, saving every step; the same attempt launched again is refused; attempt 1
  takes the lease over at once (no takeover age waited, though the holder is alive) and
  trains to its end; attempt 0 stops at its next save in one line, not saving it."""
  workdir = tmp_path / "run"
  attempt = lambda n: dict(_env(1), **{lease_lib.JOB_ENV: "jobset-uid-7",
                                       lease_lib.ATTEMPT_ENV: str(n),
                                       lease_lib.TAKEOVER_ENV: "600"})
  args = [f"--workdir={workdir}", "--fdl_set=checkpoint.every=1"]
  run = _background([*args, "--fdl_set=train.steps=100000"], attempt(0))
  try:
    run.until(lambda: (workdir / "checkpoints" / "3").exists())
    again = forked.completed("main", [*TINY, *args, "--fdl_set=train.steps=100000"], attempt(0),
                             timeout=120)
    assert again.returncode == 1 and f"is in use by pid {run.proc.pid}" in again.stderr
    later = forked.completed("main", [*TINY, *args, "--fdl_set=train.steps=12"], attempt(1),
                             timeout=300)
    assert later.returncode == 0, later.stderr[-3000:]
    assert re.search(r"taking over the workdir lease \S+: it is held by pid \d+ on host \S+ "
                     r"\(attempt 0 of job jobset-uid-7\) and this launch is attempt 1",
                     later.stderr), later.stderr[-3000:]
    assert "waiting up to" not in later.stderr
    assert run.finish() == 1, run.log()
  finally:
    run.kill()
  assert re.search(r"^error: .*\(attempt 1 of job jobset-uid-7\).*Step (\d+) was not saved",
                   run.lines[-1]), run.log()
  assert "Traceback" not in run.log(1000)
  assert max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == 12
  assert not (workdir / "lease.json").exists()  # the later attempt ended and released it


class _AnswerLost:
  """A TCP relay in front of a store's server that lets one lease renewal land and loses its
  answer: the renewal (a conditional replacement of lease.json: GCS's multipart upload with
  ifGenerationMatch=<generation>, S3's PUT with If-Match) reaches the server, which writes it
  and answers; the relay holds that answer past the client's request timeout, then cuts the
  connection. `answers` keeps every renewal's HTTP status, in order, and which was lost."""

  _HEAD = re.compile(rb"(GET|HEAD|POST|PUT|PATCH|DELETE) (\S+) HTTP/1\.[01]\r\n(.*?)\r\n\r\n",
                     re.S)

  def __init__(self, backend_port: int, hold_s: float):
    self.backend_port, self.hold_s = backend_port, hold_s
    self.answers: list[tuple[int, bool]] = []  # (status, lost)
    self._lock = threading.Lock()
    self._open: set[socket.socket] = set()
    self._listener = socket.create_server(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
    threading.Thread(target=self._accept, daemon=True).start()

  @staticmethod
  def _renewal(method: bytes, target: bytes, headers: bytes) -> bool:
    gcs = (method == b"POST" and b"uploadType=multipart" in target
           and re.search(rb"ifGenerationMatch=[1-9]", target))
    s3 = (method == b"PUT" and target.split(b"?")[0].endswith(b"/lease.json")
          and re.search(rb"^if-match:", headers, re.I | re.M))
    return bool(gcs or s3)

  def _accept(self):
    while True:
      try:
        client, _ = self._listener.accept()
        backend = socket.create_connection(("127.0.0.1", self.backend_port))
      except OSError:
        return
      with self._lock:
        self._open |= {client, backend}
      renewals = collections.deque()  # per request on this connection: is it a renewal
      threading.Thread(target=self._requests, args=(client, backend, renewals),
                       daemon=True).start()
      threading.Thread(target=self._answers, args=(backend, client, renewals),
                       daemon=True).start()

  def _requests(self, client, backend, renewals):
    pending = b""  # the bytes after the last complete request head (a head may be split)
    with contextlib.suppress(OSError):
      while data := client.recv(1 << 16):
        pending = (pending + data)[-(1 << 16):]
        end = 0
        for head in self._HEAD.finditer(pending):
          renewals.append(self._renewal(*head.groups()))  # before the server can answer
          end = head.end()
        pending = pending[end:]
        backend.sendall(data)
    self._close(client, backend)

  def _answers(self, backend, client, renewals):
    with contextlib.suppress(OSError):
      while data := backend.recv(1 << 16):
        status = re.match(rb"HTTP/1\.[01] (\d{3}) ", data)
        # (1xx: not the answer yet)
        if status and int(status[1]) >= 200 and renewals and renewals.popleft():
          with self._lock:
            lose = int(status[1]) == 200 and not any(lost for _, lost in self.answers)
            self.answers.append((int(status[1]), lose))
          if lose:
            time.sleep(self.hold_s)
            break
        client.sendall(data)
    self._close(backend, client)

  def _close(self, *sockets):
    with self._lock:
      self._open -= set(sockets)
    for sock in sockets:
      with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
      sock.close()

  def renewed_after_the_lost_one(self) -> bool:
    """The lost renewal's retry was refused (412: the lease had changed, by its own write) and
    a later renewal succeeded."""
    with self._lock:
      statuses = [status for status, _ in self.answers]
      lost = [i for i, (_, was_lost) in enumerate(self.answers) if was_lost]
    after = statuses[lost[0] + 1:] if lost else []
    return 412 in after and 200 in after[after.index(412):]

  def close(self):
    self._listener.close()
    with self._lock:
      sockets, self._open = self._open, set()
    for sock in sockets:
      with contextlib.suppress(OSError):
        sock.close()


@pytest.mark.parametrize("store", ["gs", "s3"])
@pytest.mark.slow(seconds=15)
def test_a_renewal_whose_answer_was_lost_is_the_runs_own_and_the_run_trains_on(store, tmp_path):
  """A lease renewal in a bucket lands but its answer never comes (held past the request
  timeout, then the connection cut): the client retries the same conditional write, which
  the store refuses (412) as the lease changed since — by that very write. The run finds its
  own token in the lease, keeps renewing and training, and stops cleanly when asked; before,
  it named itself the usurper and stopped."""
  with contextlib.ExitStack() as stack:
    if store == "gs":
      (tmp_path / "gcs").mkdir()
      server = storage_servers.GcsServer(tmp_path / "gcs")
      server.start()
      stack.callback(server.close)
      server.make_bucket("lease")
      proxy = _AnswerLost(server.port, hold_s=3.0)
      env = {k: v.replace(server.url, proxy.url) for k, v in server.env.items()}
    else:
      env = stack.enter_context(storage_servers.s3_server())
      moto = env["AWS_ENDPOINT_URL"]
      urllib.request.urlopen(urllib.request.Request(f"{moto}/lease", method="PUT"),
                             timeout=10).close()
      proxy = _AnswerLost(int(moto.rpartition(":")[2]), hold_s=3.0)
      env = dict(env, AWS_ENDPOINT_URL=proxy.url)
    stack.callback(proxy.close)
    # Renewals every 1.25 s, each request's deadline 2 s; the run gives up on a lease it
    # cannot renew for 7.5 s, well after the lost renewal's retry.
    run = _background(["--fdl_set=train.steps=100000", f"--workdir={store}://lease/run"],
                      dict(_env(1), **env, **{settings.TIMEOUT_ENV: "2",
                                              lease_lib.TAKEOVER_ENV: "15"}))
    stack.callback(run.kill)
    run.until(proxy.renewed_after_the_lost_one)
    run.proc.send_signal(signal.SIGTERM)
    code = run.finish()
  assert code == 0, run.log()
  assert re.search(r"interrupted \(SIGTERM\) at step \d+: saved", run.log(1000)), run.log()
  assert "taken over" not in run.log(1000), run.log()
  assert [lost for _, lost in proxy.answers].count(True) == 1, proxy.answers


@pytest.mark.slow(seconds=25)
def test_a_run_that_cannot_renew_its_lease_stops_at_a_step_boundary_in_one_line(tmp_path):
  """Renewals fail (the lease became a directory): past half the takeover age the run stops at
  its next step, saves it and exits 1 with one line saying why; it never trains on."""
  workdir = tmp_path / "run"
  run = _background(["--fdl_set=train.steps=100000", f"--workdir={workdir}"],
                    dict(_env(1), **{lease_lib.TAKEOVER_ENV: "6"}))
  try:
    run.until(lambda: (workdir / "checkpoints" / "3").exists(), 300)
    (workdir / "lease.json").unlink()
    (workdir / "lease.json").mkdir()
    broken = time.monotonic()
    code = run.finish(120)
  finally:
    run.kill()
  err = run.log(10**6)
  assert code == 1, err[-3000:]
  assert time.monotonic() - broken < 30
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"error: the workdir lease {workdir / 'lease.json'} could not be "
                         "renewed for "), err[-3000:]
  assert "Saved step" in last and "Traceback" not in err
  saved = int(last.split("Saved step ")[1].split(";")[0])
  committed = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert committed[-1] == saved == max(_losses(workdir))  # nothing trained after the stop
