"""One function turns the runtime config (and the cluster) into a tf.distribute strategy.

Choices are made by pure functions (`choose_*`) so they can be tested without the hardware they
choose for; `make_strategy` only carries them out.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Sequence

from absl import logging

from tfdp.distributed import cluster as cluster_lib
from tfdp.distributed.cluster import Cluster
from tfdp.config.schema import RuntimeConfig
from tfdp.distributed import compat
from tfdp.distributed import cpus
from tfdp.distributed import gpus
from tfdp.distributed import rendezvous
from tfdp.distributed import startup
from tfdp import errors
from tfdp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class StrategyPlan:
  kind: str  # default | one_device | mirrored | multi_worker_mirrored
  devices: tuple[str, ...] = ()
  cross_device_ops: str = ""  # mirrored: nccl | hierarchical_copy | reduce_to_one_device
  all_reduce: str = ""  # multi_worker_mirrored: ring | nccl | auto
  reason: str = ""  # why a fallback was taken, logged once
  precision: str = "float32"  # the Keras dtype policy decided for runtime.mixed_precision
  precision_reason: str = ""  # why, when runtime.mixed_precision is auto


def choose_strategy_kind(runtime: RuntimeConfig, cluster: Cluster, num_gpus: int) -> str:
  """`auto`: several workers → multi-worker; several local devices → mirrored; else default."""
  kind = runtime.strategy
  if kind == "auto":
    if cluster.is_multi_worker:
      return "multi_worker_mirrored"
    if runtime.cpu_replicas > 1 or len(runtime.devices) > 1 or num_gpus > 1:
      return "mirrored"
    return "default"
  if cluster.is_multi_worker and kind != "multi_worker_mirrored":
    raise ConfigError(f"TF_CONFIG describes {cluster.num_workers} workers but runtime.strategy is "
                      f"'{kind}'; use runtime.strategy=multi_worker_mirrored (or auto).")
  return kind


def choose_cross_device_ops(requested: str, devices: Sequence[str]) -> tuple[str, str]:
  """Returns (ops, reason). NCCL needs GPUs on every replica; else fall back and say why."""
  all_gpu = bool(devices) and all("gpu" in d.lower() for d in devices)
  if requested == "auto":
    if all_gpu and len(devices) > 1:
      return "nccl", ""
    if all_gpu:
      return "reduce_to_one_device", "one GPU: nothing to all-reduce between devices"
    return "reduce_to_one_device", "CPU replicas: NCCL needs GPUs, so they reduce on one device"
  if requested == "nccl" and not all_gpu:
    return "reduce_to_one_device", "runtime.cross_device_ops=nccl asked for, but the replicas are " \
        "not all GPUs; falling back to reduce_to_one_device"
  if requested == "hierarchical_copy" and len(devices) % 2:
    # TF splits the devices into two halves of len // 2 (a DGX-1 layout): with an odd count the
    # last device's gradient is never summed (cross_device_utils.aggregate_gradients_using_
    # hierarchical_copy). Shown on logical CPUs in tests/test_strategy.py.
    return "reduce_to_one_device", f"runtime.cross_device_ops=hierarchical_copy needs an even " \
        f"number of devices, got {len(devices)} (TF would drop one replica's gradient); " \
        "falling back to reduce_to_one_device"
  return requested, ""


def choose_all_reduce(requested: str, num_gpus_per_worker: int) -> tuple[str, str]:
  """Collective implementation for multi-worker: NCCL only with GPUs, ring over gRPC otherwise."""
  if requested == "nccl" and num_gpus_per_worker == 0:
    return "ring", "runtime.all_reduce=nccl asked for without GPUs; using ring"
  if requested == "auto":
    return ("nccl" if num_gpus_per_worker else "ring"), ""
  return requested, ""


NATIVE_BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def choose_precision(requested: str, gpu_compute_capabilities: Sequence[tuple[int, int]],
                     cpu_flags: Sequence[str]) -> tuple[str, str]:
  """Returns (policy, reason). `auto`: mixed_float16 (with loss scaling) when every GPU has tensor
  cores (compute capability 7.0+), mixed_bfloat16 on a CPU with native bfloat16 arithmetic,
  else float32. BENCHMARKS.md has the CIFAR-10 accuracy of bfloat16 against float32."""
  if requested != "auto":
    return requested, ""
  if gpu_compute_capabilities:
    if all(tuple(c) >= (7, 0) for c in gpu_compute_capabilities):
      return "mixed_float16", "auto: every GPU has tensor cores (compute capability 7.0+)"
    return "float32", "auto: a GPU without tensor cores (compute capability below 7.0)"
  native = [flag for flag in NATIVE_BFLOAT16_CPU_FLAGS if flag in cpu_flags]
  if native:
    return "mixed_bfloat16", f"auto: the CPU computes in bfloat16 natively ({native[0]})"
  return "float32", "auto: no tensor-core GPU and no native bfloat16 on the CPU"


def enable_onednn(environ=None) -> None:
  """Sets TF_ENABLE_ONEDNN_OPTS as compat.onednn_setting says, where TensorFlow has not been
  imported yet (TF reads it once, while it loads). `import tfdp` calls this."""
  environ = os.environ if environ is None else environ
  if "tensorflow" in sys.modules and environ is os.environ:
    return
  value = compat.onednn_setting(cpus.cpu_flags(environ={}), environ)
  if value is not None:
    environ[compat.ONEDNN_ENV] = value


def check_bfloat16_under_isa_cap(requested: str, has_gpu: bool, environ=None,
                                 cpuinfo_path: str = cpus.CPUINFO) -> None:
  """TF sends bfloat16 matmuls to oneDNN where the CPU has AVX-512; under an ONEDNN_MAX_CPU_ISA
  cap that hides it, oneDNN has no kernel and the process aborts in the first step ("could not
  create a primitive descriptor for the matmul primitive"). Refuse that in one line instead."""
  if requested != "mixed_bfloat16" or has_gpu:
    return
  environ = os.environ if environ is None else environ
  had = cpus.cpu_flags(cpuinfo_path, environ={})
  if "avx512f" in had and "avx512f" not in cpus.onednn_capped(had, environ):
    cap = environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA")
    raise ConfigError(f"runtime.mixed_precision=mixed_bfloat16 cannot run under "
                      f"ONEDNN_MAX_CPU_ISA={cap}: TF sends bfloat16 matmuls to oneDNN on this "
                      "AVX-512 CPU, and the cap leaves oneDNN none (it aborts); unset the cap, or "
                      "use runtime.mixed_precision=float32 (or auto) to imitate an AVX2-only CPU.")


def resolve_precision(requested: str) -> tuple[str, str]:
  """choose_precision for this machine's GPUs and CPU."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus_here = tf.config.list_physical_devices("GPU")
  check_bfloat16_under_isa_cap(requested, bool(gpus_here))
  if requested != "auto":
    return requested, ""
  capabilities = []
  for gpu in gpus_here:
    details = tf.config.experimental.get_device_details(gpu)
    capabilities.append(tuple(details.get("compute_capability", (0, 0))))
  return choose_precision(requested, capabilities, cpus.cpu_flags())


def plan_strategy(runtime: RuntimeConfig, cluster: Cluster, local_devices: Sequence[str],
                  present: Sequence[str] = ()) -> StrategyPlan:
  """Pure: decides strategy, devices and reduction from the config and the devices found.
  `present`: devices the process has beyond those (logical CPUs it configured itself)."""
  have = {_device_name(d) for d in [*local_devices, *present]}
  missing = [d for d in runtime.devices if _device_name(d) not in have]
  if missing:  # else NCCL's 'no OpKernel' blamed on the data, or one replica fewer, silently
    raise ConfigError(f"runtime.devices names {', '.join(missing)}, which this process does not "
                      f"have (it has {', '.join(local_devices)}); name devices it has, or leave "
                      "runtime.devices empty (runtime.cpu_replicas makes CPU replicas).")
  gpus = [d for d in local_devices if "gpu" in d.lower()]
  kind = choose_strategy_kind(runtime, cluster, len(gpus))
  if kind == "multi_worker_mirrored":
    impl, reason = choose_all_reduce(runtime.all_reduce, len(gpus))
    return StrategyPlan(kind, tuple(gpus), all_reduce=impl, reason=reason)
  if kind == "mirrored":
    note = ""
    if runtime.devices:
      devices = tuple(runtime.devices)
    elif gpus:
      devices = tuple(gpus)
      if runtime.cpu_replicas > 1:
        note = (f"runtime.cpu_replicas={runtime.cpu_replicas} ignored: {len(gpus)} GPU(s) found, "
                "so the replicas are the GPUs (hide them with CUDA_VISIBLE_DEVICES= to train on "
                "CPU replicas)")
    else:
      devices = tuple(d for d in local_devices if "cpu" in d.lower())
    ops, reason = choose_cross_device_ops(runtime.cross_device_ops, devices)
    return StrategyPlan(kind, devices, cross_device_ops=ops,
                        reason="; ".join(r for r in (note, reason) if r))
  if kind == "one_device":
    device = runtime.devices[0] if runtime.devices else (gpus[0] if gpus else "/cpu:0")
    return StrategyPlan(kind, (device,))
  return StrategyPlan(kind)


def _device_name(device: str) -> str:
  """'/job:localhost/replica:0/task:0/device:GPU:1', 'GPU:1', '/gpu:1' → '/gpu:1'."""
  return "/" + device.lower().rsplit("device:", 1)[-1].lstrip("/")


def configure_devices(runtime: RuntimeConfig, multi_worker: bool = False) -> int:
  """Must run before TensorFlow initialises its devices: logical CPUs and thread pools.
  Returns the number of CPU devices this process trains on.

  Under multi-worker training each process is one CPU replica: MultiWorkerMirroredStrategy does
  not use logical CPU devices, so `cpu_replicas` (a single-host setting) is ignored there.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  threading = tf.config.threading
  for key, wanted, get, set_ in (
      ("intra_op_threads", runtime.intra_op_threads, threading.get_intra_op_parallelism_threads,
       threading.set_intra_op_parallelism_threads),
      ("inter_op_threads", runtime.inter_op_threads, threading.get_inter_op_parallelism_threads,
       threading.set_inter_op_parallelism_threads)):
    if wanted and wanted != get():
      try:
        set_(wanted)
      except RuntimeError:  # fixed once TensorFlow runs (an earlier run in this process)
        raise ConfigError(f"runtime.{key}={wanted} must be set before TensorFlow starts, but this "
                          f"process already runs with {get() or 'its default'}; restart the "
                          "process (or Jupyter kernel) first.") from None
    elif not wanted and get():
      logging.warning("strategy: runtime.%s is 0 (TensorFlow's default), but this process runs "
                      "with %d, set before; restart the process for the default", key, get())
  num_cpus = 1
  if runtime.cpu_replicas > 1 and multi_worker:
    logging.info("strategy: runtime.cpu_replicas=%d ignored: each worker process is one CPU "
                 "replica under multi_worker_mirrored", runtime.cpu_replicas)
  elif runtime.cpu_replicas > 1:
    num_cpus = runtime.cpu_replicas
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    wanted = [tf.config.LogicalDeviceConfiguration() for _ in range(runtime.cpu_replicas)]
    if current is None or len(current) != len(wanted):
      try:
        tf.config.set_logical_device_configuration(cpu, wanted)
      except RuntimeError:
        raise ConfigError(
            f"runtime.cpu_replicas={runtime.cpu_replicas} must be set before TensorFlow starts, "
            f"but this process already has {len(current or [1])} CPU device(s); restart the "
            "process (or Jupyter kernel) and create the strategy first.") from None
  for gpu in tf.config.list_physical_devices("GPU"):
    try:
      tf.config.experimental.set_memory_growth(gpu, True)
    except RuntimeError:  # TensorFlow already started (a notebook, data loaded first): keep it
      logging.info("strategy: GPU memory growth not set: TensorFlow had already started")
      break
  return num_cpus


def _cross_device_ops(name: str, num_packs: int):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if name == "nccl":
    return tf.distribute.NcclAllReduce(num_packs=num_packs)
  if name == "hierarchical_copy":
    return tf.distribute.HierarchicalCopyAllReduce(num_packs=num_packs)
  return tf.distribute.ReductionToOneDevice()


def communication_options(runtime: RuntimeConfig, implementation: str):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  impl = tf.distribute.experimental.CommunicationImplementation
  return tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=runtime.bytes_per_pack,
      timeout_seconds=runtime.collective_timeout_seconds or None,
      implementation={"ring": impl.RING, "nccl": impl.NCCL, "auto": impl.AUTO}[implementation])


