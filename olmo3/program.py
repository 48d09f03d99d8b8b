"""A program: what every command-line program of olmo3 does the same way.

- Its opening: `parser(prog, __doc__)` (argparse programs) or `begin()` (absl's, whose flags
  absl parses), the first call of its main: the JAX platform is chosen before anything touches
  JAX (`olmo3.platforms.choose`: no TPU probing on a machine without one).
- Its ending: `reported(main, errors)`, the one-line error policy. A user's mistake or a failed
  store is one `error:` line naming the file, URL, field or setting and what failed; the
  traceback only on request (absl's `-v 1`, or OLMO3_TRACEBACK=1 for any program). Each program
  says which errors are its own to report this way (config, data, checkpoint, lease, and the
  storage's OSError: a missing file, a store that stayed down past the retry budget); a setting
  read from the environment (`SettingError`) is always one line. Once a main has failed, the
  rest of the process is its ending (`quiet_leftovers`, `end_within`).
- Its long calls into a library (XLA compiling for minutes): `on_a_thread`, so that a signal
  is handled at once; `abandoned_on_signal` where the work writes nothing and a signal should
  end it there and then.
- Its settings read from the environment when they are needed (`seconds_setting`,
  `count_setting`): a value that is not one is a `SettingError` (a ValueError) naming the
  variable.

Below `olmo3.io` (whose settings read through here) and above `olmo3.platforms` only: it knows
nothing of models, configs or stores.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from olmo3 import platforms

TRACEBACK_ENV = "OLMO3_TRACEBACK"
T = TypeVar("T")
# How long a program that has ended waits for background threads still running at its end.
EXIT_GRACE_S = 10.0


class SettingError(ValueError):
  """An environment variable's value is not what the setting takes. The message names it."""


def begin() -> None:
  """Every program's first call (absl programs; argparse ones through `parser`): the CPU for
  JAX where there is no accelerator, so that nothing probes for a TPU."""
  platforms.choose()


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
  """An argparse program's opening (`begin`), and its parser: `prog` as the user types it
  (`python -m olmo3.sample`), its module docstring `doc` as the help, laid out as written."""
  begin()
  return argparse.ArgumentParser(prog=prog, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


def seconds_setting(name: str, default: float) -> float:
  """A positive number of seconds from the environment variable `name` (default when unset);
  SettingError naming the variable when it is not one."""
  value = os.environ.get(name)
  if value is None or value == "":
    return default
  try:
    seconds = float(value)
  except ValueError:
    seconds = math.nan
  if not (math.isfinite(seconds) and seconds > 0):
    raise SettingError(f"{name}={value!r}: expected a positive number of seconds")
  return seconds


def count_setting(name: str, default: int) -> int:
  """A positive integer from the environment variable `name` (default when unset);
  SettingError naming the variable when it is not one."""
  value = os.environ.get(name)
  if value is None or value == "":
    return default
  if not value.isdigit() or int(value) < 1:
    raise SettingError(f"{name}={value!r}: expected a positive integer")
  return int(value)


def traceback_wanted(verbosity: int = 0) -> bool:
  """Whether to show the traceback too: -v 1 (absl programs) or OLMO3_TRACEBACK=1."""
  return verbosity >= 1 or os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def one_line(error: BaseException) -> str:
  """The `error:` line of `error`: its message's first line (libraries append request dumps
  and specs), or its type when it has no message."""
  lines = str(error).strip().splitlines()
  text = lines[0] if lines else ""
  if isinstance(error, OSError) and not type(error).__module__.startswith("olmo3."):
    # Python's or a library's OSError (aiohttp's, botocore's) says little without its type.
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
  return f"error: {text or type(error).__name__}"


def reported(main: Callable[..., Any], errors: Callable[[], tuple[type[BaseException], ...]],
             verbosity: Callable[[], int] = lambda: 0) -> Callable[..., Any]:
  """`main` with the `errors()` types (and SettingError) ending the program as one line (exit
  code 1), unless the traceback is wanted (`traceback_wanted(verbosity())`), when they
  propagate as they are. `errors` is called only when something was raised (its imports cost
  nothing otherwise). For a program's main: once it has failed, the rest of the process is its
  ending (`quiet_leftovers`, `end_within`)."""
  @functools.wraps(main)
  def wrapped(*args, **kwargs):
    code = 1
    try:
      result = main(*args, **kwargs)
      # A main that returns its exit status (`sys.exit(main())`, as `prepare`'s does) ends
      # with that status even when threads outlive it.
      code = result if isinstance(result, int) and not isinstance(result, bool) else 0
      return result
    except SystemExit as e:
      code = exit_code(e)
      raise
    except KeyboardInterrupt:  # Ctrl-C: the user's own stop, said in one line (128 + SIGINT)
      code = 130
      if traceback_wanted(verbosity()):
        raise
      print("interrupted (Ctrl-C)", file=sys.stderr)
      sys.exit(130)
    except Exception as e:  # pylint: disable=broad-except  # the others are raised on
      if not isinstance(e, (SettingError, *errors())) or traceback_wanted(verbosity()):
        raise
      sys.exit(one_line(e))
    finally:
      verbose = traceback_wanted(verbosity())
      if code and not verbose:
        quiet_leftovers()
      end_within(EXIT_GRACE_S, code, say=verbose)

  return wrapped


def exit_code(stop: SystemExit) -> int:
  """The status Python exits with for `stop`: 0 for None, the number, or 1 for a message."""
  return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)


