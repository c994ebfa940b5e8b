"""tfdp-launch --min_workers: the group shrinks past a worker that keeps failing, grows back when
its slot is listed again, and stops with one line when too few are left (real processes)."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import pandas as pd
import psutil
import pytest

import helpers
from tfdp.distributed import elastic
from tfdp.errors import TfdpError

LAUNCH_APP = str(helpers.REPO / "apps" / "launch.py")


# ---- the decision, a pure function -------------------------------------------------------------
@pytest.mark.parametrize("ran, blamed, streaks, available, slots, new_streaks, dropped", [
    # first failure of slot 2: a strike, the group stays whole
    ((0, 1, 2), 2, {}, {0, 1, 2}, (0, 1, 2), {0: 0, 1: 0, 2: 1}, ()),
    # second in a row: dropped
    ((0, 1, 2), 2, {2: 1}, {0, 1, 2}, (0, 1), {0: 0, 1: 0, 2: 2}, (2,)),
    # another slot failed in between: the row is broken, slot 2 starts again from 0
    ((0, 1, 2), 1, {2: 1}, {0, 1, 2}, (0, 1, 2), {0: 0, 1: 1, 2: 0}, ()),
    # nobody to blame (a worker lost its peer, exit 203): every row is broken
    ((0, 1, 2), None, {2: 1}, {0, 1, 2}, (0, 1, 2), {0: 0, 1: 0, 2: 0}, ()),
    # a dropped slot listed again rejoins; its streak is kept (one more failure drops it again)
    ((0, 1), 0, {2: 2}, {0, 1, 2}, (0, 1, 2), {0: 1, 1: 0, 2: 2}, ()),
    ((0, 1, 2), 2, {2: 2}, {0, 1, 2}, (0, 1), {0: 0, 1: 0, 2: 3}, (2,)),
    # a slot the file no longer lists is left out, not dropped
    ((0, 1, 2, 3), 3, {}, {0, 1, 2}, (0, 1, 2), {0: 0, 1: 0, 2: 0, 3: 1}, ()),
])
def test_next_group(ran, blamed, streaks, available, slots, new_streaks, dropped):
  assert elastic.next_group(4 if 3 in ran else 3, ran, blamed, streaks, available) == (
      slots, new_streaks, dropped)


def test_membership_shrinks_rewrites_the_slots_file_grows_back_and_stops(tmp_path):
  slots_file = tmp_path / "slots"
  members = elastic.Membership(3, 2, str(slots_file))
  assert members.slots == (0, 1, 2) and slots_file.read_text() == "0\n1\n2\n"  # written in full
  assert members.after_failure(2, "exited with code 1") == "worker slot 2 exited with code 1"
  line = members.after_failure(2, "exited with code 1")
  assert line == ("was 3; worker slot 2 failed first in 2 attempts in a row (exited with code 1)")
  assert members.slots == (0, 1) and slots_file.read_text() == "0\n1\n"
  slots_file.write_text("0, 1\n2  # host b is back\n")
  assert members.after_failure(0, "was frozen") == (
      "was 2; worker slot 2 is back; worker slot 0 was frozen")
  assert members.slots == (0, 1, 2)
  slots_file.write_text("0\nbad\n")  # a half-edited file keeps the last set, said in the line
  line = members.after_failure(1, "exited with code 203", blame=False)
  assert members.slots == (0, 1, 2) and "'bad' is not a worker slot" in line
  slots_file.write_text("0\n")
  with pytest.raises(TfdpError) as raised:
    members.after_failure(1, "exited with code 203", blame=False)
  assert str(raised.value) == (
      f"only 1 of 3 workers can start, fewer than --min_workers 2, so the group is not "
      f"restarted: worker slot 1 is not listed in --slots_file {slots_file}; worker slot 2 is "
      f"not listed in --slots_file {slots_file}.")


def test_too_few_slots_at_the_first_start_is_one_line_saying_not_started(tmp_path):
  """Once 'tfdp-launch: error: error: only 0 of 2 workers can start ..., so the group is not
  restarted', for a group that never started (a probe)."""
  (tmp_path / "slots").write_text("")
  proc = _launch("--num_workers=2", "--min_workers=1", f"--slots_file={tmp_path / 'slots'}",
                 "--", "true")
  assert proc.stderr.strip().splitlines() == [
      "tfdp-launch: error: only 0 of 2 workers can start, fewer than --min_workers 1, so the "
      f"group is not started: worker slot 0 is not listed in --slots_file {tmp_path / 'slots'}; "
      f"worker slot 1 is not listed in --slots_file {tmp_path / 'slots'}."], proc.stderr


