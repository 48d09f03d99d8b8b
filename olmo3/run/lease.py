"""One live run per workdir: WORKDIR/lease.json names the launch that holds it (a token of its
own, its host, pid and that process's start, the machine's boot and pid namespace, its takeover
age, a renewal count and, for people, the times it started and last renewed by its own clock),
written by the job's first process before it writes anything else there (the launcher takes it
before it records the launch), renewed while it runs and removed when it ends. A second launch
on the same workdir refuses, naming the holder, instead of writing the same checkpoints and
metric lines; refused, it has written nothing there, so it has nothing to take back.

No wall clock decides anything. A holder's clock may be off by any amount (hosts drift, a VM
resumes with a stale clock, a container's clock is set wrong), so the times in the lease are
never compared with the reader's, nor the store's modification times. What is trusted instead:
- this machine's process table, for a holder of this machine: same host, boot and pid
  namespace, its pid still running the process that started when the lease says;
- the lease object itself, watched on the would-be taker's own monotonic clock: every renewal
  changes it (its bytes, with the renewal count, and its GCS generation / S3 ETag), so a lease
  that stays exactly as it was for the takeover age (`OLMO3_LEASE_TAKEOVER_S`, default 360 s)
  belongs to a holder that stopped renewing (a live holder renews it every takeover age / 12);
  the age watched is the longer of the taker's own and the one the holder recorded in its
  lease, so a launch set to a shorter age never takes over a holder that renews less often;
- the store's conditional writes (below), so that only one launch wins any change.

When is a holder dead (its lease is taken over)?
- at once when this launch is a later attempt of the holder's job: the scheduler that restarts
  a job numbers its attempts (JobSet's restart attempt, SLURM's restart count of a requeued job,
  or `OLMO3_JOB` / `OLMO3_ATTEMPT`; `attempt_setting`), and starts attempt n + 1
  only once it has given attempt n up. The earlier attempt, if a process of it still runs, is
  fenced: its next renewal finds this launch's token and it stops at its next step boundary
  without saving (below). A launch of the same attempt, an earlier one or none keeps the rules
  that follow;
- at once when it is provably a dead process of this machine: its pid no longer runs, runs
  another process (started at another time: a reused pid), or is this launch's own pid (a
  restarted container's PID 1 finds its predecessor's lease);
- otherwise (another host, another container, a lease it cannot parse) once the launch has
  watched the lease unchanged for the takeover age; if it changes meanwhile (a live holder
  renewed it, or another launch took it), the launch is refused. So a restarted job on another
  machine or container waits the takeover age, however long ago its predecessor died.
A live holder of this machine is refused at once, whatever its lease says; a live holder
elsewhere is never taken over while it renews.

Every change is conditional on what was read, so two launches never both win: local disks
create by linking a complete file into place and replace by renaming the old one aside first;
GCS and S3 check an ifGenerationMatch / If-None-Match / If-Match precondition on the server
(olmo3.io.storage). A write that landed but whose answer was lost (a timeout, a cut
connection) is retried and then fails its own precondition: a launch that finds its own token
in the lease knows the write was its own and carries on (only this launch writes its token).
The heartbeat retries failed renewals; one that cannot renew for half the takeover age, or
that finds another launch's token in the lease, makes `lost()` say why, and the loop stops at
its next step boundary (olmo3.train.loop): a run never trains on without its lease. It saves
that step only while the lease is still its own (`stop_without_lease`): a run whose lease
another launch holds writes no checkpoint into that launch's run.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import NoReturn

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from olmo3 import program
from olmo3.io import conditional, errors, pathnames, retry, storage
from olmo3.run import processes
from olmo3.run.record import Workdir

TAKEOVER_ENV = "OLMO3_LEASE_TAKEOVER_S"
JOB_ENV = "OLMO3_JOB"  # the job's identity across its restarts (JobSet's uid, SLURM's job id)
ATTEMPT_ENV = "OLMO3_ATTEMPT"  # which attempt of that job this launch is: 0, 1, ...
DEFAULT_TAKEOVER_S = 360.0  # twice the storage retry budget: a renewal outlasts an outage
_BEATS_PER_TAKEOVER = 12  # the heartbeat's period is the takeover age / 12 (30 s by default)


class LeaseHeld(RuntimeError):
  """Another live job holds the workdir. The message names its host and pid."""


class LeaseLost(RuntimeError):
  """The run could not keep its workdir lease; the message says why. `taken`: another launch
  holds the workdir now, so nothing more of this run's belongs there."""

  def __init__(self, message: str, taken: bool = False):
    super().__init__(message)
    self.taken = taken


