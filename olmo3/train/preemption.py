"""SIGTERM / SIGINT ask a run to stop at a step boundary; every process agrees on the step.

Light to import (JAX is imported on first use), so a launcher can install the handlers before
its own heavy imports: a signal during startup is then a clean stop, not a kill.
"""

from __future__ import annotations

import signal
import threading

import numpy as np


class Preemption:
  """Records SIGTERM / SIGINT (restoring the previous handlers on `restore`). `agreed()` is
  True on every process at the same step once any process was signalled: a tiny all-gather of
  the flag per call when the job spans several processes."""

  def __init__(self):
    self.signal: int | None = None
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    self.signal = signum

  def agreed(self) -> bool:
    import jax  # pylint: disable=import-outside-toplevel

    local = np.int32(self.signal is not None)
    if jax.process_count() == 1:
      return bool(local)
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(local)).any())

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
