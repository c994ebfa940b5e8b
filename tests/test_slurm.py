"""tfdp under a real Slurm: the shipped sbatch template, srun with 3 tasks, a requeued job, the
template ending at once with a task's permanent failure, and the template requeueing itself after a
lost worker (coming back with another task count).

Needs slurmctld + slurmd + munged running (`.ci/run` starts them with
tests/scripts/start_slurm.sh); skipped with that reason where Slurm is absent.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

import helpers
from tfdp.distributed import slurm


def _slurm_up() -> str | None:
  if not shutil.which("sbatch") or not shutil.which("sinfo"):
    return "Slurm is not installed (apt-get install slurm-wlm munge)"
  try:
    states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                            timeout=20).stdout.split()
  except (OSError, subprocess.TimeoutExpired):
    return "sinfo does not answer"
  if not any(s in ("idle", "mixed", "allocated") for s in states):
    return "no Slurm node is up (start one: bash tests/scripts/start_slurm.sh)"
  return None


pytestmark = [pytest.mark.skipif(_slurm_up() is not None, reason=_slurm_up() or ""),
              # under `pytest -n 2 --dist loadgroup`: one job at a time on the one-node Slurm
              pytest.mark.xdist_group("many_processes")]

SYNTHETIC = ",".join([
    "task.model.name=small_cnn", "task.model.kwargs.filters=8",
    "task.train_data.source=synthetic", "task.train_data.image_size=16",
    "task.train_data.num_classes=4", "task.eval_data.source=synthetic",
    "task.eval_data.num_examples=96", "task.eval_data.image_size=16",
    "task.eval_data.num_classes=4", "runtime.intra_op_threads=1", "runtime.inter_op_threads=1",
])


def shipped_template(nodes_line: str) -> str:
  """configs/cluster/slurm_cifar10_quick.sbatch with its node line replaced, 1 CPU a task and
  20 minutes: what this machine's Slurm can run."""
  shipped = (helpers.REPO / "configs" / "cluster" / "slurm_cifar10_quick.sbatch").read_text()
  for line, replacement in {"#SBATCH --nodes=2\n": nodes_line,
                            "#SBATCH --cpus-per-task=8\n": "#SBATCH --cpus-per-task=1\n",
                            "#SBATCH --time=01:00:00\n": "#SBATCH --time=20\n"}.items():
    assert line in shipped, line
    shipped = shipped.replace(line, replacement)
  return shipped


def slurm_env() -> dict:
  env = helpers.env()
  # Jobs start tfdp-train from this virtualenv and read the repository's configs.
  env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
  return env


def squeue_state(job_id: str) -> str:
  out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                       text=True, timeout=20).stdout.strip()
  return out


def cancel(job_id: str) -> None:
  subprocess.run(["scancel", job_id], capture_output=True, timeout=20)


def submit_and_wait(args: list[str], timeout: float, env=None) -> str:
  """sbatch ARGS, polled every 0.5 s until the job has left the queue (sbatch --wait polls ever
  more slowly: it answered up to 30 s late here); then `scontrol show job`, which holds its
  ExitCode. The job is cancelled whatever happens."""
  submitted = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                             timeout=60, env=env or slurm_env(), cwd=str(helpers.REPO))
  assert submitted.returncode == 0, submitted.stderr
  job_id = submitted.stdout.strip().split(";")[0]
  started = time.monotonic()
  try:
    while squeue_state(job_id):
      assert time.monotonic() - started < timeout, "the job did not end"
      time.sleep(0.5)
  finally:
    cancel(job_id)
  return job_info(job_id)


def test_the_shipped_template_starts_one_task_on_a_whole_node(tmp_path):
  """On a whole node (--exclusive) with --cpus-per-task half its CPUs and no --ntasks, Slurm sets
  SLURM_TASKS_PER_NODE to 2 (CPUs over --cpus-per-task), and the template started 2 workers
  where it means one a node (a review; seen failing with the old count on the 8-CPU node, -c 4:
  2 configs printed). --print_config: each task prints the config and leaves."""
  cpus = int(subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True,
                            timeout=20).stdout.split()[0].rstrip("+"))
  assert cpus >= 2, cpus  # else a whole node holds one task of any size: no test
  out = tmp_path / "job.out"
  info = submit_and_wait(["--nodes=1", "--exclusive", f"--cpus-per-task={cpus // 2}",
                          f"--output={out}", "configs/cluster/slurm_cifar10_quick.sbatch",
                          "--print_config"], timeout=300)
  log = out.read_text() if out.exists() else ""
  assert "ExitCode=0:0" in info, info + log[-3000:]
  assert log.count("global_batch_size:") == 1, log[-3000:]


