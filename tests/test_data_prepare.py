import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from olmo3.data import embedded, prepare, tokens
from olmo3.data.heldout import HeldoutDocs
from olmo3.loss import IGNORE
from olmo3.data.tokens import DataError


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
  texts = [f"document number {i} says hello world {i * 7}" for i in range(200)]
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  embedded.train_tokenizer(texts, vocab_size=300).save(str(path))
  return str(path)


def _inputs(directory):
  texts = [f"document {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(60)]
  (directory / "a.txt").write_text(texts[0])
  with open(directory / "b.jsonl", "w") as f:
    for t in texts[1:20]:
      f.write(json.dumps({"text": t, "id": 1}) + "\n")
  with gzip.open(directory / "c.jsonl.gz", "wt") as f:
    for t in texts[20:40]:
      f.write(json.dumps({"text": t}) + "\n")
  pq.write_table(pa.table({"text": texts[40:]}), directory / "d.parquet")
  return texts, [str(directory / n) for n in ("a.txt", "b.jsonl", "c.jsonl.gz", "d.parquet")]


def _read_docs(out, manifest, split, eos):
  docs = []
  for f in manifest.files(out, split):
    data = np.fromfile(f, dtype="<u4")
    cuts = np.flatnonzero(data == eos) + 1
    docs.extend(np.split(data, cuts)[:-1])
  return docs


def test_prepare_all_formats_split_by_document(tmp_path, tokenizer_file):
  texts, inputs = _inputs(tmp_path)
  manifest = prepare.prepare(inputs, tokenizer_file, str(tmp_path / "out"), 0.3, progress=False)
  assert manifest.splits["train"]["documents"] + manifest.splits["heldout"]["documents"] == 60
  assert 5 < manifest.splits["heldout"]["documents"] < 30
  assert manifest.vocab_size == 300 and manifest.eos_id == 0
  tok = prepare.load_tokenizer(tokenizer_file)
  train = _read_docs(tmp_path / "out", manifest, "train", 0)
  held = _read_docs(tmp_path / "out", manifest, "heldout", 0)
  decoded = {tok.decode(d[:-1].tolist()) for d in train} | {tok.decode(d[:-1].tolist()) for d in held}
  assert decoded == set(texts)  # every document once, EOS-terminated, in one split only
  assert sum(map(len, train)) == manifest.splits["train"]["tokens"]
  held_texts = {tok.decode(d[:-1].tolist()) for d in held}
  assert held_texts == {t for t in texts if prepare.is_heldout(t, 0.3)}


def test_prepare_is_deterministic_across_runs_and_workers(tmp_path, tokenizer_file):
  _, inputs = _inputs(tmp_path)
  prepare.prepare(inputs, tokenizer_file, str(tmp_path / "one"), 0.2, workers=1, progress=False)
  prepare.prepare(inputs, tokenizer_file, str(tmp_path / "two"), 0.2, workers=2, progress=False)
  prepare.prepare(inputs, tokenizer_file, str(tmp_path / "one"), 0.2, workers=1, progress=False)
  for root, _, names in os.walk(tmp_path / "one"):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), tmp_path / "one")
      assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes(), rel


def test_interrupted_prepare_leaves_no_manifest_to_partial_files(tmp_path, tokenizer_file,
                                                                 monkeypatch):
  _, inputs = _inputs(tmp_path)
  out = tmp_path / "out"
  monkeypatch.setattr(prepare, "TOKENS_PER_FILE", 50)  # many part files

  calls = {"n": 0}
  real_write = prepare.write_token_file

  def crash_on_third(path, data):
    calls["n"] += 1
    if calls["n"] == 3:
      raise KeyboardInterrupt
    real_write(path, data)

  monkeypatch.setattr(prepare, "write_token_file", crash_on_third)
  with pytest.raises(KeyboardInterrupt):
    prepare.prepare(inputs, tokenizer_file, str(out), 0.2, progress=False)
  assert not (out / "manifest.json").exists()
  assert sorted(os.listdir(out)) == []  # the staging directory is gone too
  monkeypatch.setattr(prepare, "write_token_file", real_write)
  manifest = prepare.prepare(inputs, tokenizer_file, str(out), 0.2, progress=False)
  for split in prepare.SPLITS:
    for f in manifest.files(out, split):
      assert os.path.getsize(f) > 0


