"""This machine's processes as the workdir lease (olmo3.run.lease) judges a holder of this
machine: what makes two processes' pids comparable, and when a pid's process started."""

from __future__ import annotations

import os


def _read_first_line(path: str) -> str | None:
  try:
    with open(path) as f:
      return f.readline().strip() or None
  except OSError:
    return None


def machine() -> dict[str, str | None]:
  """What makes two processes' pids comparable: the same boot of the same machine, in the same
  pid namespace (a container has its own)."""
  try:
    pid_ns = os.readlink("/proc/self/ns/pid")
  except OSError:
    pid_ns = None
  return {"boot_id": _read_first_line("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns}


def start_time(pid: int) -> str | None:
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
