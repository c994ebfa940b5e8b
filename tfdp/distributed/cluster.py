"""Cluster description for data-parallel training: TF_CONFIG, Slurm or none.

Everything here is plain Python on purpose: the cluster must be validated, with
one readable line per mistake, before any TensorFlow gRPC server starts (a
malformed TF_CONFIG otherwise surfaces as a C++ error or a hang). TensorFlow is
imported lazily, only by `make_cluster_resolver`. For the same reason a Slurm
task that shares its node's GPUs gets its own share in CUDA_VISIBLE_DEVICES
here (pin_slurm_task_gpus), before TensorFlow first touches a GPU.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import json
import os
import socket
from collections.abc import Mapping
from typing import Any

from tfdp.distributed import slurm
from tfdp.distributed.slurm import (expand_nodelist, expand_tasks_per_node,  # noqa: F401
                                    is_ascii_number, pin_slurm_task_gpus, slurm_task_gpus)
from tfdp.errors import ClusterError

# Task types TensorFlow knows; "ps" is recognised only to reject it clearly.
_TRAINING_TASK_TYPES = ("chief", "worker")
_SUPPORTED_TASK_TYPES = ("chief", "worker", "evaluator")
_TOP_LEVEL_KEYS = ("cluster", "task", "environment", "rpc_layer")
# The only server factory TF 2.21's pip build registers ("grpc+verbs", "grpc+gdr", "grpc+mpi"
# left TF core; tf.distribute.Server raises NotFoundError for them).
RPC_LAYERS = ("grpc",)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Where this process sits in the training cluster.

  Attributes:
    task_type: "chief", "worker", "evaluator", or "" for a single process.
    task_index: Index of this task within `task_type`.
    cluster: The cluster spec, e.g. {"worker": ["host0:2222", "host1:2222"]}.
    source: "none", "TF_CONFIG" or "slurm": where the description came from.
    rpc_layer: Protocol the servers use ("grpc" unless TF_CONFIG says else).
    may_resize: A restart may run this group on another worker count (tfdp-launch
      --min_workers below --num_workers: TFDP_MIN_WORKERS, TFDP_MAX_WORKERS).
  """

  task_type: str = ""
  task_index: int = 0
  # hash=False: a dict is unhashable, and the other fields identify the task.
  cluster: dict[str, list[str]] = dataclasses.field(
      default_factory=dict, hash=False)
  source: str = "none"
  rpc_layer: str = "grpc"
  may_resize: bool = False

  @property
  def num_workers(self) -> int:
    """Number of tasks that train (chief + workers); 1 for a single process."""
    if not self.cluster:
      return 1
    return sum(len(self.cluster.get(kind, [])) for kind in _TRAINING_TASK_TYPES)

  @property
  def is_chief(self) -> bool:
    """True for the task that writes checkpoints and summaries."""
    if not self.task_type:
      return True
    if self.task_type == "chief":
      return True
    # TF's rule: without a chief, worker 0 takes that role.
    return (self.task_type == "worker" and self.task_index == 0 and
            "chief" not in self.cluster)

  @property
  def is_multi_worker(self) -> bool:
    return self.num_workers > 1

  @property
  def rank(self) -> int:
    """0..num_workers-1, chief first then workers; -1 for an evaluator."""
    if not self.task_type or self.task_type == "chief":
      return 0
    if self.task_type == "worker":
      return len(self.cluster.get("chief", [])) + self.task_index
    return -1  # An evaluator does not take part in training.

  def as_tf_config(self) -> dict[str, Any]:
    """The TF_CONFIG dict for this task ({} for a single process)."""
    if not self.task_type:
      return {}
    return {
        "cluster": {kind: list(addrs) for kind, addrs in self.cluster.items()},
        "task": {"type": self.task_type, "index": self.task_index},
        "rpc_layer": self.rpc_layer,
    }


# --------------------------------------------------------------------------
# TF_CONFIG
# --------------------------------------------------------------------------


def _fail(message: str) -> ClusterError:
  return ClusterError(f"TF_CONFIG: {message}")


def _describe(value: Any) -> str:
  """Short repr plus type name, for messages like "got 'a' (str)"."""
  text = json.dumps(value) if not isinstance(value, str) else repr(value)
  if len(text) > 60:
    text = text[:57] + "..."
  return f"{text} ({type(value).__name__})"


