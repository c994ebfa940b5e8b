"""Elastic resume keeps the run's numerics: runtime.mixed_precision and runtime.all_reduce_dtype
are recorded in run.json, a resume on another replica count computes in them, and a resume
config that would switch them (an override left off the resume command) is refused in one
line naming the keys, before anything in model_dir changes."""
from __future__ import annotations

import subprocess
import sys

import helpers
from test_elastic import job, probe, record

BF16 = ",runtime.mixed_precision=mixed_bfloat16,runtime.all_reduce_dtype=bfloat16"
# bfloat16 keeps 8 significant bits (unit round-off 2**-8 = 0.0039). 4 replicas and 2 replicas x
# 2 accumulation steps round the gradients at other points (each replica's gradient is cast
# before the sum; two micro-steps are summed in float32 first), so the two runs part by one or two
# bfloat16 round-offs of the largest weight, not by float32's (with a float32 all-reduce they are
# bit-equal). Measured: 0.0025 on the AVX512-BF16 EPYC, 0.0062 on the AVX2-only one (bfloat16
# emulated). Either setting dropped moves the run further: 0.017 / 0.035 there (float32 all-reduce
# / all float32), 0.037 / 0.054 here. 0.01 sits between the two groups on both CPUs.
BF16_TOLERANCE = 1e-2


def side_by_side(*legs) -> list[dict]:
  """tests/scripts/probe.py for each (model_dir, overrides, out_dir) at once, one process each
  (the uninterrupted run and the stopped one need not wait for each other: two cores)."""
  procs = []
  for model_dir, overrides, out_dir in legs:
    out_dir.mkdir(parents=True)
    procs.append(subprocess.Popen(
        [sys.executable, helpers.PROBE, str(model_dir), overrides, str(out_dir), "train"],
        env=helpers.env(**helpers.UNCAPPED), cwd=str(helpers.REPO), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True))
  for proc in procs:
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
  return [helpers.load_probe(out_dir) for _, _, out_dir in legs]


def tree(model_dir) -> dict:
  return {str(p.relative_to(model_dir)): p.read_bytes() for p in sorted(model_dir.rglob("*"))
          if p.is_file() and p.name != ".lock"}


def test_bfloat16_settings_survive_four_replicas_to_two_and_a_silent_switch_is_refused(tmp_path):
  model_dir = tmp_path / "run"
  uninterrupted, stopped = side_by_side((tmp_path / "whole", job(4, 12) + BF16, tmp_path / "w"),
                                        (model_dir, job(4, 6) + BF16, tmp_path / "first"))
  assert stopped["info"]["step"] == 6
  kept = record(model_dir)
  assert (kept["precision"], kept["all_reduce_dtype"]) == ("mixed_bfloat16", "bfloat16")

  # The resume command without the first one's overrides: float32 both, refused in one line.
  before = tree(model_dir)
  refused = helpers.run_train(f"--model_dir={model_dir}", "--mode=train",
                              f"--params_override={job(2, 12)}", timeout=300)
  assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
  (line,) = helpers.error_lines(refused)
  assert ("this config would resume in another precision: runtime.mixed_precision was "
          "mixed_bfloat16, now float32; runtime.all_reduce_dtype was bfloat16, now float32"
          in line), line
  assert "set runtime.mixed_precision=mixed_bfloat16 and runtime.all_reduce_dtype=bfloat16" in line
  assert tree(model_dir) == before

  resumed, output = probe(model_dir, job(2, 12) + BF16, tmp_path / "out", **helpers.UNCAPPED)
  assert resumed["info"]["step"] == 12
  assert ("resumed at step 6 on 2 replicas (was 4): accumulation 1 → 2, per-replica batch 4, "
          "global batch 16 kept") in output, output[-3000:]
  kept = record(model_dir)  # rewritten by the resumed run: what it computed in
  assert (kept["precision"], kept["all_reduce_dtype"]) == ("mixed_bfloat16", "bfloat16")
  assert [h["replicas"] for h in kept["history"]] == [4, 2]
  assert helpers.max_relative_difference(resumed["final"], uninterrupted["initial"]) > 0.05
  difference = helpers.max_relative_difference(resumed["final"], uninterrupted["final"])
  assert difference <= BF16_TOLERANCE, difference
