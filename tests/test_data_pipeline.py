import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3.config import DataConfig, RepetitionFilter
from olmo3.data import pipeline, sources, tokens
from olmo3.data.tokens import DataError
from olmo3.loss import IGNORE, lm_loss, token_nll

from data_helpers import batch_sharding, write_files


def _cfg(paths, **kw):
  # Single instances shuffled unless asked (these files are far shorter than 8192 tokens).
  return DataConfig(paths=tuple(paths), seq_len=kw.pop("seq_len", 16),
                    max_target_seq_len=kw.pop("max_target_seq_len", None),
                    global_batch_size=kw.pop("global_batch_size", 8), seed=kw.pop("seed", 3),
                    **kw)


def _global_batches(cfg, sharding, start, steps, **kw):
  loader = pipeline.Loader(cfg, sharding, start_step=start, num_steps=steps, vocab_size=100, **kw)
  return [{k: np.asarray(v) for k, v in b.items()} for b in loader]  # the exit training reads


def test_instances_never_span_files_and_tails_are_dropped(tmp_path):
  paths = write_files(tmp_path, [35, 16, 50])
  source = tokens.TokenFiles(paths, seq_len=16)
  assert len(source) == 2 + 1 + 3
  assert source.locate(2) == (1, 0) and source.locate(5) == (2, 32)
  raw = np.fromfile(paths[2], dtype="<u4")
  np.testing.assert_array_equal(source[5], raw[32:48])


def test_same_global_batches_on_any_device_count_and_resume(tmp_path):
  cfg = _cfg(write_files(tmp_path, [1000, 333, 2050]))
  one = _global_batches(cfg, batch_sharding(1), 0, 12)
  eight = _global_batches(cfg, batch_sharding(8, {"data": 2, "fsdp": 4}), 0, 12)
  resumed = _global_batches(cfg, batch_sharding(2), 7, 5)  # resize and resume at step 7
  for a, b in zip(one, eight):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  for a, b in zip(one[7:], resumed):
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])


def test_each_device_holds_its_own_rows(tmp_path):
  cfg = _cfg(write_files(tmp_path, [3000]))
  sharding = batch_sharding(8, {"data": 2, "fsdp": 4})
  loader = pipeline.Loader(cfg, sharding, start_step=0, num_steps=1, vocab_size=100)
  batch = next(iter(loader))
  expected = np.stack([loader.source[i] for i in loader.order.batch(0)])
  for shard in batch["input_ids"].addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
    assert shard.data.shape == (1, 16)


def test_device_prefetch_keeps_the_loaders_order(tmp_path):
  cfg = _cfg(write_files(tmp_path, [3000]))
  sharding = batch_sharding(8, {"data": 2, "fsdp": 4})
  plain = _global_batches(cfg, sharding, 3, 6)
  loader = pipeline.Loader(cfg, sharding, start_step=3, num_steps=6, vocab_size=100)
  with pipeline.DevicePrefetch(iter(loader), depth=2) as batches:
    ahead = list(batches)
    assert next(batches, None) is None  # stays exhausted
  assert len(ahead) == len(plain)
  for a, b in zip(plain, ahead):
    assert b["input_ids"].sharding == sharding  # already global arrays on the devices
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], np.asarray(b[key]))


def test_device_prefetch_raises_a_read_error_where_the_batch_would_be():
  def batches():
    yield from ({"x": i} for i in range(3))
    raise DataError("batch 3 is unreadable")

  prefetch = pipeline.DevicePrefetch(batches(), depth=2)
  assert [b["x"] for b in itertools.islice(prefetch, 3)] == [0, 1, 2]
  with pytest.raises(DataError, match="batch 3 is unreadable"):
    next(prefetch)
  prefetch.close()
  assert not prefetch._thread.is_alive()


