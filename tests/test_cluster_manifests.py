"""The Kubernetes and Slurm examples run the config they claim, as a valid multi-worker job."""
import json
import re
import shlex

import yaml

import helpers
from tfdp import cli
from tfdp import cluster as cluster_lib
from tfdp import config as config_lib
from tfdp import strategy as strategy_lib

CLUSTER_DIR = helpers.REPO / "configs" / "cluster"


def flag_values(args, name):
  return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


def check_job(args, cluster):
  """The command's config loads, and as this cluster it is a valid multi-worker job."""
  assert args[0] == "tfdp-train"
  files = flag_values(args, "config_file")
  assert files == ["configs/cifar10_quick.yaml"]
  config = config_lib.load_config([cli.find_config(f) for f in files],
                                  flag_values(args, "params_override"))
  assert flag_values(args, "model_dir")
  plan = strategy_lib.plan_strategy(config.runtime, cluster, ["/cpu:0"])
  assert plan.kind == "multi_worker_mirrored" and plan.all_reduce == "ring"
  config_lib.check_batch_divides(config, cluster.num_workers)
  return config


def test_tfjob_runs_the_quick_config_on_two_workers():
  manifest = yaml.safe_load((CLUSTER_DIR / "tfjob_cifar10_quick.yaml").read_text())
  assert manifest["kind"] == "TFJob"
  workers = manifest["spec"]["tfReplicaSpecs"]["Worker"]
  container = workers["template"]["spec"]["containers"][0]
  assert container["name"] == "tensorflow"
  # The TF_CONFIG the training operator writes for worker 1 of this job:
  hosts = [f"tfdp-cifar10-quick-worker-{i}.default.svc:2222" for i in range(workers["replicas"])]
  tf_config = json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": 1}})
  cluster = cluster_lib.parse_tf_config(tf_config)
  assert cluster.num_workers == 2 and not cluster.is_chief
  check_job(container["command"], cluster)
  env = {e["name"]: e["value"] for e in container["env"]}
  assert env["TFDS_DATA_DIR"].startswith("/shared")
  assert flag_values(container["command"], "model_dir")[0].startswith("/shared")


def test_slurm_script_runs_the_quick_config_on_two_workers():
  text = (CLUSTER_DIR / "slurm_cifar10_quick.sbatch").read_text()
  sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
  tasks = int(sbatch["nodes"]) * int(sbatch["ntasks-per-node"])
  assert tasks == 2
  srun = next(line for line in text.splitlines() if line.startswith("srun "))
  args = shlex.split(srun)[1:]
  # What srun gives task 1 of this allocation:
  env = {"SLURM_PROCID": "1", "SLURM_NTASKS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks),
         "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "1"}
  cluster = cluster_lib.resolve_cluster(env)
  assert cluster.source == "slurm" and cluster.num_workers == 2 and cluster.rank == 1
  check_job(args, cluster)
