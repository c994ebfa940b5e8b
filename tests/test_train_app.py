"""`tfdp-train` end to end: real processes, real CIFAR-10 where present, uneven batches, resume."""
import json
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import helpers

SYNTHETIC = ",".join([
    "task.train_data.source=synthetic", "task.train_data.num_examples=1025",
    "task.train_data.image_size=16", "task.train_data.num_classes=10",
    "task.eval_data.source=synthetic", "task.eval_data.num_examples=1025",
    "task.eval_data.image_size=16", "task.eval_data.num_classes=10",
    "trainer.global_batch_size=128", "trainer.epochs=1", "trainer.steps_per_loop=3",
    "task.model.name=resnet8",  # BatchNorm + convolutions: what crashed on ragged final batches
])


@pytest.mark.parametrize("replicas", [2, 4])
def test_uneven_final_batch_trains_and_evaluates_every_example_once(tmp_path, replicas):
  # 1025 = 8 * 128 + 1: the final global batch holds one example, fewer than the replicas.
  proc = helpers.run_train(f"--model_dir={tmp_path}",
                           f"--params_override={SYNTHETIC},runtime.cpu_replicas={replicas}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  metrics = pd.read_csv(tmp_path / "metrics.csv")
  assert metrics["step"].tolist() == [9]
  assert metrics["eval_examples"].tolist() == [1025]
  assert metrics["train_loss"].notna().all()
  assert (metrics["peak_rss_mb"] >= metrics["rss_mb"]).all() and (metrics["rss_mb"] > 0).all()


@pytest.mark.skipif(not helpers.HAVE_CIFAR, reason=helpers.NO_CIFAR_REASON)
def test_cifar10_run_writes_outputs_and_a_second_run_resumes(tmp_path):
  args = [f"--model_dir={tmp_path}", "--config_file=configs/cifar10_quick.yaml",
          "--config_file=configs/runlocal.yaml"]
  # A constant schedule: more epochs is then a continuation (a cosine run's length is fixed).
  # 1000 test images: an evaluation of the full 10,000 cost more than the rest of the test.
  first = helpers.run_train(*args, "--params_override=task.eval_data.split=test[:1000],"
                            "trainer.eval_batch_size=96,runtime.cpu_replicas=2,"
                            "trainer.learning_rate.schedule=constant")
  assert first.returncode == 0, first.stderr[-3000:]
  assert f"outputs: {tmp_path} (metrics.csv, " in first.stderr
  for name in ("config.yaml", "metrics.csv", "model.keras", "checkpoints/checkpoint"):
    assert (tmp_path / name).exists(), name
  assert list((tmp_path / "train").glob("events.out.tfevents.*"))
  assert list((tmp_path / "eval").glob("events.out.tfevents.*"))
  assert "replicas=2" in first.stdout
  metrics = pd.read_csv(tmp_path / "metrics.csv")
  assert metrics["eval_examples"].tolist() == [1000]  # 1000 = 10 * 96 + 40: none lost or doubled
  assert metrics["step"].tolist() == [8]

  second = helpers.run_train(*args, "--params_override=trainer.epochs=2,runtime.cpu_replicas=2,"
                             "trainer.learning_rate.schedule=constant")
  assert second.returncode == 0, second.stderr[-3000:]
  assert "resumed from" in second.stderr and "at step 8" in second.stderr
  metrics2 = pd.read_csv(tmp_path / "metrics.csv")
  assert metrics2["step"].tolist() == [8, 16]
  assert metrics2["wall_time"].iloc[0] == metrics["wall_time"].iloc[0]  # epoch 1 was not redone
  assert list(tmp_path.glob("config.*.yaml")), "the first run's config is kept beside the new one"

  evaluation = helpers.run_train(*args, "--mode=eval", "--params_override=trainer.epochs=2,"
                                 "runtime.cpu_replicas=2")
  assert evaluation.returncode == 0, evaluation.stderr[-3000:]
  assert f"evaluating {tmp_path}/checkpoints/ckpt-16 at step 16" in evaluation.stderr
  assert "resumed from" not in evaluation.stderr  # an evaluation trains on from nothing
  result = json.loads((tmp_path / "eval.json").read_text())
  assert result["step"] == 16 and result["eval_examples"] == 512


def test_ctrl_c_saves_a_checkpoint_and_a_rerun_resumes(tmp_path):
  job = (SYNTHETIC.replace("num_examples=1025", "num_examples=6400", 1)
         + ",trainer.checkpoint_every_steps=10,runtime.cpu_replicas=2,task.model.name=small_cnn")
  args = [sys.executable, helpers.TRAIN_APP, f"--model_dir={tmp_path}", "--mode=train",
          f"--params_override={job}"]
  proc = subprocess.Popen(args, env=helpers.env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  deadline = time.monotonic() + 300
  while not (tmp_path / "checkpoints" / "checkpoint").exists() and time.monotonic() < deadline:
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 130, out[-3000:]
  assert "Traceback" not in out
  saved = int(re.search(r"saved checkpoint at step (\d+)", out).group(1))
  assert tf_latest_step(tmp_path) == saved
  again = helpers.run_train(*args[2:], timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"at step {saved}" in again.stderr
  assert tf_latest_step(tmp_path) == 50  # 6400 / 128


def tf_latest_step(model_dir):
  text = (model_dir / "checkpoints" / "checkpoint").read_text()
  return int(re.search(r'model_checkpoint_path: "ckpt-(\d+)"', text).group(1))


@pytest.mark.parametrize("options", ["runtime.mixed_precision=mixed_bfloat16",
                                     "runtime.strategy=default,runtime.cpu_replicas=0,"
                                     "runtime.jit_compile=true"])
def test_performance_options_train(tmp_path, options):
  tiny = SYNTHETIC.replace("num_examples=1025", "num_examples=256").replace("resnet8", "small_cnn")
  proc = helpers.run_train(f"--model_dir={tmp_path}", f"--params_override={tiny},{options}",
                           **helpers.UNCAPPED)
  assert proc.returncode == 0, proc.stderr[-3000:]
  metrics = pd.read_csv(tmp_path / "metrics.csv")
  assert metrics["eval_examples"].tolist() == [256]
  assert np.isfinite(metrics["train_loss"]).all()


RESUME = ",".join([
    "task.model.name=small_cnn", "task.model.kwargs={filters: 16}",
    "task.train_data.source=synthetic", "task.train_data.num_examples=1600",
    "task.train_data.image_size=16", "task.train_data.num_classes=10",
    "task.train_data.augment=true", "trainer.global_batch_size=64", "trainer.epochs=2",
    "trainer.steps_per_loop=5", "trainer.checkpoint_every_steps=10", "runtime.cpu_replicas=2",
    "runtime.intra_op_threads=1", "runtime.inter_op_threads=1",
])  # 2 epochs x 25 steps, BatchNorm, augmentation, shuffling, cosine schedule


def exported_weights(model_dir):
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.saving.load_model(str(model_dir / "model.keras"))
  return {v.path: np.asarray(v) for v in model.weights}


def test_a_run_killed_mid_epoch_and_resumed_equals_an_uninterrupted_run(tmp_path):
  straight = helpers.run_train(f"--model_dir={tmp_path / 'straight'}", "--mode=train",
                               f"--params_override={RESUME}")
  assert straight.returncode == 0, straight.stderr[-3000:]
  args = [sys.executable, helpers.TRAIN_APP, f"--model_dir={tmp_path / 'killed'}", "--mode=train",
          f"--params_override={RESUME}"]
  proc = subprocess.Popen(args, env=helpers.env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  checkpoint = tmp_path / "killed" / "checkpoints" / "checkpoint"
  deadline = time.monotonic() + 300
  while not checkpoint.exists() and time.monotonic() < deadline:
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)  # no chance to save: resume from the periodic checkpoint
  proc.communicate(timeout=60)
  killed_at = tf_latest_step(tmp_path / "killed")
  assert 10 <= killed_at < 50
  resumed = helpers.run_train(*args[2:])
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"at step {killed_at}" in resumed.stderr
  assert tf_latest_step(tmp_path / "killed") == 50
  a, b = exported_weights(tmp_path / "straight"), exported_weights(tmp_path / "killed")
  assert sorted(a) == sorted(b)
  assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= 1e-6


def test_an_epochs_row_lost_after_its_checkpoint_is_written_on_the_next_start(tmp_path):
  """A second Ctrl-C (or SIGKILL) during an epoch's evaluation, after its checkpoint: the
  resumed run started after that epoch and its metrics.csv row was missing for good. Now the
  next start writes it, evaluated on the checkpoint (the epoch's own weights: the same values
  as the lost row) and without train_* values. Seen failing on the old controller: 1 row."""
  overrides = ",".join([
      "task.model.name=small_cnn", "task.model.kwargs={filters: 8}",
      "task.train_data.source=synthetic", "task.train_data.num_examples=256",
      "task.train_data.image_size=8", "task.train_data.num_classes=4",
      "task.eval_data.source=synthetic", "task.eval_data.num_examples=64",
      "task.eval_data.image_size=8", "task.eval_data.num_classes=4",
      "trainer.global_batch_size=64", "trainer.epochs=2", "trainer.export_model=false"])
  args = (f"--model_dir={tmp_path / 'run'}", f"--params_override={overrides}")
  first = helpers.run_train(*args)
  assert first.returncode == 0, first.stderr[-3000:]
  metrics = tmp_path / "run" / "metrics.csv"
  rows = pd.read_csv(metrics)
  assert list(rows["epoch"]) == [1, 2]
  rows.iloc[:1].to_csv(metrics, index=False)  # what the process killed in epoch 2's evaluation left
  shutil.rmtree(tmp_path / "run" / "eval")  # and its TensorBoard evaluation (a review: a finished
  again = helpers.run_train(*args)  # run's recovered row reached metrics.csv, not TensorBoard)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "metrics.csv has no row for epoch 2" in again.stderr, again.stderr[-3000:]
  written = pd.read_csv(metrics)
  assert list(written["epoch"]) == [1, 2], written
  lost, found = rows.iloc[1], written.iloc[1]
  assert found["eval_loss"] == lost["eval_loss"] and found["eval_accuracy"] == lost["eval_accuracy"]
  assert found["train_steps"] == 0 and pd.isna(found["train_loss"]) and found["step"] == lost["step"]
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  steps = {event.step for path in (tmp_path / "run" / "eval").glob("events.*")
           for event in tf.compat.v1.train.summary_iterator(str(path))
           for value in event.summary.value if value.tag == "loss"}
  assert steps == {int(lost["step"])}, steps


def installed_script(name):
  beside_python = Path(sys.executable).parent / name
  script = beside_python if beside_python.exists() else shutil.which(name)
  if not script:
    pytest.skip(f"{name} is not installed; pip install -e . installs it")
  return str(script)


@pytest.mark.parametrize("name, words", [
    ("tfdp-train", ["tfdp-train: train / evaluate one experiment config", "--config_file:",
                    "--params_override:", "--tf_log_level:"]),
    ("tfdp-launch", ["tfdp-launch: run N local copies", "-- tfdp-train", "--num_workers:"]),
    ("tfdp-bench", ["tfdp-bench: throughput", "--mode=tta", "--output_dir:"]),
])
def test_help_of_an_installed_script_shows_its_usage_and_flags(name, words):
  # The console script is a wrapper __main__: absl's --help showed only "USAGE: ... [flags]".
  proc = subprocess.run([installed_script(name), "--help"], capture_output=True, text=True,
                        timeout=60, env=helpers.env())
  for word in words:
    assert word in proc.stdout, proc.stdout[-3000:]
  every_flag = subprocess.run([installed_script(name), "--helpfull"], capture_output=True,
                              text=True, timeout=60, env=helpers.env()).stdout
  assert ".;" not in every_flag, [line for line in every_flag.splitlines() if ".;" in line]


def test_a_missing_default_config_names_tfdp_default_config(tmp_path):
  proc = helpers.run_train(TFDP_DEFAULT_CONFIG=str(tmp_path / "nonexist.yaml"), timeout=60)
  lines = helpers.error_lines(proc)
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
  assert "TFDP_DEFAULT_CONFIG" in lines[0] and "--config_file path" not in lines[0], lines[0]


def test_print_config_shows_the_paths_as_config_yaml_records_them():
  """A review: --print_config ("the final config, as it would be saved") showed a relative data
  path where config.yaml records it absolute. Seen failing on the old train.py: 'path: tests'."""
  proc = helpers.run_train("--print_config", "--params_override=task.train_data.source="
                           "image_folder,task.train_data.path=tests", timeout=60)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert f"path: {helpers.REPO / 'tests'}\n" in proc.stdout, proc.stdout[:2000]


@pytest.mark.parametrize("config_files, run_name", [
    ([], "cifar10_quick"),  # the default job's folder stays where it was
    (["configs/cifar10_quick.yaml", "configs/runlocal.yaml"], "cifar10_quick+runlocal"),
])
def test_default_model_dir_is_named_after_every_config_file(tmp_path, config_files, run_name):
  # Named after the last file only, two jobs sharing the runlocal overlay shared runs/runlocal.
  # --mode=eval of a folder with no run: refused, naming the folder, which is not made.
  flags = [f"--config_file={helpers.REPO / path}" for path in config_files]
  proc = subprocess.run([sys.executable, helpers.TRAIN_APP, *flags, "--mode=eval"],
                        capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
                        env=helpers.env(TFDP_DEFAULT_CONFIG=""))
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert f"'{tmp_path / 'runs' / run_name}' has none" in proc.stderr, proc.stderr[-2000:]
  assert "outputs:" not in proc.stderr  # named only once the start's checks have passed
  assert not (tmp_path / "runs").exists()


def test_mode_eval_without_model_dir_reads_the_default_folders_run_not_the_current_folder(
    tmp_path):
  """A review: without --model_dir, --mode=eval looked for ./config.yaml and ./checkpoints (the
  current folder) while it evaluated runs/cifar10_quick: a run there trained with overrides was
  evaluated with the default job's model. Seen failing: no line about its config.yaml."""
  run = tmp_path / "runs" / "cifar10_quick"
  (run / "checkpoints").mkdir(parents=True)
  (run / "checkpoints" / "checkpoint").write_text('model_checkpoint_path: "ckpt-8"\n')
  proc = subprocess.run([sys.executable, helpers.TRAIN_APP, "--mode=eval"],
                        capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
                        env=helpers.env(TFDP_DEFAULT_CONFIG=""))
  lines = helpers.error_lines(proc)
  assert proc.returncode == 2 and lines == [
      "tfdp-train: error: --mode=eval: 'runs/cifar10_quick' has no config.yaml (the config that "
      "trained its checkpoint); pass that config with --config_file."], proc.stderr[-2000:]


def test_mode_eval_of_a_run_whose_config_cannot_be_read_is_one_line(tmp_path):
  """A review: a config.yaml its user cannot read was a PermissionError traceback under
  --mode=eval. Root reads any file, so the read's failure is stood in for. Seen failing: the
  traceback."""
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  (run / "checkpoints" / "checkpoint").write_text('model_checkpoint_path: "ckpt-8"\n')
  (run / "config.yaml").write_text("trainer: {epochs: 1}\n")
  code = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {str(helpers.REPO)!r})
      from tfdp.core import outputs
      def unreadable(path):
        raise PermissionError(13, "Permission denied", path)
      outputs.is_fit_record = unreadable
      sys.argv = ["tfdp-train", "--mode=eval", "--model_dir={run}"]
      from apps import train
      train.run()
      """)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        cwd=str(tmp_path), env=helpers.env(TFDP_DEFAULT_CONFIG=""))
  lines = helpers.error_lines(proc)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert lines == [f"tfdp-train: error: --mode=eval: '{run}/config.yaml' cannot be read "
                   "(Permission denied); make it readable, or pass the run's config with "
                   "--config_file."]


def test_a_refused_resume_says_where_the_folder_or_the_job_came_from(tmp_path):
  """A probe's second job, --params_override=task.model.name=small_cnn after the default job,
  landed in the same default folder (named after the config files) and was told to 'restore the
  earlier value'; a run's folder given without its --config_file met the default job. Seen
  failing on the old apps/train.py (no hint in either line)."""
  from test_hardening import TINY  # pylint: disable=g-import-not-at-top
  job = tmp_path / "job.yaml"
  job.write_text("task: {model: {name: small_cnn}}\n")

  def train(*args):
    return subprocess.run([sys.executable, helpers.TRAIN_APP, "--mode=train", *args],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env=helpers.env())
  first = train(f"--config_file={job}", f"--params_override={TINY},trainer.max_steps=2")
  assert first.returncode == 0, first.stderr[-3000:]
  second = train(f"--config_file={job}", f"--params_override={TINY},trainer.global_batch_size=32")
  (line,) = helpers.error_lines(second)
  assert "cannot resume" in line and "--model_dir was not given: runs/job is named after the " \
      "config files, not --params_override" in line, line
  run = tmp_path / "runs" / "job"
  default_job = train(f"--model_dir={run}")  # the default job (CIFAR-10, batch 1000) over it
  (line,) = helpers.error_lines(default_job)
  assert f"no --config_file was given, so this is the default job; to resume that run, pass " \
      f"--config_file={run / 'config.yaml'}" in line, line
  shutil.rmtree(run / "checkpoints")  # its outputs without a checkpoint: no setting to blame
  (line,) = helpers.error_lines(train(f"--config_file={job}", f"--params_override={TINY}"))
  assert "no checkpoint to resume it from" in line and "--model_dir was not given" not in line, line