# ---- the launcher, real processes --------------------------------------------------------------
def _launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, LAUNCH_APP, *args], capture_output=True, text=True,
                        timeout=timeout, env=helpers.env(), cwd=str(helpers.REPO))


def _alive(pid: int) -> bool:
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def _pids(folder) -> list[int]:
  return [int(path.read_text()) for path in folder.glob("pid-*")]


def _assert_all_gone(pids: list[int]) -> None:
  deadline = time.monotonic() + 5
  while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert pids and not any(_alive(pid) for pid in pids)


# Slot 2 crashes at start while `broken` exists. Whole groups wait to be stopped; in the shrunk
# group slot 0 plays the operator (host back: marker gone, slot listed again) and fails once.
FLAKY_WORKER = """
    import os, pathlib, sys, time
    out = pathlib.Path(sys.argv[1])
    slot, size = os.environ["TFDP_WORKER_SLOT"], os.environ["TFDP_NUM_WORKERS"]
    restart = os.environ["TFDP_RESTART_COUNT"]
    (out / f"pid-{restart}-{slot}").write_text(str(os.getpid()))
    while len(list(out.glob(f"pid-{restart}-*"))) < int(size):  # every pid written
      time.sleep(0.02)
    if slot == "2" and (out / "broken").exists():
      sys.exit(1)
    if size == "2" and slot == "0":
      (out / "broken").unlink()
      (out / "slots").write_text("0\\n1\\n2\\n")
      sys.exit(3)
    if restart == "3":
      print("done", slot, os.environ["TFDP_WORKER_INDEX"], size, os.environ["TFDP_MIN_WORKERS"],
            os.environ["TFDP_MAX_WORKERS"], flush=True)
      sys.exit(0)
    time.sleep(60)
"""


def test_group_shrinks_past_a_worker_that_fails_twice_and_grows_back(tmp_path):
  (tmp_path / "broken").write_text("x")
  proc = _launch("--num_workers=3", "--min_workers=2", "--max_restarts=3",
                 f"--slots_file={tmp_path / 'slots'}", "--stop_grace_seconds=5", "--",
                 sys.executable, "-c", textwrap.dedent(FLAKY_WORKER), str(tmp_path))
  assert proc.returncode == 0, proc.stderr
  restarts = [line for line in proc.stderr.splitlines() if " restart " in line]
  assert restarts == [
      "tfdp-launch: restart 1 of 3: 3 workers (worker slot 2 exited with code 1).",
      "tfdp-launch: restart 2 of 3: 2 workers (was 3; worker slot 2 failed first in 2 attempts "
      "in a row (exited with code 1)).",
      "tfdp-launch: restart 3 of 3: 3 workers (was 2; worker slot 2 is back; worker slot 0 "
      "exited with code 3)."], proc.stderr
  assert sorted(proc.stdout.splitlines()) == [
      "[w0] done 0 0 3 2 3", "[w1] done 1 1 3 2 3", "[w2] done 2 2 3 2 3"]
  assert len(_pids(tmp_path)) == 3 + 3 + 2 + 3
  _assert_all_gone(_pids(tmp_path))