def address_problem(address: Any) -> str | None:
  """Returns why `address` is not a usable "host:port" string, or None if ok."""
  if not isinstance(address, str):
    return f"must be a \"host:port\" string, got {_describe(address)}"
  if not address:
    return "is an empty string; write it as host:port, e.g. 'localhost:12345'"
  if any(char.isspace() for char in address):
    return f"{address!r} contains whitespace; remove the spaces"
  if address.startswith("["):  # IPv6 literal: [::1]:2222
    host, sep, port = address[1:].partition("]:")
    try:
      ipaddress.IPv6Address(host)
    except ValueError:
      sep = ""
    if not sep:
      return (f"{address!r} is not [ipv6]:port; write it like '[::1]:12345'")
  else:
    host, sep, port = address.rpartition(":")
    if not sep:
      return (f"{address!r} has no port; write it as host:port, "
              f"e.g. '{address}:12345'")
    if ":" in host:
      return (f"{address!r} has more than one ':'; put IPv6 hosts in brackets, "
              "e.g. '[::1]:12345'")
  if not host:
    return f"{address!r} has an empty host; write it as host:port"
  if not is_ascii_number(port):
    return (f"{address!r} has port {port!r}, which is not a number; use a "
            "numeric port, e.g. 'host:12345'")
  if not 1 <= int(port) <= 65535:
    return (f"{address!r} has port {int(port)}, outside 1..65535; pick a "
            "port in that range")
  return None


def _validate_cluster_spec(spec: Any) -> dict[str, list[str]]:
  """Checks the `cluster` section and returns it as a plain dict of lists."""
  if not isinstance(spec, dict):
    raise _fail(
        f"cluster must be an object mapping task type to a list of "
        f"\"host:port\" strings, got {_describe(spec)}; e.g. "
        "{\"worker\": [\"host0:12345\", \"host1:12345\"]}.")
  for kind, addresses in spec.items():
    if kind == "ps":
      raise _fail(
          "cluster.ps is set, but 'ps' means parameter-server training, which "
          "tfdp does not support; remove cluster.ps and use chief/worker tasks "
          "(tfdp trains with MultiWorkerMirroredStrategy).")
    if kind not in _SUPPORTED_TASK_TYPES:
      raise _fail(
          f"cluster.{kind} is not a known task type; use one of "
          f"{', '.join(_SUPPORTED_TASK_TYPES)}.")
    if not isinstance(addresses, list):
      raise _fail(
          f"cluster.{kind} must be a list of \"host:port\" strings, got "
          f"{_describe(addresses)}; e.g. [\"host0:12345\"].")
    for position, address in enumerate(addresses):
      problem = address_problem(address)
      if problem:
        raise _fail(f"cluster.{kind}[{position}] {problem}.")
  seen: dict[str, str] = {}
  for kind, addresses in spec.items():
    for position, address in enumerate(addresses):
      field = f"cluster.{kind}[{position}]"
      if address in seen:
        raise _fail(
            f"{field} repeats address {address!r} already used by "
            f"{seen[address]}; every task needs its own host:port.")
      seen[address] = field
  for kind in ("chief", "evaluator"):
    if kind in spec and len(spec[kind]) > 1:
      raise _fail(
          f"cluster.{kind} has {len(spec[kind])} addresses but at most one "
          f"{kind} is allowed; keep one and move the others to cluster.worker.")
    if kind in spec and not spec[kind]:
      raise _fail(f"cluster.{kind} is an empty list; add an address or remove "
                  f"cluster.{kind}.")
  if not spec.get("worker") and not spec.get("chief"):
    raise _fail(
        "cluster has no chief and an empty or missing worker list, so nobody "
        "would train; add addresses to cluster.worker.")
  return {kind: list(addresses) for kind, addresses in spec.items()}


