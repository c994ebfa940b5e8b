"""Operations: one run per model_dir, exit codes a scheduler can act on, what non-chief workers
keep in /tmp, and a full disk."""
from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import helpers
from test_multi_worker import wait_for  # pylint: disable=g-bad-import-order
from tfdp import cli
from tfdp import errors
from tfdp.core import locks
from tfdp.core import outputs
from tfdp.distributed import launch as launcher

# A synthetic epoch far longer than any test waits: runs are stopped, never finished.
LONG = ("task.model.name=small_cnn,task.model.kwargs.filters=8,"
        "task.train_data.source=synthetic,task.train_data.num_examples=64000,"
        "task.train_data.image_size=8,task.train_data.num_classes=2,"
        "trainer.global_batch_size=16,trainer.epochs=1,trainer.steps_per_loop=2,"
        "trainer.checkpoint_every_steps=4,runtime.cpu_replicas=2,"
        "runtime.intra_op_threads=1,runtime.inter_op_threads=1")


def start_train(model_dir: Path, *args: str, log: Path, **env) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, helpers.TRAIN_APP, f"--model_dir={model_dir}", *args],
                          stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True,
                          env=helpers.env(**env), cwd=str(helpers.REPO))


def stop(proc: subprocess.Popen) -> None:
  if proc.poll() is None:
    proc.kill()
  proc.wait(timeout=60)


# ---- item 8: one run per model_dir ---------------------------------------------------------------


def hold_lock_in_child(model_dir: Path, write: bool = True) -> subprocess.Popen:
  """Another process (no TensorFlow) that holds model_dir's run lock, as a live run does."""
  code = textwrap.dedent(f"""
      import fcntl, os, socket, sys, time
      fd = os.open({str(model_dir / locks.LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT, 0o644)
      fcntl.flock(fd, fcntl.LOCK_EX)
      if {write}:
        os.write(fd, f"pid={{os.getpid()}} host={{socket.gethostname()}} since=now\\n".encode())
      print("locked", flush=True)
      time.sleep(120)
  """)
  proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_a_model_dir_held_by_another_process_is_refused_before_anything_is_written(tmp_path):
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  (model_dir / "config.yaml").write_text("earlier: run\n")
  holder = hold_lock_in_child(model_dir)
  try:
    with pytest.raises(errors.OutputError) as refused:
      outputs.prepare_model_dir(str(model_dir))  # the preflight check: creates nothing
    line = str(refused.value)
    assert f"pid {holder.pid} on host {socket.gethostname()}" in line, line
    assert "another --model_dir" in line
    with pytest.raises(errors.OutputError, match=f"pid {holder.pid}"):
      outputs.create_model_dir(str(model_dir))  # the lock itself, for a start that raced past
    assert sorted(p.name for p in model_dir.iterdir()) == [locks.LOCK_FILE, "config.yaml"]
  finally:
    holder.kill()
    holder.wait()
  # The holder died: its lock went with it, and this process takes the folder at once.
  outputs.create_model_dir(str(model_dir))
  assert f"pid={holder.pid} " in (model_dir / locks.LOCK_FILE).read_text()  # not yet rewritten
  plan = outputs.write_plan(str(model_dir), is_chief=True, rank=0)
  outputs.write_config(plan, "this: run\n", resuming=False)  # every check passed: the holder is named
  text = (model_dir / locks.LOCK_FILE).read_text()
  assert f"pid={os.getpid()} host={socket.gethostname()}" in text
  outputs.create_model_dir(str(model_dir))  # again in this process (tfdp.fit twice): no refusal
  plan.cleanup()
  # This folder's lock (other in-process tests on this worker may still hold their own).
  assert str(model_dir) not in locks._HELD_LOCKS
  assert (model_dir / locks.LOCK_FILE).read_text() == ""


