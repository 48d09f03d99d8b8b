"""python -m olmo3.inspect_step --workdir RUN --step N [--tokens] [--chars C] [--json]
                         [--replay [--from_step S] [--per_token] [--top K]]

What global step N of a run trained on, row by row: each row's instance (its index in the
epoch's order), source label, token file and offset (one span per document for stage 3's
packed instances), whether the repetition filter masked it, and its text decoded with the run's
tokenizer (--tokens: the ids). Read through the loader's own code with the experiment revision
that trained step N (olmo3/run/record.py's rule), for any step of the stage, trained or not,
from local, bucket or HTTP data; nothing is trained and nothing is written.

--replay trains the step again (olmo3/train/replay.py): it restores the newest checkpoint
before N (--from_step S: checkpoint S, 0 for the stage's start), runs the steps up to N on the
mesh the run trained them on (the first devices here), and reports step N's loss, CE, gradient
norm and skip decision beside the logged ones, what they are expected to equal them to and why
(bit for bit where every sum runs in the run's order: on CPU also after a run of several
processes, whose cross-process collectives the replay then takes; else to float rounding), and
each row's loss with the parameters the step started from (--per_token: every position's;
--top K: only the K highest-loss rows, highest first).

The text shows the first C characters of each row (--chars, default 240; 0: all of it).
--json prints one JSON object: {"workdir", "step", "data_step", "experiment", "rows": [{"row",
"instance", "source", "spans": [{"file", "offset", "tokens"}], "filtered", "text" (a string
per span) | "tokens",
with --replay "loss", "scored_tokens" and with --per_token "token_losses"}], and with --replay
"loss", "ce_loss", "grad_norm", "skipped", "replay": {"from_step", "layout", "layout_from",
"run_layout", "expected" ("bit for bit" | "to float rounding"), "why", "logged", "matches_log"
(per logged metric: equal bit for bit)}}. Exit status 0; 2 for options that make no sense; 1
with one `error:` line for a step that cannot be read or replayed as asked (it says why and
what to ask instead).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
from etils import epath

from olmo3 import compilation_cache, program, xla_flags
from olmo3.config import ConfigError
from olmo3.eval.__main__ import load_experiment
from olmo3.io import pathnames
from olmo3.run import record

DEFAULT_CHARS = 240


MAX_STEP = 2**48  # step x batch x sequence length stays within 64 bits


def _mistake(args: argparse.Namespace) -> str | None:
  """What is wrong with the options themselves, if anything."""
  if args.step < 1:
    return f"--step {args.step}: steps count from 1"
  for flag, step in (("--step", args.step), ("--from_step", args.from_step)):
    if step is not None and step > MAX_STEP:  # numpy's positions are 64-bit
      return f"{flag} {step}: larger than any run's steps (at most 2**48)"
  needs_replay = [f for f, v in (("--from_step", args.from_step is not None),
                                 ("--per_token", args.per_token), ("--top", args.top is not None))
                  if v]
  if needs_replay and not args.replay:
    return f"{', '.join(needs_replay)} needs --replay (the losses come from replaying the step)"
  if args.top is not None and args.top < 1:
    return f"--top {args.top}: must be at least 1"
  if args.chars < 0:
    return f"--chars {args.chars}: must be >= 0 (0: the whole text)"
  if not epath.Path(args.workdir).is_dir():
    return f"--workdir {args.workdir}: no such run directory"
  return None


def _texts(exp, contents, tokens_only: bool) -> list[list[str] | None]:
  """Each row's text: one string per span (document), decoded with the run's tokenizer."""
  if tokens_only:
    return [None] * len(contents.rows)
  if exp.eval.tokenizer is None:
    raise SystemExit("error: the run's experiment names no tokenizer (EvalConfig.tokenizer): "
                     "use --tokens")
  from olmo3.data import sources, tokenizer as tokenizer_lib

  tokenizer = tokenizer_lib.load(sources.tokenizer_file(exp.eval.tokenizer),
                             what="the run's EvalConfig.tokenizer")
  out = []
  for row in contents.rows:
    ids = contents.batch["input_ids"][row.row]
    at, texts = 0, []
    for span in row.spans:
      texts.append(tokenizer.decode(ids[at:at + span.tokens].tolist(),
                                    skip_special_tokens=False))
      at += span.tokens
    out.append(texts)
  return out


def _float(x: float) -> float | str:
  return x if math.isfinite(x) else str(x)


def report(args: argparse.Namespace) -> dict[str, Any]:
  """The JSON object (module docstring) of what step `args.step` trained on."""
  from olmo3.data import step_contents
  from olmo3.run.plan import RunPlan
  from olmo3.train import logs, replay

  exp = load_experiment(args.workdir, args.step)
  # The run's compiler flags, before JAX starts its backends: another flag set may compile
  # the step into another program, whose sums round differently.
  xla_flags.apply_to_environ(exp.xla_flags, exp.libtpu_flags, exp.env)
  if args.replay and (cache := compilation_cache.directory()):
    compilation_cache.enable(cache)  # the launcher's: its compiled train step is there
  plan = RunPlan.build(exp, args.workdir)
  done = None
  if args.replay:
    logs.for_a_program()  # the replay's phases say they are running (minutes to compile)
    replay.use_the_runs_collectives(plan, args.step, args.from_step)  # before JAX starts
    with _stdout_to_stderr():
      done = replay.replay_verified(plan, args.step, args.from_step, per_token=args.per_token)
  # Train step N reads data step N - 1 + an offset: the replay's own, else its launch's.
  data_step = (done.data_step if done is not None
               else replay.listed_position(plan, args.step).data_step(args.step - 1))
  contents = step_contents.read(exp.data, plan.train_files, data_step)
  texts = _texts(exp, contents, args.tokens)
  rows = []
  for row, text in zip(contents.rows, texts):
    item: dict[str, Any] = {
        "row": row.row, "instance": row.instance, "source": row.source,
        "spans": [{"file": s.file, "offset": s.offset, "tokens": s.tokens} for s in row.spans],
        "filtered": row.filtered}
    if text is None:
      item["tokens"] = contents.batch["input_ids"][row.row].tolist()
    else:
      item["text"] = text
    rows.append(item)
  out: dict[str, Any] = {
      "workdir": os.fspath(pathnames.absolute(args.workdir)), "step": args.step,
      "data_step": data_step, "past_end": args.step > plan.end,
      "experiment": os.fspath(record.experiment_file(args.workdir, args.step).name),
      "rows": rows}
  if done is None:
    return out
  origin = done.origin  # (a damaged checkpoint: the one before it)
  for item, loss, n in zip(rows, done.row_loss, done.row_tokens):
    item["loss"], item["scored_tokens"] = _float(float(loss)), int(n)
  if done.token_nll is not None:
    for item, nll in zip(rows, done.token_nll):
      item["token_losses"] = nll.tolist()
  if args.top is not None:
    order = np.argsort(-np.nan_to_num(done.row_loss, nan=-np.inf), kind="stable")
    out["rows"] = [rows[i] for i in order[:args.top]]
  out.update({k: _float(done.metrics[k]) for k in ("loss", "ce_loss", "grad_norm")})
  out["skipped"] = bool(done.metrics["skipped"])
  out["replay"] = {"from_step": origin.from_step, "layout": done.layout,
                   "layout_from": origin.layout_from.value, "run_layout": origin.layout,
                   "expected": done.expected.value, "why": done.why,
                   "logged": done.logged and {k: _float(v) for k, v in done.logged.items()},
                   "matches_log": done.matches_log()}
  return out


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
  """Whatever is written to file descriptor 1 meanwhile goes to 2: gloo's C++ prints a line per
  rank on stdout as its collectives connect, and stdout is the report's (--json)."""
  sys.stdout.flush()
  saved = os.dup(1)
  os.dup2(2, 1)
  try:
    yield
  finally:
    sys.stdout.flush()
    os.dup2(saved, 1)
    os.close(saved)


