"""Audit an experiment's own input pipeline for exactly-once reading (olmo3.data.audit).

  python launch/audit.py --fdl_config=experiments.olmo3_tiny:stage1 --processes 4 \
      --devices_per_process 2 --steps 200 [--start_step K] [--dump DIR] [--fdl_set=...]

Builds the experiment (with any --fdl_set overrides) and audits its DataConfig: the same files,
order, batch and filters the trainer would use, read by P real processes.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fiddle as fdl  # noqa: E402

from launch import configs  # noqa: E402
from olmo3.data import audit  # noqa: E402


def main(argv: list[str]) -> int:
  ref = next((a.split("=", 1)[1] for a in argv if a.startswith("--fdl_config=")), None)
  if ref is None:
    print("error: --fdl_config=REF is required", file=sys.stderr)
    return 2
  sets = [a.split("=", 1)[1] for a in argv if a.startswith("--fdl_set=")]
  rest = [a for a in argv if not a.startswith(("--fdl_config=", "--fdl_set="))]
  exp = fdl.build(configs.resolve(ref, sets))
  return audit.main(rest, data=exp.data)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
