"""python -m olmo3.sample --workdir RUN --prompt TEXT [--step S] [--max_new_tokens N]
                         [--temperature T] [--top_p P] [--seed K] [--json]
python -m olmo3.sample --workdir RUN --chat [--prompt TEXT]... [--messages JSON]
                         [--chat_template NAME|FILE] [options as above]

Continues TEXT with a run's checkpoint (default: its newest committed step), read with the
model and tokenizer of the experiment revision that wrote that step (olmo3/run/record.py's
rule, as `python -m olmo3.eval` reads it). Greedy unless --temperature > 0; stops at the
model's EOS or after --max_new_tokens. Prints the prompt and its continuation (stdout) and a
summary line (stderr); --json prints one JSON object instead: {"workdir", "step",
"prompt_ids", "ids" (the new tokens, the EOS included), "text" (theirs), "stop" ("eos" or
"max_new_tokens")}.

--chat: the prompt is a conversation, rendered with the chat template the run's data was
tokenized with (its data directory records it; --chat_template names another: a template
olmo3 ships, `tokenizer` for the tokenizer's own, or a .jinja file), the assistant's header
added; each reply ends at the template's end of turn (EOS, or <|im_end|>) and is appended to
the conversation as the assistant's message. --messages gives the conversation so far (a JSON
list of {"role", "content"}: system, user, assistant, environment); each --prompt is then a
user turn, answered in order; a conversation that ends with the user's turn is answered
first, and without either the session is interactive: a user turn a line from stdin until
it ends (Ctrl-D). Prints each reply (stdout) and a summary line (stderr); --json one JSON
object at the end: {"workdir", "step", "chat_template" ({"name", "sha256"}), "messages" (the
whole conversation), "turns" ([{"prompt_ids", "ids", "text", "stop" ("eos", "end_of_turn" or
"max_new_tokens")}])}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable

from etils import epath
from tokenizers import Tokenizer

from olmo3 import program
from olmo3.config import ConfigError, Experiment
from olmo3.convert import tokenizer_files
from olmo3.data import chat as chat_lib
from olmo3.eval.__main__ import load_experiment
from olmo3.io import pathnames
from olmo3.run import record
from olmo3.sample import chat


def _mistake(args: argparse.Namespace) -> str | None:
  """What is wrong with the options themselves, if anything."""
  prompts = args.prompt or []
  if not args.chat:
    for flag in ("messages", "chat_template"):
      if getattr(args, flag) is not None:
        return f"--{flag} needs --chat (a conversation)"
    if len(prompts) != 1:
      return ("--prompt: give the text to continue, once (several are user turns of --chat)"
              if prompts else "--prompt is required (or --chat for a conversation)")
  if any(not p for p in prompts):
    return "--prompt is empty: give the text to continue"
  if args.max_new_tokens < 1:
    return f"--max_new_tokens {args.max_new_tokens}: must be at least 1"
  if args.temperature < 0:
    return f"--temperature {args.temperature}: must be >= 0 (0: greedy)"
  if not 0 < args.top_p <= 1:
    return f"--top_p {args.top_p}: must be in (0, 1]"
  if args.top_p < 1 and args.temperature == 0:
    return "--top_p needs --temperature > 0 (greedy decoding takes the most likely token)"
  return None


def _parser() -> argparse.ArgumentParser:
  parser = program.parser("python -m olmo3.sample", __doc__)
  parser.add_argument("--workdir", required=True, help="the run's workdir")
  parser.add_argument("--prompt", action="append",
                      help="the text to continue; with --chat a user turn (repeat for more)")
  parser.add_argument("--chat", action="store_true",
                      help="the prompt is a conversation in the run's chat template")
  parser.add_argument("--messages", help="with --chat: the conversation so far, a JSON list of "
                                         "{\"role\", \"content\"}")
  parser.add_argument("--chat_template",
                      help="with --chat: a template olmo3 ships, 'tokenizer' (the tokenizer's "
                           "own) or a .jinja file (default: the one the run's data was "
                           "tokenized with)")
  parser.add_argument("--step", type=int, default=None, help="default: the latest checkpoint")
  parser.add_argument("--max_new_tokens", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
  parser.add_argument("--top_p", type=float, default=1.0,
                      help="nucleus sampling: draw among the most likely tokens whose "
                           "probabilities reach this (with --temperature > 0)")
  parser.add_argument("--seed", type=int, default=0, help="of the draws (with --temperature)")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  return parser


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  mistake = _mistake(args)
  if mistake is None and not epath.Path(args.workdir).is_dir():
    mistake = f"--workdir {args.workdir}: no such run directory"
  if mistake:
    print(f"error: {mistake}", file=sys.stderr)
    return 2

  from olmo3 import model as model_lib
  from olmo3.data import sources, tokenizer as tokenizer_lib
  from olmo3.io import checkpoint
  from olmo3 import decode

  directory = record.Workdir(args.workdir).checkpoints
  steps = checkpoint.run_steps(directory)
  if not steps:
    print(f"error: {args.workdir} has no checkpoint", file=sys.stderr)
    return 2
  step = steps[-1] if args.step is None else args.step
  if step not in steps:
    print(f"error: no checkpoint at step {step} (have {steps})", file=sys.stderr)
    return 2
  exp = load_experiment(args.workdir, step)
  if exp.eval.tokenizer is None:  # experiment.json holds the resolved experiment: not a run's
    print(f"error: {record.experiment_file(args.workdir, step)} names no tokenizer "
          "(EvalConfig.tokenizer)", file=sys.stderr)
    return 2
  tokenizer = tokenizer_lib.load(sources.tokenizer_file(exp.eval.tokenizer),
                             what="the run's EvalConfig.tokenizer")
  cfg = exp.model

  def generator() -> chat.Generate:
    """generate(prompt_ids, stop=None) -> the new ids, on the checkpoint's parameters (read
    once the options and the run's files have been checked)."""
    params = checkpoint.restore_params(directory / str(step),
                                       checkpoint.host_target(model_lib.param_shapes(cfg)))
    model = model_lib.from_params(cfg, params)
    sampling = decode.Sampling(args.temperature, args.top_p)
    return lambda ids, stop=None: decode.generate(model, ids, args.max_new_tokens, sampling,
                                                  args.seed, stop)

  run = _Run(args, exp, step, tokenizer, generator)
  return _chat(run) if args.chat else _continue(run)


