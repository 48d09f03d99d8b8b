"""Two launchers racing for one workdir, on a local disk, in S3 (moto) or in GCS
(fake-gcs-server): benchmarks/launch_race.py runs 20 rounds a store, tests/test_launch_race.py a
few.

A round starts the same command twice at the same moment on the same workdir: a new workdir in
even rounds, the run the round before left, extended by `STEPS` steps (a resume), in odd ones.
One launch takes the workdir lease and trains; the other is refused by the lease (or, started
late, finds the run complete, or takes the lease once the first released it and finds nothing
left to train). Whatever the order, the winner's files must be whole (`check`): its record
(config, experiment, command, a history line per launch that trained), every metric row once,
its TensorBoard events, the last step's checkpoint, and no lease or temporary file left.
Before the fix, a refused launch took back "what it wrote" by removing what the workdir had
gained since it recorded itself: the winner's record, metrics, events and lease.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import urllib.error
from collections.abc import Callable, Iterator
from typing import Protocol

from harness import storage_servers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3  # each round trains this many steps: a new run 3, a resume 3 more
# The reliability tests' tiny run (half-length instances, one device, no evaluation): its
# programs are in the suite's compilation cache.
TINY = ["--fdl_config=experiments.olmo3_tiny:stage1", "--fdl_set=data.global_batch_size=8",
        "--fdl_set=data.seq_len=128", "--fdl_set=train.log_every=1",
        "--fdl_set=train.eval_every=0", "--fdl_set=eval.tasks=()",
        "--fdl_set=checkpoint.every=3"]
STORES = ("local", "s3", "gs")
# How a launch the lease refused says so (olmo3.run.lease.LeaseHeld), its last line.
REFUSED = re.compile(r"^error: \S+ (is in use by pid \d+ on host|: another launch took the "
                     r"lease .* at the same moment)")


class Launch(Protocol):
  """A launch under way: `finish()` waits for it and gives its exit code and its output."""

  def finish(self) -> tuple[int, str]: ...


Start = Callable[[list[str], dict[str, str]], Launch]  # (launcher's flags, environment)


@dataclasses.dataclass
class _Subprocess:
  proc: subprocess.Popen
  out: str

  def finish(self) -> tuple[int, str]:
    code = self.proc.wait(timeout=600)
    with open(self.out) as f:
      return code, f.read()


def subprocess_start(directory: str, root: str = ROOT) -> Start:
  """Launches as `python launch/main.py ...` of the checkout at `root`, each a fresh process,
  its output in a file under `directory`."""
  counter = iter(range(10**9))

  def start(argv: list[str], env: dict[str, str]) -> Launch:
    out = os.path.join(directory, f"{next(counter)}.log")
    with open(out, "w") as f:
      proc = subprocess.Popen([sys.executable, os.path.join(root, "launch", "main.py"), *argv],
                              cwd=root, env=dict(env, PYTHONPATH=root), stdout=f,
                              stderr=subprocess.STDOUT)
    return _Subprocess(proc, out)
  return start


# --- the workdir as the store holds it, read without the clients (no cache of this process's) ---


class _Files(Protocol):
  def names(self) -> list[str]: ...  # every file under the workdir, relative to it

  def read(self, name: str) -> bytes | None: ...


@dataclasses.dataclass(frozen=True)
class LocalFiles:
  root: str

  def names(self) -> list[str]:
    found = []
    for directory, _, files in os.walk(self.root):
      found += [os.path.relpath(os.path.join(directory, f), self.root) for f in files]
    return found

  def read(self, name: str) -> bytes | None:
    try:
      with open(os.path.join(self.root, name), "rb") as f:
        return f.read()
    except FileNotFoundError:
      return None


@dataclasses.dataclass(frozen=True)
class _GcsFiles:
  server: storage_servers.GcsServer
  bucket: str
  prefix: str

  def names(self) -> list[str]:
    return [n[len(self.prefix) + 1:] for n in self.server.list(self.bucket, self.prefix + "/")]

  def read(self, name: str) -> bytes | None:
    try:
      return self.server.read(self.bucket, f"{self.prefix}/{name}")
    except urllib.error.HTTPError as e:
      if e.code == 404:
        return None
      raise


class _S3Files:
  """Through a boto3 client of its own (moto refuses unsigned reads of objects)."""

  def __init__(self, env: dict[str, str], bucket: str, prefix: str):
    import boto3  # pylint: disable=import-outside-toplevel

    self.client = boto3.client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    self.bucket, self.prefix = bucket, prefix

  def names(self) -> list[str]:
    found = []
    pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                  Prefix=self.prefix + "/")
    for page in pages:
      found += [item["Key"][len(self.prefix) + 1:] for item in page.get("Contents", [])]
    return found

  def read(self, name: str) -> bytes | None:
    try:
      return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}")["Body"].read()
    except self.client.exceptions.NoSuchKey:
      return None


@dataclasses.dataclass(frozen=True)
class Store:
  """Where the workdirs go: `workdir(name)` (a path or URL), the environment that points the
  launcher at the store, and the files of a workdir as the store holds them."""

  kind: str
  base: str
  env: dict[str, str]
  files: Callable[[str], _Files]

  def workdir(self, name: str) -> str:
    return f"{self.base}/{name}"


@contextlib.contextmanager
def store(kind: str, scratch: str) -> Iterator[Store]:
  """A store of `kind` ("local", "s3", "gs") for the rounds, its server started (and ended)
  here; `scratch`: a local directory for the workdirs or the GCS emulator's objects."""
  if kind == "local":
    base = os.path.join(scratch, "runs")
    yield Store(kind, base, {}, lambda name: LocalFiles(os.path.join(base, name)))
  elif kind == "gs":
    os.makedirs(os.path.join(scratch, "gcs"), exist_ok=True)
    server = storage_servers.GcsServer(os.path.join(scratch, "gcs"))
    server.start()
    try:
      server.make_bucket("race")
      yield Store(kind, "gs://race", server.env,
                  lambda name: _GcsFiles(server, "race", name))
    finally:
      server.close()
  elif kind == "s3":
    server = storage_servers.S3Process()
    server.start()
    try:
      server.make_bucket("race")
      yield Store(kind, "s3://race", server.env,
                  lambda name: _S3Files(server.env, "race", name))
    finally:
      server.close()
  else:
    raise ValueError(f"store {kind!r}: one of {STORES}")


