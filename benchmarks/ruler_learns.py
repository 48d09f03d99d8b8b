"""RULER shows a model learning retrieval, and one that does not: two tiny OLMo 3 runs through
the launcher, the same model, steps and schedule, one on a mixture that includes a retrieval
task, the other on text alone, RULER's needle tasks scored in the loop.

  python benchmarks/ruler_learns.py [--steps 300] [--length 512] [--needles 3000]
      [--text_docs N] [--only with_needles|text_only] [--global_only] [--out runs/ruler_learns]

The retrieval task is RULER's own single needle in noise (`niah_single_1`), generated at
`--length` tokens with another seed than the evaluation's (its instances never evaluated), each
with its answer after the prompt, written as documents beside the embedded corpus's text and
prepared (`python -m olmo3.data.prepare`) with the embedded tokenizer. Each run is the tiny
stage 1 at `--length` tokens a sequence (`--fdl_set`s, printed), evaluating niah_single_1 and
niah_multikey_2 at that length every quarter of the run. Prints each run's RULER per
evaluation (from its metrics.jsonl) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from olmo3 import platforms  # noqa: E402

TASKS = ("niah_single_1", "niah_multikey_2")


def corpus(path: str, needles: int, length: int, with_needles: bool, text_docs: int | None
           ) -> None:
  """JSONL documents: the embedded corpus's text (its first `text_docs` documents), and
  with_needles also `needles` RULER needle instances, each followed by its answer (seed 1000:
  not the evaluation's)."""
  from olmo3.data import embedded, sources, tokenizer as tokenizer_lib
  from olmo3.eval import ruler_tasks

  docs = [text for _, text in embedded.documents()][:text_docs]
  if with_needles:
    tokenizer = tokenizer_lib.load(sources.tokenizer_file("embedded"), "the embedded tokenizer")
    count = lambda text: len(tokenizer.encode(text).ids)
    for instance in ruler_tasks.generate("niah_single_1", length, needles, 1000, count):
      docs.append(f"{instance.prompt} {', '.join(instance.outputs)}.")
  with open(path, "w") as f:
    for text in docs:
      f.write(json.dumps({"text": text}) + "\n")


def run(name: str, out: str, steps: int, length: int, needles: int, with_needles: bool,
        text_docs: int | None, global_only: bool) -> dict:
  data = os.path.join(out, f"{name}.data")
  source = os.path.join(out, f"{name}.jsonl")
  if not os.path.exists(os.path.join(data, "manifest.json")):
    from olmo3.data import sources

    corpus(source, needles, length, with_needles, text_docs)
    subprocess.run([sys.executable, "-m", "olmo3.data.prepare", "--input", source,
                    "--tokenizer", sources.tokenizer_file("embedded"), "--out", data],
                   check=True, cwd=ROOT)
  workdir = os.path.join(out, name)
  sets = [f"--fdl_set=data.mix={json.dumps(data)}", f"--fdl_set=data.seq_len={length}",
          "--fdl_set=data.max_target_seq_len=None", f"--fdl_set=model.max_seq_len={length}",
          f"--fdl_set=train.steps={steps}", f"--fdl_set=optimizer.decay_steps={steps}",
          f"--fdl_set=train.eval_every={steps // 4}", "--fdl_set=eval.tasks=()",
          f"--fdl_set=eval.ruler.lengths=({length},)", f"--fdl_set=eval.ruler.tasks={TASKS}",
          "--fdl_set=eval.ruler.samples=16", f"--fdl_set=eval.ruler.prefill_chunk={length}",
          "--fdl_set=train.stop_at_epoch=None"]
  if global_only:  # every layer attends the whole sequence (the tiny model: one in four)
    sets.append("--fdl_set=model.global_every=1")
  command = [sys.executable, "launch/main.py", "--fdl_config=experiments.olmo3_tiny:stage1",
             f"--workdir={workdir}", *sets]
  print(" ".join(command), flush=True)
  start = time.time()
  subprocess.run(command, check=True, cwd=ROOT)
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  scores = {r["step"]: {k: v for k, v in r.items() if k.startswith("ruler/")}
            for r in rows if any(k.startswith("ruler/") for k in r)}
  return {"name": name, "seconds": round(time.time() - start), "ruler": scores}


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--needles", type=int, default=3000)
  parser.add_argument("--text_docs", type=int, default=None,
                      help="the embedded corpus's first N documents (default: all)")
  parser.add_argument("--only", choices=("with_needles", "text_only"), default=None)
  parser.add_argument("--global_only", action="store_true",
                      help="no sliding-window layers: every layer attends the whole sequence")
  parser.add_argument("--out", default=os.path.join(ROOT, "runs", "ruler_learns"))
  args = parser.parse_args(argv)
  platforms.choose()
  os.makedirs(args.out, exist_ok=True)
  results = [run(name, args.out, args.steps, args.length, args.needles, with_needles,
                 args.text_docs, args.global_only)
             for name, with_needles in (("with_needles", True), ("text_only", False))
             if args.only in (None, name)]
  for result in results:
    print(f"\n{result['name']} ({result['seconds']} s):")
    print("  step  " + "  ".join(f"{t:>16}" for t in TASKS))
    for step, scores in sorted(result["ruler"].items()):
      print(f"  {step:>4}  " + "  ".join(
          f"{100 * scores.get(f'ruler/{t}/{args.length}', float('nan')):>16.1f}" for t in TASKS))
  out = {"steps": args.steps, "length": args.length, "needles": args.needles, "runs": results}
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
