"""What a run prints when its output goes to a file: one plain line per compiled loop, no escape
codes, none of TensorFlow's start-up noise unless --tf_log_level asks for it."""
import io
import os
import re
import subprocess
import sys

import helpers
from tfdp import logs

# 2 epochs x 64 examples / batch 16 = 8 steps, 2 per compiled loop: 4 loops.
TINY = ("task.train_data.source=synthetic,task.train_data.num_examples=64,"
        "task.train_data.image_size=8,task.train_data.num_classes=2,"
        "task.eval_data.source=synthetic,task.eval_data.num_examples=32,"
        "task.eval_data.image_size=8,task.eval_data.num_classes=2,trainer.global_batch_size=16,"
        "trainer.epochs=2,trainer.steps_per_loop=2,task.model.name=small_cnn,runtime.cpu_replicas=2")
LOOP_LINE = re.compile(r"^epoch [12]/2 step (\d+)/8 loss \d+\.\d{4} accuracy \d+\.\d{4} "
                       r"ex/s \d+\.\d GFLOP/s \d+\.\d MFU \d+\.\d% lr \S+ ETA (\d+:\d\d|\?)$")
# What TensorFlow prints on a CPU-only machine at start: C++ log lines (I0000 00:00:...), the
# absl pre-init banner, the CUDA probe's error, tf.distribute's INFO lines.
TF_NOISE = ("I0000 00:00", "W0000 00:00", "absl::InitializeLog", "cuInit", "cuda_platform",
            "oneDNN", "cross_device_ops.py", "mirrored_strategy.py", "functional_saver.py")


def run_redirected(tmp_path, *flags: str) -> str:
  """tfdp-train with stdout and stderr into one file, as a batch system's log; returns it."""
  env = helpers.env()
  env.pop("TF_CPP_MIN_LOG_LEVEL")  # the default, as a user starts it
  log = tmp_path / "train.log"
  with open(log, "w") as out:
    proc = subprocess.run([sys.executable, helpers.TRAIN_APP, f"--model_dir={tmp_path / 'run'}",
                           f"--params_override={TINY}", *flags], stdout=out,
                          stderr=subprocess.STDOUT, env=env, cwd=str(helpers.REPO), timeout=600)
  text = log.read_text()
  assert proc.returncode == 0, text[-3000:]
  return text


def test_redirected_log_has_one_plain_line_per_loop_and_no_tensorflow_noise(tmp_path):
  # With a profiler trace of 2 steps too: TensorBoard's profile tab reads it, the log stays clean.
  text = run_redirected(tmp_path, "--params_override=runtime.profile_steps=2")
  assert "\x1b" not in text and "\r" not in text and "\b" not in text, repr(text[-2000:])
  loop_lines = [line for line in text.splitlines() if line.startswith("epoch ")]
  assert [int(LOOP_LINE.match(line).group(1)) for line in loop_lines] == [2, 4, 6, 8], loop_lines
  assert [noise for noise in TF_NOISE if noise in text] == [], text[-3000:]
  assert len(re.findall(r"^eval: ", text, re.M)) == 2  # one evaluation per epoch
  # The summary's learning rate is the last loop's, in its digits (it said 0.0000 for 8e-08).
  done = re.search(r"^tfdp-train: done: .*learning_rate=([^,]+),", text, re.M).group(1)
  last_lr = float(re.findall(r" lr (\S+) ETA", text)[-1])
  assert last_lr > 0 and abs(float(done) - last_lr) <= 1e-3 * last_lr, (done, last_lr)
  png = (tmp_path / "run" / "metrics.png").read_bytes()
  assert png.startswith(b"\x89PNG\r\n\x1a\n")
  assert len(list((tmp_path / "run" / "train" / "plugins" / "profile").glob("*/*.xplane.pb"))) == 1


def test_tf_log_level_info_shows_tensorflow_lines_again(tmp_path):
  text = run_redirected(tmp_path, "--tf_log_level=info")
  assert "I0000 00:00" in text and "cross_device_ops.py" in text, text[-3000:]


def test_plain_progress_line_names_step_metrics_rate_and_eta():
  out = io.StringIO()
  progress = logs.Progress(total_steps=10, steps_per_epoch=5, metric_names=["loss"], stream=out)
  assert not progress.interactive
  progress.start_epoch(0)
  progress.loop_done(2, 2, seconds=30.0, metrics={"loss": 1.5}, examples_per_sec=10.0, lr=0.1)
  progress.loop_done(4, 2, seconds=2.0, metrics={"loss": 1.25}, examples_per_sec=64.0, lr=0.05)
  lines = out.getvalue().splitlines()
  # The first loop (30 s: graph tracing) predicts 6 steps x 15 s; after it, 1 s a step.
  assert lines == ["epoch 1/2 step 2/10 loss 1.5000 ex/s 10.0 lr 0.1 ETA 2:00",
                   "epoch 1/2 step 4/10 loss 1.2500 ex/s 64.0 lr 0.05 ETA 0:06"]


