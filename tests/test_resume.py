"""Resuming: what a continuation may change (the run record beside the checkpoints), which
checkpoint is good after a divergence, and a restarted group that resumes despite --start_over.
The refused resumes are rows of tests/test_hardening.py's table."""
from __future__ import annotations

import json
from pathlib import Path

import helpers
from test_hardening import TINY

CONSTANT = f"{TINY},trainer.learning_rate.schedule=constant"


def record(model_dir: Path) -> dict:
  return json.loads((model_dir / "checkpoints" / "run.json").read_text())


def test_more_epochs_on_another_replica_count_continue_and_a_run_without_record_resumes(tmp_path):
  model_dir = tmp_path / "run"
  first = helpers.run_train(f"--model_dir={model_dir}", "--mode=train",
                            f"--params_override={CONSTANT},trainer.epochs=1", timeout=300)
  assert first.returncode == 0, first.stderr[-3000:]
  assert record(model_dir)["history"] == [{"from_step": 0, "workers": 1, "replicas": 2}]
  assert record(model_dir)["global_batch_size"] == 16 and record(model_dir)["steps_per_epoch"] == 4
  # A constant schedule does not depend on the run's length, and one replica takes the same
  # global batch in the same steps: a continuation, the group's size kept in the history.
  longer = helpers.run_train(f"--model_dir={model_dir}", "--mode=train",
                             f"--params_override={CONSTANT},trainer.epochs=2,runtime.cpu_replicas=1",
                             timeout=300)
  assert longer.returncode == 0, longer.stderr[-3000:]
  assert "resumed from" in longer.stderr and (model_dir / "checkpoints" / "ckpt-8.index").exists()
  assert record(model_dir)["history"] == [{"from_step": 0, "workers": 1, "replicas": 2},
                                          {"from_step": 4, "workers": 1, "replicas": 1}]
  assert record(model_dir)["total_steps"] == 8
  # A run from before run records: resumed, and its record written from then on.
  (model_dir / "checkpoints" / "run.json").unlink()
  legacy = helpers.run_train(f"--model_dir={model_dir}", "--mode=train",
                             f"--params_override={CONSTANT},trainer.epochs=3", timeout=300)
  assert legacy.returncode == 0, legacy.stderr[-3000:]
  assert (model_dir / "checkpoints" / "ckpt-12.index").exists()
  assert record(model_dir)["history"] == [{"from_step": 8, "workers": 1, "replicas": 2}]
