"""End-to-end scaling across N hosts of a cluster in a box (tfdp/bench/box.py) on shaped
links, and the scale model step(N) = compute(N) + max(0, allreduce(N, S) - overlap) checked on
the held-out N.

  python benchmarks/cluster_scaling.py [--quick] [--replot] [--out benchmarks/results/cluster]

Every host runs tfdp-bench's own `train` cell (`python -m tfdp.bench CELL_JSON`,
tfdp/bench/cells.py: Trainer.run_steps on the experiment's own pipeline) with the overrides
tfdp-bench's scaling mode uses (one thread per worker, a fixed per-replica batch) and, between
hosts, the ring overrides of its allreduce mode (jobs.allreduce_jobs), TF_CONFIG naming the
hosts' 10.77.0.k addresses. A box per (model, variant, rate, N):

  compute   N single-worker cells at once on unshaped links that never talk (no TF_CONFIG):
            what N processes sharing this machine's cores cost without communication; they start
            timing together (the cell's `start_together` file barrier)
  fp32      the ring, float32 gradients, TF's packing (bytes_per_pack 0), variable order
  backward  runtime.all_reduce_order=backward with 256 KiB packs (DDP's buckets)
  bf16      runtime.all_reduce_dtype=bfloat16

Step time is the slowest host's median; rows are saved after every box and a rerun skips the
boxes already in scaling.csv. The model takes compute(N) from the compute boxes and alpha, B per
link rate from cluster_allreduce.py's fit.csv (item 4, fitted on N=2,4), so the N=3 points
are predictions the model never saw; a second form refits alpha, B on this script's N=2,4 points.
Writes scaling.csv, scaling_model.csv, scaling.png, scaling_projection.csv|md in --out.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # this tree's tfdp, before any installed one
import cluster_allreduce  # noqa: E402  pylint: disable=wrong-import-position

from tfdp import paths  # noqa: E402  pylint: disable=wrong-import-position
from tfdp.bench import box as cluster_box  # noqa: E402  pylint: disable=wrong-import-position
from tfdp.bench import jobs, processes  # noqa: E402  pylint: disable=wrong-import-position

NS = [1, 2, 3, 4]
FIT_N, HELD_OUT_N = cluster_allreduce.FIT_N, cluster_allreduce.HELD_OUT_N
PORT = cluster_allreduce.PORT
WARMUP, STEPS, REPEATS = 2, 4, 3  # per box: 2 untimed steps (tracing), then 3 blocks of 4
CORES = os.cpu_count() or 1
PACK = 256 << 10  # the backward variant's packs: tfdp-bench's earlier overlap experiment's size

# name → (config files, model name for tfdp-bench's grid, per-replica batch, extra overrides)
MODELS = {
    "resnet20": ([], "resnet20", 32, []),
    # airbench at a quarter of its width (~0.5 M parameters): a step of a few hundred ms here
    "airbench_w32": ([], "airbench", 32, ["task.model.kwargs={widths: [32, 128, 128]}"]),
    # configs/shakespeare_mlm.yaml's BERT (2 layers, hidden 128); one play, so start-up is short
    "bert_mlm": ([os.path.join(paths.REPO_ROOT, "configs", "shakespeare_mlm.yaml")], "bert", 8,
                 ["task.train_data.holdout=[hamlet]", "task.train_data.split=holdout",
                  "task.eval_data.holdout=[edward-iii]"]),  # as runlocal_text: not hamlet
}
VARIANTS = {
    "fp32": [],
    "backward": ["runtime.all_reduce_order=backward", f"runtime.bytes_per_pack={PACK}"],
    "bf16": ["runtime.all_reduce_dtype=bfloat16"],
}


def grid(quick: bool) -> list[tuple[str, str, str, int]]:
  """(model, variant, rate, N) in the order they run: every model's compute and baselines before
  any variant, so a run cut short still has the baselines. Variants only at 100 Mbit/s, where
  the wire dominates; float32 at 1 Gbit/s too. 48 boxes, ~70 s each on the shared machine."""
  if quick:
    return [("resnet20", "compute", "", 1), ("resnet20", "fp32", "100mbit", 2)]
  boxes = []
  for model in MODELS:
    boxes += [(model, "compute", "", n) for n in NS]
    boxes += [(model, "fp32", rate, n) for rate in ("100mbit", "1gbit") for n in NS[1:]]
  # The variants where the gradient is largest first: a run cut short loses ResNet-20's (1 MB).
  for model in reversed(MODELS):
    boxes += [(model, variant, "100mbit", n) for variant in ("bf16", "backward") for n in NS[1:]]
  return boxes


def box_overrides(model: str, variant: str, n: int) -> tuple[list[str], list[str]]:
  """(config files, overrides) of every host of one box."""
  files, name, batch, extra = MODELS[model]
  step_settings = [f"trainer.steps_per_loop={STEPS}", "runtime.intra_op_threads=1",
                   "runtime.inter_op_threads=1", *extra]
  opts = types.SimpleNamespace(config_files=files, data="synthetic", params_override=step_settings)
  if variant == "compute":  # each host alone: one worker, one replica, its own batch
    # forced: shakespeare_mlm.yaml's cpu_replicas: 2 made bert_mlm's compute(N) 2 replicas x 4
    return files, jobs.job_overrides(opts, name, batch, []) + jobs.ONE_REPLICA_PER_WORKER
  opts.params_override = step_settings + VARIANTS[variant]  # after the ring's: a pack size wins
  ring, _ = jobs.allreduce_jobs(types.SimpleNamespace(params_override=[], workers=n))
  return files, jobs.job_overrides(opts, name, batch * n, ring) + ["runtime.cpu_replicas=1"]


def run_box(model: str, variant: str, rate: str, n: int, workdir: str) -> dict:
  files, overrides = box_overrides(model, variant, n)
  barrier = tempfile.mkdtemp(prefix="barrier-", dir=workdir)
  specs = []
  for k in range(n):
    spec = {"kind": "train", "config_files": files, "overrides": overrides, "measure": ["train"],
            # one group shares a model_dir (workers check they agree); lone cells each their own
            "model_dir": os.path.join(workdir, f"{model}-{variant}-{rate or 'none'}-n{n}"
                                      + (f"-h{k}" if variant == "compute" else "")),
            "warmup": WARMUP, "steps": STEPS, "repeats": REPEATS}
    if variant == "compute":
      spec["start_together"] = {"folder": barrier, "count": n}
    specs.append(spec)
  return cluster_box.run_cells(specs, rate, f"{model} {variant} {rate or 'unshaped'} N={n}",
                               timeout=420, group=variant != "compute", port=PORT,
                               workdir=workdir)


def box_row(model: str, variant: str, rate: str, n: int, box: dict, load: float,
            info: dict) -> dict:
  cells = box["cells"]
  slowest = max(cells, key=lambda c: c["step_ms"])
  grad = cells[0]["gradient_bytes"]
  wire = grad / 2 if variant == "bf16" else grad
  steps_run = WARMUP + STEPS * REPEATS
  ring = 2 * (n - 1) / n * wire if variant != "compute" else 0.0
  tx_per_step = float(np.mean(box["tx"])) / steps_run
  row = {"model": model, "variant": variant, "rate": cluster_allreduce.rate_name(rate),
         "n": n, "step_ms": slowest["step_ms"],
         "step_ms_hosts": "/".join(f"{c['step_ms']:.1f}" for c in cells),
         "global_batch": cells[0]["global_batch"],
         # what each host ran: one replica per worker, else compute(N) is not the ring's compute
         "strategy": cells[0]["strategy"], "replicas_per_host": cells[0]["replicas"] // cells[0]["num_workers"],
         "per_replica_batch": cells[0]["global_batch"] // cells[0]["replicas"],
         "examples_per_sec": cells[0]["global_batch"] / slowest["step_ms"] * 1e3,
         "tokens_per_sec": (slowest["tokens_per_sec"] / slowest["examples_per_sec"]
                            * cells[0]["global_batch"] / slowest["step_ms"] * 1e3
                            if "tokens_per_sec" in slowest else math.nan),
         "gradient_bytes": grad, "wire_bytes": wire, "ring_bytes_per_step": ring,
         # all of a host's traffic over the box (start-up, warm-up steps too) per step run
         "tx_bytes_per_step": tx_per_step,
         "tx_over_ring": tx_per_step / ring if ring else math.nan,
         "box_wall_s": box["wall_s"], "load_avg_1m": load,
         "load_avg_1m_after": processes.load_average(),
         "warmup": WARMUP, "steps": STEPS, "repeats": REPEATS,
         **{k: info[k] for k in ("cpu", "cpu_family_model", "cpu_isa", "onednn_max_cpu_isa")},
         "nproc": info["nproc"], "tf_version": info["tf_version"],
         "date": info["date"]}
  return row


def sweep(quick: bool, log, rows: list[dict], save) -> list[dict]:
  info = processes.machine_info()
  done = {(r["model"], r["variant"], r["rate"], r["n"]) for r in rows}
  rows = list(rows)
  with tempfile.TemporaryDirectory(prefix="cluster-scaling-") as workdir:
    for model, variant, rate, n in grid(quick):
      key = (model, variant, cluster_allreduce.rate_name(rate), n)
      if key in done:
        continue
      load = processes.load_average()
      for attempt in range(2):
        try:
          box = run_box(model, variant, rate, n, workdir)
          break
        except RuntimeError as error:  # a host that exits while a peer still pulls from it
          log(f"box failed (attempt {attempt + 1}): {str(error)[:400]}")
      else:
        log(f"{key} failed twice; skipped")
        continue
      rows.append(box_row(model, variant, rate, n, box, load, info))
      save(rows)
      r = rows[-1]
      log(f"{model:12s} {variant:8s} {r['rate']:8s} N={n}: step {r['step_ms']:8.1f} ms "
          f"({r['step_ms_hosts']}), {r['examples_per_sec']:7.1f} ex/s, tx/ring "
          f"{r['tx_over_ring']:.3f}; box {box['wall_s']:.0f} s, load {load}")
  return rows



# ---- the scale model, checked on the held-out N ----------------------------------------------


def ring_ms(n, wire_bytes, alpha_us, b_mbps):
  """One ring all-reduce of wire_bytes over n hosts (item 4's alpha-beta form), ms."""
  n = np.asarray(n, dtype=float)
  return np.where(n > 1, 2 * (n - 1) * alpha_us * 1e-3 + 2 * (n - 1) / n * wire_bytes
                  / (b_mbps * 1e3), 0.0)


def predict(compute_ms, allreduce_ms, overlap_ms):
  """step = compute + max(0, all-reduce - overlap)."""
  return compute_ms + np.maximum(0.0, allreduce_ms - overlap_ms)


def _relative_lstsq(columns, target):
  """Least squares of sum(coef * column) = target relative to target, every coef >= 0 (a
  negative latency or fixed cost means nothing): the best of the column subsets whose solution
  is non-negative; the columns left out get 0."""
  import itertools  # pylint: disable=g-import-not-at-top
  a = np.stack(columns, axis=1) / target[:, None]
  best, best_err = np.zeros(len(columns)), np.inf
  for k in range(1, len(columns) + 1):
    for subset in itertools.combinations(range(len(columns)), k):
      coef = np.linalg.lstsq(a[:, subset], np.ones(len(target)), rcond=None)[0]
      err = float(np.sum((a[:, subset] @ coef - 1) ** 2))
      if np.all(coef >= 0) and err < best_err:
        best, best_err = np.zeros(len(columns)), err
        best[list(subset)] = coef
  return best


def model_table(frame, fits):
  """Per ring box: compute(N) from its compute box, then two forms of the model.
  item4: alpha, B per rate from fit.csv (fitted on all-reduces alone, N=2,4); nothing of this
         script's timings enters except compute(N) (and, for `backward`, the overlap).
  refit: step - compute = c + 2(N-1)alpha + 2(N-1)/N * S/B per rate, fitted (relative least
         squares) on this script's fp32 and bf16 boxes at N=2,4; c: a step's fixed cost of being
         in a group (its other collectives, the coordination per loop).
  cores: item4's all-reduce, compute(N) = compute(1) x max(1, N / cores) (a fair share of the
         cores) instead of the compute boxes.
  overlap: 0 for fp32 and bf16; for backward a fraction f of compute(N), one f for every model
  and rate, chosen on the N=2,4 backward boxes (grid search, least mean relative error)."""
  compute = frame[frame.variant == "compute"].set_index(["model", "n"]).step_ms
  ring = frame[frame.variant != "compute"].copy()
  ring["compute_ms"] = [compute.get((m, n), math.nan) for m, n in zip(ring.model, ring.n)]
  ring = ring[ring.compute_ms.notna()].copy()
  by_rate = fits.set_index("rate")
  ring["allreduce_item4_ms"] = [
      float(ring_ms(n, w, by_rate.alpha_us[r], by_rate.B_MBps[r])) for n, w, r in
      zip(ring.n, ring.wire_bytes, ring.rate)]
  ring["held_out"] = ring.n.isin(HELD_OUT_N)
  ring["allreduce_refit_ms"] = math.nan
  refits = []
  for rate, g in ring[ring.variant != "backward"].groupby("rate"):
    train = g[g.n.isin(FIT_N)]
    if len(train) < 3:
      continue
    x = 2 * (train.n - 1).to_numpy(float)
    y = (2 * (train.n - 1) / train.n * train.wire_bytes).to_numpy(float)
    c, a, inv_b = _relative_lstsq([np.ones(len(train)), x, y],
                                  (train.step_ms - train.compute_ms).to_numpy(float))
    refits.append({"rate": rate, "c_ms": c, "alpha_us": a * 1e3,
                   "B_MBps": 1 / inv_b / 1e3 if inv_b > 0 else math.inf,
                   "fit_points": len(train)})
    mask = ring.rate == rate
    n, w = ring.n[mask].to_numpy(float), ring.wire_bytes[mask].to_numpy(float)
    ring.loc[mask, "allreduce_refit_ms"] = c + a * 2 * (n - 1) + inv_b * 2 * (n - 1) / n * w
  backward = (ring.variant == "backward") & ring.n.isin(FIT_N)
  best_f, best_err = 0.0, math.inf
  for f in np.linspace(0, 1, 101):
    if not backward.any():
      break
    g = ring[backward]
    err = np.mean(np.abs(predict(g.compute_ms, g.allreduce_item4_ms, f * g.compute_ms)
                         - g.step_ms) / g.step_ms)
    if err < best_err:
      best_f, best_err = f, err
  ring["overlap_fraction"] = np.where(ring.variant == "backward", best_f, 0.0)
  overlap = ring.overlap_fraction * ring.compute_ms
  ring["pred_item4_ms"] = predict(ring.compute_ms, ring.allreduce_item4_ms, overlap)
  ring["pred_refit_ms"] = predict(ring.compute_ms, ring.allreduce_refit_ms, overlap)
  # cores: compute(N) not measured but N processes' fair share of the cores, compute(1) x N/cores
  ring["compute_cores_ms"] = [compute.get((m, 1), math.nan) * max(1.0, n / CORES)
                              for m, n in zip(ring.model, ring.n)]
  ring["pred_cores_ms"] = predict(ring.compute_cores_ms, ring.allreduce_item4_ms,
                                  ring.overlap_fraction * ring.compute_cores_ms)
  for form in ("item4", "refit", "cores"):
    ring[f"ape_{form}_pct"] = 100 * (ring[f"pred_{form}_ms"] - ring.step_ms).abs() / ring.step_ms
  single = compute.xs(1, level="n") if (compute.index.get_level_values("n") == 1).any() else {}
  ring["efficiency"] = [single.get(m, math.nan) / s for m, s in zip(ring.model, ring.step_ms)]
  ring["efficiency_vs_compute_n"] = ring.compute_ms / ring.step_ms
  return ring, refits


def mape_lines(ring) -> list[str]:
  lines = ["| points | n | MAPE item 4's alpha, B | MAPE refit on N=2,4 | MAPE cores |",
           "|---|---:|---:|---:|---:|"]
  groups = [("held out (N=3), all", ring.held_out), ("fit N (2, 4), all", ~ring.held_out)]
  groups += [(f"held out, {v}", ring.held_out & (ring.variant == v))
             for v in ("fp32", "bf16", "backward")]
  groups += [(f"held out, {r}", ring.held_out & (ring.rate == r)) for r in ("100mbit", "1gbit")]
  for name, mask in groups:
    g = ring[mask]
    if len(g):
      lines.append(f"| {name} | {len(g)} | {g.ape_item4_pct.mean():.1f}% | "
                   f"{g.ape_refit_pct.mean():.1f}% | {g.ape_cores_pct.mean():.1f}% |")
  return lines


def step_lines(frame, ring) -> list[str]:
  lines = ["| model | variant | link | N | step ms (hosts) | examples/s | efficiency | compute(N) ms "
           "| model ms (item 4 / refit) | tx / ring | load 1m |", "|---|---|---|---:|---|---:|---:|---:|---|---:|---:|"]
  for _, r in frame.sort_values(["model", "variant", "rate", "n"]).iterrows():
    m = ring[(ring.model == r.model) & (ring.variant == r.variant) & (ring.rate == r.rate)
             & (ring.n == r.n)]
    eff = f"{m.efficiency.iloc[0]:.2f}" if len(m) else ("1.00" if r.n == 1 else "—")
    pred = (f"{m.pred_item4_ms.iloc[0]:.0f} / {m.pred_refit_ms.iloc[0]:.0f}" if len(m) else "—")
    comp = f"{m.compute_ms.iloc[0]:.0f}" if len(m) else "—"
    rate = "none (compute)" if r.variant == "compute" else r.rate
    held = " (held out)" if r.n in HELD_OUT_N and r.variant != "compute" else ""
    lines.append(f"| {r.model} | {r.variant} | {rate} | {r.n}{held} | {r.step_ms:.0f} "
                 f"({r.step_ms_hosts}) | {r.examples_per_sec:.1f} | {eff} | {comp} | {pred} | "
                 + (f"{r.tx_over_ring:.3f}" if r.tx_over_ring == r.tx_over_ring else "—")
                 + f" | {r.load_avg_1m:.1f} |")
  return lines


def pivot_lines(frame, ring) -> list[str]:
  """Per model and N: compute alone, then each ring variant's step ms (efficiency)."""
  columns = [("fp32", "1gbit"), ("fp32", "100mbit"), ("bf16", "100mbit"), ("backward", "100mbit")]
  lines = ["| model | N | compute alone ms | " + " | ".join(f"{v} {r} ms (eff)" for v, r in columns)
           + " |", "|---|---:|---:|" + "---:|" * len(columns)]
  for model in dict.fromkeys(frame.model):
    for n in NS:
      c = frame[(frame.model == model) & (frame.variant == "compute") & (frame.n == n)]
      cells = []
      for variant, rate in columns:
        g = ring[(ring.model == model) & (ring.variant == variant) & (ring.rate == rate)
                 & (ring.n == n)]
        cells.append(f"{g.step_ms.iloc[0]:.0f} ({g.efficiency.iloc[0]:.2f})" if len(g) else "—")
      held = " (held out)" if n in HELD_OUT_N else ""
      lines.append(f"| {model} | {n}{held} | " + (f"{c.step_ms.iloc[0]:.0f}" if len(c) else "—")
                   + " | " + " | ".join(cells) + " |")
  return lines


def plot(frame, ring, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  models = list(dict.fromkeys(frame.model))
  fig, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 4.3))
  styles = {("fp32", "1gbit"): "C0", ("fp32", "100mbit"): "C1", ("bf16", "100mbit"): "C2",
            ("backward", "100mbit"): "C3"}
  for ax, model in zip(axes, models):
    c = frame[(frame.model == model) & (frame.variant == "compute")].sort_values("n")
    ax.plot(c.n, c.step_ms, "k.--", label="compute alone (N processes)")
    for (variant, rate), color in styles.items():
      g = ring[(ring.model == model) & (ring.variant == variant)
               & (ring.rate == rate)].sort_values("n")
      if g.empty:
        continue
      ax.plot(g.n, g.step_ms, "o-", color=color, label=f"{variant} {rate}")
      ax.plot(g.n, g.pred_item4_ms, "x:", color=color, alpha=0.7)
    ax.set_title(f"{model}: step time (o measured, x model with item 4's alpha, B)",
                 fontsize=9)
    ax.set_xlabel("hosts N (N=3 held out)")
    ax.set_ylabel("ms per step (slowest host)")
    ax.set_xticks(NS)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
  ax = axes[-1]
  for form, marker in (("item4", "o"), ("refit", "^")):
    for held, fill in ((False, "none"), (True, None)):
      g = ring[ring.held_out == held]
      ax.scatter(g.step_ms, g[f"pred_{form}_ms"], marker=marker,
                 facecolors=fill if fill else None, edgecolors="C0" if form == "item4" else "C1",
                 color=None if fill else ("C0" if form == "item4" else "C1"),
                 label=f"{form} {'held out N=3' if held else 'N=2,4'}")
  top = float(max(ring.step_ms.max(), ring.pred_item4_ms.max())) * 1.1
  ax.plot([0, top], [0, top], "k-", lw=0.8)
  ax.plot([0, top], [0, top * 0.85], "k:", lw=0.6)
  ax.plot([0, top], [0, top * 1.15], "k:", lw=0.6)
  ax.set_xlabel("measured step ms")
  ax.set_ylabel("model step ms")
  ax.set_title("model vs measured (dotted: +-15%)", fontsize=9)
  ax.legend(fontsize=7)
  ax.grid(True, alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)



