"""The launcher with one thing changed, for the race tests (tests/test_launch_race.py) and the
compile-only interruptions (tests/test_launch.py), run as a program:

  python -m tests.launch_stand_ins pause [launch/main.py's flags...]
      the launch stops itself (SIGSTOP) just before it tries to take the workdir lease; the
      test lets it go on (SIGCONT) once another launch holds the workdir;
  python -m tests.launch_stand_ins container [launch/main.py's flags...]
      the launch as from another container on this host (another pid namespace in its lease):
      launches here cannot check its process, so they watch its lease;
  python -m tests.launch_stand_ins compiling [launch/main.py's flags...]
      the launch logs `XLA is compiling` as XLA starts compiling the train step (inside the
      compiler's call, which holds Python's signal handlers until it returns).

(`forked.background("tests.launch_stand_ins", ["pause", ...], env)` forks it as any program.)
Everything else is the real launcher.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pause_before_taking_the_lease() -> None:
  from olmo3.run import lease

  acquire = lease.Lease.acquire

  def paused(self) -> None:
    os.kill(os.getpid(), signal.SIGSTOP)
    acquire(self)

  lease.Lease.acquire = paused


def _in_another_container() -> None:
  from olmo3.run import processes

  machine = processes.machine

  def another() -> dict[str, str | None]:
    return {**machine(), "pid_ns": "pid:[another container]"}

  processes.machine = another


def _say_when_xla_compiles() -> None:
  from olmo3.train import aot

  compile_ = aot._compile  # pylint: disable=protected-access

  def said(lowered, topology):
    print("XLA is compiling", file=sys.stderr, flush=True)
    return compile_(lowered, topology)

  aot._compile = said  # pylint: disable=protected-access


if __name__ == "__main__":
  {"pause": _pause_before_taking_the_lease, "container": _in_another_container,
   "compiling": _say_when_xla_compiles}[sys.argv[1]]()
  main = os.path.join(ROOT, "launch", "main.py")
  sys.argv, sys.path[0] = [main, *sys.argv[2:]], os.path.dirname(main)
  runpy.run_path(main, run_name="__main__")
