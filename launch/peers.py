"""When another process of a multi-process job dies, this one ends in one `error:` line naming
it, not in a dump.

jax.distributed (jaxlib 0.10.2) ends a process whose peer is gone from C++: its error-polling
thread logs `Terminating process because the JAX distributed service detected fatal errors`,
its gRPC details, and aborts (SIGABRT) within about a second; Python never sees it, and its
`missed_heartbeat_callback` cannot be used (it crashes with std::bad_cast). So what reaches
the user is rewritten where it can be: on its way out. `watch_stderr` puts a small filter
process between the launcher's file descriptor 2 and the real stderr. It passes every line on
unchanged until the first sign that a peer is lost, drops the dump from there, and when the
launcher's stderr closes (it exits, or is aborted) writes the one line, unless the launcher
wrote an `error:` line of its own (a collective that failed first: `peer_lost`). The exit
status stays the launcher's own (non-zero: 134 when aborted), which is what a scheduler reads.
"""

from __future__ import annotations

import os
import re
import signal

# The first lines jaxlib's coordination agent writes when a peer is gone (its preemption
# watcher's failed poll comes first when the coordinator went), then the abort itself.
MARKERS = (b"Terminating process because the JAX distributed service detected fatal errors",
           b"Polled an error from coordination service",
           b"Failed to retrieve preemption notice from coordination service")
# Said when the coordination service (process 0's) is unreachable.
COORDINATOR_GONE = (b"leader task", b"Socket closed", b"Failed to send RPC to coordination",
                    b"Connection reset by peer", b"failed to connect")

# A process that stops sending heartbeats (dead, frozen, or cut off) is taken for lost this long
# after its last one: every other process of the job stops too, non-zero, instead of waiting in
# a collective. jax.distributed's default, kept for jobs started by hand.
HEARTBEAT_ENV = "OLMO3_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_S = 100
# What launch/cluster.py renders into its jobs: a lost host is detected within it (measured on
# a 2-process CPU job with one process SIGSTOPped, its connections open: 24.7 s for a worker and
# 25.6 s for the coordinator at 30 s; benchmarks/RESULTS.md). Safe because the heartbeat is
# sent by the coordination service's client thread, beside the training: a long collective, a
# compile or a checkpoint's copy never delays it; only a process frozen whole, or cut off from
# the coordinator, for 30 s is taken for lost, and restarting it is then right.
CLUSTER_HEARTBEAT_S = 30


class PeerLost(RuntimeError):
  """A collective failed because another process of the job is gone."""


def job_position(env: dict[str, str] | os._Environ) -> tuple[int, int] | None:
  """(this process's id, the number of processes) of a multi-process job, from what
  jax.distributed.initialize will read (explicit, SLURM, multi-host TPU); None: one process."""
  if "JAX_COORDINATOR_ADDRESS" in env:
    me, n = int(env.get("JAX_PROCESS_ID", "0")), int(env.get("JAX_NUM_PROCESSES", "1"))
  elif int(env.get("SLURM_NTASKS", "1")) > 1:
    me, n = int(env.get("SLURM_PROCID", "0")), int(env["SLURM_NTASKS"])
  elif "," in env.get("TPU_WORKER_HOSTNAMES", ""):
    me, n = int(env.get("TPU_WORKER_ID", "0")), len(env["TPU_WORKER_HOSTNAMES"].split(","))
  else:
    return None
  return (me, n) if n > 1 else None


def message(me: int, n: int, peer: int | None) -> str:
  who = ("another process" if peer is None else
         f"process {peer} of {n}" + (" (the coordinator)" if peer == 0 else ""))
  return (f"error: {who} left the job, so process {me} of {n} stops too; rerun the job's "
          "command (every process) to resume from the last checkpoint")


def lost_peer(me: int, n: int, said: bytes) -> int | None:
  """Which process the dump `said` is about: a task it names other than this one, else the
  coordinator when it is the one unreachable, else the other process of two."""
  named = {int(t) for t in re.findall(rb"task:(\d+)", said)} - {me}
  if len(named) == 1:
    return named.pop()
  if me != 0 and any(m in said for m in COORDINATOR_GONE):
    return 0
  return 1 - me if n == 2 else None


def peer_lost(error: BaseException, me: int, n: int) -> PeerLost | None:
  """The one-line error for a collective that failed because a peer is gone (Gloo's or the
  coordination service's words in a JAX runtime error), else None."""
  text = str(error)
  if type(error).__name__ not in ("JaxRuntimeError", "XlaRuntimeError") or not any(
      m in text for m in ("Gloo", "coordination service", "Connection closed by peer",
                          "Connection reset by peer")):
    return None
  return PeerLost(message(me, n, lost_peer(me, n, text.encode()))[len("error: "):])


def watch_stderr(me: int, n: int) -> None:
  """Starts the filter process (see the module's docstring) for process `me` of `n`."""
  read_end, write_end = os.pipe()
  real_stderr = os.dup(2)
  if os.fork() == 0:  # the filter: plain reads and writes, then _exit
    try:
      for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the launcher's signals are the launcher's
      os.close(write_end)
      # Nothing else of the launcher's held open here (a socket, another pipe's write end).
      low, high = sorted((read_end, real_stderr))
      os.closerange(3, low)
      os.closerange(low + 1, high)
      os.closerange(high + 1, os.sysconf("SC_OPEN_MAX"))
      os.dup2(real_stderr, 2)
      _filter(read_end, real_stderr, me, n)
    finally:
      os._exit(0)  # pylint: disable=protected-access  # never the launcher's exit handlers
  os.close(read_end)
  os.close(real_stderr)
  os.dup2(write_end, 2)
  os.close(write_end)


def _filter(read_end: int, out: int, me: int, n: int) -> None:
  pending, dropped, dropping, said_error = b"", b"", False, False
  while True:
    data = os.read(read_end, 1 << 16)
    lines = (pending + data).split(b"\n")
    pending = lines.pop() if data else b""
    if not data and lines and lines[-1] == b"":
      lines.pop()
    for line in lines:
      dropping = dropping or any(m in line for m in MARKERS)
      if not dropping or line.startswith(b"error: "):
        said_error = said_error or line.startswith(b"error: ")
        _write(out, line + b"\n")
      else:
        dropped += line + b"\n"
    if not data:
      break
  if dropping and not said_error:
    _write(out, (message(me, n, lost_peer(me, n, dropped)) + "\n").encode())


def _write(fd: int, data: bytes) -> None:
  while data:
    data = data[os.write(fd, data):]
