"""The scripts under benchmarks/ that BENCHMARKS.md and run_all.sh call: they run against the
current code, and a mistake in their arguments is one line, not a traceback."""
import json
import subprocess
import sys

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
