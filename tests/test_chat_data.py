"""Chat (SFT) data: conversations encoded as transformers and open-instruct encode them,
`prepare --chat`'s files, open-instruct's directories read as they are (locally and over
HTTP), the refusals before a first step, packed rows equal to OLMo-core's NumpyPackedFSLDataset
with label masks, held-out CE on trained tokens, and the embedded chat corpus."""

import gzip
import json
import os
import shutil

import numpy as np
import pytest
import torch
from olmo_core.data import DataCollator, TokenizerConfig
from olmo_core.data.numpy_dataset import NumpyPackedFSLDatasetConfig
from olmo_core.data.utils import get_labels

from harness.storage_servers import InstrumentedRangeServer
from olmo3.config import DataConfig, Packing
from olmo3.data import chat, chat_data, embedded, label_masks, packing, prepare_chat, sources
from olmo3.data.heldout import HeldoutDocs
from olmo3.data.tokens import DataError, write_token_file
from olmo3.loss import IGNORE
from tests import forked

EOS, PAD, SEQ = 0, 1, 256
SFT = Packing(source_group_size=1, source_permutation_seed=None)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello!"}],
    [{"role": "user", "content": "Übersetze: ça va? 日本語"},
     {"role": "assistant", "content": "Wie geht's? — ça va 🙂"},
     {"role": "user", "content": "Und noch einmal?"},
     {"role": "assistant", "content": "Gut, danke."}],
    [{"role": "system", "content": "Tools."}, {"role": "user", "content": "Run it"},
     {"role": "assistant", "content": "Done", "function_calls": "f()"},
     {"role": "environment", "content": "ok"}, {"role": "assistant", "content": "It worked."}],
]


@pytest.fixture(scope="module")
def tokenizer_json():
  return str(embedded.corpus_dir() / "tokenizer.json")


@pytest.fixture(scope="module")
def think(tokenizer_json):
  tok = chat.Tokenizer.from_file(tokenizer_json)
  return chat.Chat(chat.ChatTemplate.named("olmo3_think"), tok, chat.special_tokens(tok, EOS))


def test_ids_equal_transformers_apply_chat_template(tokenizer_json, think):
  from transformers import PreTrainedTokenizerFast

  theirs = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, eos_token="<|endoftext|>")
  theirs.chat_template = think.template.text
  for messages in CONVERSATIONS:
    want = theirs.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert think.ids(messages) == list(want), messages
    ids, _ = think.encode(messages, 10**6)
    assert ids.tolist() == list(want)
    prompt = theirs.apply_chat_template(messages[:-1], tokenize=True, return_dict=False,
                                        add_generation_prompt=True)
    assert think.ids(messages[:-1], add_generation_prompt=True) == list(prompt)


def test_masks_train_the_assistant_and_the_final_eos_only(think):
  tok = think.tokenizer
  ids, trained = think.encode(CONVERSATIONS[2], 10**6)
  assert ids[-1] == EOS and trained[-1]
  said = tok.decode(ids[trained].tolist(), skip_special_tokens=False)
  unsaid = tok.decode(ids[~trained].tolist(), skip_special_tokens=False)
  for text in ("Wie geht's? — ça va 🙂", "Gut, danke.", "<|endoftext|>"):
    assert text in said
  # open-instruct measures a non-final turn's end by a prefix that ends in EOS instead: one
  # token of its end-of-turn is trained (dolma2: <|im_end|>, one token; here its "<").
  assert "Wie geht's? — ça va 🙂<Gut" in said
  for text in ("Übersetze", "Und noch einmal?", "You are Olmo", "<|im_start|>assistant\n"):
    assert text in unsaid and text not in said
  # Cut to max_tokens: the prefix, its mask the prefix of the whole one's.
  keep = len(ids) - 5
  cut, cut_trained = think.encode(CONVERSATIONS[2], keep)
  assert cut.tolist() == ids[:keep].tolist()
  assert cut_trained.tolist() == trained[:keep].tolist() and cut[-1] != EOS
  assert think.encode([{"role": "user", "content": "no answer"}], 100) is None


def _write_jsonl(path, conversations):
  path.write_text("".join(json.dumps({"messages": m, "id": i}) + "\n"
                          for i, m in enumerate(conversations)))
  return str(path)