def quiet_leftovers() -> None:
  """Keeps the error line the program's last: what library threads still say after it (an
  uncaught exception in one of Orbax's commit threads of the failed save, its log records, a
  TensorStore write's result reaching an event loop already closed) is a leftover of the same
  failure, printed only when the traceback is wanted. Python prints the line itself after
  this, when the SystemExit carrying it leaves the program."""
  import logging as py_logging

  threading.excepthook = lambda args: None
  sys.unraisablehook = lambda unraisable: None
  # A library's C++ threads print their callbacks' exceptions through sys.excepthook
  # (TensorStore's, calling into an event loop Orbax has closed: "Event loop is closed");
  # the main thread's own uncaught exception (a bug's traceback) still prints.
  main_thread, print_exception = threading.main_thread(), sys.excepthook
  sys.excepthook = lambda *exc: (print_exception(*exc) if threading.current_thread()
                                 is main_thread else None)
  py_logging.disable(py_logging.CRITICAL)  # every record, absl's included


def end_within(grace_s: float, code: int, *, say: bool = False) -> None:
  """Makes sure a program whose main has ended also ends as a process: Python waits, at exit,
  for every non-daemon thread, and a library may leave one waiting far longer than the user
  should. Orbax's commit threads of a failed async save each wait for their peers' signals
  for the coordination timeout (300 s), so a run whose store went down reported its error
  at once and then hung for minutes. The threads still running now get `grace_s` to end; then
  the process exits with `code` without them, silently unless `say` (verbose): the program's
  last line already said why it ended, and these threads are a library's leftovers of it."""
  waiting = [t for t in threading.enumerate()
             if t is not threading.current_thread() and not t.daemon and t.is_alive()]
  if not waiting:
    return

  def watch() -> None:
    deadline = time.monotonic() + grace_s
    for thread in waiting:
      # threading.Thread's own join, not the thread's: Orbax's commit threads override it to
      # raise TimeoutError when the wait runs out (or their error when they failed), which
      # ended this watcher instead of the process.
      threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in waiting if t.is_alive()]
    if stuck:
      if say:
        print(f"warning: {len(stuck)} background thread(s) still running {grace_s:g} s after the "
              f"program ended ({', '.join(sorted(set(stuck))[:4])}); exiting without them",
              file=sys.stderr)
      sys.stderr.flush()
      sys.stdout.flush()
      os._exit(code)  # pylint: disable=protected-access  # the only exit that skips the join

  threading.Thread(target=watch, name="end-within", daemon=True).start()



class _Worker(threading.Thread):
  """A daemon thread running `fn()` once; `outcome()` returns its result or raises its error."""

  def __init__(self, fn: Callable[[], Any], name: str):
    super().__init__(name=name, daemon=True)
    self._fn, self._result, self._error = fn, None, None

  def run(self) -> None:
    try:
      self._result = self._fn()
    except BaseException as e:  # pylint: disable=broad-except  # raised again on the caller
      self._error = e

  def outcome(self) -> Any:
    if self._error is not None:
      raise self._error
    return self._result


def on_a_thread(fn: Callable[[], T]) -> T:
  """`fn()` on a thread while this one waits: its result, or its error raised here. CPython runs
  signal handlers only on the main thread between bytecodes, so a long call into a library
  (XLA compiling a program) holds them until it returns; waiting on a thread, they run at
  once, and one that raises (Ctrl-C's KeyboardInterrupt) abandons the wait. `fn` sets up any
  per-thread context it needs itself (a mesh is per thread)."""
  worker = _Worker(fn, "olmo3-long-call")
  worker.start()
  worker.join()  # interrupted by a signal only to run its handler (Python >= 3.2)
  return worker.outcome()


# How often `abandoned_on_signal` puts its handlers back.
_REASSERT_S = 0.5


def abandoned_on_signal(fn: Callable[[], T], doing: str) -> T:
  """`fn()` on a thread; a SIGINT or SIGTERM meanwhile ends the process at once with one line,
  `interrupted (SIGINT) while <doing>; nothing was written`, and status 128 + the signal: for
  work that writes nothing (a compile-only launch), which nothing else could stop promptly.
  The handlers are put back every half second because libtpu installs its own for SIGTERM
  while it compiles (one that prints a C++ stack dump as it kills the process)."""
  def stop(signum: int, frame: Any) -> None:
    del frame
    os.write(2, f"interrupted ({signal.Signals(signum).name}) while {doing}; nothing was "
                "written\n".encode())
    os._exit(128 + signum)  # pylint: disable=protected-access  # the compile cannot be stopped

  previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
  worker = _Worker(fn, "olmo3-abandonable")
  worker.start()
  try:
    while worker.is_alive():
      worker.join(_REASSERT_S)
      for sig in previous:
        signal.signal(sig, stop)
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
  return worker.outcome()
