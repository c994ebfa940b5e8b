"""How the strategy and its all-reduce are chosen, for hardware this machine has and has not."""
import pytest

from tfdp import config as config_lib
from tfdp.distributed import cpus
from tfdp.distributed import strategy as strategy_lib
from tfdp.distributed.cluster import Cluster
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


def test_make_strategy_default_in_process(monkeypatch):
  monkeypatch.setattr(strategy_lib, "_MADE", [])  # this worker's later in-process runs see none
  strategy, plan = strategy_lib.make_strategy(runtime(strategy="default"))
  assert plan.kind == "default" and strategy.num_replicas_in_sync == 1
  options = strategy_lib.communication_options(runtime(bytes_per_pack=1024,
                                                       collective_timeout_seconds=30), "ring")
  assert options.bytes_per_pack == 1024 and options.timeout_seconds == 30


def test_a_default_strategy_made_earlier_claims_no_variable_and_records_nothing(monkeypatch):
  """Every variable made outside a scope is the default strategy's: a `strategy: default` made
  earlier in a notebook must not claim a model built outside the scope of the one made last
  (tfdp.fit then trains a copy in that one's scope, and says so), nor stand for the settings
  a run records."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(strategy_lib, "_MADE", [])
  default, _ = strategy_lib.make_strategy(runtime(strategy="default"), for_user=True)
  assert strategy_lib.strategy_of([tf.Variable(1.0)]) is None
  assert strategy_lib.runtime_of(default, runtime(cpu_replicas=3)) == runtime(cpu_replicas=3)
  assert strategy_lib.last_made() is default and strategy_lib.plan_of(default).kind == "default"
  strategy_lib.make_strategy(runtime(strategy="one_device"))  # a run's own (tfdp.train)
  assert strategy_lib.last_made() is default  # make_strategy() gives the user's again


def test_cpu_replicas_on_a_gpu_host_say_what_was_chosen_and_why():
  one_gpu = strategy_lib.plan_strategy(runtime(cpu_replicas=2), SINGLE, CPUS + ["/gpu:0"])
  assert one_gpu.devices == ("/gpu:0",)
  assert "cpu_replicas=2 ignored: 1 GPU(s) found" in one_gpu.reason
  assert "no GPUs" not in one_gpu.reason and "one GPU" in one_gpu.reason
  cpu_only = strategy_lib.plan_strategy(runtime(cpu_replicas=2), SINGLE, CPUS)
  assert "ignored" not in cpu_only.reason and "CPU replicas" in cpu_only.reason
  # The batch is checked against the replicas the run will really have: not 2 when GPUs may
  # replace the CPU replicas, 2 when they surely cannot.
  assert strategy_lib.expected_replicas(runtime(cpu_replicas=2), gpus_visible=True) is None
  assert strategy_lib.expected_replicas(runtime(cpu_replicas=2), gpus_visible=False) == 2
  assert not strategy_lib.gpus_may_be_visible({"CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.parametrize("devices, expected", [
    (["/gpu:0", "/gpu:1"], "hierarchical_copy"),
    (["/gpu:0", "/gpu:1", "/gpu:2"], "reduce_to_one_device"),
    (["/gpu:0", "/gpu:1", "/gpu:2", "/gpu:3"], "hierarchical_copy"),
])
def test_hierarchical_copy_needs_an_even_device_count(devices, expected):
  ops, reason = strategy_lib.choose_cross_device_ops("hierarchical_copy", devices)
  assert ops == expected
  assert ("even number of devices" in reason) == (expected != "hierarchical_copy")


def test_memory_growth_after_tensorflow_started_is_not_an_error(monkeypatch):
  tf = pytest.importorskip("tensorflow")
  calls = []

  def too_late(device, enabled):
    calls.append(device)
    raise RuntimeError("Physical devices cannot be modified after being initialized")

  monkeypatch.setattr(tf.config, "list_physical_devices",
                      lambda kind=None: ["fake-gpu"] if kind == "GPU" else [])
  monkeypatch.setattr(tf.config.experimental, "set_memory_growth", too_late)
  assert strategy_lib.configure_devices(runtime()) == 1
  assert calls == ["fake-gpu"]


PLAN = {"local_replicas": 2, "kind": "multi_worker_mirrored", "all_reduce": "nccl", "config": "ab"}


@pytest.mark.parametrize("other, field", [
    ({**PLAN, "local_replicas": 1}, "local_replicas"),
    ({**PLAN, "all_reduce": "ring"}, "all_reduce"),
    ({**PLAN, "config": "cd"}, "config"),
])
def test_workers_that_disagree_are_refused_naming_worker_and_field(other, field):
  strategy_lib.check_workers_agree([PLAN, dict(PLAN)])
  with pytest.raises(ConfigError, match=rf"worker 2 has {field}=") as error:
    strategy_lib.check_workers_agree([PLAN, dict(PLAN), other])
  assert "\n" not in str(error.value)


def test_a_field_one_worker_lacks_is_a_disagreement():
  """Seen passing silently on the old loop, which walked only the later worker's fields (a
  worker of an older tfdp sends no precision)."""
  lacking = {k: v for k, v in PLAN.items() if k != "all_reduce"}
  with pytest.raises(ConfigError, match=r"worker 1 has all_reduce=None but worker 0 has 'nccl'"):
    strategy_lib.check_workers_agree([PLAN, lacking])


def test_first_difference_is_the_first_worker_then_its_first_field():
  from tfdp.distributed import cluster as cluster_lib
  same = {"a": 1, "b": [1, 2]}
  assert cluster_lib.first_difference([same, dict(same), dict(same)]) is None
  assert cluster_lib.first_difference([same, {"a": 1, "b": [2, 1]}, {"a": 2, "b": 0}]) == (1, "b")
  assert cluster_lib.first_difference([same, {"b": [1, 2], "a": 3}]) == (1, "a")
  assert cluster_lib.first_difference([same, {"b": [1, 2]}]) == (1, "a")  # lacked
  assert cluster_lib.first_difference([same, {**same, "c": None}]) is None  # None is unset


@pytest.mark.parametrize("requested, gpus, flags, expected", [
    ("auto", [(8, 0), (8, 0)], [], "mixed_float16"),  # tensor cores on every GPU
    ("auto", [(8, 0), (6, 1)], ["avx512_bf16"], "float32"),  # one GPU without: not the CPU's
    ("auto", [], ["avx512f", "avx512_bf16"], "mixed_bfloat16"),
    ("auto", [], ["amx_bf16"], "mixed_bfloat16"),
    ("auto", [], ["avx512f", "avx2"], "float32"),
    ("float32", [(8, 0)], ["avx512_bf16"], "float32"),  # an explicit choice is kept
    ("mixed_bfloat16", [], [], "mixed_bfloat16"),
])
def test_auto_precision_by_gpu_tensor_cores_and_cpu_bfloat16(requested, gpus, flags, expected):
  policy, reason = strategy_lib.choose_precision(requested, gpus, flags)
  assert policy == expected
  assert bool(reason) == (requested == "auto")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n\nprocessor\t: 1\n")
  assert cpus.cpu_flags(str(cpuinfo), environ={}) == ["fpu", "avx512f", "avx512_bf16"]
  assert cpus.cpu_flags(str(tmp_path / "absent")) == []


@pytest.mark.parametrize("cap, expected_policy", [
    ("AVX2", "float32"), ("avx512_core", "float32"), ("AVX512_CORE_BF16", "mixed_bfloat16"),
    ("", "mixed_bfloat16")])
def test_onednn_isa_cap_imitates_a_cpu_without_its_hidden_instructions(tmp_path, cap,
                                                                       expected_policy):
  """ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN off AVX-512 and bfloat16: auto must then pick float32,
  as on an AVX2-only CPU, and the MFU peak must not count AVX-512 lanes."""
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text("flags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_bf16\n")
  flags = cpus.cpu_flags(str(cpuinfo), environ={"ONEDNN_MAX_CPU_ISA": cap})
  assert strategy_lib.choose_precision("auto", [], flags)[0] == expected_policy
  assert ("avx512f" in flags) == (cap.upper() != "AVX2")
  assert "amx_bf16" not in flags or not cap
  facts = cpus.cpu_facts(str(cpuinfo), str(tmp_path / "no_cpufreq"), usable_cpus=1,
                         environ={"ONEDNN_MAX_CPU_ISA": cap})
  assert facts.flags == frozenset(flags)  # the peak counts what the precision was chosen by


def test_explicit_bfloat16_under_a_cap_hiding_avx512_is_one_line_not_an_abort(tmp_path):
  """Under ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 CPU, mixed_bfloat16 aborted the process in its
  first matmul (oneDNN: "could not create a primitive descriptor"; seen in an AVX2-imitated CI
  run). On a GPU, without the cap, or with float32 it runs."""
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text("flags\t\t: fpu avx2 fma avx512f avx512_bf16\n")
  check = lambda requested, gpu, cap: strategy_lib.check_bfloat16_under_isa_cap(
      requested, gpu, {"ONEDNN_MAX_CPU_ISA": cap} if cap else {}, str(cpuinfo))
  with pytest.raises(ConfigError, match="ONEDNN_MAX_CPU_ISA=AVX2.*unset the cap"):
    check("mixed_bfloat16", False, "AVX2")
  for allowed in [("mixed_bfloat16", True, "AVX2"), ("mixed_bfloat16", False, ""),
                  ("mixed_bfloat16", False, "AVX512_CORE_BF16"), ("float32", False, "AVX2"),
                  ("auto", False, "AVX2")]:
    check(*allowed)


def test_workers_must_agree_on_the_decided_precision():
  plans = [strategy_lib.worker_plan(strategy_lib.StrategyPlan("multi_worker_mirrored",
                                                              precision=p), 1, "x")
           for p in ("mixed_bfloat16", "float32")]
  with pytest.raises(ConfigError, match="worker 1 has precision='float32'"):
    strategy_lib.check_workers_agree(plans)


THREADS_TWICE = """
import tensorflow as tf
from tfdp import config as config_lib
from tfdp.distributed import strategy as strategy_lib
from tfdp.errors import ConfigError
strategy_lib.configure_devices(config_lib.RuntimeConfig(intra_op_threads=1))
tf.constant(1.0) + 1.0  # TensorFlow runs: its thread pools are fixed
strategy_lib.configure_devices(config_lib.RuntimeConfig(intra_op_threads=1))  # the same: fine
try:
  strategy_lib.configure_devices(config_lib.RuntimeConfig(intra_op_threads=2))
