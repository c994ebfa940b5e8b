"""What a mode's rows become: the printed table, <mode>.csv and <mode>.png (tta also
tta_targets.csv). VIEWS holds, per mode, its table's columns beside its drawing."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

from tfdp.bench.options import PROG


def _subplots(columns: int, figsize):
  from tfdp.plots import new_figure  # pylint: disable=g-import-not-at-top
  fig = new_figure(figsize=figsize)
  return fig, fig.subplots(1, columns)


def _label(row) -> str:
  who = "keras_fit" if row["strategy"] == "keras_fit" else f"{row['strategy']} x{row['replicas']}"
  return f"{row['model']} b{row['global_batch']} {who}"


def _rate_label(frame) -> str:
  """images/s, sequences/s, ...: the unit of the rows' examples (examples/s for a mix or for
  results from before the unit column)."""
  units = set(frame["unit"].dropna()) if "unit" in frame.columns else set()
  return f"{units.pop()}/s" if len(units) == 1 else "examples/s"


def _bars(ax, frame, columns: dict[str, str], xlabel: str) -> None:
  """Horizontal bars, one row of the frame per label, one bar per column (legend: its name)."""
  width = 0.8 / len(columns)
  for k, (column, name) in enumerate(columns.items()):
    # A column results from before it existed lack (mfu) draws as no bar, not a KeyError.
    values = frame[column].fillna(0) if column in frame.columns else [0.0] * len(frame)
    ax.barh([i + (k - (len(columns) - 1) / 2) * width for i in range(len(frame))],
            values, width, label=name)
  ax.set_yticks(range(len(frame)), [_label(r) for _, r in frame.iterrows()])
  ax.invert_yaxis()
  ax.set_xlabel(xlabel)
  if len(columns) > 1:
    ax.legend()


def draw_throughput(frame, targets):
  del targets
  fig, axes = _subplots(3, (16, 1.5 + 0.45 * len(frame)))
  _bars(axes[0], frame, {"examples_per_sec": _rate_label(frame)}, _rate_label(frame))
  _bars(axes[1], frame, {"input_wait_fraction": "input wait"}, "input-wait fraction")
  axes[1].set_xlim(0, 1)
  _bars(axes[2], frame, {"mfu": "MFU"}, "model-FLOPs utilization (of the devices' peak)")
  axes[2].set_yticks([])
  return fig


def draw_scaling(frame, targets):
  del targets
  fig, axes = _subplots(2, (11, 4))
  for model, group in frame.groupby("model"):
    line, = axes[0].plot(group["workers"], group["examples_per_sec"], "o-", label=model)
    axes[0].plot(group["workers"], group["workers"] * group["examples_per_sec"].iloc[0], "--",
                 color=line.get_color(), label=f"{model} linear")
    axes[1].plot(group["workers"], group["efficiency"], "o-", label=model)
  ticks = sorted(frame["workers"].unique())
  axes[0].set(xlabel="workers", ylabel=_rate_label(frame), xticks=ticks)
  axes[0].legend()
  axes[1].set(xlabel="workers", ylabel="efficiency", ylim=(0, 1.1), xticks=ticks)
  return fig


def draw_allreduce(frame, targets):
  del targets
  fig, axes = _subplots(2, (12, 4))
  sizes = frame[frame["test"] == "size"]
  if "dtype" not in sizes.columns:  # results from before the dtype column: float32 only
    sizes = sizes.assign(dtype="float32")
  # One line per scope and dtype: a bfloat16 point sits at half its float32 size's bytes.
  for (scope, dtype), group in sizes.groupby(["scope", "dtype"]):
    axes[0].plot(group["bytes"], group["busbw_gbps"], "o-", label=f"{scope} {dtype}")
  axes[0].axhline(frame.iloc[0]["tcp_gbps"], color="gray", ls="--", label="loopback TCP")
  axes[0].set(xscale="log", yscale="log", xlabel="bytes per all-reduce", ylabel="busbw (GB/s)")
  axes[0].legend()
  packs = frame[frame["test"] == "pack"]
  axes[1].bar(range(len(packs)), packs["time_us"] / 1000)
  axes[1].set_xticks(range(len(packs)), [str(int(p)) for p in packs["bytes_per_pack"]])
  axes[1].set(xlabel="bytes_per_pack (0: one pack)", ylabel="ms per all-reduce",
              title=f"{int(packs['num_tensors'].iloc[0]) if len(packs) else 0} tensors between workers")
  return fig


def draw_input(frame, targets):
  del targets
  fig, ax = _subplots(1, (10, 1.5 + 0.6 * len(frame)))
  _bars(ax, frame, {"pipeline_examples_per_sec": "input pipeline alone",
                    "train_examples_per_sec": "training loop"}, _rate_label(frame))
  return fig


def draw_tta(frame, targets):
  """`targets` are drawn as dashed lines."""
  fig, ax = _subplots(1, (9, 5))
  for run, group in frame.groupby("run", sort=False):
    how = group.iloc[0]
    ax.plot(group["seconds"], group["eval_accuracy"], "o-", label=f"{run} ({how['strategy']} "
            f"x{how['replicas']}, batch {how['global_batch']})")
  for target in targets:
    ax.axhline(target, color="gray", ls="--", lw=0.8)
  ax.set(xlabel="wall seconds since the training call started (evaluation included)",
         ylabel="eval accuracy", xlim=(0, None), ylim=(0, 1),
         title=f"{frame.iloc[0]['model']}: eval accuracy per epoch")
  ax.legend()
  return fig


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


@dataclasses.dataclass(frozen=True)
class View:
  columns: list[str]  # the printed table's
  draw: Callable  # (frame, targets) → matplotlib Figure, without its title
  # (frame, targets) → {csv file name: rows}: more tables, written and printed after the first
  more_tables: Callable[..., dict[str, list[dict]]] | None = None


VIEWS: dict[str, View] = {
    "throughput": View(["model", "strategy", "replicas", "precision", "global_batch",
                        "examples_per_sec", "unit", "step_ms", "input_wait_fraction", "vs_keras_fit",
                        "tfdp_interleaved_vs_keras_fit", "gflops_per_sec", "mfu", "peak_rss_mb"],
                       draw_throughput),
    # Strategy and replicas printed: efficiency means something only with one replica per worker.
    "scaling": View(["model", "workers", "strategy", "replicas", "per_replica_batch",
                     "global_batch", "examples_per_sec", "unit", "step_ms", "speedup",
                     "efficiency"],
                    draw_scaling),
    "allreduce": View(["scope", "test", "dtype", "n", "bytes", "bytes_per_pack", "time_us", "algbw_gbps",
                       "busbw_gbps", "busbw_over_tcp"], draw_allreduce),
    "input": View(["model", "strategy", "replicas", "global_batch", "pipeline_examples_per_sec",
                   "train_examples_per_sec", "unit", "pipeline_over_train"], draw_input),
    "tta": View(["run", "epoch", "seconds", "eval_accuracy", "train_accuracy", "strategy",
                 "replicas", "global_batch"], draw_tta,
                lambda frame, targets: {"tta_targets.csv": targets_table(frame, targets)}),
}


def figure(mode: str, frame, targets: list[float] = ()):
  """The picture of one mode's results (a frame read from <mode>.csv): a matplotlib Figure.
  tta: `targets` are drawn as dashed lines."""
  # Results written before the rename (images_per_sec) draw as they are.
  frame = frame.rename(columns={k: k.replace("images_per_sec", "examples_per_sec")
                                for k in frame.columns if "images_per_sec" in k})
  first = frame.iloc[0]
  fig = VIEWS[mode].draw(frame, targets)
  cpu = first["cpu"] + (f" ({first['cpu_family_model']}, {first['cpu_isa']})"
                        if "cpu_isa" in frame.columns else "")  # older results lack them
  fig.suptitle(f"tfdp-bench {mode}: {cpu}, {first['nproc']} CPUs, TF {first['tf_version']}, "
               f"{first['date']}", fontsize=9)
  fig.tight_layout()
  return fig


def plot(mode: str, frame, path: str, targets: list[float] = ()) -> None:
  figure(mode, frame, targets).savefig(path, dpi=100)


def write(mode: str, rows: list[dict], output_dir: str, targets: list[float]):
  """<mode>.csv, <mode>.png and the mode's further tables into output_dir; prints the tables.
  Returns the pandas DataFrame of <mode>.csv."""
  import pandas as pd  # pylint: disable=g-import-not-at-top
  view = VIEWS[mode]
  frame = pd.DataFrame(rows)
  os.makedirs(output_dir, exist_ok=True)  # another run that failed may have removed it empty
  frame.to_csv(os.path.join(output_dir, f"{mode}.csv"), index=False)
  plot(mode, frame, os.path.join(output_dir, f"{mode}.png"), targets)
  # A column no row has (the Keras baseline's, under --nobaseline) is left out of the print.
  tables, written = [frame[[c for c in view.columns if c in frame.columns]]], [f"{mode}.csv"]
  for name, more in (view.more_tables(frame, targets) if view.more_tables else {}).items():
    tables.append(pd.DataFrame(more))
    tables[-1].to_csv(os.path.join(output_dir, name), index=False)
    written.append(name)
  with pd.option_context("display.width", 200, "display.max_columns", 20):
    print("\n\n".join(t.to_string(index=False, float_format=lambda v: f"{v:.4g}") for t in tables))
  print(f"{PROG}: wrote {output_dir}/{', '.join(written)} and {mode}.png", flush=True)
  return frame