@pytest.mark.skipif(not helpers.HAVE_CIFAR, reason=helpers.NO_CIFAR_REASON)
def test_the_shipped_sbatch_template_runs_to_the_end_on_one_node(tmp_path):
  """configs/cluster/slurm_cifar10_quick.sbatch as shipped, its node count overridden to the
  one node here and a runlocal job layered on: 2 workers from SLURM_* variables."""
  out = tmp_path / "job.out"
  info = submit_and_wait(["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                          f"--output={out}", "configs/cluster/slurm_cifar10_quick.sbatch",
                          "--config_file=configs/runlocal.yaml", f"--model_dir={tmp_path / 'run'}",
                          "--params_override=trainer.export_model=false"], timeout=600)
  log = out.read_text() if out.exists() else ""
  assert "ExitCode=0:0" in info, info + log[-3000:]
  assert "worker 0 of 2 (slurm)" in log and "worker 1 of 2 (slurm)" in log, log[-3000:]
  assert "tfdp-train: done" in log
  assert len(pd.read_csv(tmp_path / "run" / "metrics.csv")) == 1


def test_three_tasks_under_srun_train_as_one_group(tmp_path):
  proc = subprocess.run(
      ["srun", "--ntasks=3", "--cpus-per-task=1", "--kill-on-bad-exit=1", "--time=10",
       sys.executable, helpers.TRAIN_APP, f"--model_dir={tmp_path / 'run'}",
       f"--params_override={SYNTHETIC},task.train_data.num_examples=384,"
       "trainer.global_batch_size=48,trainer.epochs=1,trainer.export_model=false"],
      capture_output=True, text=True, timeout=600, env=slurm_env(), cwd=str(helpers.REPO))
  assert proc.returncode == 0, proc.stderr[-3000:]
  for rank in range(3):
    assert f"worker {rank} of 3 (slurm)" in proc.stdout + proc.stderr
  assert pd.read_csv(tmp_path / "run" / "metrics.csv")["step"].tolist() == [8]  # 384 / 48


def port_pair_taken_at_the_second() -> tuple[int, socket.socket]:
  """(base, a socket bound to base + 1): worker 1 of a TFDP_SLURM_PORT_BASE=base job cannot
  listen. Bound, not listening: worker 0 finds no one there and waits in Python, where SIGTERM
  stops it at once (143); a listener would let it into TensorFlow's start-up, where SIGTERM waits
  for KillWait's SIGKILL."""
  for _ in range(20):
    holder = socket.socket()
    holder.bind(("", 0))
    base = holder.getsockname()[1] - 1
    try:
      socket.create_server(("", base)).close()  # worker 0's port is free
    except OSError:
      holder.close()
      continue
    return base, holder
  raise AssertionError("no two free ports in a row")


def test_the_shipped_template_ends_at_once_with_a_tasks_permanent_failure(tmp_path):
  """Task 1 cannot start for good (its port is taken: exit 2). srun --kill-on-bad-exit=1 stops
  task 0 at once instead of leaving it to wait out runtime.startup_timeout_seconds (then a
  SIGKILL: 137), and the job ends with task 1's 2, not task 0's 143 (stopped by SIGTERM): a
  permanent failure, not requeued."""
  base, holder = port_pair_taken_at_the_second()
  script = tmp_path / "job.sbatch"
  script.write_text(shipped_template("#SBATCH --nodes=1\n#SBATCH --ntasks=2\n"))
  out = tmp_path / "job.out"
  started = time.monotonic()
  with holder:
    info = submit_and_wait(
        [f"--output={out}", str(script), f"--model_dir={tmp_path / 'run'}",
         f"--params_override={SYNTHETIC},task.train_data.num_examples=64,"
         "trainer.global_batch_size=16,trainer.epochs=1,trainer.export_model=false,"
         "runtime.startup_timeout_seconds=60"],
        timeout=300, env={**slurm_env(), slurm.PORT_BASE_VAR: str(base)})
  seconds = time.monotonic() - started
  log = out.read_text() if out.exists() else ""
  assert "ExitCode=2:0" in info, info + log[-3000:]
  assert seconds < 45, (seconds, log[-3000:])  # not the 60 s start-up timeout
  assert re.search(rf"^tfdp-train: error: worker 1 cannot listen on \S+:{base + 1} ", log, re.M), log
  # srun's own code was task 0's 143: the job took the first failed task's
  assert re.search(r"^srun: error: \S+: task 1: Exited with exit code 2\n(.*\n)*srun: error: "
                   r"\S+: task 0: Exited with exit code 143$", log, re.M), log[-3000:]
  assert "requeueing" not in log and "Restarts=0" in info


