"""What each airbench piece ported to tfdp adds, at a fixed number of epochs (accuracy does not
depend on the machine's load; time does): configs/cifar10_airbench.yaml at a narrower width and
fewer epochs, baseline, + each piece, all; translate test-time augmentation is evaluated on the
baseline's and on all's final checkpoints (--mode=eval), no training of its own.

The baseline is explicit (--baseline=before_dirac, the default): the config with Dirac
initialization and translate evaluation off, as BENCHMARKS.md's ablation ran it before the
config turned both on (else "baseline" would hold them and "dirac" would equal it).
--baseline=config keeps the config as it is (the default job's rows).

  nice -n 10 python benchmarks/airbench_ablation.py --out=/tmp/ablation [--epochs=3]
      [--widths=32,64,128] [--seed=42] [--only=baseline,lookahead]
  python benchmarks/airbench_ablation.py --out=/tmp/quick --config=configs/cifar10_quick.yaml \
      --epochs=0 --widths= --baseline=config --only=baseline,fixed_scale  # the default job as it is

Prints and appends to OUT/results.jsonl one JSON line per run: name, eval accuracy, seconds.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PROG = "airbench_ablation"
# The pieces below start from this: the config's own Dirac init and translate evaluation off.
BEFORE_DIRAC = "task.model.kwargs.dirac_init=false,task.eval_translate=0"

from tfdp.errors import TfdpError  # pylint: disable=g-import-not-at-top,wrong-import-position
PIECES = {
    "baseline": "",
    "lookahead": "trainer.lookahead_every_steps=5",
    "bias64": "trainer.optimizer.norm_bias_lr_multiplier=64",
    "dirac": "task.model.kwargs.dirac_init=true",
}
PIECES["all"] = ",".join(v for v in PIECES.values() if v)
# airbench's BatchNorm: scale fixed at 1, alone and with the pieces that may need it
PIECES["fixed_scale"] = "task.model.kwargs.batchnorm_scale=false"
PIECES["fixed_scale_bias64"] = f"{PIECES['fixed_scale']},{PIECES['bias64']}"
PIECES["fixed_scale_lookahead"] = f"{PIECES['fixed_scale']},{PIECES['lookahead']}"
PIECES["torch_init"] = "task.model.kwargs.torch_default_init=true"  # PyTorch's initialization
PIECES["torch_init_fixed_scale"] = f"{PIECES['torch_init']},{PIECES['fixed_scale']}"
PIECES["alternating_flip"] = "task.train_data.flip=alternating"


def train(out, name, config, common, extra, mode="train_and_eval"):
  overrides = ",".join(x for x in (common, extra) if x)
  cmd = [sys.executable, os.path.join(REPO, "apps", "train.py"),
         f"--config_file={os.path.join(REPO, config)}",
         f"--model_dir={os.path.join(out, name.split('+')[0])}", f"--mode={mode}",
         f"--params_override={overrides}"]
  start = time.time()
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
  done = [l for l in proc.stderr.splitlines() + proc.stdout.splitlines() if "done:" in l]
  if proc.returncode or not done:
    raise SystemExit(f"{name} failed: {proc.stderr[-2000:]}")
  accuracy = float(re.search(r"eval_accuracy=([\d.]+)", done[-1]).group(1))
  row = {"name": name, "eval_accuracy": accuracy, "seconds": round(time.time() - start, 1),
         "mode": mode, "overrides": overrides}
  print(json.dumps(row), flush=True)
  with open(os.path.join(out, "results.jsonl"), "a") as f:
    f.write(json.dumps(row) + "\n")


def runs(args) -> tuple[str, list[tuple[str, str, str]]]:
  """(overrides common to every run, [(name, the run's own overrides, mode)]), checked first."""
  from tfdp import config as config_lib  # pylint: disable=g-import-not-at-top
  names = [n for n in args.only.split(",") if n]
  unknown = [n for n in names if n not in PIECES]
  if unknown or not names:
    sys.exit(f"{PROG}: --only '{args.only}' names no piece or an unknown one; use some of "
             f"{','.join(PIECES)}.")
  common = [f"trainer.seed={args.seed}", "trainer.export_model=false", "runtime.watchdog_seconds=0"]
  if args.baseline == "before_dirac":
    common.append(BEFORE_DIRAC)
  if args.widths:
    common.append(f"task.model.kwargs.widths=[{args.widths}]")
  if args.epochs:  # the config's warmup kept as the same fraction of the shorter run
    config = config_lib.load_config([os.path.join(REPO, args.config)])
    warmup = config.trainer.learning_rate.warmup_epochs * args.epochs / config.trainer.epochs
    common += [f"trainer.epochs={args.epochs}", f"trainer.eval_every_epochs={args.epochs}",
               f"trainer.learning_rate.warmup_epochs={warmup:.3f}"]
  todo = []
  for name in names:
    todo.append((name, PIECES[name], "train_and_eval"))
    if name in ("baseline", "all"):  # the same checkpoint, evaluated with translate TTA too
      todo.append((name + "+translate", f"{PIECES[name]},task.eval_translate=1".strip(","), "eval"))
  return ",".join(common), todo


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--config", default="configs/cifar10_airbench.yaml")
  parser.add_argument("--epochs", type=int, default=3, help="0: the config's (and its warmup)")
  parser.add_argument("--widths", default="32,64,128", help="empty: the config's")
  parser.add_argument("--seed", type=int, default=42)
  parser.add_argument("--baseline", choices=("before_dirac", "config"), default="before_dirac",
                      help="before_dirac: the config with dirac_init and eval_translate off; "
                           "config: the config as it is")
  parser.add_argument("--only", default=",".join(PIECES))
  args = parser.parse_args()
  try:
    common, todo = runs(args)
  except (TfdpError, OSError) as error:  # a bad --config or override: one line
    sys.exit(f"{PROG}: {error}")
  os.makedirs(args.out, exist_ok=True)
  for name, extra, mode in todo:
    train(args.out, name, args.config, common, extra, mode=mode)


if __name__ == "__main__":
  main()
