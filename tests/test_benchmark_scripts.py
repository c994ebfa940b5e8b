"""The scripts under benchmarks/ that BENCHMARKS.md and run_all.sh call: they run against the
current code, and a mistake in their arguments is one line, not a traceback."""
import json
import subprocess
import sys

import pytest

import helpers

BENCH_DIR = helpers.REPO / "benchmarks"
TINY_JOB = ("task.train_data.source=synthetic,task.train_data.image_size=8,"
            "task.train_data.num_examples=64,task.train_data.num_classes=4,"
            "task.eval_data.source=synthetic,task.eval_data.image_size=8,"
            "task.eval_data.num_examples=32,task.eval_data.num_classes=4,"
            "task.model.name=small_cnn,task.model.kwargs={filters: 8},trainer.epochs=1,"
            "trainer.global_batch_size=32,trainer.ema_decay=0.9,task.eval_flip=true,"
            "runtime.cpu_replicas=1")


def run_script(name, *args, timeout=300, cwd=None):
  return subprocess.run([sys.executable, str(BENCH_DIR / name), *args], capture_output=True,
                        text=True, timeout=timeout, env=helpers.env(), cwd=str(cwd or helpers.REPO))


def test_eval_variants_evaluates_one_state_four_ways(tmp_path):
  """It called Trainer._make_eval_loop, gone since the one compiled eval loop (99b5add):
  AttributeError after the whole training, and run_all.sh stopped there."""
  proc = run_script("eval_variants.py", f"--model_dir={tmp_path / 'run'}",
                    f"--params_override={TINY_JOB}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  found = json.loads(proc.stdout.strip().splitlines()[-1])
  for key in ("ema+flip", "ema", "weights+flip", "weights"):
    assert 0 <= found[key] <= 1, found
  assert found["eval_translate"] == 0


def test_airbench_ablation_starts_from_an_explicit_baseline_before_dirac():
  """configs/cifar10_airbench.yaml turned on dirac_init and eval_translate and grew to 16
  epochs: the script's "baseline" held both, its "dirac" run equalled it, and its warm-up was
  2.5/11 of the run (the config now warms up 2.5 of 16)."""
  import argparse  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(BENCH_DIR))
  import airbench_ablation  # pylint: disable=g-import-not-at-top
  from tfdp import config as config_lib  # pylint: disable=g-import-not-at-top
  args = argparse.Namespace(config="configs/cifar10_airbench.yaml", epochs=2, widths="16,32,64",
                            seed=42, baseline="before_dirac", only="baseline,dirac")
  common, todo = airbench_ablation.runs(args)
  assert [(name, mode) for name, _, mode in todo] == [
      ("baseline", "train_and_eval"), ("baseline+translate", "eval"), ("dirac", "train_and_eval")]
  files = [str(helpers.REPO / args.config)]
  shipped = config_lib.load_config(files)
  assert shipped.task.model.kwargs["dirac_init"] and shipped.task.eval_translate  # the case
  loaded = {name: config_lib.load_config(files, [common, extra]) for name, extra, _ in todo}
  assert [loaded[n].task.model.kwargs["dirac_init"] for n in loaded] == [False, False, True]
  assert [loaded[n].task.eval_translate for n in loaded] == [0, 1, 0]
  warmup = shipped.trainer.learning_rate.warmup_epochs * 2 / shipped.trainer.epochs
  assert loaded["baseline"].trainer.learning_rate.warmup_epochs == pytest.approx(warmup, abs=1e-3)
  as_is = airbench_ablation.runs(argparse.Namespace(**{**vars(args), "baseline": "config"}))
  assert config_lib.load_config(files, [as_is[0]]).task.model.kwargs["dirac_init"]


def test_airbench_ablation_names_an_unknown_piece_in_one_line(tmp_path):
  proc = run_script("airbench_ablation.py", f"--out={tmp_path}", "--only=diracc,baseline",
                    timeout=120)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "diracc" in lines[0] and "dirac" in lines[0]


def one_line_error(proc, *words):
  """A usage line (argparse) may come first; then one line that names the problem."""
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  lines = [l for l in proc.stderr.strip().splitlines() if not l.startswith("usage:")]
  assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr[-2000:]


def test_plot_metrics_without_arguments_or_a_run_is_one_line(tmp_path):
  one_line_error(run_script("plot_metrics.py", timeout=120), "run_dir", "png")  # was IndexError
  one_line_error(run_script("plot_metrics.py", str(tmp_path), str(tmp_path / "a.png"),
                            timeout=120), "metrics.csv")


def test_elastic_resume_help_prints_usage_and_runs_nothing(tmp_path):
  """--help was taken for OUT_DIR: the whole benchmark ran into ./--help/."""
  proc = run_script("elastic_resume.py", "--help", cwd=tmp_path, timeout=60)
  assert proc.returncode == 0 and proc.stdout.startswith("usage: elastic_resume"), proc.stderr
  assert list(tmp_path.iterdir()) == []
  one_line_error(run_script("elastic_resume.py", cwd=tmp_path, timeout=60), "OUT_DIR")


def test_cluster_scaling_replot_without_its_files_is_one_line(tmp_path):
  one_line_error(run_script("cluster_scaling.py", "--replot", "--out", str(tmp_path),
                            timeout=120), "scaling.csv", "without --replot")
  (tmp_path / "scaling.csv").write_text("model\n")
  one_line_error(run_script("cluster_scaling.py", "--replot", "--out", str(tmp_path),
                            timeout=120), "fit.csv", "cluster_allreduce.py")