def test_a_requeued_job_resumes_from_its_checkpoint_and_loses_nothing(tmp_path):
  """`scontrol requeue` mid-run (as a preemption does): Slurm stops the steps with SIGTERM,
  every worker saves the same step, the job runs again from the top of its script and resumes
  there; the final step is exact and each epoch appears once in metrics.csv."""
  run = tmp_path / "run"
  script = tmp_path / "job.sbatch"
  steps_per_epoch, epochs = 40, 3
  script.write_text(
      "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --ntasks=2\n#SBATCH --cpus-per-task=1\n"
      "#SBATCH --requeue\n#SBATCH --time=20\n#SBATCH --open-mode=append\n"
      f"srun --kill-on-bad-exit=1 {sys.executable} {helpers.TRAIN_APP} --model_dir={run} "
      f"--params_override={SYNTHETIC},task.train_data.num_examples={steps_per_epoch * 32},"
      f"trainer.global_batch_size=32,trainer.epochs={epochs},trainer.steps_per_loop=2,"
      "trainer.checkpoint_every_steps=10,trainer.export_model=false\n")
  out = tmp_path / "job.out"  # both runs, the first and the requeued one
  requeue_mid_run_and_wait(script, run, out)
  text = out.read_text()
  assert text.count("worker 0 of 2 (slurm)") == 2, text[-3000:]  # the first run and the requeued one
  resumed = [int(step) for step in re.findall(r"resumed from \S+ at step (\d+)", text)]
  assert len(resumed) == 2 and resumed[0] == resumed[1] > 0, text[-3000:]  # both workers, one step
  metrics = pd.read_csv(run / "metrics.csv")
  assert metrics["epoch"].tolist() == list(range(1, epochs + 1)), metrics
  assert metrics["step"].iloc[-1] == steps_per_epoch * epochs


def test_a_requeued_job_that_comes_back_with_fewer_tasks_resumes_with_the_elastic_rules(tmp_path):
  """The shipped template, its resource lines set for this one node (3 tasks), loses a worker
  mid-run (task 2 SIGKILLed, as by the OOM killer): srun stops the others, and the script, seeing
  a retryable code, requeues its own job (Slurm would not: it requeues on node failure or
  preemption only). While it is pending it is given 2 tasks (`scontrol update NumTasks=2
  NumCPUs=2`; on many nodes a --nodes=2-4 job that comes back on fewer does the same). Slurm keeps
  SLURM_NTASKS=3 from the submission; the script asks srun for the allocation's 2, and they resume
  the 3-task run: the global batch 12 kept, accumulation 1 -> 2, the final step exact. The log
  holds both runs (the template's --open-mode=append)."""
  run = tmp_path / "run"
  script = tmp_path / "job.sbatch"
  steps_per_epoch, epochs = 40, 2
  script.write_text(shipped_template("#SBATCH --nodes=1\n#SBATCH --ntasks=3\n"))
  out = tmp_path / "job.out"
  job_id = requeue_mid_run_and_wait(
      script, run, out, "NumTasks=2", "NumCPUs=2", stop=lambda job: kill_a_task(job, 2),
      args=[f"--model_dir={run}", "--mode=train",
            f"--params_override={SYNTHETIC},task.train_data.num_examples={steps_per_epoch * 12},"
            f"trainer.global_batch_size=12,trainer.epochs={epochs},trainer.steps_per_loop=2,"
            "trainer.checkpoint_every_steps=10,trainer.export_model=false"])
  text = out.read_text()
  # the first run's lines are kept (append), the script's requeue among them
  assert "worker 2 of 3 (slurm)" in text and "worker 1 of 2 (slurm)" in text, text[-3000:]
  assert re.search(r"^srun: error: \S+: task 2: Killed$", text, re.M), text[-3000:]
  # srun may hear of a peer's 203 (lost worker) before of task 2's death: either is retryable
  assert re.search(rf"^tfdp: the tasks ended with exit code (137|203) \(retryable\): requeueing "
                   rf"job {job_id} \(restart 1 of TFDP_MAX_RESTARTS=3\)$", text, re.M), text[-3000:]
  assert "Restarts=1" in job_info(job_id)
  # the chief's start-up line (every worker also logs it, prefixed)
  lines = re.findall(r"^resumed at step (\d+) on 2 workers \(was 3\): (.*)$", text, re.MULTILINE)
  assert len(lines) == 1 and int(lines[0][0]) >= 10, text[-3000:]
  assert lines[0][1] == "accumulation 1 → 2, per-replica batch 3, global batch 12 kept"
  history = json.loads((run / "checkpoints" / "run.json").read_text())["history"]
  assert history == [{"from_step": 0, "workers": 3, "replicas": 3},
                     {"from_step": int(lines[0][0]), "workers": 2, "replicas": 2}]
  metrics = pd.read_csv(run / "metrics.csv")
  assert metrics["epoch"].tolist() == list(range(1, epochs + 1)), metrics
  assert metrics["step"].iloc[-1] == steps_per_epoch * epochs


