"""benchmarks/suite_processes.py, which measured where the suite's CPU goes: its hook logs a
process that leaves with os._exit (as tfdp's apps do), and its summary finds a module fixture
built on two xdist workers."""
import importlib.util
import json
import subprocess
import sys

import helpers

SCRIPT = helpers.REPO / "benchmarks" / "suite_processes.py"


def load_script():
  spec = importlib.util.spec_from_file_location("suite_processes", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_hook_logs_a_process_that_leaves_with_os_exit_and_one_that_returns(tmp_path):
  script = load_script()
  log = tmp_path / "log.jsonl"
  env = helpers.env(TFDP_PROCLOG=str(log), PYTHONPATH=str(script.HOOK))
  for code in ("import os; os._exit(3)", "x = sum(range(10))",
               "import os\nif os.fork() == 0: os._exit(0)\nos.wait()"):  # as tests/preloaded.py
    subprocess.run([sys.executable, "-c", code], env=env, check=False, timeout=60)
  lines = [json.loads(text) for text in log.read_text().splitlines()]
  assert len(lines) == 4 and all(line["argv"] == ["-c"] for line in lines), lines
  assert not any(line["tensorflow"] for line in lines) and all(line["cpu"] >= 0 for line in lines)
  assert [line["forked"] for line in lines] == [False, False, True, False], lines


def test_the_summary_names_a_fixture_built_on_two_workers():
  script = load_script()
  def line(worker, folder, test, tf=True):
    return {"argv": ["probe.py", f"/tmp/pytest-of-x/pytest-1/popen-{worker}/{folder}/run"],
            "test": f"tests/test_m.py::{test} (call)", "cpu": 5.0, "tensorflow": tf}
  text = script.summary([line("gw0", "common0", "test_a"), line("gw1", "common0", "test_b"),
                         line("gw0", "once0", "test_a"), line("gw1", "test_c0", "test_c", False)])
  assert "4 Python processes, 20 CPU s; 3 imported TensorFlow, 15 CPU s" in text, text
  assert "0 of them forked from a preloaded server" in text, text
  assert "{'common0': ['popen-gw0', 'popen-gw1']}" in text, text  # not once0, not a test's own tmp_path


def test_a_process_that_leaves_from_a_thread_while_tensorflow_imports_leaves_with_its_code(tmp_path):
  """tfdp's signal thread calls os._exit while the main thread may be importing TensorFlow
  (tests/test_stop.py): the hook's line must not import anything there, or the import deadlocks
  and the main thread dies of a _DeadlockError with code 1 first."""
  script = load_script()
  log = tmp_path / "log.jsonl"
  code = """if True:
    import os, sys, threading, time
    from tfdp.distributed import compat
    def leave():
      while "tensorflow.python.autograph" not in sys.modules:
        time.sleep(0.0005)
      os._exit(7)
    threading.Thread(target=leave, daemon=True).start()
    import tensorflow
    time.sleep(30)"""
  env = helpers.env(TFDP_PROCLOG=str(log), PYTHONPATH=f"{script.HOOK}:{helpers.REPO}")
  for _ in range(4):  # a race: the old hook's import failed in about half the runs
    proc = subprocess.run([sys.executable, "-c", code], env=env, check=False, timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == 7, proc.stderr[-2000:]
  lines = [json.loads(text) for text in log.read_text().splitlines()]
  assert len(lines) == 4 and all(line["tensorflow"] and line["autograph"] == [] for line in lines)