def gpus_may_be_visible(env=None) -> bool:
  """False only when this process surely sees no GPU (asked without starting TensorFlow)."""
  env = os.environ if env is None else env
  if "CUDA_VISIBLE_DEVICES" in env:
    return bool(gpus.parse_visible_devices(env["CUDA_VISIBLE_DEVICES"]))
  return gpus.count_nvidia_device_files() > 0


def expected_replicas(runtime: RuntimeConfig, num_workers: int = 1,
                      gpus_visible: bool | None = None) -> int | None:
  """Replica count known from the config alone (None when it depends on GPUs found)."""
  per_worker = None
  if num_workers > 1:
    return None  # one replica per worker on CPU, one per GPU otherwise: known once TF runs
  if runtime.cpu_replicas:
    if gpus_may_be_visible() if gpus_visible is None else gpus_visible:
      return None  # GPUs, if TensorFlow finds any, replace CPU replicas (strategy.plan_strategy)
    per_worker = runtime.cpu_replicas
  elif runtime.devices:
    per_worker = len(runtime.devices)
  elif runtime.strategy in ("default", "one_device"):
    per_worker = 1
  if per_worker is None:
    return None
  return per_worker * max(1, num_workers)


def check_jit_compile(runtime: RuntimeConfig, replicas: int, flag: str = "") -> None:
  """XLA-compiled replica steps under a multi-replica strategy are not supported (untested).
  `flag`: the command-line option that asked for the replicas, named in the fix."""
  if runtime.jit_compile and replicas > 1:
    if flag:
      raise ConfigError(f"runtime.jit_compile works with one replica; drop {replicas} from "
                        f"{flag} or set runtime.jit_compile=false.")
    raise ConfigError(f"runtime.jit_compile works with one replica, but this run has "
                      f"{replicas}; set runtime.jit_compile=false.")


