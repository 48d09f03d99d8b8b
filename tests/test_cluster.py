"""Cluster jobs (launch/jobs.py, gke.py, slurm.py, cluster.py): the GKE JobSet, the xpk command
and the SLURM script, rendered in-process; the command line through real processes. The SLURM
script running end to end (srun stand-in, jax.distributed): tests/test_reliability.py's
2-process runs are launched that way."""

import os
import re
import shlex
import stat
import subprocess
import sys

import fiddle as fdl
import jax
import pytest
import yaml

from launch import gke, jobs, refs, slurm
from olmo3 import sharding
from olmo3.config import MeshConfig
from olmo3.xla_flags import FLAG_SETS
from tests import forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(ROOT, "launch", "cluster.py")
STAGE1 = "experiments.olmo3_7b:stage1"
DATA_ROOT = "--fdl_set=data.root='\"http://olmo-data.org\"'"


def _exp(ref=STAGE1, sets=(), fiddlers=()):
  return fdl.build(refs.resolve(ref, list(sets), list(fiddlers)))


def _command(*fiddlers):
  return jobs.Command(STAGE1, ("data.root='http://olmo-data.org'",), fiddlers, "gs://b/s1")


def _pod_job(topology="4x4x8", num_slices=2):
  exp = _exp()
  slices = jobs.tpu_slices("tpu7x", topology, num_slices)
  jobs.check_experiment(exp, jobs.Target.GKE, slices.devices, slices.num_slices)
  return gke.PodJob("olmo3-7b-stage1", slices, "img:1", _command(), jobs.job_env(exp),
                     max_restarts=2, queue="multislice-queue")


def test_jobset_manifest_for_a_multislice_tpu7x_job():
  job = _pod_job()
  doc = yaml.safe_load(gke.render_jobset(job))
  assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  assert doc["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "multislice-queue"}
  assert doc["spec"]["failurePolicy"] == {"maxRestarts": 2}
  (rjob,) = doc["spec"]["replicatedJobs"]
  assert rjob["replicas"] == 2  # slices
  spec = rjob["template"]["spec"]
  # 4x4x8 = 128 chips per slice, 4 per TPU VM: 32 hosts, one launcher process each.
  assert spec["parallelism"] == spec["completions"] == 32
  pod = spec["template"]["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu7x",
                                 "cloud.google.com/gke-tpu-topology": "4x4x8"}
  (container,) = pod["containers"]
  assert container["resources"]["limits"] == {"google.com/tpu": 4}
  assert container["env"] == [
      {"name": "LIBTPU_INIT_ARGS", "value": " ".join(FLAG_SETS["tpu7x"].libtpu)},
      # A lost host found within 30 s (launch/peers.py says why that is safe).
      {"name": "OLMO3_HEARTBEAT_TIMEOUT_S", "value": "30"},
      # Which attempt of which JobSet: a later attempt fences the earlier one's lease at once.
      {"name": "OLMO3_JOB", "valueFrom": {"fieldRef": {
          "fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-uid']"}}},
      {"name": "OLMO3_ATTEMPT", "valueFrom": {"fieldRef": {
          "fieldPath": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"}}}]
  assert container["command"] == [
      "python", "launch/main.py", f"--fdl_config={STAGE1}",
      "--fdl_set=data.root='http://olmo-data.org'", "--workdir=gs://b/s1"]


@pytest.mark.parametrize("path, value, complaint", [
    (("spec", "replicatedJobs", 0, "replicas"), 3, "spec.replicatedJobs.0.replicas is 3, not 2"),
    (("spec", "replicatedJobs", 0, "template", "spec", "parallelism"), 16, "parallelism is 16"),
    (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "nodeSelector",
      "cloud.google.com/gke-tpu-topology"), "4x8x8", "gke-tpu-topology is '4x8x8'"),
    (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0,
      "resources", "limits", "google.com/tpu"), 8, "google.com/tpu limit is 8"),
    (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0,
      "env"), [], "env LIBTPU_INIT_ARGS is None"),
    (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0,
      "env", 3), {"name": "OLMO3_ATTEMPT", "value": "0"},
     "env OLMO3_ATTEMPT is not read from the pod's metadata.labels"),
    (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0,
      "command", 3), "--fdl_set=data.root=''", "the command is not"),
    (("metadata",), {}, "missing metadata.name"),
])
def test_a_manifest_that_would_run_another_job_is_refused(path, value, complaint):
  job = _pod_job()
  doc = gke.jobset(job)
  node = doc
  for key in path[:-1]:
    node = node[key]
  node[path[-1]] = value
  with pytest.raises(jobs.LaunchError, match="manifest: .*" + re.escape(complaint)):
    gke.validate_jobset(yaml.safe_dump(doc), job)
  with pytest.raises(jobs.LaunchError, match="manifest: not YAML"):
    gke.validate_jobset("spec: [", job)


