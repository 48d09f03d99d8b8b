"""Tokenizers as programs name them: a Hugging Face hub name out of reach ends in one line
within seconds (not huggingface_hub's 25 s of retries), and a cached one is used offline."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from olmo3.data import embedded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUB_NAME = "allenai/dolma2-tokenizer"  # docs/data.md's example


def _closed_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]  # closed when the socket is: connections are refused


def _prepare(tmp_path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
  (tmp_path / "docs.jsonl").write_text(
      "".join(json.dumps({"text": f"def f{i}(x):\n  return x + {i}\n"}) + "\n"
              for i in range(20)))
  started = time.monotonic()
  done = subprocess.run(
      [sys.executable, "-m", "olmo3.data.prepare", "--input", str(tmp_path / "docs.jsonl"),
       "--tokenizer", HUB_NAME, "--out", str(tmp_path / "out"), "--heldout_fraction", "0"],
      capture_output=True, text=True, timeout=120, cwd=ROOT,
      env={**os.environ, "HF_HOME": str(tmp_path / "hf"), **env})
  return done, time.monotonic() - started


@pytest.mark.slow(seconds=5)
@pytest.mark.parametrize("env", ["unreachable", "offline"])
def test_a_hub_tokenizer_out_of_reach_is_one_line_within_seconds(tmp_path, env):
  """The docs' own prepare example with no network (the hub's endpoint a closed port) or
  HF_HUB_OFFLINE set, the tokenizer not cached: one error line, quickly."""
  settings = ({"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"} if env == "unreachable"
              else {"HF_HUB_OFFLINE": "1"})
  done, seconds = _prepare(tmp_path, settings)
  assert done.returncode != 0
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1, done.stderr[-3000:]
  assert lines[0].startswith(f"error: --tokenizer '{HUB_NAME}': not a tokenizer.json file"), lines
  assert ("cannot be reached" if env == "unreachable" else "HF_HUB_OFFLINE") in lines[0]
  assert seconds < 5, seconds  # before: 23.6 s of "Retrying in 8s [Retry 5/5]" and the like
  assert not (tmp_path / "out").exists()


@pytest.mark.slow(seconds=5)
def test_a_cached_hub_tokenizer_is_used_when_the_hub_is_out_of_reach(tmp_path):
  """The Hugging Face cache holds the tokenizer (its layout: refs/main names the snapshot):
  with the hub unreachable, prepare uses that copy, as huggingface_hub itself would."""
  texts = [f"def f{i}(x):\n  return x + {i}\n" for i in range(50)]
  repo = tmp_path / "hf" / "hub" / ("models--" + HUB_NAME.replace("/", "--"))
  commit = "0" * 40
  (repo / "refs").mkdir(parents=True)
  (repo / "refs" / "main").write_text(commit)
  (repo / "snapshots" / commit).mkdir(parents=True)
  embedded.train_tokenizer(texts, 300).save(str(repo / "snapshots" / commit / "tokenizer.json"))
  done, seconds = _prepare(tmp_path, {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"})
  assert done.returncode == 0, done.stderr[-3000:]
  assert "Retrying" not in done.stderr and seconds < 10
  manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
  assert manifest["vocab_size"] == 300 and manifest["splits"]["train"]["documents"] == 20


def _two_tokenizers(tmp_path):
  """Two prepared directories of the same documents, each tokenized with its own 4,096-entry
  BPE trained on different halves: the same size, the same special ids (EOS 0, PAD 1, the tiny
  model's), other vocabularies."""
  import random

  from olmo3.data import prepare

  rnd = random.Random(0)
  words = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 9)))
           for _ in range(3000)]
  docs = [" ".join(rnd.choice(words) for _ in range(200)) for _ in range(300)]
  (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
  dirs = []
  for name, half in (("first", docs[:150]), ("second", docs[150:])):
    tok = embedded.train_tokenizer(half, 4096)
    assert (tok.get_vocab_size(), tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|pad|>")
            ) == (4096, 0, 1)
    tok.save(str(tmp_path / f"{name}.json"))
    prepare.prepare([str(tmp_path / "docs.jsonl")], str(tmp_path / f"{name}.json"),
                    str(tmp_path / name), 0.1, progress=False)
    dirs.append(tmp_path / name)
  return dirs


@pytest.mark.slow(seconds=25)
def test_a_stage_started_from_a_run_on_another_tokenizer_is_refused(tmp_path):
  """Stage 1 trains on a directory prepared with one tokenizer; stage 2, initialised from it,
  on a directory prepared with another of the same size and special ids: refused in one line
  naming both, before anything is written. The same tokenizer is accepted."""
  from tests import forked
  from tests.test_launch import ENV, TINY_FAST

  first, second = _two_tokenizers(tmp_path)
  vocab = "--fdl_set=model.vocab_size=4096"  # the tokenizers' size, as a prepared directory asks
  run = tmp_path / "stage1"
  done = forked.completed("main", ["--fdl_config=experiments.olmo3_tiny:stage1",
                                   f"--fdl_set=data.mix='{first}'", f"--workdir={run}",
                                   "--fdl_set=train.steps=2", "--fdl_set=eval.tasks=()",
                                   vocab, *TINY_FAST], ENV, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  # The summary suggests a prompt in the data's kind of text (before: 'Once upon' everywhere).
  (sample,) = [line.split("sample", 1)[1].strip() for line in done.stdout.splitlines()
               if line.startswith("  sample ")]
  assert sample == f"python -m olmo3.sample --workdir {run} --prompt The", done.stdout[-2000:]

  def stage2(data, *flags):
    return forked.completed("main", ["--fdl_config=experiments.olmo3_tiny:stage2",
                                     f"--fdl_set=data.mix='{data}'", f"--workdir={tmp_path / 's2'}",
                                     f"--fdl_set=checkpoint.init_from='{run}'",
                                     "--fdl_set=eval.tasks=()", vocab, *TINY_FAST, *flags], ENV,
                            timeout=300)

  refused = stage2(second)
  assert refused.returncode != 0
  assert refused.stderr.strip().splitlines()[-1] == (
      f"error: DataConfig.mix='{second}' is tokenized with {second}/tokenizer.json, but "
      f"CheckpointConfig.init_from='{run}' was trained with another tokenizer "
      f"({first}/tokenizer.json): its embeddings would read these ids as other tokens; prepare "
      f"the data with that run's tokenizer (python -m olmo3.data.prepare --tokenizer "
      f"{first}/tokenizer.json)"), refused.stderr[-3000:]
  assert not (tmp_path / "s2").exists()
  accepted = stage2(first, "--dry_run")
  assert accepted.returncode == 0, accepted.stderr[-3000:]
  assert "initialised from" in accepted.stdout + accepted.stderr


def test_the_suggested_sample_prompt_fits_the_built_in_corpus_python_source():
  import fiddle as fdl

  from experiments import olmo3_tiny
  from olmo3.data import sources

  exp = fdl.build(olmo3_tiny.stage1())
  assert exp.data.mix == "embedded"
  assert sources.sample_prompt(exp.data) == "def main("


@pytest.mark.parametrize("what", ["--tokenizer", "the run's EvalConfig.tokenizer"])
def test_the_one_loader_names_its_callers_flag_or_field(tmp_path, what):
  """A name that is neither a file nor a hub repository name, and a file that is no
  tokenizer: one DataError line that starts with the caller's own flag or field."""
  from olmo3.data import tokenizer as tokenizer_lib
  from olmo3.data.tokens import DataError

  missing = str(tmp_path / "nope" / "tokenizer.json")
  with pytest.raises(DataError) as raised:
    tokenizer_lib.load(missing, what=what)
  assert str(raised.value) == (f"{what} {missing!r}: not a tokenizer.json file (no such file), "
                               "nor a Hugging Face hub repository name")
  broken = tmp_path / "broken.json"
  broken.write_text("{not json")
  with pytest.raises(DataError) as raised:
    tokenizer_lib.load(str(broken), what=what)
  assert str(raised.value).startswith(f"{what} '{broken}': not a readable tokenizer.json file")
  good = tmp_path / "good.json"
  embedded.train_tokenizer(["a b c", "b c d"], 300).save(str(good))
  assert tokenizer_lib.load(str(good), what=what).get_vocab_size() > 0
