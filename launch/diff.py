"""Diff two experiments or runs, field by field (Fiddle's diffing).

  python launch/diff.py experiments.olmo3_7b:stage1 experiments.olmo3_7b:stage2
  python launch/diff.py runs/olmo3_tiny.stage1 runs/olmo3_tiny.stage2 --json
  python launch/diff.py runs/olmo3_tiny.stage1@100 runs/olmo3_tiny.stage1@200

Each side is an experiment reference (module:function) or a run workdir: the config revision
that produced its newest checkpoint, or with `WORKDIR@STEP` the one that produced checkpoint
STEP (a run resumed with a resumable change holds several; olmo3/run/record.py has the
rule). Programmatic use: `launch.config_changes.diff(config_files.load_any(a), config_files.load_any(b))`.
"""

from __future__ import annotations

import sys

from absl import app, flags

from launch import config_changes, config_files, refs
from olmo3 import program

JSON = flags.DEFINE_bool("json", False, "print a JSON list of changes")


def format_table(changes: list[config_changes.Change], a: str, b: str) -> str:
  if not changes:
    return "no differences"
  width = max(len(c.path) for c in changes)
  return "\n".join([f"{'field'.ljust(width)}  {a}  ->  {b}"]
                   + [f"{c.path.ljust(width)}  {c.a!r}  ->  {c.b!r}" for c in changes])


def main(argv: list[str]) -> None:
  program.begin()
  if len(argv) != 3:
    sys.exit(f"error: expected two experiments or run workdirs (A B), got {argv[1:]}\n"
             "Run 'python launch/diff.py --help' for usage.")
  a, b = argv[1:]
  refs.make_cwd_importable()
  try:
    changes = config_changes.diff(config_files.load_any(a), config_files.load_any(b))
  except refs.ConfigRefError as e:  # one line, not the usage text
    sys.exit(f"error: {e}")
  print(config_changes.diff_json(changes) if JSON.value else format_table(changes, a, b))


if __name__ == "__main__":
  app.run(main)
