"""python -m olmo3.sample --workdir RUN --prompt TEXT [--step S] [--max_new_tokens N]
                         [--temperature T] [--top_p P] [--seed K] [--json]

Continues TEXT with a run's checkpoint (default: its newest committed step), read with the
model and tokenizer of the experiment revision that wrote that step (olmo3/run/record.py's
rule, as `python -m olmo3.eval` reads it). Greedy unless --temperature > 0; stops at the
model's EOS or after --max_new_tokens. Prints the prompt and its continuation (stdout) and a
summary line (stderr); --json prints one JSON object instead: {"workdir", "step",
"prompt_ids", "ids" (the new tokens, the EOS included), "text" (theirs), "stop" ("eos" or
"max_new_tokens")}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from etils import epath

from olmo3 import program
from olmo3.config import ConfigError
from olmo3.eval.__main__ import load_experiment
from olmo3.io import pathnames
from olmo3.run import record


def _mistake(args: argparse.Namespace) -> str | None:
  """What is wrong with the options themselves, if anything."""
  if not args.prompt:
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


def main(argv: list[str] | None = None) -> int:
  parser = program.parser("python -m olmo3.sample", __doc__)
  parser.add_argument("--workdir", required=True, help="the run's workdir")
  parser.add_argument("--prompt", required=True, help="the text to continue")
  parser.add_argument("--step", type=int, default=None, help="default: the latest checkpoint")
  parser.add_argument("--max_new_tokens", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
  parser.add_argument("--top_p", type=float, default=1.0,
                      help="nucleus sampling: draw among the most likely tokens whose "
                           "probabilities reach this (with --temperature > 0)")
  parser.add_argument("--seed", type=int, default=0, help="of the draws (with --temperature)")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  args = parser.parse_args(argv)
  mistake = _mistake(args)
  if mistake is None and not epath.Path(args.workdir).is_dir():
    mistake = f"--workdir {args.workdir}: no such run directory"
  if mistake:
    print(f"error: {mistake}", file=sys.stderr)
    return 2

  from olmo3 import model as model_lib
  from olmo3.data import sources, tokenizer as tokenizer_lib
  from olmo3.io import checkpoint
  from olmo3.sample import decode

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
  cfg = exp.model
  if exp.eval.tokenizer is None:  # experiment.json holds the resolved experiment: not a run's
    print(f"error: {record.experiment_file(args.workdir, step)} names no tokenizer "
          "(EvalConfig.tokenizer)", file=sys.stderr)
    return 2
  tokenizer = tokenizer_lib.load(sources.tokenizer_file(exp.eval.tokenizer),
                             what="the run's EvalConfig.tokenizer")
  # As `prepare` tokenized the training documents: no special tokens (OLMo 3 has no BOS).
  prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
  if len(prompt_ids) + args.max_new_tokens > cfg.max_seq_len:
    print(f"error: the prompt ({len(prompt_ids)} tokens) and --max_new_tokens "
          f"{args.max_new_tokens} reach past the model's max_seq_len {cfg.max_seq_len} (the "
          "longest sequence it trained on): shorten either", file=sys.stderr)
    return 2

  params = checkpoint.restore_params(directory / str(step),
                                     checkpoint.host_target(model_lib.param_shapes(cfg)))
  ids = decode.generate(model_lib.from_params(cfg, params), prompt_ids, args.max_new_tokens,
                        decode.Sampling(args.temperature, args.top_p), args.seed)
  stop = "eos" if ids[-1] == cfg.eos_token_id else "max_new_tokens"
  if args.json:
    print(json.dumps({"workdir": os.fspath(pathnames.absolute(args.workdir)), "step": step,
                      "prompt_ids": prompt_ids, "ids": ids, "text": tokenizer.decode(ids),
                      "stop": stop}))
  else:
    # Decoded together: a character split between the prompt's last token and the first new
    # one comes out whole.
    print(tokenizer.decode(prompt_ids + ids))
    print(f"step {step}: {len(ids)} new tokens, stopped at "
          f"{'EOS' if stop == 'eos' else '--max_new_tokens'}", file=sys.stderr)
  return 0


def _one_line_errors() -> tuple[type[BaseException], ...]:
  """What this program reports as one `error:` line (OLMO3_TRACEBACK=1 shows the traceback):
  a run's files that cannot be used (config, checkpoint, tokenizer, record) and the storage's
  failures."""
  from olmo3.data.tokens import DataError
  from olmo3.io.checkpoint import CheckpointError

  return (ConfigError, CheckpointError, DataError, record.RecordError, OSError)


if __name__ == "__main__":
  sys.exit(program.reported(main, _one_line_errors)())