def test_hosts_chips_and_devices_come_from_the_topology():
  cases = {("tpu7x", "4x8x8"): (64, 4, 512), ("tpu7x", "2x2x1"): (1, 4, 8),
           ("tpu7x", "8x8x8"): (128, 4, 1024), ("v5p", "2x2x1"): (1, 4, 4),
           ("v5p", "2x2x2"): (2, 4, 8), ("v6e", "2x4"): (1, 8, 8), ("v6e", "16x16"): (64, 4, 256)}
  for (kind, topology), want in cases.items():
    s = jobs.tpu_slices(kind, topology, 1)
    assert (s.hosts, s.chips_per_host, s.devices) == want, (kind, topology)
  assert jobs.tpu_slices("v5p", "4x4x8", 2).xpk_type == "v5p-4x4x8"


@pytest.mark.parametrize("args, complaint", [
    (("v9", "2x2x1", 1), "--accelerator='v9': unknown TPU kind (known: tpu7x, v5p, v6e)"),
    (("tpu7x", "4x8", 1), "--topology='4x8': tpu7x topologies are AxBxC"),
    (("v6e", "4x4x4", 1), "--topology='4x4x4': v6e topologies are AxB"),
    (("tpu7x", "4x4x6", 1), "--topology='4x4x6' is not a tpu7x slice"),
    (("tpu7x", "8x4x4", 1), "--topology='8x4x4' is not a tpu7x slice"),  # A <= B <= C
    (("v6e", "4x2", 1), "--topology='4x2' is not a v6e slice"),
    (("tpu7x", "4x8x8", 0), "--num_slices=0: must be >= 1"),
    (("tpu7x", "2x2x1", 2), "--num_slices=2: multislice needs multi-host slices"),
])
def test_a_slice_that_does_not_exist_is_refused_naming_the_flag(args, complaint):
  with pytest.raises(jobs.LaunchError) as e:
    jobs.tpu_slices(*args)
  assert str(e.value).startswith(complaint) and "\n" not in str(e.value)


@pytest.mark.parametrize("shape", [
    {"fsdp": -1}, {"data": 2, "fsdp": -1}, {"data": 3, "fsdp": -1}, {"fsdp": 8},
    {"fsdp": 4}, {"data": 2, "fsdp": 4}, {"data": 2, "tensor": 2, "fsdp": 2}, {"tensor": 16}])
def test_the_mesh_check_agrees_with_make_mesh(shape):
  """mesh_problem does make_mesh's arithmetic without devices; on this machine's 8 it must
  accept exactly the shapes make_mesh builds."""
  devices = jax.devices()
  assert len(devices) == 8
  try:
    sharding.make_mesh(shape, devices)
    built = True
  except ValueError:
    built = False
  problem = jobs.mesh_problem(MeshConfig(shape=tuple(shape.items())), len(devices), 1)
  assert (problem is None) == built, problem


def test_the_experiment_must_fit_the_job():
  stage1 = _exp()
  jobs.check_experiment(stage1, jobs.Target.GKE, 256, 2)  # fsdp -1, the slices on data
  with pytest.raises(jobs.LaunchError, match=r"^--topology/--num_slices: mesh.dcn=\{'data': 4\}"):
    jobs.check_experiment(_exp(sets=["mesh.dcn=(('data', 4),)"]), jobs.Target.GKE, 256, 2)
  with pytest.raises(jobs.LaunchError, match=r"^--nodes/--gpus_per_node: mesh.shape=.* needs 16 "
                                             "devices per slice; the job has 8"):
    jobs.check_experiment(_exp(sets=["mesh.shape=(('fsdp', 16),)"], fiddlers=["gpu"]),
                          jobs.Target.SLURM, 8, 1)
  with pytest.raises(jobs.LaunchError, match="^--target=slurm: model.attention=splash .* add "
                                             "--fiddler=gpu"):
    jobs.check_experiment(stage1, jobs.Target.SLURM, 512, 1)
  with pytest.raises(jobs.LaunchError, match="^--target=xpk: model.attention=cudnn needs GPUs"):
    jobs.check_experiment(_exp(fiddlers=["gpu"]), jobs.Target.XPK, 512, 1)
  with pytest.raises(jobs.LaunchError, match="^--nodes=0: must be >= 1"):
    slurm.check_slurm(0, 8)
  with pytest.raises(jobs.LaunchError, match="^--name='Stage_1': must be a DNS label"):
    jobs.check_name("Stage_1")
  assert jobs.default_name("experiments.olmo3_7b:stage1") == "olmo3-7b-stage1"
  assert jobs.default_name("experiments.olmo3_tiny.stage2") == "olmo3-tiny-stage2"