def _many(n):
  out = []
  for i in range(n):
    m = [dict(c) for c in CONVERSATIONS[i % len(CONVERSATIONS)]]
    m[-1] = {**m[-1], "content": f"{m[-1]['content']} ({i})"}
    out.append(m)
  out.append([{"role": "user", "content": "only a question"}])  # nothing trained: dropped
  return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer_json):
  """A chat directory in parts of 1000 tokens (conversations straddle them)."""
  root = tmp_path_factory.mktemp("chat")
  jsonl = _write_jsonl(root / "convs.jsonl", _many(200))
  manifest = prepare_chat.prepare_chat([jsonl], tokenizer_json, str(root / "out"),
                                       "olmo3_think", heldout_fraction=0.1, progress=False,
                                       part_tokens=1000)
  return root / "out", manifest


def test_prepared_files_are_open_instructs_format(prepared, think):
  out, manifest = prepared
  assert manifest.kind == "chat" and manifest.chat["dropped"] == 1
  assert manifest.chat["template"]["sha256"] == chat.ChatTemplate.named("olmo3_think").sha256
  train = manifest.splits["train"]
  assert len(train["files"]) > 3 and train["files"][1] == "train/token_ids_part_0001.npy"
  assert train["masks"][1] == "train/labels_mask_part_0001.npy"
  tokens = np.concatenate([np.fromfile(out / f, "<u4") for f in train["files"]])
  masks = np.concatenate([np.fromfile(out / f, np.bool_) for f in train["masks"]])
  assert len(tokens) == len(masks) == train["tokens"] and masks.sum() == train["trained_tokens"]
  # Every conversation is Chat.encode's; the bounds files cut them at the parts' edges.
  ends = np.flatnonzero(tokens == EOS) + 1
  assert len(ends) == train["documents"]
  bounds = []
  for i, name in enumerate(train["bounds"]):
    lines = gzip.decompress((out / name).read_bytes()).decode().split()
    bounds += [(i * 1000 + int(a), i * 1000 + int(b)) for a, b in (x.split(",") for x in lines)]
  merged = [bounds[0]]
  for start, end in bounds[1:]:  # a conversation straddling a part is listed in both
    merged[-1:] = [(merged[-1][0], end)] if start == merged[-1][1] and start % 1000 == 0 else [
        merged[-1], (start, end)]
  assert [e for _, e in merged] == ends.tolist()
  config = json.loads((out / "tokenizer_config.json").read_text())
  assert config["chat_template"] == think.template.text and config["eos_token"] == "<|endoftext|>"


def _olmo_core(paths, masks, work_dir):
  config = NumpyPackedFSLDatasetConfig(
      paths=paths, label_mask_paths=masks, dtype="uint32", sequence_length=SEQ,
      tokenizer=TokenizerConfig(vocab_size=8192, eos_token_id=EOS, pad_token_id=PAD),
      generate_doc_lengths=True, long_doc_strategy="truncate", work_dir=str(work_dir))
  dataset = config.build()
  for group in dataset._source_path_groups:  # what prepare()'s pool would run, in process
    dataset._pack_documents_from_source_into_instances(*group)
  dataset.prepare()
  return dataset


def test_packed_rows_and_labels_equal_olmo_cores(prepared, tmp_path):
  """OLMo-core's own NumpyPackedFSLDataset(label_mask_paths=...) on the same files: the same
  instances and label masks, and the labels its get_labels makes of its collated batch."""
  out, manifest = prepared
  paths = [str(out / f) for f in manifest.splits["train"]["files"]]
  index = packing.PackedIndex.build(paths, seq_len=SEQ, eos_token_id=EOS, source_group_size=1,
                                    label_masks=label_masks.masks_of(paths))
  ours = packing.PackedInstances(index, pad_token_id=PAD, vocab_size=8192)
  theirs = _olmo_core(paths, label_masks.masks_of(paths), tmp_path)
  assert len(ours) == len(theirs) > 10
  rows = ours.read(np.arange(len(ours)))
  for i in range(len(ours)):
    item = theirs[i]
    np.testing.assert_array_equal(rows.tokens[i], item["input_ids"].numpy())
    np.testing.assert_array_equal(rows.label_mask[i], item["label_mask"].numpy())
  batch = DataCollator(pad_token_id=PAD)([theirs[i] for i in range(len(theirs))])
  np.testing.assert_array_equal(rows.labels(-100), get_labels(batch).numpy())
  trained = rows.labels(IGNORE) >= 0
  assert 0 < trained.sum() < (rows.tokens != PAD).sum() / 2  # headers and users masked
  # The masks are part of the packing's identity (and so of a run's data identity).
  plain = packing.PackedIndex.build(paths, seq_len=SEQ, eos_token_id=EOS, source_group_size=1)
  assert "label_masks" not in plain.key and plain.digest != index.digest
  batch = DataCollator(pad_token_id=PAD)([theirs[0]])
  assert torch.equal(torch.tensor(ours.read([0]).labels(-100)), get_labels(batch))


