"""The global order computed once per machine and shared (olmo3.data.order): the same order as
computed in process, read back without computing, and never trusted when torn or foreign. The
order's own semantics against OLMo-core: tests/test_data_olmo_core.py."""

import multiprocessing
import os
import time

import numpy as np
import pytest

from olmo3.data import order as order_lib
from olmo3.data.order import GlobalOrder, KeptOrder, epoch_permutation


def _kept(n, seed, epoch, chunk, directory):
  """The whole kept order, every block checked (as a launch reads it, all at once)."""
  return KeptOrder(n, seed, epoch, chunk, directory).rows(0, n)


@pytest.mark.parametrize("epoch, chunk", [(1, 1), (2, 1), (1, 4)])
def test_the_shared_order_is_the_order(tmp_path, epoch, chunk):
  np.testing.assert_array_equal(_kept(10_000, 7, epoch, chunk, tmp_path),
                                epoch_permutation(10_000, 7, epoch, chunk))
  shared, own = GlobalOrder(10_000, 64, 7, chunk, tmp_path), GlobalOrder(10_000, 64, 7, chunk)
  for step in (0, 155, 156, 400):  # 156 batches an epoch: the second epoch too
    np.testing.assert_array_equal(shared.batch(step), own.batch(step))


def _refuse(*args):
  raise AssertionError("computed again")


def test_a_kept_order_is_read_not_computed(tmp_path, monkeypatch):
  expected = _kept(10_000, 7, 1, 1, tmp_path)
  monkeypatch.setattr(order_lib, "epoch_permutation", _refuse)
  read = _kept(10_000, 7, 1, 1, tmp_path)
  # (`_refuse` would have raised had it been computed again)
  np.testing.assert_array_equal(read, expected)