def test_stage3_jobs_show_their_context_parallel_mesh_and_refuse_what_cannot_split():
  stage3 = _exp("experiments.olmo3_7b:stage3")
  jobs.check_experiment(stage3, jobs.Target.GKE, 512, 1)
  assert jobs.mesh_description(stage3, 512, 1) == (
      "mesh data 1 x fsdp 64 x sequence 8 x tensor 1; context parallelism: each 65,536-token "
      "sequence over 8 devices")
  assert jobs.mesh_description(_exp(), 256, 2) == "mesh data 2 x fsdp 256 x sequence 1 x tensor 1"
  with pytest.raises(jobs.LaunchError, match=r"^mesh.shape: sequence=8 \(context parallelism\) "
                                             "needs .*model.attention=cudnn cannot"):
    jobs.check_experiment(_exp("experiments.olmo3_7b:stage3", fiddlers=["gpu"]),
                          jobs.Target.SLURM, 512, 1)
  with pytest.raises(jobs.LaunchError, match=r"^mesh.shape: sequence=8 splits each sequence "
                                             "into 16 equal chunks; data.seq_len=65528"):
    jobs.check_experiment(_exp("experiments.olmo3_7b:stage3", sets=["data.seq_len=65528"]),
                          jobs.Target.GKE, 512, 1)
  # All-to-all needs no offset mask and no zig-zag chunks, but cuDNN still cannot mask the
  # packed documents; and a head split the key/value heads do not divide is refused (the
  # sequence axis filled from -1 here, so the experiment's own check could not see it).
  a2a = "model.context_parallel='all_to_all'"
  jobs.check_experiment(_exp("experiments.olmo3_7b:stage3", sets=[a2a, "data.seq_len=65528"]),
                        jobs.Target.GKE, 512, 1)
  with pytest.raises(jobs.LaunchError, match=r"^data.packing: model.attention=cudnn cannot "
                                             "mask packed documents"):
    jobs.check_experiment(_exp("experiments.olmo3_7b:stage3", sets=[a2a], fiddlers=["gpu"]),
                          jobs.Target.SLURM, 512, 1)
  with pytest.raises(jobs.LaunchError, match=r"^mesh.shape: sequence=64 x tensor=1: all-to-all "
                                             r"context parallelism splits the heads 64 ways .* "
                                             r"does not divide 32 key/value heads"):
    jobs.check_experiment(_exp("experiments.olmo3_7b:stage3", sets=[
        a2a, "mesh.shape=(('data', 1), ('fsdp', 8), ('sequence', -1))"]), jobs.Target.GKE, 512, 1)


def test_xpk_command_runs_the_same_job():
  job = _pod_job()
  argv = gke.xpk_command(job, "my-cluster", zone="us-central1-c")
  assert argv[:3] == ["xpk", "workload", "create"]
  opts = dict(a.split("=", 1) for a in argv[3:-1] if not a.startswith("--env="))
  assert opts == {"--cluster": "my-cluster", "--workload": "olmo3-7b-stage1",
                  "--tpu-type": "tpu7x-4x4x8", "--num-slices": "2", "--docker-image": "img:1",
                  "--max-restarts": "2", "--termination-grace-period-seconds": "600",
                  "--zone": "us-central1-c"}
  assert [a for a in argv if a.startswith("--env=")] == [
      "--env=LIBTPU_INIT_ARGS=" + " ".join(FLAG_SETS["tpu7x"].libtpu),
      "--env=OLMO3_HEARTBEAT_TIMEOUT_S=30"]
  # xpk runs --command with bash: its words are the launcher's argv.
  assert argv[-1].startswith("--command=")
  assert shlex.split(argv[-1].removeprefix("--command=")) == job.command.argv()
  with pytest.raises(jobs.LaunchError, match="^--cluster: xpk needs"):
    gke.xpk_command(job, "")


