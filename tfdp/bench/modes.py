"""The five modes' orchestration, parent side: which cells run in which order, and the rows they
become (report.py turns them into the printed table, `<mode>.csv` and `<mode>.png`):

  throughput  examples/s (column `unit`: images, sequences, ratings...), step time, input-wait
              fraction and peak memory per model x replicas x global batch, with plain Keras
              `model.fit` on one device as the baseline row
  scaling     the same job on 1..N worker processes (tfdp's launcher, 1 thread and 1 replica
              each, whatever the config file says) with a fixed per-replica batch;
              efficiency = thr(N) / (N x thr(1))
  allreduce   all-reduce SUM bandwidth between worker processes (ring over gRPC) and between
              logical replicas of one process, the effect of bytes_per_pack, and loopback TCP;
              --hosts=box: the workers on a box of hosts with --link_rate links, and the bytes
              each sent against the ring's
  input       the input pipeline alone vs the rate the training loop consumes it
  tta         time to accuracy: one config (default: tfdp-train's default job) trained by tfdp
              and by two plain-Keras `model.fit` baselines on the same model, data and cores,
              to each of --targets; eval accuracy per epoch against wall seconds, the seconds to
              each target and the speed-up of tfdp (also tta_targets.csv; see tta.py for the
              three runs and their common time zero)

Cells use tfdp's own config, strategy, data, model and trainer (cells.py): the timed loop is
`Trainer.run_steps`, the same compiled function `tfdp-train` runs; tta's runs are whole trainings
(`Experiment.run()`, or `model.fit` on the same experiment's objects), one after the other, each
in its own process, because logical CPU devices and thread pools are fixed once TensorFlow starts.
"""
from __future__ import annotations

import math
import os
import socket
import statistics
import subprocess
import threading
import time
from typing import Callable

from tfdp.bench import jobs as jobs_lib
from tfdp.bench.cells import ops_per_block
from tfdp.bench.options import BenchError, BenchOptions
from tfdp.bench.processes import load_average, progress, run_cell, run_worker_group
from tfdp.errors import ConfigError

TCP_CHUNK = 4 << 20


# ---- throughput ---------------------------------------------------------------------------------


def throughput(opts: BenchOptions, model_dir: str, info: dict) -> list[dict]:
  jobs = jobs_lib.replica_grid(opts)
  rows, baselines = [], {}
  for model, batch in dict.fromkeys((m, b) for m, b, _ in jobs):
    if opts.baseline:
      rows.append(baseline_row(opts, model, batch, model_dir, info))
      baselines[(model, batch)] = rows[-1]["examples_per_sec"]
      progress(f"keras_fit {model} batch {batch}: {rows[-1]['examples_per_sec']:.1f} "
               f"{rows[-1]['unit']}/s")
  for (model, batch, replicas), overrides in jobs.items():
    load = load_average()
    spec = jobs_lib.train_spec(opts, overrides,
                               os.path.join(model_dir, f"{model}-b{batch}-r{replicas}"),
                               ["train", "cached"])
    res = run_cell(spec, f"cell {model} batch={batch} replicas={replicas}", opts.timeout_seconds)
    base = baselines.get((model, batch))
    rows.append({**_row_head(res), **_timing(res),
                 "cached_step_ms": res["cached_step_ms"],
                 "input_wait_fraction": res["input_wait_fraction"],
                 "vs_keras_fit": res["examples_per_sec"] / base if base else math.nan,
                 "peak_rss_mb": res["peak_rss_mb"], **utilization(res), "load_avg_1m": load,
                 **info})
    progress(f"{_cell_name(res)}: {res['examples_per_sec']:.1f} "
             f"{res['unit']}/s, "
             f"input wait {res['input_wait_fraction']:.2f}, MFU {rows[-1]['mfu']:.3f}")
  return rows


def utilization(res: dict) -> dict:
  """Achieved model FLOP/s (training FLOPs per example, 3x the forward count, x examples/s) and
  MFU against the devices' peak (tfdp.core.flops: the formula and the table)."""
  achieved = res["train_flops_per_example"] * res["examples_per_sec"]
  return {"train_flops_per_example": res["train_flops_per_example"],
          "gflops_per_sec": achieved / 1e9, "peak_gflops_per_sec": res["peak_flops"] / 1e9,
          "mfu": achieved / res["peak_flops"] if res["peak_flops"] else math.nan,
          "precision": res["precision"], "peak_how": res["peak_how"]}


