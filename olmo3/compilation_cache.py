"""The persistent XLA compilation cache, for every kind of job (the launcher calls `enable`).

A workaround for one JAX behaviour, isolated here (tests/test_compilation_cache.py): on CPU, the
cache key of a program compiled by a job of several processes includes a fingerprint of the
device topology as *this process* sees it, so the same program has a different key in each
process, while only process 0 writes entries. A relaunched job then had process 0 load its
executables while every other process compiled again; on a machine with few cores that put
process 0 a minute ahead, past the 30 s gloo allows for setting up a collective, and the job
failed at its first step. Keying CPU programs by the global devices instead (each device's
kind, id and process: the same list in every process, and what the executable is compiled
for) gives every process process 0's entry. Accelerators keep JAX's own key: a GPU or TPU
topology is the same in every process.

A CPU job of several processes also compiles each new program once (`compile_once_per_cpu_job`):
process 0 compiles it and hands the executable to the others through jax.distributed's
key-value store (JAX's `jax_share_binary_between_hosts`), instead of every process compiling
the same program on the same machine's cores and only process 0 writing it to the cache.

A cache entry is checked before it is used (`_check_entries_read`): JAX returns whatever
executable the file under a program's key holds, and one that is not that program's (a file
copied or restored over it) failed every relaunch with a bare `AssertionError` (its outputs
miscounted). An entry whose program name, argument count or result count is not the program's
being compiled is removed with a warning naming it, and the program compiled afresh. (An entry
of the same name and counts but other shapes is not seen: only a hand-copied file can be one,
since JAX's key hashes the program's text.)

Where the cache lives (`directory`): what the launch names (--compilation_cache, or JAX's own
JAX_COMPILATION_CACHE_DIR), else `jax` under $OLMO3_CACHE (default ~/.cache/olmo3) beside the
embedded corpus and the prepared tasks, so one variable moves (or empties) every cache.
"""

from __future__ import annotations

import functools
import os
import threading

import jax
from absl import logging
# JAX's cache internals (private: this module is where olmo3 works around them; see above).
from jax._src import compilation_cache as jax_cache
from jax._src import compiler
from jax._src.interpreters import mlir

# The one setting JAX itself reads for the cache (it is an explicit choice, as the flag is).
JAX_ENV = "JAX_COMPILATION_CACHE_DIR"


def directory(configured: str | None = None) -> str:
  """The cache directory: `configured` (a launcher's --compilation_cache; '' turns the cache
  off) when given, else $JAX_COMPILATION_CACHE_DIR, else $OLMO3_CACHE/jax (OLMO3_CACHE:
  default ~/.cache/olmo3, as for the corpus: olmo3.data.embedded.cache_root)."""
  if configured is not None:
    return configured
  if os.environ.get(JAX_ENV):
    return os.environ[JAX_ENV]
  root = os.environ.get("OLMO3_CACHE", os.path.join("~", ".cache", "olmo3"))
  return os.path.join(root, "jax")


def enable(directory: str) -> None:
  """The cache in `directory` (a local path or a URL such as gs://...: one cache for every
  host), shared by every process of a job, on CPU too. Call before the first compile."""
  jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
  _same_key_in_every_cpu_process()
  _check_entries_read()


@functools.cache
def _same_key_in_every_cpu_process() -> None:
  from jax._src import cache_key  # pylint: disable=g-import-not-at-top

  topology_key = cache_key._hash_accelerator_config  # pylint: disable=protected-access

  def global_devices_key(hash_obj, devices_array) -> None:
    devices = list(devices_array.flat)
    if not all(d.platform == "cpu" for d in devices):
      topology_key(hash_obj, devices_array)
      return
    for d in devices:
      cache_key._hash_string(  # pylint: disable=protected-access
          hash_obj, f"{d.device_kind}:{d.id}:{d.process_index}")

  cache_key._hash_accelerator_config = global_devices_key  # pylint: disable=protected-access


# The program being compiled on this thread: (name, arguments, results) of its module.
_compiling = threading.local()


def _module_signature(computation) -> tuple[str, int, int]:
  """(name, argument count, result count) of a JAX module's entry function `main`."""
  ir = mlir.ir
  name = ir.StringAttr(computation.operation.attributes["sym_name"]).value
  for op in computation.body.operations:
    if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main":
      kind = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
      return name, len(kind.inputs), len(kind.results)
  return name, -1, -1


def _executable_signature(executable) -> tuple[str, int, int]:
  """(name, argument count, result count) of a compiled executable."""
  return (executable.hlo_modules()[0].name, len(executable.get_parameter_layouts()),
          len(executable.get_output_layouts()))


@functools.cache
def _check_entries_read() -> None:
  """Wraps JAX's cache read: an entry that is not the program being compiled is removed and
  the program compiled (see the module's docstring)."""
  compile_or_get_cached, cache_read = compiler.compile_or_get_cached, compiler._cache_read  # pylint: disable=protected-access

  def compiling(backend, computation, *args, **kwargs):
    _compiling.signature = _module_signature(computation)
    try:
      return compile_or_get_cached(backend, computation, *args, **kwargs)
    finally:
      _compiling.signature = None

  def read(module_name, cache_key, compile_options, backend, executable_devices):
    executable, seconds = cache_read(module_name, cache_key, compile_options, backend,
                                     executable_devices)
    expected = getattr(_compiling, "signature", None)
    if executable is None or expected is None:
      return executable, seconds
    found = _executable_signature(executable)
    if found == expected:
      return executable, seconds
    cache = jax_cache._get_cache(backend)  # pylint: disable=protected-access
    logging.warning("the compilation cache's entry %s holds another program (%s with %d "
                    "arguments and %d results, not %s with %d and %d): removed; compiling it "
                    "again", cache_key, *found, *expected)
    for suffix in ("-cache", "-atime"):  # JAX's LRU cache's files for the key
      (cache._path / f"{cache_key}{suffix}").unlink(missing_ok=True)  # pylint: disable=protected-access
    return None, None

  compiler.compile_or_get_cached = compiling
  compiler._cache_read = read  # pylint: disable=protected-access


def compile_once_per_cpu_job() -> None:
  """In a CPU job of several processes (call after jax.distributed.initialize), process 0
  compiles each program the processes share and the others receive its executable. Only on
  CPU, where the processes share a machine's cores: GPU and TPU hosts compile in parallel,
  each on its own CPUs, and a large executable would cross the coordinator once per host."""
  if jax.distributed.is_initialized() and jax.default_backend() == "cpu":
    jax.config.update("jax_share_binary_between_hosts", True)