except ConfigError as e:
  print("REFUSED", e)
strategy_lib.configure_devices(config_lib.RuntimeConfig())
"""


def test_thread_pools_set_once_are_said_not_a_bare_runtime_error():
  """A probe's second run in one process with another runtime.intra_op_threads: a bare
  RuntimeError from TensorFlow; with the default 0 afterwards it silently kept the first run's 1.
  Seen failing on the old configure_devices (the RuntimeError)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import helpers  # pylint: disable=g-import-not-at-top
  proc = subprocess.run([sys.executable, "-c", THREADS_TWICE], capture_output=True, text=True,
                        timeout=120, env=helpers.env(TF_CPP_MIN_LOG_LEVEL="3"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ("REFUSED runtime.intra_op_threads=2 must be set before TensorFlow starts, but this "
          "process already runs with 1") in proc.stdout, proc.stdout
  assert "runtime.intra_op_threads is 0 (TensorFlow's default), but this process runs with 1" \
      in proc.stderr, proc.stderr[-3000:]


def test_devices_this_process_does_not_have_are_refused():
  """A probe's runtime.devices=[/gpu:0, /gpu:1] on a CPU machine: NCCL's 'no OpKernel' blamed on
  the data; [/cpu:0, /cpu:7] with one CPU device: 'replicas=2' and trained, silently. Seen
  failing on the old plan_strategy (no error)."""
  for devices, missing in ((["/gpu:0", "/gpu:1"], "/gpu:0, /gpu:1"), (["/cpu:0", "/cpu:7"], "/cpu:7")):
    with pytest.raises(ConfigError, match=f"runtime.devices names {missing}, which this process"):
      strategy_lib.plan_strategy(runtime(strategy="mirrored", devices=devices), SINGLE, CPUS)
  spelled = ["/job:localhost/replica:0/task:0/device:GPU:1", "GPU:0"]  # TF's other spellings
  plan = strategy_lib.plan_strategy(runtime(strategy="mirrored", devices=spelled), SINGLE, GPUS)
  assert plan.devices == tuple(spelled)


def test_a_runs_multi_worker_strategy_is_the_one_a_worker_process_has(monkeypatch):
  """A review: after a tfdp.train under TF_CONFIG, make_strategy() made a second
  MultiWorkerMirroredStrategy (a second rendezvous) and tfdp.fit refused 'no tfdp strategy was
  made'. A process joins its cluster once: the run's strategy is returned. Seen failing after
  726ab4a (None)."""
  run = object()
  plan = strategy_lib.StrategyPlan("multi_worker_mirrored")
  monkeypatch.setattr(strategy_lib, "_MADE", [strategy_lib._Made(run, plan, runtime())])  # pylint: disable=protected-access
  assert strategy_lib.last_made() is run
  one = strategy_lib.StrategyPlan("one_device", ("/cpu:0",))
  monkeypatch.setattr(strategy_lib, "_MADE", [strategy_lib._Made(run, one, runtime())])  # pylint: disable=protected-access
  assert strategy_lib.last_made() is None  # a single-host run's: the user makes their own


def test_tfdp_fit_workers_with_other_keras_seeds_are_told_to_set_one_seed():
  """tfdp.fit shuffles arrays by keras.utils.set_random_seed's seed: workers that seed by rank
  would each read a share of another order (examples twice and never); the config line's fix
  ('the same config files, overrides and model_dir') was no fix for them."""
  from tfdp.compiled import fit as fit_lib  # pylint: disable=g-import-not-at-top
  from tfdp import errors  # pylint: disable=g-import-not-at-top
  plans = [strategy_lib.worker_plan(strategy_lib.StrategyPlan("multi_worker_mirrored"), 1,
                                    {"trainer.seed": str(seed), "--model_dir": "runs/x"})
           for seed in (0, 1)]
  with errors.speaking_as(fit_lib.terms()):
    with pytest.raises(ConfigError, match=r"^workers disagree before training on their config: "
                       r"worker 1 has trainer.seed=1 \(worker 0: 0\); set one "
                       r"keras.utils.set_random_seed on every worker"):
      strategy_lib.check_workers_agree(plans)
  with pytest.raises(ConfigError, match="the same config files, overrides"):  # tfdp-train
    strategy_lib.check_workers_agree(plans)
