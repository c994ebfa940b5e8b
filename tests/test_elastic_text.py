"""Elastic resume of the masked-LM task: the masking is a function of (seed, epoch, example), so
a run stopped on 2 replicas and resumed on 1 (accumulation 2) masks and trains on the same
tokens in every step as one never stopped. (Two replicas, not four: a BERT's tracing grows with
the replicas, and the rule is the same.)"""
from __future__ import annotations

import numpy as np

import helpers
from test_elastic import probe, record
from test_elastic_precision import side_by_side
from test_text_tasks import mlm_overrides, write_corpus


def job(corpus, replicas: int, steps: int) -> str:
  # A constant schedule: the stopped leg's shorter max_steps does not reshape it.
  return mlm_overrides(corpus, f",trainer.learning_rate.schedule=constant,"
                               f"trainer.learning_rate.warmup_epochs=0,trainer.epochs=4,"
                               f"trainer.steps_per_loop=3,runtime.strategy=mirrored,"
                               f"runtime.cpu_replicas={replicas},trainer.max_steps={steps}")


def test_masked_lm_stopped_on_two_replicas_resumes_on_one_as_if_never_stopped(tmp_path):
  corpus = write_corpus(tmp_path / "corpus", documents_per_class=4)
  model_dir = tmp_path / "run"
  whole, _ = side_by_side((tmp_path / "whole", job(corpus, 2, 6), tmp_path / "w"),
                         (model_dir, job(corpus, 2, 3), tmp_path / "first"))
  resumed, output = probe(model_dir, job(corpus, 1, 6), tmp_path / "out")
  assert resumed["info"]["step"] == 6
  assert ("resumed at step 3 on 1 replica (was 2): accumulation 1 → 2, per-replica batch 8, "
          "global batch 16 kept") in output, output[-3000:]
  assert [h["replicas"] for h in record(model_dir)["history"]] == [2, 1]
  assert record(model_dir)["steps_per_epoch"] > 3  # stopped in the middle of an epoch
  # As in test_text_tasks: the attention key bias (an exactly zero gradient) and the pooler
  # (none in masked-LM training) move by round-off only; a relative measure of them means nothing.
  moved = {k for k in whole["final"]
           if np.abs(whole["final"][k] - whole["initial"][k]).max() > 1e-6}
  assert len(moved) > len(whole["final"]) - 4
  assert helpers.max_relative_difference({k: resumed["final"][k] for k in moved},
                                         {k: whole["final"][k] for k in moved}) <= 1e-5
  assert max(np.abs(resumed["final"][k] - whole["final"][k]).max()
             for k in whole["final"] if k not in moved) <= 1e-8
