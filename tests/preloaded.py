"""Runs a test's Python process forked from one that has already imported TensorFlow.

Most of a small test process's CPU is `import tensorflow` (~2.3 CPU s on the AVX512-BF16 EPYC,
~4.5 on the AVX2-only one: BENCHMARKS.md, "Test suite time"). `run` starts each xdist worker's
own server process once; the server imports TensorFlow, Keras and pandas as tfdp's apps do, then
forks one child per request. The child is a real, separate process: it takes the request's argv,
environment, working folder, stdout and stderr, imports tfdp afresh and runs the script as
`python script.py ...` (or `python -c ...`) would, to Python's normal exit.

Used only where that is the same as a fresh interpreter: argv `[sys.executable, script.py | -c,
...]` and the same values as the server's for every environment variable read while TensorFlow
loads (IMPORT_TIME_VARIABLES). Anything else, or a server that cannot start, runs in a fresh
interpreter (subprocess.run), as does every process with TFDP_TESTS_FRESH_PROCESSES=1.
A test of what happens while TensorFlow loads (its start-up lines, checks before it) must not
come here: `helpers.env(...)` with such a variable changed, or subprocess.run directly.
"""
from __future__ import annotations

import atexit
import json
import locale
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

# Read by TensorFlow, oneDNN, Keras, numpy's BLAS or Python while the server imports them: a
# request whose value differs runs in a fresh interpreter instead.
IMPORT_TIME_VARIABLES = (
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONUTF8",
    "PYTHONIOENCODING", "LANG", "LC_ALL", "LC_CTYPE", "TF_CPP_MIN_LOG_LEVEL",
    "TF_CPP_MAX_VLOG_LEVEL", "TF_CPP_VMODULE", "TF_ENABLE_ONEDNN_OPTS", "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA", "CUDA_VISIBLE_DEVICES", "TF_USE_LEGACY_KERAS", "KERAS_BACKEND",
    "KERAS_HOME", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
    "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "TFDP_PROCLOG", "MPLBACKEND",
    "MPLCONFIGDIR",
    "LD_PRELOAD", "LD_LIBRARY_PATH", "HOME")
FRESH_VARIABLE = "TFDP_TESTS_FRESH_PROCESSES"
_server = {}  # this process's server: "key", "process", "socket"
_starting = threading.Lock()
SERVER_START_SECONDS = 300


def _key(env: dict) -> tuple:
  return tuple((name, env.get(name)) for name in IMPORT_TIME_VARIABLES)


def _eligible(argv: list[str], env: dict) -> bool:
  return (len(argv) >= 2 and argv[0] == sys.executable and os.environ.get(FRESH_VARIABLE) != "1"
          and env.get(FRESH_VARIABLE) != "1"
          and (argv[1] == "-c" and len(argv) >= 3 or argv[1].endswith(".py")))


