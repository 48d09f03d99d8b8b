"""AI2's named mixes olmo3 ships (olmo3/data/mixes.py): the copies are ai2-olmo-core 3.0.0's
byte for byte, cover every name the 7B's stages use, are looked up after a user's own file of
that name and before ai2-olmo-core, travel in a wheel, and let the 7B's stage commands run
where ai2-olmo-core cannot be imported (the README's, the image's and SLURM's installs)."""

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile

import fiddle as fdl
import pytest

from launch import refs
from olmo3.data import mixes, sources
from tests import forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("experiments.olmo3_7b:stage1", "experiments.olmo3_7b:stage2")
LONG_CONTEXT = "OLMo-longmino-mix-0625"  # stage 3's, not in experiments/ yet


def _named_by_7b() -> set[str]:
  names = set()
  for ref in STAGES:
    exp = fdl.build(refs.resolve(ref))
    names |= {exp.data.mix, *exp.eval.heldout}
  return names


def test_each_shipped_list_is_ai2_olmo_core_s_byte_for_byte(tmp_path):
  assert importlib.metadata.version("ai2-olmo-core") == "3.0.0"  # the test extra's pin
  assert set(mixes.shipped()) == _named_by_7b() | {LONG_CONTEXT}
  assert _named_by_7b() == {"OLMo-mix-0625-official", "OLMo-midtraining-mix-0625-100B",
                            "v3-small-ppl-validation"}
  theirs = os.path.join(os.path.dirname(importlib.util.find_spec("olmo_core").origin), "data",
                        "mixes")
  for name in mixes.shipped():
    with open(mixes.find(name, olmo_core=False), "rb") as ours, open(
        os.path.join(theirs, name + ".txt"), "rb") as original:
      assert ours.read() == original.read(), f"{name}: python -m olmo3.data.mixes refreshes it"
  # The documented refresh writes the same bytes.
  assert mixes.regenerate(out=str(tmp_path)) == list(mixes.shipped())
  for name in mixes.shipped():
    assert (tmp_path / f"{name}.txt").read_bytes() == open(mixes.find(name), "rb").read()
  with pytest.raises(SystemExit, match="ai2-olmo-core has no mix 'nosuch'"):
    mixes.regenerate(["nosuch"], out=str(tmp_path))


def test_a_user_s_file_then_the_shipped_list_then_ai2_olmo_core(tmp_path, monkeypatch):
  shipped = mixes.find("v3-small-ppl-validation")
  assert shipped == os.path.join(mixes.shipped_dir(), "v3-small-ppl-validation.txt")
  assert mixes.find("v3-small-ppl-validation", olmo_core=False) == shipped
  # Not shipped: ai2-olmo-core's, where it is installed, and nothing without it.
  assert mixes.find("OLMo-mix-0925-official").startswith(mixes.olmo_core_dir())
  assert mixes.find("OLMo-mix-0925-official", olmo_core=False) is None
  for name in ("../mixes/OLMo-mix-0925", "a/b", "", ".hidden"):  # names, never paths
    assert mixes.find(name) is None
  assert [f.label for f in sources.read_mix("v3-small-ppl-validation", "r", "t")][:2] == [
      "c4_en-validation", "dolma_books-validation"]
  # A user's file of that name, in the working directory, comes first.
  monkeypatch.chdir(tmp_path)
  (tmp_path / "v3-small-ppl-validation").write_text("mine,a.npy\n")
  assert sources.read_mix("v3-small-ppl-validation", "r") == [sources.MixFile("mine", "r/a.npy")]
  with pytest.raises(sources.DataError, match="no named mix of that name .*olmo3 ships "
                     "OLMo-longmino-mix-0625, OLMo-midtraining"):
    sources.read_mix("nosuch")