class _Verdict(enum.Enum):
  ALIVE = "alive"
  DEAD = "dead"
  FENCED = "fenced"  # an earlier attempt of this job, perhaps alive: taken over at once
  UNKNOWN = "unknown"  # watched until it changes (alive) or stays as it is (dead)


def takeover_s() -> float:
  return program.seconds_setting(TAKEOVER_ENV, DEFAULT_TAKEOVER_S)


def attempt_setting() -> tuple[str, int] | None:
  """(job, attempt) from `OLMO3_JOB` and `OLMO3_ATTEMPT` (a rendered JobSet sets both from its
  pod's labels; set them by hand for other schedulers), else from SLURM's own job id and
  restart count (a requeued job keeps its id and counts up), or None when neither says;
  SettingError naming the variable when only one of ours is set, or the attempt is not a count
  from 0."""
  job, attempt = os.environ.get(JOB_ENV, ""), os.environ.get(ATTEMPT_ENV, "")
  if not job and not attempt:
    slurm = os.environ.get("SLURM_JOB_ID", "")
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
    return (f"slurm-{slurm}", int(restarts)) if slurm and restarts.isdigit() else None
  if not job:
    raise program.SettingError(f"{ATTEMPT_ENV}={attempt!r} needs {JOB_ENV}: the job whose "
                               "attempt this launch is")
  if not attempt.isdigit():
    raise program.SettingError(f"{ATTEMPT_ENV}={attempt!r}: expected the attempt of job "
                               f"{job!r} as a count from 0 ({JOB_ENV} is set)")
  return job, int(attempt)


def _parse(data: bytes) -> dict | None:
  """A lease's holder, or None when the bytes are no lease (empty, torn, hand-edited)."""
  try:
    holder = json.loads(data)
    int(holder["pid"])
  except (ValueError, TypeError, KeyError):
    return None
  return holder if isinstance(holder.get("token"), str) else None


def _ago(seconds: float) -> str:
  return f"{max(0.0, seconds):.0f} s"


def _who(holder: dict) -> str:
  job, attempt = holder.get("job"), holder.get("attempt")
  of = f" (attempt {attempt} of job {job})" if job is not None and attempt is not None else ""
  return f"pid {holder['pid']} on host {holder.get('host')}{of}"


