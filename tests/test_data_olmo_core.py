"""Same instance order and same repetition-filter decisions as ai2-olmo-core on the same files."""

import numpy as np
import pytest
from olmo_core.data import DataCollator, NumpyFSLDataLoader
from olmo_core.data.numpy_dataset import InstanceFilterConfig, NumpyFSLDataset
from olmo_core.data.utils import find_periodic_sequences

from olmo3.config import DataConfig, RepetitionFilter
from olmo3.data import filters, pipeline, tokens
from olmo3.data.order import GlobalOrder

from data_helpers import batch_sharding, write_files


def _olmo_core_batches(paths, seq_len, global_batch, seed, world, rank, work_dir, steps):
  dataset = NumpyFSLDataset(*paths, sequence_length=seq_len, pad_token_id=1, eos_token_id=0,
                            vocab_size=1000, dtype=np.uint32)
  dataset.prepare()
  loader = NumpyFSLDataLoader(dataset, collator=DataCollator(pad_token_id=1),
                              global_batch_size=global_batch * seq_len, work_dir=work_dir,
                              seed=seed, dp_world_size=world, dp_rank=rank)
  loader.reshuffle(epoch=1)
  return [b["input_ids"].numpy() for _, b in zip(range(steps), loader)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_same_instance_order_as_olmo_core(tmp_path, world):
  paths = write_files(tmp_path, [1000, 333, 2050, 77, 1600], vocab=1000)
  seq_len, global_batch, seed = 16, 8, 34521
  ours = pipeline.Loader(DataConfig(paths=tuple(paths), seq_len=seq_len,
                                    global_batch_size=global_batch, seed=seed),
                         batch_sharding(1), start_step=0, num_steps=10, vocab_size=1000)
  ours_batches = [b["input_ids"] for b in ours]
  for rank in range(world):
    theirs = _olmo_core_batches(paths, seq_len, global_batch, seed, world, rank,
                                tmp_path / f"work{rank}", 10)
    assert len(theirs) == 10
    for step, (mine, their) in enumerate(zip(ours_batches, theirs)):
      # OLMo-core hands rank r the columns r::W of each global batch.
      np.testing.assert_array_equal(mine[rank::world], their, err_msg=f"step {step}")


def test_epoch_two_reshuffles_like_olmo_core(tmp_path):
  paths = write_files(tmp_path, [900, 700], vocab=1000)
  order = GlobalOrder(len(tokens.TokenFiles(paths, 16)), 8, seed=7)
  dataset = NumpyFSLDataset(*paths, sequence_length=16, pad_token_id=1, eos_token_id=0,
                            vocab_size=1000, dtype=np.uint32)
  dataset.prepare()
  loader = NumpyFSLDataLoader(dataset, collator=DataCollator(pad_token_id=1),
                              global_batch_size=8 * 16, work_dir=tmp_path / "w", seed=7)
  loader.reshuffle(epoch=2)
  theirs = loader.get_global_indices()[:order.batches_per_epoch * 8].reshape(-1, 8)
  first_step_of_epoch_2 = order.batches_per_epoch
  for b in range(order.batches_per_epoch):
    np.testing.assert_array_equal(order.batch(first_step_of_epoch_2 + b), theirs[b])


def _with_repeats(rng, n, period, times, at):
  x = rng.integers(2, 1000, n)
  pattern = rng.integers(2, 1000, period)
  x[at:at + period * times] = np.tile(pattern, times)
  return x


def test_same_repetitions_as_olmo_core():
  rng = np.random.default_rng(0)
  cases = [rng.integers(0, 3, 300), rng.integers(0, 1000, 512), np.zeros(100, np.int64)]
  for period in (1, 2, 5, 13):
    for times in (3, 31, 32, 40):
      for at in (0, 7, 100):
        cases.append(_with_repeats(rng, 1024, period, times, at))
  cases.append(_with_repeats(rng, 513, 4, 128, 1))  # the run reaches the end
  for x in cases:
    ours = list(filters.repetitions(x, 13, 1))
    theirs = [tuple(r) for r in find_periodic_sequences(x.astype(np.int64), 13, 1)]
    assert [tuple(r) for r in ours] == theirs


def test_same_filter_decisions_as_olmo_core(tmp_path):
  rng = np.random.default_rng(1)
  instances = [_with_repeats(rng, 64, p, t, a) for p, t, a in
               [(1, 40, 3), (1, 31, 0), (2, 32, 0), (3, 10, 5), (13, 4, 0), (1, 32, 32)]]
  instances += [rng.integers(2, 1000, 64) for _ in range(4)]
  path = tmp_path / "f.npy"
  tokens.write_token_file(path, np.concatenate(instances))
  cfg = InstanceFilterConfig()
  dataset = NumpyFSLDataset(path, sequence_length=64, pad_token_id=1, eos_token_id=0,
                            vocab_size=1000, dtype=np.uint32, instance_filter_config=cfg)
  dataset.prepare()
  theirs = [not bool(dataset[i]["instance_mask"]) for i in range(len(instances))]
  ours = [filters.is_repetitive(x, RepetitionFilter()) for x in instances]
  assert ours == theirs
  assert sum(ours) >= 2 and not all(ours)  # both decisions occur
