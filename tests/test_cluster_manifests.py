"""The Kubernetes and Slurm examples run the config they claim, as a valid multi-worker job."""
import json
import re
import shlex
import signal
import subprocess

import pytest
import yaml

import helpers
from tfdp import cli
from tfdp.distributed import cluster as cluster_lib
from tfdp import config as config_lib
from tfdp import errors
from tfdp.core import data as data_lib
from tfdp.distributed import strategy as strategy_lib

CLUSTER_DIR = helpers.REPO / "configs" / "cluster"


def flag_values(args, name):
  return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


JOBS = [  # (manifest stem, the config it must run, workers)
    ("cifar10_quick", "configs/cifar10_quick.yaml", 2),
    ("shakespeare_mlm", "configs/shakespeare_mlm.yaml", 4),
]


def check_job(args, cluster, config_file):
  """The command's config loads, and as this cluster it is a valid multi-worker job."""
  assert args[0] == "tfdp-train"
  files = flag_values(args, "config_file")
  assert files == [config_file]
  config = config_lib.load_config([cli.find_config(f) for f in files],
                                  flag_values(args, "params_override"))
  assert flag_values(args, "model_dir")
  plan = strategy_lib.plan_strategy(config.runtime, cluster, ["/cpu:0"])
  assert plan.kind == "multi_worker_mirrored" and plan.all_reduce == "ring"
  data_lib.check_batch_divides(config, cluster.num_workers)
  return config


@pytest.mark.parametrize("stem, config_file, num_workers", JOBS)
def test_tfjob_runs_its_config_as_a_multi_worker_job(stem, config_file, num_workers):
  documents = list(yaml.safe_load_all((CLUSTER_DIR / f"tfjob_{stem}.yaml").read_text()))
  manifest = next(d for d in documents if d["kind"] == "TFJob")  # also ships a NetworkPolicy
  assert manifest["kind"] == "TFJob"
  workers = manifest["spec"]["tfReplicaSpecs"]["Worker"]
  container = workers["template"]["spec"]["containers"][0]
  assert container["name"] == "tensorflow"
  # The TF_CONFIG the training operator writes for worker 1 of this job:
  name = manifest["metadata"]["name"]
  hosts = [f"{name}-worker-{i}.default.svc:2222" for i in range(workers["replicas"])]
  tf_config = json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": 1}})
  cluster = cluster_lib.parse_tf_config(tf_config)
  assert cluster.num_workers == num_workers and not cluster.is_chief
  config = check_job(container["command"], cluster, config_file)
  env = {e["name"]: e["value"] for e in container.get("env", [])}
  for data in (config.task.train_data, config.task.eval_data):  # data on the shared volume
    where = env["TFDS_DATA_DIR"] if data.source == "tfds" else data.path
    assert where.startswith("/shared"), where
  assert flag_values(container["command"], "model_dir")[0].startswith("/shared")


@pytest.mark.parametrize("stem, config_file, num_workers", JOBS)
def test_slurm_script_runs_its_config_as_a_multi_worker_job(stem, config_file, num_workers):
  text = (CLUSTER_DIR / f"slurm_{stem}.sbatch").read_text()
  sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
  tasks = int(sbatch["nodes"])  # one task per node: no --ntasks
  assert "ntasks" not in sbatch and "ntasks-per-node" not in sbatch
  assert tasks == num_workers
  srun = next(line for line in text.splitlines() if line.startswith("srun "))
  args = [a for a in shlex.split(srun)[1:] if a != "$@"]  # "$@": the sbatch arguments
  args = args[args.index("tfdp-train"):]  # after srun's own options
  # What srun gives task 1 of this allocation:
  env = {"SLURM_PROCID": "1", "SLURM_NTASKS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks),
         "SLURM_STEP_NODELIST": f"node[01-{tasks:02d}]",
         "SLURM_STEP_TASKS_PER_NODE": f"1(x{tasks})",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "1"}
  cluster = cluster_lib.resolve_cluster(env)
  assert cluster.source == "slurm" and cluster.num_workers == tasks and cluster.rank == 1
  check_job([a.replace("$HOME", "/home/u") for a in args], cluster, config_file)


