"""Two launchers racing for one workdir, 20 rounds on each store: a local disk, S3 (moto's
server) and GCS (fake-gcs-server), each a real server on this machine (harness/storage_servers).

  python benchmarks/launch_race.py [--rounds 20] [--stores local,s3,gs] [--repo DIR]

A round starts the same tiny command twice at once on one workdir, a new one in even rounds, the
run the round before left extended (a resume) in odd ones; the winner's files must be whole
afterwards: its record, every metric row once, its events, its last checkpoint, no lease or
temporary file left (harness/launch_race.py). `--repo DIR` runs the launcher of another checkout
(the commit before a fix, say: `git archive <commit> | tar -x -C DIR`). Each launch is a fresh
`python launch/main.py`. Prints a Markdown table (a row per store) and one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # harness/ (the race, the storage servers)

from harness import launch_race  # noqa: E402
from olmo3 import platforms  # noqa: E402


def main() -> None:
  platforms.choose()  # first, as every program: the launches it starts run on the CPU here
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--stores", default=",".join(launch_race.STORES))
  parser.add_argument("--repo", default=ROOT, help="the checkout whose launcher races")
  args = parser.parse_args()
  summary = {}
  for kind in args.stores.split(","):
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"race-{kind}-") as scratch:
      start = launch_race.subprocess_start(os.path.join(scratch, "logs"),
                                           os.path.abspath(args.repo))
      os.makedirs(os.path.join(scratch, "logs"))
      rounds = launch_race.race(
          kind, scratch, args.rounds, start,
          report=lambda r: print(f"{r.store} round {r.number} ({'resumed' if r.resumed else 'new'}"
                                 f"): {', '.join(r.outcomes)}; "
                                 + "; ".join(r.failures + r.problems or ("whole",)),
                                 file=sys.stderr, flush=True))
    summary[kind] = {
        "rounds": len(rounds), "whole": sum(r.whole for r in rounds),
        "whole_new": sum(r.whole for r in rounds if not r.resumed),
        "whole_resumed": sum(r.whole for r in rounds if r.resumed),
        "outcomes": dict(collections.Counter(o for r in rounds for o in r.outcomes)),
        "failures": [f"round {r.number}: {f}" for r in rounds for f in r.failures],
        "problems": [f"round {r.number}: {p}" for r in rounds for p in r.problems],
        "seconds": round(time.monotonic() - began, 1)}
  print("| store | rounds | winner's files whole (new / resumed) | launches: outcomes | "
        "launches failed | wall |")
  print("|---|---|---|---|---|---|")
  for kind, s in summary.items():
    outcomes = ", ".join(f"{n} {o}" for o, n in sorted(s["outcomes"].items()))
    print(f"| {kind} | {s['rounds']} | {s['whole']} ({s['whole_new']} / {s['whole_resumed']}) | "
          f"{outcomes} | {len(s['failures'])} | {s['seconds']:.0f} s |")
  print(json.dumps({"repo": os.path.abspath(args.repo), "stores": summary}))


if __name__ == "__main__":
  main()
