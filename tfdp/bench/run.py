"""tfdp-bench's top level: one mode, checked, run in a scratch folder, and written out."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading

from tfdp import paths
from tfdp.bench import modes
from tfdp.bench import report
from tfdp.bench.options import MODES, BenchError, BenchOptions, check_options
from tfdp.bench.processes import machine_info
from tfdp.errors import ConfigError

# Every mode has its runner (modes.py) and its table and picture (report.VIEWS).
assert set(modes.RUNNERS) == set(report.VIEWS) == set(MODES), "a mode lacks a runner or a view"


def prepare_output_dir(path: str) -> str:
  path = os.path.abspath(os.path.expanduser(path))
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".tfdp-bench-"):
      pass
  except OSError as e:
    above = paths.nearest_existing(path)  # makedirs said "File exists" for a file (a probe)
    why = (f"'{above}' is a file, not a folder" if not os.path.isdir(above) else e.strerror)
    raise ConfigError(f"--output_dir '{path}' is not writable ({why}); choose another "
                      "folder.") from None
  return path


def _remove_empty_folders(path: str, existed: str):
  """Removes `path` and the folders above it up to `existed` (the nearest that was there
  before), each only while it is empty."""
  while path != existed and path.startswith(existed):
    try:
      os.rmdir(path)
    except OSError:
      return
    path = os.path.dirname(path)


def _stop_on_sigterm():
  """SIGTERM becomes an exception, so the `finally` that kills the running cell still runs."""
  if threading.current_thread() is not threading.main_thread():
    return None

  def stop(signum, frame):
    del signum, frame
    error = BenchError("got SIGTERM; stopped the running measurement.")
    error.exit_code = 128 + signal.SIGTERM  # retryable, as every tfdp stop (not 2: a bad input)
    raise error

  return signal.signal(signal.SIGTERM, stop)


def run_mode(mode: str, opts: BenchOptions):
  """Runs one mode; writes <mode>.csv and <mode>.png (tta: also tta_targets.csv); returns the
  pandas DataFrame of <mode>.csv."""
  check_options(mode, opts)
  import pandas  # pylint: disable=g-import-not-at-top,unused-import  (missing: fail before the runs)
  existed = paths.nearest_existing(os.path.abspath(os.path.expanduser(opts.output_dir)))
  output_dir = prepare_output_dir(opts.output_dir)
  scratch = tempfile.mkdtemp(prefix="tfdp-bench-")  # model_dirs of the setup steps
  previous = _stop_on_sigterm()
  try:
    rows = modes.RUNNERS[mode](opts, scratch, {**machine_info(), "mode": mode})
  except BaseException:
    _remove_empty_folders(output_dir, existed)  # a failed first cell left them behind (a probe)
    raise
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
    shutil.rmtree(scratch, ignore_errors=True)
  return report.write(mode, rows, output_dir, opts.targets)
