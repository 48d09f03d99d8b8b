"""Every user mistake through the real launch programs ends in one line that names the field,
file or experiment and says what to do; no traceback, nothing half-created.

One driver process (this file run as a script) imports the programs' dependencies once and, for
each case, forks a child that runs the program as the interpreter would (tests/forked.py's
`run_as_main`: launch/main.py, launch/diff.py, launch/audit.py as __main__, or
`python -m olmo3.eval`) with its own argv, working directory and captured output. Every case
stops before JAX starts a backend, so forking is safe, and the cases cost one interpreter start
instead of one each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import forked  # beside this file (the driver runs as a script)
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELP = "Run 'python launch/main.py --help' for the flags."
TINY = "--fdl_config=experiments.olmo3_tiny:stage1"


def drive(cases: list[dict], out_dir: str) -> list[dict]:
  """Forks one child per case; returns each case's exit code and output."""
  return [forked.run(case["program"], case["argv"], case["cwd"],
                     os.path.join(out_dir, f"{i}.out"), case.get("env"))
          for i, case in enumerate(cases)]


def _cases(tmp) -> list[dict]:
  """(program, argv, what the output must hold, exit code, paths that must not exist)."""
  afile = tmp / "afile"
  afile.write_text("")
  (tmp / "root").mkdir()
  (tmp / "fresh").mkdir()  # stage 2's cwd: no runs/ below it
  new = lambda name: os.fspath(tmp / name)  # a workdir no case may leave behind
  config_error = lambda message: {"last_two": [message, HELP]}
  return [
      dict(name="workdir is a file", program="main", argv=[TINY, f"--workdir={afile}"],
           expect={"last": f"error: --workdir={afile} is a file, not a directory: give a "
                           "directory (a new one is created)"}),
      dict(name="workdir below a file", program="main", argv=[TINY, f"--workdir={afile}/run"],
           expect={"last": f"error: --workdir={afile}/run: {afile} is a file, so the directory "
                           "cannot be created there"}),
      dict(name="workdir over HTTP", program="main", argv=[TINY, "--workdir=https://h/run"],
           expect={"last": "error: --workdir https://h/run: https:// is read-only; a workdir or "
                           "anything written must be a local path, gs:// or s3://"}),
      dict(name="stage 2 before stage 1", program="main", cwd=new("fresh"),
           argv=["--fdl_config=experiments.olmo3_tiny:stage2"], absent=[new("fresh/runs")],
           expect={"last": "error: CheckpointConfig.init_from='runs/olmo3_tiny.stage1' holds no "
                           "checkpoint yet: train it first: python launch/main.py "
                           "--fdl_config=experiments.olmo3_tiny:stage1 (or point "
                           "checkpoint.init_from at a checkpoint that exists)"}),
      dict(name="missing token file", program="main", absent=[new("w_tokens")],
           argv=[TINY, f"--workdir={new('w_tokens')}", "--fdl_set=data.mix=None",
                 f"--fdl_set=data.paths=('{tmp / 'nope.npy'}',)"],
           expect={"last": f"error: token file {tmp / 'nope.npy'} does not exist"}),
      dict(name="data.root missing", program="main", absent=[new("w_root")],
           argv=[TINY, f"--workdir={new('w_root')}", f"--fdl_set=data.root='{tmp / 'nope'}'"],
           expect={"last": f"error: DataConfig.root='{tmp / 'nope'}' does not exist: give the "
                           "directory (or URL) the token files are under"}),
      dict(name="data.root unused", program="main", absent=[new("w_unused")],
           argv=[TINY, f"--workdir={new('w_unused')}", f"--fdl_set=data.root='{tmp / 'root'}'"],
           expect={"last": f"error: DataConfig.root='{tmp / 'root'}' is not used: "
                           "DataConfig.mix='embedded' is a prepared directory (or the built-in "
                           "corpus), which names its own files. Drop data.root, or give "
                           "data.paths or a mix file relative to it"}),
      dict(name="heartbeat timeout not a number", program="main",
           argv=[TINY, f"--workdir={new('w_heartbeat')}"], absent=[new("w_heartbeat")],
           env={"OLMO3_HEARTBEAT_TIMEOUT_S": "soon"},
           expect={"last": "error: OLMO3_HEARTBEAT_TIMEOUT_S='soon': expected a positive "
                           "number of seconds"}),
      dict(name="steps a string", program="main", argv=[TINY, "--fdl_set=train.steps='ten'"],
           expect=config_error("error: TrainConfig.steps='ten': must be an integer (int), "
                               "not str")),
      dict(name="steps a float", program="main", argv=[TINY, "--fdl_set=train.steps=2.5"],
           expect=config_error("error: TrainConfig.steps=2.5: must be an integer (int), "
                               "not float")),
      dict(name="misspelt experiment", program="main",
           argv=["--fdl_config=experiments.olmo3_tiny:stagee1"],
           expect=config_error("error: --fdl_config='experiments.olmo3_tiny:stagee1': "
                               "experiments.olmo3_tiny has no experiment 'stagee1'; did you "
                               "mean 'stage1'? experiments: memorize, sft, stage1, stage2, stage3")),
      dict(name="the 7B without data.root", program="main",
           argv=["--fdl_config=experiments.olmo3_7b:stage1", f"--workdir={new('seven')}"],
           absent=[new("seven")],
           expect={"last": "error: DataConfig.mix='OLMo-mix-0625-official' is a named mix of "
                           "AI2's token files, listed relative to where they are stored: set "
                           "DataConfig.root to that directory or URL "
                           "(--fdl_set=data.root='\"gs://bucket/olmo3-data\"')"}),
      dict(name="a config field as a flag", program="main", argv=[TINY, "--steps=5"],
           expect=config_error("error: unknown flag --steps: a config field is set with "
                               "--fdl_set, e.g. --fdl_set=train.steps=VALUE")),
      dict(name="a module without its experiment", program="main",
           argv=["--fdl_config=experiments.olmo3_tiny"],
           expect=config_error("error: --fdl_config='experiments.olmo3_tiny' names a module: add "
                               "':' and one of its experiments, e.g. "
                               "--fdl_config=experiments.olmo3_tiny:stage1 (it defines memorize, "
                               "sft, stage1, stage2, stage3)")),
      dict(name="misspelt module", program="main",
           argv=["--fdl_config=experiments.olmo3_tin:stage1"],
           expect=config_error("error: --fdl_config='experiments.olmo3_tin:stage1': no module "
                               "'experiments.olmo3_tin'; did you mean 'experiments.olmo3_tiny'? "
                               "experiment modules: experiments.olmo3_7b, "
                               "experiments.olmo3_tiny")),
      dict(name="misspelt fiddler", program="main",
           argv=["--fdl_config=experiments.olmo3_7b:stage1", "--fiddler=single_cosin"],
           expect=config_error("error: --fiddler='single_cosin': experiments.olmo3_7b has no "
                               "fiddler 'single_cosin'; did you mean 'single_cosine'? fiddlers: "
                               "flag_set, gpu, single_cosine")),
      dict(name="no experiment", program="main", argv=[],
           expect=config_error("error: --fdl_config is required, e.g. "
                               "experiments.olmo3_tiny:stage1")),
      dict(name="stray argument", program="main", argv=[TINY, "stage1"],
           expect=config_error("error: unexpected arguments: ['stage1'] (every option is a "
                               "--flag)")),
      dict(name="misspelt flag", program="main", argv=[TINY, "--fdl_sett=train.steps=3"],
           expect=config_error("error: unknown flag --fdl_sett; did you mean --fdl_set?")),
      dict(name="diff of a missing run", program="diff",
           argv=[new("no_run"), "experiments.olmo3_tiny:stage1"],
           expect={"last": f"error: {tmp / 'no_run'}: no such run directory"}),
      dict(name="diff of a bare name", program="diff",
           argv=["norun", "experiments.olmo3_tiny:stage1"],
           expect={"last": "error: 'norun' is neither a run directory (none is there) nor an "
                           "experiment reference (package.module:function)"}),
      dict(name="diff of one side", program="diff", argv=["experiments.olmo3_tiny:stage1"],
           expect={"last_two": ["error: expected two experiments or run workdirs (A B), got "
                                "['experiments.olmo3_tiny:stage1']",
                                "Run 'python launch/diff.py --help' for usage."]}),
      dict(name="eval of a missing run", program="olmo3.eval", argv=["--workdir", new("no_run")],
           rc=2, expect={"last": f"error: --workdir {tmp / 'no_run'}: no such run directory"}),
      dict(name="prepare with a negative floor", program="olmo3.data.prepare", rc=2,
           argv=["--input", "x.jsonl", "--tokenizer", "t.json", "--out", new("prepared"),
                 "--heldout_min_documents", "-1"], absent=[new("prepared")],
           expect={"last": "error: --heldout_min_documents=-1: must be >= 0"}),
      # absl's --help exits 1 after printing the usage (its convention for every absl program).
      dict(name="audit's help", program="audit", argv=["--help"],
           expect={"contains": ["Audit an experiment's own input pipeline", "--processes:",
                                "--fdl_config:"]}),
      dict(name="the launcher's help", program="main", argv=["--help"],
           expect={"contains": ["Train an experiment.", "--fdl_set:", "--workdir:"]}),
  ]


