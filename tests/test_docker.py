"""The cluster image: the repository's Dockerfile, whose build context .dockerignore keeps to the
sources (no virtual environment, runs or caches), and the README's TPU-pod commands build it."""

import fnmatch
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
               "data/mine/train/part-00000.npy"):
    assert excluded(path), f"{path} would be sent to docker build"
  for path in ("Dockerfile", "pyproject.toml", "README.md", "olmo3/config.py",
               "olmo3/data/prepare.py", "olmo3/data/embedded.py", "launch/main.py",
               "experiments/olmo3_7b.py", "docs/launch.md",
               "benchmarks/sweeps/olmo3_7b_tpu7x_4x8x8/results.png"):
    assert not excluded(path), f"{path} is left out of the image"


def test_the_readme_builds_the_repository_s_dockerfile():
  with open(os.path.join(ROOT, "Dockerfile")) as f:
    dockerfile = f.read()
  assert "WORKDIR /olmo3" in dockerfile and "COPY . ." in dockerfile
  assert re.search(r'pip install --no-cache-dir -e "\.\[\$\{EXTRAS\}\]"', dockerfile)
  assert re.search(r"^ARG EXTRAS=tpu,eval$", dockerfile, re.MULTILINE)
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  pod = readme[readme.index("## On a TPU pod"):readme.index("## On a SLURM GPU cluster")]
  assert "docker build -t" in pod and "> Dockerfile" not in pod  # the repository's own file
  assert "--working_dir=/olmo3" in pod  # where the Dockerfile puts the repository
