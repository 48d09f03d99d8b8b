"""TPU pod slices' jobs: a GKE JobSet manifest (one child Job per slice, exclusive placement
per node pool, JobSet's failure policy restarting the whole set) and the equivalent xpk command.
Rendering and checking only; launch/jobs.py holds what every job shares."""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping
from typing import Any

import yaml

from launch import jobs
from olmo3.run import lease

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
# A failed host restarts the whole JobSet this many times (each restart resumes from the last
# checkpoint): a weeks-long run outlives many host failures.
DEFAULT_MAX_RESTARTS = 20
# /dev/shm of each pod: Grain's reader processes (data.num_workers) hand batches to the
# launcher through shared memory, and a container's default (64 MiB) cannot hold a step's.
DEFAULT_SHM_SIZE = "16Gi"
SHM_VOLUME = "dshm"


@dataclasses.dataclass(frozen=True)
class PodJob:
  name: str
  slices: jobs.TpuSlices
  image: str
  command: jobs.Command
  env: Mapping[str, str]
  max_restarts: int = DEFAULT_MAX_RESTARTS  # restarts of every slice; each resumes
  shm_size: str = DEFAULT_SHM_SIZE  # /dev/shm (memory-backed) for Grain's worker processes
  # SIGTERM is honoured at the next step boundary, which then saves a checkpoint: give it time.
  grace_period_s: int = 600
  working_dir: str | None = None  # the repository in the image (None: the image's WORKDIR)
  queue: str | None = None  # a Kueue LocalQueue
  mesh: str | None = None  # `jobs.mesh_description`: a comment under the devices' one


def check_quantity(value: str, flag: str) -> str:
  """A Kubernetes memory quantity (16Gi, 512Mi, 8G), or jobs.LaunchError naming the flag."""
  if not re.fullmatch(r"[1-9]\d*(\.\d+)?(Ki|Mi|Gi|Ti|k|M|G|T)?", value):
    raise jobs.LaunchError(f"--{flag}={value!r}: expected a Kubernetes quantity such as 16Gi")
  return value


# Which attempt of which JobSet a pod's launcher is (JobSet labels every pod with its uid and the
# restart attempt it was created for): a later attempt takes the workdir's lease over at once
# and fences the earlier one (olmo3.run.lease), instead of waiting out the takeover age.
ATTEMPT_ENV = [{"name": name,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}
               for name, label in ((lease.JOB_ENV, "jobset.sigs.k8s.io/jobset-uid"),
                                   (lease.ATTEMPT_ENV, "jobset.sigs.k8s.io/restart-attempt"))]


def jobset(job: PodJob) -> dict[str, Any]:
  """The JobSet: one replicated job per slice, one pod per host, every pod the launcher."""
  s = job.slices
  container: dict[str, Any] = {
      "name": CONTAINER, "image": job.image, "command": job.command.argv(),
      "env": [{"name": k, "value": v} for k, v in job.env.items()] + ATTEMPT_ENV,
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
  text = f"# {job.slices.describe()}\n{jobs.mesh_comment(job.mesh)}{body}"
  validate_jobset(text, job)
  return text


def _get(node: Any, *path: str | int) -> Any:
  for key in path:
    try:
      node = node[key]
    except (KeyError, IndexError, TypeError):
      raise jobs.LaunchError("manifest: missing " + ".".join(map(str, path))) from None
  return node


def validate_jobset(text: str, job: PodJob) -> dict[str, Any]:
  """Parses a rendered manifest as YAML and checks every field the job depends on against
  `job`: a manifest that would schedule other hosts, chips or flags is refused here."""
  try:
    doc = yaml.safe_load(text)
  except yaml.YAMLError as e:
    raise jobs.LaunchError(f"manifest: not YAML ({str(e).splitlines()[0]})") from None
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
      raise jobs.LaunchError(f"manifest: {'.'.join(map(str, path))} is {got!r}, not {want!r}")
  if not isinstance(rjobs, list) or len(rjobs) != 1:
    raise jobs.LaunchError("manifest: spec.replicatedJobs must hold one job (the slices)")
  selector = _get(pod, "nodeSelector")
  for label, want in ((ACCELERATOR_LABEL, s.kind.gke_accelerator), (TOPOLOGY_LABEL, s.topology)):
    if selector.get(label) != want:
      raise jobs.LaunchError(f"manifest: nodeSelector {label} is {selector.get(label)!r}, "
                        f"not {want!r}")
  if not isinstance(containers, list) or len(containers) != 1:
    raise jobs.LaunchError("manifest: the pod must run one container (the launcher)")
  container = containers[0]
  chips = _get(container, "resources", "limits", TPU_RESOURCE)
  if chips != s.chips_per_host:
    raise jobs.LaunchError(f"manifest: {TPU_RESOURCE} limit is {chips!r}, not the "
                      f"{s.chips_per_host} chips per host")
  if not _get(container, "image"):
    raise jobs.LaunchError("manifest: the container has no image")
  env = {e.get("name"): e.get("value") for e in _get(container, "env") or []}
  for var, value in job.env.items():
    if env.get(var) != value:
      raise jobs.LaunchError(f"manifest: env {var} is {env.get(var)!r}, not {value!r}")
  for entry in ATTEMPT_ENV:
    if entry not in (_get(container, "env") or []):
      raise jobs.LaunchError(f"manifest: env {entry['name']} is not read from the pod's "
                             f"{entry['valueFrom']['fieldRef']['fieldPath']}")
  if _get(container, "command") != job.command.argv():
    raise jobs.LaunchError(f"manifest: the command is not {job.command.shell()!r}")
  shm = [v for v in _get(pod, "volumes") or [] if v.get("name") == SHM_VOLUME]
  mounts = [m for m in _get(container, "volumeMounts") or [] if m.get("name") == SHM_VOLUME]
  if (len(shm) != 1 or shm[0].get("emptyDir") != {"medium": "Memory", "sizeLimit": job.shm_size}
      or [m.get("mountPath") for m in mounts] != ["/dev/shm"]):
    raise jobs.LaunchError(f"manifest: /dev/shm is not a {job.shm_size} memory volume")
  return doc


def xpk_command(job: PodJob, cluster: str, project: str | None = None,
                zone: str | None = None) -> list[str]:
  """`xpk workload create` for the same job (xpk writes and applies the JobSet itself)."""
  if not cluster:
    raise jobs.LaunchError("--cluster: xpk needs the GKE cluster's name")
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
