"""python -m olmo3.sample: the KV-cache decode equals the full forward at every position, greedy
text equals transformers' `generate` on the exported checkpoint token for token, sampling
draws from the cut it names, and a user's mistake is one `error:` line.

The model is olmo3_micro (6 layers, GQA, sliding window 16 on layers 0-2 and 4) with wide
random weights: prompts and continuations run past two windows, so a wrong window, RoPE offset
or cache slot changes the predictions."""

import json
import logging as py_logging
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo3 import config
from olmo3 import model as model_lib
from olmo3 import program
from olmo3.io import checkpoint
from olmo3 import decode
from olmo3.sample.__main__ import _one_line_errors, main

from conftest import random_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = config.olmo3_micro()
PROMPT = "some words 7 and more 21, some words 12 and more 36"


# Stage 3's YaRN (original context 16, so positions up to 40 reach 2.5x it) on the global
# layers: the decode must give each layer its own RoPE tables.
YARN = MICRO.replace(rope_scaling=config.Yarn(factor=4.0, original_context=16))


@pytest.mark.parametrize("cfg", [MICRO, YARN], ids=["plain", "yarn"])
def test_cached_decode_logits_equal_the_full_forward(cfg):
  """The prompt's logits from one prefill, then each later position's from a one-token step
  over the cache, equal the full forward's at every position (past two windows)."""
  model = model_lib.from_params(cfg, random_params(MICRO, seed=1))
  tokens_BT = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 40), np.int32)
  full_BTV = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens_BT))
  extend = nnx.jit(decode.extend, donate_argnums=1)
  cache = decode.KVCache.empty(cfg, 2, 40)
  prompt = 7
  logits, cache = extend(model, cache, tokens_BT[:, :prompt], jnp.int32(0))
  pieces = [np.asarray(logits)]
  for position in range(prompt, 40):
    logits, cache = extend(model, cache, tokens_BT[:, position:position + 1],
                           jnp.int32(position))
    pieces.append(np.asarray(logits))
  cached_BTV = np.concatenate(pieces, axis=1)
  assert full_BTV.std() > 2  # logits spread wide enough that a wrong key shows
  np.testing.assert_allclose(cached_BTV, full_BTV, atol=1e-4, rtol=0)
  assert (cached_BTV.argmax(-1) == full_BTV.argmax(-1)).all()


def test_sampling_draws_from_the_cut():
  """Temperature 0 takes the most likely token; top_p keeps the most likely tokens whose
  probabilities reach it (the first always), and draws among them by their odds."""
  logits_BV = jnp.log(jnp.array([[0.1, 0.5, 0.25, 0.15], [0.7, 0.1, 0.1, 0.1]]))
  assert decode.Sampling().pick(logits_BV, jax.random.key(0)).tolist() == [1, 0]
  keys = jax.random.split(jax.random.key(0), 4000)

  def draw(sampling: decode.Sampling) -> np.ndarray:  # [draws, B]
    return np.asarray(jax.vmap(lambda key: sampling.pick(logits_BV, key))(keys))

  nucleus = draw(decode.Sampling(temperature=1.0, top_p=0.7))
  assert set(nucleus[:, 0]) == {1, 2} and set(nucleus[:, 1]) == {0}
  assert abs((nucleus[:, 0] == 1).mean() - 2 / 3) < 0.03  # 0.5 : 0.25
  everything = draw(decode.Sampling(temperature=1.0))[:, 0]
  np.testing.assert_allclose(np.bincount(everything, minlength=4) / 4000,
                             [0.1, 0.5, 0.25, 0.15], atol=0.03)


def _tokenizer(path):
  from olmo3.data import embedded

  texts = [f"some words {i} and more {i * 3}, other words {i % 7}" for i in range(300)]
  embedded.train_tokenizer(texts, vocab_size=500).save(str(path))
  return str(path)


def _run(tmp_path, steps=(2, 4), tokenizer: str | None = None) -> tuple:
  """(workdir, model config) of a run as the launcher leaves one: experiment.json naming its
  tokenizer (a file), the model sized to that tokenizer, and wide random weights saved as the
  checkpoints at `steps` (empty directories when `steps` holds a negative)."""
  tokenizer = tokenizer or _tokenizer(tmp_path / "tok.json")
  from tokenizers import Tokenizer

  cfg = MICRO.replace(vocab_size=Tokenizer.from_file(tokenizer).get_vocab_size())
  run = tmp_path / "run"
  exp = config.Experiment(model=cfg, data=config.DataConfig(paths=("x.npy",), seq_len=128),
                          eval=config.EvalConfig(tokenizer=tokenizer))
  (run / "checkpoints").mkdir(parents=True)
  (run / "experiment.json").write_text(json.dumps(exp.to_dict()))
  for step in steps:
    if step < 0:
      (run / "checkpoints" / str(-step)).mkdir()
    else:
      checkpoint.save_model(run / "checkpoints" / str(step), cfg, random_params(cfg, step))
  return run, cfg


