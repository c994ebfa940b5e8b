"""tfdp.plot_metrics draws what metrics.csv holds: the task's metrics, learning rate, rate."""
import numpy as np
import pandas as pd
import pytest

import tfdp
from tfdp import plots
from tfdp.errors import OutputError


def write_metrics(folder, metrics=("loss", "accuracy"), epochs=3, eval_every=1):
  rows = []
  for epoch in range(1, epochs + 1):
    row = {"epoch": epoch, "step": 10 * epoch, "learning_rate": 0.1 / epoch,
           "examples_per_sec": 100.0 * epoch, "epoch_seconds": 5.0, "rss_mb": 700.0,
           "peak_rss_mb": 720.0, "wall_time": 1e9 + epoch}
    for k, name in enumerate(metrics):
      row[f"train_{name}"] = 1.0 / epoch + k
      if epoch % eval_every == 0:
        row[f"eval_{name}"] = 2.0 / epoch + k
        row["eval_examples"] = 100
    rows.append(row)
  pd.DataFrame(rows).to_csv(folder / "metrics.csv", index=False)
  return pd.read_csv(folder / "metrics.csv")


def lines_by_panel(fig) -> dict:
  return {ax.get_title(): {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                           for line in ax.get_lines()}
          for ax in fig.axes if ax.get_visible()}


def test_plot_metrics_draws_each_metric_train_and_eval_against_epoch(tmp_path):
  frame = write_metrics(tmp_path)
  panels = lines_by_panel(tfdp.plot_metrics(str(tmp_path)))
  assert list(panels) == ["loss", "accuracy", "learning rate", "examples/s"]
  epochs = [1, 2, 3]
  assert panels["loss"]["train"] == (epochs, list(frame["train_loss"]))
  assert panels["accuracy"]["eval"] == (epochs, list(frame["eval_accuracy"]))
  assert np.allclose(next(iter(panels["learning rate"].values()))[1], frame["learning_rate"])
  assert np.allclose(next(iter(panels["examples/s"].values()))[1], frame["examples_per_sec"])


def test_other_tasks_get_their_own_metrics_and_missing_evaluations_are_gaps(tmp_path):
  frame = write_metrics(tmp_path, metrics=("loss", "rmse", "mae"), epochs=4, eval_every=2)
  panels = lines_by_panel(tfdp.plot_metrics(str(tmp_path)))
  assert list(panels)[:3] == ["loss", "rmse", "mae"]
  ys = panels["rmse"]["eval"][1]
  assert np.isnan(ys[0]) and ys[1] == frame["eval_rmse"][1]


def test_metrics_png_is_a_png_and_the_figure_shows_in_notebooks(tmp_path):
  write_metrics(tmp_path)
  path = plots.write_metrics_png(str(tmp_path))
  assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  assert not list(tmp_path.glob(".tmp-*"))
  assert tfdp.plot_metrics(str(tmp_path))._repr_png_().startswith(b"\x89PNG")  # IPython's hook


def test_no_metrics_csv_is_one_line_naming_the_folder(tmp_path):
  with pytest.raises(OutputError, match=f"no metrics.csv in '{tmp_path}'"):
    tfdp.plot_metrics(str(tmp_path))


def test_metrics_png_leaves_no_figure_for_the_garbage_collector(tmp_path):
  """A redrawn metrics.png left its Figure in reference cycles, freed only by CPython's rare full
  collection: RSS crept ~4.5 MB per epoch (BENCHMARKS.md, "The creep after epoch 2")."""
  import gc
  from matplotlib.figure import Figure

  def figures() -> int:
    return sum(isinstance(o, Figure) for o in gc.get_objects())

  write_metrics(tmp_path)
  plots.write_metrics_png(str(tmp_path))
  gc.disable()  # as between two of CPython's rare full collections
  try:
    before = figures()
    for _ in range(3):
      plots.write_metrics_png(str(tmp_path))
    assert figures() == before
  finally:
    gc.enable()