def test_a_token_file_shorter_than_its_manifest_says_is_refused(tmp_path, tokenizer_file,
                                                                  monkeypatch):
  _, inputs = _inputs(tmp_path)
  out = tmp_path / "out"
  monkeypatch.setattr(prepare, "TOKENS_PER_FILE", 200)  # several part files
  manifest = prepare.prepare(inputs, tokenizer_file, str(out), 0.0, progress=False)
  victim = manifest.files(out, "train")[1]
  data = np.fromfile(victim, dtype="<u4")
  tokens.write_token_file(victim, data[:-10])
  with pytest.raises(DataError, match=rf"token file {victim} holds {len(data) - 10} tokens; "
                                      rf".*manifest.json says {len(data)}"):
    prepare.Manifest.load(out)
  record = json.loads((out / "manifest.json").read_text())
  del record["splits"]["train"]["file_tokens"]  # as manifests written before it was recorded
  (out / "manifest.json").write_text(json.dumps(record))
  with pytest.raises(DataError, match=r"the train files of .* hold \d+ tokens; it says"):
    prepare.Manifest.load(out)
  for broken in ('{"splits": {', '{"splits": {}, "vocab_size": 3}', "[]"):  # torn or foreign
    (out / "manifest.json").write_text(broken)
    with pytest.raises(DataError, match=r"manifest\.json is not a readable manifest"):
      prepare.Manifest.load(out)


def test_prepare_cli_and_bad_input(tmp_path, tokenizer_file):
  _, inputs = _inputs(tmp_path)
  cmd = [sys.executable, "-m", "olmo3.data.prepare", "--tokenizer", tokenizer_file,
         "--out", str(tmp_path / "out"), "--heldout_fraction", "0.1"]
  done = subprocess.run(cmd + [a for i in inputs for a in ("--input", i)], capture_output=True,
                        text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert "train:" in done.stdout and "manifest.json" in done.stdout
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n{"title": "no text"}\n')
  with pytest.raises(DataError, match=r"bad\.jsonl:2: no string field 'text'"):
    prepare.prepare([str(bad)], tokenizer_file, str(tmp_path / "o2"), progress=False)
  with pytest.raises(DataError, match=r"--input '.*nothing\*' matches no file"):
    prepare.prepare([str(tmp_path / "nothing*")], tokenizer_file, str(tmp_path / "o3"))


def test_heldout_docs_are_padded_and_masked(tmp_path):
  tokens.write_token_file(tmp_path / "h.npy", np.array([5, 6, 7, 0, 8, 9, 10, 11, 12, 13, 0]))
  docs = HeldoutDocs([tmp_path / "h.npy"], seq_len=5, eos_id=0, pad_id=1)
  assert len(docs) == 2
  ids, labels = docs[0]
  assert ids.tolist() == [5, 6, 7, 0, 1] and labels.tolist() == [6, 7, 0, IGNORE, IGNORE]
  ids, labels = docs[1]  # truncated to seq_len
  assert ids.tolist() == [8, 9, 10, 11, 12] and labels.tolist() == [9, 10, 11, 12, IGNORE]
  batches = list(docs.batches(3))
  assert len(batches) == 1 and (batches[0]["labels"][2] == IGNORE).all()


def test_embedded_corpus(tmp_path, monkeypatch):
  monkeypatch.setenv("OLMO3_CACHE", str(tmp_path))
  out = embedded.corpus_dir()
  manifest = prepare.Manifest.load(out)
  assert manifest.vocab_size == 8192 and manifest.eos_id == 0
  assert manifest.splits["train"]["tokens"] > 2_000_000
  assert manifest.splits["heldout"]["documents"] > 10
  assert embedded.corpus_dir() == out  # cached
  names = [n for n, _ in embedded.documents()]
  assert any(n.startswith("pydoc:") for n in names) and "json/decoder.py" in names
  assert not any("/test/" in f"/{n}" or n.startswith("test/") for n in names)