def _open_instruct_dir(prepared, target):
  """The training split as open-instruct's converter lays it out: flat, no manifest."""
  out, manifest = prepared
  target.mkdir()
  info = manifest.splits["train"]
  for name in info["files"] + info["masks"] + info["bounds"]:
    shutil.copy(out / name, target / os.path.basename(name))
  (target / "tokenizer").mkdir()
  shutil.copy(out / "tokenizer.json", target / "tokenizer")
  shutil.copy(out / "tokenizer_config.json", target / "tokenizer")
  (target / label_masks.STATISTICS).write_text(json.dumps(
      {"configuration": {"chat_template": "olmo_thinker_no_think_7b", "tokenizer": "x"}}))
  return target


def _rows(files, masked=True):
  paths = [f.path for f in files]
  index = packing.PackedIndex.build(paths, seq_len=SEQ, eos_token_id=EOS, source_group_size=1,
                                    label_masks=label_masks.masks_of(paths) if masked else None)
  return packing.PackedInstances(index, pad_token_id=PAD).read(np.arange(len(index)))


def test_an_open_instruct_directory_is_read_as_it_is_locally_and_over_http(prepared, tmp_path):
  directory = _open_instruct_dir(prepared, tmp_path / "oi")
  want = _rows(sources.read_mix(str(prepared[0])))
  local = sources.read_mix(str(directory))
  assert [os.path.basename(f.path) for f in local] == [
      label_masks.TOKENS.format(i) for i in range(len(local))]
  assert {f.label for f in local} == {"oi"}
  for got in (_rows(local),):
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.label_mask, want.label_mask)
  with InstrumentedRangeServer(str(tmp_path)) as server:  # no listing: parts probed
    served = sources.read_mix(f"{server.url}/oi")
    assert [f.path for f in served] == [f"{server.url}/oi/{os.path.basename(f.path)}"
                                        for f in local]
    got = _rows(served)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.label_mask, want.label_mask)
    name, text = label_masks.open_instruct_template(f"{server.url}/oi")
  assert name == "olmo_thinker_no_think_7b" and text == chat.ChatTemplate.named(
      "olmo3_think").text


def _config(mix, **changes):
  return DataConfig(mix=str(mix), seq_len=SEQ, global_batch_size=2, packing=SFT, **changes)


def test_refusals_before_the_first_step(prepared, tmp_path):
  directory = _open_instruct_dir(prepared, tmp_path / "oi")
  files = sources.read_mix(str(directory))
  cfg = _config(directory)
  assert sources.token_files(cfg, 8192, files=files, model=_Model()).index.key["label_masks"]
  mask = directory / label_masks.MASK.format(1)
  good = mask.read_bytes()
  mask.write_bytes(good[:-3])  # a mask of the wrong length
  with pytest.raises(DataError, match=rf"^DataConfig.mix='{directory}': label mask {mask} holds "
                     r"\d+ bytes, but its token file .*token_ids_part_0001.npy holds \d+ tokens"):
    sources.token_files(cfg, 8192, files=files, model=_Model())
  # A uint32 token file given as a mask (OLMo-core 9e9747105's glob on gs://): 4 bytes a token.
  shutil.copy(directory / label_masks.TOKENS.format(1), mask)
  with pytest.raises(DataError, match=r"4 bytes per token: a uint32 token file given as a mask"):
    sources.token_files(cfg, 8192, files=files, model=_Model())
  mask.write_bytes(good)
  with pytest.raises(DataError, match=r"is chat data .*which is trained packed: set data.packing"):
    sources.token_files(cfg.replace(packing=None), 8192, files=files, model=_Model())
  masks = [directory / label_masks.MASK.format(i) for i in range(len(files))]
  saved = [m.read_bytes() for m in masks]
  for m in masks:
    m.write_bytes(bytes(len(m.read_bytes())))
  with pytest.raises(DataError, match=r"label masks .* train no token"):
    sources.token_files(cfg, 8192, files=files, model=_Model())
  for m, b in zip(masks, saved):
    m.write_bytes(b)
  paths = [f.path for f in files]
  chat_data.check_template(_config(directory, chat_template="olmo3_think"), None, paths)
  other = tmp_path / "other.jinja"
  other.write_text("{{ messages }}")
  with pytest.raises(DataError, match=(
      rf"^DataConfig.chat_template='{other}' \(sha256 [0-9a-f]{{12}}\) is not the template "
      rf"DataConfig.mix='{directory}' was tokenized with \(olmo_thinker_no_think_7b, sha256")):
    chat_data.check_template(_config(directory, chat_template=str(other)), None, paths)
  plain = [str(embedded.corpus_dir() / "train" / "part-00000.npy")]
  with pytest.raises(DataError, match=r"is no chat data \(no label masks"):
    chat_data.check_template(_config("embedded", chat_template="olmo3_think"), None, plain)


