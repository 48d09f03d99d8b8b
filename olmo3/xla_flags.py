"""Compiler flag sets as data (docs/performance.md#compiler-flag-sets). An experiment carries them in `xla_flags`,
`libtpu_flags` and `env`; the launcher applies them before JAX initialises, and libtpu rejects
flags it does not know, so `--compile_only` for a TPU topology validates a set."""

from __future__ import annotations

import dataclasses
import os

_SPARSECORE_OFFLOAD = (
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
    "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
    # Async collective fusion interferes with SparseCore offload.
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false",
)


@dataclasses.dataclass(frozen=True)
class FlagSet:
  xla: tuple[str, ...] = ()
  libtpu: tuple[str, ...] = ()
  env: tuple[tuple[str, str], ...] = ()


_V5P_V6E = FlagSet(libtpu=("--xla_tpu_scoped_vmem_limit_kib=65536", *_SPARSECORE_OFFLOAD))

FLAG_SETS: dict[str, FlagSet] = {
    # The set that took the TPU reproduction from 27% to 44.5% MFU on Ironwood.
    "tpu7x": FlagSet(libtpu=(
        "--xla_tpu_scoped_vmem_limit_kib=65536",
        "--xla_tpu_bf16_emission_mode=NATIVE_EMISSION",
        "--xla_tpu_dvfs_p_state=7",
        *_SPARSECORE_OFFLOAD,
        "--xla_tpu_use_tc_device_shape_on_sc=True",
        "--xla_sc_disable_megacore_partitioning=True",
    )),
    # v5p and v6e do not offload collectives to SparseCore unless told to (one set for both).
    "v5p": _V5P_V6E,
    "v6e": _V5P_V6E,
    # H100 / H200.
    "gpu_hopper": FlagSet(xla=(
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_enable_triton_gemm=false",
        "--xla_gpu_enable_command_buffer=",
        "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
        "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
        "--xla_gpu_pipeline_all_gather=true",
        "--xla_gpu_pipeline_reduce_scatter=true",
        "--xla_gpu_pipeline_all_reduce=true",
        "--xla_gpu_enable_while_loop_double_buffering=true",
        "--xla_disable_hlo_passes=rematerialization",
    ), env=(("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)),
    # XLA:CPU (the tiny experiments' `cpu` fiddler): YNNPACK runs the matmuls only. By default
    # it also takes elementwise and reduce fusions from XLA's loop emitter, and their broadcast
    # operands (norm weights, row statistics) are then written out in full: ≈ 10% more CPU time
    # in the tiny step (benchmarks/RESULTS.md). jaxlib 0.10.2's name for the switch.
    "cpu": FlagSet(xla=("--xla_cpu_experimental_ynn_fusion_type=dot",)),
}


def apply_to_environ(xla: tuple[str, ...], libtpu: tuple[str, ...],
                     env: tuple[tuple[str, str], ...]) -> None:
  """Adds an experiment's flags to XLA_FLAGS / LIBTPU_INIT_ARGS and sets its environment.

  Only takes effect before JAX initialises its backends: one flag set per process.
  """

  for var, extra in (("XLA_FLAGS", xla), ("LIBTPU_INIT_ARGS", libtpu)):
    present = os.environ.get(var, "").split()
    # A cluster job already carries the flag set in its environment (launch/cluster.py), and
    # the launcher applies it again: a flag already there is not repeated.
    new = [f for f in extra if f not in present]
    if new:
      os.environ[var] = " ".join([*present, *new])
  os.environ.update(dict(env))