def _slurm_job(processes, nodes=2):
  exp = _exp(fiddlers=["gpu"])
  return slurm.SlurmJob("olmo3-7b-stage1", nodes, 8, processes, _command("gpu"),
                       jobs.job_env(exp), partition="h100", time="7-00:00:00")


@pytest.mark.slow(seconds=1)
def test_slurm_script_one_task_per_gpu(tmp_path):
  """The script's #SBATCH header and srun line, and what each task receives: bash runs it with
  an `srun` that prints its arguments and the flag environment."""
  job = _slurm_job(jobs.Processes.PER_GPU)
  script = slurm.slurm_script(job)
  header = [line.removeprefix("#SBATCH ") for line in script.splitlines()
            if line.startswith("#SBATCH")]
  assert header == ["--job-name=olmo3-7b-stage1", "--nodes=2", "--ntasks-per-node=8",
                    "--gpus-per-node=8", "--exclusive", "--output=olmo3-7b-stage1-%j.out",
                    "--open-mode=append", "--requeue", "--partition=h100",
                    "--time=7-00:00:00", "--signal=TERM@600"]
  assert "JAX_LOCAL_DEVICE_IDS" not in script  # JAX gives each task GPU SLURM_LOCALID
  fake = tmp_path / "bin" / "srun"
  fake.parent.mkdir()
  fake.write_text('#!/bin/bash\nprintf "%s\\n" "$XLA_FLAGS" "$CUDA_DEVICE_MAX_CONNECTIONS" '
                  '"${JAX_LOCAL_DEVICE_IDS-unset}" "$@"\n')
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  (tmp_path / "job.sh").write_text(script)
  done = subprocess.run(["bash", str(tmp_path / "job.sh")], capture_output=True, text=True,
                        env=dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}",
                                 XLA_FLAGS="--xla_dump_to=/tmp/x"), check=True)
  xla, connections, local_ids, *srun = done.stdout.splitlines()
  # The flag set is appended to what the environment had, as the launcher appends it.
  assert xla == " ".join(("--xla_dump_to=/tmp/x", *FLAG_SETS["gpu_hopper"].xla))
  assert (connections, local_ids) == ("1", "unset")
  assert srun == ["--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--kill-on-bad-exit=1",
                  "--label", *job.command.argv()]


def test_slurm_script_one_task_per_node():
  script = slurm.slurm_script(_slurm_job(jobs.Processes.PER_NODE, nodes=64))
  assert "#SBATCH --ntasks-per-node=1\n" in script and "#SBATCH --gpus-per-node=8\n" in script
  assert "\nexport JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7\n" in script
  assert "\nsrun --nodes=64 --ntasks=64 --ntasks-per-node=1 " in script


def test_command_from_launcher_arguments():
  cmd = jobs.command_from_args(["--fdl_config=a.b:c", "--fdl_set=x=1", "--fiddler=f",
                                "--workdir=/w", "--force_workdir"], python="/py")
  assert cmd == jobs.Command("a.b:c", ("x=1",), ("f",), "/w", ("--force_workdir",), "/py")
  with pytest.raises(jobs.LaunchError, match="expected one --fdl_config"):
    jobs.command_from_args(["--workdir=/w"])


def _cluster(*args, path=None):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if path is not None:
    env["PATH"] = path
  return forked.completed("cluster", [f"--fdl_config={STAGE1}", *args], env, timeout=300)


@pytest.mark.slow(seconds=3)
def test_cli_dry_run_prints_a_valid_manifest():
  done = _cluster("--target=gke", "--accelerator=tpu7x", "--topology=4x8x8", "--image=img:1",
                  "--workdir=gs://b/s1", DATA_ROOT, "--dry_run")
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.startswith("# 1 x tpu7x 4x8x8 slice(s): 64 host(s) x 4 chips each, 512 "
                                "devices in all\n# mesh data 1 x fsdp 512 x sequence 1 x tensor 1\n")
  slices = jobs.tpu_slices("tpu7x", "4x8x8", 1)
  command = jobs.Command(STAGE1, ("data.root='\"http://olmo-data.org\"'",), (), "gs://b/s1")
  job = gke.PodJob("olmo3-7b-stage1", slices, "img:1", command, jobs.job_env(_exp()))
  gke.validate_jobset(done.stdout, job)