class _Model:
  eos_token_id, pad_token_id = EOS, PAD


def test_held_out_rows_score_trained_tokens_only(prepared):
  """Each held-out conversation's labels: its next tokens where they are trained, IGNORE
  elsewhere (documents found per file by EOS, as the held-out sets find them)."""
  out, manifest = prepared
  paths = [str(out / f) for f in manifest.splits["heldout"]["files"]]
  docs = HeldoutDocs(paths, SEQ, EOS, PAD)
  rows = docs.rows(range(len(docs)), SEQ, len(docs))
  want = []
  for path in paths:
    tokens = np.fromfile(path, "<u4").astype(np.int64)
    masks = np.fromfile(label_masks.mask_path(path), np.bool_)
    ends = np.flatnonzero(tokens == EOS) + 1
    for start, end in zip(np.concatenate([[0], ends[:-1]]), ends):
      end = min(end, start + SEQ)
      want.append(np.where(masks[start + 1:end], tokens[start + 1:end], IGNORE))
  assert len(want) == len(docs) > 5
  for r, labels in enumerate(want):
    np.testing.assert_array_equal(rows["labels"][r, :len(labels)], labels)
    assert (rows["labels"][r, len(labels):] == IGNORE).all()
  assert 0 < (rows["labels"] >= 0).sum() < (rows["input_ids"] != PAD).sum() / 2


def test_the_embedded_chat_corpus_is_a_named_source():
  split = sources.prepared("embedded_chat")
  assert split.builtin and split.label == "embedded_chat" and split.tokenizer == "embedded"
  assert split.manifest.kind == "chat" and split.mix("heldout") == "embedded_chat-heldout"
  assert split.manifest.chat["template"]["sha256"] == chat.ChatTemplate.named(
      embedded.CHAT_TEMPLATE).sha256
  assert 1500 < split.manifest.chat["conversations"] < 5000
  held = sources.read_mix("embedded_chat-heldout")
  assert held and all(f.label == "embedded_chat" for f in held)
  assert embedded.conversations()[:50] == embedded.conversations()[:50]


@pytest.mark.slow(seconds=3)
def test_prepare_chat_cli_and_its_one_line_refusals(tmp_path, tokenizer_json):
  jsonl = _write_jsonl(tmp_path / "convs.jsonl", _many(40))
  base = ["--chat", "--tokenizer", tokenizer_json, "--out", str(tmp_path / "out")]
  done = forked.completed("olmo3.data.prepare",
                          [*base, "--chat_template", "olmo3_think", "--input", jsonl],
                          dict(os.environ), timeout=120)
  assert done.returncode == 0, done.stderr
  assert "conversations" in done.stdout and "chat template olmo3_think" in done.stdout
  manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
  assert manifest["kind"] == "chat" and manifest["chat"]["max_tokens"] == 32768
  assert manifest["chat"]["template"]["text"] == chat.ChatTemplate.named("olmo3_think").text
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + '{"text": "no"}\n')
  refusals = {
      (str(bad), "olmo3_think"): f"error: {bad}:2: no 'messages' (a list of role/content "
                                 "messages)",
      (jsonl, "nope"): "error: --chat_template 'nope': not a template olmo3 ships (olmo3_think), "
                       "'tokenizer' (the tokenizer's own) or a .jinja file"}
  for (given, template), line in refusals.items():
    done = forked.completed("olmo3.data.prepare",
                            [*base[:-1], str(tmp_path / "o2"), "--chat_template", template,
                             "--input", given], dict(os.environ), timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [line], done.stderr
  assert not (tmp_path / "o2").exists()
