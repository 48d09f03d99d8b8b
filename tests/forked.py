"""The repo's programs as forked children of one driver process that imported their
dependencies once: each child runs its program as the interpreter would (`python launch/X.py`,
`python -m olmo3.eval`), a real process of its own with its own pid, signals, argv, working
directory, environment and output file, but without an interpreter start and its imports
(≈ 2.5 CPU s a launch on 2 cores). The driver never starts a JAX backend, so forking is safe.

- `run_as_main`: what a child runs; `run` forks one and waits for it (tests/test_launch_errors.py
  and tests/test_launch_lifecycle.py drive their cases with it);
- `Driver`: a driver that forks on request, for tests that start launches one after another
  and signal them as they run (tests/test_reliability.py's soak): `Driver.start` gives a
  `Child` with Popen's pid, send_signal, poll and wait;
- `completed`: `subprocess.run(..., capture_output=True, text=True)` of a program, forked by
  the xdist worker's driver for that environment (started at its first use, kept to the end of
  the session): what most tests that run a program and read its outcome call;
- `background`: a program forked by the same driver and left running, its log lines read as
  they come (`Running`): for tests that act on a run while it trains (stall or stop a store,
  take its lease).

A child ends as the interpreter would: Python's shutdown (non-daemon threads joined, atexit
handlers run) before the process exits with the program's code.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"main": "launch/main.py", "diff": "launch/diff.py", "audit": "launch/audit.py",
           "sweep": "launch/sweep.py", "cluster": "launch/cluster.py",
           "restart_olmo_core": "benchmarks/restart_olmo_core.py",
           "continue_olmo_core": "benchmarks/continue_olmo_core.py"}


def run_as_main(program: str, argv: list[str], cwd: str, out: str,
                env: dict[str, str] | None = None, err: str | None = None) -> None:
  """Runs one program in this (forked) process as Python would run it: as __main__, with its
  argv, sys.path and the environment variables `env` adds; stdout to `out`, stderr to `err`
  (default: `out` too). Never returns: the process exits with the program's code."""
  code = 1  # as the interpreter's, for an exception the program did not catch
  try:
    os.chdir(cwd)
    os.environ.update(env or {})
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if err else fd, 2)
    if os.environ.get("PYTHONFAULTHANDLER"):  # read by an interpreter as it starts
      faulthandler.enable()
    if program in SCRIPTS:
      path = os.path.join(ROOT, SCRIPTS[program])
      sys.argv, sys.path[0] = [path, *argv], os.path.dirname(path)
      runpy.run_path(path, run_name="__main__")
    else:
      sys.argv = [program, *argv]
      runpy.run_module(program, run_name="__main__", alter_sys=True)
    code = 0
  except SystemExit as e:
    if isinstance(e.code, str):  # as the interpreter reports sys.exit("message")
      print(e.code, file=sys.stderr)
      code = 1
    else:
      code = e.code or 0
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    # Python's own shutdown: wait for the non-daemon threads, then the atexit handlers.
    threading._shutdown()  # pylint: disable=protected-access
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(program: str, argv: list[str], cwd: str, out: str, env: dict[str, str] | None = None,
        before: Callable[[], None] | None = None) -> dict[str, Any]:
  """`program` in a forked child (`run_as_main`, after `before()` there if given), waited for:
  its exit code ("rc") and its output ("output")."""
  pid = os.fork()
  if pid == 0:
    try:
      if before is not None:
        before()
    finally:
      run_as_main(program, argv, cwd, out, env)
  _, status = os.waitpid(pid, 0)
  with open(out) as f:
    return {"rc": os.waitstatus_to_exitcode(status), "output": f.read()}


# CPU seconds of the drivers' children that have ended, for the test CPU log (tests/conftest.py):
# they are the drivers' children, not this process's, so its RUSAGE_CHILDREN misses them.
children_cpu_s = 0.0


def _ended(answer: dict) -> int | None:
  global children_cpu_s
  children_cpu_s += answer["cpu_s"]
  return answer["code"]