def _row_head(res: dict) -> dict:
  """What ran, as the cell's final config says (a --params_override may change the grid's)."""
  return {"model": res["model"], "data": res["data"], "image_size": res["image_size"],
          "strategy": res["strategy"], "replicas": res["replicas"],
          "workers": res.get("num_workers", 1), "global_batch": res["global_batch"],
          "per_replica_batch": -(-res["global_batch"] // res["replicas"])}  # padded: ceil


def _cell_name(res: dict) -> str:
  """As the row says what ran: a --params_override may change the grid's model or replicas."""
  return f"{res['model']} batch {res['global_batch']} replicas {res['replicas']}"


def _timing(res: dict) -> dict:
  return {"examples_per_sec": res["examples_per_sec"], "unit": res["unit"],  # images, sequences..
          **({"tokens_per_sec": res["tokens_per_sec"]} if "tokens_per_sec" in res else {}),
          "step_ms": res["step_ms"],
          "step_ms_min": res["step_ms_min"], "step_ms_max": res["step_ms_max"],
          "steps": res["steps"], "repeats": res["repeats"]}


def baseline_row(opts: BenchOptions, model: str, batch: int, model_dir: str, info: dict) -> dict:
  load = load_average()
  spec = jobs_lib.keras_fit_spec(opts, model, batch,
                                 os.path.join(model_dir, f"{model}-b{batch}-keras_fit"))
  res = run_cell(spec, f"Keras baseline {model} batch={batch}", opts.timeout_seconds)
  return {"model": res["model"], "data": res["data"], "image_size": res["image_size"],
          "strategy": "keras_fit", "replicas": 1, "workers": 1,
          "global_batch": res["global_batch"], "per_replica_batch": res["global_batch"],
          "examples_per_sec": res["examples_per_sec"], "unit": res["unit"], "step_ms": res["step_ms"],
          "step_ms_min": res["step_ms_min"], "step_ms_max": res["step_ms_max"],
          "steps": res["steps_per_epoch"], "repeats": res["timed_epochs"],
          "cached_step_ms": math.nan, "input_wait_fraction": math.nan, "vs_keras_fit": 1.0,
          # tfdp's loop on one device, timed in the same process between Keras's epochs
          "tfdp_interleaved_step_ms": res["tfdp_interleaved_step_ms"],
          "tfdp_interleaved_vs_keras_fit": res["step_ms"] / res["tfdp_interleaved_step_ms"],
          "peak_rss_mb": res["peak_rss_mb"], **utilization(res), "load_avg_1m": load, **info}


# ---- scaling --------------------------------------------------------------------------------------


def scaling(opts: BenchOptions, model_dir: str, info: dict) -> list[dict]:
  rows = []
  for (model, n), overrides in jobs_lib.scaling_jobs(opts).items():
    load = load_average()
    spec = jobs_lib.train_spec(opts, overrides, os.path.join(model_dir, f"{model}-w{n}"), ["train"])
    per_worker = run_worker_group(spec, n, f"scaling {model} on {n} worker(s)",
                                  opts.timeout_seconds)
    chief = per_worker[0]  # each worker timed its own window; the chief's is the global rate
    rows.append({**_row_head(chief), **_timing(chief),
                 "slowest_worker_step_ms": max(w["step_ms"] for w in per_worker),
                 "peak_rss_mb": chief["peak_rss_mb"], "load_avg_1m": load, **info})
    progress(f"{chief['model']} on {n} worker(s): {chief['examples_per_sec']:.1f} "
             f"{chief['unit']}/s")
  for row in rows:
    single = next(r["examples_per_sec"] for r in rows if r["model"] == row["model"] and r["workers"] == 1)
    row["speedup"] = row["examples_per_sec"] / single
    row["efficiency"] = row["examples_per_sec"] / (row["workers"] * single)
  return rows


# ---- allreduce ------------------------------------------------------------------------------------


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
  if opts.hosts == "box":
    from tfdp.bench import box  # pylint: disable=g-import-not-at-top
    why = box.unavailable()  # a probe namespace: once
    if why:
      raise ConfigError(f"--hosts=box cannot build its hosts here: {why}; use --hosts=loopback.")
  n, sizes = opts.workers, jobs_lib.allreduce_sizes(opts)
  workers_cfg, local_cfg = jobs_lib.allreduce_jobs(opts)
  spec = {"kind": "allreduce", "sizes": sizes, "warmup": opts.warmup_steps, "steps": opts.steps,
          "repeats": opts.repeats, "pack_tensors": opts.pack_tensors,
          "pack_tensor_bytes": opts.pack_tensor_bytes, "bytes_per_pack": opts.bytes_per_pack}
  load = load_average()
  tcp = statistics.median(loopback_tcp_seconds(opts.tcp_bytes) for _ in range(opts.repeats))
  tcp_bytes = max(1, opts.tcp_bytes // TCP_CHUNK) * TCP_CHUNK
  tcp_row = _bandwidth_row("tcp_loopback", "tcp", 2, tcp_bytes, tcp, implementation="socket",
                           num_tensors=1, bytes_per_pack=math.nan)
  tcp_gbps = tcp_row["algbw_gbps"]
  progress(f"loopback TCP: {tcp_gbps:.2f} GB/s")
  if opts.hosts == "box":
    per_worker, traffic = _box_group({**spec, "overrides": workers_cfg, "pack": False}, opts)
  else:
    per_worker = run_worker_group({**spec, "overrides": workers_cfg, "pack": True}, n,
                                  f"all-reduce between {n} workers", opts.timeout_seconds)
    traffic = {"hosts": "loopback"}
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
                                 dtype=entry.get("dtype", "float32"),
                                 **(traffic if scope == "workers" else {})))
  for row in rows:
    row.update(tcp_gbps=tcp_gbps, busbw_over_tcp=row["busbw_gbps"] / tcp_gbps, load_avg_1m=load,
               **info)
  best = max((r for r in rows if r["scope"] == "workers"), key=lambda r: r["busbw_gbps"])
  progress(f"best all-reduce between workers: busbw {best['busbw_gbps']:.3f} GB/s")
  return rows


def _box_group(spec: dict, opts: BenchOptions) -> tuple[list[dict], dict]:
  """The workers' cell on a box of --workers hosts (--hosts=box), each link at --link_rate: one
  result per host, and the bytes the busiest host sent against the ring's 2(N-1)/N of every
  all-reduce the cell ran (tc counts frames: headers make it ~1.08)."""
  from tfdp.bench import box  # pylint: disable=g-import-not-at-top
  n, rate = opts.workers, opts.link_rate
  what = f"all-reduce between {n} box hosts ({rate or 'unshaped'} links)"
  try:
    group = box.run_cell_group(spec, n, rate, what, opts.timeout_seconds)
  except (RuntimeError, subprocess.TimeoutExpired) as error:
    raise BenchError(str(error).splitlines()[0][:300]) from None
  ring = sum((ops_per_block(e["bytes"], spec["warmup"]) +
              spec["repeats"] * ops_per_block(e["bytes"], spec["steps"])) * 2 * (n - 1) / n
             * e["bytes"] for e in group["cells"][0]["sizes"])
  sent = max(group["tx"])
  progress(f"{what}: the busiest host sent {sent / ring:.3f}x the ring's bytes")
  return group["cells"], {"hosts": "box", "link_rate": rate or "unshaped",
                          "box_tx_bytes_max": sent, "ring_tx_bytes": ring,
                          "tx_over_ring": sent / ring}


# ---- input -------------------------------------------------------------------------------------


def input_rate(opts: BenchOptions, model_dir: str, info: dict) -> list[dict]:
  rows = []
  for (model, batch, replicas), overrides in jobs_lib.replica_grid(opts).items():
    load = load_average()
    spec = jobs_lib.train_spec(opts, overrides,
                               os.path.join(model_dir, f"{model}-b{batch}-r{replicas}"),
                               ["pipeline", "train"])
    res = run_cell(spec, f"cell {model} batch={batch} replicas={replicas}", opts.timeout_seconds)
    rows.append({**_row_head(res), **_timing(res),
                 "pipeline_examples_per_sec": res["pipeline_examples_per_sec"],
                 "train_examples_per_sec": res["examples_per_sec"],
                 "pipeline_over_train": res["pipeline_examples_per_sec"] / res["examples_per_sec"],
                 "peak_rss_mb": res["peak_rss_mb"], "load_avg_1m": load, **info})
    progress(f"{_cell_name(res)}: pipeline "
             f"{res['pipeline_examples_per_sec']:.0f} {res['unit']}/s, training "
             f"{res['examples_per_sec']:.1f}")
  return rows


# ---- tta: time to accuracy ----------------------------------------------------------------------


def time_to_accuracy(opts: BenchOptions, model_dir: str, info: dict) -> list[dict]:
  """One row per (run, epoch); each run trains in its own process, one after the other."""
  rows, jobs = [], jobs_lib.tta_jobs(opts)
  for number, (run, overrides) in enumerate(jobs.items(), 1):
    load = load_average()
    progress(f"{run}: training (run {number} of {len(jobs)})")
    res = run_cell(jobs_lib.tta_spec(opts, run, overrides, model_dir), f"tta run {run}",
                   opts.timeout_seconds)
    if not res["curve"]:
      raise BenchError(f"tta run {run} trained no epoch; set trainer.epochs >= 1.")
    for point in res["curve"]:
      rows.append({"run": run, **point, "model": res["model"], "strategy": res["strategy"],
                   "replicas": res["replicas"], "global_batch": res["global_batch"],
                   "steps_per_epoch": res["steps_per_epoch"], "load_avg_1m": load, **info})
    last = res["curve"][-1]
    progress(f"{run}: {last['epoch']} epoch(s) in {last['seconds']:.1f}s, eval accuracy "
             f"{last['eval_accuracy']:.4f}")
  return rows


RUNNERS: dict[str, Callable[[BenchOptions, str, dict], list[dict]]] = {
    "throughput": throughput, "scaling": scaling, "allreduce": allreduce, "input": input_rate,
    "tta": time_to_accuracy}
