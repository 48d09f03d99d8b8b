"""SLURM GPU clusters' jobs: an sbatch script whose `srun` starts the launcher on every task
(JAX's SLURM detection joins them). Rendering only; launch/jobs.py holds what every job
shares."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping

from launch import jobs

# A SLURM job with a time limit has its tasks sent SIGTERM this long before it (sbatch
# --signal), time for the step in flight and a checkpoint save.
SIGNAL_BEFORE_LIMIT_S = 600


@dataclasses.dataclass(frozen=True)
class SlurmJob:
  name: str
  nodes: int
  gpus_per_node: int
  processes: jobs.Processes
  command: jobs.Command
  env: Mapping[str, str]
  partition: str | None = None
  account: str | None = None
  time: str | None = None  # sbatch --time, e.g. 7-00:00:00
  mesh: str | None = None  # `jobs.mesh_description`: a comment under the devices' one

  @property
  def tasks_per_node(self) -> int:
    return self.gpus_per_node if self.processes is jobs.Processes.PER_GPU else 1

  @property
  def devices(self) -> int:
    return self.nodes * self.gpus_per_node

  def describe(self) -> str:
    return (f"{self.nodes} node(s) x {self.gpus_per_node} GPUs, {self.tasks_per_node} "
            f"process(es) per node ({self.processes.value}), {self.devices} devices in all")


def check_slurm(nodes: int, gpus_per_node: int) -> None:
  if nodes < 1:
    raise jobs.LaunchError(f"--nodes={nodes}: must be >= 1")
  if gpus_per_node < 1:
    raise jobs.LaunchError(f"--gpus_per_node={gpus_per_node}: must be >= 1")


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
  lines = ["#!/bin/bash", f"# {job.describe()}", *jobs.mesh_comment(job.mesh).splitlines(),
           *(f"#SBATCH {h}" for h in header),
           "set -euo pipefail", *(_export(k, v) for k, v in job.env.items())]
  if job.processes is jobs.Processes.PER_NODE:
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
