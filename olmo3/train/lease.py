"""One live run per workdir: WORKDIR/lease.json names the launch that holds it (a token of its
own, its host, pid and that process's start, the machine's boot and pid namespace, and a
heartbeat), written by the job's first process when it starts, renewed while it runs and
removed when it ends. A second launch on the same workdir refuses, naming the holder, instead
of writing the same checkpoints and metric lines.

When is a holder dead (its lease is taken over)?
- its heartbeat is older than the takeover age (`OLMO3_LEASE_TAKEOVER_S`, default 360 s),
  whatever its pid;
- or it is provably a dead process of this machine: same host, boot and pid namespace, and its
  pid no longer runs, runs another process (started at another time: a reused pid), or is this
  launch's own pid (a restarted container's PID 1 finds its predecessor's lease).
A holder this launch cannot check (another host, another container, a lease it cannot parse)
is watched: if the lease changes (a live holder renews it every takeover age / 12), the launch
is refused; if it stays as it is until it is older than the takeover age, it is taken over.
So a restarted job waits at most the takeover age, and an empty or torn lease.json (a crash or
a full disk while it was written) is judged by its modification time the same way.

Every change is conditional on what was read, so two launches never both win: local disks
create by linking a complete file into place and replace by renaming the old one aside first;
GCS and S3 check an ifGenerationMatch / If-None-Match / If-Match precondition on the server
(olmo3.io.storage). The heartbeat retries failed renewals; one that cannot renew for half the
takeover age, or that finds another launch's token in the lease, makes `lost()` say why, and
the loop stops at its next step boundary (olmo3.train.loop): a run never trains on without
its lease.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
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

from olmo3.io import storage
from olmo3.run.record import Workdir

TAKEOVER_ENV = "OLMO3_LEASE_TAKEOVER_S"
DEFAULT_TAKEOVER_S = 360.0  # twice the storage retry budget: a renewal outlasts an outage
_BEATS_PER_TAKEOVER = 12  # the heartbeat's period is the takeover age / 12 (30 s by default)


class LeaseHeld(RuntimeError):
  """Another live job holds the workdir. The message names its host and pid."""


class LeaseLost(RuntimeError):
  """The run could not keep its workdir lease; the message says why."""


class _Verdict(enum.Enum):
  ALIVE = "alive"
  DEAD = "dead"
  UNKNOWN = "unknown"  # watched until it changes (alive) or goes stale (dead)


def takeover_s() -> float:
  return storage.seconds_setting(TAKEOVER_ENV, DEFAULT_TAKEOVER_S)


def _read_first_line(path: str) -> str | None:
  try:
    with open(path) as f:
      return f.readline().strip() or None
  except OSError:
    return None


def _machine() -> dict[str, str | None]:
  """What makes two processes' pids comparable: the same boot of the same machine, in the same
  pid namespace (a container has its own)."""
  try:
    pid_ns = os.readlink("/proc/self/ns/pid")
  except OSError:
    pid_ns = None
  return {"boot_id": _read_first_line("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns}


def _start_time(pid: int) -> str | None:
  """When process `pid` started (clock ticks since boot, /proc/<pid>/stat's 22nd field), or
  None when no such process runs (a zombie, killed and not yet reaped, runs nothing). '' where
  /proc does not tell (not Linux)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      stat = f.read()
  except FileNotFoundError:
    return None
  except OSError:
    return ""
  fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
  return None if fields[0] in ("Z", "X") else fields[19]


def _parse(data: bytes) -> dict | None:
  """A lease's holder, or None when the bytes are no lease (empty, torn, hand-edited)."""
  try:
    holder = json.loads(data)
    float(holder["heartbeat"])
    int(holder["pid"])
  except (ValueError, TypeError, KeyError):
    return None
  return holder if isinstance(holder.get("token"), str) else None


def _ago(seconds: float) -> str:
  return f"{max(0.0, seconds):.0f} s"


class Lease:
  def __init__(self, workdir: str | os.PathLike, takeover: float | None = None):
    self.path = Workdir(os.fspath(workdir)).lease
    self.url = os.fspath(self.path)
    self.takeover_s = takeover_s() if takeover is None else takeover
    self.beat_s = self.takeover_s / _BEATS_PER_TAKEOVER
    pid = os.getpid()
    self.record = {"host": socket.gethostname(), "pid": pid, "token": uuid.uuid4().hex,
                   "started": time.time(), "pid_start": _start_time(pid), **_machine()}
    self._version = ""  # the object's generation / ETag as this launch last wrote it
    self._renewed = 0.0  # time.monotonic() of the last renewal that landed
    self._error: BaseException | None = None  # the last renewal's failure
    self._taken: str | None = None  # set when another launch's token is found in the lease
    self._stop = threading.Event()
    self._beat: threading.Thread | None = None

  # --- taking it ---------------------------------------------------------------------------

  def acquire(self) -> None:
    """Takes the lease or raises LeaseHeld; then keeps its heartbeat fresh until release().
    May wait (at most the takeover age) for a holder it cannot check."""
    watched: tuple[bytes, float] | None = None  # (the lease as first seen, watched until)
    for attempt in itertools.count():
      current = storage.read_versioned(self.url)
      if current is None:
        try:
          self._version = storage.create_exclusive(self.url, self._encode())
          break
        except storage.PreconditionFailed:
          if self._holds():  # our own create, retried after a transient error
            break
          if attempt >= 2:
            raise LeaseHeld(self._race()) from None
          continue
      holder = _parse(current.data)
      verdict, why, wait = self._judge(holder, current)
      if verdict is _Verdict.ALIVE:
        raise LeaseHeld(self._held(holder))
      if verdict is _Verdict.UNKNOWN:
        if watched is None:
          watched = (current.data, time.monotonic() + wait)
          logging.warning("%s: %s, which this launch cannot check; waiting up to %s for it to "
                          "renew (a live run: this launch stops) or go stale (taken over)",
                          self.url, why, _ago(wait))
        if current.data != watched[0]:
          raise LeaseHeld(self._held(holder) if holder else self._race())
        if time.monotonic() < watched[1]:
          time.sleep(max(0.1, min(self.beat_s / 2, 5.0)))
          continue
        why = f"{why}, and it was not renewed for {_ago(wait)} more"
      logging.warning("taking over the workdir lease %s: %s", self.url, why)
      try:
        self._version = storage.replace_if(self.url, self._encode(), current)
        break
      except storage.PreconditionFailed:
        raise LeaseHeld(self._race()) from None
    self._renewed = time.monotonic()
    self._beat = threading.Thread(target=self._heartbeat, name="workdir-lease", daemon=True)
    self._beat.start()

  def _judge(self, holder: dict | None, current: storage.Versioned
             ) -> tuple[_Verdict, str, float]:
    """(verdict, why in words, how long to watch an UNKNOWN one)."""
    now = time.time()
    if holder is None:
      age = now - current.modified
      why = f"it is not a readable lease (empty or torn) and was last modified {_ago(age)} ago"
      return (_Verdict.DEAD, why, 0.0) if age >= self.takeover_s else (
          _Verdict.UNKNOWN, why, min(self.takeover_s, self.takeover_s - age))
    age = now - float(holder["heartbeat"])
    who = f"pid {holder['pid']} on host {holder.get('host')}"
    if age >= self.takeover_s:
      return (_Verdict.DEAD, f"its holder ({who}) last renewed it {_ago(age)} ago (takeover "
              f"age {self.takeover_s:g} s, {TAKEOVER_ENV})", 0.0)
    mine = self.record
    same_host = holder.get("host") == mine["host"]
    if same_host and all(holder.get(k) == mine[k] and mine[k] is not None
                         for k in ("boot_id", "pid_ns")):
      pid = int(holder["pid"])
      started = _start_time(pid)
      if started is None:
        return _Verdict.DEAD, f"its holder ({who}) no longer runs", 0.0
      recorded = holder.get("pid_start")  # None: a lease that does not say
      if started and started != recorded and (recorded is not None or pid == mine["pid"]):
        # Another process has the pid now: a reused pid, or this very launch (a restarted
        # container's PID 1 finding its predecessor's lease).
        return (_Verdict.DEAD, f"pid {pid} is another process now than the one that held it "
                "(a reused pid, or a restarted container's)", 0.0)
      return _Verdict.ALIVE, "", 0.0
    if same_host and mine["boot_id"] is None and holder.get("boot_id") is None:
      with contextlib.suppress(PermissionError):  # no /proc (not Linux): no pid namespaces
        try:
          os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
          return _Verdict.DEAD, f"its holder ({who}) no longer runs", 0.0
    # Watched for at most the takeover age: a holder whose clock runs ahead looks fresh.
    return (_Verdict.UNKNOWN, f"it is held by {who} (heartbeat {_ago(age)} ago)",
            min(self.takeover_s, self.takeover_s - age))

  def _held(self, holder: dict) -> str:
    started = holder.get("started")
    since = f"running since {time.ctime(float(started))}; " if isinstance(
        started, (int, float)) else ""
    return (f"{self.path.parent} is in use by pid {holder['pid']} on host {holder.get('host')} "
            f"({since}lease {self.url}). Wait for that run to end or stop it; a lease whose "
            f"holder died is taken over automatically (at the latest when its heartbeat is "
            f"{self.takeover_s:g} s old, {TAKEOVER_ENV}).")

  def _race(self) -> str:
    return f"{self.path.parent}: another launch took the lease {self.url} at the same moment"

  def _encode(self) -> bytes:
    return json.dumps({**self.record, "heartbeat": time.time()}).encode()

  def _holds(self) -> bool:
    current = storage.read_versioned(self.url)
    holder = _parse(current.data) if current is not None else None
    if holder is not None and holder["token"] == self.record["token"]:
      self._version = current.version
      return True
    return False

  # --- keeping it --------------------------------------------------------------------------

  def _renew(self) -> None:
    if storage.is_url(self.url):
      try:
        self._version = storage.replace_if(
            self.url, self._encode(), storage.Versioned(b"", self._version, 0.0))
        return
      except storage.PreconditionFailed:
        current = storage.read_versioned(self.url)
    else:  # a local file is replaced in one rename: no moment without a lease
      current = storage.read_versioned(self.url)
      holder = _parse(current.data) if current is not None else None
      if holder is not None and holder["token"] == self.record["token"]:
        if not self._stop.is_set():
          storage.write_bytes_atomic(self.url, self._encode())
        return
    holder = _parse(current.data) if current is not None else None
    self._taken = (f"the workdir lease {self.url} was taken over by " + (
        f"pid {holder['pid']} on host {holder.get('host')}" if holder else
        "another launch (it is gone or unreadable)") + f" while this run held it (after "
        f"{_ago(time.monotonic() - self._renewed)} without a renewal)")

  def _heartbeat(self) -> None:
    pause = self.beat_s
    while not self._stop.wait(pause):
      try:
        self._renew()
      except Exception as e:  # pylint: disable=broad-except  # retried; lost() says when to stop
        self._error = e
        pause = max(0.1, min(self.beat_s, 5.0))
        continue
      if self._taken is not None:
        return
      self._renewed, self._error, pause = time.monotonic(), None, self.beat_s

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
    cause = f" (last error: {type(error).__name__}: {storage.first_line(error)})" if error else ""
    return (f"the workdir lease {self.url} could not be renewed for {_ago(silent)}{cause}; "
            f"at {self.takeover_s:g} s ({TAKEOVER_ENV}) another launch could take the workdir "
            "over, so this run stops")

  def release(self) -> None:
    """Stops the heartbeat and removes the lease if it is still this launch's. Never raises
    (it runs on the way out, after whatever stopped the run): a lease it cannot remove is
    taken over by the next launch once it is stale."""
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
                      "it over once its heartbeat is %g s old", self.url, type(e).__name__,
                      storage.first_line(e), self.takeover_s)


def hold(lease: Lease) -> None:
  """The job's first process takes the lease; every process learns whether it did, so a refused
  job stops on all of them (LeaseHeld)."""
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


def stop_without_lease(reason: str | None, step: int, save: Callable[[], None]) -> NoReturn:
  """The run lost its lease (on this process, for `reason`, or on another): saves `step` if the
  storage allows and stops with LeaseLost saying why."""
  why = reason or "another process of this job lost the workdir lease"
  try:
    save()
  except Exception as e:  # pylint: disable=broad-except  # the lease is the reason to stop
    raise LeaseLost(f"{why}; saving step {step} failed too ({type(e).__name__}: "
                    f"{storage.first_line(e)})") from e
  raise LeaseLost(f"{why}. Saved step {step}; rerun the same command to resume once the "
                  "workdir is free")