def _show(text: str, chars: int) -> str:
  if chars and len(text) > chars:
    return text[:chars].replace("\n", "\\n") + f"... ({len(text) - chars:,} more characters)"
  return text.replace("\n", "\\n") if chars else text


def lines(out: dict[str, Any], chars: int) -> list[str]:
  """The report for people."""
  rows = out["rows"]
  said = [f"step {out['step']} of {out['workdir']} ({out['experiment']}): data step "
          f"{out['data_step']} of the global order, {len(rows)} rows"
          + (" (past the stage's end)" if out["past_end"] else "")]
  if "replay" in out:
    r = out["replay"]
    layout = r["layout"]
    start = f"checkpoint {r['from_step']}" if r["from_step"] else "the stage's start"
    said.append(f"replayed from {start} on {layout['devices']} {layout['device_kind']} "
                f"device(s), mesh {layout['mesh'] or '{}'} (the run's: {r['layout_from']})")
    said.append(f"against the log, expected {r['expected']}: {r['why']}")
    logged, matches = r["logged"] or {}, r["matches_log"]
    exact = r["expected"] == "bit for bit"
    for k in ("loss", "ce_loss", "grad_norm", "skipped"):
      value = out[k]
      if k in logged:
        finite = all(isinstance(v, (bool, int, float)) for v in (value, logged[k]))
        verdict = ("equal" if matches.get(k) else
                   f"differs by {float(value) - logged[k]:.3g}" if finite else "differs")
        if exact and not matches.get(k):
          verdict += (" (not bit for bit: another state, batch, program or machine than "
                      "the run's)")
        said.append(f"  {k:<9} {value!s:<22} logged {logged[k]!s:<22} {verdict}")
      else:
        said.append(f"  {k:<9} {value!s:<22} (not logged)")
  for item in rows:
    head = (f"row {item['row']}: instance {item['instance']}, source {item['source']}"
            + (", masked by the repetition filter" if item["filtered"] else ""))
    if "loss" in item:
      head += f", loss {item['loss']:.4f} over {item['scored_tokens']} tokens" if isinstance(
          item["loss"], float) else f", loss {item['loss']}"
    said.append(head)
    texts = item.get("text")
    for i, span in enumerate(item["spans"]):
      end = span["offset"] + span["tokens"]
      said.append(f"  {span['file']} tokens {span['offset']:,}..{end:,}")
      if texts is not None:
        said.append(f"    | {_show(texts[i], chars)}")
    if "tokens" in item:
      said.append(f"    ids {item['tokens']}")
    if "token_losses" in item:
      losses = np.asarray(item["token_losses"])
      worst = np.argsort(-losses, kind="stable")[:5]
      said.append("    highest-loss positions: " + ", ".join(
          f"{int(p)} ({losses[p]:.3f})" for p in worst))
  return said


