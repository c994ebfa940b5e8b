"""Accuracy curve and time-to-accuracy of a tfdp run, from its metrics.csv.

  python benchmarks/plot_metrics.py runs/cifar10_resnet benchmarks/cifar10_resnet.png
"""
import argparse
import os
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import pandas as pd  # pylint: disable=g-import-not-at-top


def summarize(metrics: pd.DataFrame, targets=(0.8, 0.9)) -> dict:
  minutes = metrics["epoch_seconds"].cumsum() / 60  # training time; evaluation excluded
  out = {"epochs": int(metrics["epoch"].iloc[-1]),
         "final_accuracy": float(metrics["eval_accuracy"].iloc[-1]),
         "best_accuracy": float(metrics["eval_accuracy"].max()),
         "train_minutes": float(minutes.iloc[-1]),
         "wall_minutes": float((metrics["wall_time"].iloc[-1] - metrics["wall_time"].iloc[0]
                                + metrics["epoch_seconds"].iloc[0]) / 60),
         "peak_rss_mb": float(metrics["peak_rss_mb"].max()) if "peak_rss_mb" in metrics else None}
  for target in targets:
    reached = metrics.index[metrics["eval_accuracy"] >= target]
    out[f"epoch_to_{target:.0%}"] = int(metrics["epoch"][reached[0]]) if len(reached) else None
    out[f"minutes_to_{target:.0%}"] = float(minutes[reached[0]]) if len(reached) else None
  return out


def main():
  parser = argparse.ArgumentParser(prog="plot_metrics", description=__doc__.splitlines()[0])
  parser.add_argument("run_dir", help="a tfdp run's --model_dir (holds metrics.csv)")
  parser.add_argument("png", help="the picture to write")
  args = parser.parse_args()  # missing arguments: argparse's usage line and exit 2
  run_dir, png = args.run_dir, args.png
  path = os.path.join(run_dir, "metrics.csv")
  try:
    metrics = pd.read_csv(path)
    missing = {"epoch", "epoch_seconds", "wall_time", "eval_accuracy", "train_accuracy"} - set(
        metrics.columns)
  except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as error:
    sys.exit(f"plot_metrics: cannot read {path}: {error}")
  if missing or metrics.empty:
    sys.exit(f"plot_metrics: {path} has no evaluated epochs (missing: "
             f"{', '.join(sorted(missing)) or 'rows'}); was the run evaluated?")
  summary = summarize(metrics)
  minutes = metrics["epoch_seconds"].cumsum() / 60
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(minutes, metrics["eval_accuracy"], marker="o", label="test accuracy")
  ax.plot(minutes, metrics["train_accuracy"], marker=".", label="train accuracy (augmented)")
  for target in (0.8, 0.9):
    ax.axhline(target, color="grey", lw=0.5, ls="--")
  ax.set_xlabel("training minutes (2 CPU cores)")
  ax.set_ylabel("accuracy")
  ax.set_title(f"{os.path.basename(run_dir.rstrip('/'))}: final {summary['final_accuracy']:.2%}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(png, dpi=100)
  for key, value in summary.items():
    print(f"{key}: {value}")


if __name__ == "__main__":
  main()