def _validate_task(task: Any, spec: dict[str, list[str]]) -> tuple[str, int]:
  """Checks the `task` section against the cluster; returns (type, index)."""
  if not isinstance(task, dict):
    raise _fail(
        f"task must be an object like {{\"type\": \"worker\", \"index\": 0}}, "
        f"got {_describe(task)}.")
  if "type" not in task:
    raise _fail("task.type is missing; set it to \"chief\", \"worker\" or "
                "\"evaluator\".")
  task_type = task["type"]
  if task_type == "ps":
    raise _fail(
        "task.type is 'ps', which means parameter-server training; tfdp does "
        "not support it, run this task as a chief or worker instead.")
  if task_type not in _SUPPORTED_TASK_TYPES:
    raise _fail(
        f"task.type {_describe(task_type)} is not a known task type; use one "
        f"of {', '.join(_SUPPORTED_TASK_TYPES)}.")
  if task_type == "chief" and "chief" not in spec:
    raise _fail(
        "task.type is 'chief' but cluster.chief is missing; add "
        "cluster.chief with this task's address, or make this task a worker.")
  if task_type not in spec and task_type != "evaluator":
    raise _fail(
        f"task.type is {task_type!r} but cluster.{task_type} is missing; add "
        f"it to the cluster or fix task.type.")
  if "index" not in task:
    raise _fail("task.index is missing; set it to this task's position in "
                f"cluster.{task_type} (0 for the first).")
  index = task["index"]
  # bool is an int subclass in Python, but true/false is never an index.
  if not isinstance(index, int) or isinstance(index, bool):
    raise _fail(f"task.index must be an integer, got {_describe(index)}; "
                "write it without quotes, e.g. \"index\": 0.")
  if index < 0:
    raise _fail(f"task.index {index} is negative; indices start at 0.")
  # TF allows an evaluator that is not listed in the cluster; it is task 0.
  count = len(spec.get(task_type, [])) or (1 if task_type == "evaluator" else 0)
  if index >= count:
    raise _fail(
        f"task.index {index} is out of range: cluster.{task_type} has {count} "
        f"address{'es' if count != 1 else ''} (indices 0..{count - 1}); fix "
        "the index or add an address.")
  return task_type, index


def parse_tf_config(text: str | None) -> Cluster:
  """Parses and validates a TF_CONFIG JSON string.

  Args:
    text: The TF_CONFIG value; None or blank means a single process.

  Returns:
    The validated Cluster (source "TF_CONFIG"), or a single-process Cluster.

  Raises:
    ClusterError: one line naming the offending field and the fix.
  """
  if text is None or not text.strip():
    return Cluster()
  try:
    config = json.loads(text)
  except json.JSONDecodeError as error:
    raise _fail(
        f"not valid JSON: {error.msg} at line {error.lineno} column "
        f"{error.colno}; fix the JSON syntax there (keys and strings need "
        "double quotes).") from None
  if not isinstance(config, dict):
    raise _fail(f"the top level must be an object with \"cluster\" and "
                f"\"task\", got {_describe(config)}.")
  unknown = sorted(set(config) - set(_TOP_LEVEL_KEYS))
  if unknown:
    raise _fail(
        f"unknown top-level key{'s' if len(unknown) > 1 else ''} "
        f"{', '.join(map(repr, unknown))}; allowed keys are "
        f"{', '.join(_TOP_LEVEL_KEYS)} (check the spelling).")
  if "cluster" not in config:
    raise _fail("cluster is missing; add e.g. \"cluster\": {\"worker\": "
                "[\"host0:12345\", \"host1:12345\"]}.")
  if "task" not in config:
    raise _fail("task is missing; add e.g. \"task\": {\"type\": \"worker\", "
                "\"index\": 0}.")
  rpc_layer = config.get("rpc_layer", "grpc")
  if rpc_layer not in RPC_LAYERS:
    raise _fail(f"rpc_layer {_describe(rpc_layer)} is not supported; the allowed value is "
                f"{', '.join(map(json.dumps, RPC_LAYERS))} (or leave rpc_layer out).")
  if "environment" in config and not isinstance(config["environment"], str):
    raise _fail(f"environment must be a string, got "
                f"{_describe(config['environment'])}.")
  spec = _validate_cluster_spec(config["cluster"])
  task_type, index = _validate_task(config["task"], spec)
  return Cluster(task_type=task_type, task_index=index, cluster=spec,
                 source="TF_CONFIG", rpc_layer=rpc_layer)


def from_slurm(env: Mapping[str, str],
               port_base: int | None = None) -> Cluster:
  """A worker-only Cluster from the environment srun gives each task (slurm.slurm_workers)."""
  rank, addresses = slurm.slurm_workers(env, port_base)
  return Cluster(task_type="worker", task_index=rank,
                 cluster={"worker": addresses}, source="slurm")


