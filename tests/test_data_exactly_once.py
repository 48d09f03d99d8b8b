"""Exactly-once reading, proven with real OS processes joined by jax.distributed on CPU."""

import json
import subprocess
import sys

import numpy as np
import pytest

from olmo3.data import exactly_once

from data_helpers import write_files


def _run(paths, processes, devices, steps, start=0, dump=None, workers=0):
  args = exactly_once.parse(
      ["--paths", *paths, "--seq_len", "16", "--global_batch", "8", "--seed", "5",
       "--processes", str(processes), "--devices_per_process", str(devices),
       "--steps", str(steps), "--start_step", str(start), "--workers", str(workers)]
      + (["--dump", str(dump)] if dump else []))
  return exactly_once.launch(args, timeout=300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  # 25 + 10 + 1 + 64 = 100 instances of 16 tokens: 12 steps of 8 per epoch, 4 dropped.
  return write_files(tmp_path_factory.mktemp("tokens"), [400, 170, 20, 1030])


@pytest.fixture(scope="module")
def single(files):
  return _run(files, processes=1, devices=2, steps=24)  # two whole epochs


@pytest.mark.parametrize("processes, devices", [(1, 8), (2, 2), (4, 2)])
@pytest.mark.slow(seconds=7)
def test_every_instance_read_once_per_epoch_at_any_process_count(files, single, processes,
                                                                 devices):
  report = _run(files, processes, devices, steps=24)
  assert report["ok"], report
  assert report["complete_epochs"] == [1, 2]
  assert report["duplicates_within_epoch"] == 0
  assert report["never_read_in_complete_epochs"] == 0
  assert report["instances_read"] == 24 * 8  # exactly one global batch per step, no more
  assert report["instances_read_per_process"] == [24 * 8 // processes] * processes
  assert report["digests"] == single["digests"]  # identical global batches for every P


@pytest.mark.slow(seconds=7)
def test_resume_on_a_different_process_count_continues_the_sequence(files, single):
  report = _run(files, processes=4, devices=1, steps=10, start=9)  # saved on 1 process
  assert report["ok"], report
  assert report["digests"] == {s: d for s, d in single["digests"].items() if 9 <= s < 19}


@pytest.mark.slow(seconds=5)
def test_dump_writes_each_process_rows(files, tmp_path):
  report = _run(files, processes=2, devices=2, steps=2, dump=tmp_path)
  assert report["ok"]
  rows = [np.load(tmp_path / f"step000001.process{p:03d}.npy") for p in range(2)]
  assert [r.shape for r in rows] == [(4, 16), (4, 16)]
  assert not any((a == b).all() for a in rows[0] for b in rows[1])


@pytest.mark.slow(seconds=9)
def test_grain_workers_inside_each_process(files, single):
  report = _run(files, processes=2, devices=2, steps=12, workers=2)
  assert report["ok"], report
  assert report["digests"] == {s: d for s, d in single["digests"].items() if s < 12}


@pytest.mark.slow(seconds=7)
def test_cli_prints_report_and_json(files):
  out = subprocess.run([sys.executable, "-m", "olmo3.data.exactly_once", "--paths", *files,
                        "--seq_len", "16", "--global_batch", "8", "--processes", "2",
                        "--devices_per_process", "1", "--steps", "3"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  assert "PASS" in out.stdout
  assert json.loads(out.stdout.strip().splitlines()[-1])["ok"]


def _fake_results(reads_per_process, batches_per_epoch, global_batch):
  """Per-process results as workers write them, from the rows each process read per step."""
  results = []
  for p, reads in enumerate(reads_per_process):
    steps = {}
    for step, read in enumerate(reads):
      union = sorted(i for r in reads_per_process for i in r[step])
      steps[str(step)] = {"read": read, "global": union, "matches_direct": True, "digest": ""}
    results.append({"process": p, "devices": 1, "instances": 16,
                    "batches_per_epoch": batches_per_epoch, "steps": steps})
  return results


def test_audit_catches_the_double_sharding_bug():
  """The reproduction's bug: each host got its slice of every global batch from the sampler AND
  Grain shard options, so it read every 2nd item of its slice (twice over)."""
  order = np.random.default_rng(0).permutation(16).reshape(4, 4)  # 4 steps of 4, 2 hosts
  good = [[list(order[s][:2]) for s in range(4)], [list(order[s][2:]) for s in range(4)]]
  assert exactly_once.analyze(_fake_results(good, 4, 4), 4)["ok"]
  buggy = [[[order[s][0]] * 2 for s in range(4)], [[order[s][2]] * 2 for s in range(4)]]
  report = exactly_once.analyze(_fake_results(buggy, 4, 4), 4)
  assert not report["ok"]
  assert report["duplicates_within_epoch"] == 8 and report["never_read_in_complete_epochs"] == 8


@pytest.mark.slow(seconds=5)
def test_audit_an_experiments_own_pipeline():
  root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
  out = subprocess.run([sys.executable, "launch/audit.py",
                        "--fdl_config=experiments.olmo3_tiny:stage1", "--processes", "2",
                        "--devices_per_process", "1", "--steps", "4", "--start_step=1",
                        "--fdl_set=data.global_batch_size=8"],
                       capture_output=True, text=True, timeout=300, cwd=root)
  assert out.returncode == 0, out.stderr[-2000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  # Every flag reached the audit: 2 processes of 1 device, steps 1..4, the overridden batch.
  assert report["ok"] and report["processes"] == 2 and report["devices_per_process"] == 1
  assert report["steps"] == [1, 4] and sorted(report["digests"], key=int) == ["1", "2", "3", "4"]
  assert report["instances_read"] == 4 * 8 and report["instances_read_per_process"] == [16, 16]
