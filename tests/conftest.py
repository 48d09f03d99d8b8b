"""Test setup: 8 simulated CPU devices (for sharding tests), the compilation cache, the two
tiers (`slow`: process-level; the rest, in-process, is the fast tier) and their guard, the
schedule (longest first), and shared helpers."""

import os

# In-process tests compile for speed of compiling: their programs run a few steps of a micro
# model, so compiling was most of what they cost. LLVM at -O0, XLA:CPU's older elemental
# emitters instead of its MLIR fusion emitters (which, at -O0, compile slower than the program
# they save) and one codegen thread: a micro train step compiles in 1.9 CPU s instead of 10.1
# (the fast tier from empty caches on 2 cores: 544 CPU s with XLA's defaults, 408 at -O0, 342
# with all three), and runs about twice as slowly; results agree within the tests' tolerances,
# not bit for bit. The processes tests start compile as a user's do: while a process-level test
# runs, XLA_FLAGS is `_USER_XLA_FLAGS` (a launcher's step would take twice as long), except
# in processes that compile much and run little, whose tests hand them FAST_COMPILE_XLA_FLAGS
# (a sweep's compile-only variants, the MFU benchmark's 2-step smoke run).
FAST_COMPILE_XLA_FLAGS = " ".join(["--xla_backend_optimization_level=0",
                                   "--xla_cpu_use_fusion_emitters=false",
                                   "--xla_cpu_parallel_codegen_split_count=1"])
_USER_XLA_FLAGS = (os.environ.get("XLA_FLAGS", "") +
                   " --xla_force_host_platform_device_count=8").strip()
