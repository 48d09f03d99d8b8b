"""The launcher as a real process in the background, its log lines collected as they come:
for tests that act on a run while it trains (stall or stop a store, take its lease)."""

import signal
import subprocess
import sys
import threading
import time


class Background:
  """`python MAIN *argv` in `cwd` with `env`; PYTHONFAULTHANDLER is set, so a launch that
  outlives its test is stopped with SIGABRT and prints every thread's stack into the log the
  test reports."""

  def __init__(self, main: str, argv: list[str], env: dict, cwd: str):
    self.proc = subprocess.Popen([sys.executable, main, *argv], cwd=cwd,
                                 env=dict(env, PYTHONFAULTHANDLER="1"),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    self.lines: list[str] = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stderr:
      self.lines.append(line.rstrip("\n"))

  def log(self, last: int = 60) -> str:
    return "\n".join(self.lines[-last:])

  def until(self, done, seconds: float = 240) -> None:
    """Waits for done() while the launch runs."""
    deadline = time.time() + seconds
    while not done():
      assert self.proc.poll() is None, f"the launch ended ({self.proc.returncode}):\n{self.log()}"
      assert time.time() < deadline, f"still waiting after {seconds} s:\n{self.log()}"
      time.sleep(0.05)

  def wait_for(self, text: str, seconds: float = 300) -> None:
    """Waits for a log line holding `text`."""
    self.until(lambda: any(text in line for line in self.lines), seconds)

  def finish(self, seconds: float = 120) -> int:
    """The launch's exit code, once it ends within `seconds`; past them its stacks are dumped
    (SIGABRT, then SIGKILL) and the test fails with its log."""
    try:
      code = self.proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
      self.proc.send_signal(signal.SIGABRT)
      try:
        self.proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
      self._reader.join(timeout=10)
      raise AssertionError(f"still running after {seconds} s:\n{self.log(150)}") from None
    self._reader.join(timeout=10)
    return code

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()