@pytest.mark.slow(seconds=6)
def test_every_mistake_ends_in_one_line_and_leaves_nothing_behind(tmp_path):
  cases = _cases(tmp_path)
  (tmp_path / "cwd").mkdir()
  for case in cases:  # never the repository: a default workdir (runs/...) would land there
    case.setdefault("cwd", os.fspath(tmp_path / "cwd"))
  spec = tmp_path / "cases.json"
  spec.write_text(json.dumps([{"env": case.get("env", {}),
                               **{k: case[k] for k in ("program", "argv", "cwd")}}
                              for case in cases]))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run([sys.executable, __file__, os.fspath(spec), os.fspath(tmp_path)],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads(done.stdout)
  failures = []
  for case, result in zip(cases, results):
    output, lines = result["output"], result["output"].strip().splitlines()
    expect, problems = case["expect"], []
    if result["rc"] != case.get("rc", 1):
      problems.append(f"exit code {result['rc']}, expected {case.get('rc', 1)}")
    if "Traceback" in output:
      problems.append("a traceback")
    if "last" in expect and lines[-1:] != [expect["last"]]:
      problems.append(f"last line {lines[-1:]}, expected {expect['last']!r}")
    if "last_two" in expect and lines[-2:] != expect["last_two"]:
      problems.append(f"last lines {lines[-2:]}, expected {expect['last_two']}")
    if "last_two" in expect and len(lines) > 2:  # the help pointer, not the help
      problems.append(f"{len(lines)} lines: {lines[:3]}...")
    problems += [f"missing {text!r}" for text in expect.get("contains", ()) if text not in output]
    problems += [f"left {path} behind" for path in case.get("absent", ()) if os.path.exists(path)]
    if problems:
      failures.append(f"{case['name']}: {'; '.join(problems)}\n{output[-1500:]}")
  assert (tmp_path / "afile").read_text() == ""  # the file given as a workdir is untouched
  assert not any((tmp_path / "cwd").iterdir())  # no default workdir either
  assert not failures, "\n\n".join(failures)


if __name__ == "__main__":
  # The driver: what every program imports anyway, imported once (JAX starts no backend).
  import fiddle  # noqa: F401

  import launch.config_files  # noqa: F401
  import olmo3.io.checkpoint  # noqa: F401
  import olmo3.data.sources  # noqa: F401
  import olmo3.run.lease  # noqa: F401

  with open(sys.argv[1]) as f:
    print(json.dumps(drive(json.load(f), sys.argv[2])))