# ---- step time on real clusters (a model, not a measurement) ------------------------------------
# Compute per step, an assumption: training FLOPs (3x forward) at 40% of an A100's 312 TFLOP/s
# bf16 peak. ResNet-50: 8.2 GFLOP forward per 224x224 image (4.1 G multiply-adds), 256 images
# per GPU; BERT-base: 6 x 110 M FLOPs per token, 64 sequences of 128 tokens per GPU.
A100_SUSTAINED = 0.4 * 312e12
COMPUTE_S = {"ResNet-50": 3 * 8.2e9 * 256 / A100_SUSTAINED,
             "BERT-base": 6 * 110e6 * 64 * 128 / A100_SUSTAINED}
BACKWARD_SHARE = 2 / 3  # of a step's compute: what all-reduce can hide behind at best


def projection_steps():
  """cluster_allreduce.projection()'s all-reduce per step, plus compute: step time and efficiency
  (compute / step) without overlap and with all-reduce hidden behind the whole backward pass."""
  proj = cluster_allreduce.projection()
  proj["compute_ms"] = [1e3 * COMPUTE_S[m] for m in proj.model]
  for topo in ("ring", "hier_8nic"):
    ar = proj[f"{topo}_ms"]
    proj[f"{topo}_step_ms"] = predict(proj.compute_ms, ar, 0.0)
    proj[f"{topo}_eff"] = proj.compute_ms / proj[f"{topo}_step_ms"]
    proj[f"{topo}_eff_overlap"] = proj.compute_ms / predict(proj.compute_ms, ar,
                                                            BACKWARD_SHARE * proj.compute_ms)
  return proj


