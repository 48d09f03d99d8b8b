"""The requirements of olmo3 with some extras, read from pyproject.toml, for the image's
dependency layer (the repository's Dockerfile installs them before it copies the tree, so a
source edit reuses that layer). Standard library only: it runs before anything is installed.

  python docker/requirements.py tpu,eval torch   # torch's pin, when the extras need torch
  python docker/requirements.py tpu,eval other   # every other requirement, one a line

torch is listed apart because the image installs it from PyTorch's CPU wheel index (the
Dockerfile says why).
"""

from __future__ import annotations

import os
import re
import sys
import tomllib

PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "pyproject.toml")
PARTS = ("torch", "other")


def name(requirement: str) -> str:
  """A requirement's distribution name, normalised (PEP 503): 'jax[tpu]==0.10.2' -> 'jax'."""
  found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
  return re.sub(r"[-_.]+", "-", found.group(0)).lower() if found else ""


def requirements(extras: list[str], pyproject: str = PYPROJECT) -> list[str]:
  """The base dependencies and those of `extras`, in order, each once. An extra pyproject.toml
  does not define is an error (pip would only warn, and build an image without it)."""
  with open(pyproject, "rb") as f:
    project = tomllib.load(f)["project"]
  table = project.get("optional-dependencies", {})
  unknown = [e for e in extras if e not in table]
  if unknown:
    raise SystemExit(f"error: EXTRAS={','.join(extras)}: olmo3 has no extra {unknown[0]!r} (its "
                     f"extras: {', '.join(sorted(table))})")
  out: list[str] = []
  for requirement in [*project["dependencies"], *(r for e in extras for r in table[e])]:
    if requirement not in out:
      out.append(requirement)
  return out


def split(lines: list[str]) -> dict[str, list[str]]:
  """{"torch": torch's requirements, "other": the rest}."""
  torch = [r for r in lines if name(r) == "torch"]
  return {"torch": torch, "other": [r for r in lines if r not in torch]}


def main(argv: list[str]) -> int:
  if len(argv) != 3 or argv[2] not in PARTS:
    raise SystemExit(f"usage: python {argv[0]} EXTRAS {'|'.join(PARTS)}")
  extras = [e.strip() for e in argv[1].split(",") if e.strip()]
  lines = split(requirements(extras))[argv[2]]
  if lines:  # nothing at all otherwise: the Dockerfile tests the file for emptiness
    print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
