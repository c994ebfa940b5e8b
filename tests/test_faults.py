"""Faults under tfdp-launch: a frozen worker, a killed launcher, and workers killed at random."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pandas as pd
import psutil

import helpers
from tfdp.distributed import launch as launcher

LAUNCH_APP = str(helpers.REPO / "apps" / "launch.py")
SLEEPER = ("import os, sys, time\n"
           "print('started', os.getpid(), flush=True)\n"
           "deadline = time.monotonic() + float(sys.argv[1])\n"
           "while time.monotonic() < deadline:\n"
           "  time.sleep(0.1)\n")


def start_launcher(*args: str, log=subprocess.PIPE) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, LAUNCH_APP, *args], stdout=log,
                          stderr=subprocess.STDOUT, env=helpers.env(), cwd=str(helpers.REPO),
                          text=True)


def worker_pids(launcher_proc: subprocess.Popen, count: int, timeout: float = 60) -> list[int]:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    children = [p for p in psutil.Process(launcher_proc.pid).children() if alive(p.pid)]
    if len(children) == count:
      return sorted(p.pid for p in children)
    time.sleep(0.05)
  raise AssertionError(f"{count} workers did not start within {timeout}s")


def alive(pid: int) -> bool:
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except (psutil.NoSuchProcess, ProcessLookupError):  # gone between listing and reading it
    return False


def test_a_frozen_worker_stops_the_group_within_fifteen_seconds():
  proc = start_launcher("--num_workers=2", "--", sys.executable, "-c", SLEEPER, "120")
  pids = worker_pids(proc, 2)
  time.sleep(1)
  frozen_at = time.monotonic()
  os.kill(pids[1], signal.SIGSTOP)
  out, _ = proc.communicate(timeout=60)
  seconds = time.monotonic() - frozen_at
  assert proc.returncode == 128 + signal.SIGKILL, out  # killed by the launcher: retryable
  assert seconds <= 15, (seconds, out)
  assert "worker 1 was frozen" in out, out
  assert not any(alive(pid) for pid in pids)


def test_a_briefly_stopped_worker_is_not_declared_dead():
  """A worker stopped for less than FROZEN_WORKER_SECONDS (job control, a debugger's glance)
  and running again is forgiven: the group finishes normally."""
  proc = start_launcher("--num_workers=2", "--", sys.executable, "-c", SLEEPER, "6")
  pids = worker_pids(proc, 2)
  os.kill(pids[0], signal.SIGSTOP)
  time.sleep(launcher.FROZEN_WORKER_SECONDS / 3)
  os.kill(pids[0], signal.SIGCONT)
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == 0, out


def test_workers_die_with_a_killed_launcher():
  proc = start_launcher("--num_workers=2", "--", sys.executable, "-c", SLEEPER, "120")
  pids = worker_pids(proc, 2)
  proc.kill()  # SIGKILL: the launcher cannot stop its workers itself
  proc.wait()
  deadline = time.monotonic() + 10
  while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(alive(pid) for pid in pids), "orphaned workers outlived their launcher"


CHAOS_JOB = ("task.model.name=small_cnn,task.model.kwargs.filters=8,"
             "task.train_data.source=synthetic,task.train_data.num_examples=8192,"
             "task.train_data.image_size=16,task.train_data.num_classes=4,"
             "task.eval_data.source=synthetic,task.eval_data.num_examples=256,"
             "task.eval_data.image_size=16,task.eval_data.num_classes=4,"
             "trainer.global_batch_size=32,trainer.epochs=2,trainer.steps_per_loop=4,"
             "trainer.checkpoint_every_steps=8,runtime.intra_op_threads=1,"
             "runtime.inter_op_threads=1")  # 2 x 256 steps: far more than 2 s of training


def test_chaos_three_random_worker_kills_and_the_job_still_finishes(tmp_path):
  """Under --max_restarts 3, SIGKILL a random worker three times at random moments (during
  start-up and during training); the job finishes at its planned step, metrics.csv has each
  epoch once, the exported model loads and no process is left."""
  seed = int(os.environ.get("TFDP_CHAOS_SEED", time.time_ns() % 10_000))
  rng = random.Random(seed)
  model_dir = tmp_path / "run"
  log_path = tmp_path / "launch.log"
  with open(log_path, "w") as log:
    proc = start_launcher("--num_workers=2", "--max_restarts=3", "--",
                          sys.executable, str(helpers.TRAIN_APP), f"--model_dir={model_dir}",
                          f"--params_override={CHAOS_JOB}", log=log)
    seen, killed = set(), []
    for kill in range(3):
      pids = worker_pids(proc, 2, timeout=120)
      while set(pids) & seen:  # wait for the restarted group
        time.sleep(0.05)
        pids = worker_pids(proc, 2, timeout=120)
      seen.update(pids)
      if kill == 1:  # once mid-training: after the group has checkpointed
        deadline = time.monotonic() + 120
        while not (model_dir / "checkpoints" / "checkpoint").exists():
          assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()[-3000:]
          time.sleep(0.05)
      time.sleep(rng.uniform(0.2, 2.0) if kill == 1 else rng.uniform(0.5, 4.0))
      victim = rng.choice(pids)
      assert proc.poll() is None, f"seed {seed}: job ended before kill {kill + 1}"
      os.kill(victim, signal.SIGKILL)
      killed.append(victim)
    proc.wait(timeout=600)
  text = log_path.read_text()
  assert proc.returncode == 0, f"seed {seed}\n{text[-4000:]}"
  assert text.count("restarting all 2 workers") == 3, f"seed {seed}\n{text[-4000:]}"
  metrics = pd.read_csv(model_dir / "metrics.csv")
  assert metrics["epoch"].tolist() == [1, 2], metrics
  assert int(metrics["step"].iloc[-1]) == 2 * 8192 // 32
  assert not any(alive(pid) for pid in seen)
  check = subprocess.run(
      [sys.executable, "-c", "import sys, keras; m = keras.saving.load_model(sys.argv[1]); "
       "print(m.count_params())", str(model_dir / "model.keras")],
      capture_output=True, text=True, env=helpers.env(), timeout=120)
  assert check.returncode == 0 and int(check.stdout.split()[-1]) > 0, check.stderr[-2000:]


LONG_EPOCH = ("task.model.name=small_cnn,task.model.kwargs.filters=8,"
              "task.train_data.source=synthetic,task.train_data.num_examples=64000,"
              "task.train_data.image_size=16,task.train_data.num_classes=4,"
              "trainer.global_batch_size=32,trainer.epochs=1,trainer.steps_per_loop=4,"
              "runtime.intra_op_threads=1,runtime.inter_op_threads=1")


def test_training_workers_of_a_killed_launcher_save_a_checkpoint_and_exit(tmp_path):
  """SIGKILL to the launcher in the middle of one long epoch (no scheduled checkpoint): its
  workers get SIGTERM, agree on a step, save there and exit, though their output pipe is gone."""
  model_dir = tmp_path / "run"
  log_path = tmp_path / "launch.log"
  with open(log_path, "w") as log:
    proc = start_launcher("--num_workers=2", "--", sys.executable, str(helpers.TRAIN_APP),
                          f"--model_dir={model_dir}", "--mode=train",
                          f"--params_override={LONG_EPOCH}", log=log)
    pids = worker_pids(proc, 2, timeout=120)
    deadline = time.monotonic() + 180
    while "epoch 1/1 step" not in log_path.read_text().lower():  # a loop line: training
      assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()[-3000:]
      time.sleep(0.1)
    time.sleep(2)  # some steps into the epoch
    proc.kill()
    proc.wait()
  deadline = time.monotonic() + 30
  while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(alive(pid) for pid in pids), "workers outlived their launcher by 30 s"
  saved = list((model_dir / "checkpoints").glob("ckpt-*.index"))
  assert len(saved) == 1 and 0 < int(saved[0].name[5:-6]) < 2000, saved