def test_min_workers_equal_to_num_workers_stops_with_one_line_naming_the_worker(tmp_path):
  worker = """
      import os, pathlib, sys, time
      out, restart = pathlib.Path(sys.argv[1]), os.environ["TFDP_RESTART_COUNT"]
      (out / f"pid-{restart}-{os.environ['TFDP_WORKER_SLOT']}").write_text(str(os.getpid()))
      while len(list(out.glob(f"pid-{restart}-*"))) < 2:
        time.sleep(0.02)
      if os.environ["TFDP_WORKER_SLOT"] == "1":
        sys.exit(1)
      time.sleep(60)
  """
  proc = _launch("--num_workers=2", "--min_workers=2", "--max_restarts=3",
                 "--stop_grace_seconds=5", "--", sys.executable, "-c", textwrap.dedent(worker),
                 str(tmp_path))
  assert proc.returncode == 1, proc.stderr
  lines = [line for line in proc.stderr.splitlines()
           if line.startswith("tfdp-launch:") and " on ports " not in line]
  assert lines == [
      "tfdp-launch: restart 1 of 3: 2 workers (worker slot 1 exited with code 1).",
      "tfdp-launch: error: only 1 of 2 workers can start, fewer than --min_workers 2, so the "
      "group is not restarted: worker slot 1 failed first in 2 attempts in a row (exited with "
      "code 1)."], proc.stderr
  assert len(_pids(tmp_path)) == 4
  _assert_all_gone(_pids(tmp_path))


def test_a_worker_that_lost_its_peer_is_not_blamed(tmp_path):
  """Exit 203 says 'a peer was lost': twice in a row is no reason to drop that worker."""
  worker = """
      import os, sys
      if os.environ["TFDP_RESTART_COUNT"] != "2" and os.environ["TFDP_WORKER_SLOT"] == "1":
        sys.exit(203)
      print("size", os.environ["TFDP_NUM_WORKERS"], flush=True)
  """
  proc = _launch("--num_workers=2", "--min_workers=1", "--max_restarts=2",
                 "--stop_grace_seconds=5", "--", sys.executable, "-c", textwrap.dedent(worker))
  assert proc.returncode == 0, proc.stderr
  restarts = [line for line in proc.stderr.splitlines() if " restart " in line]
  assert restarts == [
      f"tfdp-launch: restart {n} of 2: 2 workers (worker slot 1 exited with code 203 (lost a "
      "peer: no strike))." for n in (1, 2)], proc.stderr
  assert proc.stdout.splitlines()[-2:] in (["[w0] size 2", "[w1] size 2"],
                                           ["[w1] size 2", "[w0] size 2"])


def test_a_real_failure_is_blamed_over_a_lost_peer_seen_with_it_or_just_before(tmp_path):
  """The probe's `kill -9` of slot 2: its peer's 203 (lost a peer) can reach the launcher in
  the same poll as the SIGKILL, or before it. Here slot 1 exits 203 first and slot 2 dies once
  slot 1 is gone; slot 2 is to blame, so it is dropped after two attempts (the old launcher
  blamed slot 1's 203: no strike, and the group never shrank)."""
  worker = """
      import os, pathlib, signal, sys, time
      import psutil
      out = pathlib.Path(sys.argv[1])
      slot, size = os.environ["TFDP_WORKER_SLOT"], os.environ["TFDP_NUM_WORKERS"]
      restart = os.environ["TFDP_RESTART_COUNT"]
      (out / f"pid-{restart}-{slot}").write_text(str(os.getpid()))
      if size == "2":
        print("done", slot, flush=True)
        sys.exit(0)
      while len(list(out.glob(f"pid-{restart}-*"))) < 3:
        time.sleep(0.01)
      if slot == "1":
        sys.exit(203)
      if slot == "2":
        while True:  # until slot 1 has exited (a zombie until the launcher reaps it)
          try:
            pid = int((out / f"pid-{restart}-1").read_text())
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
              break
          except psutil.NoSuchProcess:
            break
          except ValueError:
            pass  # the pid file is being written
          time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)
      time.sleep(60)
  """
  proc = _launch("--num_workers=3", "--min_workers=2", "--max_restarts=2",
                 "--stop_grace_seconds=5", "--", sys.executable, "-c", textwrap.dedent(worker),
                 str(tmp_path))
  restarts = [line for line in proc.stderr.splitlines() if " restart " in line]
  assert restarts == [
      "tfdp-launch: restart 1 of 2: 3 workers (worker slot 2 was killed by signal SIGKILL).",
      "tfdp-launch: restart 2 of 2: 2 workers (was 3; worker slot 2 failed first in 2 attempts "
      "in a row (was killed by signal SIGKILL))."], proc.stderr
  assert proc.returncode == 0, proc.stderr
  assert sorted(proc.stdout.splitlines()) == ["[w0] done 0", "[w1] done 1"]
  _assert_all_gone(_pids(tmp_path))