def make_strategy(runtime: RuntimeConfig, cluster: Cluster | None = None,
                  for_user: bool = False):
  """The one place a strategy is created. Returns (strategy, plan). `for_user`: made by
  tfdp.make_strategy (or tfdp.fit in its place), which returns it again; a run's own is not."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  cluster = cluster or cluster_lib.Cluster(task_type="", task_index=0, cluster={}, source="none")
  num_cpus = configure_devices(runtime, multi_worker=cluster.is_multi_worker)
  # Physical devices only: listing logical ones would start the runtime, after which
  # MultiWorkerMirroredStrategy can no longer configure its collectives.
  local = [f"/cpu:{i}" for i in range(num_cpus)]
  gpus_here = tf.config.list_physical_devices("GPU")
  local += [f"/gpu:{i}" for i in range(len(gpus_here))]
  precision, precision_reason = resolve_precision(runtime.mixed_precision)
  if not gpus_here:
    warning = compat.onednn_off_warning(compat.onednn_enabled(), cpus.cpu_flags(environ={}),
                                        os.environ)
    if warning:
      logging.warning(warning)
  cpu = tf.config.list_physical_devices("CPU")[0]  # its logical devices, set by the caller too
  present = [f"/cpu:{i}" for i in range(len(tf.config.get_logical_device_configuration(cpu) or []))]
  plan = dataclasses.replace(plan_strategy(runtime, cluster, local, present), precision=precision,
                             precision_reason=precision_reason)
  if plan.kind == "multi_worker_mirrored":
    if not cluster.is_multi_worker and cluster.source == "none":
      logging.info("strategy: multi_worker_mirrored with no TF_CONFIG runs as one worker")
    if cluster.is_multi_worker:
      compat.configure_coordination_service(cluster.cluster, cluster.task_type,
                                            runtime.heartbeat_timeout_seconds)
    with startup.StartupDeadline(cluster, runtime.startup_timeout_seconds) as deadline:
      # in Python: a signal while a peer is late acts at once; a peer that differs is one line
      rendezvous.wait_for_peers(cluster, deadline.say)
      strategy = tf.distribute.MultiWorkerMirroredStrategy(
          cluster_resolver=cluster_lib.make_cluster_resolver(cluster) if cluster.source != "none"
          else None,
          communication_options=communication_options(runtime, plan.all_reduce))
  elif plan.kind == "mirrored":
    strategy = tf.distribute.MirroredStrategy(
        devices=list(plan.devices),
        cross_device_ops=_cross_device_ops(plan.cross_device_ops, runtime.num_packs))
  elif plan.kind == "one_device":
    strategy = tf.distribute.OneDeviceStrategy(plan.devices[0])
  else:
    strategy = tf.distribute.get_strategy()
  logging.info("%s", describe(plan, strategy.num_replicas_in_sync))  # once: what, and why
  _MADE.insert(0, _Made(strategy, plan, runtime, for_user))
  return strategy, plan


@dataclasses.dataclass(frozen=True)
class _Made:
  """A strategy make_strategy made, its plan, and the settings it was asked for (`auto` as
  given): tfdp.fit trains a model built in its scope, and says what it reduces with."""
  strategy: object
  plan: StrategyPlan
  runtime: RuntimeConfig
  for_user: bool = False

  @property
  def in_a_scope(self) -> bool:  # every variable made outside a scope is the default strategy's
    return self.plan.kind != "default"


_MADE: list[_Made] = []  # newest first: a notebook may make several (tfdp.train makes one)


def _made(strategy) -> _Made | None:
  return next((made for made in _MADE if made.strategy is strategy), None)


def last_made(runtime: RuntimeConfig | None = None):
  """The strategy made last for the user (tfdp.make_strategy); with `runtime`, only if it was
  made from those settings. Not a tfdp.train run's: `with tfdp.make_strategy().scope():` after
  one built the user's model there (its replicas, not the user's)."""
  users = [made for made in _MADE if made.for_user]
  if not users and _MADE and _MADE[0].plan.kind == "multi_worker_mirrored":
    return _MADE[0].strategy  # a process joins its cluster once: the run's is the only one
  if not users or (runtime is not None and users[0].runtime != runtime):
    return None
  return users[0].strategy


def strategy_of(variables):
  """The strategy this process made whose scope created every one of `variables`, or None."""
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  for made in _MADE:
    if made.in_a_scope and all(compat.created_in_scope(made.strategy, v) for v in variables):
      return made.strategy
  return None


# The settings that make a strategy (make_strategy reads them); the others act while it trains.
MAKING_SETTINGS = ("strategy", "devices", "cpu_replicas", "cross_device_ops", "num_packs",
                   "all_reduce", "bytes_per_pack", "heartbeat_timeout_seconds",
                   "startup_timeout_seconds", "intra_op_threads", "inter_op_threads")
_KINDS = {"MirroredStrategy": "mirrored", "OneDeviceStrategy": "one_device",
          "MultiWorkerMirroredStrategy": "multi_worker_mirrored",
          "CollectiveAllReduceStrategy": "multi_worker_mirrored"}


def runtime_of(strategy, runtime: RuntimeConfig) -> RuntimeConfig:
  """`runtime` with the settings `strategy` was made from (the library API's strategy is given,
  not made from the config), so a run's config.yaml records what ran: tfdp.make_strategy's
  settings, or a strategy of the user's own by its kind and devices."""
  made = _made(strategy)
  if made is not None and made.in_a_scope:  # what ran: `auto` resolved to its kind
    ran = dataclasses.replace(made.runtime, strategy=made.plan.kind)
    return dataclasses.replace(runtime, **{k: getattr(ran, k) for k in MAKING_SETTINGS})
  kind = _KINDS.get(type(strategy).__name__)
  if kind is None:  # the default strategy, or one tfdp does not know: left as the config says
    return runtime
  devices = list(strategy.extended.worker_devices) if kind != "multi_worker_mirrored" else []
  return dataclasses.replace(runtime, strategy=kind, devices=devices, cpu_replicas=0)


