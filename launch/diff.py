"""Diff two experiments or runs, field by field (Fiddle's diffing).

  python launch/diff.py experiments.olmo3_7b:stage1 experiments.olmo3_7b:stage2
  python launch/diff.py runs/olmo3_tiny.stage1 runs/olmo3_tiny.stage2 --json

Each side is an experiment reference (module:function) or a run workdir (its config.json).
Programmatic use: `launch.configs.diff(configs.load_any(a), configs.load_any(b))`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import configs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="launch/diff.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("a")
  parser.add_argument("b")
  parser.add_argument("--json", action="store_true", help="print a JSON list of changes")
  args = parser.parse_args(argv)
  try:
    changes = configs.diff(configs.load_any(args.a), configs.load_any(args.b))
  except configs.ConfigRefError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(configs.diff_json(changes))
    return 0
  if not changes:
    print("no differences")
    return 0
  width = max(len(c.path) for c in changes)
  print(f"{'field'.ljust(width)}  {args.a}  ->  {args.b}")
  for c in changes:
    print(f"{c.path.ljust(width)}  {c.a!r}  ->  {c.b!r}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
