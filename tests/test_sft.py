"""A user's own conversations, through the real programs: `prepare --chat`, the tiny SFT recipe
training on them, `export-hf`, then transformers: the exported chat template gives exactly the
token ids the prepared files hold, conversation for conversation."""

import gzip
import json
import os

import numpy as np
import pytest

from olmo3.data import embedded
from tests import forked
from tests.test_chat_data import CONVERSATIONS, _write_jsonl

ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _conversations(n: int) -> list[list[dict]]:
  """n conversations of the four shapes (system prompt, multi-turn, unicode, a tool call), each
  made distinct."""
  out = []
  for i in range(n):
    m = [dict(c) for c in CONVERSATIONS[i % len(CONVERSATIONS)]]
    m[-1] = {**m[-1], "content": f"{m[-1]['content']} (answer {i})"}
    out.append(m)
  return out


def _spans(directory) -> list[tuple[int, ...]]:
  """Every conversation's token ids in a prepared chat directory, both splits."""
  out = []
  for split in ("train", "heldout"):
    for part in sorted((directory / split).glob("token_ids_part_*.npy")):
      tokens = np.fromfile(part, np.uint32)
      with gzip.open(part.with_suffix(".csv.gz"), "rt") as f:
        for line in f:
          start, end = map(int, line.split(","))
          out.append(tuple(int(t) for t in tokens[start:end]))
  return out


@pytest.mark.slow(seconds=40)
def test_own_conversations_prepare_train_export_and_transformers_gives_the_same_ids(tmp_path):
  from transformers import AutoTokenizer

  conversations = _conversations(60)
  jsonl = _write_jsonl(tmp_path / "mine.jsonl", conversations)
  tokenizer = str(embedded.corpus_dir() / "tokenizer.json")
  data = tmp_path / "data"
  done = forked.completed("olmo3.data.prepare", [
      "--chat", "--input", jsonl, "--tokenizer", tokenizer, "--chat_template", "olmo3_think",
      "--out", str(data), "--heldout_fraction", "0.1"], ENV, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  run = tmp_path / "run"
  done = forked.completed("main", [
      "--fdl_config=experiments.olmo3_tiny:sft", f"--fdl_set=data.mix='{data}'",
      "--fdl_set=checkpoint.init_from=None", "--fdl_set=data.seq_len=256",
      "--fdl_set=train.steps=3", "--fdl_set=train.eval_every=3",
      "--fdl_set=eval.ruler.lengths=()",  # RULER through the launcher: tests/test_launch.py
      f"--workdir={run}"], ENV, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "held-out CE     " in done.stdout and "the assistant's tokens, step 3" in done.stdout
  assert "python -m olmo3.sample --workdir" in done.stdout and "--chat --prompt" in done.stdout
  export = tmp_path / "hf"
  done = forked.completed("olmo3.convert", ["export-hf", "--ckpt", str(run), "--out",
                                            str(export)], ENV, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  hf = AutoTokenizer.from_pretrained(str(export))
  ids = [hf.apply_chat_template(m, tokenize=True) for m in conversations]
  ids = [tuple(x["input_ids"] if hasattr(x, "keys") else x) for x in ids]
  assert sorted(ids) == sorted(_spans(data))  # every conversation, both splits, none dropped