class Lease:
  def __init__(self, workdir: str | os.PathLike, takeover: float | None = None):
    self.path = Workdir(os.fspath(workdir)).lease
    self.url = os.fspath(self.path)
    self.takeover_s = takeover_s() if takeover is None else takeover
    attempt = attempt_setting()
    self.beat_s = self.takeover_s / _BEATS_PER_TAKEOVER
    pid = os.getpid()
    # "takeover_s": how long a taker watches this lease unchanged at least (it is renewed every
    # takeover_s / 12): a launch watching with a shorter age of its own waits this one.
    self.record = {"host": socket.gethostname(), "pid": pid, "token": uuid.uuid4().hex,
                   "started": time.time(), "pid_start": processes.start_time(pid),
                   "takeover_s": self.takeover_s, **processes.machine(),
                   **({"job": attempt[0], "attempt": attempt[1]} if attempt else {})}
    self._writes = itertools.count(1)  # the renewal count: every write's bytes differ
    self._version = ""  # the object's generation / ETag as this launch last wrote it
    self._renewed = 0.0  # time.monotonic() when the last write that landed was sent
    self._error: BaseException | None = None  # the last renewal's failure
    self._taken: str | None = None  # set when another launch's token is found in the lease
    # Who this launch fenced when it took the lease from an earlier attempt of its job, which
    # may still be running (a save of its may be in flight): None otherwise.
    self.fenced: str | None = None
    self._stop = threading.Event()
    self._beat: threading.Thread | None = None

  # --- taking it ---------------------------------------------------------------------------

  def acquire(self) -> None:
    """Takes the lease or raises LeaseHeld; then keeps it renewed until release(). May wait
    (the takeover age) for a holder it cannot check."""
    # The lease as first seen (its bytes and version) and until when (monotonic) it is watched.
    watched: tuple[tuple[bytes, str], float] | None = None
    for attempt in itertools.count():
      current = conditional.read_versioned(self.url)
      if current is None:
        sent = time.monotonic()
        try:
          self._version = conditional.create_exclusive(self.url, self._encode())
          break
        except errors.PreconditionFailed:
          if self._holds():  # our own create, its answer lost, retried
            break
          if attempt >= 2:
            raise LeaseHeld(self._race()) from None
          continue
      holder = _parse(current.data)
      verdict, why = self._judge(holder)
      if verdict is _Verdict.ALIVE:
        raise LeaseHeld(self._held(holder))
      if verdict is _Verdict.UNKNOWN:
        seen = (current.data, current.version)
        age = self._age(holder)
        if watched is None:
          watched = (seen, time.monotonic() + age)
          logging.warning("%s: %s, which this launch cannot check; waiting up to %s for it to "
                          "change (renewed: a live run holds it, this launch stops) or not "
                          "(taken over)", self.url, why, _ago(age))
        elif seen != watched[0]:
          raise LeaseHeld(self._held(holder) if holder else self._race())
        if time.monotonic() < watched[1]:
          time.sleep(max(0.1, min(self.beat_s / 2, 5.0)))
          continue
        why = (f"{why}, and it did not change for the takeover age ({self._age_words(holder)}) "
               "while this launch watched it")
      logging.warning("taking over the workdir lease %s: %s", self.url, why)
      if verdict is _Verdict.FENCED:
        self.fenced = _who(holder)
      sent = time.monotonic()
      try:
        self._version = conditional.replace_if(self.url, self._encode(), current)
        break
      except errors.PreconditionFailed:
        if self._holds():  # our own takeover, its answer lost, retried
          break
        now = conditional.read_versioned(self.url)
        holder = _parse(now.data) if now is not None else None
        raise LeaseHeld(self._held(holder) if holder else self._race()) from None
    self._renewed = sent
    self._beat = threading.Thread(target=self._heartbeat, name="workdir-lease", daemon=True)
    self._beat.start()

  def _judge(self, holder: dict | None) -> tuple[_Verdict, str]:
    """(verdict, why in words). No clock is read: see the module's docstring."""
    if holder is None:
      return _Verdict.UNKNOWN, "it is not a readable lease (empty or torn)"
    who = _who(holder)
    mine = self.record
    theirs = holder.get("attempt")
    verdict, why = self._liveness(holder, who)
    if ("attempt" in mine and holder.get("job") == mine["job"] and type(theirs) is int
        and theirs < mine["attempt"]):
      # Taken over at once; FENCED unless its holder is seen not to run (then nothing of it
      # can still be writing: no save of it to wait for).
      return (_Verdict.DEAD if verdict is _Verdict.DEAD else _Verdict.FENCED,
              f"it is held by {who} and this launch is attempt {mine['attempt']}, a later one: "
              "the earlier attempt is fenced (it stops at its next renewal without saving)")
    return verdict, why

  def _liveness(self, holder: dict, who: str) -> tuple[_Verdict, str]:
    """ALIVE or DEAD where this machine can tell (the holder's pid in this boot and pid
    namespace), else UNKNOWN."""
    mine = self.record
    same_host = holder.get("host") == mine["host"]
    if same_host and all(holder.get(k) == mine[k] and mine[k] is not None
                         for k in ("boot_id", "pid_ns")):
      pid = int(holder["pid"])
      started = processes.start_time(pid)
      if started is None:
        return _Verdict.DEAD, f"its holder ({who}) no longer runs"
      recorded = holder.get("pid_start")  # None: a lease that does not say
      if started and started != recorded and (recorded is not None or pid == mine["pid"]):
        # Another process has the pid now: a reused pid, or this very launch (a restarted
        # container's PID 1 finding its predecessor's lease).
        return (_Verdict.DEAD, f"pid {pid} is another process now than the one that held it "
                "(a reused pid, or a restarted container's)")
      return _Verdict.ALIVE, ""
    if same_host and mine["boot_id"] is None and holder.get("boot_id") is None:
      with contextlib.suppress(PermissionError):  # no /proc (not Linux): no pid namespaces
        try:
          os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
          return _Verdict.DEAD, f"its holder ({who}) no longer runs"
    return _Verdict.UNKNOWN, f"it is held by {who}"

  def _held(self, holder: dict) -> str:
    started = holder.get("started")
    since = f"running since {time.ctime(float(started))} by its clock; " if isinstance(
        started, (int, float)) else ""
    return (f"{self.path.parent} is in use by {_who(holder)} ({since}lease {self.url}). Wait "
            "for that run to end or stop it; a lease whose holder died is taken over "
            "automatically (at once where this machine can tell its process ended, else once "
            f"the lease has not changed for {self._age_words(holder)}).")

  def _age(self, holder: dict | None) -> float:
    """How long a lease must stay unchanged before this launch takes it over: the longer of
    this launch's takeover age and the one its holder recorded (it renews every twelfth of
    that, so a taker with a shorter age of its own would take over a live holder between two
    renewals)."""
    recorded = holder.get("takeover_s") if holder is not None else None
    if (isinstance(recorded, (int, float)) and not isinstance(recorded, bool)
        and math.isfinite(recorded) and recorded > 0):
      return max(self.takeover_s, float(recorded))
    return self.takeover_s

  def _age_words(self, holder: dict | None) -> str:
    age = self._age(holder)
    if age > self.takeover_s:
      return (f"{age:g} s, the holder's {TAKEOVER_ENV}, longer than this launch's "
              f"{self.takeover_s:g} s")
    return f"{age:g} s, {TAKEOVER_ENV}"

  def _race(self) -> str:
    return f"{self.path.parent}: another launch took the lease {self.url} at the same moment"

  def _encode(self) -> bytes:
    return json.dumps({**self.record, "renewals": next(self._writes),
                       "heartbeat": time.time()}).encode()

  def _holds(self) -> bool:
    current = conditional.read_versioned(self.url)
    holder = _parse(current.data) if current is not None else None
    if holder is not None and holder["token"] == self.record["token"]:
      self._version = current.version
      return True
    return False

  # --- keeping it --------------------------------------------------------------------------

  def _renew(self) -> None:
    if pathnames.is_url(self.url):
      try:
        self._version = conditional.replace_if(
            self.url, self._encode(), conditional.Versioned(b"", self._version, 0.0))
        return
      except errors.PreconditionFailed:
        current = conditional.read_versioned(self.url)
      holder = _parse(current.data) if current is not None else None
      if holder is not None and holder["token"] == self.record["token"]:
        # Our own write: this renewal's, landed though its answer was lost and then retried
        # against the version it replaced (or an earlier renewal's, lost the same way). No
        # other launch writes this token, so nobody took the lease meanwhile.
        self._version = current.version
        return
    else:  # a local file is replaced in one rename: no moment without a lease
      current = conditional.read_versioned(self.url)
      holder = _parse(current.data) if current is not None else None
      if holder is not None and holder["token"] == self.record["token"]:
        if not self._stop.is_set():
          # Flushed: renewed every few seconds; a machine that crashes loses its lease anyway.
          storage.write_bytes_atomic(self.url, self._encode(),
                                     durability=storage.Durability.FLUSHED)
        return
    self._taken = (f"the workdir lease {self.url} was taken over by " + (
        _who(holder) if holder else "another launch (it is gone or unreadable)") +
        f" while this run held it (after {_ago(time.monotonic() - self._renewed)} without a "
        "renewal)")

  def _heartbeat(self) -> None:
    pause = self.beat_s
    while not self._stop.wait(pause):
      sent = time.monotonic()  # the write lands after this: a taker's watch starts later
      try:
        self._renew()
      except Exception as e:  # pylint: disable=broad-except  # retried; lost() says when to stop
        self._error = e
        pause = max(0.1, min(self.beat_s, 5.0))
        continue
      if self._taken is not None:
        return
      self._renewed, self._error, pause = sent, None, self.beat_s

  def lost(self) -> str | None:
    """Why this run no longer holds its lease (None while it does): another launch took it
    over, or it could not be renewed for half the takeover age (by the takeover age another
    launch could take it). Cheap: the loop asks at every step."""
    if self._taken is not None:
      return self._taken
    if self._beat is None:
      return None
    silent = time.monotonic() - self._renewed
    if silent <= self.takeover_s / 2:
      return None
    error = self._error
    cause = f" (last error: {type(error).__name__}: {errors.first_line(error)})" if error else ""
    return (f"the workdir lease {self.url} could not be renewed for {_ago(silent)}{cause}; "
            f"at {self.takeover_s:g} s ({TAKEOVER_ENV}) another launch could take the workdir "
            "over, so this run stops")

  def still_held(self) -> bool:
    """Whether this launch provably holds its lease now: acquired, not found taken nor gone
    unrenewed (`lost`), and the lease as read now carries its token. False when the lease
    cannot be read (the store down): what only the holder may do (the launcher taking back
    what it wrote) waits for that proof."""
    if self._beat is None or self.lost() is not None:
      return False
    try:
      return self._holds()
    except Exception:  # pylint: disable=broad-except  # unreadable: no proof
      return False

  def elsewhere(self) -> str | None:
    """Who holds the lease now when this launch does not, in words (None: this launch, or it
    cannot be read just now, the store down). Reads the lease unless a renewal found it
    taken."""
    if self._taken is not None:
      return self._taken
    try:
      # One attempt: a store that is down would answer no better within the retry budget,
      # and the save after this look has its own.
      with retry.attempts_once():
        current = conditional.read_versioned(self.url)
    except Exception:  # pylint: disable=broad-except  # cannot tell: the caller's save decides
      return None
    holder = _parse(current.data) if current is not None else None
    if holder is not None and holder["token"] == self.record["token"]:
      return None
    return (f"{_who(holder)} holds the workdir lease {self.url} now" if holder else
            f"the workdir lease {self.url} is no longer this run's (it is gone or unreadable)")

  def release(self) -> None:
    """Stops the heartbeat and removes the lease if it is still this launch's. Never raises
    (it runs on the way out, after whatever stopped the run): a lease it cannot remove is
    taken over by the next launch once it has watched it unchanged for the takeover age."""
    global _held  # pylint: disable=global-statement
    if _held is self:
      _held = None
    self._stop.set()
    if self._beat is None:
      return
    self._beat.join(timeout=10.0)  # a renewal stuck in an outage is not waited for
    self._beat = None
    if self._taken is not None:
      return
    try:
      if self._holds():
        storage.remove(self.url)
    except Exception as e:  # pylint: disable=broad-except  # see the docstring
      logging.warning("could not release the workdir lease %s (%s: %s); the next launch takes "
                      "it over once it has not changed for %g s", self.url, type(e).__name__,
                      errors.first_line(e), self.takeover_s)


