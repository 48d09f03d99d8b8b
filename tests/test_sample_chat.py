"""python -m olmo3.sample --chat: the conversation rendered with the run's chat template (the one
its data directory records, or --chat_template), the assistant's header added, each reply ended
at the template's end of turn (EOS; <|im_end|> as one token, or in the decoded text when the
tokenizer splits it) and appended to the conversation; a run without a template, and the
options' mistakes, are one `error:` line."""

import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

import forked
from olmo3 import config
from olmo3.data import chat as chat_lib
from olmo3.io import checkpoint
from olmo3.sample import chat
from olmo3.sample.__main__ import main

from conftest import random_params
from data_helpers import chat_tokenizer

MICRO = config.olmo3_micro()




def _run(tmp_path, chat_data: bool = True, silent: bool = False):
  """A run on a chat directory (its manifest records the template), or on plain text; wide
  random weights, or (`silent`) a final norm of zeros: every logit 0, so greedy picks id 0, the
  EOS, at once."""
  data = tmp_path / "data"
  data.mkdir(parents=True)
  tok_file = chat_tokenizer(data / "tokenizer.json")
  template = chat_lib.ChatTemplate.named("olmo3_think")
  manifest = {"kind": "chat", "chat": {"template": {"name": template.name, "text": template.text,
                                                    "sha256": template.sha256}}}
  (data / "manifest.json").write_text(json.dumps(manifest if chat_data else {"kind": "text"}))
  cfg = MICRO.replace(vocab_size=Tokenizer.from_file(tok_file).get_vocab_size(),
                      max_seq_len=512)
  exp = config.Experiment(model=cfg, data=config.DataConfig(mix=str(data), seq_len=128),
                          eval=config.EvalConfig(tokenizer=tok_file))
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  (run / "experiment.json").write_text(json.dumps(exp.to_dict()))
  params = random_params(cfg, 0)
  if silent:
    params["norm"]["weight"][:] = 0
  checkpoint.save_model(run / "checkpoints" / "1", cfg, params)
  tokenizer = Tokenizer.from_file(tok_file)
  renderer = chat_lib.Chat(template, tokenizer, chat_lib.special_tokens(tokenizer, 0))
  return run, renderer


@pytest.mark.slow(seconds=5)
def test_a_multi_turn_chat_through_the_program(tmp_path):
  """Two --prompt turns after a --messages system prompt: each turn's prompt is the template's
  rendering of the conversation so far with the assistant's header (the reply of turn 1 in it
  as an assistant message), each reply at most --max_new_tokens; --json's conversation ends
  with the last reply."""
  run, renderer = _run(tmp_path)
  system = [{"role": "system", "content": "Answer briefly. 日本語 ok 🙂"}]
  done = forked.completed("olmo3.sample", [
      "--workdir", str(run), "--chat", "--messages", json.dumps(system), "--prompt",
      "some words 3", "--prompt", "and more?", "--max_new_tokens", "6", "--json"],
      dict(os.environ), timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout)
  assert out["step"] == 1 and out["chat_template"]["name"] == "olmo3_think"
  first, second = out["turns"]
  so_far = [*system, {"role": "user", "content": "some words 3"}]
  assert first["prompt_ids"] == renderer.ids(so_far, add_generation_prompt=True)
  so_far += [{"role": "assistant", "content": first["text"]},
             {"role": "user", "content": "and more?"}]
  assert second["prompt_ids"] == renderer.ids(so_far, add_generation_prompt=True)
  assert out["messages"] == [*so_far, {"role": "assistant", "content": second["text"]}]
  for turn in (first, second):
    assert 1 <= len(turn["ids"]) <= 6 and turn["stop"] in ("eos", "end_of_turn",
                                                           "max_new_tokens")
  assert "step 1: 2 turns (olmo3_think), stopped at" in done.stderr


