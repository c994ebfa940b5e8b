"""Start-up: counted from the process's creation (imports count), and bounded when a peer never joins."""
import signal
import subprocess
import sys
import time

import helpers
from tfdp import errors
from tfdp.distributed import launch as launcher


def test_process_age_counts_from_the_process_start_not_from_the_import():
  code = ("import time; time.sleep(1.5); t = time.time(); from tfdp import logs; "
          "print(logs.process_age_seconds(), time.time() - t)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       timeout=60).stdout.split()
  age, since_import = float(out[0]), float(out[1])
  assert 1.5 <= age - since_import < 5.0  # the 1.5 s before the import are in it


def test_a_worker_whose_peer_never_comes_back_names_it_and_exits_to_be_restarted(tmp_path):
  """TF's MultiWorkerMirroredStrategy waits for every worker for ever: a restarted group whose
  host never came back hung there. Worker 0 of 2 starts alone; worker 1's port stays closed."""
  ports = launcher.pick_free_ports(2)
  configs = launcher.worker_tf_configs(2, "127.0.0.1", ports)
  started = time.monotonic()
  proc = helpers.run_train(f"--model_dir={tmp_path / 'run'}", "--mode=train",
                           "--params_override=runtime.startup_timeout_seconds=5",
                           timeout=240, TF_CONFIG=configs[0])
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  assert errors.is_retryable_exit_code(proc.returncode)
  lines = helpers.error_lines(proc)
  assert len(lines) == 1, proc.stderr[-2000:]
  assert f"worker 1 at 127.0.0.1:{ports[1]} (connection refused)" in lines[0], lines[0]
  assert "runtime.startup_timeout_seconds" in lines[0]
  assert time.monotonic() - started < 200