@dataclasses.dataclass(frozen=True)
class _Run:
  """What both modes sample with: the options, the run's experiment and step, its tokenizer,
  and what builds the model's generate function (the checkpoint read)."""

  args: argparse.Namespace
  exp: Experiment
  step: int
  tokenizer: Tokenizer
  generator: Callable[[], chat.Generate]

  def header(self) -> dict:
    return {"workdir": os.fspath(pathnames.absolute(self.args.workdir)), "step": self.step}


def _continue(run: _Run) -> int:
  """The text mode: one prompt continued."""
  args, cfg, tokenizer = run.args, run.exp.model, run.tokenizer
  # As `prepare` tokenized the training documents: no special tokens (OLMo 3 has no BOS).
  prompt_ids = tokenizer.encode(args.prompt[0], add_special_tokens=False).ids
  if len(prompt_ids) + args.max_new_tokens > cfg.max_seq_len:
    print(f"error: the prompt ({len(prompt_ids)} tokens) and --max_new_tokens "
          f"{args.max_new_tokens} reach past the model's max_seq_len {cfg.max_seq_len} (the "
          "longest sequence it trained on): shorten either", file=sys.stderr)
    return 2
  ids = run.generator()(prompt_ids)
  stop = "eos" if ids[-1] == cfg.eos_token_id else "max_new_tokens"
  if args.json:
    print(json.dumps({**run.header(), "prompt_ids": prompt_ids, "ids": ids,
                      "text": tokenizer.decode(ids), "stop": stop}))
  else:
    # Decoded together: a character split between the prompt's last token and the first new
    # one comes out whole.
    print(tokenizer.decode(prompt_ids + ids))
    print(f"step {run.step}: {len(ids)} new tokens, stopped at "
          f"{'EOS' if stop == 'eos' else '--max_new_tokens'}", file=sys.stderr)
  return 0


def _chat(run: _Run) -> int:
  """The chat mode: a conversation in the run's chat template (olmo3.sample.chat)."""
  args, cfg = run.args, run.exp.model
  messages = chat.messages_given(args.messages)
  if not args.prompt and messages and not chat.awaits_reply(messages):
    print(f"error: --messages ends with the {messages[-1]['role']}'s turn, not the user's: add "
          "a --prompt to answer", file=sys.stderr)
    return 2
  config = tokenizer_files.config_beside(run.exp.eval.tokenizer)
  if args.chat_template is not None:
    template = chat_lib.ChatTemplate.named(args.chat_template, config)
  else:
    template = tokenizer_files.data_template(run.exp)
  if template is None:
    print(f"error: --chat: the run's data ({run.exp.data.mix or 'DataConfig.paths'}) has no chat "
          "template (a pretraining run?): name one with --chat_template (a template olmo3 ships: "
          f"{', '.join(chat_lib.shipped())}; 'tokenizer'; or a .jinja file)", file=sys.stderr)
    return 2
  renderer = chat_lib.Chat(template, run.tokenizer,
                           chat_lib.special_tokens(run.tokenizer, cfg.eos_token_id, config))
  end = chat.EndOfTurn.of(template, run.tokenizer, cfg.eos_token_id)
  interactive = not args.prompt and not messages
  turns: list[chat.Turn] = []

  def on_turn(turn: chat.Turn) -> None:
    turns.append(turn)
    if not args.json:
      print(turn.text, flush=True)

  def ask() -> None:
    if interactive and sys.stdin.isatty() and not args.json:
      print("user> ", end="", file=sys.stderr, flush=True)

  user_turns = chat.stdin_turns(sys.stdin, ask) if interactive else args.prompt or []
  messages = chat.converse(renderer, run.generator(), end, cfg.eos_token_id, messages,
                           user_turns, cfg.max_seq_len - args.max_new_tokens, on_turn)
  if args.json:
    print(json.dumps({**run.header(), "chat_template": chat.template_summary(template),
                      "messages": messages,
                      "turns": [dataclasses.asdict(t) for t in turns]}, ensure_ascii=False))
  print(f"step {run.step}: {len(turns)} turns ({template.name}), stopped at "
        f"{chat.stop_words(turns)}", file=sys.stderr)
  return 0


def _one_line_errors() -> tuple[type[BaseException], ...]:
  """What this program reports as one `error:` line (OLMO3_TRACEBACK=1 shows the traceback):
  a run's files that cannot be used (config, checkpoint, tokenizer, record), a conversation
  that outgrew the model, and the storage's failures."""
  from olmo3.data.tokens import DataError
  from olmo3.io.checkpoint import CheckpointError

  return (ConfigError, CheckpointError, DataError, chat.ChatError, record.RecordError, OSError)


if __name__ == "__main__":
  sys.exit(program.reported(main, _one_line_errors)())
