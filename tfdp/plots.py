"""Pictures of a run: a run's metrics.csv drawn against epochs.

Figures are built with matplotlib's object API (`matplotlib.figure.Figure`), never pyplot's global
state: no GUI backend starts, nothing is left open in a long training process, and a notebook
shows the returned figure inline (Jupyter's inline backend draws any Figure an expression returns).
"""
from __future__ import annotations

import gc
import io
import os
import time

from tfdp import errors
from tfdp.errors import OutputError

METRICS_PNG = "metrics.png"
# Columns of metrics.csv that are bookkeeping, not something to look at against epochs.
_NOT_PLOTTED = {"epoch", "step", "train_steps", "wall_time", "epoch_seconds", "rss_mb", "peak_rss_mb",
                "eval_examples", "learning_rate", "examples_per_sec"}


def read_metrics(model_dir: str):
  """model_dir/metrics.csv as a pandas DataFrame, one row per epoch."""
  import pandas as pd  # pylint: disable=g-import-not-at-top
  path = os.path.join(model_dir, "metrics.csv")
  if not os.path.exists(path):
    raise OutputError(f"no metrics.csv in '{model_dir}'; train first (a run writes it after "
                      f"each epoch), or give the run's {errors.terms().model_dir}.")
  return pd.read_csv(path)


def metric_names(frame) -> list[str]:
  """The task's metrics, in column order: 'loss', 'accuracy', 'rmse', ... (train_ or eval_)."""
  names = []
  for column in frame.columns:
    for prefix in ("train_", "eval_"):
      if column.startswith(prefix) and column not in _NOT_PLOTTED:
        name = column[len(prefix):]
        if name not in names:
          names.append(name)
  return names


def new_figure(**kwargs):
  """A matplotlib Figure that draws itself as PNG wherever IPython displays it (a bare Figure
  shows as text unless pyplot's inline backend was activated first)."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  class PngFigure(Figure):

    def _repr_png_(self) -> bytes:
      buffer = io.BytesIO()
      self.savefig(buffer, format="png", dpi=100)
      return buffer.getvalue()

  return PngFigure(**kwargs)


def metrics_figure(frame, title: str = ""):
  """One panel per task metric (train and eval), then learning rate and examples/s, against
  epoch. Returns a matplotlib Figure."""
  panels = [(name, [c for c in (f"train_{name}", f"eval_{name}") if c in frame])
            for name in metric_names(frame)]
  panels += [(label, [column]) for column, label in (("learning_rate", "learning rate"),
                                                      ("examples_per_sec", "examples/s"))
             if column in frame]
  columns = 2 if len(panels) <= 4 else 3
  rows = -(-len(panels) // columns) or 1
  fig = new_figure(figsize=(4.2 * columns, 3.2 * rows), layout="constrained")
  axes = fig.subplots(rows, columns, squeeze=False).ravel()
  for ax, (label, plotted) in zip(axes, panels):
    for column in plotted:
      ax.plot(frame["epoch"], frame[column], "o-", markersize=4,
              label=column.split("_")[0] if column.startswith(("train_", "eval_")) else None)
    ax.set(xlabel="epoch", title=label)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if len(plotted) > 1:
      ax.legend()
    ax.grid(alpha=0.3)
  for ax in axes[len(panels):]:
    ax.set_visible(False)
  if title:
    fig.suptitle(title)
  return fig


def plot_metrics(model_dir: str, path: str | None = None):
  """Loss, accuracy (or the task's metrics), learning rate and examples/s against epoch, from
  model_dir/metrics.csv. Returns the Figure (shown inline in a notebook); `path` also saves it."""
  frame = read_metrics(model_dir)
  fig = metrics_figure(frame, os.path.basename(os.path.normpath(model_dir)))
  if path:
    fig.savefig(path, dpi=100)
  return fig


def write_metrics_png(model_dir: str) -> str:
  """model_dir/metrics.png from model_dir/metrics.csv, replaced atomically (a viewer never reads
  half a file). Returns its path."""
  path = os.path.join(model_dir, METRICS_PNG)
  tmp = os.path.join(model_dir, f".tmp-{os.getpid()}-{METRICS_PNG}")
  plot_metrics(model_dir, tmp)
  os.replace(tmp, path)
  # A Figure dies only in reference cycles (~12k objects and its 2 MB canvas), which CPython's
  # full collection reaches every ~10 epochs beside TensorFlow's long-lived objects: RSS crept
  # ~4.5 MB per epoch until then (BENCHMARKS.md, "The creep after epoch 2, explained").
  gc.collect()
  return path


PNG_MIN_SECONDS = 30.0
_drawn_at: dict[str, float] = {}


def redraw_metrics_png(model_dir: str, last: bool = True, epoch_seconds: float = 0.0) -> bool:
  """write_metrics_png after a run's last epoch, otherwise at most every PNG_MIN_SECONDS (a draw
  costs ~0.5 s of the training thread: 1-second epochs redrew more than they trained); a
  process's first draw counts from its first epoch's start. Returns whether it drew."""
  now = time.time()
  if not last and now - _drawn_at.get(model_dir, now - epoch_seconds) < PNG_MIN_SECONDS:
    return False
  write_metrics_png(model_dir)
  _drawn_at[model_dir] = now
  return True
