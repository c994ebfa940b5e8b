"""tfdp-bench: what data-parallel training costs here, and where the time goes.

Five modes; each writes `<mode>.csv` and `<mode>.png` into the output folder and prints a table:

  throughput  images/s, step time, input-wait fraction and peak memory per model x replicas x
              global batch, with plain Keras `model.fit` on one device as the baseline row
  scaling     the same job on 1..N worker processes (tfdp's launcher, 1 thread each) with a fixed
              per-replica batch; efficiency = thr(N) / (N x thr(1))
  allreduce   all-reduce SUM bandwidth between worker processes (ring over gRPC) and between
              logical replicas of one process, the effect of bytes_per_pack, and loopback TCP
  input       the input pipeline alone vs the rate the training loop consumes it
  tta         time to accuracy: one config (default: tfdp-train's default job) trained by tfdp
              and by two plain-Keras `model.fit` baselines on the same model, data and cores,
              to each of --targets; eval accuracy per epoch against wall seconds, the seconds to
              each target and the speed-up of tfdp (also tta_targets.csv; see tfdp/tta.py for
              the three runs and their common time zero)

The parent process never imports TensorFlow: it checks every config of the grid first (a mistake
fails in a second, before anything runs), then runs each measurement in a fresh process
(`python -m tfdp.bench CELL_JSON`), because logical CPU devices and thread pools are fixed once
TensorFlow starts. Cells use tfdp's own config, strategy, data, model and trainer: the timed loop
is `Trainer.run_steps`, the same compiled function `tfdp-train` runs; tta's runs are whole
trainings (`Experiment.run()`, or `model.fit` on the same experiment's objects), one after the
other, each in its own process.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from tfdp import config as config_lib
from tfdp.core import data as data_lib
from tfdp.core import task as tasks
from tfdp import tta
from tfdp.errors import ConfigError, TfdpError

PROG = "tfdp-bench"
MODES = ("throughput", "scaling", "allreduce", "input", "tta")
DATA_CHOICES = ("synthetic", "cifar10")
RESULT_PREFIX = "tfdp-bench-result: "
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE_SCRIPT = os.path.join(REPO, "benchmarks", "keras_fit_baseline.py")
DEFAULT_JOB = "configs/cifar10_quick.yaml"  # what tfdp-train trains when given no config
MAX_BLOCK_BYTES = 256 << 20  # caps all-reduce ops per timed block, so 64 MiB sizes take seconds
TCP_CHUNK = 4 << 20


class BenchError(TfdpError):
  """A measurement could not run; the message names which one and why."""


@dataclasses.dataclass
class BenchOptions:
  output_dir: str = "runs/bench"
  models: list[str] = dataclasses.field(default_factory=lambda: ["resnet20"])
  replicas: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
  global_batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [128])
  steps: int = 20  # steps (or all-reduce ops) per timed block
  warmup_steps: int = 5
  repeats: int = 3  # timed blocks; the median is reported
  data: str = "synthetic"
  config_files: list[str] = dataclasses.field(default_factory=list)  # a job from configs instead
  # of the model x data grid (e.g. configs/shakespeare_mlm.yaml): its model, data and task
  params_override: list[str] = dataclasses.field(default_factory=list)
  baseline: bool = True  # throughput: also time plain Keras model.fit
  workers: int = 2  # scaling: 1..workers; allreduce: the group size
  per_replica_batch: int = 64  # scaling
  min_bytes: int = 4 << 10  # allreduce sizes: min_bytes * size_factor**k <= max_bytes
  max_bytes: int = 64 << 20
  size_factor: int = 4
  pack_tensors: int = 256  # allreduce bytes_per_pack test: a list of this many tensors ...
  pack_tensor_bytes: int = 64 << 10  # ... of this size each (16 MiB in all by default)
  bytes_per_pack: list[int] = dataclasses.field(default_factory=lambda: [0, 4 << 20])
  tcp_bytes: int = 256 << 20
  timeout_seconds: float = 1800.0  # per single-process measurement
  targets: list[float] = dataclasses.field(default_factory=lambda: [0.6, 0.7, 0.8])  # tta
  runs: list[str] = dataclasses.field(default_factory=lambda: list(tta.RUNS))  # tta


def _parse_number_list(text: str, flag: str, kind: type, what: str) -> list:
  try:
    values = [kind(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise ConfigError(f"--{flag} must be {what} separated by commas, got '{text}'.") from None
  if not values:
    raise ConfigError(f"--{flag} is empty; give at least one number.")
  return values


def parse_int_list(text: str, flag: str) -> list[int]:
  """`1,2,4` → [1, 2, 4]; one line naming the flag otherwise."""
  return _parse_number_list(text, flag, int, "whole numbers")


def parse_float_list(text: str, flag: str) -> list[float]:
  """`0.6,0.7` → [0.6, 0.7]; one line naming the flag otherwise."""
  return _parse_number_list(text, flag, float, "numbers")


def parse_name_list(text: str) -> list[str]:
  return [v.strip() for v in text.split(",") if v.strip()]


# ---- parent side: config checks, subprocesses, tables ------------------------------------------


def check_options(mode: str, opts: BenchOptions) -> None:
  """Every flag mistake fails here, before any TensorFlow process starts."""
  if mode not in MODES:
    raise ConfigError(f"--mode '{mode}' is unknown; use one of {', '.join(MODES)}.")
  if opts.data not in DATA_CHOICES:
    raise ConfigError(f"--data '{opts.data}' is unknown; use one of {', '.join(DATA_CHOICES)}.")
  if mode == "tta":
    check_tta_flags(opts)
    opts.config_files = opts.config_files or [DEFAULT_JOB]
  if opts.config_files:
    from tfdp import cli  # pylint: disable=g-import-not-at-top
    opts.config_files = [cli.find_config(f) for f in opts.config_files]
    opts.models = [config_lib.load_config(opts.config_files).task.model.name]
  if opts.config_files and opts.baseline and mode == "throughput":
    raise ConfigError("--baseline times the --models x --data grid in plain Keras, not a "
                      "--config_file job; add --nobaseline.")
  if not opts.models:  # names are checked with each config (task.model.module may register more)
    raise ConfigError("--models is empty; name at least one model, e.g. resnet20.")
  for flag in ("steps", "repeats", "workers", "per_replica_batch", "min_bytes", "max_bytes",
               "pack_tensors", "pack_tensor_bytes", "tcp_bytes", "timeout_seconds"):
    if getattr(opts, flag) <= 0:
      raise ConfigError(f"--{flag} is {getattr(opts, flag)}; it must be > 0.")
  if opts.warmup_steps < 0:
    raise ConfigError(f"--warmup_steps is {opts.warmup_steps}; it must be >= 0.")
  for flag in ("replicas", "global_batch_sizes"):
    if any(v <= 0 for v in getattr(opts, flag)):
      raise ConfigError(f"--{flag} has a value <= 0; use positive numbers.")
  if any(v < 0 for v in opts.bytes_per_pack):
    raise ConfigError("--bytes_per_pack has a negative value; use 0 (one pack) or a byte count.")
  if mode == "allreduce":
    if opts.workers < 2:
      raise ConfigError("--workers must be >= 2 for allreduce: one process has nothing to reduce with.")
    if opts.size_factor < 2 or opts.min_bytes > opts.max_bytes:
      raise ConfigError("allreduce sizes need --size_factor >= 2 and --min_bytes <= --max_bytes.")
    if any(v % 4 for v in (opts.min_bytes, opts.pack_tensor_bytes)):
      raise ConfigError("--min_bytes and --pack_tensor_bytes must be multiples of 4 (float32).")


def check_tta_flags(opts: BenchOptions) -> None:
  if not opts.targets or any(not 0 < t < 1 for t in opts.targets):
    raise ConfigError(f"--targets {opts.targets} must be accuracies between 0 and 1 (exclusive), "
                      "e.g. --targets=0.6,0.7,0.8.")
  unknown = [r for r in opts.runs if r not in tta.RUNS]
  if unknown or not opts.runs or len(set(opts.runs)) != len(opts.runs):
    raise ConfigError(f"--runs '{','.join(opts.runs)}' must name each run once, from "
                      f"{', '.join(tta.RUNS)}.")


def machine_info() -> dict:
  """Carried by every row: results mean little without the machine and load they came from."""
  cpu = platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  except OSError:
    pass

  def version(package: str) -> str:
    try:
      return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      return ""

  return {"nproc": os.cpu_count(), "cpu": cpu, "tf_version": version("tensorflow"),
          "keras_version": version("keras"),
          "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def data_overrides(data: str) -> list[str]:
  if data == "cifar10":  # tfdp's default train_data: TFDS cifar10 "train", augmented
    return ["task.train_data.source=tfds", "task.train_data.name=cifar10"]
  # Small enough that the warm-up fills the cache: the timed window is the steady state.
  return ["task.train_data.source=synthetic", "task.train_data.num_examples=1024",
          "task.train_data.image_size=32", "task.train_data.num_classes=10"]


def job_overrides(opts: BenchOptions, model: str, global_batch: int, extra: list[str]) -> list[str]:
  """The benchmarked job: user overrides win over the grid, except what the setup step needs.
  With --config_file the configs give model, data and task; the grid sets batch and replicas."""
  grid = [] if opts.config_files else [f"task.model.name={model}", *data_overrides(opts.data),
                                       "task.train_data.augment=true"]
  base = [*grid, f"trainer.global_batch_size={global_batch}",
          "trainer.learning_rate.schedule=constant", *extra]
  # The cell builds the experiment and times the trainer's own loop on fresh iterators.
  setup = ["trainer.epochs=1", "trainer.export_model=false"]
  return base + list(opts.params_override) + setup


def describe_data(data: config_lib.DataConfig) -> str:
  return data.source if data.source != "tfds" else f"{data.name}:{data.split}"


def load_checked(overrides: list[str], replicas: int | None = None,
                 config_files: list[str] = ()) -> config_lib.ExperimentConfig:
  """The checks a cell would fail on, made up front: one bad cell must not waste the others."""
  config = config_lib.load_config(list(config_files), overrides)
  if replicas:
    data_lib.check_batch_divides(config, replicas)
    from tfdp.distributed import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
    strategy_lib.check_jit_compile(config.runtime, replicas, "--replicas")
  tasks.task_class(config.task.name).check_source(config.task.train_data, "task.train_data")
  return config


def child_env() -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
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


def run_cell(spec: dict, what: str, timeout: float) -> dict:
  out = run_process(cell_command(spec), what, timeout)
  results = [json.loads(l[len(RESULT_PREFIX):]) for l in out.splitlines()
             if l.startswith(RESULT_PREFIX)]
  if not results:
    raise BenchError(f"{what} printed no result line.")
  return results[-1]


def run_worker_group(spec: dict, num_workers: int, what: str) -> list[dict]:
  """One measurement on `num_workers` processes through tfdp's launcher; one result per rank."""
  from tfdp.distributed import launch  # pylint: disable=g-import-not-at-top
  output = io.StringIO()
  env = child_env()
  result = launch.run_group(cell_command(spec), num_workers, env=env, stop_grace_seconds=10,
                            output=output)
  if result.interrupted_by is not None:
    raise BenchError(f"{what}: {result.failure_summary()}.")
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


