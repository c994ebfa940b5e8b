"""tfdp across separate hosts: network namespaces with their own addresses (benchmarks/cluster_box.py),
TF_CONFIG naming real host addresses, not 127.0.0.1."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import helpers

sys.path.insert(0, str(helpers.REPO / "benchmarks"))
import cluster_box  # noqa: E402  pylint: disable=wrong-import-position

pytestmark = pytest.mark.skipif(cluster_box.unavailable() is not None,
                                reason=str(cluster_box.unavailable()))

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
  workers = [f"{cluster_box.address(k)}:{port}" for k in range(count)]
  return [cluster_box.Host(command(k), rate=rate, env={
      **helpers.env(), "TF_CONFIG": json.dumps({"cluster": {"worker": workers},
                                                "task": {"type": "worker", "index": k}})})
          for k in range(count)]


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
