"""Packed instances equal to ai2-olmo-core's NumpyPackedFSLDataset (AI2's stage-3 settings:
generate_doc_lengths, source_group_size=8, source_permutation_seed=123, long documents
truncated) on files that exercise every rule: thirteen files (two source groups), tied lengths
by the thousand (the argsort's tie order), documents longer than an instance, length-1
documents, a tail after the last EOS, a file without any EOS. Its data loader's order over
them is GlobalOrder's at 1, 2 and 4 ranks, across an epoch end, and after a resume at another
rank count.

OLMo-core's prepare() packs each group in a process pool; here each group is packed in this
process by the same per-group method the pool would run (`_pack_documents_from_source_into_
instances`), after which prepare() finds its work_dir files and starts nothing."""

import dataclasses

import numpy as np
import pytest
import torch
from olmo_core.data import DataCollator, NumpyDataLoaderBase, TokenizerConfig
from olmo_core.data.numpy_dataset import NumpyPackedFSLDatasetConfig
from olmo_core.data.utils import InstancePacker, get_cumulative_document_lengths, get_labels
from olmo_core.nn.rope import RotaryEmbedding

from olmo3.data import packing, tokens
from olmo3.data.order import GlobalOrder

EOS, PAD, VOCAB, SEQ = 0, 1, 1000, 128


def _doc(rng, n):
  return np.append(rng.integers(2, VOCAB, n - 1), EOS)


def _write_corpus(directory) -> list[str]:
  """Thirteen token files; file 0 holds 1500 short documents of 30 distinct lengths."""
  rng = np.random.default_rng(5)
  files = [np.concatenate([_doc(rng, n) for n in rng.integers(1, 31, 1500)])]
  for i in range(1, 13):
    lengths = list(rng.choice([1, 5, 17, 40, 64, 90, SEQ - 1, SEQ], 25))
    lengths += [int(rng.integers(1, 3 * SEQ))] * 3  # some longer than an instance, tied
    docs = [_doc(rng, int(n)) for n in rng.permutation(lengths)]
    if i == 4:
      docs += [np.array([EOS, EOS, EOS])]  # three length-1 documents in a row
    if i == 7:
      docs = [rng.integers(2, VOCAB, 300)]  # no EOS at all: no document
    tail = rng.integers(2, VOCAB, 7 if i % 3 else 0)  # tokens after the last EOS: dropped
    files.append(np.concatenate(docs + [tail]))
  paths = []
  for i, x in enumerate(files):
    path = directory / f"part-{i:02d}.npy"
    tokens.write_token_file(path, x)
    paths.append(str(path))
  return paths


def _olmo_core_dataset(paths, work_dir, strategy="truncate"):
  config = NumpyPackedFSLDatasetConfig(
      paths=paths, tokenizer=TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS,
                                             pad_token_id=PAD),
      dtype="uint32", sequence_length=SEQ, generate_doc_lengths=True, source_group_size=8,
      source_permutation_seed=123, long_doc_strategy=strategy, work_dir=str(work_dir))
  dataset = config.build()
  for group in dataset._source_path_groups:  # what prepare()'s pool would run, in process
    dataset._pack_documents_from_source_into_instances(*group)
  dataset.prepare()
  return dataset


