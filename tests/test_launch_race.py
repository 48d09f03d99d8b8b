"""Two launches meeting on one workdir, through the real launcher: the one the lease refuses
removes nothing of the winner's (it has written nothing: the lease is taken before the launch
records itself), a live holder that renews less often than a taker watches is never taken
over (the lease records its holder's takeover age and a taker waits the longer), and two
launchers started together on a local disk, in S3 (moto) and in GCS (fake-gcs-server) leave the
winner's files whole (harness/launch_race.py; 20 rounds a store: benchmarks/launch_race.py)."""

import contextlib
import itertools
import os
import signal
import time

import pytest

from harness import launch_race
from olmo3.run import lease as lease_lib
from olmo3.run import record
from olmo3.run.lease import Lease, LeaseHeld
from tests import forked
from tests.test_lease import TAKEOVER, _holder, _takes
from tests.test_reliability import TINY, _env, _losses


def _until_stopped(run: forked.Running, seconds: float = 240) -> None:
  """Waits until the program has stopped itself (SIGSTOP: state T in /proc)."""
  def stopped() -> bool:
    with open(f"/proc/{run.proc.pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] == "T"
  run.until(stopped, seconds)


def _whole(workdir, history_before: int) -> list[str]:
  """What is wrong with a run a signal stopped at its last saved step (nothing: whole)."""
  return launch_race.check(launch_race.LocalFiles(os.fspath(workdir)), max(_losses(workdir)),
                           history_before, trained=1)


@pytest.mark.parametrize("workdir_was", ["new", "resumed"])
@pytest.mark.slow(seconds=6)
def test_a_launch_the_lease_refuses_leaves_the_winners_files_whole(workdir_was, tmp_path):
  """The loser starts first and is paused just before it tries to take the lease
  (tests/launch_stand_ins.py); the winner takes it and trains; the loser, let go, is refused
  naming the winner, and the winner trains on to a clean stop with every file of its run.
  Before, the loser had recorded itself by then and, refused, took back everything the workdir
  had gained since: the winner's record, metrics, events and lease (in a new workdir, all of
  it but checkpoints/), and the winner stopped at its next renewal, "taken over"."""
  workdir = tmp_path / "run"
  env = _env(1)
  if workdir_was == "resumed":
    done = forked.completed("main", [*TINY, "--fdl_set=train.steps=3", f"--workdir={workdir}"],
                            env)
    assert done.returncode == 0, done.stderr[-3000:]
  args = [*TINY, "--fdl_set=train.steps=100000", f"--workdir={workdir}"]
  loser = forked.background("tests.launch_stand_ins", ["pause", *args], env)
  with contextlib.ExitStack() as stack:
    stack.callback(loser.kill)
    _until_stopped(loser)
    winner = forked.background("main", args, env)
    stack.callback(winner.kill)
    winner.until(lambda: (workdir / "checkpoints" / "9").exists())
    loser.proc.send_signal(signal.SIGCONT)
    assert loser.finish() == 1, loser.log()
    assert loser.lines[-1].startswith(
        f"error: {workdir} is in use by pid {winner.proc.pid} on host "), loser.log()
    trained = max(_losses(workdir))
    winner.until(lambda: max(_losses(workdir)) >= trained + 3)  # it trains on, holding its lease
    winner.proc.send_signal(signal.SIGTERM)
    assert winner.finish() == 0, winner.log()
  assert "taken over" not in winner.log(10**6)
  assert _whole(workdir, history_before=1 if workdir_was == "resumed" else 0) == []


@pytest.mark.slow(seconds=12, waits=True)
def test_a_holder_renewing_less_often_than_a_taker_watches_is_not_taken_over(tmp_path):
  """A run in another container (this machine cannot check its process) renews its lease every
  5 s (OLMO3_LEASE_TAKEOVER_S=60); launches set to take over a lease unchanged for 0.5 s wait
  the holder's 60 s instead, see it renewed and are refused, and the run trains on. Before,
  they took it over between two renewals and both trained into the same workdir."""
  workdir = tmp_path / "run"
  args = [*TINY, "--fdl_set=train.steps=100000", f"--workdir={workdir}"]
  holder = forked.background("tests.launch_stand_ins", ["container", *args],
                             dict(_env(1), **{lease_lib.TAKEOVER_ENV: "60"}))
  with contextlib.ExitStack() as stack:
    stack.callback(holder.kill)
    holder.until(lambda: (workdir / "checkpoints" / "3").exists())
    for _ in range(2):
      taker = forked.completed("main", args, dict(_env(1), **{lease_lib.TAKEOVER_ENV: "0.5"}),
                               timeout=90)
      assert taker.returncode == 1, taker.stderr[-3000:]
      assert "which this launch cannot check; waiting up to 60 s" in taker.stderr
      last = taker.stderr.strip().splitlines()[-1]
      assert last.startswith(f"error: {workdir} is in use by pid {holder.proc.pid} on host "), last
      assert last.endswith("has not changed for 60 s, the holder's OLMO3_LEASE_TAKEOVER_S, "
                           "longer than this launch's 0.5 s)."), last
    trained = max(_losses(workdir))
    holder.until(lambda: max(_losses(workdir)) >= trained + 3)
    holder.proc.send_signal(signal.SIGTERM)
    assert holder.finish() == 0, holder.log()
  assert "taken over" not in holder.log(10**6)
  assert _whole(workdir, history_before=0) == []


@pytest.mark.seconds(3, waits=True)
def test_a_taker_waits_the_longer_of_its_own_takeover_age_and_the_holders(tmp_path):
  # A live holder elsewhere renewing every 0.2 s: a taker set to 0.05 s is refused every time.
  live = Lease(tmp_path, takeover=2.4)
  live.record.update(host="elsewhere")
  live.acquire()
  for _ in range(5):
    with pytest.raises(LeaseHeld, match=r"on host elsewhere .*has not changed for 2\.4 s, the "
                       r"holder's OLMO3_LEASE_TAKEOVER_S, longer than this launch's 0\.05 s"):
      Lease(tmp_path, takeover=0.05).acquire()
  assert live.lost() is None
  live.release()
  # A holder elsewhere that stopped renewing, having recorded 1 s: taken over after 1 s.
  _holder(tmp_path, host="elsewhere", takeover_s=1.0)
  assert 0.7 < _takes(tmp_path, 0.05) < 3
  # One that recorded no age, or a garbled one: the taker's own.
  for recorded in (None, "soon", -1.0, float("nan")):
    _holder(tmp_path, host="elsewhere", takeover_s=recorded)
    assert _takes(tmp_path, 0.05) < 0.6


@pytest.mark.parametrize("workdir_was", ["new", "resumed"])
def test_undo_leaves_the_lease_to_the_lease(workdir_was, tmp_path):
  """A launch that trained nothing takes back, under its lease, what the workdir gained since
  it recorded itself, but not lease.json (its release removes it, last) nor another launch's
  conditional write of it in flight; a converted OLMo-core checkpoint goes only with a
  workdir that held nothing before."""
  if workdir_was == "resumed":
    (tmp_path / "checkpoints").mkdir()
  held = Lease(tmp_path, takeover=TAKEOVER)
  held.acquire()
  run_record = record.RunRecord(str(tmp_path))
  run_record.begin({"json": "{}", "text": "{}"}, {}, ["launch"], 0)
  (tmp_path / "metrics.jsonl").write_text("")
  (tmp_path / "olmo_core_import").mkdir()
  (tmp_path / "lease.json.0123.tmp").write_text("")  # another launch's create, under way
  run_record.undo()
  held.release()
  assert sorted(os.listdir(tmp_path)) == {
      "new": ["lease.json.0123.tmp"],
      "resumed": ["checkpoints", "lease.json.0123.tmp", "olmo_core_import"]}[workdir_was]


class _Launch:
  """A launch the race started in a driver's child, its output (both streams) in a file."""

  def __init__(self, child: forked.Child, out):
    self.child, self.out = child, out

  def finish(self) -> tuple[int, str]:
    code = self.child.wait(300)
    return code, self.out.read_text()


@contextlib.contextmanager
def _forked_start(tmp_path):
  """launch_race's `start` forking each launch from a driver (one per environment: the store's
  server is started within the race)."""
  drivers: dict[tuple, forked.Driver] = {}
  numbers = itertools.count()

  def start(argv, env):
    key = tuple(sorted(env.items()))
    if key not in drivers:
      drivers[key] = forked.Driver(env)
    out = tmp_path / f"launch-{next(numbers)}.log"
    return _Launch(drivers[key].start("main", argv, out, env=env), out)

  try:
    yield start
  finally:
    for driver in drivers.values():
      driver.__exit__()


@pytest.mark.parametrize("store", [
    pytest.param("local", marks=pytest.mark.slow(seconds=6)),
    pytest.param("s3", marks=pytest.mark.slow(seconds=10)),
    pytest.param("gs", marks=pytest.mark.slow(seconds=9))])
def test_two_launchers_racing_leave_the_winners_files_whole(store, tmp_path):
  """Two launches of one command started together, on a new workdir and then on the run it
  holds, extended: one trains, the other is refused (or finds nothing left), and the winner's
  files are whole. Before, a refused launch removed them in 3 of 3 such S3 rounds."""
  with _forked_start(tmp_path) as start:
    began = time.monotonic()
    rounds = launch_race.race(store, os.fspath(tmp_path / "scratch"), 2, start,
                              base_env=_env(1))
  assert [(r.failures, r.problems) for r in rounds] == [((), ())] * 2, (
      rounds, time.monotonic() - began)