def group_restart(env: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
  """(variable, count) when this process belongs to a restarted group (tfdp-launch
  --max_restarts sets TFDP_RESTART_COUNT, a Slurm --requeue SLURM_RESTART_COUNT), else None: a
  restart resumes the run its first start began, even one asked to start over."""
  for name in ("TFDP_RESTART_COUNT", "SLURM_RESTART_COUNT"):
    count = env.get(name, "").strip()
    if count.isdigit() and int(count) > 0:
      return name, int(count)
  return None


def group_may_resize(env: Mapping[str, str] = os.environ) -> bool:
  """tfdp-launch --min_workers says how far the group may shrink (and grow back)."""
  counts = [env.get(name, "").strip() for name in ("TFDP_MIN_WORKERS", "TFDP_MAX_WORKERS")]
  return all(c.isdigit() for c in counts) and int(counts[0]) < int(counts[1])


def resolve_cluster(env: Mapping[str, str] = os.environ) -> Cluster:
  """TF_CONFIG wins if set (under a multi-task srun only if it agrees with srun's layout), else
  Slurm under a multi-task srun, else single.

  For a Slurm cluster resolved from os.environ itself, this task's share of
  the node's GPUs is also set there (pin_slurm_task_gpus), before TensorFlow
  starts; any other mapping is only read.
  """
  if env is os.environ and "TF_CONFIG" in env and not env["TF_CONFIG"].strip():
    del os.environ["TF_CONFIG"]  # blank: none, here and for TensorFlow, whose resolvers parse it
  if env.get("TF_CONFIG", "").strip():
    cluster = parse_tf_config(env["TF_CONFIG"])
    if cluster.task_type in _TRAINING_TASK_TYPES:  # an evaluator is refused later, on its own
      slurm.check_tf_config_place(env, f"{cluster.task_type} {cluster.task_index}", cluster.rank,
                                  cluster.num_workers)
    return dataclasses.replace(cluster, may_resize=group_may_resize(env))
  if slurm.running_under_srun(env):
    cluster = from_slurm(env)
    if env is os.environ:
      slurm.pin_slurm_task_gpus(os.environ)
    return cluster
  return Cluster()


# --------------------------------------------------------------------------
# TensorFlow glue and reporting
# --------------------------------------------------------------------------


def make_cluster_resolver(cluster: Cluster):
  """A tf.distribute SimpleClusterResolver for MultiWorkerMirroredStrategy.

  The same resolver type serves TF_CONFIG, Slurm and single-process clusters,
  because `cluster` is already validated and TF_CONFIG may not be in
  os.environ (e.g. resolve_cluster was given another mapping).
  """
  import tensorflow as tf  # Lazy: validation must not start TensorFlow.

  # SimpleClusterResolver reports no GPUs unless told; the strategy needs it.
  num_gpus = len(tf.config.list_physical_devices("GPU"))
  return tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(cluster.cluster),
      task_type=cluster.task_type or None,
      task_id=cluster.task_index if cluster.task_type else None,
      num_accelerators={"GPU": num_gpus} if num_gpus else None,
      rpc_layer=cluster.rpc_layer)


def peer_wait_seconds(heartbeat_timeout_seconds: float = 30.0) -> float:
  """How long a worker waits for its peers at an exchange or a barrier: long enough for the
  heartbeat to have declared a dead peer, and never under a minute."""
  return max(60.0, 2 * heartbeat_timeout_seconds)


def exchange(cluster: Cluster, value, heartbeat_timeout_seconds: float, topic: str) -> list:
  """Every worker's `value` (made JSON), in rank order, through the coordination service: what
  the workers compare before they may run a collective together."""
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  return [json.loads(v) for v in compat.exchange_between_workers(
      cluster.rank, cluster.num_workers, json.dumps(value, default=str),
      peer_wait_seconds(heartbeat_timeout_seconds), topic=topic)]


def first_difference(states: list[dict]) -> tuple[int, str] | None:
  """The first worker, in rank order, and its first key whose value differs from worker 0's
  (a key one of them lacks counts as None there); None where all agree."""
  first = states[0]
  for rank, state in enumerate(states[1:], start=1):
    for key in [*state, *(k for k in first if k not in state)]:
      if state.get(key) != first.get(key):
        return rank, key
  return None


def compare_workers(cluster: Cluster, state: dict, heartbeat_timeout_seconds: float,
                    topic: str) -> tuple[list[dict], int, str] | None:
  """Every worker's `state` exchanged, then (the states, the first worker and key that differ
  from worker 0's), or None where all agree."""
  states = exchange(cluster, state, heartbeat_timeout_seconds, topic)
  differs = first_difference(states)
  return None if differs is None else (states, *differs)