def anchors():
  """The same formula on the set-ups of two published results (every input named in BENCHMARKS.md).
  Horovod (docs/benchmarks.rst): ResNet-101 (44.5 M params, float32 gradients), 128 hosts x 4
  Pascal GPUs, 25 Gbit/s RoCE; compute: 64 images per GPU at the doc's 16-GPU example output,
  1656.82 img/s / 16; ring of 128 hosts over one NIC each; in-host reduce left out.
  NVIDIA DeepLearningExamples TensorFlow2 BERT (DGX A100, 32 nodes, mixed precision, seq 128):
  BERT-Large (the scripts' default, 336 M params, float32 gradients assumed), 312 sequences per
  GPU per all-reduce at 32 nodes (accumulation 1); compute at the 1-node rate 3803.82 / 8
  per GPU; 8 GPUs per node over NVLink, one 200 Gbit/s NIC per GPU (hier 8 NICs)."""
  bw = cluster_allreduce.LINK_EFFICIENCY
  alpha = cluster_allreduce.ALPHA_NET
  rows = []
  compute = 64 / (1656.82 / 16)
  ar = cluster_allreduce.ring_seconds(128, 4 * 44.5e6, 25e9 / 8 * bw, alpha)
  rows.append({"anchor": "Horovod ResNet-101, 512 GPUs (128 x 4), 25 GbE", "published": 0.90,
               "compute_ms": compute * 1e3, "allreduce_ms": ar * 1e3})
  compute = 312 / (3803.82 / 8)
  size = 4 * 336e6
  ar = (2 * 7 / 8 * size / cluster_allreduce.NVLINK_BUSBW
        + cluster_allreduce.ring_seconds(32, size / 8, 200e9 / 8 * bw, alpha))
  rows.append({"anchor": "NVIDIA TF2 BERT-Large, 256 GPUs (32 x 8), 8x200 Gb/s",
               "published": 28.99 / 32, "compute_ms": compute * 1e3, "allreduce_ms": ar * 1e3})
  for r in rows:
    r["eff_no_overlap"] = r["compute_ms"] / (r["compute_ms"] + r["allreduce_ms"])
    r["eff_backward_overlap"] = r["compute_ms"] / float(predict(
        r["compute_ms"], r["allreduce_ms"], BACKWARD_SHARE * r["compute_ms"]))
  return rows


