r"""Audit an experiment's own input pipeline for exactly-once reading (olmo3.data.exactly_once).

  python launch/audit.py --fdl_config=experiments.olmo3_tiny:stage1 --processes 4 \
      --devices_per_process 2 --steps 200 [--start_step K] [--dump DIR] [--fdl_set=...]

Builds the experiment (with any --fdl_set overrides) and audits its DataConfig: the same files,
order, batch and filters the trainer would use, read by P real processes. Exits 1 if the audit
finds a duplicate, a gap or a mismatch.
"""

from __future__ import annotations

import sys

import fiddle as fdl
from absl import app, flags

from launch import refs
from olmo3 import platforms
from olmo3.data import exactly_once

CONFIG = flags.DEFINE_string(
    "fdl_config", None, "experiment reference: package.module:function", required=True)
SETS = flags.DEFINE_multi_string("fdl_set", [], "override: path=value (a Python literal)")
PROCESSES = flags.DEFINE_integer("processes", 2, "real OS processes (jax.distributed on CPU)",
                                 lower_bound=1)
DEVICES = flags.DEFINE_integer("devices_per_process", 2, "simulated CPU devices per process",
                               lower_bound=1)
STEPS = flags.DEFINE_integer("steps", None, "steps to read", required=True, lower_bound=1)
START_STEP = flags.DEFINE_integer("start_step", 0, "first step read", lower_bound=0)
DUMP = flags.DEFINE_string("dump", None, "directory for the rows each process holds per step")


def audit_argv() -> list[str]:
  """olmo3.data.exactly_once's own command line (it parses with argparse) for these flags."""
  argv = ["--processes", str(PROCESSES.value), "--devices_per_process", str(DEVICES.value),
          "--steps", str(STEPS.value), "--start_step", str(START_STEP.value)]
  return argv + (["--dump", DUMP.value] if DUMP.value else [])


def main(argv: list[str]) -> int:
  platforms.choose()  # the CPU where there is no accelerator: no TPU probing
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments: {argv[1:]}\n"
             "Run 'python launch/audit.py --help' for the flags.")
  refs.make_cwd_importable()
  try:
    exp = fdl.build(refs.resolve(CONFIG.value, SETS.value))
  except (refs.ConfigRefError, ValueError, TypeError) as e:  # one line, not the usage text
    sys.exit(f"error: {refs.message(e)}\nRun 'python launch/audit.py --help' for the flags.")
  return exactly_once.main(audit_argv(), data=exp.data)


if __name__ == "__main__":
  app.run(main)
