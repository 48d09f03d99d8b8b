"""Test setup: 8 simulated CPU devices (for sharding tests) and shared helpers."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test session, shared by the xdist workers and every
# launcher subprocess (they inherit the environment): a restarted run loads its executables
# instead of recompiling them, which is what makes the many-restart tests affordable.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile

  _cache = tempfile.mkdtemp(prefix="olmo3-test-jax-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import contextlib  # noqa: E402
import multiprocessing.process  # noqa: E402
import subprocess  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from olmo3 import model as model_lib  # noqa: E402
from olmo3.config import ModelConfig  # noqa: E402
from olmo3.convert import hf  # noqa: E402


def random_params(cfg: ModelConfig, seed: int) -> dict:
  """Weights drawn wide enough that logits spread over several nats and attention is peaked:
  linear weights with std 1.5/sqrt(fan_in) (4/sqrt(fan_in) for the LM head), norm weights
  1 + N(0, 0.2²). Then a wrong mask, window, RoPE convention or norm placement changes
  predictions."""
  rng = np.random.default_rng(seed)

  def draw(path, shape):
    name = path[-1]
    if name == "weight":  # norm
      return (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    if name == "embedding":
      return rng.standard_normal(shape).astype(np.float32)
    scale = 4.0 if path[0] == "lm_head" else 1.5  # logits with a std of about 4 nats
    return (scale * rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)

  shapes = model_lib.param_shapes(cfg)
  import jax

  return jax.tree_util.tree_map_with_path(
      lambda p, s: draw(tuple(k.key for k in p), s.shape), shapes)


def write_random_hf_dir(path, cfg: ModelConfig, seed: int = 0, dtype: str = "float32") -> None:
  hf.write_hf_dir(path, cfg, random_params(cfg, seed), dtype=dtype)


# The tiers. Process-level tests are marked `@pytest.mark.slow(seconds=N)`: every test that
# starts another process (a program through subprocess or os.fork, the launcher, JAX in other
# processes, a multiprocessing / Grain worker pool, a storage server binary), itself or through
# a fixture. Everything else is in-process and forms the fast tier, `-m "not slow"`, the one a
# developer runs after each edit. The guard below makes the rule hold: while an unmarked test
# (and its fixtures) runs, starting a process fails it, naming what it started.
_STARTERS = [(subprocess.Popen, "_execute_child"), (os, "fork"), (os, "forkpty"),
             (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"),
             (multiprocessing.process.BaseProcess, "start")]


class ProcessInFastTier(RuntimeError):
  pass


@contextlib.contextmanager
def _in_process_only(item: pytest.Item):
  if item.get_closest_marker("slow") is not None:
    yield
    return
  started = []

  def refuse(owner, name):
    def start(*args, **kwargs):
      what = f"{getattr(owner, '__name__', owner)}.{name}"
      if name == "_execute_child":
        what = f"a subprocess: {args[1]!r}"[:300]
      started.append(what)
      raise ProcessInFastTier(
          f"{item.nodeid} started {what} but is not marked slow: a test that starts a "
          "process (itself or through a fixture) is process-level and belongs in the slow "
          "tier, @pytest.mark.slow(seconds=N) (tests/conftest.py)")
    return start

  saved = [(owner, name, getattr(owner, name)) for owner, name in _STARTERS
           if hasattr(owner, name)]
  for owner, name, _ in saved:
    setattr(owner, name, refuse(owner, name))
  try:
    yield
  finally:
    for owner, name, real in saved:
      setattr(owner, name, real)
    if started:  # even where the code under test caught the error
      pytest.fail(f"{item.nodeid} is in the fast tier but started {started[0]}: mark it "
                  "@pytest.mark.slow(seconds=N) (tests/conftest.py: the tiers)", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
  with _in_process_only(item):
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
  with _in_process_only(item):
    return (yield)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  """Longest first: `@pytest.mark.slow(seconds=N)` and `@pytest.mark.seconds(N)` (rough, on 2
  cores) order the long tests ahead of the rest, longest first. With -n 2 and --maxschedchunk=1 (pyproject) the two
  workers start on them and the short tests fill in around them, instead of a long test
  starting last and running alone."""

  def seconds(item: pytest.Item) -> float:
    slow, timed = item.get_closest_marker("slow"), item.get_closest_marker("seconds")
    if timed is not None:
      return float(timed.args[0])
    return 0.0 if slow is None else float(slow.kwargs.get("seconds", 1))

  items.sort(key=lambda item: -seconds(item))  # stable: otherwise file order
