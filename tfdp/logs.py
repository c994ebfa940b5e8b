"""What a run prints: a progress bar on a terminal, one plain line per compiled loop anywhere else
(a file, a cluster log, tfdp-launch's pipe: no escape codes), and TensorFlow's own start-up noise
hidden unless asked for (`--tf_log_level`)."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import tempfile
import threading

# --tf_log_level → TF_CPP_MIN_LOG_LEVEL (the C++ side) and the Python "tensorflow" logger's level.
TF_LOG_LEVELS = {"off": ("3", logging.ERROR), "error": ("2", logging.ERROR),
                 "warning": ("1", logging.WARNING), "info": ("0", logging.INFO)}
DEFAULT_TF_LOG_LEVEL = "off"
_CPP_TO_NAME = {cpp: name for name, (cpp, _) in TF_LOG_LEVELS.items()}
# Lines TensorFlow's C++ libraries print while they load, before absl::InitializeLog (so no
# TF_CPP_MIN_LOG_LEVEL applies): "WARNING: All log messages before absl::InitializeLog() ..." and
# "I0000 00:00:1796075493.118210   22802 port.cc:153] oneDNN custom operations are on ...".
_STARTUP_LINE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)"
                           r"|[IW]0000 00:00:[\d.]+\s+\d+ [\w.]+:\d+\] )")
# (dated 0000 00:00: no log is set up yet. A Python absl line while a module imports is kept.)


# While import_tensorflow captures fd 2: a dup of the real stderr. A signal that ends the process
# then (os._exit) would otherwise leave its message in the capture, never read.
_real_stderr_fd: int | None = None
_stderr_lock = threading.RLock()  # re-entrant: a Python signal handler runs in the main thread


def write_stderr_line(line: str) -> None:
  """`line` on the process's stderr, even while TensorFlow is importing."""
  with _stderr_lock:
    if _real_stderr_fd is None:
      sys.stderr.write(line + "\n")
      sys.stderr.flush()
    else:
      os.write(_real_stderr_fd, (line + "\n").encode("utf-8", "replace"))


def tf_log_level(flag_value: str | None = None) -> str:
  """The flag if given, else what TF_CPP_MIN_LOG_LEVEL already says, else 'off'."""
  if flag_value:
    return flag_value
  return _CPP_TO_NAME.get(os.environ.get("TF_CPP_MIN_LOG_LEVEL", ""), DEFAULT_TF_LOG_LEVEL)


def quiet_tensorflow(level: str = DEFAULT_TF_LOG_LEVEL) -> None:
  """Call before TensorFlow is imported: its C++ logging reads the level once, at start."""
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = TF_LOG_LEVELS[level][0]
  # tf.distribute's INFO lines (cross_device_ops.py, mirrored_strategy.py, functional_saver.py)
  # go through this logger, which absl's handler prints once absl.app has run.
  logging.getLogger("tensorflow").setLevel(TF_LOG_LEVELS[level][1])
  # Some of TensorFlow's Python modules log through absl, as tfdp does ("Sharding callback
  # duration" from functional_saver.py), and so does TFDS: filter those by where they come from.
  absl_logger = logging.getLogger("absl")
  for old_filter in [f for f in absl_logger.filters if isinstance(f, _TensorFlowRecords)]:
    absl_logger.removeFilter(old_filter)
  absl_logger.addFilter(_TensorFlowRecords(TF_LOG_LEVELS[level][1]))


class _TensorFlowRecords(logging.Filter):
  """Drops records below `level` logged from inside TensorFlow or TensorFlow Datasets (which
  announces every dataset it opens)."""
  PACKAGES = tuple(os.sep + name + os.sep for name in ("tensorflow", "tensorflow_datasets"))

  def __init__(self, level: int):
    super().__init__()
    self.level = level

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= self.level or not any(p in record.pathname for p in self.PACKAGES)


def start_tensorflow(level: str | None = None):
  """Imports TensorFlow (if not yet) with its logging at `level` (see tf_log_level); returns tf.
  The apps call this first; so do tfdp.make_strategy and tfdp.fit in a notebook."""
  level = tf_log_level(level)
  quiet_tensorflow(level)
  tf = import_tensorflow(level)
  # TF sets its logger to INFO in an interactive kernel on first use: configure it, then set it.
  tf.get_logger().setLevel(TF_LOG_LEVELS[level][1])
  return tf


def import_tensorflow(level: str = DEFAULT_TF_LOG_LEVEL):
  """Imports TensorFlow; at level 'off' or 'error' the INFO and WARNING lines its C++ libraries
  print while loading are dropped (everything else they print is passed on)."""
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  compat.defer_unused_imports()
  with tensorflow_loading(level):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf


@contextlib.contextmanager
def tensorflow_loading(level: str | None = None):
  """Around code that may load TensorFlow first (TensorFlow's import, a config's model module
  that imports Keras): at level 'off' or 'error' (`tf_log_level`) the lines its C++ libraries
  print while loading are dropped from fd 2, and the rest passed on."""
  global _real_stderr_fd
  if (tf_log_level(level) not in ("off", "error") or "tensorflow" in sys.modules
      or _real_stderr_fd is not None):  # (or inside another: that one captures and filters)
    yield
    return
  sys.stderr.flush()
  with tempfile.TemporaryFile() as captured:
    saved = os.dup(2)
    with _stderr_lock:
      _real_stderr_fd = saved
      os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      with _stderr_lock:
        os.dup2(saved, 2)
        _real_stderr_fd = None
        os.close(saved)
      captured.seek(0)
      kept = [line for line in captured.read().decode("utf-8", "replace").splitlines()
              if not _STARTUP_LINE.match(line)]
      if kept:
        print("\n".join(kept), file=sys.stderr, flush=True)