@pytest.mark.slow(seconds=8)
def test_a_wheel_carries_the_mix_lists(tmp_path):
  """A non-editable install (a wheel, as pip builds one) holds every shipped list."""
  src = tmp_path / "src"
  src.mkdir()
  ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
  for entry in ("olmo3", "experiments", "launch"):
    shutil.copytree(os.path.join(ROOT, entry), src / entry, ignore=ignore)
  for entry in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(ROOT, entry), src / entry)
  done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                         "--no-build-isolation", "-q", "-w", str(tmp_path / "out"), str(src)],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  (wheel,) = (tmp_path / "out").glob("olmo3-*.whl")
  with zipfile.ZipFile(wheel) as z:
    for name in mixes.shipped():
      with open(mixes.find(name), "rb") as f:
        assert z.read(f"olmo3/data/mix_lists/{name}.txt") == f.read(), name


def env_without_olmo_core(directory) -> dict[str, str]:
  """The environment of an install without ai2-olmo-core (the README's `pip install -e .`, the
  image's tpu,eval, SLURM's gpu,eval): a package of that name first on PYTHONPATH (written in
  `directory`) fails to import as a package that is not installed does. XLA_FLAGS is dropped:
  programs run on the plain CPU device, as a user's."""
  (directory / "olmo_core").mkdir()
  (directory / "olmo_core" / "__init__.py").write_text(
      "raise ModuleNotFoundError(\"No module named 'olmo_core'\", name='olmo_core')\n")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
  return env


@pytest.fixture(scope="module")
def without_olmo_core(tmp_path_factory):
  env = env_without_olmo_core(tmp_path_factory.mktemp("no_olmo_core"))
  done = subprocess.run([sys.executable, "-c", "import olmo_core"], env=env,
                        capture_output=True, text=True)
  assert "No module named 'olmo_core'" in done.stderr  # the stand-in hides the real one
  return env


@pytest.mark.slow(seconds=30)
def test_the_7b_stages_run_without_ai2_olmo_core(without_olmo_core, tmp_path):
  """Both stages' dry runs resolve their mixes and held-out sets, and stage 1 starts on sparse
  stand-ins for AI2's 1016 token files and 11 held-out files (at laptop size: a 7B does not
  train on a CPU), in an environment where ai2-olmo-core cannot be imported."""
  env = without_olmo_core
  out = forked.completed("main", [f"--fdl_config={STAGES[0]}", "--dry_run"], env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "cannot be resolved" not in out.stdout
  assert ("held-out            v3-small-ppl-validation: 11 sets, every 10,000 steps: "
          "c4_en-validation, dolma_books-validation,") in out.stdout
  out = forked.completed("main", [f"--fdl_config={STAGES[1]}", "--dry_run"], env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "cannot be resolved" not in out.stdout
  # The training files are listed (the dolmino mix's); their sizes are unknown on this machine.
  assert "plan                unknown here: token file " in out.stdout
  assert "/preprocessed/dolma3-dolmino-official/100B/allenai/dolma3-tokenizer/" in out.stdout

  root = tmp_path / "data"
  exp = fdl.build(refs.resolve(STAGES[0]))
  files = (sources.read_mix(exp.data.mix, str(root), exp.data.tokenizer_id)
           + sources.read_mix(exp.eval.heldout[0], str(root), exp.eval.heldout_tokenizer_id))
  for f in files:  # sparse: 1 MiB each to the sampler, nothing on disk
    os.makedirs(os.path.dirname(f.path), exist_ok=True)
    with open(f.path, "wb") as out_file:
      out_file.truncate(1 << 20)
  assert len(files) == 1016 + 11
  done = forked.completed("main", [
      f"--fdl_config={STAGES[0]}", "--fiddler=experiments.olmo3_tiny:laptop_size(steps=100)",
      f"--fdl_set=data.mix='{exp.data.mix}'", f"--fdl_set=data.root='{root}'",
      "--fdl_set=train.steps=1", "--fdl_set=train.eval_every=0", "--fdl_set=eval.tasks=()",
      "--fdl_set=data.global_batch_size=8", "--fdl_set=data.seq_len=128",
      f"--workdir={tmp_path / 'run'}"], env)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "training data: 1016 files, sources ['arxiv', 'common_crawl_adult_content'," in (
      done.stderr)
  assert "run complete: " in done.stdout and (tmp_path / "run" / "checkpoints" / "1").is_dir()
