"""Time from a worker's death (SIGKILL) or freeze (SIGSTOP) to the exit of the whole group,
and from the launcher's own SIGKILL to the exit of its orphaned workers.

  python benchmarks/worker_death.py --repeats 3
Runs `tfdp-launch --num_workers 2` (no restarts) on a small synthetic job, waits until training
is under way, hits worker 1 (or the launcher), and measures until no process is left.
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


def one_run(model_dir: str, signum: int, target: str = "worker") -> tuple[float, int, bool]:
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
  if target == "launcher":
    launcher.kill()
    while any(alive(pid) for pid in pids) and time.monotonic() - hit_at < 120:
      time.sleep(0.05)
  else:
    os.kill(workers[1].pid, signum)
  launcher.wait()
  log.close()
  while any(alive(pid) for pid in pids) and time.monotonic() - hit_at < 120:
    time.sleep(0.05)
  seconds = time.monotonic() - hit_at
  return seconds, launcher.returncode, any(alive(pid) for pid in pids)


def alive(pid: int) -> bool:
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--work_dir", default="/tmp/tfdp-worker-death")
  parser.add_argument("--hits", default="worker SIGKILL,worker SIGSTOP,launcher SIGKILL",
                      help="which rows to measure, comma-separated")
  args = parser.parse_args()
  print("hit                run  seconds_to_no_worker_left  launcher_exit_code  processes_left")
  for name, signum, target in (("worker SIGKILL", signal.SIGKILL, "worker"),
                               ("worker SIGSTOP", signal.SIGSTOP, "worker"),
                               ("launcher SIGKILL", signal.SIGKILL, "launcher")):
    if name not in args.hits.split(","):
      continue
    for run in range(args.repeats):
      model_dir = os.path.join(args.work_dir, f"{target}-{signum}-{run}-{time.time_ns()}")
      seconds, code, left = one_run(model_dir, signum, target)
      print(f"{name:17} {run:3}  {seconds:25.1f}  {code:18}  {left}", flush=True)


if __name__ == "__main__":
  main()