def is_interactive(stream=None) -> bool:
  """A terminal, or the output of a Jupyter kernel (which draws the progress bar's carriage
  returns)."""
  if stream is None and in_jupyter_kernel():
    return True
  return bool(getattr(stream or sys.stdout, "isatty", lambda: False)())


def in_jupyter_kernel() -> bool:
  if "ipykernel" not in sys.modules:  # imported by any kernel (IPython alone may be deferred)
    return False
  ipython = sys.modules.get("IPython")
  shell = ipython.get_ipython() if ipython is not None else None
  # Colab's shell is a subclass of ipykernel's under another name (google.colab._shell.Shell)
  return any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)


def format_seconds(seconds: float) -> str:
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
  """Training progress, once per compiled loop. Interactive: Keras' progress bar per epoch.
  Otherwise one line per loop: epoch, step/total, the task's metrics, examples/s, the model's
  FLOP/s and MFU (when tfdp.core.flops could count them), learning rate and the run's ETA (from
  the loops after the first, which also traces the graph)."""

  def __init__(self, total_steps: int, steps_per_epoch: int, metric_names, enabled: bool = True,
               stream=None, flops_per_example: float = math.nan, peak_flops: float = math.nan):
    self.total_steps = total_steps
    self.flops_per_example = flops_per_example  # training FLOPs per example (3x forward)
    self.peak_flops = peak_flops  # of every device the job trains on
    self.steps_per_epoch = steps_per_epoch
    self.metric_names = list(metric_names)
    self.enabled = enabled
    self.stream = stream
    self.interactive = is_interactive(stream)
    self._bar = None
    self._epoch = 0
    self._timed_steps = 0
    self._timed_seconds = 0.0
    self._first_loop = None  # (steps, seconds): used for the ETA until a second loop is timed

  @property
  def _out(self):
    return self.stream or sys.stdout

  def start_epoch(self, epoch: int) -> None:
    """epoch counts from 0."""
    self._epoch = epoch
    if not (self.enabled and self.interactive):
      return
    import keras  # pylint: disable=g-import-not-at-top
    epoch_steps = min(self.steps_per_epoch, self.total_steps - epoch * self.steps_per_epoch)
    print(f"Epoch {epoch + 1}/{self.epochs}", file=self._out, flush=True)
    self._bar = keras.utils.Progbar(epoch_steps,
                                    stateful_metrics=[*self.metric_names, "ex/s", "MFU", "lr"])

  @property
  def epochs(self) -> int:
    return -(-self.total_steps // self.steps_per_epoch)

  def eta_seconds(self, step: int) -> float | None:
    if self._timed_steps:
      per_step = self._timed_seconds / self._timed_steps
    elif self._first_loop:
      per_step = self._first_loop[1] / self._first_loop[0]
    else:
      return None
    return (self.total_steps - step) * per_step

  def loop_done(self, step: int, num_steps: int, seconds: float, metrics: dict,
                examples_per_sec: float, lr: float) -> None:
    """After a loop of num_steps steps that ended at global step `step` and took `seconds`."""
    if self._first_loop is None:
      self._first_loop = (num_steps, seconds)
    else:
      self._timed_steps += num_steps
      self._timed_seconds += seconds
    if not self.enabled:
      return
    if self.interactive:
      mfu = self.flops_per_example * examples_per_sec / (self.peak_flops or math.nan)
      self._bar.update(step - self._epoch * self.steps_per_epoch,
                       values=[*metrics.items(), ("ex/s", examples_per_sec),
                               *([("MFU", mfu)] if math.isfinite(mfu) else []), ("lr", lr)])
      return
    print(self.line(step, metrics, examples_per_sec, lr), file=self._out, flush=True)

  def line(self, step: int, metrics: dict, examples_per_sec: float, lr: float) -> str:
    shown = " ".join(f"{name} {value:.4f}" for name, value in metrics.items())
    eta = self.eta_seconds(step)
    return (f"epoch {self._epoch + 1}/{self.epochs} step {step}/{self.total_steps} {shown} "
            f"ex/s {examples_per_sec:.1f}{self.flops_text(examples_per_sec)} lr {lr:.4g} ETA "
            f"{format_seconds(eta) if eta is not None else '?'}")

  def flops_text(self, examples_per_sec: float) -> str:
    """' GFLOP/s 32.1 MFU 19.3%'; the MFU left out without a peak, both without a count."""
    achieved = self.flops_per_example * examples_per_sec
    if not math.isfinite(achieved):
      return ""
    text = f" GFLOP/s {achieved / 1e9:.1f}"
    return text + (f" MFU {100 * achieved / self.peak_flops:.1f}%"
                   if math.isfinite(self.peak_flops) and self.peak_flops > 0 else "")


def process_age_seconds() -> float:
  """Seconds since this process was created (the kernel's clock, so Python's and TensorFlow's own
  import time count): a command's start-up is its age at its first training step."""
  import psutil  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  return time.time() - psutil.Process().create_time()