def test_device_prefetch_stops_its_thread_when_the_consumer_stops_early():
  read, closed = [], []

  def endless():
    try:
      for i in itertools.count():
        read.append(i)
        yield {"x": i}
    finally:
      closed.append(True)  # the thread closes the iterator it ran

  with pytest.raises(RuntimeError, match="the loop stopped"):
    with pipeline.DevicePrefetch(endless(), depth=3) as prefetch:
      assert [next(prefetch)["x"] for _ in range(2)] == [0, 1]
      raise RuntimeError("the loop stopped")
  assert not prefetch._thread.is_alive() and closed == [True]
  assert len(read) <= 2 + 3  # never more than `depth` batches ahead of the consumer


def test_labels_shift_left_and_repetitive_instances_are_masked(tmp_path):
  rng = np.random.default_rng(0)
  instances = [rng.integers(2, 100, 64) for _ in range(4)]
  instances[2][:] = 7  # 64 repetitions of period 1
  path = tmp_path / "f.npy"
  tokens.write_token_file(path, np.concatenate(instances))
  cfg = _cfg([path], seq_len=64, global_batch_size=4, repetition_filter=RepetitionFilter())
  batch = _global_batches(cfg, batch_sharding(1), 0, 1)[0]
  # The exit marks the masked instance: the loss divisor still counts its tokens.
  assert batch["filtered"].tolist() == [bool((ids == 7).all()) for ids in batch["input_ids"]]
  assert batch["filtered"].sum() == 1
  for ids, labels in zip(batch["input_ids"], batch["labels"]):
    if (ids == 7).all():
      assert (labels == IGNORE).all()  # masked, but keeps its slot in the batch
    else:
      np.testing.assert_array_equal(labels[:-1], ids[1:])
      assert labels[-1] == IGNORE
  host = next(pipeline.Loader(cfg, batch_sharding(1), start_step=0, num_steps=1,
                              vocab_size=100).host_batches())
  assert sorted(host["instance"]) == [0, 1, 2, 3]  # the audit metadata, kept on the host
  np.testing.assert_array_equal(host["input_ids"], batch["input_ids"])


def test_all_masked_batch_gives_zero_loss_not_nan():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 11)), jnp.float32)
  loss, metrics = lm_loss(token_nll(logits, jnp.full((2, 5), -1)), z_loss_weight=1e-5)
  assert float(loss) == 0.0 and int(metrics["tokens"]) == 0
  grads = jax.grad(lambda x: lm_loss(token_nll(x, jnp.full((2, 5), -1)), 1e-5)[0])(logits)
  assert np.isfinite(np.asarray(grads)).all()


@pytest.mark.slow(seconds=3)
def test_grain_worker_processes_give_the_same_batches(tmp_path):
  cfg = _cfg(write_files(tmp_path, [2000, 900]))
  plain = _global_batches(cfg, batch_sharding(2), 0, 6)
  workers = _global_batches(cfg.replace(num_workers=2), batch_sharding(2), 0, 6)
  for a, b in zip(plain, workers):
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])


def test_mix_files_resolve_against_a_root(tmp_path):
  paths = write_files(tmp_path, [100, 200])
  mix = tmp_path / "mix.txt"
  mix.write_text("# a comment\n\n" + "".join(
      f"src,{os.path.basename(p).replace('000', '{TOKENIZER}')}\n" for p in paths))
  source = sources.token_files(DataConfig(mix=str(mix), root=str(tmp_path), seq_len=16,
                                           max_target_seq_len=None, tokenizer_id="000"),
                               vocab_size=100)
  assert [str(p) for p in source.paths] == paths


