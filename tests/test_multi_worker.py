"""MultiWorkerMirroredStrategy with real worker processes on loopback, through tfdp-launch."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import psutil
import pytest

import helpers

# Every test of this module on one xdist worker: a module-scoped fixture here trains in real
# processes, and would train again on each worker that ran one of the tests using it.
pytestmark = pytest.mark.xdist_group("test_multi_worker")

LAUNCH_APP = str(helpers.REPO / "apps" / "launch.py")


# One config for both topologies: `auto` is mirrored over 2 logical CPUs in one process, and
# multi_worker_mirrored (cpu_replicas ignored) under the launcher's TF_CONFIG.
EQUIVALENCE = ",".join([
    "task.model.name=small_cnn", "task.model.kwargs={batch_norm: false, filters: 8}",
    "task.train_data.source=synthetic", "task.train_data.num_examples=650",
    "task.train_data.image_size=8", "task.train_data.num_classes=4", "task.train_data.augment=true",
    "task.train_data.shard_policy=data",
    "trainer.global_batch_size=32", "trainer.epochs=1", "trainer.steps_per_loop=7",
    "trainer.export_model=false", "trainer.learning_rate.base_lr=0.05",
    "trainer.learning_rate.base_batch_size=32", "runtime.cpu_replicas=2",
])

# 3 epochs x 50 steps, a checkpoint every 20 steps: long enough to kill a worker mid-epoch
# (the tests act within 0.1 s of a checkpoint; 100 steps took 1.3-2.6 s here, loaded).
STEPS, INTERVAL = 150, 20
FAULT = ",".join([
    "task.model.name=small_cnn", "task.model.kwargs={filters: 16}",
    "task.train_data.source=synthetic", "task.train_data.num_examples=3200",
    "task.train_data.image_size=16", "task.train_data.num_classes=10",
    "task.eval_data.source=synthetic", "task.eval_data.num_examples=500",
    "task.eval_data.image_size=16", "task.eval_data.num_classes=10",
    "trainer.global_batch_size=64", "trainer.epochs=3", "trainer.steps_per_loop=5",
    f"trainer.checkpoint_every_steps={INTERVAL}", "runtime.intra_op_threads=1",
    "runtime.inter_op_threads=1", "runtime.collective_timeout_seconds=30",
])


def launch(args, worker_cmd, **extra_env):
  return subprocess.Popen([sys.executable, LAUNCH_APP, *args, "--", *worker_cmd],
                          env=helpers.env(**extra_env), cwd=str(helpers.REPO),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def train_cmd(model_dir, overrides=FAULT):
  return [sys.executable, helpers.TRAIN_APP, f"--model_dir={model_dir}",
          f"--params_override={overrides}"]


def latest_checkpoint_step(model_dir):
  steps = [int(m.group(1)) for p in (model_dir / "checkpoints").glob("ckpt-*.index")
           if (m := re.match(r"ckpt-(\d+)\.index", p.name))]
  return max(steps, default=0)


def wait_for(predicate, timeout, proc=None):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    if proc is not None and proc.poll() is not None:
      return predicate()
    time.sleep(0.05)
  return False


def workers_of(launcher):
  return {int(p.environ().get("TFDP_WORKER_INDEX", -1)): p
          for p in psutil.Process(launcher.pid).children() if p.is_running()}


def probe_in_one_process(tmp_path, overrides):
  """The probe in one process with 2 logical replicas."""
  (tmp_path / "one").mkdir()
  single = subprocess.run([sys.executable, helpers.PROBE, str(tmp_path / "run_one"), overrides,
                           str(tmp_path / "one"), "train"], env=helpers.env(), capture_output=True,
                          text=True, timeout=300)
  assert single.returncode == 0, single.stderr[-3000:]
  return helpers.load_probe(tmp_path / "one")


# With Keras's weight average (trainer.ema_decay), which only reads the weights: the same
# trajectory as EQUIVALENCE, so one reference run and one 2-worker run serve the equivalence and
# the weight-average tests (one launch and one process fewer).
WITH_EMA = f"{EQUIVALENCE},trainer.ema_decay=0.8"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  """WITH_EMA in one process: the uninterrupted run four tests compare against (run once)."""
  return probe_in_one_process(tmp_path_factory.mktemp("one_process"), WITH_EMA)


def probe_two_workers(tmp_path, worker_overrides):
  """The probe on 2 worker processes (with `worker_overrides`): (worker 0, worker 1, the
  launcher's output)."""
  for name in ("mw", "tmp"):
    (tmp_path / name).mkdir()
  proc = launch(["--num_workers=2"], [sys.executable, helpers.PROBE, str(tmp_path / "run_mw"),
                                      worker_overrides, str(tmp_path / "mw"), "train"],
                TMPDIR=tmp_path / "tmp")
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  return helpers.load_probe(tmp_path / "mw", 0), helpers.load_probe(tmp_path / "mw", 1), out


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
  """WITH_EMA on 2 worker processes: (tmp_path, worker 0, worker 1, the launcher's output)."""
  tmp_path = tmp_path_factory.mktemp("two_workers")
  return (tmp_path, *probe_two_workers(tmp_path, WITH_EMA))


def test_two_workers_agree_bitwise_and_match_one_host_with_two_replicas(two_workers, one_process):
  tmp_path, w0, w1, out = two_workers
  one = one_process
  assert helpers.max_relative_difference(one["final"], one["initial"]) > 0.1  # they trained
  assert all(np.array_equal(w0["final"][k], w1["final"][k]) for k in w0["final"])
  assert helpers.max_relative_difference(w0["final"], one["final"]) <= 1e-5
  assert w0["info"]["step"] == w1["info"]["step"] == one["info"]["step"] == 21
  # Only the chief wrote model_dir; the other worker saved its checkpoint in its own temp dir,
  # which it removed (TMPDIR is this test's, so a leftover would show here).
  assert (tmp_path / "run_mw" / "config.yaml").exists()
  assert "worker 1 of 2 (TF_CONFIG), chief=False" in out
  assert not [p for p in (tmp_path / "tmp").iterdir() if p.name.startswith("tfdp-worker")]


def test_bfloat16_all_reduce_over_the_ring_between_worker_processes(tmp_path, one_process):
  """The collective ring carries bfloat16 gradients between real worker processes: the workers
  agree bitwise and stay close to (but not on) the float32 trajectory of one process."""
  w0, w1, _ = probe_two_workers(tmp_path, f"{EQUIVALENCE},runtime.all_reduce_dtype=bfloat16")
  exact = one_process
  assert all(np.array_equal(w0["final"][k], w1["final"][k]) for k in w0["final"])
  assert 1e-6 < helpers.max_relative_difference(w0["final"], exact["final"]) < 0.05


def test_gradients_packed_in_backward_order_give_the_same_training(tmp_path, one_process):
  """runtime.all_reduce_order=backward with small packs: the ring reduces the last layer's
  gradients first, in several packs, and every gradient still reaches its own variable."""
  w0, w1, _ = probe_two_workers(
      tmp_path, f"{EQUIVALENCE},runtime.all_reduce_order=backward,runtime.bytes_per_pack=1024")
  one = one_process
  assert all(np.array_equal(w0["final"][k], w1["final"][k]) for k in w0["final"])
  assert helpers.max_relative_difference(w0["final"], one["final"]) <= 1e-5


def test_the_weight_average_is_the_same_on_every_worker_and_in_one_process(two_workers,
                                                                         one_process):
  """trainer.ema_decay (Keras's optimizer EMA, updated in replica context) under
  MultiWorkerMirroredStrategy: both workers keep the same average, equal to the one a single
  process with 2 replicas keeps, and it is not the weights themselves."""
  _, w0, w1, _ = two_workers
  one = one_process
  assert w0["ema"] is not None and sorted(w0["ema"]) == sorted(one["ema"])
  assert all(np.array_equal(w0["ema"][k], w1["ema"][k]) for k in w0["ema"])
  assert helpers.max_relative_difference(w0["ema"], one["ema"]) <= 1e-5
  trained = {k: w0["final"][k] for k in w0["ema"]}
  assert helpers.max_relative_difference(w0["ema"], trained) > 1e-3


def test_workers_started_with_different_configs_refuse_before_training(tmp_path):
  # Worker 1 reads another global batch: the start-up exchange finds it before any collective.
  script = ("import os, subprocess, sys; batch = 64 if os.environ['TFDP_WORKER_INDEX'] == '1' "
            "else 32; sys.exit(subprocess.call(sys.argv[1:] + ["
            "f'--params_override=trainer.global_batch_size={batch}']))")
  proc = launch(["--num_workers=2"], [sys.executable, "-c", script,
                                      *train_cmd(tmp_path / "run", EQUIVALENCE)])
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode != 0
  errors = [l for l in out.splitlines() if "tfdp-train: error: workers disagree" in l]
  # The key, not two hashes (was "worker 1 has config='27e2fbd379562842' but worker 0 has ...").
  assert errors and errors[0].endswith(
      "workers disagree before training on their config: worker 1 has "
      "trainer.global_batch_size=64 (worker 0: 32); start every worker with the same config "
      "files, overrides and --model_dir."), out[-3000:]
  assert "Traceback" not in out
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_sigkill_mid_epoch_restarts_and_finishes_the_planned_steps(tmp_path):
  model_dir = tmp_path / "run"
  proc = launch(["--num_workers=2", "--max_restarts=2", "--stop_grace_seconds=10"],
                train_cmd(model_dir))
  assert wait_for(lambda: latest_checkpoint_step(model_dir) >= 2 * INTERVAL, 240, proc), \
      proc.communicate()[0][-3000:]
  checkpoint_at_kill = latest_checkpoint_step(model_dir)
  workers_of(proc)[1].send_signal(signal.SIGKILL)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert "restart" in out.lower()
  resumed = [int(s) for s in re.findall(r"\[w0\].*resumed from .* at step (\d+)", out)]
  assert resumed and resumed[0] >= checkpoint_at_kill  # at most one interval of work redone
  assert checkpoint_at_kill < STEPS
  assert latest_checkpoint_step(model_dir) == STEPS
  metrics = pd.read_csv(model_dir / "metrics.csv")
  assert metrics["epoch"].tolist() == [1, 2, 3] and metrics["step"].iloc[-1] == STEPS
  assert metrics["eval_examples"].tolist() == [500, 500, 500]
  # The chief's directory is consistent: it loads and evaluates at the final step.
  check = helpers.run_train(f"--model_dir={model_dir}", "--mode=eval", f"--params_override={FAULT}")
  assert check.returncode == 0, check.stderr[-3000:]
  assert f'"step": {STEPS}' in (model_dir / "eval.json").read_text()


def test_without_restarts_a_dead_worker_stops_the_group_quickly_and_leaves_no_process(tmp_path):
  model_dir = tmp_path / "run"
  proc = launch(["--num_workers=2", "--stop_grace_seconds=10"], train_cmd(model_dir))
  assert wait_for(lambda: latest_checkpoint_step(model_dir) >= INTERVAL, 240, proc)
  pids = [p.pid for p in workers_of(proc).values()]
  assert len(pids) == 2
  killed_at = time.monotonic()
  os.kill(pids[1], signal.SIGKILL)
  out, _ = proc.communicate(timeout=120)
  seconds = time.monotonic() - killed_at
  assert proc.returncode == 128 + signal.SIGKILL, out[-2000:]  # the killed worker's: retryable
  assert seconds < 60, seconds
  assert "worker 1" in out and "SIGKILL" in out, out[-2000:]
  assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                 for pid in pids)


