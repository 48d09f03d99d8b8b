"""The embedded default corpus: real text every machine has, no download.

The running Python's standard-library sources (outside tests and site-packages) and its
documentation topics (`pydoc_data.topics`), one document each, prepared by `prepare` into a cache
directory on first use, with an 8k byte-level BPE trained locally on the training documents
only. Deterministic; held-out documents (by hash of their text) are disjoint from training.

The embedded chat corpus (`chat_dir`, the mix `embedded_chat`): conversations about the same
sources, a user asking what a public function, class or method of the standard library does
and the assistant answering with its docstring's first paragraph (the questions phrased in
several ways, some with a system prompt, some two questions long, each choice by a hash of the
name), read from the files by `ast` (nothing imported), tokenized with the corpus's tokenizer
and AI2's Think template by `prepare --chat`'s code into the cache on first use.
"""

from __future__ import annotations

import ast
import fcntl
import functools
import hashlib
import json
import os
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from absl import logging

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

FORMAT = 2  # bump when the corpus or its preparation changes (2: the held-out split disjoint)
CHAT_FORMAT = 2  # bump when the chat corpus or its preparation changes
CHAT_TEMPLATE = "olmo3_think"  # the chat corpus's template (olmo3.data.chat)
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")  # ids 0 (EOS) and 1 (PAD)


def _source_paths() -> list[Path]:
  """The standard library's .py files outside site-packages and test directories, sorted.
  (os.walk prunes those directories instead of walking all of site-packages.)"""
  stdlib = Path(sysconfig.get_paths()["stdlib"])
  paths = []
  for root, dirs, files in os.walk(stdlib):
    top = Path(root) == stdlib
    dirs[:] = [d for d in dirs if d not in ("test", "tests", "idle_test") and not (
        top and d in ("site-packages", "dist-packages"))]
    paths.extend(Path(root) / f for f in files if f.endswith(".py"))
  return sorted(paths)


def documents() -> list[tuple[str, str]]:
  """(name, text) of every document, in a fixed order."""
  stdlib = Path(sysconfig.get_paths()["stdlib"])
  docs = [(str(path.relative_to(stdlib)), path.read_text(encoding="utf-8", errors="replace"))
          for path in _source_paths()]
  docs.extend((f"pydoc:{name}", text) for name, text in sorted(_topics().items()))
  return [(n, t) for n, t in docs if t.strip()]


def _fingerprint() -> list:
  """What the corpus is made of, cheaply: every source file's name and size, every topic's
  length. Reading the 13 MB of text is left to the one process that prepares it."""
  stdlib = Path(sysconfig.get_paths()["stdlib"])
  return ([(str(p.relative_to(stdlib)), p.stat().st_size) for p in _source_paths()]
          + [(name, len(text)) for name, text in sorted(_topics().items())])


def _topics() -> dict[str, str]:
  """pydoc's help topics (name -> text). Imported here, not at the top: a 1 MB module only the
  corpus's preparation and fingerprint read."""
  from pydoc_data import topics

  return topics.topics


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
  return _corpus_dir(cache_root(), vocab_size, heldout_fraction, progress)


@functools.lru_cache  # a run asks several times (train mix, held-out mix, tokenizer)
def _corpus_dir(root: Path, vocab_size: int, heldout_fraction: float, progress: bool) -> Path:
  key = hashlib.sha256(json.dumps([FORMAT, vocab_size, heldout_fraction, _fingerprint()]).encode()
                       ).hexdigest()[:12]

  def build(out: Path, staging: str) -> int:
    # Imported only to build the corpus (once per machine): a run that finds it built never
    # loads the preparation tool (tests/test_imports.py).
    from olmo3.data import prepare as prepare_lib  # pylint: disable=import-outside-toplevel

    docs = documents()
    train_texts = [t for _, t in docs if not prepare_lib.is_heldout(t, heldout_fraction)]
    tokenizer = train_tokenizer(train_texts, vocab_size)  # prepare saves it beside the tokens
    jsonl = os.path.join(staging, "documents.jsonl")
    with open(jsonl, "w") as f:
      for name, text in docs:
        f.write(json.dumps({"id": name, "text": text}) + "\n")
    # The fraction alone, no floor: the split (and every tiny run's numbers) as it always
    # was, and the one `train_texts` above drew the tokenizer's documents from.
    prepare_lib.prepare([jsonl], tokenizer, str(out), heldout_fraction, workers=1,
                        progress=progress, tokenizer_name="embedded", heldout_min_documents=0)
    return len(docs)

  return _built(root / f"embedded-{key}", "corpus", "documents", build, lasts=": about a minute")


