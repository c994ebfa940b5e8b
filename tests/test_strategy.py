"""How the strategy and its all-reduce are chosen, for hardware this machine has and has not."""
import pytest

from tfdp import config as config_lib
from tfdp import strategy as strategy_lib
from tfdp.cluster import Cluster
from tfdp.errors import ConfigError

SINGLE = Cluster()
TWO_WORKERS = Cluster("worker", 0, {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "TF_CONFIG")
GPUS = ["/cpu:0", "/gpu:0", "/gpu:1"]
CPUS = ["/cpu:0", "/cpu:1"]


def runtime(**kw):
  return config_lib.RuntimeConfig(**kw)


def test_auto_picks_by_cluster_and_devices():
  assert strategy_lib.plan_strategy(runtime(), SINGLE, ["/cpu:0"]).kind == "default"
  assert strategy_lib.plan_strategy(runtime(cpu_replicas=2), SINGLE, CPUS).kind == "mirrored"
  assert strategy_lib.plan_strategy(runtime(), SINGLE, GPUS).devices == ("/gpu:0", "/gpu:1")
  assert strategy_lib.plan_strategy(runtime(), TWO_WORKERS, ["/cpu:0"]).kind == "multi_worker_mirrored"


def test_nccl_only_on_gpus():
  gpu_plan = strategy_lib.plan_strategy(runtime(strategy="mirrored"), SINGLE, GPUS)
  assert (gpu_plan.cross_device_ops, gpu_plan.reason) == ("nccl", "")
  cpu_plan = strategy_lib.plan_strategy(runtime(strategy="mirrored", cross_device_ops="nccl"),
                                        SINGLE, CPUS)
  assert cpu_plan.cross_device_ops == "reduce_to_one_device"
  assert "nccl" in cpu_plan.reason and "GPU" in cpu_plan.reason
  explicit = strategy_lib.plan_strategy(
      runtime(strategy="mirrored", cross_device_ops="hierarchical_copy"), SINGLE, GPUS)
  assert explicit.cross_device_ops == "hierarchical_copy"


def test_multi_worker_collective_implementation():
  assert strategy_lib.choose_all_reduce("auto", 0) == ("ring", "")
  assert strategy_lib.choose_all_reduce("auto", 4) == ("nccl", "")
  impl, reason = strategy_lib.choose_all_reduce("nccl", 0)
  assert impl == "ring" and "GPU" in reason


def test_single_host_strategy_with_a_multi_worker_cluster_is_refused():
  with pytest.raises(ConfigError, match="multi_worker_mirrored"):
    strategy_lib.plan_strategy(runtime(strategy="mirrored"), TWO_WORKERS, CPUS)


def test_make_strategy_default_in_process():
  strategy, plan = strategy_lib.make_strategy(runtime(strategy="default"))
  assert plan.kind == "default" and strategy.num_replicas_in_sync == 1
  options = strategy_lib.communication_options(runtime(bytes_per_pack=1024,
                                                       collective_timeout_seconds=30), "ring")
  assert options.bytes_per_pack == 1024 and options.timeout_seconds == 30