def test_sigterm_to_one_worker_stops_every_worker_at_the_same_step_and_one_resumes(tmp_path):
  model_dir = tmp_path / "run"
  proc = launch(["--num_workers=2", "--stop_grace_seconds=30"], train_cmd(model_dir))
  assert wait_for(lambda: latest_checkpoint_step(model_dir) >= INTERVAL, 240, proc)
  time.sleep(0.5)
  workers_of(proc)[1].send_signal(signal.SIGTERM)  # only worker 1 is asked to stop
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode != 0
  saved = {int(w): int(s) for w, s in re.findall(r"\[w(\d)\].*saved checkpoint at step (\d+)", out)}
  # Worker 0 heard of it only through the stop flag in the loop's all-reduce, and both
  # stopped and saved at the same loop boundary.
  assert sorted(saved) == [0, 1] and saved[0] == saved[1], out[-3000:]
  assert re.search(r"\[w1\].*stop requested \(SIGTERM\)", out), out[-3000:]
  # and each one's last line says what stopped it (worker 0's said 'on request (signal 15)')
  assert re.search(r"\[w0\].*stopped at step \d+ on a peer's SIGTERM", out), out[-3000:]
  assert re.search(r"\[w1\].*stopped at step \d+ on SIGTERM", out), out[-3000:]
  # The launcher blames the worker that was asked (143), not the one its stop flag stopped
  # (204): both exited 143 in one poll, and worker 0 was blamed (a probe; --min_workers then
  # dropped the healthy slot).
  assert "worker 1 exited with code 143" in out and "worker 0 exited" not in out, out[-3000:]
  assert latest_checkpoint_step(model_dir) == saved[0] < STEPS
  # Resumed on one worker of one replica (the elastic rules: accumulation 2 keeps the batch).
  rerun = launch(["--num_workers=1"], train_cmd(model_dir, FAULT + ",runtime.cpu_replicas=1"))
  out2, _ = rerun.communicate(timeout=600)
  assert rerun.returncode == 0, out2[-3000:]
  assert (f"resumed at step {saved[0]} on 1 worker (was 2): accumulation 1 → 2, per-replica "
          "batch 32, global batch 64 kept") in out2, out2[-3000:]
  assert latest_checkpoint_step(model_dir) == STEPS


