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


def srun_command(text: str) -> list[str]:
  """The script's srun command, up to its redirections (srun's stderr goes through awk)."""
  line = next(line for line in text.splitlines() if line.startswith("srun "))
  return shlex.split(line.split(" 2>&1 ")[0])


@pytest.mark.parametrize("stem, config_file, num_workers", JOBS)
def test_slurm_script_runs_its_config_as_a_multi_worker_job(stem, config_file, num_workers):
  text = (CLUSTER_DIR / f"slurm_{stem}.sbatch").read_text()
  sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
  tasks = int(sbatch["nodes"])  # one task per node: no --ntasks
  assert "ntasks" not in sbatch and "ntasks-per-node" not in sbatch
  assert tasks == num_workers
  # a requeued run adds to the log: the first run's lines (why it failed) are kept
  assert sbatch["open-mode"] == "append"
  args = [a for a in srun_command(text)[1:] if a != "$@"]  # "$@": the sbatch arguments
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
  the script counts the allocation's tasks from SLURM_TASKS_PER_NODE instead. A job that named no
  tasks runs one per node: on whole nodes (--exclusive) SLURM_TASKS_PER_NODE counts their CPUs
  over --cpus-per-task ('8(x2)' on two 64-CPU nodes; seen on this Slurm: '2' for 8 CPUs over
  -c 4), and the script started 16 workers where the job meant 2 (a review; seen failing with
  the old count). srun is given --cpus-per-task, which Slurm 22.05-23.02 does not pass on."""
  (tmp_path / "srun").write_text('#!/bin/sh\necho "srun $*"\n')  # prints what it was asked
  (tmp_path / "srun").chmod(0o755)
  env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_CPUS_PER_TASK": "8"}
  for named, tasks_per_node, layout in (
      ("99", "2(x3),1", "--ntasks=7"), ("99", "1(x4)", "--ntasks=4"), ("99", "3", "--ntasks=3"),
      ("", "8(x2)", "--ntasks=2 --ntasks-per-node=1")):
    proc = subprocess.run(["bash", str(CLUSTER_DIR / f"slurm_{stem}.sbatch"), "--extra"],
                          env={**env, "SLURM_TASKS_PER_NODE": tasks_per_node, "SLURM_JOB_NUM_NODES":
                               "2", **({"SLURM_NTASKS": named} if named else {})},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"srun {layout} --cpus-per-task=8 --kill-on-bad-exit=1 "
                                  "tfdp-train "), proc.stdout
    assert proc.stdout.rstrip().endswith(" --extra"), proc.stdout
  outside = subprocess.run(["bash", str(CLUSTER_DIR / f"slurm_{stem}.sbatch")], env=env,
                           capture_output=True, text=True, timeout=30)
  assert outside.returncode != 0 and "submit this script with sbatch" in outside.stderr


# (srun's exit code, srun's lines for tasks that ended badly, environment, the job's exit code,
# requeued). --kill-on-bad-exit=1 stops the other tasks with SIGTERM when one fails: they exit
# 143, srun's highest code, so the job takes the first failed task's code from srun's lines.
EXITS = {
    "done": (0, [], {}, 0, False),
    "a_bad_config_on_one_task": (143, ["task 1: Exited with exit code 2",
                                       "task 0: Exited with exit code 143"], {}, 2, False),
    "a_lost_worker": (203, ["task 1: Exited with exit code 203", "task 0: Exited with exit code 143"],
                      {}, 203, True),
    "a_killed_worker": (137, ["task 1: Killed", "task 0: Exited with exit code 143"], {}, 137, True),
    "the_time_limits_sigterm": (143, ["tasks 0-1: Exited with exit code 143"],
                                {"SLURM_RESTART_COUNT": "2"}, 143, True),
    "out_of_restarts": (143, ["tasks 0-1: Exited with exit code 143"],
                        {"SLURM_RESTART_COUNT": "3"}, 143, False),
    "more_restarts_asked_for": (203, ["task 0: Exited with exit code 203"],
                                {"SLURM_RESTART_COUNT": "3", "TFDP_MAX_RESTARTS": "5"}, 203, True),
    "requeue_refused": (203, ["task 0: Exited with exit code 203"], {"SCONTROL_FAILS": "1"}, 203,
                        True),
    "srun_itself_failed": (1, [], {}, 1, False),
}


@pytest.mark.parametrize("stem", [stem for stem, _, _ in JOBS])
@pytest.mark.parametrize("case", EXITS)
def test_slurm_script_ends_with_the_first_failed_tasks_code_and_requeues_a_retryable_one(
    stem, case, tmp_path):
  """Slurm requeues a --requeue job on node failure or preemption, never for its exit code: the
  script requeues itself after 128 and above (143, 203, a killed task), up to TFDP_MAX_RESTARTS
  (default 3) counted by SLURM_RESTART_COUNT; any other code ends the job with it."""
  srun_code, lines, extra, code, requeued = EXITS[case]
  (tmp_path / "srun").write_text(  # a task's own line, then srun's lines, as srun prints them
      "#!/bin/sh\necho \"srun $*\"\necho 'a task line' >&2\n"
      + "".join(f"echo 'srun: error: node1: {line}' >&2\n" for line in lines) + f"exit {srun_code}\n")
  (tmp_path / "scontrol").write_text(
      '#!/bin/sh\necho "$@" >> "$HOME/scontrol.log"\n[ -z "$SCONTROL_FAILS" ]\n')
  for tool in ("srun", "scontrol"):
    (tmp_path / tool).chmod(0o755)
  env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "42",
         "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NUM_NODES": "2", **extra}
  proc = subprocess.run(["bash", str(CLUSTER_DIR / f"slurm_{stem}.sbatch")], env=env,
                        capture_output=True, text=True, timeout=30)
  assert proc.returncode == code, proc.stderr
  assert proc.stdout.startswith("srun --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 "
                                "tfdp-train "), proc.stdout
  # srun's stderr reaches the job's log whole, in order
  said = [line for line in proc.stderr.splitlines() if not line.startswith("tfdp: ")]
  assert said == ["a task line"] + [f"srun: error: node1: {line}" for line in lines], proc.stderr
  log = tmp_path / "scontrol.log"
  assert (log.read_text() if log.exists() else "") == ("requeue 42\n" if requeued else "")
  if requeued:
    restart = int(extra.get("SLURM_RESTART_COUNT", 0)) + 1
    assert f"requeueing job 42 (restart {restart} of TFDP_MAX_RESTARTS=" in proc.stderr
  if "SCONTROL_FAILS" in extra:
    assert "could not be requeued; it ends with exit code 203" in proc.stderr
  if case == "out_of_restarts":
    assert "already restarted 3 times (TFDP_MAX_RESTARTS=3): not requeueing it" in proc.stderr


@pytest.mark.parametrize("manifest", sorted(CLUSTER_DIR.glob("tfjob_*.yaml")),
                         ids=lambda p: p.name)
def test_tfjob_restart_policy_names_the_codes_tfdp_exits_with(manifest):
  text = manifest.read_text()
  job = next(d for d in yaml.safe_load_all(text) if d["kind"] == "TFJob")  # + a NetworkPolicy
  workers = job["spec"]["tfReplicaSpecs"]["Worker"]
  assert workers["restartPolicy"] == "ExitCode"
  policy_line = next(l for l in text.splitlines() if "restartPolicy:" in l)
  for code in (128 + signal.SIGTERM, errors.EXIT_RESTART_GROUP, errors.EXIT_PEER_STOPPED,
               errors.EXIT_PERMANENT):
    assert re.search(rf"\b{code}\b", policy_line), policy_line


@pytest.mark.parametrize("manifest", sorted(CLUSTER_DIR.glob("tfjob_*.yaml")),
                         ids=lambda p: p.name)
def test_tfjob_mounts_a_shipped_claim_that_pods_on_many_nodes_can_share(manifest):
  """A review: the TFJobs named a claim 'tfdp-shared' that nothing shipped (the pods stayed
  Pending), and one made ReadWriteOnce holds the second node's pod at 'Multi-Attach error'.
  Seen failing without configs/cluster/pvc_shared.yaml."""
  job = next(d for d in yaml.safe_load_all(manifest.read_text()) if d["kind"] == "TFJob")
  pod = job["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
  claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]]
  shipped = {d["metadata"]["name"]: d for f in CLUSTER_DIR.glob("*.yaml")
             for d in yaml.safe_load_all(f.read_text()) if d["kind"] == "PersistentVolumeClaim"}
  assert claims and all(c in shipped for c in claims), (claims, list(shipped))
  assert all(shipped[c]["spec"]["accessModes"] == ["ReadWriteMany"] for c in claims)


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