# --- a round -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Round:
  number: int
  store: str
  resumed: bool
  codes: tuple[int, ...]
  outcomes: tuple[str, ...]  # each launch's: trained / refused / complete / nothing left / failed
  failures: tuple[str, ...]  # the launches that failed: how each ended
  problems: tuple[str, ...]  # what is wrong with the workdir (empty: the winner's files whole)

  @property
  def whole(self) -> bool:
    return not self.problems


def _outcome(code: int, output: str) -> str | None:
  """What a launch of the race did, or None when that is no outcome a race may have."""
  lines = output.strip().splitlines()
  last = lines[-1] if lines else ""
  if code == 1:
    return "refused" if REFUSED.match(last) else None
  if code != 0:
    return None
  if "nothing to train, nothing written" in last:
    return "complete"  # started once the winner had finished: the plan found the run complete
  if "run complete: " in output:
    return "trained"
  return "nothing left"  # took the lease once the winner released it: nothing left to train


def check(files: _Files, steps: int, history_before: int, trained: int) -> list[str]:
  """What is wrong with the workdir a round left (nothing: the winner's files are whole)."""
  problems = []
  names = files.names()
  top = {n.split("/")[0] for n in names}
  history = _json_lines(files, "history.jsonl", problems)
  if len(history) != history_before + trained:
    problems.append(f"history.jsonl holds {len(history)} launches, expected "
                    f"{history_before + trained}")
  wanted = {"command.txt", "config.txt", "history.jsonl", "metrics.jsonl", "tensorboard",
            "checkpoints"}
  for launch in history:
    config = launch.get("config", "config.json")
    wanted |= {config, launch.get("experiment", "experiment.json"), config[:-len("json")] + "txt"}
  if wanted - top:
    problems.append(f"missing: {sorted(wanted - top)}")
  if top - wanted:
    problems.append(f"not the run's: {sorted(top - wanted)}")  # a lease, a temporary file
  losses = [r.get("step") for r in _json_lines(files, "metrics.jsonl", problems) if "loss" in r]
  if losses != list(range(1, steps + 1)):
    problems.append(f"metrics.jsonl's steps: {losses}, expected 1-{steps}")
  if f"checkpoints/{steps}/_CHECKPOINT_METADATA" not in names:
    problems.append(f"no checkpoint of step {steps}")
  if not any(n.startswith("tensorboard/events.") for n in names):
    problems.append("no TensorBoard event file")
  return problems


def _json_lines(files: _Files, name: str, problems: list[str]) -> list[dict]:
  """The file's JSON lines; one that is not a JSON object is a problem."""
  rows = []
  for number, line in enumerate((files.read(name) or b"").splitlines(), start=1):
    try:
      row = json.loads(line) if line.strip() else None
    except ValueError:
      row = "garbled"
    if row is not None and not isinstance(row, dict):
      problems.append(f"{name}:{number} is no JSON object: {line[:80]!r}")
    elif row is not None:
      rows.append(row)
  return rows


def race(kind: str, scratch: str, rounds: int, start: Start,
         base_env: dict[str, str] | None = None,
         report: Callable[[Round], None] = lambda r: None) -> list[Round]:
  """`rounds` rounds on a store of `kind` (new workdirs in even rounds, resumed in odd ones),
  each launch started by `start`; what each round left."""
  env = dict(os.environ if base_env is None else base_env,
             XLA_FLAGS="--xla_force_host_platform_device_count=1")
  results: list[Round] = []
  with store(kind, scratch) as where:
    env.update(where.env)
    for number in range(rounds):
      resumed = number % 2 == 1
      name = f"r{number - resumed}"
      steps = STEPS * (2 if resumed else 1)
      if resumed and (results[-1].problems or results[-1].failures):
        # The round before left no whole run to resume: one launch alone trains a new one.
        name = f"r{number}"
        code, output = start([*TINY, f"--fdl_set=train.steps={STEPS}",
                              f"--workdir={where.workdir(name)}"], env).finish()
        if code != 0:
          raise RuntimeError(f"a launch alone on {where.workdir(name)} failed: {output[-3000:]}")
      files = where.files(name)
      history_before = len([line for line in (files.read("history.jsonl") or b"").splitlines()
                            if line.strip()])
      argv = [*TINY, f"--fdl_set=train.steps={steps}", f"--workdir={where.workdir(name)}"]
      launches = [start(argv, env) for _ in range(2)]
      ended = [launch.finish() for launch in launches]
      outcomes = [_outcome(code, output) for code, output in ended]
      failures = [f"launch {i}: exit code {code}, ends {output.strip().splitlines()[-1:]}"
                  for i, ((code, output), outcome) in enumerate(zip(ended, outcomes))
                  if outcome is None]
      trained = outcomes.count("trained")
      problems = [f"{trained} launches trained"] if trained != 1 else []
      problems += check(files, steps, history_before, trained)
      results.append(Round(number, kind, resumed, tuple(c for c, _ in ended),
                           tuple(o or "failed" for o in outcomes), tuple(failures),
                           tuple(problems)))
      report(results[-1])
  return results