def _can_unshare_mounts() -> bool:
  return shutil.which("unshare") is not None and subprocess.run(
      ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode == 0


def worker_1_sees(view, over):
  """A worker command prefix: worker 1 runs in a mount namespace of its own where `view` is
  mounted over `over` (a folder that holds other files on another host); worker 0 as is."""
  script = ("import os, sys\n"
            "view, over, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]\n"
            "if os.environ['TFDP_WORKER_INDEX'] == '1':\n"
            "  cmd = ['unshare', '--user', '--map-root-user', '--mount', 'sh', '-c',\n"
            "         'mount --bind \"$1\" \"$2\" && shift 2 && exec \"$@\"', 'sh', view, over, *cmd]\n"
            "os.execvp(cmd[0], cmd)\n")
  return [sys.executable, "-c", script, str(view), str(over)]


RESTORED = ",".join([
    "task.model.name=small_cnn", "task.model.kwargs={filters: 4}",
    "task.train_data.source=synthetic", "task.train_data.num_examples=64",
    "task.train_data.image_size=8", "task.train_data.num_classes=2",
    "trainer.global_batch_size=16", "trainer.epochs=1", "trainer.steps_per_loop=2",
    "trainer.export_model=false", "trainer.learning_rate.schedule=constant",
])


def disagree_line(out):
  return [l for l in out.splitlines() if "tfdp-train: error: workers disagree after restore" in l]


@pytest.mark.skipif(not _can_unshare_mounts(), reason="needs unprivileged user + mount namespaces")
def test_a_model_dir_not_shared_with_a_worker_is_refused_before_training(tmp_path):
  # Worker 1 does not see the chief's checkpoints (its host has its own model_dir): it restored
  # nothing and would train from step 0 with fresh weights while the chief resumes.
  model_dir = tmp_path / "run"
  first = launch(["--num_workers=2"], train_cmd(model_dir, RESTORED) + ["--mode=train"])
  out, _ = first.communicate(timeout=300)
  assert first.returncode == 0 and latest_checkpoint_step(model_dir) == 4, out[-3000:]
  (tmp_path / "elsewhere").mkdir()
  before = sorted(p.name for p in (model_dir / "checkpoints").iterdir())
  again = launch(["--num_workers=2"], worker_1_sees(tmp_path / "elsewhere", model_dir / "checkpoints")
                 + train_cmd(model_dir, RESTORED + ",trainer.epochs=2") + ["--mode=train"])
  out, _ = again.communicate(timeout=300)
  assert again.returncode != 0, out[-3000:]
  lines = disagree_line(out)
  assert lines and "worker 1 has restored_step=0 but worker 0 has 4" in lines[0], out[-3000:]
  assert "--model_dir" in lines[0] and "Traceback" not in out, out[-3000:]
  assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == before  # nothing trained


@pytest.mark.skipif(not _can_unshare_mounts(), reason="needs unprivileged user + mount namespaces")
def test_data_that_differs_on_a_worker_is_refused_before_training(tmp_path):
  # Worker 1's image folder lacks one image: under shard_policy data both plan the same steps,
  # and the group trained silently on shards of two different orders.
  helpers.write_image_folder(tmp_path / "images", per_class=8, size=8)
  helpers.write_image_folder(tmp_path / "other", per_class=8, size=8)
  (tmp_path / "other" / "dog" / "7.png").unlink()
  overrides = RESTORED.replace("task.train_data.source=synthetic,task.train_data.num_examples=64,",
                               f"task.train_data.source=image_folder,task.train_data.path="
                               f"{tmp_path / 'images'},task.train_data.shard_policy=data,")
  overrides = overrides.replace("task.train_data.image_size=8", "task.train_data.image_size=0")
  proc = launch(["--num_workers=2"], worker_1_sees(tmp_path / "other", tmp_path / "images")
                + train_cmd(tmp_path / "run", overrides) + ["--mode=train"])
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode != 0, out[-3000:]
  lines = disagree_line(out)
  assert lines and "worker 1 has train" in lines[0] and "same data" in lines[0], out[-3000:]
  assert "Traceback" not in out and not (tmp_path / "run" / "checkpoints").exists(), out[-3000:]


def test_the_config_check_names_the_keys_both_values_and_at_most_four():
  from tfdp.distributed import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  from tfdp.errors import ConfigError  # pylint: disable=g-import-not-at-top
  plan = strategy_lib.StrategyPlan("multi_worker_mirrored")
  first = {"trainer": {"epochs": 2, "tag": "a" * 100}, "task": {"a": 1, "b": 1, "c": 1}}
  other = {"trainer": {"epochs": 3, "tag": "a" * 99 + "b"}, "task": {"a": 2, "b": 2, "c": 2}}
  plans = [strategy_lib.worker_plan(plan, 1, strategy_lib.config_fields(json.dumps(c), d))
           for c, d in ((first, "/m"), (other, "/m"))]
  with pytest.raises(ConfigError) as raised:
    strategy_lib.check_workers_agree(plans)
  assert str(raised.value) == (
      "workers disagree before training on their config: worker 1 has task.a=2 (worker 0: 1), "
      "task.b=2 (worker 0: 1), task.c=2 (worker 0: 1), trainer.epochs=3 (worker 0: 2) and 1 more "
      "key; start every worker with the same config files, overrides and --model_dir.")
  from tfdp import errors  # pylint: disable=g-import-not-at-top
  from tfdp.compiled import fit as fit_lib  # pylint: disable=g-import-not-at-top
  with errors.speaking_as(fit_lib.terms()), pytest.raises(ConfigError) as raised:
    strategy_lib.check_workers_agree(plans)  # a probe: tfdp.fit users told of config files
  assert str(raised.value).endswith(
      "; give every worker the same data (x, y, validation_data), arguments and model_dir to "
      "tfdp.fit."), str(raised.value)
  del other["trainer"]["epochs"], other["task"]
  other["trainer"]["tag"] = first["trainer"]["tag"]
  plans[1] = strategy_lib.worker_plan(plan, 1, strategy_lib.config_fields(json.dumps(other), "/n"))
  with pytest.raises(ConfigError, match=r"worker 1 has --model_dir=/n \(worker 0: /m\), task.a="
                     r"\(unset\) \(worker 0: 1\), task.b=\(unset\)"):
    strategy_lib.check_workers_agree(plans)
