"""A host whose clock is off, for the lease tests: the times a launch writes into its workdir
lease (when it started, each heartbeat) are read from olmo3.run.lease's `time.time()`, and no
decision reads them back. `LaggingClock` stands in for that module's `time` (in process:
monkeypatch.setattr(lease_lib, "time", LaggingClock(-DAY))); run as a program, it is the
launcher with its lease's clock shifted:

  python -m tests.lagging_clock SECONDS [launch/main.py's flags...]

(`forked.Driver(env).start("tests.lagging_clock", [...])` forks it as any program.)
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LaggingClock:
  """The time module with `time()` shifted by `shift_s` seconds; the monotonic clock, sleep and
  the rest are the real ones."""

  def __init__(self, shift_s: float):
    self.shift_s = shift_s

  def time(self) -> float:
    return time.time() + self.shift_s

  def __getattr__(self, name: str) -> Any:
    return getattr(time, name)


if __name__ == "__main__":
  from olmo3.run import lease

  lease.time = LaggingClock(float(sys.argv[1]))
  main = os.path.join(ROOT, "launch", "main.py")
  sys.argv, sys.path[0] = [main, *sys.argv[2:]], os.path.dirname(main)
  runpy.run_path(main, run_name="__main__")
