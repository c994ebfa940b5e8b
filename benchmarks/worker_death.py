"""Time from a worker's death (SIGKILL) or freeze (SIGSTOP) to the exit of the whole group.

  python benchmarks/worker_death.py --repeats 3
Runs `tfdp-launch --num_workers 2` (no restarts) on a small synthetic job, waits until training
is under way, hits worker 1, and measures until the launcher has exited with no process left.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ("task.model.name=small_cnn,task.train_data.source=synthetic,task.train_data.num_examples=64000,"
       "task.train_data.image_size=16,task.train_data.num_classes=10,trainer.global_batch_size=64,"
       "trainer.epochs=1,trainer.steps_per_loop=5,runtime.intra_op_threads=1,"
       "runtime.inter_op_threads=1,trainer.checkpoint_every_steps=20")


def one_run(model_dir: str, signum: int) -> tuple[float, int, bool]:
  os.makedirs(os.path.dirname(model_dir), exist_ok=True)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  log = open(model_dir + ".log", "w")
  launcher = subprocess.Popen(
      [sys.executable, os.path.join(REPO, "apps", "launch.py"), "--num_workers=2", "--",
       sys.executable, os.path.join(REPO, "apps", "train.py"), f"--model_dir={model_dir}",
       "--mode=train", f"--params_override={JOB}"], env=env, stdout=log, stderr=subprocess.STDOUT)
  checkpoint = os.path.join(model_dir, "checkpoints", "checkpoint")
  while not os.path.exists(checkpoint):  # both workers are training
    if launcher.poll() is not None:
      raise SystemExit(f"the job ended before training started; see {model_dir}.log")
    time.sleep(0.05)
  workers = {int(p.environ().get("TFDP_WORKER_INDEX", -1)): p
             for p in psutil.Process(launcher.pid).children()}
  pids = [p.pid for p in workers.values()]
  hit_at = time.monotonic()
  os.kill(workers[1].pid, signum)
  launcher.wait()
  log.close()
  seconds = time.monotonic() - hit_at
  left = any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
             for pid in pids)
  return seconds, launcher.returncode, left


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--work_dir", default="/tmp/tfdp-worker-death")
  args = parser.parse_args()
  print("signal   run  seconds_to_group_exit  launcher_exit_code  processes_left")
  for name, signum in (("SIGKILL", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
    for run in range(args.repeats):
      model_dir = os.path.join(args.work_dir, f"{name}-{run}-{time.time_ns()}")
      seconds, code, left = one_run(model_dir, signum)
      print(f"{name:8} {run:3}  {seconds:21.1f}  {code:18}  {left}", flush=True)


if __name__ == "__main__":
  main()