def test_user_mistakes_are_one_line(tmp_path, capsys, monkeypatch, request):
  """An empty prompt, bad options, no run, a run without checkpoints, a step it does not have:
  one `error:` line and exit code 2, before any model is built; a checkpoint that cannot be
  read: one line through the program's wrapper."""
  run, _ = _run(tmp_path, steps=(-4,))  # an empty step directory: listed, unreadable

  def error(*argv: str) -> str:
    assert main(["--workdir", str(run), *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]

  assert error("--prompt", "") == "error: --prompt is empty: give the text to continue"
  assert "--max_new_tokens 0: must be at least 1" in error("--prompt", "x",
                                                           "--max_new_tokens", "0")
  assert "--top_p needs --temperature > 0" in error("--prompt", "x", "--top_p", "0.9")
  assert "--top_p 0.0: must be in (0, 1]" in error("--prompt", "x", "--temperature", "1",
                                                   "--top_p", "0")
  assert error("--prompt", "x", "--step", "3") == "error: no checkpoint at step 3 (have [4])"
  assert "reach past the model's max_seq_len 256" in error("--prompt", "x",
                                                           "--max_new_tokens", "300")
  assert error("--prompt", "x", "--workdir", str(tmp_path / "nope")) == (
      f"error: --workdir {tmp_path / 'nope'}: no such run directory")
  (run / "checkpoints" / "4").rmdir()
  assert error("--prompt", "x") == f"error: {run} has no checkpoint"
  (run / "checkpoints" / "4").mkdir()
  # The wrapper ends a program: its failure quiets what the process's threads say afterwards
  # (program.quiet_leftovers). Called here in pytest's process, that is put back.
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  request.addfinalizer(lambda: py_logging.disable(py_logging.NOTSET))
  with pytest.raises(SystemExit) as exited:
    program.reported(main, _one_line_errors)(["--workdir", str(run), "--prompt", "x"])
  assert str(exited.value).startswith("error: ") and "\n" not in str(exited.value)



def test_a_tokenizer_that_cannot_be_loaded_is_named_as_the_runs_field(tmp_path):
  """The one tokenizer loader names the caller's own setting: here the run's
  EvalConfig.tokenizer, not `prepare`'s --tokenizer flag."""
  from olmo3.data.tokens import DataError

  run, _ = _run(tmp_path, steps=(-4,))
  exp = json.loads((run / "experiment.json").read_text())
  gone = tmp_path / "gone" / "tokenizer.json"
  exp["eval"]["tokenizer"] = str(gone)
  (run / "experiment.json").write_text(json.dumps(exp))
  with pytest.raises(DataError) as raised:
    main(["--workdir", str(run), "--prompt", "x"])
  assert str(raised.value).startswith(f"the run's EvalConfig.tokenizer {str(gone)!r}: not a "
                                      "tokenizer.json file"), raised.value

@pytest.mark.slow(seconds=30)
def test_greedy_text_equals_transformers_generate(tmp_path, capsys):
  """The program (a process, JAX_PLATFORMS unset as a user runs it) continues a prompt greedily
  with the run's newest checkpoint and its tokenizer; transformers' `generate` (greedy, the same
  max_new_tokens) on that checkpoint exported by `convert export-hf` gives the same tokens, one
  for one, past two sliding windows; `--step` (in process) picks an older checkpoint, which
  continues differently."""
  import torch
  import transformers

  from olmo3.convert.__main__ import main as convert_main

  run, cfg = _run(tmp_path)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  new = 32

  def sample(*argv: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "olmo3.sample", "--workdir", str(run), "--prompt", PROMPT,
         "--max_new_tokens", str(new), "--json", *argv],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TPU" not in done.stderr and "libtpu" not in done.stderr
    return json.loads(done.stdout)

  latest = sample()
  assert latest["step"] == 4
  prompt_ids, ids = latest["prompt_ids"], latest["ids"]
  assert len(prompt_ids) + len(ids) > 2 * cfg.sliding_window and len(prompt_ids) > 8

  assert convert_main(["export-hf", "--ckpt", str(run), "--out", str(tmp_path / "hf")]) == 0
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  assert tokenizer(PROMPT)["input_ids"] == prompt_ids  # the run's own tokenizer
  reference = transformers.Olmo3ForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                            dtype=torch.float32)
  with torch.no_grad():
    out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
  expected = out[0, len(prompt_ids):].tolist()
  assert ids == expected
  assert latest["stop"] == ("eos" if expected[-1] == cfg.eos_token_id else "max_new_tokens")
  assert latest["text"] == tokenizer.decode(expected, skip_special_tokens=True)

  capsys.readouterr()  # export-hf's lines
  assert main(["--workdir", str(run), "--prompt", PROMPT, "--max_new_tokens", str(new),
               "--json", "--step", "2"]) == 0
  older = json.loads(capsys.readouterr().out)
  assert older["step"] == 2 and older["prompt_ids"] == prompt_ids and older["ids"] != ids
