"""tfdp across separate hosts: network namespaces with their own addresses (tfdp/bench/box.py),
TF_CONFIG naming real host addresses, not 127.0.0.1."""
from __future__ import annotations

import json
import math
import sys

import numpy as np
import pandas as pd
import pytest

import helpers
from tfdp import errors
from tfdp.distributed import launch

from tfdp.bench import box as cluster_box

pytestmark = [pytest.mark.skipif(cluster_box.unavailable() is not None,
                                 reason=str(cluster_box.unavailable())),
              # under `pytest -n 2 --dist loadgroup`: boxes of several hosts one at a time
              pytest.mark.xdist_group("many_processes")]

# 3 replicas either way: 3 hosts with one worker each, or one process with 3 logical CPUs.
EQUIVALENCE = ",".join([
    "task.model.name=small_cnn", "task.model.kwargs={batch_norm: false, filters: 8}",
    "task.train_data.source=synthetic", "task.train_data.num_examples=650",
    "task.train_data.image_size=8", "task.train_data.num_classes=4", "task.train_data.augment=true",
    "task.train_data.shard_policy=data",
    "trainer.global_batch_size=48", "trainer.epochs=1", "trainer.steps_per_loop=7",
    "trainer.export_model=false", "trainer.learning_rate.base_lr=0.05",
    "trainer.learning_rate.base_batch_size=48", "runtime.cpu_replicas=3",
    "runtime.intra_op_threads=1", "runtime.inter_op_threads=1",
])


def worker_hosts(count: int, command, port: int = 2222, rate: str = "") -> list:
  return [cluster_box.Host(command(k), rate=rate, env={
      **helpers.env(), "TF_CONFIG": cluster_box.tf_config(k, count, port)}) for k in range(count)]


def test_three_workers_on_three_hosts_train_as_one_process_with_three_replicas(tmp_path):
  (tmp_path / "box").mkdir()
  probe = lambda k: [sys.executable, helpers.PROBE, str(tmp_path / "run_box"), EQUIVALENCE,
                     str(tmp_path / "box"), "train"]
  result = cluster_box.Box(worker_hosts(3, probe)).run(timeout=400)
  for k, host in enumerate(result["hosts"]):
    assert host["returncode"] == 0, f"host {k}: " + host["log"][-3000:]
    assert f"worker {k} of 3 (TF_CONFIG)" in host["log"]
    assert host["tx_bytes"] > 10_000 and host["rx_bytes"] > 10_000  # they talked over the bridge
  one = helpers.run_probe(tmp_path, "one", EQUIVALENCE)
  workers = [helpers.load_probe(tmp_path / "box", k) for k in range(3)]
  assert helpers.max_relative_difference(one["final"], one["initial"]) > 0.1  # it trained
  for w in workers:
    assert all(np.array_equal(w["final"][k], workers[0]["final"][k]) for k in w["final"])
  assert helpers.max_relative_difference(workers[0]["final"], one["final"]) <= 1e-5


def test_a_host_on_a_slow_link_still_trains_and_the_ring_loads_both_links_alike(tmp_path):
  """Host 1 shaped to 10 Mbit/s, a tenth of a slow LAN: the group still finishes, and ring
  all-reduce sends as much over the slow link as over the fast one (2(N-1)/N of the gradient
  per step from each host)."""
  steps = 6
  job = EQUIVALENCE.replace("task.train_data.num_examples=650",
                            f"task.train_data.num_examples={48 * steps}")
  train = lambda k: [sys.executable, helpers.TRAIN_APP, f"--model_dir={tmp_path / 'run'}",
                     "--mode=train", f"--params_override={job},trainer.steps_per_loop=1"]
  hosts = worker_hosts(2, train)
  hosts[1].rate = "10mbit"
  result = cluster_box.Box(hosts).run(timeout=400)
  for k, host in enumerate(result["hosts"]):
    assert host["returncode"] == 0, f"host {k}: " + host["log"][-3000:]
  assert "tfdp-train: done" in result["hosts"][0]["log"]
  fast, slow = (result["hosts"][k]["tx_bytes"] for k in range(2))
  assert fast > 0 and 0.8 < slow / fast < 1.25, (fast, slow)



