"""The parent's child processes: one measurement per fresh process (`python -m tfdp.bench
CELL_JSON`, or a worker group through tfdp's launcher), its environment, time limit and result
line; and what every row carries about the machine it ran on."""
from __future__ import annotations

import datetime
import importlib.metadata
import io
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading

from tfdp import paths
from tfdp.distributed import cpus
from tfdp.bench.options import PROG, BenchError

RESULT_PREFIX = "tfdp-bench-result: "
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what machine_info records


def machine_info() -> dict:
  """Carried by every row: results mean little without the machine and load they came from."""
  fields = cpus.first_processor()
  cpu = fields.get("model name") or platform.processor()
  # The model name alone does not tell two "AMD EPYC" CPUs apart; family/model and the
  # instructions oneDNN's kernels choose between do, and a cap on them changes every number.
  flags = set(fields.get("flags", "").split())

  def version(package: str) -> str:
    try:
      return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      return ""

  return {"nproc": os.cpu_count(), "cpu": cpu,
          "cpu_family_model": f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}",
          "cpu_isa": " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + "/".join(ISA_FLAGS),
          "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")
                                or os.environ.get("DNNL_MAX_CPU_ISA", ""),
          "tf_version": version("tensorflow"),
          "keras_version": version("keras"),
          "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def load_average() -> float:
  return round(os.getloadavg()[0], 2)  # other work on the machine skews every number


def progress(text: str) -> None:
  print(f"{PROG}: {text}", flush=True)


def child_env() -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = paths.REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["PYTHONUNBUFFERED"] = "1"
  env.pop("TF_CONFIG", None)  # single-process cells must not join someone's cluster
  return env


def _error_line(text: str) -> str:
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  mine = [l for l in lines if l.startswith(f"{PROG}: error:")]
  if mine:
    return mine[-1][len(f"{PROG}: error:"):].strip()
  return lines[-1][:300] if lines else "no output"


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)  # the process and anything it started
  except (ProcessLookupError, PermissionError):
    pass
  proc.wait()


def run_process(cmd: list[str], what: str, timeout: float) -> str:
  """Runs one measurement process; returns its stdout. Nothing it started outlives this call."""
  proc = subprocess.Popen(cmd, env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    raise BenchError(f"{what} did not finish in {timeout:.0f}s; raise --timeout_seconds or "
                     "use fewer --steps.") from None
  finally:
    _kill_group(proc)
  if proc.returncode:
    raise BenchError(f"{what} failed (exit code {proc.returncode}): {_error_line(err or out)}")
  return out


def cell_command(spec: dict) -> list[str]:
  return [sys.executable, "-m", "tfdp.bench", json.dumps(spec)]


def last_result(out: str) -> dict | None:
  """A cell's result: the last RESULT_PREFIX line of its output, or None."""
  lines = [l for l in out.splitlines() if l.startswith(RESULT_PREFIX)]
  return json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None


def run_cell(spec: dict, what: str, timeout: float) -> dict:
  result = last_result(run_process(cell_command(spec), what, timeout))
  if result is None:
    raise BenchError(f"{what} printed no result line.")
  return result


def run_worker_group(spec: dict, num_workers: int, what: str, timeout: float) -> list[dict]:
  """One measurement on `num_workers` processes through tfdp's launcher; one result per rank.
  A group that outlives `timeout` is stopped as a SIGTERM to this process would stop it."""
  from tfdp.distributed import launch  # pylint: disable=g-import-not-at-top
  output = io.StringIO()
  env = child_env()
  timed_out = threading.Event()

  def expire():
    timed_out.set()
    os.kill(os.getpid(), signal.SIGTERM)  # run_group's handler stops the group
  timer = threading.Timer(timeout, expire)
  timer.daemon = True
  timer.start()
  try:
    result = launch.run_group(cell_command(spec), num_workers, env=env, stop_grace_seconds=10,
                              output=output)
  finally:
    timer.cancel()
  if timed_out.is_set():
    raise BenchError(f"{what} did not finish in {timeout:.0f}s; raise --timeout_seconds or "
                     "use fewer --steps.")
  if result.interrupted_by is not None:  # a stop, retryable as every tfdp stop (not 2: bad input)
    stopped = BenchError(f"{what}: {result.failure_summary()}.")
    stopped.exit_code = 128 + result.interrupted_by
    raise stopped
  if not result.ok:
    failed = result.first_failed if result.first_failed is not None else 0
    tail = "\n".join(result.last_lines[failed]) if result.last_lines else ""
    raise BenchError(f"{what}: {result.failure_summary()}: {_error_line(tail)}")
  rows: dict[int, dict] = {}
  for line in output.getvalue().splitlines():
    match = re.match(r"\[w(\d+)\] " + re.escape(RESULT_PREFIX) + r"(.*)$", line)
    if match:
      rows[int(match.group(1))] = json.loads(match.group(2))
  if len(rows) != num_workers:
    raise BenchError(f"{what}: {len(rows)} of {num_workers} workers printed a result line.")
  return [rows[i] for i in range(num_workers)]