# Each leave_together call is a barrier of its own, numbered alike on every worker.
_LEAVE_CALLS = itertools.count(1)


def leave_together(cluster: Cluster, heartbeat_timeout_seconds: float = 30.0) -> None:
  """A worker whose work is done waits for the others before it leaves (compat.leave_together:
  a peer may still be fetching the last collective's buffers from it), for peer_wait_seconds at
  most; a peer that died, or the timeout, is only logged: nothing is left to do."""
  if not cluster.is_multi_worker:
    return
  from absl import logging  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  why = compat.leave_together(peer_wait_seconds(heartbeat_timeout_seconds), next(_LEAVE_CALLS))
  if why:  # worker 0, which holds the barrier, may have left first: nothing is lost either way
    logging.info("left without hearing from every worker (%s); this worker's work is done", why)


def summary_line(cluster: Cluster, replicas_in_sync: int,
                 all_reduce: str) -> str:
  """One log line: who this task is and how gradients are reduced."""
  if not cluster.task_type:
    where = "single process (no TF_CONFIG or Slurm)"
  elif cluster.task_type == "evaluator":
    where = (f"evaluator {cluster.task_index}, not training, beside "
             f"{cluster.num_workers} workers ({cluster.source})")
  else:
    where = (f"{cluster.task_type} {cluster.task_index} of "
             f"{cluster.num_workers} ({cluster.source})")
    if cluster.rank not in (-1, cluster.task_index):
      where += f", rank {cluster.rank}"
  return (f"cluster: {where}, chief={cluster.is_chief}, "
          f"replicas_in_sync={replicas_in_sync}, all_reduce={all_reduce}")


# --------------------------------------------------------------------------
# Start-up: a cluster that never assembles
# --------------------------------------------------------------------------


def split_address(address: str) -> tuple[str, int]:
  """'host:port' or '[::1]:port' → (host, port)."""
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def peers(cluster: Cluster) -> list[tuple[str, str]]:
  """(`worker 2`, its address) for every other training task."""
  mine = (cluster.task_type, cluster.task_index)
  return [(f"{kind} {index}", address) for kind in _TRAINING_TASK_TYPES
          for index, address in enumerate(cluster.cluster.get(kind, [])) if (kind, index) != mine]


def reach(address: str, seconds: float) -> socket.socket | str:
  """A connection to `address`, or why there is none (`connection refused`, `timeout`...)."""
  try:
    return socket.create_connection(split_address(address), timeout=seconds)
  except (OSError, ValueError) as error:
    return (getattr(error, "strerror", None) or type(error).__name__).lower()


def unanswered_peers(cluster: Cluster, seconds: float = 2.0) -> list[str]:
  """`worker 2 at host:port (why)` for each other training task whose port takes no connection:
  a host that is gone, or a worker that never started."""
  silent = []
  for name, address in peers(cluster):
    connection = reach(address, seconds)
    if isinstance(connection, str):
      silent.append(f"{name} at {address} ({connection})")
    else:
      connection.close()
  return silent


def port_taken_error(cluster: Cluster, why: str | None = None, said: str = "",
                     holder: str = "") -> ClusterError:
  """The one line for this task's port that cannot be bound: `why` (the bind's strerror), or,
  for TF's bare 'Could not start gRPC server' (`said`: it names neither port nor why), a test
  bind on '' (TF listens on every interface, launch.py's docstring). The line keeps
  isolation.BIND_FAILURE_MARKERS' words: tfdp-launch retries with fresh ports."""
  address = cluster.cluster[cluster.task_type][cluster.task_index]
  port = split_address(address)[1]
  if why is None:
    try:
      with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
        probe.bind(("", port))
      why = "it is free now, so something held it while TensorFlow started"
    except OSError as error:
      why = error.strerror or str(error)
  if cluster.source == "slurm":
    fix = slurm.port_base_fix(cluster.cluster["worker"], holder)
  else:
    fix = (f"give it another free port in TF_CONFIG's "
           f"cluster.{cluster.task_type}[{cluster.task_index}]")
  return ClusterError(
      f"{cluster.task_type} {cluster.task_index} cannot listen on {address} (port {port}: "
      f"{why}{said}); {fix}, or stop what holds port {port} "
      f"(`ss -ltnp 'sport = :{port}'` names it).")
