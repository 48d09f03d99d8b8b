"""The embedded default corpus: real text every machine has, no download.

The running Python's standard-library sources (outside tests and site-packages) and its
documentation topics (`pydoc_data.topics`), one document each, prepared by `prepare` into a cache
directory on first use, with an 8k byte-level BPE trained locally on the training documents
only. Deterministic; held-out documents (by hash of their text) are disjoint from training.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sysconfig
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from olmo3.data import prepare as prepare_lib

FORMAT = 1  # bump when the corpus or its preparation changes
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")  # ids 0 (EOS) and 1 (PAD)


def documents() -> list[tuple[str, str]]:
  """(name, text) of every document, in a fixed order."""
  stdlib = Path(sysconfig.get_paths()["stdlib"])
  docs = []
  for path in sorted(stdlib.rglob("*.py")):
    rel = path.relative_to(stdlib)
    if rel.parts[0] in ("site-packages", "dist-packages") or any(
        p in ("test", "tests", "idle_test") for p in rel.parts):
      continue
    docs.append((str(rel), path.read_text(encoding="utf-8", errors="replace")))
  from pydoc_data import topics

  docs.extend((f"pydoc:{name}", topics.topics[name]) for name in sorted(topics.topics))
  return [(n, t) for n, t in docs if t.strip()]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(texts, trainer)
  return tokenizer


def cache_root() -> Path:
  return Path(os.environ.get("OLMO3_CACHE", Path.home() / ".cache" / "olmo3"))


def corpus_dir(vocab_size: int = 8192, heldout_fraction: float = 0.05,
               progress: bool = False) -> Path:
  """The prepared corpus (manifest.json, tokenizer.json, token files), built on first use."""
  docs = documents()
  key = hashlib.sha256(json.dumps(
      [FORMAT, vocab_size, heldout_fraction, [(n, len(t)) for n, t in docs]]).encode()
  ).hexdigest()[:12]
  out = cache_root() / f"embedded-{key}"
  out.mkdir(parents=True, exist_ok=True)
  with open(out / ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # one preparer at a time; the others wait, then reuse it
    if (out / "manifest.json").exists():
      return out
    train_texts = [t for _, t in docs if not prepare_lib.is_heldout(t, heldout_fraction)]
    tokenizer = train_tokenizer(train_texts, vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    with tempfile.TemporaryDirectory(dir=out) as staging:
      jsonl = os.path.join(staging, "documents.jsonl")
      with open(jsonl, "w") as f:
        for name, text in docs:
          f.write(json.dumps({"id": name, "text": text}) + "\n")
      prepare_lib.prepare([jsonl], tokenizer, str(out), heldout_fraction, workers=1,
                          progress=progress)
  return out