def _start_server(env: dict) -> None:
  folder = tempfile.mkdtemp(prefix="tfdp-preloaded-")
  path = os.path.join(folder, "socket")
  process = subprocess.Popen([sys.executable, __file__, path], env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
  ready = (select.select([process.stdout], [], [], SERVER_START_SECONDS)[0]
           and process.stdout.readline().strip() == b"ready")
  _server.update(key=_key(env), process=process, socket=path, folder=folder)
  atexit.register(_stop_server)
  if not ready:
    _stop_server()


def _stop_server() -> None:
  process = _server.pop("process", None)
  if process is not None and process.poll() is None:
    process.kill()
    process.wait()
  shutil.rmtree(_server.get("folder", ""), ignore_errors=True)


def run(argv: list[str], *, env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
  """subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)."""
  argv = [str(a) for a in argv]
  if not _eligible(argv, env):
    return _fresh(argv, env, cwd, timeout)
  with _starting:
    if not _server:
      _start_server(env)
  if _server.get("process") is None or _server["key"] != _key(env) \
      or _server["process"].poll() is not None:
    return _fresh(argv, env, cwd, timeout)
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
      socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
    conn.connect(_server["socket"])
    request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
    socket.send_fds(conn, [len(request).to_bytes(8, "big") + request],
                    [out.fileno(), err.fileno()])
    conn.settimeout(timeout)
    reader = conn.makefile("r")
    pid = int(reader.readline())
    try:
      status = reader.readline()
    except (socket.timeout, TimeoutError):
      _kill_group(pid)
      raise subprocess.TimeoutExpired(argv, timeout, _text(out), _text(err)) from None
    if not status:  # the server died under it
      _kill_group(pid)
      raise RuntimeError(f"tests/preloaded.py: the server left while running {argv[:2]}")
    return subprocess.CompletedProcess(argv, int(status), _text(out), _text(err))


def _fresh(argv, env, cwd, timeout) -> subprocess.CompletedProcess:
  return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def _kill_group(pid: int) -> None:
  try:
    os.killpg(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _text(file) -> str:
  """As subprocess's text mode reads a pipe: the locale's encoding, universal newlines."""
  file.seek(0)
  data = file.read().decode(locale.getpreferredencoding(False), "replace")
  return data.replace("\r\n", "\n").replace("\r", "\n")


# --- the server -------------------------------------------------------------------------------

def _serve(path: str) -> None:
  before = dict(os.environ)
  import tfdp  # pylint: disable=g-import-not-at-top,unused-import  (oneDNN on, as tfdp does)
  from tfdp import logs  # pylint: disable=g-import-not-at-top
  logs.import_tensorflow()
  import keras, pandas  # pylint: disable=g-import-not-at-top,unused-import,multiple-statements
  # What these imports put in the environment, a fresh process's imports would put in its own.
  set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
  # TensorFlow's import queued a GPU count (distribute/combinations.py) for absl's app.run to
  # call before main; a fresh tfdp app imports TensorFlow inside main, where absl calls it at
  # once, inside tfdp's filter of TensorFlow's start-up lines. Here it would print its CUDA probe
  # before main; it only serves TensorFlow's own tests.
  from absl import app as absl_app  # pylint: disable=g-import-not-at-top
  absl_app._init_callbacks.clear()  # pylint: disable=protected-access
  # tfdp itself is imported afresh by each child (0.07 s): its modules' state starts clean.
  for name in [n for n in sys.modules if n == "tfdp" or n.startswith("tfdp.")]:
    del sys.modules[name]
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(8)
  listener.settimeout(2.0)
  signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-request waiters are reaped at once
  parent = os.getppid()
  print("ready", flush=True)
  while os.getppid() == parent:
    try:
      conn, _ = listener.accept()
    except (socket.timeout, TimeoutError):
      continue
    conn.settimeout(None)
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
    size = int.from_bytes(message[:8], "big")
    while len(message) < 8 + size:
      message += conn.recv(1 << 20)
    request = json.loads(message[8:8 + size])
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:  # the waiter: forks the child, reports its pid and then its exit status
      listener.close()
      signal.signal(signal.SIGCHLD, signal.SIG_DFL)
      child = os.fork()
      if child == 0:
        conn.close()
        _become(request, fds, set_by_imports)  # raises SystemExit: leaves as Python does
        return
      for fd in fds:
        os.close(fd)
      conn.sendall(f"{child}\n".encode())
      _, status = os.waitpid(child, 0)
      conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
      os._exit(0)
    conn.close()
    for fd in fds:
      os.close(fd)


def _become(request: dict, fds: list[int], set_by_imports: dict) -> None:
  """Turns this forked process into `python <argv[1:]>` started with the request's environment,
  working folder and output files; raises SystemExit (or the script's exception) as that would."""
  import random  # pylint: disable=g-import-not-at-top
  import runpy  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  os.setpgid(0, 0)  # a timeout kills the child with whatever it started
  devnull = os.open(os.devnull, os.O_RDONLY)
  os.dup2(devnull, 0)
  os.dup2(fds[0], 1)
  os.dup2(fds[1], 2)
  for fd in (devnull, *fds):
    os.close(fd)
  os.environ.clear()
  os.environ.update(request["env"])
  os.environ.update(set_by_imports)
  os.chdir(request["cwd"])
  random.seed()
  np.random.seed()  # numpy's global generator is not reseeded by a fork
  argv = request["argv"]
  if argv[1] == "-c":
    sys.argv = ["-c", *argv[3:]]
    sys.path[0] = ""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    exec(compile(argv[2], "<string>", "exec"), main.__dict__)  # pylint: disable=exec-used
  else:
    sys.argv = argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
    runpy.run_path(argv[1], run_name="__main__")
  raise SystemExit(0)


if __name__ == "__main__":
  _serve(sys.argv[1])
