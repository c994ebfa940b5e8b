"""All-reduce across N hosts of a cluster in a box (tfdp/bench/box.py), per link rate and
size: seconds per all-reduce and the bytes each host put on its link, against the ring's
2(N-1)/N * S; then the alpha-beta fit T(N, S) = 2(N-1)*alpha + 2(N-1)/N * S/B per link rate on
N in FIT_N, checked on the held-out N.

  python benchmarks/cluster_allreduce.py [--quick] [--out benchmarks/results/cluster]

Every host runs tfdp-bench's own `allreduce` cell (`python -m tfdp.bench CELL_JSON`,
tfdp/bench/cells.py) with TF_CONFIG naming the hosts' 10.77.0.k addresses and the overrides
tfdp-bench uses between worker processes (jobs.allreduce_jobs: multi_worker_mirrored, ring).
One box per (N, rate) runs every size (a fresh TensorFlow per host costs ~25 s on the shared
2-core machine, so one box per size did not fit the time); each host's tx byte counter over the
whole box is held against the ring's 2(N-1)/N * S summed over every all-reduce the cell ran
(warm-up + timed; at 100 Mbit/s float32 + bfloat16). What else a host sends (start-up, the
collective group's set-up, gRPC headers of the ops) was 34-93 KB per host in boxes of as many
4-byte all-reduces (results/cluster/sweep1_failed.log), under 0.1% of these totals; it is not
subtracted. A box whose host fails is run again (up to 3 times); rows are saved after every box
and a rerun skips the (N, rate) already in allreduce.csv.
Writes allreduce.csv, fit.csv and allreduce.png in --out.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # this tree's tfdp, before any installed one

from tfdp.bench import box as cluster_box  # noqa: E402  pylint: disable=wrong-import-position
from tfdp.bench import cells, jobs, processes  # noqa: E402  pylint: disable=wrong-import-position

KIB, MIB = 1 << 10, 1 << 20
RATES = ["100mbit", "1gbit", ""]  # "" : unshaped (veth, no tbf)
RATE_BITS = {"100mbit": 100e6, "1gbit": 1e9, "": math.nan}
NS = [2, 3, 4]
FIT_N, HELD_OUT_N = (2, 4), (3,)
SIZES = [64 * KIB, 1 * MIB, 8 * MIB, 32 * MIB]
STEPS, REPEATS = 4, 3  # per size: 1 warm-up + 3 timed blocks of 4 all-reduces
WARMUP = 1
PORT = cluster_box.PORT


def rate_name(rate: str) -> str:
  return rate or "unshaped"


def wanted_sizes(rate: str) -> list[int]:
  # 32 MiB only where it takes under ~20 s: at 100 Mbit/s a 32 MiB float32 + bf16 pair puts
  # 2(N-1)/N * 48 MiB on each link, ~6 s at N=4, times 13.
  return [s for s in SIZES if s < 32 * MIB or rate != "100mbit"]


def calls_run(sizes: list[int], steps: int, repeats: int, dtypes: int) -> list[int]:
  """All-reduces the cell runs per size and dtype: warm-up block + timed blocks."""
  return [dtypes * (cells.ops_per_block(s, WARMUP) + repeats * cells.ops_per_block(s, steps))
          for s in sizes]


def run_box(n: int, rate: str, sizes: list[int], dtype: str) -> dict:
  opts = types.SimpleNamespace(params_override=["runtime.intra_op_threads=1",
                                                "runtime.inter_op_threads=1",
                                                f"runtime.all_reduce_dtype={dtype}"], workers=n)
  workers_cfg, _ = jobs.allreduce_jobs(opts)
  spec = {"kind": "allreduce", "sizes": sizes, "warmup": WARMUP, "steps": STEPS,
          "repeats": REPEATS, "pack": False, "overrides": workers_cfg}
  return cluster_box.run_cell_group(spec, n, rate, f"N={n} rate={rate_name(rate)} sizes={sizes}",
                                    timeout=300, port=PORT)


def sweep(quick: bool, log, rows_done: list[dict], save) -> list[dict]:
  info = processes.machine_info()
  rows = []
  # One box per (N, rate) with every size; at 100 Mbit/s the cell runs each size as float32
  # and as bfloat16 (runtime.all_reduce_dtype=bfloat16: the cell times both in one run).
  grid = [(n, rate, wanted_sizes(rate), "bfloat16" if rate == "100mbit" else "float32")
          for rate in RATES for n in NS]
  if quick:
    grid = [(2, "", [64 * KIB, MIB], "float32")]
  done = {(r["n"], r["rate"]) for r in rows_done}
  rows = list(rows_done)
  for n, rate, sizes, dtype in grid:
    if (n, rate_name(rate)) in done:
      continue
    load = processes.load_average()
    for attempt in range(3):
      try:
        box = run_box(n, rate, sizes, dtype)
        break
      except RuntimeError as error:  # seen once: a host exits while a peer still pulls from it
        log(f"box failed (attempt {attempt + 1}): {str(error)[:300]}")
    else:
      raise RuntimeError(f"N={n} {rate_name(rate)} failed 3 times")
    dtypes = 2 if dtype != "float32" else 1
    calls = calls_run(sizes, STEPS, REPEATS, dtypes)
    # Ring: each host sends 2(N-1)/N of every all-reduce's bytes (bf16: half of float32's).
    wire = [s * (1.5 if dtypes == 2 else 1.0) for s in sizes]
    ring_total = sum(c / dtypes * 2 * (n - 1) / n * w for c, w in zip(calls, wire))
    for i, size in enumerate(sizes):
      entries = [c["sizes"] for c in box["cells"]]
      secs = {}
      for j, entry in enumerate(entries[0]):
        if entry["bytes"] * (4 // (2 if entry["dtype"] == "bfloat16" else 4)) == size:
          secs[entry["dtype"]] = max(e[j]["seconds"] for e in entries)
      for k in range(n):
        net = box["tx"][k]
        rows.append({"n": n, "rate": rate_name(rate), "rate_bits": RATE_BITS[rate],
                     "size_bytes": size, "all_reduce_dtype": dtype, "host": k,
                     "seconds_f32": secs["float32"], "seconds_bf16": secs.get("bfloat16", math.nan),
                     "calls_this_size": calls[i],
                     "ring_bytes_per_op_f32": 2 * (n - 1) / n * size,
                     "box_sizes": "+".join(str(s) for s in sizes),
                     "box_tx_bytes": box["tx"][k], "box_rx_bytes": box["rx"][k],
                     "box_tx_net": net,
                     "box_ring_bytes": ring_total, "box_tx_over_ring": net / ring_total,
                     "box_wall_s": box["wall_s"], "load_avg_1m": load,
                     "implementation": box["cells"][0]["implementation"],
                     "steps": STEPS, "repeats": REPEATS, "warmup": WARMUP,
                     **{k: info[k] for k in ("cpu", "cpu_family_model", "cpu_isa",
                                             "onednn_max_cpu_isa", "nproc", "tf_version",
                                             "date")}})
      log(f"N={n} {rate_name(rate):8s} {size:>9d} B: f32 {secs['float32'] * 1e3:9.2f} ms"
          + (f", bf16 {secs['bfloat16'] * 1e3:9.2f} ms" if "bfloat16" in secs else ""))
    save(rows)
    ratios = [r["box_tx_over_ring"] for r in rows[-n:]]
    log(f"N={n} {rate_name(rate)}: tx / ring = {', '.join(f'{x:.3f}' for x in ratios)}"
        f"; box {box['wall_s']:.1f} s, load {load}")
  return rows


def fit(frame):
  """alpha, B per rate on FIT_N (least squares on T = a*x + b*y, x = 2(N-1), y = 2(N-1)/N*S),
  MAPE on the held-out N. float32 rows only; one time per box (host 0's row)."""
  import pandas as pd  # pylint: disable=g-import-not-at-top
  points = frame[frame.host == 0]
  out = []
  for rate, group in points.groupby("rate", sort=False):
    x = 2 * (group.n - 1)
    y = 2 * (group.n - 1) / group.n * group.size_bytes
    t = group.seconds_f32
    train = group.n.isin(FIT_N)
    test = group.n.isin(HELD_OUT_N)
    if train.sum() < 2:
      continue
    # Relative least squares: each point weighted 1/T, so 64 KiB counts as much as 32 MiB.
    a_mat = np.stack([x[train], y[train]], axis=1) / t[train].to_numpy()[:, None]
    (alpha, inv_b), *_ = np.linalg.lstsq(a_mat, np.ones(train.sum()), rcond=None)
    predict = alpha * x + inv_b * y
    err = (predict - t).abs() / t
    bw = 1 / inv_b if inv_b > 0 else math.inf
    wire = group.rate_bits.iloc[0] / 8
    out.append({"rate": rate, "alpha_us": alpha * 1e6, "B_MBps": bw / 1e6,
                "wire_MBps": wire / 1e6, "B_over_wire": bw / wire if wire == wire else math.nan,
                "fit_n": "+".join(map(str, FIT_N)), "held_out_n": "+".join(map(str, HELD_OUT_N)),
                "fit_points": int(train.sum()), "held_out_points": int(test.sum()),
                "fit_mape_pct": 100 * err[train].mean(),
                "held_out_mape_pct": 100 * err[test].mean() if test.any() else math.nan,
                "held_out_max_ape_pct": 100 * err[test].max() if test.any() else math.nan})
  return pd.DataFrame(out)


def plot(frame, fits, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  points = frame[frame.host == 0]
  rates = list(dict.fromkeys(points.rate))
  fig, axes = plt.subplots(1, len(rates) + 1, figsize=(5 * (len(rates) + 1), 4.2))
  for ax, rate in zip(axes, rates):
    group = points[points.rate == rate]
    f = fits[fits.rate == rate]
    for n, color in zip(NS, ["C0", "C1", "C2"]):
      g = group[group.n == n].sort_values("size_bytes")
      if g.empty:
        continue
      ax.loglog(g.size_bytes, g.seconds_f32 * 1e3, "o-", color=color,
                label=f"N={n} float32" + (" (held out)" if n in HELD_OUT_N else ""))
      b = group[(group.n == n) & (group.all_reduce_dtype == "bfloat16")].sort_values("size_bytes")
      if not b.empty:
        ax.loglog(b.size_bytes, b.seconds_bf16 * 1e3, "s:", color=color, label=f"N={n} bfloat16")
      if not f.empty:
        s = np.geomspace(g.size_bytes.min(), g.size_bytes.max(), 50)
        model = (2 * (n - 1) * f.alpha_us.iloc[0] * 1e-6
                 + 2 * (n - 1) / n * s / (f.B_MBps.iloc[0] * 1e6))
        ax.loglog(s, model * 1e3, "--", color=color, alpha=0.5)
    title = f"link {rate}"
    if not f.empty:
      title += (f"\nfit N={'+'.join(map(str, FIT_N))}: a={f.alpha_us.iloc[0]:.0f} us, "
                f"B={f.B_MBps.iloc[0]:.1f} MB/s; held-out MAPE {f.held_out_mape_pct.iloc[0]:.0f}%")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("all-reduce size (bytes, float32)")
    ax.set_ylabel("ms per all-reduce (slowest host)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
  ax = axes[-1]
  boxes = frame.drop_duplicates(["n", "rate", "host"])
  for j, (rate, marker) in enumerate(zip(rates, "o^s")):
    g = boxes[boxes.rate == rate]
    ax.plot(g.n + 0.08 * (j - 1), g.box_tx_over_ring, marker, alpha=0.7, label=f"{rate}")
  ax.set_xticks(NS)
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_title("bytes each host sent (whole box) / ring sum of 2(N-1)/N*S\n"
               "(every all-reduce the cell ran; 100mbit: f32+bf16)", fontsize=9)
  ax.set_xlabel("hosts N (one point per host)")
  ax.legend(fontsize=7)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


# ---- projection to real clusters (a model, not a measurement) -----------------------------------
MODELS = {"ResNet-50": 102e6, "BERT-base": 440e6}  # fp32 gradient bytes (25.6 M, 110 M params)
LINKS = {"25GbE": 25e9 / 8, "100GbE": 100e9 / 8}  # bytes/s on the wire
LINK_EFFICIENCY = 0.8  # B = 0.8 x wire: what a tuned TCP/RoCE ring gets (assumption)
ALPHA_NET = 25e-6  # s per ring step between hosts (LAN RTT/2 + software; assumption)
GPUS_PER_HOST = 8
NVLINK_BUSBW = 200e9  # bytes/s in-host all-reduce busbw (A100 NVLink class; assumption)
WORKERS = [8, 64, 256]


def ring_seconds(p: int, size: float, bw: float, alpha: float) -> float:
  return 2 * (p - 1) * alpha + 2 * (p - 1) / p * size / bw if p > 1 else 0.0


def projection():
  """Seconds per step of gradient all-reduce. ring: P workers, one per host, one ring over the
  network. hierarchical: P/8 hosts of 8 GPUs: in-host all-reduce over NVLink (reduce-scatter +
  all-gather, 2(7/8) S at NVLINK_BUSBW), then a ring over the hosts' NICs of the whole S
  (the 8 shards share one NIC per host), no overlap between the two. hier_8nic: the same with
  one NIC per GPU, each of the 8 local ranks ringing its S/8 shard over its own NIC."""
  import pandas as pd  # pylint: disable=g-import-not-at-top
  rows = []
  for model, grad in MODELS.items():
    for link, wire in LINKS.items():
      bw = wire * LINK_EFFICIENCY
      for p in WORKERS:
        for dtype, size in (("float32", grad), ("bfloat16", grad / 2)):
          hosts = max(1, p // GPUS_PER_HOST)
          local = min(p, GPUS_PER_HOST)
          nvlink = 2 * (local - 1) / local * size / NVLINK_BUSBW
          rows.append({"model": model, "link": link, "workers": p, "dtype": dtype,
                       "bytes": size, "B_GBps": bw / 1e9, "alpha_us": ALPHA_NET * 1e6,
                       "ring_ms": 1e3 * ring_seconds(p, size, bw, ALPHA_NET),
                       "hier_ms": 1e3 * (nvlink + ring_seconds(hosts, size, bw, ALPHA_NET)),
                       # one NIC per GPU ("rail"): each local rank rings its S/8 shard
                       "hier_8nic_ms": 1e3 * (nvlink + ring_seconds(hosts, size / local, bw,
                                                                     ALPHA_NET)),
                       "hier_nvlink_ms": 1e3 * nvlink, "hosts_hier": hosts})
  return pd.DataFrame(rows)


def projection_markdown(frame) -> str:
  lines = ["| model | link | workers | ring fp32 ms | ring bf16 ms | hier fp32 ms | hier bf16 ms "
           "| hier 8 NICs fp32 ms | hier 8 NICs bf16 ms |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for (model, link, p), g in frame.groupby(["model", "link", "workers"], sort=False):
    f, b = g[g.dtype == "float32"].iloc[0], g[g.dtype == "bfloat16"].iloc[0]
    lines.append(f"| {model} | {link} | {p} | {f.ring_ms:.1f} | {b.ring_ms:.1f} | "
                 f"{f.hier_ms:.1f} | {b.hier_ms:.1f} | {f.hier_8nic_ms:.1f} | {b.hier_8nic_ms:.1f} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(HERE, "results", "cluster"))
  parser.add_argument("--quick", action="store_true", help="two boxes, to check the set-up")
  parser.add_argument("--replot", action="store_true", help="refit and replot allreduce.csv")
  args = parser.parse_args()
  import pandas as pd  # pylint: disable=g-import-not-at-top
  os.makedirs(args.out, exist_ok=True)
  csv = os.path.join(args.out, "allreduce.csv")
  if args.replot:
    frame = pd.read_csv(csv, keep_default_na=False, na_values=["nan", "NaN", ""])
  else:
    why = cluster_box.unavailable()
    if why:
      sys.exit(f"cluster_allreduce: no box here: {why}")
    start = time.perf_counter()
    done = (pd.read_csv(csv, keep_default_na=False, na_values=["nan", "NaN", ""]).to_dict("records")
            if os.path.exists(csv) and not args.quick else [])
    rows = sweep(args.quick, lambda s: print(f"[{time.perf_counter() - start:6.0f} s] {s}",
                                             flush=True), done,
                 lambda rows: pd.DataFrame(rows).to_csv(csv, index=False))  # after every box
    frame = pd.DataFrame(rows)
  frame["rate"] = frame["rate"].astype(str)
  fits = fit(frame)  # seconds_f32 of every box (100 Mbit/s boxes ran float32 too)
  fits.to_csv(os.path.join(args.out, "fit.csv"), index=False)
  print(fits.to_string(index=False))
  plot(frame, fits, os.path.join(args.out, "allreduce.png"))
  proj = projection()
  proj.to_csv(os.path.join(args.out, "projection.csv"), index=False)
  with open(os.path.join(args.out, "projection.md"), "w") as f:
    f.write(projection_markdown(proj) + "\n")
  print(projection_markdown(proj))


if __name__ == "__main__":
  main()
