"""AI2's named mixes that olmo3 ships (`olmo3/data/mix_lists/NAME.txt`, package data): the lists
of AI2's token files (`label,path` lines, the paths relative to `DataConfig.root`, `{TOKENIZER}`
standing for the tokenizer id) that the 7B's stages and held-out sets name, plus stage 3's
long-context mix, copied byte for byte from ai2-olmo-core 3.0.0's package data
(`olmo_core/data/mixes/`). They are data, not code.

Why a copy: ai2-olmo-core imports torch (an unpinned dependency of it: the multi-GB CUDA build
from PyPI) and only the test extra installs it, so none of the documented installs (the
README's, the cluster image's tpu,eval, a SLURM environment's gpu,eval) could name the 7B's data.
A name olmo3 does not ship is still looked up in ai2-olmo-core where that is installed.

To refresh the copies from the installed ai2-olmo-core (tests/test_data_mixes.py fails when
they drift from it), or to ship another of its mixes:

  python -m olmo3.data.mixes              # every shipped list again, from ai2-olmo-core
  python -m olmo3.data.mixes NAME ...     # and NAME too (python -m olmo3.data.mixes --list)
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import re
import shutil
import sys

from olmo3 import program

SUFFIX = ".txt"
# A mix name, as opposed to a path: it never leaves the directory it is looked up in.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def shipped_dir() -> str:
  """The directory of the shipped lists (package data: a wheel installs it with the code)."""
  return os.fspath(importlib.resources.files("olmo3.data").joinpath("mix_lists"))


def shipped() -> tuple[str, ...]:
  """The names of the mixes olmo3 ships, sorted."""
  return tuple(sorted(f.removesuffix(SUFFIX) for f in os.listdir(shipped_dir())
                      if f.endswith(SUFFIX)))


def olmo_core_dir() -> str | None:
  """ai2-olmo-core's directory of named mixes, if it is installed. Located without importing
  ai2-olmo-core (which imports torch: seconds at every launch)."""
  try:
    spec = importlib.util.find_spec("olmo_core")
  except (ImportError, ValueError):  # ValueError: a module of that name without a spec
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  for location in spec.submodule_search_locations:
    candidate = os.path.join(location, "data", "mixes")
    if os.path.isdir(candidate):
      return candidate
  return None


def find(name: str, olmo_core: bool = True) -> str | None:
  """The file of the named mix `name`: olmo3's shipped copy, else (with `olmo_core`)
  ai2-olmo-core's where it is installed; None when neither has it."""
  if not _NAME.fullmatch(name):
    return None
  for directory in (shipped_dir(), olmo_core_dir() if olmo_core else None):
    if directory is not None and os.path.isfile(os.path.join(directory, name + SUFFIX)):
      return os.path.join(directory, name + SUFFIX)
  return None


def regenerate(names: list[str] | None = None, out: str | None = None) -> list[str]:
  """Copies the named lists (default: every shipped one) from the installed ai2-olmo-core into
  `out` (default: the shipped directory); returns the names copied."""
  source = olmo_core_dir()
  if source is None:
    raise SystemExit("error: ai2-olmo-core is not installed (pip install -e '.[test]')")
  names = list(shipped()) if names is None else names
  missing = [n for n in names if not (_NAME.fullmatch(n)
                                      and os.path.isfile(os.path.join(source, n + SUFFIX)))]
  if missing:
    known = sorted(f.removesuffix(SUFFIX) for f in os.listdir(source) if f.endswith(SUFFIX))
    raise SystemExit(f"error: ai2-olmo-core has no mix {missing[0]!r} (it has: "
                     f"{', '.join(known)})")
  out = shipped_dir() if out is None else out
  os.makedirs(out, exist_ok=True)
  for name in names:
    shutil.copyfile(os.path.join(source, name + SUFFIX), os.path.join(out, name + SUFFIX))
  return names


def main(argv: list[str] | None = None) -> int:
  parser = program.parser("python -m olmo3.data.mixes", __doc__)
  parser.add_argument("names", nargs="*", help="ai2-olmo-core mixes to ship besides the shipped")
  parser.add_argument("--list", action="store_true",
                      help="list the shipped mixes and ai2-olmo-core's, copy nothing")
  args = parser.parse_args(argv)
  if args.list:
    print("shipped:       " + ", ".join(shipped()))
    source = olmo_core_dir()
    print("ai2-olmo-core: " + (", ".join(sorted(f.removesuffix(SUFFIX) for f in os.listdir(source)
                                               if f.endswith(SUFFIX)))
                               if source else "not installed"))
    return 0
  names = sorted(set(shipped()) | set(args.names))
  for name in regenerate(names):
    print(f"{name}: copied from ai2-olmo-core")
  return 0


if __name__ == "__main__":
  sys.exit(main())