# The lease `hold` took for this process's job (held by process 0), which `stop_without_lease`
# consults before it saves; cleared by its release().
_held: Lease | None = None


def hold(lease: Lease) -> None:
  """The job's first process takes the lease; every process learns whether it did, so a refused
  job stops on all of them (LeaseHeld)."""
  global _held  # pylint: disable=global-statement
  _held = lease
  error = None
  if jax.process_index() == 0:
    try:
      lease.acquire()
    except LeaseHeld as e:
      error = e
  if jax.process_count() > 1:
    refused = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
    if refused and error is None:
      raise LeaseHeld(f"{lease.path.parent} is in use by another run (see process 0's error)")
  if error is not None:
    raise error


def _taken_elsewhere() -> tuple[bool, str | None]:
  """Whether another launch holds the job's lease now (process 0 reads it, every process gets
  its answer; every process calls this at the same step), and who, in words, on process 0."""
  lease = _held if jax.process_index() == 0 else None
  elsewhere = lease.elsewhere() if lease is not None else None
  taken = elsewhere is not None
  if jax.process_count() > 1:
    taken = bool(multihost_utils.broadcast_one_to_all(np.int32(taken)))
  return taken, elsewhere


def check_before_save(step: int) -> None:
  """Before a checkpoint: a run whose lease another launch holds now (a later attempt of its
  job fenced it, between two of its renewals) stops here with LeaseLost, saving nothing. Only a
  launch that knows its attempt can be fenced; others are not asked (no read of the lease)."""
  if attempt_setting() is None:  # the same environment on every process of the job
    return
  taken, elsewhere = _taken_elsewhere()
  if taken:
    raise LeaseLost(f"{elsewhere or 'another launch holds the workdir lease now'}. Step {step} "
                    "was not saved: the workdir's run is not this one's to write", taken=True)


def stop_without_lease(reason: str | None, step: int, save: Callable[[], None]) -> NoReturn:
  """The run lost its lease (on this process, for `reason`, or on another) and stops with
  LeaseLost saying why, having saved `step` if the storage allows and the lease is still this
  run's. Once another launch holds it, the workdir is that launch's run: this one writes no
  checkpoint into it. Every process of the job calls it at the same step (they agreed to stop
  there), so process 0's verdict reaches them all."""
  why = reason or "another process of this job lost the workdir lease"
  taken, elsewhere = _taken_elsewhere()
  if taken:
    whose = ("" if elsewhere is None or elsewhere == reason else f" ({elsewhere})")
    raise LeaseLost(f"{why}. Step {step} was not saved: another launch holds the workdir now"
                    f"{whose}, and its run is not this one's to write", taken=True)
  try:
    save()
  except Exception as e:  # pylint: disable=broad-except  # the lease is the reason to stop
    raise LeaseLost(f"{why}; saving step {step} failed too ({type(e).__name__}: "
                    f"{errors.first_line(e)})") from e
  raise LeaseLost(f"{why}. Saved step {step}; rerun the same command to resume once the "
                  "workdir is free")