def test_a_lock_naming_a_dead_process_says_a_run_is_starting(tmp_path):
  """A holder that has not passed its checks yet has not written its pid; what the file holds
  then is a dead run's, and is not named as the holder."""
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True).stdout.strip()
  (model_dir / locks.LOCK_FILE).write_text(f"pid={dead} host={socket.gethostname()} since=x\n")
  holder = hold_lock_in_child(model_dir, write=False)
  try:
    with pytest.raises(errors.OutputError, match="a run that is starting") as refused:
      outputs.prepare_model_dir(str(model_dir))
    assert f"pid {dead}" not in str(refused.value)
  finally:
    holder.kill()
    holder.wait()


def test_a_file_system_without_locks_warns_and_trains(tmp_path, monkeypatch):
  def no_locks(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
  monkeypatch.setattr(locks.fcntl, "flock", no_locks)
  outputs.create_model_dir(str(tmp_path / "run"))  # no exception: a warning line
  assert str(tmp_path / "run") not in locks._HELD_LOCKS


def test_two_training_runs_in_one_model_dir_the_second_is_refused_and_a_crash_never_blocks(
    tmp_path):
  """Two real tfdp-train processes: the second is refused in one line naming the first's pid
  and host and writes nothing; after the first is SIGKILLed, a restart resumes."""
  model_dir = tmp_path / "run"
  first = start_train(model_dir, f"--params_override={LONG}", "--mode=train",
                      log=tmp_path / "first.log")
  try:
    assert wait_for(lambda: (model_dir / "checkpoints" / "checkpoint").exists(), 240, first), \
        (tmp_path / "first.log").read_text()[-3000:]
    config_before = (model_dir / "config.yaml").read_text()
    second = helpers.run_train(f"--model_dir={model_dir}", "--mode=train", "--start_over",
                               f"--params_override={LONG},trainer.max_steps=2", timeout=300)
    assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    lines = helpers.error_lines(second)
    assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
    assert lines[0].startswith("tfdp-train: error: "), lines[0]
    assert f"pid {first.pid} on host {socket.gethostname()}" in lines[0], lines[0]
    assert "Traceback" not in second.stderr
    # Nothing of the second: no other config, nothing moved aside by --start_over.
    assert (model_dir / "config.yaml").read_text() == config_before
    assert not list(model_dir.glob("config.*.yaml")) and not list(model_dir.glob("previous-*"))
  finally:
    stop(first)  # SIGKILL: no clean-up ran
  restart = start_train(model_dir, f"--params_override={LONG}", "--mode=train",
                        log=tmp_path / "restart.log")
  try:
    assert wait_for(lambda: "resumed from" in (tmp_path / "restart.log").read_text(), 240,
                    restart), (tmp_path / "restart.log").read_text()[-3000:]
  finally:
    stop(restart)


# ---- item 9: exit codes a scheduler acts on ------------------------------------------------------


def test_exit_codes_restart_a_lost_peer_and_stop_on_bad_input():
  """Kubeflow's restartPolicy ExitCode retries 128-255 and fails the job on 1-127
  (training-operator's IsRetryableExitCode: exitCode >= 128): a lost peer must be retryable,
  a bad config or input must not."""
  lost = errors.GroupMustRestart("lost a peer worker")
  assert isinstance(lost, errors.ClusterError)
  assert lost.exit_code == errors.EXIT_RESTART_GROUP >= 128
  assert errors.is_retryable_exit_code(lost.exit_code)
  assert errors.EXIT_RESTART_GROUP > 128 + max(signal.Signals)  # never read as a signal's
  assert errors.EXIT_RESTART_GROUP != 128 + signal.SIGTERM
  for error in (errors.ConfigError("x"), errors.DataError("x"), errors.OutputError("x"),
                errors.ClusterError("x"), errors.TrainingDiverged("x")):
    assert error.exit_code == errors.EXIT_PERMANENT == 2
    assert not errors.is_retryable_exit_code(error.exit_code)
  assert errors.is_retryable_exit_code(errors.Preempted(5, signal.SIGTERM).exit_code)  # 143
  by_peer = errors.Preempted(5, signal.SIGTERM, by_peer=True).exit_code  # 204: not the asked one
  assert errors.is_retryable_exit_code(by_peer) and by_peer > 128 + max(signal.Signals)
  assert len({by_peer, errors.EXIT_RESTART_GROUP, 128 + signal.SIGTERM}) == 3
  assert errors.is_retryable_exit_code(-9)  # killed by a signal, as Popen reports it


@pytest.mark.parametrize("kind, code", [("GroupMustRestart", 203), ("DataError", 2), (None, 2)])
def test_apps_exit_with_the_errors_own_code(monkeypatch, capsys, kind, code):
  error = getattr(errors, kind)("the message") if kind else "usage"
  monkeypatch.setattr(cli, "exit_now", lambda c: (_ for _ in ()).throw(SystemExit(c)))
  with pytest.raises(SystemExit) as exited:
    cli.exit_with_error("tfdp-train", error)
  assert exited.value.code == code
  assert capsys.readouterr().err.startswith("tfdp-train: error: ")


def test_the_error_line_is_one_write_the_signal_watcher_cannot_split(monkeypatch):
  """The watcher thread's 'SIGTERM (not training)' line (the launcher stopping a worker as it
  fails) landed between print's two writes, the message and its newline: one line of two errors
  (a probe). Seen failing on print (2 writes)."""
  writes = []

  class Recording:
    def write(self, text):
      writes.append(text)

    def flush(self):
      pass

  monkeypatch.setattr(sys, "stderr", Recording())
  monkeypatch.setattr(cli, "exit_now", lambda c: (_ for _ in ()).throw(SystemExit(c)))
  with pytest.raises(SystemExit):
    cli.exit_with_error("tfdp-train", errors.DataError("the message"))
  assert writes == ["tfdp-train: error: the message\n"]


def test_the_peer_loss_errors_raise_the_restart_error():
  """Where the code says "the group must restart", it raises the retryable error."""
  for module in ("tfdp/core/run_errors.py", "tfdp/distributed/compat.py"):
    text = (helpers.REPO / module).read_text()
    for match in re.finditer(r"(?:raise|return) (\w+)\(\s*f\"(lost a peer|the start-up check "
                             r"between)", text):
      assert match.group(1) == "GroupMustRestart", (module, match.group(0))
    assert "GroupMustRestart(" in text, module


@pytest.mark.parametrize("killed_while, timeouts", [
    ("training", "runtime.heartbeat_timeout_seconds=10,runtime.collective_timeout_seconds=20"),
    ("building", "runtime.heartbeat_timeout_seconds=5,runtime.collective_timeout_seconds=10"),
])
def test_a_worker_that_lost_its_peer_exits_with_the_retryable_code(tmp_path, killed_while,
                                                                   timeouts):
  """Two tfdp-train workers started as a scheduler starts them (TF_CONFIG, no launcher): after
  worker 1 is SIGKILLed, worker 0 says the group must restart and exits 203, which Kubeflow
  retries (it exited 2 before, which fails the job for good). `building`: killed right after its
  strategy was made (its `cluster:` line), while the group built and broadcast its model (a
  cluster probe): worker 0 gave a raw traceback and exit 1, since only training converted a lost
  peer; seen failing so on the old experiment.py."""
  ports = launcher.pick_free_ports(2)
  configs = launcher.worker_tf_configs(2, "127.0.0.1", ports)
  model_dir = tmp_path / "run"
  logs = [tmp_path / f"w{i}.log" for i in range(2)]
  workers = [start_train(model_dir, f"--params_override={LONG},{timeouts}", "--mode=train",
                         log=logs[i], TF_CONFIG=configs[i]) for i in range(2)]
  ready, watched = {
      "training": (lambda: (model_dir / "checkpoints" / "checkpoint").exists(), 0),
      "building": (lambda: "cluster: worker 1" in logs[1].read_text(), 1)}[killed_while]
  try:
    assert wait_for(ready, 240, workers[watched]), logs[watched].read_text()[-3000:]
    workers[1].kill()
    assert workers[0].wait(timeout=180) == errors.EXIT_RESTART_GROUP, logs[0].read_text()[-3000:]
  finally:
    for worker in workers:
      stop(worker)
  text = logs[0].read_text()
  lines = [l for l in text.splitlines() if l.startswith("tfdp-")]
  assert len(lines) == 1 and "lost a peer worker" in lines[0], text[-3000:]
  assert "Traceback" not in text, text[-3000:]


def python_worker(code: str) -> list[str]:
  return [sys.executable, "-c", textwrap.dedent(code)]


def test_an_uncaught_tfdp_error_in_a_users_script_is_not_restarted_either(tmp_path, capfd):
  """A probe: a tfdp.fit script refused in one line (its workers' seeds) exits 1, as Python
  exits on an uncaught exception, and --max_restarts restarted it into the same error twice.
  A GroupMustRestart (its code 203 when tfdp-train says it) stays retryable. Seen failing:
  'restarting all 1 workers'."""
  starts = tmp_path / "starts"
  starts.mkdir()
  worker = python_worker(f"""
      import os, pathlib
      pathlib.Path({str(starts)!r}, str(os.getpid())).write_text("")
      from tfdp.errors import ConfigError
      raise ConfigError("tfdp.fit: workers were given other seeds; set one on every worker.")
  """)
  code = launcher.launch(worker, 1, max_restarts=2, stop_grace_seconds=5)
  err = capfd.readouterr().err
  assert code == 2 and len(list(starts.iterdir())) == 1, err
  lines = [l for l in err.splitlines() if l.startswith("tfdp-launch: error:")]
  assert lines == ["tfdp-launch: error: worker 0 raised a tfdp error (exit 1) (a bad config, "
                   "input or model_dir; a restart would fail the same way), so the group is not "
                   "restarted: tfdp.errors.ConfigError: tfdp.fit: workers were given other "
                   "seeds; set one on every worker."], err
  assert not errors.is_permanent_failure(1, ["tfdp.errors.GroupMustRestart: a peer was lost"])


def test_launcher_does_not_restart_a_worker_that_exits_with_the_permanent_code(tmp_path, capfd):
  starts = tmp_path / "starts"
  starts.mkdir()
  worker = python_worker(f"""
      import os, pathlib, sys, time
      index = os.environ["TFDP_WORKER_INDEX"]
      pathlib.Path({str(starts)!r}, f"{{index}}-{{os.getpid()}}").write_text("")
      if index == "1":
        # after worker 0 has started (under load it was stopped before it wrote its start)
        while not any(p.name.startswith("0-") for p in pathlib.Path({str(starts)!r}).iterdir()):
          time.sleep(0.02)
        print("tfdp-train: error: task.train_data.path 'x' holds a corrupt image", flush=True)
        sys.exit(2)
      time.sleep(60)
  """)
  code = launcher.launch(worker, 2, max_restarts=3, stop_grace_seconds=5)
  err = capfd.readouterr().err
  assert code == 2, err
  assert len(list(starts.iterdir())) == 2  # one start of each worker: no restart
  assert "restarting" not in err
  lines = [l for l in err.splitlines() if l.startswith("tfdp-launch: error:")]
  assert len(lines) == 1, err
  assert lines[0].startswith("tfdp-launch: error: worker 1 exited with code 2"), lines[0]
  assert "corrupt image" in lines[0]


def test_tfdp_launch_stops_at_once_when_tfdp_train_refuses_its_config(tmp_path):
  """A real tfdp-train worker with a bad config, under --max_restarts 3: started once, and
  tfdp-launch exits 2 with one line naming the worker's error."""
  proc = subprocess.run(
      [sys.executable, str(helpers.REPO / "apps" / "launch.py"), "--num_workers=1",
       "--max_restarts=3", "--", sys.executable, helpers.TRAIN_APP, f"--model_dir={tmp_path / 'run'}",
       "--params_override=trainer.epochs=-1"],
      capture_output=True, text=True, timeout=300, env=helpers.env(), cwd=str(helpers.REPO))
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stdout.count("[w0] tfdp-train: error: ") == 1, proc.stdout[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.startswith("tfdp-launch: error:")]
  assert len(lines) == 1 and lines[0].startswith("tfdp-launch: error: worker 0 exited with code 2")
  assert "trainer.epochs" in lines[0], lines[0]
  assert not (tmp_path / "run").exists()


def test_launcher_restarts_a_group_whose_worker_lost_a_peer(tmp_path, capfd):
  marker = tmp_path / "restarted"
  worker = python_worker(f"""
      import os, pathlib, sys
      if not pathlib.Path({str(marker)!r}).exists():
        if os.environ["TFDP_WORKER_INDEX"] == "0":
          pathlib.Path({str(marker)!r}).write_text("")
          sys.exit({errors.EXIT_RESTART_GROUP})
        import time; time.sleep(60)
      print("resumed")
  """)
  code = launcher.launch(worker, 2, max_restarts=1, stop_grace_seconds=5)
  err = capfd.readouterr().err
  assert code == 0, err
  assert f"worker 0 exited with code {errors.EXIT_RESTART_GROUP}; restarting" in err


# ---- item 14: a non-chief keeps one checkpoint copy, and never another group's temp dir --------


def hold_dir_lock(path: Path) -> subprocess.Popen:
  code = textwrap.dedent(f"""
      import fcntl, os, time
      fd = os.open({str(path / locks.LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT, 0o600)
      fcntl.flock(fd, fcntl.LOCK_EX)
      print("locked", flush=True)
      time.sleep(120)
  """)
  proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_stale_temp_dirs_are_judged_by_their_lock_not_their_pid(tmp_path, monkeypatch):
  """A live worker in another pid namespace (its pid unknown here) keeps its dir; a dead
  worker's dir whose pid was reused by an unrelated process goes."""
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  monkeypatch.setattr(outputs.tempfile, "tempdir", None)
  other_namespace = tmp_path / "tfdp-worker1-pid999999999-a"  # pid not visible from here
  other_namespace.mkdir()
  (other_namespace / "checkpoints").mkdir()
  reused = tmp_path / "tfdp-worker1-pid1-b"  # pid 1 is alive, but it is not that worker
  reused.mkdir()
  (reused / locks.LOCK_FILE).write_text("")
  holder = hold_dir_lock(other_namespace)
  try:
    plan = outputs.write_plan(str(tmp_path / "model"), is_chief=False, rank=1)
    assert other_namespace.is_dir() and (other_namespace / "checkpoints").is_dir()
    assert not reused.exists()
    # This worker's own dir is locked from the moment it has its name.
    with open(Path(plan.write_dir) / locks.LOCK_FILE) as f:
      with pytest.raises(BlockingIOError):
        fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
    plan.cleanup()
  finally:
    holder.kill()
    holder.wait()
  locks.remove_stale_worker_dirs()  # its holder is gone now
  assert not other_namespace.exists()


def test_a_worker_dir_left_half_made_by_a_kill_is_swept(tmp_path, monkeypatch):
  """make_worker_dir makes `.making-<name>`, locks it, then renames it: a worker killed in
  between left it in /tmp for good (six seen in one day)."""
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  monkeypatch.setattr(outputs.tempfile, "tempdir", None)
  old, old_with_lock, fresh_with_lock = (
      tmp_path / f"{locks.MAKING}tfdp-worker1-pid{pid}-{tag}" for pid, tag in
      ((999999998, "a"), (999999997, "b"), (999999996, "c")))
  for folder in (old, old_with_lock, fresh_with_lock):
    folder.mkdir()
  for folder in (old_with_lock, fresh_with_lock):  # killed after making its lock file
    (folder / locks.LOCK_FILE).write_text("")
  for folder in (old, old_with_lock):
    os.utime(folder, (time.time() - 3600,) * 2)
  locks.remove_stale_worker_dirs()
  # A fresh one may be a live worker's between making its lock file and locking it: kept.
  assert not old.exists() and not old_with_lock.exists() and fresh_with_lock.is_dir()


SAVES = ("task.model.name=small_cnn,task.model.kwargs.filters=8,"
         "task.train_data.source=synthetic,task.train_data.num_examples=512,"
         "task.train_data.image_size=8,task.train_data.num_classes=2,"
         "trainer.global_batch_size=16,trainer.epochs=1,trainer.steps_per_loop=2,"
         "trainer.checkpoint_every_steps=4,trainer.max_checkpoints=3,trainer.export_model=false,"
         "runtime.intra_op_threads=1,runtime.inter_op_threads=1")


COUNTING_WORKER = """
import glob, os, runpy, sys
sys.path.insert(0, {repo!r})
from tfdp.core import outputs
discard = outputs.WritePlan.discard_worker_checkpoints

def held(plan):
  return len(glob.glob(os.path.join(plan.checkpoint_dir, "ckpt-*.index")))

def counting(plan):  # what the temp dir holds right after each save, and once its copy went
  before = held(plan)
  discard(plan)
  if not plan.is_chief:
    with open({record!r}, "a") as record:
      record.write(f"{{before}}:{{held(plan)}}\\n")

outputs.WritePlan.discard_worker_checkpoints = counting
sys.argv[0] = {train_app!r}
runpy.run_path({train_app!r}, run_name="__main__")
"""


def test_a_non_chief_worker_keeps_at_most_one_checkpoint_in_its_temp_dir(tmp_path):
  """2 workers, 8 saves: after each save the non-chief's temp area holds one checkpoint (it
  held max_checkpoints = 3), then none once its copy went; nothing is left at exit. The worker
  counts at each save: polling the folder from outside missed a copy that lives only until its
  save returns (on the Zen 5, and once on the AVX2-only CPU in CI)."""
  model_dir, tmp, record = tmp_path / "run", tmp_path / "tmp", tmp_path / "counts"
  tmp.mkdir()
  worker = tmp_path / "counting_worker.py"
  worker.write_text(COUNTING_WORKER.format(repo=str(helpers.REPO), record=str(record),
                                           train_app=helpers.TRAIN_APP))
  launch_app = str(helpers.REPO / "apps" / "launch.py")
  result = subprocess.run(
      [sys.executable, launch_app, "--num_workers=2", "--", sys.executable, str(worker),
       f"--model_dir={model_dir}", "--mode=train", f"--params_override={SAVES}"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
      env=helpers.env(TMPDIR=tmp), cwd=str(helpers.REPO))
  out = result.stdout
  assert result.returncode == 0, out[-3000:]
  assert len(list((model_dir / "checkpoints").glob("ckpt-*.index"))) == 3  # the chief keeps 3
  assert re.search(r"\[w1\].*worker 1 of 2", out), out[-3000:]
  counts = record.read_text().split()
  assert counts == ["1:0"] * 8, (counts, out[-3000:])  # 512 examples / 16 per step / 4 per save
  assert not list(tmp.glob("tfdp-worker*")) and not list(tmp.glob(".making-*"))


# ---- item 15: a full disk ----------------------------------------------------------------------


def no_space(*args, **kwargs):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_writing_metrics_is_one_line_naming_the_file_and_keeps_it(
    tmp_path, monkeypatch):
  plan = outputs.write_plan(str(tmp_path), is_chief=True, rank=0)
  outputs.append_metrics(plan, {"epoch": 1, "step": 10, "loss": 2.0})
  before = (tmp_path / "metrics.csv").read_bytes()
  monkeypatch.setattr(outputs.os, "fsync", no_space)  # the write reaches the disk: no room
  with pytest.raises(errors.OutputError) as full:
    outputs.append_metrics(plan, {"epoch": 2, "step": 20, "loss": 1.0})
  line = str(full.value)
  assert f"'{tmp_path / 'metrics.csv'}'" in line and "No space left on device" in line, line
  assert "free space" in line
  assert (tmp_path / "metrics.csv").read_bytes() == before
  assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == []


def test_a_full_disk_during_the_export_keeps_the_earlier_model(tmp_path):
  plan = outputs.write_plan(str(tmp_path), is_chief=True, rank=0)
  (tmp_path / outputs.EXPORT_FILE).write_bytes(b"earlier model")

  class Model:
    def save(self, path):
      with open(path, "wb") as f:
        f.write(b"half")
      no_space()

  with pytest.raises(errors.OutputError) as full:
    outputs.export_model(plan, Model())
  assert f"'{tmp_path / outputs.EXPORT_FILE}'" in str(full.value)
  assert (tmp_path / outputs.EXPORT_FILE).read_bytes() == b"earlier model"
  assert [p.name for p in tmp_path.iterdir()] == [outputs.EXPORT_FILE]


def can_mount_tmpfs() -> bool:
  if not shutil.which("unshare"):
    return False
  probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                         capture_output=True, timeout=30)
  return probe.returncode == 0


FULL_DISK_SCRIPT = """
set -u
mount -t tmpfs -o size=40m tmpfs "$MNT"
"$PY" "$TRAIN" --model_dir="$MNT/run" --mode=train --params_override="$PARAMS" > "$OUT/train.log" 2>&1 &
pid=$!
i=0
until [ -f "$MNT/run/checkpoints/checkpoint" ]; do
  i=$((i+1)); [ $i -gt 2400 ] && break; sleep 0.1
done
sleep 1
dd if=/dev/zero of="$MNT/filler" bs=64k 2>/dev/null
wait $pid
echo $? > "$OUT/rc"
rm -f "$MNT/filler"
cp -r "$MNT/run/checkpoints" "$OUT/checkpoints"
"""


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs unshare and a tmpfs in a user namespace")
def test_a_full_disk_during_a_checkpoint_save_is_one_line_and_the_last_good_one_is_intact(tmp_path):
  """A real full file system (a small tmpfs, filled once the run has saved): the next save
  fails with one line naming the checkpoint folder, and the state file still names a whole
  checkpoint, which restores."""
  mnt, out = tmp_path / "mnt", tmp_path / "out"
  mnt.mkdir()
  out.mkdir()
  env = helpers.env(MNT=mnt, OUT=out, PY=sys.executable, TRAIN=helpers.TRAIN_APP, PARAMS=LONG)
  proc = subprocess.run(["unshare", "-rm", "sh", "-c", FULL_DISK_SCRIPT], env=env,
                        capture_output=True, text=True, timeout=600, cwd=str(helpers.REPO))
  log = (out / "train.log").read_text()
  assert (out / "rc").read_text().strip() == "2", log[-3000:] + proc.stderr[-2000:]
  lines = [l for l in log.splitlines() if l.startswith("tfdp-")]
  assert len(lines) == 1 and "Traceback" not in log, log[-3000:]
  assert lines[0].startswith("tfdp-train: error: cannot write"), lines[0]
  # Whichever write meets the full disk first: the next checkpoint, or the TensorBoard events.
  assert (f"'{mnt}/run/checkpoints'" in lines[0] or f"'{mnt}/run/train'" in lines[0]), lines[0]
  assert "No space left on device" in lines[0], lines[0]
  saved = re.search(r"last good checkpoint \(step (\d+)\) is intact", lines[0])
  assert saved, lines[0]
  state = (out / "checkpoints" / "checkpoint").read_text()
  assert f'model_checkpoint_path: "ckpt-{saved.group(1)}"' in state, state
  assert not list((out / "checkpoints").glob("*_temp*"))  # the failed save's partial files went
  check = subprocess.run(
      [sys.executable, "-c", "import sys, numpy as np, tensorflow as tf\n"
       "r = tf.train.load_checkpoint(sys.argv[1])\n"
       "print(sum(np.size(r.get_tensor(n)) for n, _ in tf.train.list_variables(sys.argv[1])))",
       str(out / "checkpoints" / f"ckpt-{saved.group(1)}")],
      capture_output=True, text=True, env=helpers.env(), timeout=120)
  assert check.returncode == 0 and int(check.stdout.split()[-1]) > 0, check.stderr[-2000:]
