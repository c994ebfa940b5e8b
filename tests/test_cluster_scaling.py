"""benchmarks/cluster_scaling.py's scale model, and the file barrier that makes N independent
tfdp-bench cells time one window (compute alone per N)."""
from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pandas as pd
import pytest

import helpers
from tfdp.bench import cells
from tfdp.bench.options import BenchError

sys.path.insert(0, str(helpers.REPO / "benchmarks"))
import cluster_scaling  # noqa: E402  pylint: disable=wrong-import-position


def test_no_cell_starts_timing_before_the_last_one_has_arrived(tmp_path):
  released = []
  waiters = [threading.Thread(target=lambda: (cells._wait_for_peers(str(tmp_path), 3),
                                              released.append(time.monotonic())))
             for _ in range(2)]
  for w in waiters:
    w.start()
  time.sleep(0.5)
  assert not released  # two of three are in: both still wait
  last_in = time.monotonic()
  cells._wait_for_peers(str(tmp_path), 3)
  for w in waiters:
    w.join(timeout=5)
  assert len(released) == 2 and min(released) >= last_in
  (tmp_path / "alone").mkdir()
  with pytest.raises(BenchError, match="2 processes were to start timing together; 1 came"):
    cells._wait_for_peers(str(tmp_path / "alone"), 2, timeout=0.2)


def synthetic_boxes(alpha_us, b_mbps, fixed_ms, overlap_fraction, item4_b_mbps):
  """Step times that follow the model exactly: compute(N) + fixed + ring(N, S), and for
  `backward` compute + max(0, ring - f * compute) with item 4's B (what the overlap is fitted on)."""
  rows = []
  compute = {1: 100.0, 2: 180.0, 3: 260.0, 4: 400.0}
  for model, grad in (("a", 1e6), ("b", 6e6)):
    for n, ms in compute.items():
      rows.append({"model": model, "variant": "compute", "rate": "unshaped", "n": n,
                   "step_ms": ms, "wire_bytes": 0.0})
    for rate in ("100mbit", "1gbit"):
      for variant, wire in (("fp32", grad), ("bf16", grad / 2), ("backward", grad)):
        for n in (2, 3, 4):
          ring = float(cluster_scaling.ring_ms(
              n, wire, alpha_us[rate], (item4_b_mbps if variant == "backward" else b_mbps)[rate]))
          step = (compute[n] + max(0.0, ring - overlap_fraction * compute[n])
                  if variant == "backward" else compute[n] + fixed_ms + ring)
          rows.append({"model": model, "variant": variant, "rate": rate, "n": n,
                       "step_ms": step, "wire_bytes": wire})
  return pd.DataFrame(rows)


def test_the_refit_recovers_alpha_bandwidth_and_fixed_cost_and_predicts_the_held_out_n():
  alpha, bw = {"100mbit": 900.0, "1gbit": 1500.0}, {"100mbit": 12.0, "1gbit": 90.0}
  item4_bw = {"100mbit": 24.0, "1gbit": 180.0}  # item 4's fit, off by 2x: its predictions miss
  frame = synthetic_boxes(alpha, bw, fixed_ms=30.0, overlap_fraction=0.3, item4_b_mbps=item4_bw)
  fits = pd.DataFrame({"rate": list(alpha), "alpha_us": list(alpha.values()),
                       "B_MBps": list(item4_bw.values())})
  ring, refits = cluster_scaling.model_table(frame, fits)
  by_rate = {r["rate"]: r for r in refits}
  for rate in alpha:
    assert by_rate[rate]["c_ms"] == pytest.approx(30.0, rel=1e-6)
    assert by_rate[rate]["alpha_us"] == pytest.approx(alpha[rate], rel=1e-6)
    assert by_rate[rate]["B_MBps"] == pytest.approx(bw[rate], rel=1e-6)
  held = ring[ring.held_out & (ring.variant != "backward")]
  assert len(held) == 8 and held.ape_refit_pct.max() < 1e-6
  assert held.ape_item4_pct.min() > 1.0
  backward = ring[ring.variant == "backward"]
  assert backward.overlap_fraction.iloc[0] == pytest.approx(0.3)
  assert backward.ape_item4_pct.max() < 1e-6  # the held-out N=3 too


def test_the_refit_never_returns_a_negative_latency_or_fixed_cost():
  # Noisy steps that fall with N (seen here: N=4 faster than N=3) pull plain least squares to a
  # negative alpha; the fit keeps every term >= 0 and drops the one that would go negative.
  x = np.array([2.0, 4.0, 6.0])
  y = np.array([1.0, 2.0, 3.0])
  target = np.array([300.0, 200.0, 150.0])
  coef = cluster_scaling._relative_lstsq([np.ones(3), x, y], target)
  assert np.all(coef >= 0) and coef[0] > 0


@pytest.mark.parametrize("variant, n", [("compute", 3), ("fp32", 2), ("bf16", 4)])
def test_every_host_of_a_box_runs_one_replica(variant, n):
  """shakespeare_mlm.yaml sets cpu_replicas: 2: bert_mlm's compute boxes ran 2 replicas x 4
  sequences per host while its N-host boxes ran 1 x 8, so compute(N) was not the ring's."""
  from tfdp import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  files, overrides = cluster_scaling.box_overrides("bert_mlm", variant, n)
  assert config_lib.load_config(files).runtime.cpu_replicas == 2  # the case under test
  config = config_lib.load_config(files, overrides)
  assert config.runtime.cpu_replicas == 1
  if variant == "compute":
    assert strategy_lib.expected_replicas(config.runtime, gpus_visible=False) == 1
    assert config.trainer.global_batch_size == 8
  else:
    assert config.runtime.strategy == "multi_worker_mirrored"
    assert config.trainer.global_batch_size == 8 * n