def main(argv: list[str] | None = None) -> int:
  parser = program.parser("python -m olmo3.inspect_step", __doc__)
  parser.add_argument("--workdir", required=True, help="the run's workdir (a path or URL)")
  parser.add_argument("--step", type=int, required=True, help="the global step, from 1")
  parser.add_argument("--tokens", action="store_true", help="token ids instead of text")
  parser.add_argument("--chars", type=int, default=DEFAULT_CHARS,
                      help="characters of each row's text shown (0: all)")
  parser.add_argument("--replay", action="store_true", help="train the step again")
  parser.add_argument("--from_step", type=int, default=None,
                      help="the checkpoint the replay starts from (0: the stage's start)")
  parser.add_argument("--per_token", action="store_true", help="each position's loss too")
  parser.add_argument("--top", type=int, default=None, help="only the K highest-loss rows")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  args = parser.parse_args(argv)
  mistake = _mistake(args)
  if mistake:
    print(f"error: {mistake}", file=sys.stderr)
    return 2
  out = report(args)
  print(json.dumps(out) if args.json else "\n".join(lines(out, args.chars)))
  return 0


def _one_line_errors() -> tuple[type[BaseException], ...]:
  """What this program reports as one `error:` line (OLMO3_TRACEBACK=1 shows the traceback):
  a step that cannot be read or replayed as asked, a run's files that cannot be used, the
  storage's failures."""
  from olmo3.data.tokens import DataError
  from olmo3.io.checkpoint import CheckpointError
  from olmo3.train.replay import ReplayError

  return (ReplayError, ConfigError, CheckpointError, DataError, record.RecordError, OSError)


if __name__ == "__main__":
  sys.exit(program.reported(main, _one_line_errors)())
