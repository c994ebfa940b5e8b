"""Elastic resume of the masked-LM task: the masking is a function of (seed, epoch, example), so
a run whose replica count changes at every stop — 2 → 1 → 3, the last one an uneven split of the
global batch 16 (6, 5, 5 rows) — masks and trains on the same tokens in every step as one never
stopped on 2 replicas."""
from __future__ import annotations

import re

import numpy as np

import helpers
from test_elastic import probe, record
from test_elastic_precision import side_by_side
from test_text_tasks import mlm_overrides, write_corpus

# (replicas, last step) of each leg; every leg after the first resumes the one before it. With
# 4 steps an epoch the stops fall inside an epoch (2) and at its end (4). A 4-replica leg after
# the first (2 -> 4 -> 1 -> 3 before) cost ~25 CPU s of tracing for cases these legs hold: a
# resume inside an epoch, a larger replica count, an uneven split.
LEGS = [(2, 2), (1, 4), (3, 8)]


def job(corpus, replicas: int, steps: int) -> str:
  # A constant schedule: a leg's shorter max_steps does not reshape it.
  return mlm_overrides(corpus, f",trainer.learning_rate.schedule=constant,"
                               f"trainer.learning_rate.warmup_epochs=0,trainer.epochs=4,"
                               f"trainer.steps_per_loop=2,runtime.strategy=mirrored,"
                               f"runtime.cpu_replicas={replicas},trainer.max_steps={steps}")


def test_masked_lm_resumed_on_one_and_three_replicas_equals_one_never_stopped(tmp_path):
  corpus = write_corpus(tmp_path / "corpus", documents_per_class=4)
  model_dir = tmp_path / "run"
  (first_replicas, first_steps), total = LEGS[0], LEGS[-1][1]
  whole, _ = side_by_side((tmp_path / "whole", job(corpus, 2, total), tmp_path / "w"),
                          (model_dir, job(corpus, first_replicas, first_steps), tmp_path / "l0"))
  for leg, ((was, start), (replicas, steps)) in enumerate(zip(LEGS, LEGS[1:]), 1):
    resumed, output = probe(model_dir, job(corpus, replicas, steps), tmp_path / f"l{leg}")
    assert resumed["info"]["step"] == steps
    plural = "replica" if replicas == 1 else "replicas"
    line = re.search(rf"^resumed at step {start} on {replicas} {plural} \(was {was}\): (.*)$",
                     output, re.MULTILINE)
    assert line and line.group(1).endswith("global batch 16 kept"), output[-3000:]
  assert [(h["from_step"], h["replicas"]) for h in record(model_dir)["history"]] == [
      (0, 2), (2, 1), (4, 3)]
  steps_per_epoch = record(model_dir)["steps_per_epoch"]
  assert 2 < steps_per_epoch < total  # the changes fall inside epochs and across an epoch's end
  # As in test_text_tasks: the attention key bias (an exactly zero gradient) and the pooler
  # (none in masked-LM training) move by round-off only; a relative measure of them means nothing.
  moved = {k for k in whole["final"]
           if np.abs(whole["final"][k] - whole["initial"][k]).max() > 1e-6}
  assert len(moved) > len(whole["final"]) - 4
  assert helpers.max_relative_difference({k: resumed["final"][k] for k in moved},
                                         {k: whole["final"][k] for k in moved}) <= 1e-5
  assert max(np.abs(resumed["final"][k] - whole["final"][k]).max()
             for k in whole["final"] if k not in moved) <= 1e-8
