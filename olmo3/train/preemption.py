"""SIGTERM / SIGINT ask a run to stop at a step boundary; every process agrees on the step.

Light to import (JAX is imported on first use), so a launcher can install the handlers before
its own heavy imports: a signal during startup is then a clean stop, not a kill.

In a job of several processes, no check touches the devices (the loop never waits for a step
to learn of a signal). Once `jax.distributed` starts, XLA's own SIGTERM handler replaces
Python's (its preemption service): the coordination service then agrees on a step in the
background, and `agreed()` asks it locally at every call. Signals Python still sees (SIGINT;
a SIGTERM before `jax.distributed` started, or with the service off) are exchanged through the
coordination service's key-value store at the calls that ask for it.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading

# How often (in steps) a multi-process loop exchanges the signals Python caught, beside its
# evaluation and checkpoint steps: a barrier among the hosts, nothing on the devices.
EXCHANGE_EVERY = 10
BARRIER_TIMEOUT_MS = 10 * 60 * 1000  # the hosts only drift apart by host work between checks
# `signal` of a stop the run asked for itself (request_stop: its lease was lost), exchanged
# like a signal; the lowest value wins, so every process learns it is not a preemption.
STOP_REQUESTED = 0

# Every process makes the same sequence of `agreed()` calls, so the call's index names the
# same point on all of them (XLA's sync point and the exchange's keys count from it); one count
# for the whole process, since both outlive a `Preemption`.
_calls = itertools.count(1)


class Preemption:
  """Records SIGTERM / SIGINT (restoring the previous handlers on `restore`). `agreed()` is
  True on every process at the same call once any process was signalled."""

  def __init__(self):
    self.signal: int | None = None
    self.reason: str | None = None  # why request_stop was called (on the process that did)
    # What a signal that arrives now leads to, said at once (`notice`): set by the loop
    # around phases that do not end at the next step boundary (a save, above all the final
    # one), where a signal would otherwise go unacknowledged until they end. (Python's
    # handler only: in a job of several processes XLA's catches SIGTERM.)
    self.notice: str | None = None
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    if self.signal != STOP_REQUESTED:  # a failure stays one
      self.signal = signum
    if self.notice:
      # One unbuffered write: the main thread may be inside a print or a log record (a
      # buffered stream entered again from its own thread raises).
      os.write(2, f"{signal.Signals(signum).name} received: {self.notice}\n".encode())

  def request_stop(self, reason: str) -> None:
    """Stops the run at the step every process agrees on, as a signal would, but as a failure
    (`stop_requested`): e.g. process 0 lost the workdir lease."""
    self.reason = reason
    self.signal = STOP_REQUESTED

  @property
  def signal_name(self) -> str:
    """The signal's name (SIGINT, SIGTERM) for messages."""
    try:
      return signal.Signals(self.signal).name
    except ValueError:
      return f"signal {self.signal}"

  @property
  def stop_requested(self) -> bool:
    return self.signal == STOP_REQUESTED

  def agreed(self, exchange: bool = True) -> bool:
    """Whether to stop here. Every process must call it at the same points with the same
    `exchange`. One process: the host flag. Several: XLA's preemption sync point (local, every
    call) and, where `exchange`, a barrier that shares Python's flags (no device either)."""
    import jax  # pylint: disable=import-outside-toplevel
    from jax._src import distributed  # pylint: disable=import-outside-toplevel
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    call = next(_calls)
    coordination = distributed.global_state  # the client Orbax's multihost helpers use too
    if (coordination.preemption_sync_manager is not None
        and multihost_utils.reached_preemption_sync_point(call)):
      if self.signal is None:
        self.signal = int(signal.SIGTERM)  # XLA's handler caught it, not ours
      return True
    if jax.process_count() == 1:
      return self.signal is not None
    if not exchange:
      return False
    client = coordination.client
    keys = f"olmo3/preemption/{call}/"  # this call's: a later call's never count here
    if self.signal is not None:
      client.key_value_set(f"{keys}{jax.process_index()}", str(self.signal))
    # Every key set before a process reaches the barrier is seen by all after it.
    client.wait_at_barrier(f"olmo3_preemption_{call}", BARRIER_TIMEOUT_MS)
    signalled = client.key_value_dir_get(keys)
    if signalled:  # another process's (a requested stop, 0, wins over signals)
      self.signal = min([int(v) for _, v in signalled] + (
          [self.signal] if self.signal is not None else []))
    return bool(signalled)

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