class Child:
  """A program the driver forked: its pid, and Popen's ways to signal it and learn its exit
  code (a signal's negated number, as Popen reports it)."""

  def __init__(self, driver: Driver, pid: int):
    self.driver, self.pid, self.returncode = driver, pid, None

  def send_signal(self, sig: int) -> None:
    if self.returncode is None:
      os.kill(self.pid, sig)

  def poll(self) -> int | None:
    if self.returncode is None:
      self.returncode = _ended(self.driver.ask({"poll": self.pid}))
    return self.returncode

  def wait(self, timeout: float) -> int:
    """The exit code; past `timeout` seconds the child is killed and TimeoutError raised."""
    if self.returncode is None:
      self.driver.send({"wait": self.pid})
      try:
        self.returncode = _ended(self.driver.receive(timeout))
      except TimeoutError:
        os.kill(self.pid, signal.SIGKILL)
        self.driver.receive(60)
        raise
    return self.returncode


class Driver:
  """This file run as a driver in `env` (its imports see that environment, as a launch's do);
  `start` forks a program. Use as a context manager: the driver ends with the block."""

  def __init__(self, env: dict[str, str]):
    self.proc = subprocess.Popen([sys.executable, __file__], cwd=ROOT, env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)

  def __enter__(self) -> Driver:
    return self

  def __exit__(self, *exc) -> None:
    self.proc.stdin.close()
    self.proc.wait(timeout=60)

  def start(self, program: str, argv: list[str], out: str | os.PathLike,
            env: dict[str, str] | None = None, cwd: str | os.PathLike = ROOT,
            err: str | os.PathLike | None = None) -> Child:
    reply = self.ask({"program": program, "argv": argv, "out": os.fspath(out), "env": env or {},
                      "cwd": os.fspath(cwd), "err": err and os.fspath(err)})
    return Child(self, reply["pid"])

  def send(self, request: dict) -> None:
    self.proc.stdin.write(json.dumps(request) + "\n")
    self.proc.stdin.flush()

  def receive(self, timeout: float = 60) -> dict:
    if not select.select([self.proc.stdout], [], [], timeout)[0]:
      raise TimeoutError(f"the driver did not answer in {timeout:g} s")
    line = self.proc.stdout.readline()
    assert line, f"the driver ended (exit code {self.proc.poll()})"
    return json.loads(line)

  def ask(self, request: dict) -> dict:
    self.send(request)
    return self.receive()


_DRIVERS: dict[tuple[tuple[str, str], ...], Driver] = {}


def _close_drivers() -> None:
  """Ends every driver at once: each exits as soon as its stdin closes, so they are all told
  before any is waited for."""
  for driver in _DRIVERS.values():
    driver.proc.stdin.close()
  for driver in _DRIVERS.values():
    driver.proc.wait(timeout=60)