def test_mix_labels_reach_the_batch_as_sources(tmp_path):
  """Each instance's source is its file's mix label, as an index into the sorted labels; files
  given as `paths` form one source."""
  paths = write_files(tmp_path, [160, 320, 96])
  mix = tmp_path / "mix.txt"
  mix.write_text("web,000.npy\ncode,001.npy\nweb,002.npy\n")
  cfg = DataConfig(mix=str(mix), seq_len=16, max_target_seq_len=None, global_batch_size=8,
                   seed=3)
  loader = pipeline.Loader(cfg, batch_sharding(4), start_step=0, num_steps=4, vocab_size=100)
  assert loader.source.source_names == ("code", "web")
  label_of = ["web"] * 10 + ["code"] * 20 + ["web"] * 6  # instances 0-9, 10-29, 30-35
  sources_seen = set()
  for host, batch in zip(loader.host_batches(), loader):
    expected = [loader.source.source_names.index(label_of[i]) for i in host["instance"]]
    assert host["source"].tolist() == expected  # one process: its rows are the whole batch
    np.testing.assert_array_equal(np.asarray(batch["source"]), host["source"])
    assert batch["source"].dtype == np.int32
    sources_seen.update(expected)
  assert sources_seen == {0, 1}
  plain = tokens.TokenFiles(paths, seq_len=16)
  assert plain.source_names == (tokens.UNLABELLED,)
  assert plain.source_of(np.arange(len(plain))).tolist() == [0] * len(plain)


@pytest.mark.parametrize("setup, message", [
    (lambda d: (d / "f.npy").write_bytes(b"\x01\x00\x00\x00\x02\x00"), r"f\.npy has 6 bytes"),
    (lambda d: (d / "f.npy").write_bytes(b""), r"f\.npy is empty"),
    (lambda d: None, r"f\.npy does not exist"),
    (lambda d: tokens.write_token_file(d / "f.npy", np.array([1, 2, 100, 3] * 8)),
     r"f\.npy: token 100 at position 2 is >= the model's vocab_size 100"),
])
def test_bad_token_files_fail_at_startup_naming_the_file(tmp_path, setup, message):
  setup(tmp_path)
  with pytest.raises(DataError, match=message):
    pipeline.Loader(_cfg([tmp_path / "f.npy"], global_batch_size=1), batch_sharding(1),
                    start_step=0, num_steps=1, vocab_size=100)


def test_bad_mix_and_batch_fail_at_startup(tmp_path):
  mix = tmp_path / "mix.txt"
  mix.write_text("a,missing/{TOKENIZER}/000.npy\n")
  with pytest.raises(DataError, match=r"missing/x/000\.npy does not exist"):
    sources.token_files(DataConfig(mix=str(mix), tokenizer_id="x"), vocab_size=100)
  mix.write_text("no comma here\n")
  with pytest.raises(DataError, match=r"mix\.txt:1: expected 'label,path'"):
    sources.token_files(DataConfig(mix=str(mix)), vocab_size=100)
  with pytest.raises(DataError, match=r"DataConfig\.mix='nope'"):
    sources.token_files(DataConfig(mix="nope"), vocab_size=100)
  paths = write_files(tmp_path, [1000])
  with pytest.raises(DataError, match=r"global_batch_size=6 is not divisible by the "
                                      r"data-parallel size 4"):
    pipeline.Loader(_cfg(paths, global_batch_size=6), batch_sharding(4), start_step=0,
                    num_steps=1, vocab_size=100)
  (tmp_path / "small").mkdir()
  small = _cfg(write_files(tmp_path / "small", [40]), global_batch_size=4)  # 40 tokens: 2 rows
  with pytest.raises(DataError, match=(
      rf"^the training data holds 2 instance\(s\) of DataConfig.seq_len={small.seq_len} tokens, "
      r"fewer than one global batch \(DataConfig.global_batch_size=4\): give more data")):
    pipeline.Loader(small, batch_sharding(1), start_step=0, num_steps=1, vocab_size=100)


_GRAIN_SCRIPT = """
import sys, grain
from absl.flags import _exceptions
from olmo3.data import grain_compat
ds = grain.MapDataset.range(4).to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=1))
try:
  list(ds)
  print("grain no longer needs the workaround")
except _exceptions.UnparsedFlagAccessError:
  print("unparsed flags fail")
grain_compat.ensure_flags_parsed()
print(list(ds))
"""