@pytest.mark.parametrize("args, words", [
    (["--num_workers=2", "--min_workers=3"], "--min_workers must be from 1 to --num_workers (2)"),
    (["--num_workers=2", "--slots_file=slots"], "--slots_file needs --min_workers"),
])
def test_bad_elastic_flags_are_one_line_exit_2(tmp_path, args, words):
  proc = _launch(*args, "--", "true")
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr
  assert lines[0].startswith("tfdp-launch: error: ") and words in lines[0]


# ---- real training: 3 workers, slot 2 crashes after the first checkpoint (step 8 of an epoch's
# 20), then at every start; the job finishes on 2 from that checkpoint (a global batch of 12
# splits over 3 and over 2). Three files, one per worker: `auto` once chose file shards here,
# which cannot resume on another count in the middle of an epoch, so the shrink was refused
# (exit 2) and the launcher stopped. --mode=train and no export: nothing here reads an
# evaluation or an exported model.
JOB = ("task.model.name=small_cnn,task.model.kwargs.filters=4,"
       "task.train_data.source=tfrecord,task.train_data.path={records},task.train_data.cache=false,"
       "task.train_data.num_classes=4,"
       "trainer.global_batch_size=12,trainer.epochs=2,trainer.steps_per_loop=4,"
       "trainer.checkpoint_every_steps=8,trainer.export_model=false,runtime.intra_op_threads=1,"
       "runtime.inter_op_threads=1")
# Slot 2, first attempt: trains until the chief saved a checkpoint, then dies (exit 1); later
# attempts: dies at start. Other slots exec tfdp-train.
CRASHING_SLOT = """
    import os, pathlib, subprocess, sys, time
    model_dir, args = pathlib.Path(sys.argv[1]), sys.argv[2:]
    if os.environ["TFDP_WORKER_SLOT"] != "2":
      os.execv(sys.executable, [sys.executable, *args])
    if os.environ["TFDP_RESTART_COUNT"] != "0":
      print("slot 2 cannot start", flush=True)
      sys.exit(1)
    train = subprocess.Popen([sys.executable, *args])
    while not (model_dir / "checkpoints" / "checkpoint").exists() and train.poll() is None:
      time.sleep(0.05)
    train.kill()
    print("slot 2 crashed after a checkpoint", flush=True)
    sys.exit(1)
"""


def test_training_shrinks_from_three_workers_to_two_and_finishes_exactly(tmp_path):
  model_dir = tmp_path / "run"
  records = helpers.write_tfrecords(tmp_path / "records", [80, 80, 80])
  proc = _launch("--num_workers=3", "--min_workers=2", "--max_restarts=3", "--",
                 sys.executable, "-c", textwrap.dedent(CRASHING_SLOT), str(model_dir),
                 helpers.TRAIN_APP, f"--model_dir={model_dir}", "--mode=train",
                 f"--params_override={JOB.format(records=records)}",
                 timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  restarts = [line for line in proc.stderr.splitlines() if " restart " in line]
  assert len(restarts) == 2, proc.stderr[-4000:]
  assert restarts[0].startswith("tfdp-launch: restart 1 of 3: 3 workers (worker slot 2 exited")
  assert restarts[1].startswith("tfdp-launch: restart 2 of 3: 2 workers (was 3; worker slot 2 "
                                "failed first in 2 attempts in a row (exited with code 1))")
  assert "all 2 workers finished after 2 restarts" in proc.stderr
  # the two survivors resumed the three-worker run from its checkpoint, not from scratch
  assert "[w1] cluster: worker 1 of 2 (TF_CONFIG)" in proc.stdout, proc.stdout[-4000:]
  assert "shard_policy auto → data, not file: the group may resize" in proc.stdout
  assert re.search(r"\[w0\] .*resumed from .*ckpt-\d+ at step [1-9]", proc.stdout)
  metrics = pd.read_csv(model_dir / "metrics.csv")
  assert metrics["epoch"].tolist() == [1, 2], metrics
  assert int(metrics["step"].iloc[-1]) == 2 * 240 // 12
  leftover = [p.pid for p in psutil.process_iter(["cmdline"])
              if str(model_dir) in " ".join(p.info["cmdline"] or []) and _alive(p.pid)]
  assert not leftover
