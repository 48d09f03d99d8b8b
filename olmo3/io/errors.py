"""How a program's failure reaches its user: one `error:` line that names the file, URL or field
and what failed; the traceback only on request (absl's `-v 1`, or OLMO3_TRACEBACK=1 for any
program). The programs (launch/main.py, `python -m olmo3.eval`) say which errors are theirs to
report this way: their own (config, data, checkpoint, lease) and the storage's (OSError:
a missing file, a store that stayed down past the retry budget).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

TRACEBACK_ENV = "OLMO3_TRACEBACK"


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
  """`main` with the `errors()` types ending the program as one line (exit code 1), unless the
  traceback is wanted (`traceback_wanted(verbosity())`), when they propagate as they are.
  `errors` is called only when something was raised (its imports cost nothing otherwise)."""
  @functools.wraps(main)
  def wrapped(*args, **kwargs):
    try:
      return main(*args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except  # the others are raised on
      if not isinstance(e, errors()) or traceback_wanted(verbosity()):
        raise
      sys.exit(one_line(e))

  return wrapped