def load_average() -> float:
  return round(os.getloadavg()[0], 2)  # other work on the machine skews every number


def _progress(text: str) -> None:
  print(f"{PROG}: {text}", flush=True)


def _median_ms(seconds: list[float], ops: int) -> float:
  return statistics.median(seconds) / ops * 1000.0


# ---- throughput ---------------------------------------------------------------------------------


def replica_grid(opts: BenchOptions) -> dict[tuple[str, int, int], list[str]]:
  """(model, global batch, replicas) → overrides, every one checked before anything runs."""
  jobs = {}
  for model in opts.models:
    for batch in opts.global_batch_sizes:
      for replicas in opts.replicas:
        jobs[(model, batch, replicas)] = job_overrides(opts, model, batch,
                                                       [f"runtime.cpu_replicas={replicas}"])
        load_checked(jobs[(model, batch, replicas)], replicas, opts.config_files)
  return jobs


def train_spec(opts: BenchOptions, overrides: list[str], model_dir: str, measure: list[str]) -> dict:
  return {"kind": "train", "config_files": opts.config_files, "overrides": overrides,
          "model_dir": model_dir, "measure": measure,
          "warmup": opts.warmup_steps, "steps": opts.steps, "repeats": opts.repeats}


def throughput(opts: BenchOptions, model_dir: str, info: dict) -> list[dict]:
  jobs = replica_grid(opts)
  rows, baselines = [], {}
  for model, batch in dict.fromkeys((m, b) for m, b, _ in jobs):
    if opts.baseline:
      rows.append(baseline_row(opts, model, batch, info))
      baselines[(model, batch)] = rows[-1]["images_per_sec"]
      _progress(f"keras_fit {model} batch {batch}: {rows[-1]['images_per_sec']:.1f} img/s")
  for (model, batch, replicas), overrides in jobs.items():
    load = load_average()
    spec = train_spec(opts, overrides, os.path.join(model_dir, f"{model}-b{batch}-r{replicas}"),
                      ["train", "cached"])
    res = run_cell(spec, f"cell {model} batch={batch} replicas={replicas}", opts.timeout_seconds)
    base = baselines.get((model, batch))
    rows.append({**_row_head(res), **_timing(res),
                 "cached_step_ms": res["cached_step_ms"],
                 "input_wait_fraction": res["input_wait_fraction"],
                 "vs_keras_fit": res["images_per_sec"] / base if base else math.nan,
                 "peak_rss_mb": res["peak_rss_mb"], "load_avg_1m": load, **info})
    _progress(f"{model} batch {batch} replicas {replicas}: {res['images_per_sec']:.1f} img/s, "
              f"input wait {res['input_wait_fraction']:.2f}")
  return rows


