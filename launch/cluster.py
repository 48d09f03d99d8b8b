r"""Run an experiment on a TPU pod slice (GKE JobSet, or xpk) or a SLURM GPU cluster.

  python launch/cluster.py --fdl_config=experiments.olmo3_7b:stage1 --target=gke \
      --accelerator=tpu7x --topology=4x8x8 --image=IMAGE --workdir=gs://bucket/s1 \
      --fdl_set=data.root='"http://olmo-data.org"' --dry_run
  python launch/cluster.py ... --target=xpk --cluster=CLUSTER --dry_run
  python launch/cluster.py --fdl_config=experiments.olmo3_7b:stage1 --fiddler=gpu \
      --target=slurm --nodes=64 --gpus_per_node=8 --partition=PART --workdir=... --dry_run

--dry_run prints the manifest, command or batch script; without it the job is submitted
(`kubectl apply -f -`, `xpk workload create ...`, `sbatch`). Every process of the job runs
`python launch/main.py` with this command's --fdl_config / --fiddler / --fdl_set / --workdir,
the experiment's compiler flag set in its environment. The experiment is built here first, so
a bad override, a mesh that cannot fill the job's devices, an attention kernel for the other
kind of accelerator, or data or tasks the hosts' install (--extras) cannot resolve stops the
launch before anything is submitted. docs/launch.md describes the
jobs.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys

import fiddle as fdl
from absl import app, flags

from launch import gke, jobs, refs, slurm
from olmo3 import program
from olmo3.config import Experiment

FDL_CONFIG = flags.DEFINE_string(
    "fdl_config", None, "experiment reference: package.module:function (or the dotted form)")
SETS = flags.DEFINE_multi_string("fdl_set", [], "override: path=value (a Python literal)")
FIDDLERS = flags.DEFINE_multi_string("fiddler", [], "fiddler: name or name(key=value, ...)")
WORKDIR = flags.DEFINE_string("workdir", None, "the run's directory, reachable from every host "
                              "(gs://..., s3://..., or a shared file system); required on TPU pods")
CACHE = flags.DEFINE_string("compilation_cache", None,
                            "the launcher's --compilation_cache for every process (a shared "
                            "gs://... path lets a restarted job skip its compile)")
TARGET = flags.DEFINE_enum_class("target", None, jobs.Target, "gke, xpk or slurm")
DRY_RUN = flags.DEFINE_bool("dry_run", False, "print the job; submit nothing")
NAME = flags.DEFINE_string("name", None, "job name (default from --fdl_config: olmo3-7b-stage1)")
# TPU pod slices (gke, xpk).
ACCELERATOR = flags.DEFINE_string("accelerator", None,
                                  f"TPU kind: {', '.join(jobs.TPU_KINDS)}")
TOPOLOGY = flags.DEFINE_string("topology", None, "TPU slice topology in chips, e.g. 4x8x8, 16x16")
NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "TPU slices (multislice over DCN)")
IMAGE = flags.DEFINE_string("image", None, "container image holding this repository, installed "
                            "with the --extras extras (the repository's Dockerfile)")
WORKING_DIR = flags.DEFINE_string("working_dir", None,
                                  "the repository's directory in the image (default: its WORKDIR)")
MAX_RESTARTS = flags.DEFINE_integer(
    "max_restarts", gke.DEFAULT_MAX_RESTARTS, "restarts of the whole job after a failure "
    "(each resumes from the last checkpoint; 0: a failure ends the job)", lower_bound=0)
SHM_SIZE = flags.DEFINE_string(
    "shm_size", gke.DEFAULT_SHM_SIZE, "each pod's /dev/shm (memory-backed; Grain's worker "
    "processes pass batches through it), a Kubernetes quantity (gke)")
GRACE = flags.DEFINE_integer(
    "termination_grace_period_s", 600, "seconds a pod has after SIGTERM (it saves a checkpoint "
    "at the next step boundary)", lower_bound=1)
QUEUE = flags.DEFINE_string("queue", None, "Kueue LocalQueue for the JobSet (gke)")
CLUSTER = flags.DEFINE_string("cluster", None, "GKE cluster (xpk)")
PROJECT = flags.DEFINE_string("project", None, "Google Cloud project (xpk; default gcloud's)")
ZONE = flags.DEFINE_string("zone", None, "zone (xpk; default gcloud's)")
# SLURM GPU clusters.
NODES = flags.DEFINE_integer("nodes", None, "nodes (slurm)")
GPUS_PER_NODE = flags.DEFINE_integer("gpus_per_node", 8, "GPUs per node (slurm)")
PROCESSES = flags.DEFINE_enum_class("processes", jobs.Processes.PER_GPU, jobs.Processes,
                                    "per_gpu: one task per GPU; per_node: one task per node")
PARTITION = flags.DEFINE_string("partition", None, "sbatch --partition")
ACCOUNT = flags.DEFINE_string("account", None, "sbatch --account")
TIME = flags.DEFINE_string("time", None, "sbatch --time, e.g. 7-00:00:00")
EXTRAS = flags.DEFINE_string(
    "extras", None, "the olmo3 extras the job's hosts install, comma-separated (default: "
    f"{','.join(jobs.IMAGE_EXTRAS)} for gke and xpk, the Dockerfile's; "
    f"{','.join(jobs.SLURM_EXTRAS)} for slurm, the README's): checked against the experiment's "
    "data and tasks before anything is submitted")
PYTHON = flags.DEFINE_string("python", "python", "the interpreter each task runs (slurm): "
                             "python on the nodes' PATH, or a path to a virtual environment's")


def _require(flag: flags.FlagHolder, why: str) -> None:
  if flag.value is None:
    raise jobs.LaunchError(f"--{flag.name} is required {why}")


def render(target: jobs.Target, exp: Experiment) -> tuple[str, list[str], str | None]:
  """The job's text, the command that submits it and that command's stdin."""
  cache = (f"--compilation_cache={CACHE.value}",) if CACHE.value else ()
  command = jobs.Command(FDL_CONFIG.value, tuple(SETS.value), tuple(FIDDLERS.value),
                         WORKDIR.value, cache, PYTHON.value)
  name = jobs.check_name(NAME.value or jobs.default_name(FDL_CONFIG.value))
  env = jobs.job_env(exp)
  if target is jobs.Target.SLURM:
    _require(NODES, "with --target=slurm")
    slurm.check_slurm(NODES.value, GPUS_PER_NODE.value)
    jobs.check_experiment(exp, target, NODES.value * GPUS_PER_NODE.value, 1)
    mesh = jobs.mesh_description(exp, NODES.value * GPUS_PER_NODE.value, 1)
    script = slurm.slurm_script(slurm.SlurmJob(name, NODES.value, GPUS_PER_NODE.value,
                                             PROCESSES.value, command, env, PARTITION.value,
                                             ACCOUNT.value, TIME.value, mesh))
    return script, ["sbatch"], script
  for flag in (ACCELERATOR, TOPOLOGY, IMAGE):
    _require(flag, f"with --target={target.value}")
  _require(WORKDIR, f"with --target={target.value} (a pod's own disk does not outlive it)")
  slices = jobs.tpu_slices(ACCELERATOR.value, TOPOLOGY.value, NUM_SLICES.value)
  jobs.check_experiment(exp, target, slices.devices, slices.num_slices)
  shm = gke.check_quantity(SHM_SIZE.value, SHM_SIZE.name)
  mesh = jobs.mesh_description(exp, slices.devices, slices.num_slices)
  job = gke.PodJob(name, slices, IMAGE.value, command, env, MAX_RESTARTS.value, shm,
                    GRACE.value, WORKING_DIR.value, QUEUE.value, mesh)
  if target is jobs.Target.GKE:
    manifest = gke.render_jobset(job)
    return manifest, ["kubectl", "apply", "-f", "-"], manifest
  _require(CLUSTER, "with --target=xpk")
  argv = gke.xpk_command(job, CLUSTER.value, PROJECT.value, ZONE.value)
  return f"# {slices.describe()}\n# {mesh}\n{shlex.join(argv)}\n", argv, None


def main(argv: list[str]) -> None:
  program.begin()
  if len(argv) > 1:
    refs.usage_error(f"unexpected arguments: {argv[1:]}", "launch/cluster.py")
  refs.make_cwd_importable()
  if not FDL_CONFIG.value:
    refs.usage_error("--fdl_config is required, e.g. experiments.olmo3_7b:stage1",
                        "launch/cluster.py")
  if TARGET.value is None:
    refs.usage_error("--target is required: gke, xpk or slurm", "launch/cluster.py")
  try:
    cfg = refs.resolve(FDL_CONFIG.value, SETS.value, FIDDLERS.value)
    exp = fdl.build(cfg)
    text, submit, stdin = render(TARGET.value, exp)
    # Whether the hosts' install can resolve the experiment's data: each would stop at startup.
    jobs.check_hosts(exp, jobs.host_extras(TARGET.value, EXTRAS.value))
  except (refs.ConfigRefError, ValueError, TypeError) as e:  # LaunchError too: one line
    sys.exit(f"error: {refs.message(e)}")
  if DRY_RUN.value:
    sys.stdout.write(text)
    return
  if shutil.which(submit[0]) is None:
    sys.exit(f"error: --target={TARGET.value.value} submits with {submit[0]}, which is not on PATH "
             "(--dry_run prints the job instead)")
  sys.exit(subprocess.run(submit, input=stdin, text=True).returncode)


if __name__ == "__main__":
  app.run(main)
