"""The pod in a box: benchmarks/pod_rehearsal.py, the launcher as a 4-process x 2-device SLURM
job taken through SIGTERM, SIGKILL, a storage outage, a resize and stage 2's evaluation."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow(seconds=880)  # measured on 2 cores with the load average at 13-17
def test_a_pod_job_survives_its_faults_and_loses_nothing(tmp_path):
  """The rehearsal's quick mode: every fault of the full one, in the same order, on the same
  job (4 processes x 2 devices through the sbatch script and the srun stand-in, the workdir in
  fake-gcs-server, token files over HTTP with latency and injected 500s) and every check, with
  fewer steps (12, the job's part 10) and 2 tasks of 4 documents in stage 2. It is as short as
  it can be without dropping a fault, since the whole suite is over its 10-minute budget: what
  is left is mostly process starts and compiles (an uninterrupted reference job; a; b; b's
  relaunch, where c happens; d; two audits; stage 2; the 1-process evaluation), each fault
  needing its own. The full rehearsal's numbers are in benchmarks/RESULTS.md."""
  done = subprocess.run([sys.executable, "benchmarks/pod_rehearsal.py", "--quick",
                         f"--keep={tmp_path / 'rehearsal'}"], cwd=ROOT, capture_output=True,
                        text=True, timeout=1800)
  assert done.stdout.strip(), done.stderr[-3000:]
  report = json.loads(done.stdout)
  assert report["ok"] and done.returncode == 0, json.dumps(report["failures"], indent=1)
  faults = [f["fault"] for f in report["faults"]]
  assert len(faults) == 5, faults  # a, b, b's relaunch, c, d (e: stage2_evaluation)
  assert report["stage2_evaluation"]["metrics_compared"] > 0