def test_the_reply_ends_at_eos_and_a_pretraining_run_needs_a_template(tmp_path, capsys):
  run, _ = _run(tmp_path, silent=True)
  assert main(["--workdir", str(run), "--chat", "--prompt", "hi", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["turns"][0]["ids"] == [0] and out["turns"][0]["stop"] == "eos"
  assert out["messages"][-1] == {"role": "assistant", "content": ""}

  text_run, _ = _run(tmp_path / "text", chat_data=False, silent=True)
  assert main(["--workdir", str(text_run), "--chat", "--prompt", "hi"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: --chat: the run's data") and (
      "has no chat template (a pretraining run?): name one with --chat_template" in err[0])
  assert main(["--workdir", str(text_run), "--chat", "--prompt", "hi", "--chat_template",
               "olmo3_think"]) == 0
  assert capsys.readouterr().out == "\n"  # the (empty) reply


def test_interactive_turns_come_from_stdin(tmp_path, capsys, monkeypatch):
  import io

  run, _ = _run(tmp_path, silent=True)
  monkeypatch.setattr("sys.stdin", io.StringIO("first\n\nsecond\n"))
  assert main(["--workdir", str(run), "--chat", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert [m["content"] for m in out["messages"] if m["role"] == "user"] == ["first", "second"]
  assert len(out["turns"]) == 2


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "a", "--prompt", "b"], "--prompt: give the text to continue, once (several "
                                         "are user turns of --chat)"),
    (["--prompt", "a", "--messages", "[]"], "--messages needs --chat (a conversation)"),
    (["--prompt", "a", "--chat_template", "olmo3_think"], "--chat_template needs --chat"),
    ([], "--prompt is required (or --chat for a conversation)"),
    (["--chat", "--messages", "{"], "--messages: not JSON"),
    (["--chat", "--messages", '[{"role": "bot", "content": "x"}]'], "--messages: message 0 has "
                                                                    "no role of"),
    (["--chat", "--messages", '[{"role": "user", "content": "x"}, {"role": "assistant", '
      '"content": "y"}]'], "--messages ends with the assistant's turn, not the user's: add a "
                         "--prompt"),
    (["--chat", "--prompt", "x", "--chat_template", "nope"], "--chat_template 'nope': not a "
                                                             "template olmo3 ships"),
])
def test_chat_mistakes_are_one_line(tmp_path, capsys, argv, message):
  from olmo3.sample.__main__ import _one_line_errors

  run, _ = _run(tmp_path, silent=True)
  try:
    code = main(["--workdir", str(run), *argv])
    lines = capsys.readouterr().err.strip().splitlines()
  except tuple(_one_line_errors()) as e:  # what the program's wrapper prints as one line
    code, lines = 2, [f"error: {e}"]
  assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
  return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("turns_whole", [True, False], ids=["one_token", "split"])
def test_end_of_turn_with_im_end_whole_or_split(tmp_path, turns_whole):
  """A model that answers "some words<|im_end|>\\n..." stops at <|im_end|>, whether the tokenizer
  holds it as one token (its id) or splits it (the decoded text); the reply appended to the
  conversation has no end-of-turn in it, and the next turn renders it as a past turn."""
  tokenizer = Tokenizer.from_file(chat_tokenizer(tmp_path / "tok.json", turns_whole))
  template = chat_lib.ChatTemplate.named("olmo3_think")
  renderer = chat_lib.Chat(template, tokenizer, chat_lib.special_tokens(tokenizer, 0))
  end = chat.EndOfTurn.of(template, tokenizer, eos_id=0)
  assert (end.text is None) == turns_whole
  answer = _ids(tokenizer, "some words<|im_end|>\nand more")
  prompts = []

  def generate(prompt_ids, stop):
    prompts.append(prompt_ids)
    new = []
    for token in answer:
      new.append(token)
      if stop(new):
        break
    return new

  turns = []
  messages = chat.converse(renderer, generate, end, 0, [], ["hello", "again"], 10_000,
                           turns.append)
  assert [t.text for t in turns] == ["some words", "some words"]
  assert [t.stop for t in turns] == ["end_of_turn"] * 2
  assert len(turns[0].ids) == len(_ids(tokenizer, "some words<|im_end|>"))
  assert prompts[1] == renderer.ids(messages[:3], add_generation_prompt=True)
  assert messages[1] == {"role": "assistant", "content": "some words"}
  with pytest.raises(chat.ChatError, match="reach past the model's max_seq_len"):
    chat.converse(renderer, generate, end, 0, [], ["hello"], 10, turns.append)
  np.testing.assert_array_equal(prompts[0][-3:], _ids(tokenizer, "<|im_start|>assistant\n")[-3:])