def _row_head(res: dict) -> dict:
  """What ran, as the cell's final config says (a --params_override may change the grid's)."""
  return {"model": res["model"], "data": res["data"], "image_size": res["image_size"],
          "strategy": res["strategy"], "replicas": res["replicas"],
          "workers": res.get("num_workers", 1), "global_batch": res["global_batch"],
          "per_replica_batch": res["global_batch"] // res["replicas"]}


def _timing(res: dict) -> dict:
  return {"images_per_sec": res["images_per_sec"],  # examples/s: sequences for text tasks
          **({"tokens_per_sec": res["tokens_per_sec"]} if "tokens_per_sec" in res else {}),
          "step_ms": res["step_ms"],
          "step_ms_min": res["step_ms_min"], "step_ms_max": res["step_ms_max"],
          "steps": res["steps"], "repeats": res["repeats"]}


def baseline_row(opts: BenchOptions, model: str, batch: int, info: dict) -> dict:
  if not os.path.isfile(BASELINE_SCRIPT):
    raise BenchError(f"the Keras baseline {BASELINE_SCRIPT} is missing (tfdp-bench runs from a "
                     "source checkout); pass --nobaseline to skip it.")
  load = load_average()
  overrides = job_overrides(opts, model, batch, ["runtime.cpu_replicas=0"])
  cmd = [sys.executable, BASELINE_SCRIPT, f"--steps_per_epoch={opts.steps}",
         f"--epochs={opts.repeats}", *[f"--params_override={o}" for o in overrides]]
  out = run_process(cmd, f"Keras baseline {model} batch={batch}", opts.timeout_seconds)
  lines = [l for l in out.splitlines() if l.startswith("{")]
  if not lines:
    raise BenchError(f"the Keras baseline for {model} printed no JSON result line.")
  res = json.loads(lines[-1])
  return {"model": res["model"], "data": res["data"], "image_size": res["image_size"],
          "strategy": "keras_fit", "replicas": 1, "workers": 1,
          "global_batch": res["global_batch"], "per_replica_batch": res["global_batch"],
          "images_per_sec": res["images_per_sec"], "step_ms": res["step_ms"],
          "step_ms_min": res["step_ms_min"], "step_ms_max": res["step_ms_max"],
          "steps": res["steps_per_epoch"], "repeats": res["timed_epochs"],
          "cached_step_ms": math.nan, "input_wait_fraction": math.nan, "vs_keras_fit": 1.0,
          "peak_rss_mb": res["peak_rss_mb"], "load_avg_1m": load, **info}


# ---- scaling --------------------------------------------------------------------------------------


def scaling(opts: BenchOptions, model_dir: str, info: dict) -> list[dict]:
  threads = ["runtime.intra_op_threads=1", "runtime.inter_op_threads=1"]
  jobs = {(m, n): job_overrides(opts, m, opts.per_replica_batch * n, threads)
          for m in opts.models for n in range(1, opts.workers + 1)}
  for (_, n), overrides in jobs.items():
    load_checked(overrides, n, opts.config_files)  # one CPU replica per worker
  rows = []
  for (model, n), overrides in jobs.items():
    load = load_average()
    spec = train_spec(opts, overrides, os.path.join(model_dir, f"{model}-w{n}"), ["train"])
    per_worker = run_worker_group(spec, n, f"scaling {model} on {n} worker(s)")
    chief = per_worker[0]  # each worker timed its own window; the chief's is the global rate
    rows.append({**_row_head(chief), **_timing(chief),
                 "slowest_worker_step_ms": max(w["step_ms"] for w in per_worker),
                 "peak_rss_mb": chief["peak_rss_mb"], "load_avg_1m": load, **info})
    _progress(f"{model} on {n} worker(s): {chief['images_per_sec']:.1f} img/s")
  for row in rows:
    single = next(r["images_per_sec"] for r in rows if r["model"] == row["model"] and r["workers"] == 1)
    row["speedup"] = row["images_per_sec"] / single
    row["efficiency"] = row["images_per_sec"] / (row["workers"] * single)
  return rows


# ---- allreduce ------------------------------------------------------------------------------------


def allreduce_sizes(opts: BenchOptions) -> list[int]:
  sizes, size = [], opts.min_bytes
  while size <= opts.max_bytes:
    sizes.append(size)
    size *= opts.size_factor
  return sizes


def ops_per_block(size: int, wanted: int) -> int:
  return max(1, min(wanted, MAX_BLOCK_BYTES // size))


def loopback_tcp_seconds(total_bytes: int) -> float:
  """Seconds to push total_bytes one way through a 127.0.0.1 socket (sender and receiver threads;
  both release the GIL inside the socket calls)."""
  chunks = max(1, total_bytes // TCP_CHUNK)
  payload = memoryview(bytearray(TCP_CHUNK))
  with socket.create_server(("127.0.0.1", 0)) as server:
    received = [0]

    def receive() -> None:
      conn, _ = server.accept()
      buffer = bytearray(1 << 20)
      with conn:
        while True:
          n = conn.recv_into(buffer)
          if not n:
            break
          received[0] += n

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    with socket.create_connection(server.getsockname()) as client:
      start = time.perf_counter()
      for _ in range(chunks):
        client.sendall(payload)
      client.shutdown(socket.SHUT_WR)
      receiver.join()
      seconds = time.perf_counter() - start
  if received[0] != chunks * TCP_CHUNK:
    raise BenchError(f"loopback TCP test received {received[0]} of {chunks * TCP_CHUNK} bytes.")
  return seconds


def _bandwidth_row(scope: str, test: str, n: int, nbytes: int, seconds: float, **extra) -> dict:
  algbw = nbytes / seconds / 1e9
  return {"scope": scope, "test": test, "n": n, "bytes": nbytes, "time_us": seconds * 1e6,
          "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n, **extra}


def allreduce(opts: BenchOptions, model_dir: str, info: dict) -> list[dict]:
  del model_dir
  n, sizes = opts.workers, allreduce_sizes(opts)
  user = list(opts.params_override)
  # bytes_per_pack is set per call in the pack test; a strategy-wide value would override 0.
  workers_cfg = user + ["runtime.strategy=multi_worker_mirrored", "runtime.all_reduce=ring",
                        "runtime.bytes_per_pack=0"]
  local_cfg = user + ["runtime.strategy=mirrored", f"runtime.cpu_replicas={n}"]
  for overrides in (workers_cfg, local_cfg):
    config_lib.load_config([], overrides)
  spec = {"kind": "allreduce", "sizes": sizes, "warmup": opts.warmup_steps, "steps": opts.steps,
          "repeats": opts.repeats, "pack_tensors": opts.pack_tensors,
          "pack_tensor_bytes": opts.pack_tensor_bytes, "bytes_per_pack": opts.bytes_per_pack}
  load = load_average()
  tcp = statistics.median(loopback_tcp_seconds(opts.tcp_bytes) for _ in range(opts.repeats))
  tcp_bytes = max(1, opts.tcp_bytes // TCP_CHUNK) * TCP_CHUNK
  tcp_row = _bandwidth_row("tcp_loopback", "tcp", 2, tcp_bytes, tcp, implementation="socket",
                           num_tensors=1, bytes_per_pack=math.nan)
  tcp_gbps = tcp_row["algbw_gbps"]
  _progress(f"loopback TCP: {tcp_gbps:.2f} GB/s")
  per_worker = run_worker_group({**spec, "overrides": workers_cfg, "pack": True}, n,
                                f"all-reduce between {n} workers")
  local = run_cell({**spec, "overrides": local_cfg, "pack": False},
                   f"all-reduce between {n} in-process replicas", opts.timeout_seconds)
  rows = [tcp_row]
  for key, scope, results in (("sizes", "workers", per_worker), ("sizes", "in_process", [local]),
                              ("packs", "workers", per_worker)):
    for i, entry in enumerate(results[0][key]):
      # A collective is done when its slowest participant is: time the slowest worker.
      seconds = max(r[key][i]["seconds"] for r in results)
      rows.append(_bandwidth_row(scope, "size" if key == "sizes" else "pack", results[0]["replicas"],
                                 entry["bytes"], seconds,
                                 implementation=results[0]["implementation"],
                                 num_tensors=entry.get("num_tensors", 1),
                                 bytes_per_pack=entry.get("bytes_per_pack", math.nan),
                                 dtype=entry.get("dtype", "float32")))
  for row in rows:
    row.update(tcp_gbps=tcp_gbps, busbw_over_tcp=row["busbw_gbps"] / tcp_gbps, load_avg_1m=load,
               **info)
  best = max((r for r in rows if r["scope"] == "workers"), key=lambda r: r["busbw_gbps"])
  _progress(f"best all-reduce between workers: busbw {best['busbw_gbps']:.3f} GB/s")
  return rows


# ---- input -------------------------------------------------------------------------------------


def input_rate(opts: BenchOptions, model_dir: str, info: dict) -> list[dict]:
  rows = []
  for (model, batch, replicas), overrides in replica_grid(opts).items():
    load = load_average()
    spec = train_spec(opts, overrides, os.path.join(model_dir, f"{model}-b{batch}-r{replicas}"),
                      ["pipeline", "train"])
    res = run_cell(spec, f"cell {model} batch={batch} replicas={replicas}", opts.timeout_seconds)
    rows.append({**_row_head(res), **_timing(res),
                 "pipeline_images_per_sec": res["pipeline_images_per_sec"],
                 "train_images_per_sec": res["images_per_sec"],
                 "pipeline_over_train": res["pipeline_images_per_sec"] / res["images_per_sec"],
                 "peak_rss_mb": res["peak_rss_mb"], "load_avg_1m": load, **info})
    _progress(f"{model} batch {batch} replicas {replicas}: pipeline "
              f"{res['pipeline_images_per_sec']:.0f} img/s, training {res['images_per_sec']:.1f}")
  return rows


# ---- tta: time to accuracy ----------------------------------------------------------------------


def tta_jobs(opts: BenchOptions) -> dict[str, list[str]]:
  """run → its overrides, every config checked before anything runs."""
  jobs = {}
  for run in opts.runs:
    jobs[run] = list(opts.params_override) + tta.run_overrides(run)
    config = config_lib.load_config(opts.config_files, jobs[run])
    if run != "tfdp" and config.task.name != "image_classification":
      raise ConfigError(f"the Keras baselines of --mode=tta train image classifiers, but this "
                        f"config's task is '{config.task.name}'; pass --runs=tfdp.")
    if config.trainer.max_steps:
      raise ConfigError("trainer.max_steps cuts an epoch short, and --mode=tta compares whole "
                        "epochs; set trainer.max_steps=0 and choose trainer.epochs.")
    for key in ("train_data", "eval_data"):  # every epoch evaluates
      tasks.task_class(config.task.name).check_source(getattr(config.task, key), f"task.{key}")
    from tfdp.distributed import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
    replicas = strategy_lib.expected_replicas(config.runtime)
    if replicas:
      data_lib.check_batch_divides(config, replicas)
  return jobs


def time_to_accuracy(opts: BenchOptions, model_dir: str, info: dict) -> list[dict]:
  """One row per (run, epoch); each run trains in its own process, one after the other."""
  rows, jobs = [], tta_jobs(opts)
  for number, (run, overrides) in enumerate(jobs.items(), 1):
    load = load_average()
    _progress(f"{run}: training (run {number} of {len(jobs)})")
    spec = {"kind": "tta", "run": run, "config_files": opts.config_files, "overrides": overrides,
            "model_dir": os.path.join(model_dir, run)}
    res = run_cell(spec, f"tta run {run}", opts.timeout_seconds)
    if not res["curve"]:
      raise BenchError(f"tta run {run} trained no epoch; set trainer.epochs >= 1.")
    for point in res["curve"]:
      rows.append({"run": run, **point, "model": res["model"], "strategy": res["strategy"],
                   "replicas": res["replicas"], "global_batch": res["global_batch"],
                   "steps_per_epoch": res["steps_per_epoch"], "load_avg_1m": load, **info})
    last = res["curve"][-1]
    _progress(f"{run}: {last['epoch']} epoch(s) in {last['seconds']:.1f}s, eval accuracy "
              f"{last['eval_accuracy']:.4f}")
  return rows


def time_to_target(seconds, accuracies, target: float) -> float:
  """Seconds of the first epoch whose eval accuracy is >= target, in epoch order (no
  interpolation: a model exists only at epoch ends); NaN when no epoch reaches it."""
  for second, accuracy in zip(seconds, accuracies):
    if accuracy >= target:
      return float(second)
  return math.nan


def targets_table(frame, targets: list[float]) -> list[dict]:
  """Per target: each run's seconds to reach it, and each baseline's seconds over tfdp's (the
  speed-up of tfdp; NaN when either missed the target)."""
  runs = list(dict.fromkeys(frame["run"]))
  rows = []
  for target in targets:
    row = {"target": target}
    for run in runs:
      curve = frame[frame["run"] == run].sort_values("epoch")
      row[f"{run}_seconds"] = time_to_target(curve["seconds"], curve["eval_accuracy"], target)
    if "tfdp" in runs:
      for run in runs:
        if run != "tfdp":
          row[f"{run}/tfdp"] = row[f"{run}_seconds"] / row["tfdp_seconds"]
    rows.append(row)
  return rows


# ---- outputs ----------------------------------------------------------------------------------------


def _label(row) -> str:
  who = "keras_fit" if row["strategy"] == "keras_fit" else f"{row['strategy']} x{row['replicas']}"
  return f"{row['model']} b{row['global_batch']} {who}"


def _bars(ax, frame, columns: dict[str, str], xlabel: str) -> None:
  """Horizontal bars, one row of the frame per label, one bar per column (legend: its name)."""
  width = 0.8 / len(columns)
  for k, (column, name) in enumerate(columns.items()):
    ax.barh([i + (k - (len(columns) - 1) / 2) * width for i in range(len(frame))],
            frame[column].fillna(0), width, label=name)
  ax.set_yticks(range(len(frame)), [_label(r) for _, r in frame.iterrows()])
  ax.invert_yaxis()
  ax.set_xlabel(xlabel)
  if len(columns) > 1:
    ax.legend()


def plot(mode: str, frame, path: str, targets: list[float] = ()) -> None:
  figure(mode, frame, targets).savefig(path, dpi=100)


def figure(mode: str, frame, targets: list[float] = ()):
  """The picture of one mode's results (a frame read from <mode>.csv): a matplotlib Figure.
  tta: `targets` are drawn as dashed lines."""
  from tfdp.plots import new_figure  # pylint: disable=g-import-not-at-top

  def subplots(columns: int, figsize):
    fig = new_figure(figsize=figsize)
    return fig, fig.subplots(1, columns)

  first = frame.iloc[0]
  title = f"tfdp-bench {mode}: {first['cpu']}, {first['nproc']} CPUs, TF {first['tf_version']}, {first['date']}"
  if mode == "throughput":
    fig, axes = subplots(2, (12, 1.5 + 0.45 * len(frame)))
    _bars(axes[0], frame, {"images_per_sec": "images/s"}, "images/s")
    _bars(axes[1], frame, {"input_wait_fraction": "input wait"}, "input-wait fraction")
    axes[1].set_xlim(0, 1)
  elif mode == "scaling":
    fig, axes = subplots(2, (11, 4))
    for model, group in frame.groupby("model"):
      line, = axes[0].plot(group["workers"], group["images_per_sec"], "o-", label=model)
      axes[0].plot(group["workers"], group["workers"] * group["images_per_sec"].iloc[0], "--",
                   color=line.get_color(), label=f"{model} linear")
      axes[1].plot(group["workers"], group["efficiency"], "o-", label=model)
    ticks = sorted(frame["workers"].unique())
    axes[0].set(xlabel="workers", ylabel="images/s", xticks=ticks)
    axes[0].legend()
    axes[1].set(xlabel="workers", ylabel="efficiency", ylim=(0, 1.1), xticks=ticks)
  elif mode == "allreduce":
    fig, axes = subplots(2, (12, 4))
    for scope, group in frame[frame["test"] == "size"].groupby("scope"):
      axes[0].plot(group["bytes"], group["busbw_gbps"], "o-", label=scope)
    axes[0].axhline(first["tcp_gbps"], color="gray", ls="--", label="loopback TCP")
    axes[0].set(xscale="log", yscale="log", xlabel="bytes per all-reduce", ylabel="busbw (GB/s)")
    axes[0].legend()
    packs = frame[frame["test"] == "pack"]
    axes[1].bar(range(len(packs)), packs["time_us"] / 1000)
    axes[1].set_xticks(range(len(packs)), [str(int(p)) for p in packs["bytes_per_pack"]])
    axes[1].set(xlabel="bytes_per_pack (0: one pack)", ylabel="ms per all-reduce",
                title=f"{int(packs['num_tensors'].iloc[0]) if len(packs) else 0} tensors between workers")
  elif mode == "tta":
    fig, ax = subplots(1, (9, 5))
    for run, group in frame.groupby("run", sort=False):
      how = group.iloc[0]
      ax.plot(group["seconds"], group["eval_accuracy"], "o-", label=f"{run} ({how['strategy']} "
              f"x{how['replicas']}, batch {how['global_batch']})")
    for target in targets:
      ax.axhline(target, color="gray", ls="--", lw=0.8)
    ax.set(xlabel="wall seconds since the training call started (evaluation included)",
           ylabel="eval accuracy", xlim=(0, None), ylim=(0, 1),
           title=f"{first['model']}: eval accuracy per epoch")
    ax.legend()
  else:
    fig, ax = subplots(1, (10, 1.5 + 0.6 * len(frame)))
    _bars(ax, frame, {"pipeline_images_per_sec": "input pipeline alone",
                      "train_images_per_sec": "training loop"}, "images/s")
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  return fig


TABLE_COLUMNS = {
    "throughput": ["model", "strategy", "replicas", "global_batch", "images_per_sec", "step_ms",
                   "input_wait_fraction", "vs_keras_fit", "peak_rss_mb"],
    "scaling": ["model", "workers", "global_batch", "images_per_sec", "step_ms", "speedup",
                "efficiency"],
    "allreduce": ["scope", "test", "n", "bytes", "bytes_per_pack", "time_us", "algbw_gbps",
                  "busbw_gbps", "busbw_over_tcp"],
    "input": ["model", "strategy", "replicas", "global_batch", "pipeline_images_per_sec",
              "train_images_per_sec", "pipeline_over_train"],
    "tta": ["run", "epoch", "seconds", "eval_accuracy", "train_accuracy", "strategy", "replicas",
            "global_batch"],
}
RUNNERS: dict[str, Callable[[BenchOptions, str, dict], list[dict]]] = {
    "throughput": throughput, "scaling": scaling, "allreduce": allreduce, "input": input_rate,
    "tta": time_to_accuracy}


def prepare_output_dir(path: str) -> str:
  path = os.path.abspath(os.path.expanduser(path))
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".tfdp-bench-"):
      pass
  except OSError as e:
    raise ConfigError(f"--output_dir '{path}' is not writable ({e.strerror}); choose another folder.") from None
  return path


def _stop_on_sigterm():
  """SIGTERM becomes an exception, so the `finally` that kills the running cell still runs."""
  if threading.current_thread() is not threading.main_thread():
    return None

  def stop(signum, frame):
    del signum, frame
    raise BenchError("got SIGTERM; stopped the running measurement.")

  return signal.signal(signal.SIGTERM, stop)


def run_mode(mode: str, opts: BenchOptions) -> Any:
  """Runs one mode; writes <mode>.csv and <mode>.png (tta: also tta_targets.csv); returns the
  pandas DataFrame of <mode>.csv."""
  check_options(mode, opts)
  output_dir = prepare_output_dir(opts.output_dir)
  import pandas as pd  # pylint: disable=g-import-not-at-top
  scratch = tempfile.mkdtemp(prefix="tfdp-bench-")  # model_dirs of the setup steps
  previous = _stop_on_sigterm()
  try:
    rows = RUNNERS[mode](opts, scratch, {**machine_info(), "mode": mode})
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
    shutil.rmtree(scratch, ignore_errors=True)
  frame = pd.DataFrame(rows)
  frame.to_csv(os.path.join(output_dir, f"{mode}.csv"), index=False)
  plot(mode, frame, os.path.join(output_dir, f"{mode}.png"), opts.targets)
  tables, written = [frame[TABLE_COLUMNS[mode]]], f"{mode}.csv"
  if mode == "tta":
    tables.append(pd.DataFrame(targets_table(frame, opts.targets)))
    tables[-1].to_csv(os.path.join(output_dir, "tta_targets.csv"), index=False)
    written += ", tta_targets.csv"
  with pd.option_context("display.width", 200, "display.max_columns", 20):
    print("\n\n".join(t.to_string(index=False, float_format=lambda v: f"{v:.4g}") for t in tables))
  print(f"{PROG}: wrote {output_dir}/{written} and {mode}.png", flush=True)
  return frame


# ---- child side: one measurement in a fresh process ---------------------------------------------


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _time_blocks(run: Callable[[int], Any], warmup: int, steps: int, repeats: int) -> list[float]:
  if warmup:
    run(warmup)
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    run(steps)
    seconds.append(time.perf_counter() - start)
  return seconds


def train_cell(spec: dict) -> dict:
  """Times Trainer.run_steps on the real pipeline, on one cached batch, and the pipeline alone."""
  from tfdp.distributed import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from tfdp.core import experiment  # pylint: disable=g-import-not-at-top
  config = config_lib.load_config(spec.get("config_files", []), spec["overrides"])
  cluster = cluster_lib.resolve_cluster()
  # tfdp's whole flow, built once: strategy, data plan, task, model, trainer. The cell times
  # the trainer's own compiled loop on the experiment's own input pipeline.
  exp = experiment.build(config, spec["model_dir"], "train", cluster=cluster, verbose=False)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  trainer, replicas, plan = exp.trainer, exp.replicas, exp.train_plan
  data_cfg, batch = config.task.train_data, plan.global_batch
  # At least one untimed step per fresh iterator: it traces, and it fills shuffle buffers.
  warmup, steps, repeats = max(spec["warmup"], 1), spec["steps"], spec["repeats"]
  num_pipelines = plan.num_pipelines
  source = plan.source
  epochs = math.ceil((warmup + steps * repeats) / plan.steps_per_epoch) + 1
  dataset_fn = exp.train_dataset_fn(epochs=epochs)

  def time_training(fn) -> list[float]:
    iterator = iter(trainer.strategy.distribute_datasets_from_function(fn))
    per_call = config.trainer.steps_per_loop  # as tfdp-train runs: this many steps per call

    def run(n):
      while n > 0:
        trainer.run_steps(iterator, min(per_call, n))
        n -= per_call

    return _time_blocks(run, warmup, steps, repeats)

  out = {"model": config.task.model.name, "data": describe_data(data_cfg),
         "image_size": source.image_shape[0] if source.image_shape else 0,
         "strategy": exp.strategy_plan.kind,
         "replicas": replicas, "global_batch": batch,
         "num_workers": cluster.num_workers, "rank": cluster.rank, "steps": steps,
         "repeats": repeats}
  if "pipeline" in spec["measure"]:
    # The per-pipeline tf.data dataset alone: one training step takes replicas_per_pipeline batches.
    ctx = tf.distribute.InputContext(num_pipelines, max(cluster.rank, 0), replicas)
    iterator = iter(dataset_fn(ctx))

    def pull(n: int) -> None:
      for _ in range(n * plan.replicas_per_pipeline * plan.accumulation_steps):
        next(iterator)

    seconds = _time_blocks(pull, warmup, steps, repeats)
    out["pipeline_images_per_sec"] = steps * plan.step_batch / statistics.median(seconds)
  seconds = time_training(dataset_fn)
  out.update(step_ms=_median_ms(seconds, steps), step_ms_min=min(seconds) / steps * 1000,
             step_ms_max=max(seconds) / steps * 1000,
             images_per_sec=steps * batch / statistics.median(seconds))
  if config.task.name in ("masked_lm", "text_classification"):  # examples are sequences
    out["tokens_per_sec"] = out["images_per_sec"] * config.task.text.sequence_length
  if "cached" in spec["measure"]:
    # The same loop fed one cached batch: what a step costs when input never waits.
    cached = time_training(lambda ctx: dataset_fn(ctx).take(1).cache().repeat())
    out["cached_step_ms"] = _median_ms(cached, steps)
    out["input_wait_fraction"] = max(0.0, 1.0 - out["cached_step_ms"] / out["step_ms"])
  out["peak_rss_mb"] = _peak_rss_mb()
  return out


def allreduce_cell(spec: dict) -> dict:
  """All-reduce SUM of float32 (and runtime.all_reduce_dtype) tensors via strategy.run + the
  replica context, timed per size."""
  from tfdp.distributed import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.load_config([], spec["overrides"])
  strategy, plan = strategy_lib.make_strategy(config.runtime, cluster_lib.resolve_cluster())
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  n = strategy.num_replicas_in_sync
  warmup, steps, repeats = spec["warmup"], spec["steps"], spec["repeats"]

  def reducer(options=None):
    def replica_fn(value):
      # identity places the input on this replica's device (no copy): a function argument has
      # no device, and the all-reduce needs one as its destination.
      value = tf.nest.map_structure(tf.identity, value)
      return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value,
                                                            options=options)

    @tf.function
    def all_reduce(values):
      return strategy.run(replica_fn, args=(values,))
    return all_reduce

  def measure(shapes: list[int], fn, dtype=tf.float32) -> float:
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.ones([k], dtype) for k in shapes])
    nbytes = dtype.size * sum(shapes)

    def run(ops: int):
      for _ in range(ops):
        result = fn(values)
      return float(tf.nest.flatten(strategy.experimental_local_results(result))[0][0])

    if run(max(1, ops_per_block(nbytes, warmup))) != n:  # the sum of n ones: it really reduced
      raise BenchError(f"all-reduce of {nbytes} bytes over {n} replicas returned a wrong sum.")
    block = ops_per_block(nbytes, steps)
    return statistics.median(_time_blocks(run, 0, block, repeats)) / block

  plain = reducer()
  # runtime.all_reduce_dtype=bfloat16: each size's float32 gradient also as it crosses then,
  # the same elements in half the bytes, measured in this same run.
  dtypes = [tf.float32] + ([tf.as_dtype(config.runtime.all_reduce_dtype)]
                           if config.runtime.all_reduce_dtype != "float32" else [])
  sizes = [{"bytes": s * dtype.size // 4, "dtype": dtype.name,
            "seconds": measure([s // 4], plain, dtype)} for s in spec["sizes"] for dtype in dtypes]
  packs = []
  if spec["pack"]:
    shapes = [spec["pack_tensor_bytes"] // 4] * spec["pack_tensors"]
    for bytes_per_pack in spec["bytes_per_pack"]:
      options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=bytes_per_pack)
      packs.append({"bytes": 4 * sum(shapes), "num_tensors": len(shapes),
                    "bytes_per_pack": bytes_per_pack, "seconds": measure(shapes, reducer(options))})
  return {"replicas": n, "implementation": plan.all_reduce or plan.cross_device_ops or "none",
          "sizes": sizes, "packs": packs, "peak_rss_mb": _peak_rss_mb()}


def cell_main(argv: list[str]) -> None:
  from tfdp import cli  # pylint: disable=g-import-not-at-top
  if len(argv) != 2:
    cli.exit_with_error(PROG, "usage: python -m tfdp.bench CELL_JSON (tfdp-bench runs this itself).")
  cli.quiet_tensorflow()
  try:
    spec = json.loads(argv[1])
    result = {"train": train_cell, "allreduce": allreduce_cell,
              "tta": tta.run_cell}[spec["kind"]](spec)
  except TfdpError as error:
    cli.exit_with_error(PROG, error)
  print(RESULT_PREFIX + json.dumps(result), flush=True)
  cli.exit_now(0)  # no iterator teardown: a trained Controller keeps its iterator (see there)


if __name__ == "__main__":
  cell_main(sys.argv)