def _driver(env: dict[str, str]) -> Driver:
  """This process's driver for `env`, started at its first use and kept to the end."""
  # (pytest names the running test in the environment: not a reason for another driver)
  key = tuple(sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST"))
  driver = _DRIVERS.get(key)
  if driver is None or driver.proc.poll() is not None:
    if not _DRIVERS:
      atexit.register(_close_drivers)
    driver = _DRIVERS[key] = Driver(env)
  return driver


def completed(program: str, argv: list[str], env: dict[str, str], cwd: str | os.PathLike = ROOT,
              timeout: float = 600) -> subprocess.CompletedProcess:
  """What `subprocess.run([python, program's file, *argv], env=env, cwd=cwd,
  capture_output=True, text=True, timeout=timeout)` returns, the program forked by this
  process's driver for `env` (its imports saw that environment, as the program's would)."""
  driver = _driver(env)
  with tempfile.TemporaryDirectory(prefix="forked-") as directory:
    out, err = os.path.join(directory, "stdout"), os.path.join(directory, "stderr")
    child = driver.start(program, argv, out, env=env, cwd=cwd, err=err)
    try:
      code = child.wait(timeout)
    except TimeoutError as e:
      raise subprocess.TimeoutExpired([program, *argv], timeout) from e
    with open(out) as f_out, open(err) as f_err:
      return subprocess.CompletedProcess([program, *argv], code, f_out.read(), f_err.read())


class Running:
  """A program forked in the background (`background`), its stderr lines read from its file as
  they come. PYTHONFAULTHANDLER is set, so a run that outlives its test is stopped with SIGABRT
  and prints every thread's stack into the log the test reports."""

  def __init__(self, program: str, argv: list[str], env: dict[str, str], cwd: str | os.PathLike):
    self._dir = tempfile.mkdtemp(prefix="forked-")
    self._err = os.path.join(self._dir, "stderr")
    open(self._err, "w").close()  # there to read before the child has opened it
    self._ended: list[str] | None = None  # the log, kept once the program ended
    self.proc = _driver(env).start(program, argv, os.devnull, env=dict(env, PYTHONFAULTHANDLER="1"),
                                   cwd=cwd, err=self._err)

  @property
  def lines(self) -> list[str]:
    if self._ended is not None:
      return self._ended
    with open(self._err) as f:
      return f.read().splitlines()

  def log(self, last: int = 60) -> str:
    return "\n".join(self.lines[-last:])

  def until(self, done: Callable[[], bool], seconds: float = 240) -> None:
    """Waits for done() while the program runs."""
    deadline = time.time() + seconds
    while not done():
      assert self.proc.poll() is None, f"the launch ended ({self.proc.returncode}):\n{self.log()}"
      assert time.time() < deadline, f"still waiting after {seconds} s:\n{self.log()}"
      time.sleep(0.05)

  def wait_for(self, text: str, seconds: float = 300) -> None:
    """Waits for a log line holding `text`."""
    self.until(lambda: any(text in line for line in self.lines), seconds)

  def finish(self, seconds: float = 120) -> int:
    """The program's exit code, once it ends within `seconds`; past them its stacks are dumped
    (SIGABRT, then SIGKILL) and the test fails with its log."""
    deadline = time.time() + seconds
    while self.proc.poll() is None and time.time() < deadline:
      time.sleep(0.05)
    if self.proc.returncode is None:
      self.proc.send_signal(signal.SIGABRT)
      try:
        self.proc.wait(timeout=10)  # past it, SIGKILL
      except TimeoutError:
        pass
      self._end()
      raise AssertionError(f"still running after {seconds} s:\n{self.log(150)}")
    self._end()
    return self.proc.returncode

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGKILL)
      self.proc.wait(timeout=60)
    self._end()

  def _end(self) -> None:
    if self._ended is None:
      self._ended = self.lines
      shutil.rmtree(self._dir, ignore_errors=True)


def background(program: str, argv: list[str], env: dict[str, str],
               cwd: str | os.PathLike = ROOT) -> Running:
  """`program` (as `completed` names it) forked by this process's driver for `env` and left
  running."""
  return Running(program, argv, env, cwd)


def _serve() -> None:
  """The driver's loop: a request line in, an answer line out."""
  for line in sys.stdin:
    request = json.loads(line)
    if "wait" in request or "poll" in request:
      pid = request.get("wait") or request["poll"]
      done, status, usage = os.wait4(pid, 0 if "wait" in request else os.WNOHANG)
      answer = {"code": os.waitstatus_to_exitcode(status) if done else None,
                "cpu_s": usage.ru_utime + usage.ru_stime if done else 0.0}
    else:
      pid = os.fork()
      if pid == 0:
        sys.stdin.close()
        run_as_main(request["program"], request["argv"], request["cwd"], request["out"],
                    request["env"], request["err"])
      answer = {"pid": pid}
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
  sys.path[0] = ROOT  # not tests/: a child puts its program's directory here, as Python does
  # What a launch imports anyway, imported once (JAX starts no backend here).
  import fiddle  # noqa: F401

  import launch.config_files  # noqa: F401
  import olmo3.data.sources  # noqa: F401
  import olmo3.train.loop  # noqa: F401

  _serve()
  # Nothing to tear down: the interpreter's shutdown with these imports took 0.5 s a driver.
  os._exit(0)  # pylint: disable=protected-access