@pytest.mark.parametrize("damage", ["torn", "flipped", "foreign"])
def test_a_torn_or_foreign_order_is_computed_again(tmp_path, damage):
  expected = epoch_permutation(10_000, 7, 1)
  _kept(10_000, 7, 1, 1, tmp_path)
  path = tmp_path / "order-10000-7-1-1.u32"
  data = path.read_bytes()
  if damage == "torn":  # a copy cut short
    path.write_bytes(data[: len(data) // 2])
  elif damage == "flipped":  # the right size, one index changed
    path.write_bytes(data[:400] + bytes([data[400] ^ 1]) + data[401:])
  else:  # another order under this name (another seed's), sidecar and all
    other = epoch_permutation(10_000, 8, 1).tobytes()
    path.write_bytes(other)
    meta = path.with_suffix(".json")
    meta.write_text(meta.read_text().replace('"seed": 7', '"seed": 8'))
  np.testing.assert_array_equal(_kept(10_000, 7, 1, 1, tmp_path), expected)
  assert path.read_bytes() == expected.tobytes()


def _compute(directory, log):
  def counted(*args):
    with open(log, "a") as f:
      f.write(f"{os.getpid()}\n")
    time.sleep(0.5)  # long enough for the other process to reach the lock
    return epoch_permutation(*args)

  order_lib.epoch_permutation = counted
  _kept(10_000, 7, 1, 1, directory)


@pytest.mark.slow(seconds=2)
def test_processes_racing_for_the_order_compute_it_once(tmp_path):
  log = tmp_path / "computed"
  ctx = multiprocessing.get_context("fork")
  procs = [ctx.Process(target=_compute, args=(tmp_path / "cache", log)) for _ in range(3)]
  for p in procs:
    p.start()
  for p in procs:
    p.join(30)
  assert [p.exitcode for p in procs] == [0, 0, 0]
  assert len(log.read_text().split()) == 1
  np.testing.assert_array_equal(_kept(10_000, 7, 1, 1, tmp_path / "cache"),
                                epoch_permutation(10_000, 7, 1))


def _rotation(n_instances, seed, epoch, chunk=1):
  """A permutation of n_instances computed in seconds at any size (i -> i + shift mod n, as
  two runs of arange): stands in for numpy's shuffle, which is the same code at any size. (An
  affine map, i -> a·i + b mod n, took 13 s of CPU at the 7B's size, half the test; what is
  left is mostly the system's time to first touch 2.9 GB of memory and page cache.)"""
  shift = _shift(n_instances, seed, epoch)
  return np.concatenate([np.arange(shift, n_instances, dtype=np.uint32),
                         np.arange(0, shift, dtype=np.uint32)])


def _shift(n_instances, seed, epoch):
  return (seed + epoch) * 1_000_003 % n_instances


@pytest.mark.seconds(25)  # mostly writing and reading back 2.9 GB: the disk, not the CPU
def test_at_the_7bs_size_the_kept_order_is_the_order(tmp_path, monkeypatch):
  """AI2's stage 1: 723,876,444 instances, a 2.9 GB order file (offsets past 2**31 bytes, a
  CRC over the whole) read memory-mapped gives the order's batches at the first, a far and the
  last step of the epoch. (numpy's own shuffle at this size, 48 s and 5.9 GB, is
  checked against the kept file by benchmarks/startup_7b.py.)"""
  monkeypatch.setattr(order_lib, "epoch_permutation", _rotation)
  monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not what this test is about
  n, batch = 723_876_444, 512
  kept = GlobalOrder(n, batch, 7, 1, tmp_path)
  last = n // batch - 1  # 1,413,820: the epoch's last whole batch
  for step in (0, 1_000_000, last):  # the order's entries at the step's positions
    positions = np.arange(step * batch, (step + 1) * batch, dtype=np.uint64)
    np.testing.assert_array_equal(kept.batch(step), (positions + _shift(n, 7, 1)) % n)
  assert kept._epoch(1).checked == {0, 30, 43}  # the blocks those steps read, no more
  assert (tmp_path / f"order-{n}-7-1-1.u32").stat().st_size == 4 * n


def test_an_order_cut_short_under_a_run_is_computed_again_not_a_crash(tmp_path, monkeypatch):
  """A kept order truncated in place while a process reads it (another tool, a full disk's
  cleanup): the next read finds it short and computes it again (it was memory-mapped, and the
  run died of SIGBUS)."""
  monkeypatch.setattr(order_lib, "_BLOCK_BYTES", 4096)
  order = epoch_permutation(10_000, 7, 1)
  kept = GlobalOrder(10_000, 64, 7, 1, tmp_path)
  np.testing.assert_array_equal(kept.batch(3), order[3 * 64:4 * 64])  # block 0 checked
  path = tmp_path / "order-10000-7-1-1.u32"
  with open(path, "r+b") as f:
    f.truncate(100)  # in place: the same inode, 25 indices left
  np.testing.assert_array_equal(kept.batch(4), order[4 * 64:5 * 64])  # block 0, checked before
  np.testing.assert_array_equal(kept.batch(150), order[150 * 64:151 * 64])
  assert path.read_bytes() == order.tobytes()


def test_a_restart_checks_only_the_blocks_it_reads_and_never_trusts_a_damaged_one(
    tmp_path, monkeypatch):
  monkeypatch.setattr(order_lib, "_BLOCK_BYTES", 4096)  # 1,024 indices a block: 10 blocks
  order = epoch_permutation(10_000, 7, 1)
  GlobalOrder(10_000, 64, 7, 1, tmp_path).prepare(1)  # the first launch keeps the order
  path = tmp_path / "order-10000-7-1-1.u32"
  data = bytearray(path.read_bytes())
  data[5 * 4096 + 8] ^= 1  # block 5 damaged on disk (steps 80-95 read it)
  path.write_bytes(bytes(data))
  restarted = GlobalOrder(10_000, 64, 7, 1, tmp_path)
  monkeypatch.setattr(order_lib, "epoch_permutation", _refuse)
  np.testing.assert_array_equal(restarted.batch(3), order[3 * 64:4 * 64])
  assert restarted._epoch(1).checked == {0}  # the block step 3 is in, nothing more
  monkeypatch.undo()
  monkeypatch.setattr(order_lib, "_BLOCK_BYTES", 4096)
  np.testing.assert_array_equal(restarted.batch(85), order[85 * 64:86 * 64])  # computed again
  assert path.read_bytes() == order.tobytes()