def job_info(job_id: str) -> str:
  return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                        timeout=20).stdout


def scontrol_requeue(job_id: str) -> None:
  """As a preemption does: Slurm stops the steps with SIGTERM and the job is pending again."""
  requeued = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                            timeout=30)
  assert requeued.returncode == 0, requeued.stderr


def kill_a_task(job_id: str, rank: int) -> None:
  """SIGKILLs the tfdp-train of task `rank` of the job's srun: a lost worker."""
  for proc in psutil.process_iter(["cmdline"]):
    try:
      env = proc.environ()
      command = proc.info["cmdline"] or []
      if (env.get("SLURM_JOB_ID") == job_id and env.get("SLURM_PROCID") == str(rank)
          and "SLURM_STEP_ID" in env and any(a.endswith("tfdp-train") for a in command[:2])):
        proc.kill()
        return
    except psutil.Error:
      continue
  raise AssertionError(f"job {job_id} has no task {rank}")


def requeue_mid_run_and_wait(script, run, out, *changes: str, stop=scontrol_requeue,
                             args=()) -> str:
  """Submits the job; after its first checkpoint `stop`s it (job id → None), which must leave
  it pending again (requeued); applies `changes` (`scontrol update` fields) while it is pending,
  starts it at once (Slurm holds a requeued job back for 2 minutes; a real preemption waits for
  nodes anyway) and waits for it to finish. The job is cancelled whatever happens; its id."""
  submitted = subprocess.run(["sbatch", "--parsable", f"--output={out}", str(script), *args],
                             capture_output=True, text=True, timeout=60, env=slurm_env(),
                             cwd=str(helpers.REPO))
  assert submitted.returncode == 0, submitted.stderr
  job_id = submitted.stdout.strip().split(";")[0]
  try:
    deadline = time.monotonic() + 400
    while not list((run / "checkpoints").glob("ckpt-*.index")):  # a first save: mid-run
      assert time.monotonic() < deadline, "no checkpoint appeared"
      assert squeue_state(job_id), "the job ended before it was requeued"
      time.sleep(0.5)
    stop(job_id)
    while squeue_state(job_id) not in ("PENDING", ""):  # the steps are being stopped
      time.sleep(0.2)
    assert squeue_state(job_id) == "PENDING", "the job ended instead of being requeued"
    # slurmd revoked the job's credential when it stopped the steps and refuses a credential made
    # in the same second ("Killing non-startable batch JobId=19: Job credential revoked", seen
    # once in CI): start it again a second later, not at once.
    time.sleep(1.1)
    updated = subprocess.run(["scontrol", "update", f"JobId={job_id}", *changes, "StartTime=now"],
                             capture_output=True, text=True, timeout=30)
    assert updated.returncode == 0, updated.stderr
    while squeue_state(job_id):  # pending again, then running, then gone when done
      assert time.monotonic() < deadline + 400, "the requeued job did not finish"
      time.sleep(1)
  finally:
    cancel(job_id)
  return job_id


def test_tfdp_launch_in_each_task_of_an_srun_is_told_to_let_srun_start_the_workers():
  """Each task's launcher started a group of its own, whose workers then refused srun's layout
  with 'unset TF_CONFIG', which the user never set."""
  proc = subprocess.run(
      ["srun", "--ntasks=2", "--cpus-per-task=1", "--time=2", sys.executable,
       str(helpers.REPO / "apps" / "launch.py"), "--num_workers=2", "--", "true"],
      capture_output=True, text=True, timeout=120, env=slurm_env(), cwd=str(helpers.REPO))
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if line.startswith("tfdp-launch")]
  assert len(lines) == 2 and "TF_CONFIG" not in proc.stderr, proc.stderr[-3000:]
  assert all(line.startswith("tfdp-launch: error: srun started tfdp-launch as task ")
             and line.endswith("of 2: each task would start its own workers; let srun start "
                               "them (`srun --ntasks=2 tfdp-train ...`, no tfdp-launch) or start "
                               "one launcher (`srun --ntasks=1 tfdp-launch ...`).")
             for line in lines), lines