def _ours(paths, strategy="truncate"):
  index = packing.PackedIndex.build(paths, seq_len=SEQ, eos_token_id=EOS, source_group_size=8,
                                    source_permutation_seed=123, long_doc_strategy=strategy)
  return packing.PackedInstances(index, pad_token_id=PAD, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  directory = tmp_path_factory.mktemp("packed")
  paths = _write_corpus(directory)
  return paths, _olmo_core_dataset(paths, directory / "work"), _ours(paths)


def _trimmed(doc_lens):
  return np.trim_zeros(np.asarray(doc_lens), "b").tolist()


def _check_row(rows, r, item, what):
  np.testing.assert_array_equal(rows.tokens[r], item["input_ids"].numpy(), err_msg=what)
  np.testing.assert_array_equal(rows.label_mask[r], item["label_mask"].numpy(), err_msg=what)
  assert _trimmed(rows.doc_lens[r]) == _trimmed(item["doc_lens"]), what


def test_same_instances_as_olmo_core(corpus):
  """Every instance: the same tokens, padding, label mask and document lengths, and the same
  count; the segments and positions agree with those lengths."""
  paths, theirs, ours = corpus
  assert len(ours) == len(theirs) > 100
  rows = ours.read(np.arange(len(ours)))
  for i in range(len(ours)):
    _check_row(rows, i, theirs[i], f"instance {i}")
  # The files' own order is not the packing order: the permutation and the groups matter.
  assert packing.source_order(13, 123) != list(range(13))
  assert [len(g) for g in packing.source_groups(13, 8)] == [8, 5]
  # What the corpus exercises: truncated documents, padding, length-1 documents, full rows.
  assert (rows.doc_lens == SEQ).any() and (~rows.label_mask).any() and (rows.doc_lens == 1).any()
  # Segments: documents 1, 2, ... in row order, padding PAD_SEGMENT; lengths are doc_lens.
  for r in range(len(ours)):
    lens = _trimmed(rows.doc_lens[r])
    padded = not rows.label_mask[r, -1]
    ids = np.repeat(np.arange(1, len(lens) + 1), lens)
    if padded:
      ids[-lens[-1]:] = packing.PAD_SEGMENT
    np.testing.assert_array_equal(rows.segment_ids[r], ids, err_msg=f"row {r}")
    assert (rows.segment_ids[r] == packing.PAD_SEGMENT).sum() == (~rows.label_mask[r]).sum()


@pytest.mark.seconds(2)
def test_fragments_like_olmo_core(tmp_path):
  """The other long-document strategy: no token dropped, long documents cut into pieces."""
  paths = _write_corpus(tmp_path)
  theirs = _olmo_core_dataset(paths, tmp_path / "work", "fragment")
  ours = _ours(paths, "fragment")
  assert len(ours) == len(theirs)
  rows = ours.read(np.arange(len(ours)))
  for i in range(len(ours)):
    _check_row(rows, i, theirs[i], f"instance {i}")
  assert len(ours) > len(_ours(paths))  # truncation dropped tokens that fragments keep


def test_positions_are_olmo_core_intra_document_rope(corpus):
  """Positions restart at 0 in each document (padding too): OLMo-core 3.0.0's RoPE with the
  batch's cumulative document lengths rotates each token by exactly that position."""
  _, _, ours = corpus
  padded = np.flatnonzero(~ours.read(np.arange(len(ours))).label_mask[:, -1])
  rows = ours.read(np.concatenate([np.arange(6), padded[-6:]]))  # full rows and padded ones
  assert (~rows.label_mask[-6:, -1]).all()
  cu = get_cumulative_document_lengths(torch.tensor(rows.doc_lens))
  rope = RotaryEmbedding(head_size=4, theta=10**8)  # frequencies 1 and 1e-4
  q = torch.zeros(12, 1, SEQ, 4)
  q[..., 1] = 1.0  # the slow pair only: its angle is 1e-4 x position
  rotated, _ = rope(q, q.clone(), cu_doc_lens=cu)
  angle = torch.atan2(rotated[:, 0, :, 3], rotated[:, 0, :, 1]).double().numpy()
  np.testing.assert_array_equal(np.rint(angle / 1e-4).astype(np.int32), rows.positions)


def test_padding_is_masked_from_the_loss_like_olmo_core(corpus):
  """The labels: OLMo-core's get_labels on its collated batch (targets that are padding and
  the last position ignored)."""
  _, theirs, ours = corpus
  picks = np.arange(0, len(ours), 7)
  batch = DataCollator(pad_token_id=PAD)([theirs[int(i)] for i in picks])
  rows = ours.read(picks)
  np.testing.assert_array_equal(rows.labels(ignore=-100), get_labels(batch).numpy())
  assert (rows.labels(-100)[:, :-1] == -100).any()


def test_best_fit_decreasing_by_hand():
  """Longest first into the tightest room that holds it; of equal rooms the bin that reached
  it first; a new bin when nothing fits. (First fit would put the 2 into bin 0's room of 3.)"""
  docs, bins = packing.best_fit_decreasing(np.array([2, 5, 3, 4, 3, 1]), 8)
  placed = [docs[bins[b]:bins[b + 1]].tolist() for b in range(len(bins) - 1)]
  assert placed == [[1, 2], [3, 4, 5], [0]]
  docs, bins = packing.best_fit_decreasing(np.array([6, 6, 1]), 8)
  assert [docs[bins[b]:bins[b + 1]].tolist() for b in range(2)] == [[0, 2], [1]]
  for lengths in (np.random.default_rng(s).integers(1, 65, 3000) for s in range(3)):
    theirs, order, _ = InstancePacker(64).pack_documents(
        np.stack([np.zeros_like(lengths), lengths], 1).astype(np.uint64))
    docs, bins = packing.best_fit_decreasing(lengths, 64)
    by_length = np.argsort(-1 * lengths.astype(np.int64))
    assert [by_length[b].tolist() for b in theirs] == [
        docs[bins[b]:bins[b + 1]].tolist() for b in range(len(bins) - 1)]


def _loader(dataset, world, rank, work_dir, seed=34521, global_batch=4):
  return NumpyDataLoaderBase.wrap_numpy_dataset(
      dataset, collator=DataCollator(pad_token_id=PAD), global_batch_size=global_batch * SEQ,
      work_dir=work_dir, seed=seed, dp_world_size=world, dp_rank=rank)


@pytest.mark.seconds(6)
def test_olmo_core_loader_order_over_packed_instances(corpus, tmp_path):
  """OLMo-core's loader shuffles packed instances as it shuffles FSL ones: GlobalOrder over the
  packed count, rank r taking rows r::W, at 1, 2 and 4 ranks; epoch 2 from its start; and a
  run of 1 rank resumed at 2 ranks after 3 steps continues with the same rows."""
  _, theirs, ours = corpus
  global_batch = 4
  order = GlobalOrder(len(ours), global_batch, seed=34521)
  per_epoch = order.batches_per_epoch
  for world in (1, 2, 4):
    for rank in range(world):
      loader = _loader(theirs, world, rank, tmp_path / f"w{world}.{rank}")
      assert loader.total_batches == per_epoch
      for epoch in (1, 2):
        loader.reshuffle(epoch=epoch)
        steps = range(per_epoch) if world == 1 else range(per_epoch - 2, per_epoch)
        batches = list(loader)  # the whole epoch: its last step too
        assert len(batches) == per_epoch
        for s in steps:
          step = (epoch - 1) * per_epoch + s
          rows = ours.read(order.batch(step)[rank::world])
          for r in range(global_batch // world):
            item = {k: batches[s][k][r] for k in ("input_ids", "label_mask", "doc_lens")}
            _check_row(rows, r, item, f"world {world} rank {rank} step {step} row {r}")
        loader.reset()
  first = _loader(theirs, 1, 0, tmp_path / "r")
  first.reshuffle(epoch=1)
  for _, _ in zip(range(3), first):
    pass
  for rank in range(2):
    resumed = _loader(theirs, 2, rank, tmp_path / "r")
    resumed.load_state_dict(first.state_dict())
    resumed.reshuffle(epoch=1)
    batches = list(resumed)
    assert len(batches) == per_epoch - 3
    for step, batch in enumerate(batches, start=3):
      rows = ours.read(order.batch(step)[rank::2])
      np.testing.assert_array_equal(rows.tokens, batch["input_ids"].numpy(),
                                    err_msg=f"resumed step {step} rank {rank}")


def test_index_saved_and_loaded(corpus, tmp_path):
  paths, _, ours = corpus
  index = ours.index
  index.save(tmp_path / "index.npz")
  again = packing.PackedIndex.load(tmp_path / "index.npz", index.key)
  for name in ("instance_offsets", "doc_file", "doc_start", "doc_len", "group_offsets"):
    np.testing.assert_array_equal(getattr(again, name), getattr(index, name))
  assert again.paths == index.paths and len(again) == len(index)
  other = dict(index.key, source_permutation_seed=124)
  assert packing.PackedIndex.load(tmp_path / "index.npz", other) is None
  assert packing.PackedIndex.load(tmp_path / "missing.npz") is None


def test_cut_file_is_one_error(tmp_path):
  paths = _write_corpus(tmp_path)
  ours = _ours(paths)
  file, start, n = ours.spans(0)[0]
  tokens.write_token_file(paths[file], np.zeros(start + n - 1, np.uint32))
  with pytest.raises(tokens.DataError, match="cut short"):
    ours.read([0])


def test_a_source_group_without_documents_packs_like_olmo_core(corpus, tmp_path):
  """File 7 holds no EOS: packed one file per group, its group has no document and the next
  groups' instances are numbered on (the running count was read from the empty group's
  offsets: a bare IndexError)."""
  paths = corpus[0]
  config = NumpyPackedFSLDatasetConfig(
      paths=paths, tokenizer=TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS,
                                             pad_token_id=PAD),
      dtype="uint32", sequence_length=SEQ, generate_doc_lengths=True, source_group_size=1,
      work_dir=str(tmp_path / "work"))
  theirs = config.build()
  for group in theirs._source_path_groups:
    theirs._pack_documents_from_source_into_instances(*group)
  theirs.prepare()
  index = packing.PackedIndex.build(paths, seq_len=SEQ, eos_token_id=EOS, source_group_size=1)
  ours = packing.PackedInstances(index, pad_token_id=PAD, vocab_size=VOCAB)
  assert len(ours) == len(theirs)
  assert index.group_offsets[7] == index.group_offsets[8]  # file 7's group: no instance
  rows = ours.read(range(len(ours)))
  for i in range(len(ours)):
    _check_row(rows, i, theirs[i], f"instance {i}")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "inconsistent"])
def test_a_damaged_cached_index_is_built_again(corpus, tmp_path, damage):
  """The cache file of a packed index, cut short, overwritten with bytes of its size, or a
  well-formed archive whose offsets describe no packing, is built again (the same digest) and
  written over, never trusted nor a bare traceback in every launch."""
  paths = corpus[0]
  settings = dict(seq_len=SEQ, eos_token_id=EOS, source_group_size=8,
                  source_permutation_seed=123)
  built = packing.cached_index(paths, tmp_path, **settings)
  (cached,) = tmp_path.glob("packed-*.npz")
  data = cached.read_bytes()
  if damage == "truncated":
    cached.write_bytes(data[:len(data) // 2])
  elif damage == "garbage":
    cached.write_bytes(np.random.default_rng(0).bytes(len(data)))
  else:
    broken = dataclasses.replace(built, instance_offsets=built.instance_offsets[::-1].copy())
    broken.save(cached)
  again = packing.cached_index(paths, tmp_path, **settings)
  assert again.digest == built.digest
  assert packing.PackedIndex.load(cached, built.key).digest == built.digest  # written over