def _built(out: Path, what: str, unit: str, build: Callable[[Path, str], int],
           lasts: str = "") -> Path:
  """`out`, a prepared directory built once per machine by `build(out, staging)` (which
  returns how many `unit` it holds): one builder at a time, the others wait, then reuse it."""
  out.mkdir(parents=True, exist_ok=True)
  with open(out / ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if (out / "manifest.json").exists():
      return out
    started = time.perf_counter()
    logging.info("preparing the embedded %s in %s (once per machine%s)", what, out, lasts)
    with tempfile.TemporaryDirectory(dir=out) as staging:
      n = build(out, staging)
    logging.info("prepared the embedded %s (%d %s) in %.0f s", what, n, unit,
                 time.perf_counter() - started)
  return out


_QUESTIONS = ("What does `{name}` do?", "Explain `{name}` in a few sentences.",
              "I'm reading code that calls `{name}`. What is it for?",
              "What is `{short}` in Python's `{module}` module?",
              "Can you describe the standard library's `{name}`?")
_SYSTEMS = ("You answer questions about the Python standard library.",
            "You are a concise assistant for Python programmers.")
_FOLLOW_UP = "And `{name}`?"


def _choice(name: str, salt: str, n: int) -> int:
  """A deterministic choice among `n` for `name` (its hash, not Python's salted one)."""
  return int.from_bytes(hashlib.sha256(f"{salt}:{name}".encode()).digest()[:4], "big") % n


def documented() -> list[tuple[str, str, str]]:
  """(module, qualified name, first docstring paragraph) of every public top-level function
  and class of the standard library's public modules, in file order (2,126 on Python 3.11:
  the tiny SFT's two epochs in a few minutes; their methods would be 5,304); paragraphs
  under 20 characters left out."""
  stdlib = Path(sysconfig.get_paths()["stdlib"])
  found = []
  for path in _source_paths():
    parts = list(path.relative_to(stdlib).with_suffix("").parts)
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    if not parts or any(p.startswith("_") for p in parts):
      continue
    try:
      tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:  # a file of another Python's grammar (none in a release): skipped
      continue
    module = ".".join(parts)
    for node in tree.body:
      if isinstance(node, _DEFINITIONS) and not node.name.startswith("_"):
        doc = ast.get_docstring(node)
        paragraph = " ".join(doc.split("\n\n")[0].split()) if doc else ""
        if len(paragraph) >= 20:
          found.append((module, f"{module}.{node.name}", paragraph))
  return found


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def conversations() -> list[list[dict[str, str]]]:
  """The chat corpus's conversations, in a fixed order (see the module docstring)."""
  items = documented()
  out = []
  for i, (module, name, answer) in enumerate(items):
    question = _QUESTIONS[_choice(name, "q", len(_QUESTIONS))].format(
        name=name, short=name[len(module) + 1:], module=module)
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if _choice(name, "system", 4) == 0:
      messages.insert(0, {"role": "system",
                          "content": _SYSTEMS[_choice(name, "s", len(_SYSTEMS))]})
    following = items[i + 1] if i + 1 < len(items) else None
    if following and following[0] == module and _choice(name, "turns", 5) == 0:
      messages += [{"role": "user", "content": _FOLLOW_UP.format(name=following[1])},
                   {"role": "assistant", "content": following[2]}]
    out.append(messages)
  return out


def chat_dir(heldout_fraction: float = 0.05, progress: bool = False) -> Path:
  """The prepared chat corpus (manifest.json, tokenizer.json, token and mask files), built on
  first use with the text corpus's tokenizer."""
  return _chat_dir(cache_root(), corpus_dir(), heldout_fraction, progress)


@functools.lru_cache
def _chat_dir(root: Path, text_dir: Path, heldout_fraction: float, progress: bool) -> Path:
  template = (Path(__file__).parent / "chat_templates" / f"{CHAT_TEMPLATE}.jinja").read_bytes()
  key = hashlib.sha256(json.dumps([CHAT_FORMAT, text_dir.name, heldout_fraction,
                                   hashlib.sha256(template).hexdigest(), _fingerprint()]
                                  ).encode()).hexdigest()[:12]

  def build(out: Path, staging: str) -> int:
    # Imported only to build the corpus (once per machine), as `prepare` above.
    from olmo3.data import prepare_chat  # pylint: disable=import-outside-toplevel

    convs = conversations()
    jsonl = os.path.join(staging, "conversations.jsonl")
    with open(jsonl, "w") as f:
      f.writelines(json.dumps({"messages": m}) + "\n" for m in convs)
    prepare_chat.prepare_chat([jsonl], str(text_dir / "tokenizer.json"), str(out),
                              CHAT_TEMPLATE, heldout_fraction=heldout_fraction,
                              heldout_min_documents=0, progress=progress,
                              tokenizer_name="embedded")
    return len(convs)

  return _built(root / f"embedded_chat-{key}", "chat corpus", "conversations", build)