@pytest.mark.slow(seconds=3, waits=True)
def test_cli_submits_with_sbatch_and_names_a_missing_tool(tmp_path):
  """Without --dry_run the job goes to the real tool (here an `sbatch` that keeps what it is
  given); a tool that is not on PATH is a one-line error naming it."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "sbatch").write_text(f'#!/bin/bash\ncat > {tmp_path}/submitted\n'
                                  'echo "Submitted batch job 42"\n')
  (bin_dir / "sbatch").chmod(0o755)
  args = ["--fiddler=gpu", "--target=slurm", "--nodes=64", "--workdir=/shared/s1"]
  done = _cluster(*args, path=f"{bin_dir}:{os.environ['PATH']}")
  assert done.returncode == 0 and done.stdout == "Submitted batch job 42\n", done.stderr[-3000:]
  job = slurm.SlurmJob("olmo3-7b-stage1", 64, 8, jobs.Processes.PER_GPU,
                      jobs.Command(STAGE1, (), ("gpu",), "/shared/s1"),
                      jobs.job_env(_exp(fiddlers=["gpu"])),
                      mesh="mesh data 1 x fsdp 512 x sequence 1 x tensor 1")
  assert (tmp_path / "submitted").read_text() == slurm.slurm_script(job)
  done = _cluster("--target=gke", "--accelerator=tpu7x", "--topology=4x8x8", "--image=img:1",
                  "--workdir=gs://b/s1", path=os.path.dirname(sys.executable))
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1] == (
      "error: --target=gke submits with kubectl, which is not on PATH (--dry_run prints the job "
      "instead)")


def test_cluster_jobs_restart_by_default_with_room_in_dev_shm():
  """A failed host (an OOM, a SIGKILL, a hard preemption) restarts the JobSet, which resumes
  from the checkpoint; each pod's /dev/shm is a memory volume Grain's workers can fill; a
  preempted SLURM job is requeued."""
  slices = jobs.tpu_slices("tpu7x", "4x4x4", 1)
  job = gke.PodJob("olmo3-7b-stage1", slices, "img:1", _command(), jobs.job_env(_exp()))
  doc = gke.validate_jobset(gke.render_jobset(job), job)
  assert doc["spec"]["failurePolicy"] == {"maxRestarts": gke.DEFAULT_MAX_RESTARTS} != {
      "maxRestarts": 0}
  pod = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                          "sizeLimit": "16Gi"}}]
  assert pod["containers"][0]["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
  no_shm = gke.render_jobset(job).replace("mountPath: /dev/shm", "mountPath: /tmp/shm")
  with pytest.raises(jobs.LaunchError, match="/dev/shm is not a 16Gi memory volume"):
    gke.validate_jobset(no_shm, job)
  with pytest.raises(jobs.LaunchError, match="--shm_size='lots'"):
    gke.check_quantity("lots", "shm_size")
  script = slurm.slurm_script(_slurm_job(jobs.Processes.PER_GPU))
  assert "#SBATCH --requeue\n" in script and "#SBATCH --open-mode=append\n" in script


def test_the_hosts_install_must_resolve_the_data_and_tasks():
  """check_hosts: the named mixes resolve with the hosts' code in the hosts' install (its
  extras: the image's tpu,eval and SLURM's gpu,eval hold no ai2-olmo-core), and downstream tasks
  have ai2-olmo-eval; otherwise one line naming the field or flag."""
  assert jobs.host_extras(jobs.Target.GKE, None) == jobs.IMAGE_EXTRAS == ("tpu", "eval")
  assert jobs.host_extras(jobs.Target.XPK, None) == jobs.IMAGE_EXTRAS
  assert jobs.host_extras(jobs.Target.SLURM, None) == jobs.SLURM_EXTRAS == ("gpu", "eval")
  assert jobs.host_extras(jobs.Target.GKE, "tpu, eval,test") == ("tpu", "eval", "test")
  assert jobs.OLMO_CORE not in jobs.extras()["tpu"] | jobs.extras()["eval"] | jobs.extras()["gpu"]
  stage1 = _exp()
  jobs.check_hosts(stage1, jobs.IMAGE_EXTRAS)  # every 7B mix is shipped
  jobs.check_hosts(_exp("experiments.olmo3_7b:stage2", fiddlers=["gpu"]), jobs.SLURM_EXTRAS)
  jobs.check_hosts(_exp("experiments.olmo3_tiny:stage1"), jobs.IMAGE_EXTRAS)  # built in
  jobs.check_hosts(_exp(sets=["data.mix='http://host/mix.txt'"]), jobs.IMAGE_EXTRAS)  # a URL
  # A mix only ai2-olmo-core has (installed here by the test extra): the hosts have none.
  not_shipped = _exp(sets=["data.mix='OLMo-mix-0925-official'"])
  with pytest.raises(jobs.LaunchError) as e:
    jobs.check_hosts(not_shipped, jobs.IMAGE_EXTRAS)
  assert str(e.value) == (
      "DataConfig.mix='OLMo-mix-0925-official' is a mix of ai2-olmo-core, which the job's hosts "
      "do not install (--extras=tpu,eval): ship its list (python -m olmo3.data.mixes "
      "OLMo-mix-0925-official) and rebuild the image (or reinstall), or give --extras that "
      "install ai2-olmo-core")
  jobs.check_hosts(not_shipped, ("tpu", "eval", "test"))  # the test extra installs it
  with pytest.raises(jobs.LaunchError, match=r"^EvalConfig.heldout='c4-ppl-validation' is a mix "
                                             r"of ai2-olmo-core, .* \(--extras=gpu,eval\)"):
    jobs.check_hosts(_exp(sets=["eval.heldout=('c4-ppl-validation',)"], fiddlers=["gpu"]),
                     jobs.SLURM_EXTRAS)
  with pytest.raises(jobs.LaunchError, match=r"^DataConfig.mix='nosuch': no mix file, prepared "
                                             r"directory or named mix .* olmo3 ships "
                                             r"OLMo-longmino-mix-0625, "):
    jobs.check_hosts(_exp(sets=["data.mix='nosuch'"]), jobs.IMAGE_EXTRAS)
  # Tasks need the eval extra (without it every host would skip them, for the whole run).
  with pytest.raises(jobs.LaunchError, match=r"^--extras=tpu: the experiment evaluates 26 "
                                             r"downstream tasks, .* \(the eval extra\)"):
    jobs.check_hosts(stage1, ("tpu",))
  jobs.check_hosts(_exp(sets=["eval.tasks=()"]), ("tpu",))
  with pytest.raises(jobs.LaunchError, match=r"^--extras=tpu,evil: olmo3 has no extra 'evil' "
                                             r"\(its extras: eval, gpu, "):
    jobs.check_hosts(stage1, ("tpu", "evil"))


@pytest.mark.slow(seconds=6)
def test_cli_dry_run_checks_the_hosts_install(tmp_path):
  """The README's pod command renders its manifest where ai2-olmo-core cannot be imported (the
  hosts' install, and the README's `pip install -e .` on the user's machine); a mix the image
  cannot resolve is refused in one line, even where this machine could resolve it."""
  from tests.test_data_mixes import env_without_olmo_core  # pylint: disable=import-outside-toplevel

  pod = ["--target=gke", "--accelerator=tpu7x", "--topology=4x8x8", "--image=img:1",
         "--workdir=gs://b/s1", DATA_ROOT, "--dry_run"]
  done = subprocess.run([sys.executable, CLUSTER, f"--fdl_config={STAGE1}", *pod],
                        capture_output=True, text=True, cwd=ROOT, timeout=300,
                        env=env_without_olmo_core(tmp_path))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "kind: JobSet" in done.stdout
  done = _cluster(*pod, "--fdl_set=data.mix='OLMo-mix-0925-official'")
  assert done.returncode == 1 and not done.stdout
  assert done.stderr.strip().splitlines() == [
      "error: DataConfig.mix='OLMo-mix-0925-official' is a mix of ai2-olmo-core, which the "
      "job's hosts do not install (--extras=tpu,eval): ship its list (python -m "
      "olmo3.data.mixes OLMo-mix-0925-official) and rebuild the image (or reinstall), or give "
      "--extras that install ai2-olmo-core"]
  assert _cluster(*pod, "--fdl_set=data.mix='OLMo-mix-0925-official'",
                  "--extras=tpu,eval,test").returncode == 0
