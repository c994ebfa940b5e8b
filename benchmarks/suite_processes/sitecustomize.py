"""Loaded by every Python process whose PYTHONPATH starts with this folder
(benchmarks/suite_processes.py puts it there): with TFDP_PROCLOG set, each process appends one
JSON line when it leaves — its argv, the test that started it, wall and CPU seconds, whether it
imported TensorFlow, whether it was forked after this file ran (tests/preloaded.py: its CPU is
its own, without the import its server did; its wall counts from the server's start) and which
functions autograph converted in it. tfdp's apps leave with
os._exit, which skips atexit, so that is wrapped too. A process killed by a signal writes
nothing."""
import os

if os.environ.get("TFDP_PROCLOG"):
  import atexit
  import json
  import sys
  import time

  _STARTED = time.time()
  _PID = os.getpid()  # another pid at exit: forked (tests/preloaded.py) after this file ran
  _WRITTEN = []

  def _write_line():
    if _WRITTEN:
      return
    _WRITTEN.append(True)
    try:
      times = os.times()
      line = {"pid": os.getpid(), "argv": sys.argv[:3],
              "test": os.environ.get("PYTEST_CURRENT_TEST"), "start": _STARTED,
              "wall": time.time() - _STARTED, "cpu": times.user + times.system,
              "forked": os.getpid() != _PID,
              "tensorflow": "tensorflow" in sys.modules, "autograph": _autograph_converted()}
      with open(os.environ["TFDP_PROCLOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps(line) + "\n")
    except Exception:  # pylint: disable=broad-except  (never change how a process ends)
      pass

  def _autograph_converted():
    if "tensorflow" not in sys.modules:
      return []
    # No import here: a process may leave from another thread while its main thread imports.
    compat = sys.modules.get("tfdp.distributed.compat")
    return compat.autograph_converted_functions() if compat else None  # None: not a tfdp process

  atexit.register(_write_line)
  _os_exit = os._exit

  def _exit_after_writing(code):
    _write_line()
    _os_exit(code)

  os._exit = _exit_after_writing