def test_a_link_down_mid_training_restarts_the_group_which_resumes_from_the_last_checkpoint(
    tmp_path):
  """Host 1's link goes down in epoch 2 of 3 (as soon as epoch 1's checkpoint exists) for
  longer than failure detection (runtime.collective_timeout_seconds and watchdog_seconds 4 s,
  heartbeat 5 s), then comes back. The group exits within a bound and is restarted by the box
  harness, which reruns every host's tfdp-train the way tfdp-launch --max_restarts reruns a group
  (the first failure gets the others SIGTERM, SIGKILL after PEER_FAILURE_GRACE_SECONDS, then all
  rerun with TFDP_RESTART_COUNT=1); tfdp-launch itself cannot span the hosts: it starts every
  worker on one address. The new group resumes at epoch 1's checkpoint: the planned final step,
  each epoch once in metrics.csv, no process left in the box, byte counters still read. The
  workers run with --start_over, which a restart (TFDP_RESTART_COUNT > 0) must not obey."""
  steps_per_epoch, epochs, detect, down_seconds = 80, 3, 4, 12
  total = steps_per_epoch * epochs
  job = EQUIVALENCE.replace("task.train_data.num_examples=650",
                            f"task.train_data.num_examples={48 * steps_per_epoch}").replace(
      "trainer.epochs=1", f"trainer.epochs={epochs}")
  job += (f",trainer.steps_per_loop=4,runtime.collective_timeout_seconds={detect},"
          f"runtime.watchdog_seconds={detect},runtime.heartbeat_timeout_seconds={detect + 1}")
  model_dir = tmp_path / "run"
  train = lambda k: [sys.executable, helpers.TRAIN_APP, f"--model_dir={model_dir}",
                     "--mode=train", "--start_over", f"--params_override={job}"]
  down = cluster_box.LinkDown(host=1, at=0, seconds=down_seconds,
                              after_path=str(model_dir / "checkpoints" / "checkpoint"))
  box = cluster_box.Box(worker_hosts(2, train), [down], restarts=1,
                        marks={"training": "training: steps", "resumed": "resumed from"})
  result = box.run(timeout=180)
  runs, links = result["runs"], result["links"]
  shown = json.dumps({**result, "hosts": None, "runs": [
      {**r, "logs": [log[-2500:] for log in r["logs"]]} for r in runs]}, indent=1)
  assert len(runs) == 2 and len(links) == 1, shown
  first, second, (link,) = *runs, links
  # The fault hit a training group, which noticed it and exited within the bound, retryably.
  assert all(marks["training"] < link["down"] for marks in first["marks"]), shown
  assert errors.EXIT_RESTART_GROUP in first["returncodes"], shown
  failed = first["returncodes"].index(errors.EXIT_RESTART_GROUP)
  # Either detector may see the dead link first: both wait `detect` seconds, and on a fast CPU
  # the watchdog's 4 s (its floor, above 10 short loops) can end a stuck loop before the
  # collective's timeout fails it. Both exit for a group restart, naming why.
  assert any(why in first["logs"][failed] for why in (
      "lost a peer worker", "watchdog: no training loop finished in")), shown
  exited = max(first["ended"]) - link["down"]
  assert exited <= detect + launch.PEER_FAILURE_GRACE_SECONDS + 10, shown
  # The restarted group trained again soon after the link came back, from step 80, and finished.
  training_again = max(marks.get("training", math.inf) for marks in second["marks"])
  # A restarted worker starts TensorFlow again: allow twice the first start (the load here).
  start_up = max(marks["training"] for marks in first["marks"]) - first["started"]
  assert training_again - link["down"] <= down_seconds + 2 * start_up + 20, shown
  assert link["up"] - link["down"] >= down_seconds - 0.1, shown
  assert second["returncodes"] == [0, 0], shown
  for log in second["logs"]:  # --start_over is for the first start only (TFDP_RESTART_COUNT)
    assert "--start_over ignored: this is restart 1 (TFDP_RESTART_COUNT)" in log, shown
    assert f"ckpt-{steps_per_epoch} at step {steps_per_epoch}" in log, shown
    assert f"training: steps {steps_per_epoch + 1}-{total} " in log, shown
    assert any(line.startswith("tfdp-train: done") and f" step={total}," in line
               for line in log.splitlines()), shown
  metrics = pd.read_csv(model_dir / "metrics.csv")
  assert metrics["epoch"].tolist() == list(range(1, epochs + 1)), metrics
  assert metrics["step"].tolist() == [steps_per_epoch * e for e in range(1, epochs + 1)], metrics
  assert all(run["left"] == [] for run in runs), shown
  for host in result["hosts"]:
    assert host["tx_bytes"] > 10_000 and host["rx_bytes"] > 10_000, shown
  print(f"start-up {start_up:.1f} s; link down -> first exit "
        f"{first['first_failure'] - link['down']:.1f} s, group exited {exited:.1f} s, training "
        f"again {training_again - link['down']:.1f} s ({training_again - link['up']:.1f} s after "
        "the link came back)")


def test_tfdp_bench_measures_the_ring_between_box_hosts_on_shaped_links(tmp_path):
  """`tfdp-bench --mode=allreduce --hosts=box --link_rate=100mbit`: the workers each on a host
  of their own, their links at 100 Mbit/s. A 1 MiB all-reduce cannot beat the link (busbw at
  most 12.5 MB/s; unshaped, the same runs several times faster), and the busiest host sent the
  ring's 2(N-1)/N of every all-reduce plus frame headers."""
  from test_bench import read_outputs, run_bench  # pylint: disable=g-import-not-at-top
  proc = run_bench(tmp_path, "--mode=allreduce", "--workers=2", "--hosts=box",
                   "--link_rate=100mbit", f"--min_bytes={64 << 10}", f"--max_bytes={1 << 20}",
                   "--steps=2", "--warmup_steps=1", "--repeats=1", f"--tcp_bytes={8 << 20}")
  frame = read_outputs(tmp_path, proc, "allreduce", [
      "scope", "bytes", "busbw_gbps", "hosts", "link_rate", "box_tx_bytes_max", "ring_tx_bytes",
      "tx_over_ring"])
  workers = frame[frame["scope"] == "workers"]
  assert workers["bytes"].tolist() == [64 << 10, 256 << 10, 1 << 20]
  assert (workers["hosts"] == "box").all() and (workers["link_rate"] == "100mbit").all()
  assert workers["busbw_gbps"].iloc[-1] <= 100e6 / 8 / 1e9, workers
  assert 1.0 <= workers["tx_over_ring"].iloc[0] <= 1.2, workers
  assert not frame[frame["scope"] == "in_process"].empty