def test_disabled_progress_prints_nothing():
  out = io.StringIO()
  progress = logs.Progress(4, 2, ["loss"], enabled=False, stream=out)
  progress.start_epoch(0)
  progress.loop_done(2, 2, 1.0, {"loss": 1.0}, 1.0, 0.1)
  assert out.getvalue() == ""


def test_startup_filter_drops_only_tensorflow_loading_lines():
  dropped = ["WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
             "I0000 00:00:1796075493.118210   22802 port.cc:153] oneDNN custom operations are on.",
             "W0000 00:00:1796075493.123395   22802 cudart_stub.cc:31] Could not find cuda drivers"]
  kept = ["E0000 00:00:1796075496.652884   22802 cuda_platform.cc:52] a real error",
          "Traceback (most recent call last):", "UserWarning: something from Python"]
  assert [line for line in dropped + kept if not logs._STARTUP_LINE.match(line)] == kept


def test_format_seconds():
  assert [logs.format_seconds(s) for s in (0, 59.6, 61, 3600 + 62)] == ["0:00", "1:00", "1:01",
                                                                         "1:01:02"]


def test_a_jupyter_kernel_is_known_by_its_shell_also_under_another_name(monkeypatch):
  """The progress bar draws in a kernel: ipykernel's ZMQInteractiveShell, or a subclass of it
  with another name (Colab's google.colab._shell.Shell). Fake modules stand in for both."""
  import types  # pylint: disable=g-import-not-at-top
  ZMQInteractiveShell = type("ZMQInteractiveShell", (), {})  # pylint: disable=invalid-name
  shells = {"jupyter": ZMQInteractiveShell(), "colab": type("Shell", (ZMQInteractiveShell,), {})(),
            "terminal": type("TerminalInteractiveShell", (), {})(), "python": None}
  found = {}
  for where, shell in shells.items():
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda s=shell: s))
    found[where] = logs.in_jupyter_kernel()
  monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: 1 / 0))
  monkeypatch.delitem(sys.modules, "ipykernel")  # IPython alone is no kernel, and is not asked
  found["IPython without ipykernel"] = logs.in_jupyter_kernel()
  assert found == {"jupyter": True, "colab": True, "terminal": False, "python": False,
                   "IPython without ipykernel": False}


def test_a_model_module_that_imports_keras_starts_tensorflow_quietly(tmp_path):
  """The config's model module is imported while the config is checked: one that imports Keras
  at its top loads TensorFlow there, before the run would, and must load it as quietly."""
  (tmp_path / "keras_first.py").write_text(
      "from absl import logging\nimport keras\nimport tfdp\n\n"
      "logging.warning('keras_first: imported')  # the user's own line, kept\n\n\n"
      "@tfdp.register_model('keras_first')\n"
      "def build(input_shape, num_classes):\n"
      "  inputs = keras.Input(input_shape)\n"
      "  x = keras.layers.GlobalAveragePooling2D()(inputs)\n"
      "  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))\n")
  module = "--params_override=task.model.name=keras_first,task.model.module=keras_first"
  env = helpers.env(PYTHONPATH=f"{tmp_path}{os.pathsep}{helpers.env()['PYTHONPATH']}")
  env.pop("TF_CPP_MIN_LOG_LEVEL")  # the default, as a user starts it
  for extra in ("trainer.optimizer.momentum=-5", "trainer.epochs=1"):  # refused, then trained
    proc = subprocess.run([sys.executable, helpers.TRAIN_APP, f"--model_dir={tmp_path / 'run'}",
                           f"--params_override={TINY}", f"{module},{extra}"], capture_output=True,
                          text=True, env=env, cwd=str(helpers.REPO), timeout=600)
    text = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == extra.endswith("=1"), text[-3000:]
    assert [noise for noise in TF_NOISE if noise in text] == [], text[-3000:]
    assert "keras_first: imported" in text, text[-3000:]


def test_a_capture_inside_another_keeps_the_real_stderr_for_the_outer_one(monkeypatch):
  """A model module that calls tfdp.make_strategy() at import loads TensorFlow inside the app's
  capture: the inner capture must not leave the outer one without the real stderr, which a
  signal's exit line is written to (it set it to None on leaving)."""
  monkeypatch.delitem(sys.modules, "tensorflow", raising=False)  # as before TensorFlow loads
  with logs.tensorflow_loading("off"):
    outer = logs._real_stderr_fd  # pylint: disable=protected-access
    with logs.tensorflow_loading("off"):
      assert logs._real_stderr_fd == outer  # pylint: disable=protected-access
    assert logs._real_stderr_fd == outer is not None  # pylint: disable=protected-access
  assert logs._real_stderr_fd is None  # pylint: disable=protected-access
