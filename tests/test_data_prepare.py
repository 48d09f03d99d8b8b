import dataclasses
import gzip
import json
import os
import pathlib
import re
import shlex

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import normalizers

from olmo3.data import embedded, overlap, prepare, sources, tokens
from olmo3.data import manifest as manifest_lib
from olmo3.data import tokenizer as tokenizer_lib
from olmo3.data.heldout import HeldoutDocs
from olmo3.loss import IGNORE
from olmo3.run.plan import RunPlan
from olmo3.data.tokens import DataError
from tests import forked
from tests.test_launch import TINY_FAST

ROOT_PATH = pathlib.Path(__file__).resolve().parent.parent
ROOT = str(ROOT_PATH)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
  texts = [f"document number {i} says hello world {i * 7}" for i in range(200)]
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  embedded.train_tokenizer(texts, vocab_size=300).save(str(path))
  return str(path)


def _texts(count: int, seed: int = 0) -> list[str]:
  """Documents of made-up words: no two share a run of words by chance (so prepare finds no
  held-out document in training)."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  word = lambda: "".join(rng.choice(letters, rng.integers(3, 8)))  # noqa: E731
  return [f"document {i}: " + " ".join(word() for _ in range(5 + i % 7 * 3))
          for i in range(count)]


def _inputs(directory):
  texts = _texts(60)
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
  tok = tokenizer_lib.load(tokenizer_file, what="--tokenizer")
  train = _read_docs(tmp_path / "out", manifest, "train", 0)
  held = _read_docs(tmp_path / "out", manifest, "heldout", 0)
  decoded = {tok.decode(d[:-1].tolist()) for d in train} | {tok.decode(d[:-1].tolist()) for d in held}
  assert decoded == set(texts)  # every document once, EOS-terminated, in one split only
  assert sum(map(len, train)) == manifest.splits["train"]["tokens"]
  held_texts = {tok.decode(d[:-1].tolist()) for d in held}
  assert held_texts == {t for t in texts if prepare.is_heldout(t, 0.3)}
  assert (manifest.overlap["checked"], manifest.overlap["moved"]) == (len(held), 0)


def test_a_held_out_document_copied_into_training_is_moved_there_and_named(tmp_path,
                                                                           tokenizer_file):
  """Two held-out documents the training split holds: one copied there with a word changed
  (another text, so split by its own hash), and a short one whose exact tokens a training
  document has (the tokenizer lowercases: two texts, the same tokens). prepare moves both to
  training, names them with their shares, and keeps the rest of the held-out split as hashed."""
  texts = _texts(80)
  held = [t for t in texts if prepare.is_heldout(t, 0.3)]
  original = max(held, key=len)
  words = original.split(" ")
  middle = len(words) // 2
  copy = next(c for c in (" ".join(words[:middle] + [f"changed{k}"] + words[middle + 1:])
                          for k in range(100)) if not prepare.is_heldout(c, 0.3))
  short = next(k for k in range(1000) if prepare.is_heldout(f"Note {k}", 0.3)
               and not prepare.is_heldout(f"note {k}", 0.3))
  docs = [*texts, copy, f"Note {short}", f"note {short}"]
  (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
  tok = tokenizer_lib.load(tokenizer_file, what="--tokenizer")
  tok.normalizer = normalizers.Lowercase()
  manifest = prepare.prepare([str(tmp_path / "docs.jsonl")], tok, str(tmp_path / "out"), 0.3,
                             progress=False)
  record = manifest.overlap
  assert (record["checked"], record["moved"]) == (len(held) + 1, 2)
  line = {t: f"{tmp_path / 'docs.jsonl'}:{i}" for i, t in enumerate(docs, start=1)}
  named = dict(record["moved_documents"])
  assert list(named) == [line[f"Note {short}"], line[original]]  # the highest share first
  assert named[line[f"Note {short}"]] == 1.0 and 0.5 <= named[line[original]] < 1.0
  assert record["max_share_kept"] < overlap.THRESHOLD
  train = _read_docs(tmp_path / "out", manifest, "train", 0)
  kept = _read_docs(tmp_path / "out", manifest, "heldout", 0)
  assert {tok.decode(d[:-1].tolist()) for d in kept} == set(held) - {original}
  # Moved after the training documents, in their order.
  assert [tok.decode(d[:-1].tolist()) for d in train[-2:]] == [original, f"note {short}"]
  assert len(train) + len(kept) == len(docs)

  # Every held-out document a near-copy of a training one: no held-out split would be left.
  only = [texts[0], next(c for c in (f"{texts[0]} changed{k}" for k in range(1000))
                         if prepare.is_heldout(c, 0.3) != prepare.is_heldout(texts[0], 0.3))]
  (tmp_path / "dup.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in only))
  with pytest.raises(DataError, match=r"dup\.jsonl'\]: every held-out document overlaps the "
                                      r"training documents and moved to them"):
    prepare.prepare([str(tmp_path / "dup.jsonl")], tok, str(tmp_path / "dup"), 0.3,
                    progress=False, heldout_min_documents=0)
  assert not (tmp_path / "dup" / manifest_lib.MANIFEST_FILE).exists()


@pytest.mark.slow(seconds=3)
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
  assert not out.exists()  # the staging directory is gone, and the --out it created
  monkeypatch.setattr(prepare, "write_token_file", real_write)
  manifest = prepare.prepare(inputs, tokenizer_file, str(out), 0.2, progress=False)
  for split in manifest_lib.SPLITS:
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
    manifest_lib.Manifest.load(out)
  record = json.loads((out / "manifest.json").read_text())
  del record["splits"]["train"]["file_tokens"]  # as manifests written before it was recorded
  (out / "manifest.json").write_text(json.dumps(record))
  with pytest.raises(DataError, match=r"the train files of .* hold \d+ tokens; it says"):
    manifest_lib.Manifest.load(out)
  for broken in ('{"splits": {', '{"splits": {}, "vocab_size": 3}', "[]"):  # torn or foreign
    (out / "manifest.json").write_text(broken)
    with pytest.raises(DataError, match=r"manifest\.json is not a readable manifest"):
      manifest_lib.Manifest.load(out)


# Entries that read as plain paths until percent-decoded, once or twice: an HTTP client
# normalises the first (aiohttp's yarl requests `mine/%2e%2e/secret.npy` as `/secret.npy`).
ESCAPES = ["%2e%2e/secret.npy", ".%2E/secret.npy", "train/%2e%2e/%2e%2e/secret.npy",
           "%2e%2e%2fsecret.npy", "%2e%2e%5csecret.npy", "train%5c..%5c..%5csecret.npy",
           "%252e%252e/secret.npy", "train/%2e/part-00000.npy", "train%2f%2fpart-00000.npy",
           "%2fsecret.npy",
           # Control characters beside dot segments: URL parsers drop tabs and newlines
           # anywhere and controls at the ends, so "..\t" is requested as "..".
           "..\t/secret.npy", "..\n/secret.npy", "..\r/secret.npy", "\t../secret.npy",
           "train/..\t/..\t/secret.npy", "%2e%2e%09/secret.npy", "train/part-00000.npy\x00"]


@pytest.mark.slow(seconds=4)
def test_percent_encoded_manifest_entries_cannot_leave_a_served_directory(tmp_path):
  """A prepared directory served over HTTP (olmo3.data.serve's RangeServer) whose manifest
  names a file outside it in percent-encoded spellings: each is refused, naming the manifest
  and the entry, before any file is read, and the launcher says so in one line. The served
  secret has the training file's size, so nothing but the check stands in the way."""
  import shutil

  from harness.storage_servers import InstrumentedRangeServer

  served = tmp_path / "served"
  shutil.copytree(embedded.corpus_dir(), served / "mine", ignore=shutil.ignore_patterns(".lock"))
  shutil.copy(served / "mine" / "train" / "part-00000.npy", served / "secret.npy")
  manifest = json.loads((served / "mine" / "manifest.json").read_text())
  assert manifest["splits"]["train"]["files"] == ["train/part-00000.npy"]

  def listing(entry):
    manifest["splits"]["train"]["files"] = [entry]
    (served / "mine" / "manifest.json").write_text(json.dumps(manifest))

  with InstrumentedRangeServer(os.fspath(served)) as server:
    url = f"{server.url}/mine"
    for entry in ESCAPES:
      listing(entry)
      with pytest.raises(DataError) as refused:
        manifest_lib.Manifest.load(url)
      assert str(refused.value).startswith(
          f"{url}/manifest.json: file {entry!r} of split 'train' is not a plain path inside its "
          "directory"), (entry, str(refused.value))
    listing(ESCAPES[0])
    done = forked.completed("main", ["--fdl_config=experiments.olmo3_tiny:stage1",
                                     f"--fdl_set=data.mix='{url}'", *TINY_FAST,
                                     f"--workdir={tmp_path / 'run'}"],
                            {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {url}/manifest.json: file '%2e%2e/secret.npy' of split 'train' is not a plain "
        "path inside its directory (no absolute path, URL, '.', '..' or control character, "
        "plain or percent-encoded); the manifest was not written by olmo3.data.prepare or was edited")
    assert server.get_requests("secret.npy") == 0  # never read
    listing("train/part-00000.npy")  # the manifest as prepared still loads
    assert manifest_lib.Manifest.load(url).files(url, "train") == [f"{url}/train/part-00000.npy"]
  assert not (tmp_path / "run").exists()


def test_prepare_never_removes_files_it_did_not_write(tmp_path, tokenizer_file):
  """`--out DIR` whose train/ or heldout/ holds a file no earlier preparation wrote (its
  manifest does not list it): refused before anything is written, the file kept; a directory
  an earlier prepare wrote is prepared again in place."""
  _, inputs = _inputs(tmp_path)
  out = tmp_path / "out"
  prepare.prepare(inputs, tokenizer_file, str(out), 0.2, progress=False)
  before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
  stray = out / "heldout" / "notes.txt"
  stray.write_text("mine")
  with pytest.raises(DataError, match=(
      rf"^--out {re.escape(str(out))}: {re.escape(str(stray))} was not written by an earlier "
      r"prepare \(no manifest\.json there lists it\), and prepare replaces heldout/ whole")):
    prepare.prepare(inputs, tokenizer_file, str(out), 0.2, progress=False)
  assert stray.read_text() == "mine" and all(p.read_bytes() == b for p, b in before.items())
  stray.unlink()
  prepare.prepare(inputs, tokenizer_file, str(out), 0.3, progress=False)  # its own: replaced
  (out / "manifest.json").unlink()  # files no manifest vouches for are nobody's to remove
  with pytest.raises(DataError, match="was not written by an earlier prepare"):
    prepare.prepare(inputs, tokenizer_file, str(out), 0.2, progress=False)


@pytest.mark.slow(seconds=3)
def test_prepare_cli_and_bad_input(tmp_path, tokenizer_file):
  _, inputs = _inputs(tmp_path)
  cmd = ["--tokenizer", tokenizer_file, "--out", str(tmp_path / "out"), "--heldout_fraction",
         "0.1"]
  done = forked.completed("olmo3.data.prepare", cmd + [a for i in inputs for a in ("--input", i)],
                          dict(os.environ), timeout=120)
  assert done.returncode == 0, done.stderr
  assert "train:" in done.stdout and "manifest.json" in done.stdout
  assert "held-out check: none of the" in done.stdout  # its held-out documents are not in train
  # An input inside the output's train/ (which prepare replaces whole): refused, kept.
  own = tmp_path / "own"
  (own / "train").mkdir(parents=True)
  mine = own / "train" / "mine.jsonl"
  mine.write_text('{"text": "a document of mine"}\n')
  done = forked.completed("olmo3.data.prepare", ["--tokenizer", tokenizer_file, "--out",
                                                 str(own), "--input", str(mine)],
                          dict(os.environ), timeout=120)
  assert done.returncode == 2 and done.stderr.strip().splitlines() == [
      f"error: --input {mine} lies in --out {own}'s train/, which prepare replaces whole: move "
      "the input elsewhere or choose another --out"], done.stderr
  assert mine.exists() and sorted(os.listdir(own)) == ["train"]
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
  batch = docs.rows([0, 1], docs.seq_len, 3)
  ids, labels = batch["input_ids"][0], batch["labels"][0]
  assert ids.tolist() == [5, 6, 7, 0, 1] and labels.tolist() == [6, 7, 0, IGNORE, IGNORE]
  ids, labels = batch["input_ids"][1], batch["labels"][1]  # truncated to seq_len
  assert ids.tolist() == [8, 9, 10, 11, 12] and labels.tolist() == [9, 10, 11, 12, IGNORE]
  assert (batch["labels"][2] == IGNORE).all()  # a row past the documents: masked
  assert docs.lengths.tolist() == [4, 5]


@pytest.mark.seconds(12)
def test_embedded_corpus():
  # The machine's corpus, as every run finds it: built by whichever test (or launch) of the
  # session asked first, the others waiting on its lock (a fresh clone's CI builds it once).
  out = embedded.corpus_dir()
  manifest = manifest_lib.Manifest.load(out)
  assert manifest.vocab_size == 8192 and manifest.eos_id == 0
  assert manifest.splits["train"]["tokens"] > 2_000_000
  assert manifest.splits["heldout"]["documents"] > 10
  # Its held-out split is disjoint from training (the standard library holds near-copies:
  # codecs made from one template, the same text under two pydoc topics): what prepare moved
  # is named, and what it kept is below the threshold (tests/test_data_overlap.py audits it).
  record = manifest.overlap
  assert record["checked"] == record["moved"] + manifest.splits["heldout"]["documents"]
  assert len(record["moved_documents"]) == record["moved"]
  assert record["max_share_kept"] < overlap.THRESHOLD
  assert embedded.corpus_dir() == out  # cached
  names = [n for n, _ in embedded.documents()]
  assert any(n.startswith("pydoc:") for n in names) and "json/decoder.py" in names
  assert not any("/test/" in f"/{n}" or n.startswith("test/") for n in names)


def _tiny(mix, **eval_changes):
  """The tiny stage 1 on data.mix=`mix` (the one override a user gives), eval as changed."""
  import fiddle as fdl

  from experiments import olmo3_tiny

  exp = fdl.build(olmo3_tiny.stage1())
  found = sources.prepared(str(mix))  # a prepared directory's tokenizer is the model's
  model = exp.model if found is None else exp.model.replace(vocab_size=found.manifest.vocab_size)
  return dataclasses.replace(exp, data=exp.data.replace(mix=str(mix)), model=model,
                             eval=dataclasses.replace(exp.eval, **eval_changes))


def test_a_prepared_directory_is_a_mix_with_its_heldout_split_and_tokenizer(tmp_path,
                                                                           tokenizer_file):
  _, inputs = _inputs(tmp_path)
  mine = tmp_path / "mine"
  manifest = prepare.prepare(inputs, tokenizer_file, str(mine), 0.3, progress=False)
  assert (tokenizer_lib.load(str(mine / "tokenizer.json"), what="--tokenizer").to_str()
          == tokenizer_lib.load(tokenizer_file, what="--tokenizer").to_str())  # the tokenizer travels along
  def paths(files):
    return [os.fspath(p) for p in files]

  train = sources.read_mix(str(mine))
  assert paths(f.path for f in train) == paths(manifest.files(mine, "train"))
  assert {f.label for f in train} == {"mine"}  # the directory's name labels the source
  assert paths(f.path for f in sources.read_mix(str(mine / "heldout"))) == paths(
      manifest.files(mine, "heldout"))
  exp = sources.resolve(_tiny(mine)).exp  # eval.heldout / eval.tokenizer None: from the data
  assert exp.eval.heldout == (str(mine / "heldout"),)
  assert exp.eval.tokenizer == str(mine / "tokenizer.json")
  assert sources.resolve(exp).exp == exp  # idempotent
  # A prepared directory named as a held-out set means its held-out split.
  assert sources.resolve(_tiny(mine, heldout=(str(mine),))).exp.eval.heldout == (
      str(mine / "heldout"),)
  plan = RunPlan.build(_tiny(mine), str(tmp_path / "run"))  # what --dry_run prints
  lines = plan.describe()
  assert plan.exp == exp and f"training data       {mine}: train split, 1 files" in lines
  assert f"task tokenizer      {mine / 'tokenizer.json'}" in lines
  # The built-in corpus resolves the same way, to its own split and tokenizer.
  builtin = sources.resolve(_tiny("embedded")).exp
  assert builtin.eval.heldout == ("embedded-heldout",) and builtin.eval.tokenizer == "embedded"
  # No held-out documents: no held-out set (and no error).
  bare = prepare.prepare(inputs, tokenizer_file, str(tmp_path / "bare"), 0.0, progress=False)
  assert bare.splits["heldout"]["documents"] == 0
  assert sources.resolve(_tiny(tmp_path / "bare")).exp.eval.heldout == ()


def test_held_out_sets_and_tokenizers_that_do_not_match_the_training_data_are_refused(
    tmp_path, tokenizer_file):
  _, inputs = _inputs(tmp_path)
  mine, other = tmp_path / "mine", tmp_path / "other"
  prepare.prepare(inputs, tokenizer_file, str(mine), 0.3, progress=False)
  other_tok = tmp_path / "other.json"
  embedded.train_tokenizer([f"other words {i}" for i in range(100)], 280).save(str(other_tok))
  prepare.prepare(inputs, str(other_tok), str(other), 0.3, progress=False)
  refusals = {
      (str(other),): rf"EvalConfig.heldout='{other}/heldout' was tokenized with "
                     rf"{other}/tokenizer.json, the training data \({mine}\) with "
                     rf"{mine}/tokenizer.json",
      (str(mine / "train" / "part-00000.npy"),): r"EvalConfig.heldout='.*part-00000.npy' is a "
                                                 r"binary file \(a token file\?\): expected a mix",
      (str(mine / "train"),): r"EvalConfig.heldout='.*/mine/train' lists a training file",
      (str(tmp_path),): r"EvalConfig.heldout='.*' is a directory without manifest.json",
  }
  for heldout, message in refusals.items():
    with pytest.raises(DataError, match=message):
      sources.resolve(_tiny(mine, heldout=heldout))
  with pytest.raises(DataError, match=rf"EvalConfig.tokenizer='{other_tok}' is not the tokenizer "
                                      rf"of the training data \({mine}/tokenizer.json"):
    sources.resolve(_tiny(mine, tokenizer=str(other_tok)))
  # The same tokenizer under another name (the file prepare was given) is accepted.
  assert sources.resolve(_tiny(mine, tokenizer=tokenizer_file)).exp.eval.tokenizer == tokenizer_file
  exp = _tiny(mine)
  with pytest.raises(DataError, match=r"mine/manifest.json: its documents end with EOS id 0 .*"
                                      r"but ModelConfig.eos_token_id=5"):
    sources.resolve(dataclasses.replace(exp, model=dataclasses.replace(exp.model,
                                                                       eos_token_id=5)))
  for vocab, side in ((8192, "fewer"), (299, "more")):  # the tiny model's 8,192; one short
    with pytest.raises(DataError, match=(
        rf"mine/manifest.json: its tokenizer has 300 tokens, {side} than "
        rf"ModelConfig.vocab_size={vocab}: set model.vocab_size")):
      sources.resolve(dataclasses.replace(exp, model=exp.model.replace(vocab_size=vocab)))
  with pytest.raises(DataError, match=r"EvalConfig.tokenizer=None takes the tokenizer of the "
                                      r"training data's prepared directory"):
    sources.resolve(dataclasses.replace(exp, data=exp.data.replace(mix=None, paths=("x.npy",))))


@pytest.mark.slow(seconds=22)
def test_own_jsonl_prepare_train_eval_with_one_override(tmp_path):
  """A user's JSONL: prepare (CLI) -> train with --fdl_set=data.mix='"DIR"' (the run made
  short) -> python -m olmo3.eval. Held-out set and tokenizer come from the manifest; the log
  shows the run's progress and no third-party INFO (nor TPU probing: JAX_PLATFORMS unset)."""
  with open(tmp_path / "docs.jsonl", "w") as f:
    for i in range(300):
      f.write(json.dumps({"text": f"Note {i}: the river {i % 17} runs past {i * 3} mills. " * 9})
              + "\n")
  mine, run = tmp_path / "mine", tmp_path / "run"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  done = forked.completed(
      "olmo3.data.prepare", ["--input", str(tmp_path / "docs.jsonl"), "--tokenizer",
                             sources.tokenizer_file("embedded"), "--out", str(mine),
                             "--heldout_fraction", "0.1"], env, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  done = forked.completed(
      # test_launch's tiny shapes: the session's compilation cache serves both
      "main", ["--fdl_config=experiments.olmo3_tiny:stage1", f"--fdl_set=data.mix='{mine}'",
               f"--workdir={run}", "--fdl_set=train.steps=2", "--fdl_set=eval.tasks=()",
               *TINY_FAST], env, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  experiment = json.loads((run / "experiment.json").read_text())["eval"]
  assert experiment["heldout"] == [str(mine / "heldout")]
  assert experiment["tokenizer"] == str(mine / "tokenizer.json")
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  in_loop = [r["eval/mine/ce_loss"] for r in rows if "eval/mine/ce_loss" in r]
  assert len(in_loop) == 1 and "train/mine/ce_loss" in rows[0]
  # The log: our progress lines, from the first step to the save; only our own INFO lines.
  log = done.stderr
  for line in ("preparing evaluation: held-out", "training data: 1 files, sources ['mine']",
               "compiling the train step", "step 2/2: loss", "evaluating at step 2",
               "step 2 held-out: mine CE", "saving the checkpoint of step 2"):
    assert line in log, line
  ours = {p.name for d in ("olmo3", "launch", "experiments")
          for p in (ROOT_PATH / d).rglob("*.py")}
  info = re.findall(r"^I\d{4} [\d:.]+ +\d+ ([\w.]+):\d+\]", log, re.MULTILINE)
  assert info and set(info) <= ours, sorted(set(info) - ours)
  for noise in ("orbax", "checkpoint_manager", "xla_bridge", "libtpu", "TPU", "PyTorch version"):
    assert noise not in log, noise
  # The summary's next stage anneals on the same data, from this run, in a workdir of its own
  # (the default stage-2 workdir may hold the embedded corpus's run): run as printed, the
  # launcher takes it.
  (following,) = [line.split("next stage", 1)[1].strip() for line in done.stdout.splitlines()
                  if line.startswith("  next stage ")]
  assert following == (
      "python launch/main.py --fdl_config=experiments.olmo3_tiny:stage2 "
      f"\"--fdl_set=checkpoint.init_from='{run}'\" \"--fdl_set=data.mix='{mine}'\" "
      f"--workdir={run}.stage2"), following
  python, script, *argv = shlex.split(following)
  assert (python, script) == ("python", "launch/main.py")
  stage2 = forked.completed("main", [*argv, "--dry_run"], env, timeout=300)
  assert stage2.returncode == 0, stage2.stderr[-3000:]
  assert f"data.mix: str | None = '{mine}'" in stage2.stdout
  for line in (f"training data       {mine}: train split, 1 files",
               f"start               initialised from {run}/checkpoints/2 "):
    assert line in stage2.stdout, stage2.stdout[-3000:]
  assert not os.path.exists(f"{run}.stage2")  # free, and a dry run writes nothing
  done = forked.completed("olmo3.eval", ["--workdir", str(run), "--tasks"], env, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads((run / "eval_report.json").read_text())["steps"]["2"]
  assert list(report["heldout"]) == ["mine"]
  assert report["heldout"]["mine"]["ce_loss"] == pytest.approx(in_loop[0], rel=1e-5)


def test_the_held_out_split_has_a_floor_of_documents_and_none_only_when_asked():
  texts = [f"document {i}" for i in range(300)]
  ranks = sorted(prepare.rank(t) for t in texts)
  # 1% of 300 is about 3 documents: the floor (a tenth of them, at most 100) takes the 30
  # documents with the smallest hashes, the fraction's own among them.
  cut = prepare.heldout_cut(texts, 0.01, 100)
  held = [t for t in texts if prepare.rank(t) < cut]
  assert len(held) == 30 and cut == ranks[29] + 1
  assert {t for t in texts if prepare.is_heldout(t, 0.01)} <= set(held)
  assert prepare.heldout_cut(texts, 0.2, 10) == 0.2 * 2.0**64  # the fraction reaches the floor
  assert prepare.heldout_cut(texts, 0.0, 100) == 0  # none, only when asked
  assert prepare.heldout_cut(texts[:9], 0.01, 100) == 0.01 * 2.0**64  # too few for a floor
  # The fraction alone reaches the floor early: the documents after that are never read.
  def endless():
    yield from texts
    raise AssertionError("read past the floor")
  assert prepare.heldout_cut(endless(), 0.5, 20) == 0.5 * 2.0**64
  assert prepare.DEFAULT_HELDOUT_FRACTION > 0  # the CLI's default holds documents out
