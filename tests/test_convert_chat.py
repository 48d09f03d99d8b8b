"""The chat template kept whole to the export: `export-hf` of a run whose data was prepared with a
chat template writes it (tokenizer_config.json's `chat_template` and chat_template.jinja) with
the special tokens, and transformers' `apply_chat_template` on the export gives exactly the ids
`olmo3.data.chat` makes (what `prepare --chat` writes), for conversations with and without a
system prompt, multi-turn, unicode; `import-hf` keeps an HF directory's template and tokenizer
so that a later export writes them again."""

import json

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from olmo3 import config
from olmo3.convert import hf, tokenizer_files
from olmo3.convert.__main__ import main as convert_main
from olmo3.data import chat
from olmo3.io import checkpoint

from hf_reference import save_transformers_model
from data_helpers import chat_tokenizer

MICRO = config.olmo3_micro()
CONVERSATIONS = [
    [{"role": "user", "content": "What does os.path.join do?"},
     {"role": "assistant", "content": "It joins path parts with the separator."}],
    [{"role": "system", "content": "You answer in one line."},
     {"role": "user", "content": "Name a sorting algorithm."},
     {"role": "assistant", "content": "<think>easy</think>Merge sort."},
     {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "Heapsort."}],
    [{"role": "user", "content": "Übersetze: 日本語のテキスト 🙂 — «ça va?»"},
     {"role": "assistant", "content": "Japanischer Text 🙂, „geht es?“"},
     {"role": "user", "content": "Danke!\n\nUnd jetzt?"}],
]




def _chat_run(tmp_path, turns_whole: bool):
  """A run as the launcher leaves one, on a directory as `prepare --chat` makes one: its
  manifest records the template (name, sha256, text); tokenizer.json and tokenizer_config.json
  beside."""
  data = tmp_path / "chat_data"
  data.mkdir()
  tok_file = chat_tokenizer(data / "tokenizer.json", turns_whole)
  template = chat.ChatTemplate.named("olmo3_think")
  (data / "manifest.json").write_text(json.dumps(  # the part of a manifest export-hf reads
      {"kind": "chat", "chat": {"template": tokenizer_files.template_entry(template)}}))
  (data / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                           "pad_token": "<|pad|>"}))
  exp = config.Experiment(model=MICRO, data=config.DataConfig(mix=str(data), seq_len=128),
                          eval=config.EvalConfig(tokenizer=tok_file))
  run = tmp_path / "run"
  run.mkdir()
  (run / "experiment.json").write_text(json.dumps(exp.to_dict()))
  save_transformers_model(tmp_path / "hf", MICRO)
  _, params, _ = hf.read_hf_dir(tmp_path / "hf")
  checkpoint.save_model(run / "checkpoints" / "3", MICRO, params)
  tokenizer = Tokenizer.from_file(tok_file)
  ours = chat.Chat(template, tokenizer, chat.special_tokens(tokenizer, MICRO.eos_token_id))
  return run, template, ours


@pytest.mark.parametrize("turns_whole", [True, False], ids=["special_turns", "split_turns"])
def test_transformers_renders_the_export_as_the_data_was_made(tmp_path, capsys, turns_whole):
  run, template, ours = _chat_run(tmp_path, turns_whole)
  out = tmp_path / "exported"
  assert convert_main(["export-hf", "--ckpt", str(run), "--out", str(out)]) == 0
  assert f"chat template: olmo3_think (sha256 {template.sha256[:12]})" in capsys.readouterr().out
  assert (out / "chat_template.jinja").read_bytes() == template.text.encode()
  written = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
  assert written["chat_template"] == template.text
  assert (written["eos_token"], written["pad_token"]) == ("<|endoftext|>", "<|pad|>")
  theirs = AutoTokenizer.from_pretrained(str(out))
  for messages in CONVERSATIONS:
    for prompt in (False, True):
      expected = ours.ids(messages, add_generation_prompt=prompt)
      got = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt,
                                       return_dict=False)
      assert list(got) == expected, (messages, prompt)
  # The ids `prepare --chat` writes: the conversation's, the template's EOS ending it.
  ids, _ = ours.encode(CONVERSATIONS[1], max_tokens=10_000)
  assert ids[-1] == MICRO.eos_token_id
  assert (theirs.convert_tokens_to_ids("<|im_end|>") not in (None, theirs.unk_token_id)
          ) == turns_whole


def test_a_named_template_overrides_and_a_bad_one_is_one_line(tmp_path, capsys):
  run, _, _ = _chat_run(tmp_path, turns_whole=True)
  jinja = tmp_path / "mine.jinja"
  jinja.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
  out = tmp_path / "exported"
  assert convert_main(["export-hf", "--ckpt", str(run), "--out", str(out),
                       "--chat_template", str(jinja)]) == 0
  assert (out / "chat_template.jinja").read_text() == jinja.read_text()
  capsys.readouterr()
  assert convert_main(["export-hf", "--ckpt", str(run), "--out", str(tmp_path / "o2"),
                       "--chat_template", "nope"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: --chat_template 'nope': not a template")
  assert not (tmp_path / "o2").exists()


def test_import_hf_keeps_the_template_and_tokenizer_for_the_export(tmp_path, capsys):
  """An HF chat model (transformers' own save_pretrained: tokenizer.json, tokenizer_config.json,
  chat_template.jinja) imported and exported again renders every conversation as before."""
  src = tmp_path / "hf"
  save_transformers_model(src, MICRO)
  tok = Tokenizer.from_file(chat_tokenizer(tmp_path / "tok.json", turns_whole=True))
  text = chat.ChatTemplate.named("olmo3_think").text
  PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                          chat_template=text).save_pretrained(str(src))
  before = AutoTokenizer.from_pretrained(str(src))
  assert convert_main(["import-hf", "--hf_dir", str(src), "--out", str(tmp_path / "ckpt")]) == 0
  assert "kept: tokenizer, chat template tokenizer (sha256" in capsys.readouterr().out
  assert convert_main(["export-hf", "--ckpt", str(tmp_path / "ckpt"), "--out",
                       str(tmp_path / "out")]) == 0
  after = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  assert after.chat_template == text
  for messages in CONVERSATIONS:
    assert (after.apply_chat_template(messages, tokenize=True, return_dict=False)
            == before.apply_chat_template(messages, tokenize=True, return_dict=False))