@pytest.mark.parametrize("stem", [stem for stem, _, _ in JOBS])
def test_slurm_script_asks_srun_for_the_allocations_tasks_not_the_submitted_count(stem, tmp_path):
  """A requeued job that came back on fewer nodes or tasks keeps the submission's SLURM_NTASKS;
  the script counts the allocation's tasks from SLURM_TASKS_PER_NODE instead."""
  (tmp_path / "srun").write_text('#!/bin/sh\necho "srun $*"\n')  # prints what it was asked
  (tmp_path / "srun").chmod(0o755)
  env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_NTASKS": "99"}
  for tasks_per_node, tasks in (("2(x3),1", 7), ("1(x4)", 4), ("3", 3)):
    proc = subprocess.run(["bash", str(CLUSTER_DIR / f"slurm_{stem}.sbatch"), "--extra"],
                          env={**env, "SLURM_TASKS_PER_NODE": tasks_per_node},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"srun --ntasks={tasks} tfdp-train "), proc.stdout
    assert proc.stdout.rstrip().endswith(" --extra"), proc.stdout
  outside = subprocess.run(["bash", str(CLUSTER_DIR / f"slurm_{stem}.sbatch")], env=env,
                           capture_output=True, text=True, timeout=30)
  assert outside.returncode != 0 and "submit this script with sbatch" in outside.stderr


@pytest.mark.parametrize("manifest", sorted(CLUSTER_DIR.glob("tfjob_*.yaml")),
                         ids=lambda p: p.name)
def test_tfjob_restart_policy_names_the_codes_tfdp_exits_with(manifest):
  text = manifest.read_text()
  job = next(d for d in yaml.safe_load_all(text) if d["kind"] == "TFJob")  # + a NetworkPolicy
  workers = job["spec"]["tfReplicaSpecs"]["Worker"]
  assert workers["restartPolicy"] == "ExitCode"
  policy_line = next(l for l in text.splitlines() if "restartPolicy:" in l)
  for code in (128 + signal.SIGTERM, errors.EXIT_RESTART_GROUP, errors.EXIT_PERMANENT):
    assert re.search(rf"\b{code}\b", policy_line), policy_line


@pytest.mark.parametrize("stem", [stem for stem, _, _ in JOBS])
def test_tfjob_runs_in_the_image_the_shipped_dockerfile_builds(stem):
  """A cluster probe installed the package as the manifest said (`pip install .`) and ran the
  TFJob's command in a pod's folder: 'config file configs/cifar10_quick.yaml does not exist',
  exit 2 (final for the ExitCode policy): configs/ is not in the package, and the manifest gave
  no working directory. Now configs/cluster/Dockerfile keeps the repository in its WORKDIR,
  installed in place, and the TFJob runs there. Seen failing: no Dockerfile, no workingDir."""
  dockerfile = (CLUSTER_DIR / "Dockerfile").read_text()
  workdir = re.findall(r"^WORKDIR (\S+)", dockerfile, re.M)[-1]
  copied = [src.rstrip("/") for src in re.findall(r"^COPY (\S+) ", dockerfile, re.M)]
  for src in copied:
    assert (helpers.REPO / src).exists(), src
  assert "configs" in copied and re.search(r"^RUN pip install .*-e \.$", dockerfile, re.M)
  documents = list(yaml.safe_load_all((CLUSTER_DIR / f"tfjob_{stem}.yaml").read_text()))
  manifest = next(d for d in documents if d["kind"] == "TFJob")
  container = manifest["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
  assert container["workingDir"] == workdir
  # every relative path the job reads lies in what the image copied
  config = config_lib.load_config([cli.find_config(f) for f in
                                   flag_values(container["command"], "config_file")])
  relative = [p for p in (*flag_values(container["command"], "config_file"),
                          config.task.text.vocab_path) if p and not p.startswith("/")]
  assert relative and all(p.split("/")[0] in copied for p in relative), relative