def projection_lines(proj, anchor_rows) -> list[str]:
  lines = ["| model | link | workers | compute ms | ring fp32 step ms (eff / eff overlapped) "
           "| ring bf16 | hier 8 NICs fp32 | hier 8 NICs bf16 |", "|---|---|---:|---:|---|---|---|---|"]
  for (model, link, p), g in proj.groupby(["model", "link", "workers"], sort=False):
    cells = []
    for topo in ("ring", "hier_8nic"):
      for dtype in ("float32", "bfloat16"):
        r = g[g.dtype == dtype].iloc[0]
        cells.append(f"{r[f'{topo}_step_ms']:.0f} ({r[f'{topo}_eff']:.2f} / "
                     f"{r[f'{topo}_eff_overlap']:.2f})")
    lines.append(f"| {model} | {link} | {p} | {g.compute_ms.iloc[0]:.0f} | " + " | ".join(cells)
                 + " |")
  lines += ["", "| anchor | compute ms | all-reduce ms (model) | model eff, no overlap | "
            "model eff, backward overlapped | published |", "|---|---:|---:|---:|---:|---:|"]
  for r in anchor_rows:
    lines.append(f"| {r['anchor']} | {r['compute_ms']:.0f} | {r['allreduce_ms']:.0f} | "
                 f"{r['eff_no_overlap']:.2f} | {r['eff_backward_overlap']:.2f} | "
                 f"{r['published']:.2f} |")
  return lines