def plan_of(strategy) -> StrategyPlan | None:
  """The plan make_strategy made `strategy` from, if it made it."""
  made = _made(strategy)
  return made.plan if made is not None else None


def describe(plan: StrategyPlan, num_replicas: int) -> str:
  reduce = plan.cross_device_ops or plan.all_reduce or "none"
  why = f" ({plan.reason})" if plan.reason else ""
  precision = f" precision={plan.precision} ({plan.precision_reason})" if plan.precision_reason else ""
  return (f"strategy={plan.kind} replicas={num_replicas} devices={list(plan.devices) or 'default'} "
          f"all_reduce={reduce}{why}{precision}")


def config_fields(config_json: str, model_dir: str) -> dict[str, str]:
  """The config as flat `key: value` pairs (JSON; a long value as its hash) and --model_dir, for
  the start-up exchange: workers that differ are told which keys differ, not two hashes."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  fields = {"--model_dir": model_dir}

  def add(prefix: str, node) -> None:
    if isinstance(node, dict) and node:
      for key, value in node.items():
        add(f"{prefix}{key}.", value)
      return
    text = json.dumps(node, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    fields[prefix[:-1]] = text if len(text) <= 64 else f"{text[:40]}... (sha256 {digest})"

  add("", json.loads(config_json))
  return fields


def worker_plan(plan: StrategyPlan, local_replicas: int, config: dict[str, str] | str) -> dict:
  """What every worker must agree on before the first collective (`config`: config_fields)."""
  return {"local_replicas": local_replicas, "kind": plan.kind, "all_reduce": plan.all_reduce,
          "precision": plan.precision, "config": config}


def _config_difference(rank: int, mine: dict, first: dict, shown: int = 4) -> str:
  keys = [k for k in sorted(set(mine) | set(first)) if mine.get(k) != first.get(k)]
  said = ", ".join(f"{k}={mine.get(k, '(unset)')} (worker 0: {first.get(k, '(unset)')})"
                   for k in keys[:shown])
  more = len(keys) - shown
  more = f" and {more} more key{'s' if more != 1 else ''}" if more > 0 else ""
  return f"worker {rank} has {said}{more}"


def check_workers_agree(plans: Sequence[dict]) -> None:
  """One line naming the first worker and field (for the config, the keys) that differs from
  worker 0. TF calls unequal device counts across workers undefined (they hang or sum wrongly),
  and workers that read different configs train nonsense together."""
  differs = cluster_lib.first_difference(list(plans))
  if differs is None:
    return
  rank, key = differs
  value, first = plans[rank].get(key), plans[0].get(key)
  terms = errors.terms()
  if key == "config" and isinstance(value, dict) and isinstance(first, dict):
    seed_differs = value.get("trainer.seed") != first.get("trainer.seed")
    fix = (terms.workers_seed_fix if terms.workers_seed_fix and seed_differs
           else terms.workers_config_fix.format(terms.model_dir))
    raise ConfigError(f"workers disagree before training on their config: "
                      f"{_config_difference(rank, value, first)}; {fix}.")
  fix = (terms.workers_config_fix.format(terms.model_dir) if key == "config" else
         "give every worker the same number of devices (tfdp-launch --gpus_per_worker, "
         "CUDA_VISIBLE_DEVICES) and the same runtime settings")
  raise ConfigError(f"workers disagree before training: worker {rank} has {key}={value!r} but "
                    f"worker 0 has {first!r}; {fix}.")
