"""One live run per workdir: WORKDIR/lease.json names the job that holds it (host, pid, when it
started, a heartbeat), written by the job's first process when it starts and removed when it
ends. A second launch on the same workdir refuses, naming the holder, instead of writing the
same checkpoints and metric lines. A lease whose holder died is taken over: on the same host
when its pid no longer runs, from another host when its heartbeat is older than STALE_S.

Local disks create the lease atomically (O_EXCL). Object stores (any etils.epath URL) have no
atomic create through epath: the lease is written, then read back after a pause to check that
this job's token won; two launches racing within that pause on one object-store workdir are
not excluded (documented in README's Reliability section).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

import jax
import numpy as np
from jax.experimental import multihost_utils

from olmo3.run.record import Workdir

STALE_S = 120.0  # a heartbeat older than this (another host's lease) is a dead holder
BEAT_S = 20.0  # how often the holder refreshes its heartbeat
RACE_PAUSE_S = 1.0  # object stores: how long a writer waits before reading its lease back


class LeaseHeld(RuntimeError):
  """Another live job holds the workdir. The message names its host and pid."""


class Lease:
  def __init__(self, workdir: str | os.PathLike):
    self.path = Workdir(os.fspath(workdir)).lease
    self.record = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
                   "started": time.time()}
    self._stop = threading.Event()
    self._beat: threading.Thread | None = None

  def acquire(self) -> None:
    """Takes the lease or raises LeaseHeld; then keeps its heartbeat fresh until release()."""
    holder = self._read()
    if holder is not None and holder.get("token") != self.record["token"]:
      if _alive(holder):
        raise LeaseHeld(
            f"{self.path.parent} is in use by pid {holder['pid']} on host {holder['host']} "
            f"(running since {time.ctime(holder['started'])}; lease {self.path}). Wait for that "
            "run to end or stop it; a lease whose holder died is taken over automatically.")
      self.path.unlink(missing_ok=True)  # its holder is gone
    self._write(exclusive=True)
    self._beat = threading.Thread(target=self._heartbeat, name="workdir-lease", daemon=True)
    self._beat.start()

  def release(self) -> None:
    self._stop.set()
    if self._beat is not None:
      self._beat.join()
      holder = self._read()
      if holder is not None and holder.get("token") == self.record["token"]:
        self.path.unlink(missing_ok=True)
      self._beat = None

  def _read(self) -> dict | None:
    try:
      return json.loads(self.path.read_text())
    except FileNotFoundError:
      return None
    except ValueError:  # torn by a crash mid-write: nobody holds it
      return None

  def _write(self, exclusive: bool = False) -> None:
    record = json.dumps({**self.record, "heartbeat": time.time()})
    if "://" not in os.fspath(self.path):
      if exclusive:
        try:
          fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
          raise LeaseHeld(f"{self.path.parent}: another launch took the lease {self.path} "
                          "at the same moment") from None
        with os.fdopen(fd, "w") as f:
          f.write(record)
        return
      tmp = f"{self.path}.{self.record['token']}"
      with open(tmp, "w") as f:
        f.write(record)
      os.replace(tmp, self.path)
      return
    self.path.write_text(record)
    if exclusive:
      time.sleep(RACE_PAUSE_S)
      won = self._read()
      if won is None or won.get("token") != self.record["token"]:
        raise LeaseHeld(f"{self.path.parent}: another launch took the lease {self.path} at the "
                        "same moment")

  def _heartbeat(self) -> None:
    while not self._stop.wait(BEAT_S):
      self._write()


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


def _alive(holder: dict) -> bool:
  if holder.get("host") == socket.gethostname():
    try:
      os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
      return False
    except PermissionError:  # another user's live process
      return True
    return True
  return time.time() - float(holder.get("heartbeat", 0)) < STALE_S
