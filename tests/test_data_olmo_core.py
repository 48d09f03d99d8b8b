"""Same instance order and same repetition-filter decisions as ai2-olmo-core on the same files:
with single instances shuffled (OLMo-core's default) and with the runs of 8192 tokens AI2's
scripts ask for (max_target_sequence_length=8192) below a sequence length of 8192."""

import numpy as np
import pytest
from olmo_core.data import DataCollator, NumpyDataLoaderBase, NumpyFSLDataLoader
from olmo_core.data.numpy_dataset import InstanceFilterConfig, NumpyFSLDataset
from olmo_core.data.utils import find_periodic_sequences

from olmo3.config import DataConfig, RepetitionFilter
from olmo3.data import filters, pipeline, tokens
from olmo3.data.order import GlobalOrder

from data_helpers import batch_sharding, write_files


def _olmo_core_loader(paths, seq_len, global_batch, seed, world, rank, work_dir,
                      max_target=None):
  """OLMo-core's loader as its data loader config builds it (wrap_numpy_dataset: the loader
  shuffles runs of max_target // seq_len instances when the dataset has a target)."""
  dataset = NumpyFSLDataset(*paths, sequence_length=seq_len, pad_token_id=1, eos_token_id=0,
                            vocab_size=1000, dtype=np.uint32, max_target_sequence_length=max_target)
  dataset.prepare()
  return NumpyDataLoaderBase.wrap_numpy_dataset(
      dataset, collator=DataCollator(pad_token_id=1), global_batch_size=global_batch * seq_len,
      work_dir=work_dir, seed=seed, dp_world_size=world, dp_rank=rank)


def _olmo_core_batches(paths, seq_len, global_batch, seed, world, rank, work_dir, steps,
                       max_target=None):
  loader = _olmo_core_loader(paths, seq_len, global_batch, seed, world, rank, work_dir,
                             max_target)
  loader.reshuffle(epoch=1)
  return [b["input_ids"].numpy() for _, b in zip(range(steps), loader)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_same_instance_order_as_olmo_core(tmp_path, world):
  paths = write_files(tmp_path, [1000, 333, 2050, 77, 1600], vocab=1000)
  seq_len, global_batch, seed = 16, 8, 34521
  ours = pipeline.Loader(DataConfig(paths=tuple(paths), seq_len=seq_len, max_target_seq_len=None,
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


# Files around whole runs of 8192 tokens (25 in all): tails short of one (dropped below 8192),
# exact runs, one token short of a run, a file shorter than a run.
RUN_FILES = [3 * 8192 + 5000, 8192 + 100, 5 * 8192 - 1, 4000, 2 * 8192, 8192 + 4096,
             14 * 8192 + 10]


@pytest.mark.parametrize("seq_len", [4096, 2048, 8192])
def test_runs_of_8192_tokens_in_olmo_cores_order(tmp_path, seq_len):
  """AI2's max_target_sequence_length=8192 below (and at) seq_len 8192: the same instances,
  the same order for 1, 2 and 4 ranks, the same next batches after a resume mid-epoch, and
  epoch 2 reshuffled alike."""
  paths = write_files(tmp_path, RUN_FILES, vocab=1000)
  global_batch, seed, steps = 4, 34521, 6
  cfg = DataConfig(paths=tuple(paths), seq_len=seq_len, max_target_seq_len=8192,
                   global_batch_size=global_batch, seed=seed)
  source = tokens.TokenFiles(paths, seq_len, chunk=cfg.chunk_instances)
  reference = _olmo_core_loader(paths, seq_len, global_batch, seed, 1, 0, tmp_path / "w", 8192)
  assert reference.chunk_size == cfg.chunk_instances == 8192 // seq_len
  assert len(source) == len(reference.dataset) == 25 * 8192 // seq_len
  ours = [np.asarray(b["input_ids"]) for b in pipeline.Loader(
      cfg, batch_sharding(1), start_step=0, num_steps=steps, vocab_size=1000)]
  for world in (1, 2, 4):
    for rank in range(world):
      theirs = _olmo_core_batches(paths, seq_len, global_batch, seed, world, rank,
                                  tmp_path / f"w{world}.{rank}", steps, max_target=8192)
      assert len(theirs) == steps
      for step, (mine, their) in enumerate(zip(ours, theirs)):
        np.testing.assert_array_equal(mine[rank::world], their, err_msg=f"{world}:{rank}:{step}")
  # A resume after 2 steps: OLMo-core's loader restored from its state, ours from the step.
  first = _olmo_core_loader(paths, seq_len, global_batch, seed, 1, 0, tmp_path / "r", 8192)
  first.reshuffle(epoch=1)
  for _, _ in zip(range(2), first):
    pass
  resumed = _olmo_core_loader(paths, seq_len, global_batch, seed, 1, 0, tmp_path / "r", 8192)
  resumed.load_state_dict(first.state_dict())
  resumed.reshuffle(epoch=1)
  theirs = [b["input_ids"].numpy() for b in resumed]
  mine = [np.asarray(b["input_ids"]) for b in pipeline.Loader(
      cfg, batch_sharding(1), start_step=2, num_steps=len(theirs), vocab_size=1000)]
  assert len(theirs) == pipeline.steps_per_epoch(cfg, source) - 2
  for step, (a, b) in enumerate(zip(mine, theirs), start=2):
    np.testing.assert_array_equal(a, b, err_msg=f"resumed step {step}")
  reference.reshuffle(epoch=2)
  order = GlobalOrder(len(source), global_batch, seed, cfg.chunk_instances)
  kept = order.batches_per_epoch * global_batch
  np.testing.assert_array_equal(
      np.stack([order.batch(order.batches_per_epoch + b) for b in range(order.batches_per_epoch)]),
      reference.get_global_indices()[:kept].reshape(-1, global_batch))


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