os.environ["XLA_FLAGS"] = f"{_USER_XLA_FLAGS} {FAST_COMPILE_XLA_FLAGS}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache, shared by the xdist workers and every launcher subprocess
# (they inherit the environment): a restarted run loads its executables instead of recompiling
# them, which is what makes the many-restart tests affordable. It is kept between sessions
# ($OLMO3_CACHE/jax-tests), so a session after an edit compiles only what the edit changed (an
# entry's key is the program, the flags and the jax/jaxlib versions); past 2 GiB it is emptied
# when a session starts. Not JAX's own size limit: its eviction reads every entry's access-time
# file, and an entry whose writer was killed before that file (the tests SIGKILL launchers)
# made every later write fail, so nothing new was cached. OLMO3_TEST_JAX_CACHE=fresh: a fresh
# one for this session, removed at exit.
_CACHE_LIMIT_BYTES = 2 << 30
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import shutil

  if os.environ.get("OLMO3_TEST_JAX_CACHE") == "fresh":
    import atexit
    import tempfile

    _cache = tempfile.mkdtemp(prefix="olmo3-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  else:
    _cache = os.path.join(os.path.expanduser(os.environ.get("OLMO3_CACHE", "~/.cache/olmo3")),
                          "jax-tests")
    if "PYTEST_XDIST_WORKER" not in os.environ and os.path.isdir(_cache) and sum(
        e.stat().st_size for e in os.scandir(_cache) if e.is_file()) > _CACHE_LIMIT_BYTES:
      shutil.rmtree(_cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

# As the launcher (launch/main.py): the workers trace hundreds of programs.
import gc  # noqa: E402

gc.set_threshold(50_000, 20, 20)

import contextlib  # noqa: E402
import json  # noqa: E402
import multiprocessing.process  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from olmo3 import model as model_lib  # noqa: E402
from olmo3.config import ModelConfig  # noqa: E402
from olmo3.convert import hf  # noqa: E402
from tests import forked  # noqa: E402


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
# developer runs after each edit (a long in-process test stays there, marked
# `@pytest.mark.seconds(N)` to start early). `_tiers` holds both rules: while an unmarked
# test (its fixtures included) runs, starting a process fails it, naming what it started;
# a test marked slow that passes without starting any process fails too (it belongs in the
# fast tier).
_STARTERS = [(subprocess.Popen, "_execute_child"), (os, "fork"), (os, "forkpty"),
             (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"),
             (multiprocessing.process.BaseProcess, "start"),
             (forked.Driver, "start")]  # a child forked by a driver started earlier
_STARTED = pytest.StashKey[list]()
# Fixtures whose setup started a process (a storage server kept for the session, say): a test
# that uses one depends on that process even when another test started it, so it counts as
# having started one (slow tier), whichever test happens to set the fixture up first.
_PROCESS_FIXTURES: set[str] = set()
_ALL_STARTS: list[str] = []


class ProcessInFastTier(RuntimeError):
  pass


@contextlib.contextmanager
def _tiers(item: pytest.Item, last_phase: bool):
  slow = item.get_closest_marker("slow") is not None
  started = item.stash.setdefault(_STARTED, [])

  def watch(owner, name, real):
    def start(*args, **kwargs):
      what = (f"a subprocess {args[1]!r}"[:300] if name == "_execute_child" else
              f"{getattr(owner, '__name__', owner)}.{name}")
      started.append(what)
      _ALL_STARTS.append(what)
      if slow:
        return real(*args, **kwargs)
      raise ProcessInFastTier(
          f"{item.nodeid} started {what} but is not marked slow: a test that starts a "
          "process (itself or through a fixture) belongs in the slow tier, "
          "@pytest.mark.slow(seconds=N) (tests/conftest.py: the tiers)")
    return start

  saved = [(owner, name, getattr(owner, name)) for owner, name in _STARTERS
           if hasattr(owner, name)]
  for owner, name, real in saved:
    setattr(owner, name, watch(owner, name, real))
  in_process_flags = os.environ["XLA_FLAGS"]
  if slow:
    os.environ["XLA_FLAGS"] = _USER_XLA_FLAGS  # what the processes it starts inherit
  try:
    yield
  finally:
    os.environ["XLA_FLAGS"] = in_process_flags
    for owner, name, real in saved:
      setattr(owner, name, real)
  # Reached only when the phase passed (an error or a skip propagates past this point).
  # (the request's names: the item's and those asked for with request.getfixturevalue)
  request = getattr(item, "_request", None)
  names = set(request.fixturenames if request is not None else item.fixturenames)
  if not started and (uses := sorted(_PROCESS_FIXTURES & names)):
    started.append(f"fixture {uses[0]}'s process")
  if started and not slow:  # also where the code under test caught ProcessInFastTier
    pytest.fail(f"{item.nodeid} is in the fast tier but started {started[0]}: mark it "
                "@pytest.mark.slow(seconds=N) (tests/conftest.py: the tiers)", pytrace=False)
  if last_phase and slow and not started:
    pytest.fail(f"{item.nodeid} is marked slow but started no process: an in-process test "
                "belongs in the fast tier (@pytest.mark.seconds(N) if it is long; "
                "tests/conftest.py: the tiers)", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
  with _tiers(item, last_phase=False):
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
  with _tiers(item, last_phase=True):
    return (yield)


class _FixtureWatch:
  """Records the fixtures whose setup started a process. A plugin registered at the root (in
  pytest_configure), not a hook of this conftest: pytest calls a conftest's hooks only for
  nodes under its directory, which a session-scoped fixture's setup is not."""

  @pytest.hookimpl(wrapper=True)
  def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    before = len(_ALL_STARTS)
    try:
      return (yield)
    finally:
      if len(_ALL_STARTS) > before:
        _PROCESS_FIXTURES.add(fixturedef.argname)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  """Longest first: `@pytest.mark.slow(seconds=N)` and `@pytest.mark.seconds(N)` (rough, on 2
  cores, measured) order the long tests ahead of the rest. With -n 2 and --maxschedchunk=1
  (pyproject) each xdist worker holds one test and the next, and takes another whenever it
  finishes one: the long tests start first and the short ones fill in around them, instead of
  a long test starting last and running alone.

  A test marked `waits=True` spends most of its time waiting (a stalled store's timeouts, a
  lease's age, a grace period), its core idle. Two of them side by side idled both cores (the
  outage tests, all of one length, ran together: 40 s of the suite at under one core). Each
  goes right after one of the longest tests that compute, so the queue alternates: a worker
  that takes a waiting test leaves the other worker a computing one, whose processes and
  XLA threads use the core the wait leaves. Without waiting tests, xdist's first hand-out (worker i:
  positions 2i and 2i + 1) pairs the longest test with the shortest of the first 2 x workers."""

  def marker(item: pytest.Item) -> pytest.Mark | None:
    return item.get_closest_marker("seconds") or item.get_closest_marker("slow")

  def seconds(item: pytest.Item) -> float:
    mark = marker(item)
    if mark is None:
      return 0.0
    return float(mark.args[0]) if mark.name == "seconds" else float(mark.kwargs.get("seconds", 1))

  items.sort(key=lambda item: -seconds(item))  # stable: otherwise file order
  waiting, computing = [], []
  for item in items:
    mark = marker(item)
    (waiting if mark is not None and mark.kwargs.get("waits") else computing).append(item)
  workers = getattr(config, "workerinput", {}).get("workercount", 0)
  if waiting:
    head = computing[:len(waiting)]
    # (more waiting tests than computing ones, as in a run of tests/test_outages.py alone: the
    # rest of them follow, never dropped)
    items[:] = ([x for pair in zip(head, waiting) for x in pair] + waiting[len(head):]
                + computing[len(head):])
  elif 1 < workers and 2 * workers <= len(items):
    first = items[:2 * workers]
    items[:2 * workers] = [x for i in range(workers) for x in (first[i], first[-1 - i])]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
  """OLMO3_TEST_CPU_LOG=FILE: one JSON line per test with the CPU seconds it cost, its own and
  its finished child processes' (what a launch, a job or a server it waited for used, and the
  programs tests/forked.py's drivers forked for it), its wall time and start. The suite's
  budget is CPU on 2 cores: wall time alone hides what a test costs the other worker."""
  out = os.environ.get("OLMO3_TEST_CPU_LOG")
  if not out:
    return (yield)

  def cpu() -> tuple[float, float]:
    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                     resource.RUSAGE_CHILDREN))
    return (own.ru_utime + own.ru_stime,
            children.ru_utime + children.ru_stime + forked.children_cpu_s)

  before, start = cpu(), time.time()
  try:
    return (yield)
  finally:
    after = cpu()
    with open(out, "a") as f:
      f.write(json.dumps({"test": item.nodeid, "cpu_s": round(after[0] - before[0], 2),
                          "children_cpu_s": round(after[1] - before[1], 2),
                          "wall_s": round(time.time() - start, 2), "start": start}) + "\n")


def benchmark_result(program: str, argv: list[str]) -> dict:
  """A benchmark command of tests/forked.py's SCRIPTS run to its end at the fast-compile flags
  (it compiles much and runs little), its result: the JSON line it prints last."""
  env = dict(os.environ, XLA_FLAGS=f"{os.environ['XLA_FLAGS']} {FAST_COMPILE_XLA_FLAGS}")
  done = forked.completed(program, argv, env)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def pytest_configure(config: pytest.Config) -> None:
  """The fixture watch (`_FixtureWatch`) registered. And: matplotlib builds its font cache on
  first use, asking `fc-list` (a process) on a machine that never ran it: done here, once,
  before any test's process guard watches, so the fast tier's plot tests do not start a
  process on a fresh machine only."""
  config.pluginmanager.register(_FixtureWatch(), "olmo3-fixture-watch")
  if "PYTEST_XDIST_WORKER" not in os.environ:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401
