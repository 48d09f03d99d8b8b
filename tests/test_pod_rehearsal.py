"""The pod in a box: benchmarks/pod_rehearsal.py's quick mode, the launcher as a SLURM job of
2 processes x 2 devices taken through SIGTERM, SIGKILL, a storage outage and a resize to 1 x 1."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow(seconds=150)  # measured in the suite, caches empty
def test_a_pod_job_survives_its_faults_and_loses_nothing(tmp_path):
  """The rehearsal's quick mode: its four faults in order on the same job (2 processes x 2
  devices through the sbatch script and the srun stand-in, the workdir in fake-gcs-server,
  token files over HTTP with latency and injected 500s), with their checks against an
  uninterrupted job (state bit-equal, losses, no checkpoint lost, one history line per launch),
  in 12 steps. Short as the faults allow: what is left is one job start per fault (the
  uninterrupted job, a, b, b's relaunch where c happens, d), the first compiling and the others
  loading its programs from the compilation cache in every process (olmo3/compilation_cache.py).
  The full rehearsal (4 x 2, its data audit and stage 2's 4-process evaluation) is a benchmark
  run, benchmarks/RESULTS.md; tests/test_data_exactly_once.py audits 4-process loaders and
  tests/test_reliability.py checks a 2-process evaluation against 1 process."""
  done = subprocess.run([sys.executable, "benchmarks/pod_rehearsal.py", "--quick",
                         f"--keep={tmp_path / 'rehearsal'}"], cwd=ROOT, capture_output=True,
                        text=True, timeout=1800)
  assert done.stdout.strip(), done.stderr[-3000:]
  report = json.loads(done.stdout)
  assert report["ok"] and done.returncode == 0, json.dumps(report["failures"], indent=1)
  faults = [f["fault"] for f in report["faults"]]
  assert len(faults) == 5, faults  # a, b, b's relaunch, c, d
  assert report["losses_same_sharding"]["state_bit_equal"]
