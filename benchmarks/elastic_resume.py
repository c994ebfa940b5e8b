"""Elastic resume, 4 -> 2 -> 4 workers, against the uninterrupted 4-worker run: the training loss
after each loop of both, side by side, and the seconds from a stop to training again.

  python benchmarks/elastic_resume.py OUT_DIR

Every run goes through tfdp-launch on loopback (CPU workers). A leg stops cleanly at
trainer.max_steps (constant schedule: the length does not change the learning rate), the next
leg resumes from its checkpoint. "stop -> training again": from the previous leg's launcher
exit to the first loop's progress line of the next (process start, group formation, restore,
tracing and one loop of `steps_per_loop` steps).
"""
import argparse
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ",".join([
    "task.model.name=small_cnn", "task.model.kwargs={batch_norm: false, filters: 8}",
    "task.train_data.source=synthetic", "task.train_data.num_examples=1280",
    "task.train_data.image_size=16", "task.train_data.num_classes=10",
    "task.train_data.shard_policy=data", "trainer.global_batch_size=64", "trainer.epochs=3",
    "trainer.steps_per_loop=5", "trainer.export_model=false",
    "trainer.learning_rate.schedule=constant", "trainer.learning_rate.base_lr=0.05",
    "trainer.learning_rate.base_batch_size=64", "trainer.learning_rate.warmup_epochs=0",
    "runtime.strategy=auto", "runtime.intra_op_threads=1", "runtime.inter_op_threads=1",
])
LEGS = [(4, 25), (2, 45), (4, 60)]  # (workers, stop at step): mid-epoch changes (20 steps/epoch)
LINE = re.compile(r"step (\d+)/\d+ loss ([0-9.]+)")


def leg(model_dir: str, workers: int, steps: int) -> tuple[dict, float, float, str]:
  """Runs one leg; returns ({step: loss}, seconds to its first loop line, its exit time, the
  start-up line of a resume)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO)
  command = [sys.executable, os.path.join(REPO, "apps", "launch.py"), f"--num_workers={workers}",
             "--", sys.executable, os.path.join(REPO, "apps", "train.py"),
             f"--model_dir={model_dir}", "--mode=train",
             f"--params_override={JOB},trainer.max_steps={steps}"]
  start, first, losses, resumed = time.monotonic(), None, {}, ""
  proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  for text in proc.stdout:
    match = LINE.search(text)
    if match:
      first = first or time.monotonic() - start
      losses[int(match.group(1))] = float(match.group(2))
    if "resumed at step" in text:
      resumed = text[text.index("resumed at step"):].strip()
  if proc.wait():
    raise SystemExit(f"leg on {workers} workers failed ({proc.returncode})")
  return losses, first, time.monotonic(), resumed


def main():
  parser = argparse.ArgumentParser(prog="elastic_resume", description="Elastic resume 4 -> 2 -> 4 workers against an uninterrupted 4-worker run.")
  parser.add_argument("out_dir", metavar="OUT_DIR", help="where the runs' model dirs go")
  out = parser.parse_args().out_dir  # --help or no OUT_DIR: usage, nothing runs
  if os.path.exists(os.path.join(out, "uninterrupted")) or os.path.exists(
      os.path.join(out, "elastic")):  # a run there would resume instead of starting at step 0
    sys.exit(f"elastic_resume: {out} holds an earlier run (uninterrupted/ or elastic/); "
             "give a new OUT_DIR.")
  reference, _, _, _ = leg(os.path.join(out, "uninterrupted"), 4, LEGS[-1][1])
  elastic, notes, stopped = {}, [], None
  for workers, steps in LEGS:
    began = time.monotonic()
    losses, first, stopped_now, resumed = leg(os.path.join(out, "elastic"), workers, steps)
    elastic.update(losses)
    if stopped is not None:
      notes.append(f"{resumed}: {began - stopped + first:.1f} s from stop to the first loop line")
    stopped = stopped_now
  print("| step | uninterrupted (4 workers) loss | 4 → 2 → 4 loss | workers |")
  print("|---:|---:|---:|---:|")
  for step in sorted(reference):
    workers = next(w for w, s in LEGS if step <= s)
    print(f"| {step} | {reference[step]:.4f} | {elastic.get(step, float('nan')):.4f} | {workers} |")
  for note in notes:
    print(f"- {note}")


if __name__ == "__main__":
  main()