@pytest.mark.slow(seconds=4)
def test_grain_workers_run_in_a_program_that_never_parsed_absl_flags():
  """Why olmo3.data.grain_compat exists; when the first line changes, delete the workaround."""
  import subprocess
  import sys

  done = subprocess.run([sys.executable, "-c", _GRAIN_SCRIPT], capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.splitlines() == ["unparsed flags fail", "[0, 1, 2, 3]"]


def test_a_token_file_cut_short_after_it_was_counted_is_an_error_not_a_crash(tmp_path):
  """Reading a memory map past the end of a file cut short since kills the process (SIGBUS):
  each read checks the file still holds what was counted, and names it."""
  path = tmp_path / "t.npy"
  tokens.write_token_file(path, np.arange(10_000, dtype=np.uint32) % 1000)
  files = tokens.TokenFiles([path], 128, 1000, validate_tokens=True)
  assert files.read([70]).shape == (1, 128)  # mapped
  os.truncate(path, 4 * 1000)
  with pytest.raises(DataError, match=rf"token file {path} holds 1000 tokens; it held 10000 "
                                      "when this launch counted them: it was cut short"):
    files.read([70])
  os.remove(path)
  with pytest.raises(DataError, match=rf"token file {path} is gone; it held 10000"):
    files.read([0])


def _document_files(directory, n_files=5, eos=0, seed=0):
  """Token files of EOS-terminated documents of 3 to 60 tokens (ids 2..99)."""
  rng = np.random.default_rng(seed)
  paths = []
  for f in range(n_files):
    docs = [np.append(rng.integers(2, 100, rng.integers(3, 60)), eos) for _ in range(30)]
    path = directory / f"docs{f}.npy"
    tokens.write_token_file(path, np.concatenate(docs).astype(np.uint32))
    paths.append(str(path))
  return paths


def test_packed_instances_reach_the_step_with_their_documents(tmp_path):
  """DataConfig.packing: the step's batch carries segment ids; no label where the next token is
  padding nor at the end; every packed instance is read exactly once an epoch, whatever the
  devices, and a resume on another mesh continues the same sequence."""
  from olmo3.config import ModelConfig, Packing, olmo3_micro

  model = olmo3_micro()  # eos 0, pad 1
  cfg = _cfg(_document_files(tmp_path), seq_len=64, global_batch_size=4,
             packing=Packing(source_group_size=2))
  source = sources.token_files(cfg, model.vocab_size, model=model)
  steps = len(source) // 4
  one = _global_batches(cfg, batch_sharding(1), 0, steps, source=source)
  four = _global_batches(cfg, batch_sharding(4), 0, steps, source=source)
  resumed = _global_batches(cfg, batch_sharding(2), 2, steps - 2, source=source)
  for a, b in zip(one, four):
    assert a.keys() == b.keys() == set(pipeline.STEP_KEYS)
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  for a, b in zip(one[2:], resumed):
    np.testing.assert_array_equal(a["segments"], b["segments"])
  packed = source.read(np.arange(len(source)))
  seen = np.concatenate([b["input_ids"] for b in one])
  rows = {tuple(r) for r in packed.tokens}
  assert {tuple(r) for r in seen} <= rows and len(seen) == steps * 4  # each instance at most once
  loader = pipeline.Loader(cfg, batch_sharding(1), start_step=0, num_steps=steps, source=source)
  order = np.concatenate([loader.order.batch(s) for s in range(steps)])
  assert len(set(order.tolist())) == len(order)  # exactly once in the epoch
  for batch in one:
    pad = batch["segments"] == 0
    assert (batch["input_ids"][pad] == model.pad_token_id).all()
    assert (batch["labels"][:, :-1][pad[:, 1:]] == IGNORE).all()
    assert (batch["labels"][:, -1] == IGNORE).all()
    real = ~pad[:, 1:]
    np.testing.assert_array_equal(batch["labels"][:, :-1][real], batch["input_ids"][:, 1:][real])
  with pytest.raises(DataError, match="packing needs the model's eos_token_id"):
    sources.token_files(cfg, model.vocab_size, model=ModelConfig(eos_token_id=None))