def report(frame, out: str) -> None:
  import pandas as pd  # pylint: disable=g-import-not-at-top
  frame["rate"] = frame["rate"].astype(str)
  fits = pd.read_csv(os.path.join(out, "fit.csv"))
  ring, refits = model_table(frame, fits)
  ring.to_csv(os.path.join(out, "scaling_model.csv"), index=False)
  plot(frame, ring, os.path.join(out, "scaling.png"))
  proj = projection_steps()
  proj.to_csv(os.path.join(out, "scaling_projection.csv"), index=False)
  anchor_rows = anchors()
  text = ["## steps", *pivot_lines(frame, ring), "", *step_lines(frame, ring), "", "## model error", *mape_lines(ring), "",
          f"backward overlap fraction of compute(N), chosen on N=2,4: "
          f"{ring[ring.variant == 'backward'].overlap_fraction.max() if (ring.variant == 'backward').any() else float('nan'):.2f}",
          "", "refit per rate: " + "; ".join(
              f"{r['rate']}: c {r['c_ms']:.0f} ms, alpha {r['alpha_us']:.0f} us, "
              f"B {r['B_MBps']:.1f} MB/s ({r['fit_points']} points)" for r in refits),
          "", "## projection", *projection_lines(proj, anchor_rows)]
  with open(os.path.join(out, "scaling_projection.md"), "w") as f:
    f.write("\n".join(text) + "\n")
  print("\n".join(text))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(HERE, "results", "cluster"))
  for flag, text in (("--quick", "two small boxes, to check the set-up (scaling_quick.csv)"),
                     ("--replot", "model, plot and project again from scaling.csv")):
    parser.add_argument(flag, action="store_true", help=text)
  args = parser.parse_args()
  import pandas as pd  # pylint: disable=g-import-not-at-top
  csv = os.path.join(args.out, "scaling_quick.csv" if args.quick else "scaling.csv")
  # Checked before any box runs: the report after a full sweep needs item 4's fit.csv too.
  needed = {csv: "the sweep's rows: run without --replot first"} if args.replot else {}
  if not args.quick:
    needed[os.path.join(args.out, "fit.csv")] = ("the alpha-beta fit: python "
                                                 f"benchmarks/cluster_allreduce.py --out {args.out}")
  for path, what in needed.items():
    if not os.path.exists(path):
      sys.exit(f"cluster_scaling: {path} not found ({what}).")
  os.makedirs(args.out, exist_ok=True)
  read = lambda: pd.read_csv(csv, keep_default_na=False, na_values=["nan", "NaN", ""])
  if not args.replot:
    why = cluster_box.unavailable()
    if why:
      sys.exit(f"cluster_scaling: no box here: {why}")
    start = time.perf_counter()
    done = read().to_dict("records") if os.path.exists(csv) and not args.quick else []
    sweep(args.quick, lambda s: print(f"[{time.perf_counter() - start:6.0f} s] {s}", flush=True),
          done, lambda rows: pd.DataFrame(rows).to_csv(csv, index=False))  # after every box
  if args.quick:
    return
  report(read(), args.out)


if __name__ == "__main__":
  main()
