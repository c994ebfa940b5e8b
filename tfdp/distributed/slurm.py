"""Slurm: the cluster srun describes in SLURM_* variables, and each task's share of the GPUs.

Read without TensorFlow (SlurmClusterResolver's rules, validated field by field); `cluster`
turns the result into a Cluster.
"""
from __future__ import annotations

import collections
import itertools
import os
import re
import socket
import sys
from collections.abc import Mapping, MutableMapping

from tfdp.distributed import gpus as gpus_lib
from tfdp.errors import ClusterError

DEFAULT_PORT_BASE = 8888  # SlurmClusterResolver's; used only without SLURM_JOB_ID.
PORT_BASE_VAR = "TFDP_SLURM_PORT_BASE"  # an explicit port base wins over the job's
# Fixed ports let two jobs that share a node collide. Each job takes a block of JOB_PORT_SLOT
# ports by its id: JOB_PORT_FIRST + (SLURM_JOB_ID % JOB_PORT_SLOTS) * JOB_PORT_SLOT, i.e.
# 12000..31199, below Linux's ephemeral range (32768+) so outgoing connections do not take them.
# Jobs whose ids differ by less than 300 never collide (with up to 64 tasks per node).
JOB_PORT_FIRST, JOB_PORT_SLOT, JOB_PORT_SLOTS = 12000, 64, 300
EPHEMERAL_FIRST = 32768


def job_port_base(env: Mapping[str, str]) -> int:
  """The first port of this job's workers on each node (see JOB_PORT_FIRST)."""
  if env.get(PORT_BASE_VAR, "").strip():
    value = env[PORT_BASE_VAR].strip()
    if not is_ascii_number(value):
      raise ClusterError(f"Slurm: {PORT_BASE_VAR}={value!r} is not a port number; e.g. "
                         f"{PORT_BASE_VAR}=20000.")
    return int(value)
  if "SLURM_JOB_ID" not in env:
    return DEFAULT_PORT_BASE
  return JOB_PORT_FIRST + _slurm_int(env, "SLURM_JOB_ID") % JOB_PORT_SLOTS * JOB_PORT_SLOT


def port_base_fix(addresses: list[str], holder: str = "") -> str:
  """The fix for a Slurm job whose port is taken, often by another job on the node whose id is
  this one's plus or minus a multiple of JOB_PORT_SLOTS (`holder`: who holds it, where known):
  a port base whose block is free here."""
  per_node = max(collections.Counter(a.rpartition(":")[0] for a in addresses).values())
  above_jobs = JOB_PORT_FIRST + JOB_PORT_SLOTS * JOB_PORT_SLOT  # no job's default block: 31200+
  free = next((base for base in range(above_jobs, EPHEMERAL_FIRST - per_node + 1, JOB_PORT_SLOT)
               if _ports_free(base, per_node)), None)
  example = (f"{PORT_BASE_VAR}={free} (free here)" if free is not None
             else f"{PORT_BASE_VAR}=40000")
  holder = holder or (f"another job on this node may hold it (Slurm jobs whose ids differ by a "
                      f"multiple of {JOB_PORT_SLOTS} share ports)")
  return (f"{holder}: export a base whose next {per_node} ports are free on every node before "
          f"srun, e.g. {example}")


def _ports_free(base: int, count: int) -> bool:
  """Whether ports base..base+count-1 can be bound on every interface of this host now."""
  for port in range(base, base + count):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
      try:
        probe.bind(("", port))
      except OSError:
        return False
  return True


def is_ascii_number(text: str) -> bool:
  """Digits 0-9 only: str.isdigit() takes '²' and '٣', which int() or TensorFlow then reject."""
  return bool(re.fullmatch(r"[0-9]+", text))


NODELIST_FIX = "; check SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (srun and sbatch set them)."


def _expand_bracket(body: str, nodelist: str) -> list[str]:
  """'01-03,07' -> ['01', '02', '03', '07'], keeping zero padding."""
  values = []
  for part in body.split(","):
    low, dash, high = part.partition("-")
    if not is_ascii_number(low) or (dash and not is_ascii_number(high)):
      raise ClusterError(
          f"Slurm: cannot expand nodelist {nodelist!r}: range {part!r} is not "
          f"N or N-M{NODELIST_FIX}")
    high = high if dash else low
    if int(high) < int(low):
      raise ClusterError(
          f"Slurm: cannot expand nodelist {nodelist!r}: range {part!r} runs "
          f"backwards{NODELIST_FIX}")
    values.extend(
        str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
  return values


def expand_nodelist(nodelist: str) -> list[str]:
  """Expands a Slurm hostlist, keeping Slurm's order and any repeats.

  'node[01-03,07]' -> node01 node02 node03 node07; 'a1,b2' -> a1 b2;
  'r[1-2]-n[1-2]' -> r1-n1 r1-n2 r2-n1 r2-n2.
  """
  hosts: list[str] = []
  depth, start = 0, 0
  items = []
  for position, char in enumerate(nodelist + ","):
    if char == "[":
      depth += 1
    elif char == "]":
      depth -= 1
    elif char == "," and depth == 0:
      items.append(nodelist[start:position])
      start = position + 1
    if depth not in (0, 1):
      raise ClusterError(f"Slurm: cannot expand nodelist {nodelist!r}: "
                         f"unbalanced or nested brackets{NODELIST_FIX}")
  if depth != 0:
    raise ClusterError(f"Slurm: cannot expand nodelist {nodelist!r}: "
                       f"unbalanced brackets{NODELIST_FIX}")
  for item in items:
    item = item.strip()
    if not item:
      raise ClusterError(f"Slurm: cannot expand nodelist {nodelist!r}: "
                         f"empty host name between commas{NODELIST_FIX}")
    # Split into literal text and [ranges], then take the cartesian product.
    pieces = re.split(r"(\[[^\]]*\])", item)
    choices = [_expand_bracket(piece[1:-1], nodelist) if piece.startswith("[")
               else [piece] for piece in pieces if piece]
    hosts.extend("".join(combo) for combo in itertools.product(*choices))
  return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
  """'2(x3),1' -> [2, 2, 2, 1] (the SLURM_TASKS_PER_NODE format)."""
  counts: list[int] = []
  for part in tasks_per_node.split(","):
    match = re.fullmatch(r"\s*([0-9]+)(?:\(x([0-9]+)\))?\s*", part)
    if not match:
      raise ClusterError(
          f"Slurm: cannot parse tasks per node {tasks_per_node!r}: {part!r} is "
          "not N or N(xM).")
    counts.extend([int(match.group(1))] * int(match.group(2) or 1))
  return counts


def _slurm_int(env: Mapping[str, str], name: str) -> int:
  value = env[name]
  if not is_ascii_number(value.strip()):
    raise ClusterError(
        f"Slurm: {name}={value!r} is not a non-negative integer (ASCII digits); "
        "launch with srun, which sets it.")
  return int(value)


def _slurm_num_tasks(env: Mapping[str, str]) -> int | None:
  """Task count of the current step (srun) or else of the job."""
  for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
    if name in env:
      if (count := _slurm_int(env, name)) < 1:
        raise ClusterError(f"Slurm: {name}={env[name]!r} counts no task; launch with "
                           "srun --ntasks=N, which sets it.")
      return count
  return None


def _in_step(env: Mapping[str, str]) -> bool:
  """srun sets SLURM_STEP_* for its tasks; sbatch gives its script none of them."""
  return "SLURM_STEP_ID" in env or "SLURM_STEP_NUM_TASKS" in env


def running_under_srun(env: Mapping[str, str]) -> bool:
  """True for a task of an srun with more than one task: a worker of a Slurm cluster.

  Raises:
    ClusterError: the batch script of a job with several tasks. sbatch gives it SLURM_PROCID=0
      and the job's SLURM_NTASKS but no step: as worker 0 it would wait out
      runtime.startup_timeout_seconds for workers that never start.
  """
  if "SLURM_PROCID" not in env:
    return False
  num_tasks = _slurm_num_tasks(env)  # a garbled count fails: it is not a single process either
  if num_tasks is None or num_tasks < 2:
    return False
  if not _in_step(env):
    raise ClusterError(
        f"Slurm: this is the batch script of a {num_tasks}-task job (SLURM_NTASKS={num_tasks}, "
        "no SLURM_STEP_ID); start tfdp-train with srun (the batch script itself is one "
        "process), e.g. `srun tfdp-train ...`, as configs/cluster/slurm_*.sbatch do.")
  return True


def check_one_launcher(env: Mapping[str, str]) -> None:
  """tfdp-launch in each task of an srun: every task would start a group of its own, and each
  group's workers then refuse srun's layout. srun starts the workers itself."""
  num_tasks = _slurm_num_tasks(env) if "SLURM_PROCID" in env and _in_step(env) else None
  if num_tasks is not None and num_tasks >= 2:
    raise ClusterError(
        f"srun started tfdp-launch as task {env['SLURM_PROCID']} of {num_tasks}: each task would "
        f"start its own workers; let srun start them (`srun --ntasks={num_tasks} tfdp-train ...`, "
        "no tfdp-launch) or start one launcher (`srun --ntasks=1 tfdp-launch ...`).")


def check_tf_config_place(env: Mapping[str, str], place: str, rank: int, workers: int) -> None:
  """TF_CONFIG wins over Slurm, so under an srun with several tasks it must give each task the
  place srun gave it: one left in the environment gives every task the same index (one task then
  cannot bind the port the other took, the other waits out the start-up timeout). A TF_CONFIG a
  wrapper sets per task agrees, and is kept."""
  num_tasks = _slurm_num_tasks(env)
  if "SLURM_PROCID" not in env or not _in_step(env) or num_tasks is None or num_tasks < 2:
    return
  task = _slurm_int(env, "SLURM_PROCID")
  if (rank, workers) != (task, num_tasks):
    raise ClusterError(
        f"TF_CONFIG makes this task {place} (rank {rank} of {workers} workers) but srun started "
        f"it as task {task} of {num_tasks} (SLURM_PROCID={task}); TF_CONFIG wins over Slurm, so "
        "unset TF_CONFIG before srun to let tfdp read Slurm's layout, or set it per task "
        "(rank = SLURM_PROCID, one worker per task).")


def _tasks_on_this_node(env: Mapping[str, str]) -> int | None:
  """Tasks of this step on this node, or None if the env does not say."""
  name = next((name for name in ("SLURM_STEP_TASKS_PER_NODE",
                                 "SLURM_TASKS_PER_NODE") if name in env), None)
  if name is None:
    return None
  try:
    counts = expand_tasks_per_node(env[name])
  except ClusterError:
    return None
  if len(set(counts)) == 1:
    return counts[0]
  node = env.get("SLURM_NODEID", "")
  if is_ascii_number(node) and int(node) < len(counts):
    return counts[int(node)]
  return None


def slurm_task_gpus(env: Mapping[str, str]) -> str | None:
  """This Slurm task's CUDA_VISIBLE_DEVICES if it must share the node's GPUs.

  Tasks of one srun on a node that all see the same GPUs would each plan NCCL
  over all of them ('Duplicate GPU detected'). Like TF's SlurmClusterResolver,
  task SLURM_LOCALID of the L tasks on this node then takes the LOCALID-th
  block of G // L consecutive GPUs (G % L stay idle); unlike it, the ids are
  kept as listed (TF renumbers from 0, wrong for CUDA_VISIBLE_DEVICES=4,5,6,7).

  A task cannot see the other tasks' environment, so it splits only when
  nothing says Slurm already gave each task its own GPUs. When in doubt it
  returns None (leave CUDA_VISIBLE_DEVICES alone):
    - tfdp already narrowed this environment (TFDP_GPUS_ASSIGNED_BY is set);
    - CUDA_VISIBLE_DEVICES is unset or lists no GPU (nothing to share; GPUs
      Slurm did not allocate are not handed out);
    - SLURM_GPUS_PER_TASK is set, or SLURM_GPU_BIND is set to other than
      'none': Slurm binds GPUs per task itself;
    - SLURM_STEP_GPUS (else SLURM_JOB_GPUS) lists a different number of GPUs
      than CUDA_VISIBLE_DEVICES: this task already got a subset;
    - L (SLURM_STEP_TASKS_PER_NODE, else SLURM_TASKS_PER_NODE, the entry for
      SLURM_NODEID) is unknown or 1, or SLURM_LOCALID is not in 0..L-1;
    - fewer GPUs than tasks on this node (e.g. each task sees only the GPU it
      needs): nothing sensible to split.
  """
  if gpus_lib.ASSIGNED_BY_VAR in env:
    return None
  ids = gpus_lib.parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES", ""))
  if not ids:
    return None
  if "SLURM_GPUS_PER_TASK" in env or env.get("SLURM_GPU_BIND",
                                             "none").strip() != "none":
    return None
  step_gpus = env.get("SLURM_STEP_GPUS", env.get("SLURM_JOB_GPUS"))
  if step_gpus is not None and len(step_gpus.split(",")) != len(ids):
    return None
  tasks = _tasks_on_this_node(env)
  local_id = env.get("SLURM_LOCALID", "")
  if tasks is None or tasks < 2 or not is_ascii_number(local_id):
    return None
  if int(local_id) >= tasks or len(ids) < tasks:
    return None
  blocks = gpus_lib.split_gpus(ids, tasks, len(ids) // tasks)
  return ",".join(blocks[int(local_id)])


def pin_slurm_task_gpus(
    environ: MutableMapping[str, str] = os.environ) -> str | None:
  """Narrows CUDA_VISIBLE_DEVICES to this Slurm task's share, if it must.

  The one place that changes the environment for Slurm GPU sharing (see
  slurm_task_gpus for the rule). It must run before TensorFlow first touches
  a GPU: CUDA reads the variable once. Returns the new value, or None.
  """
  value = slurm_task_gpus(environ)
  if value is None:
    return None
  before = environ["CUDA_VISIBLE_DEVICES"]
  environ["CUDA_VISIBLE_DEVICES"] = value
  environ[gpus_lib.ASSIGNED_BY_VAR] = "slurm"
  print(f"tfdp: Slurm task {environ.get('SLURM_LOCALID')} on this node uses "
        f"CUDA_VISIBLE_DEVICES={value} of {before}.", file=sys.stderr,
        flush=True)
  return value


def slurm_workers(env: Mapping[str, str],
                  port_base: int | None = None) -> tuple[int, list[str]]:
  """(this task's rank, every worker's address) from the environment srun gives each task.

  Mirrors tf.distribute.cluster_resolver.SlurmClusterResolver with block task
  distribution: node k runs the next tasks-per-node[k] ranks, on ports
  port_base, port_base+1, ... (default: job_port_base, from SLURM_JOB_ID or
  TFDP_SLURM_PORT_BASE). Worker 0 is the chief. Unlike TF's resolver,
  nodes keep Slurm's nodelist order instead of being sorted by name, so ranks
  match SLURM_PROCID even for lists like 'node[9-10]'.

  Raises:
    ClusterError: a Slurm variable is missing or inconsistent (one line).
  """
  if "SLURM_PROCID" not in env:
    raise ClusterError("Slurm: SLURM_PROCID is not set; launch the tasks with "
                       "srun (or set TF_CONFIG instead).")
  num_tasks = _slurm_num_tasks(env)
  if num_tasks is None:
    raise ClusterError("Slurm: neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS "
                       "is set; launch with srun --ntasks=N.")
  # Step variables describe what srun actually started; prefer them in pairs.
  if "SLURM_STEP_NODELIST" in env:
    nodelist_var, per_node_vars = "SLURM_STEP_NODELIST", (
        "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
  elif "SLURM_JOB_NODELIST" in env or "SLURM_NODELIST" in env:
    nodelist_var = ("SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in env
                    else "SLURM_NODELIST")
    per_node_vars = ("SLURM_TASKS_PER_NODE",)
  else:
    raise ClusterError("Slurm: neither SLURM_STEP_NODELIST nor "
                       "SLURM_JOB_NODELIST is set; launch with srun.")
  hosts = expand_nodelist(env[nodelist_var])
  per_node_var = next((name for name in per_node_vars if name in env), None)
  if per_node_var is not None:
    tasks_per_node = expand_tasks_per_node(env[per_node_var])
  elif num_tasks % len(hosts) == 0:  # Even split is the only safe guess.
    per_node_var = "(even split)"
    tasks_per_node = [num_tasks // len(hosts)] * len(hosts)
  else:
    raise ClusterError(
        f"Slurm: SLURM_STEP_TASKS_PER_NODE is not set and {num_tasks} tasks do "
        f"not split evenly over {len(hosts)} nodes; use srun "
        "--ntasks-per-node.")
  if len(tasks_per_node) != len(hosts):
    raise ClusterError(
        f"Slurm: {nodelist_var} has {len(hosts)} nodes but {per_node_var} "
        f"describes {len(tasks_per_node)}; they must match: start tfdp-train "
        "with srun inside the allocation, which sets both.")
  if sum(tasks_per_node) != num_tasks:
    raise ClusterError(
        f"Slurm: {per_node_var} adds up to {sum(tasks_per_node)} tasks but "
        f"the task count is {num_tasks}; they must match: start tfdp-train "
        "with srun inside the allocation, which sets both.")
  most = max(tasks_per_node, default=0)
  if (port_base is None and most > JOB_PORT_SLOT and "SLURM_JOB_ID" in env
      and not env.get(PORT_BASE_VAR, "").strip()):  # into the next job id's block: collisions
    raise ClusterError(
        f"Slurm: {most} tasks on one node need {most} ports, more than a job's block of "
        f"{JOB_PORT_SLOT} (the next job id's block follows it); export {PORT_BASE_VAR} with "
        f"{most} free ports from it before srun, e.g. "
        f"{PORT_BASE_VAR}={JOB_PORT_FIRST + JOB_PORT_SLOTS * JOB_PORT_SLOT}.")
  if port_base is None:
    port_base = job_port_base(env)
  if max(tasks_per_node, default=0) and not (
      1 <= port_base and port_base + max(tasks_per_node) - 1 <= 65535):
    raise ClusterError(f"Slurm: port_base {port_base} leaves ports outside "
                       "1..65535; pick a port_base like 8888.")
  addresses = [f"{host}:{port_base + local_id}"
               for host, count in zip(hosts, tasks_per_node)
               for local_id in range(count)]
  rank = _slurm_int(env, "SLURM_PROCID")
  if rank >= num_tasks:
    raise ClusterError(f"Slurm: SLURM_PROCID {rank} is out of range for "
                       f"{num_tasks} tasks (0..{num_tasks - 1}); start tfdp-train "
                       "with srun, which sets SLURM_PROCID and the task count together.")
  duplicates = sorted(a for a, n in collections.Counter(addresses).items()
                      if n > 1)
  if duplicates:
    raise ClusterError(f"Slurm: nodelist repeats a node, giving duplicate "
                       f"address {duplicates[0]!r}; check {nodelist_var}.")
  _check_block_placement(env, rank, hosts, tasks_per_node)
  return rank, addresses


def _check_block_placement(env: Mapping[str, str], rank: int, hosts: list[str],
                           tasks_per_node: list[int]) -> None:
  """Ranks are numbered node by node (block distribution, as TF's SlurmClusterResolver); under
  `srun -m cyclic` (or plane) a task runs elsewhere, listens on another node's address and its
  peers reach the wrong process or none (a review). Checked where srun says where it runs."""
  node = next(k for k, end in enumerate(itertools.accumulate(tasks_per_node)) if rank < end)
  local_id = rank - sum(tasks_per_node[:node])
  placed = (env.get("SLURMD_NODENAME", hosts[node]), env.get("SLURM_LOCALID", str(local_id)))
  if placed != (hosts[node], str(local_id)):
    how = (f" (SLURM_DISTRIBUTION={env['SLURM_DISTRIBUTION']})"
           if env.get("SLURM_DISTRIBUTION") else "")
    raise ClusterError(
        f"Slurm: task {rank} runs as local task {placed[1]} on {placed[0]}{how}, but tfdp "
        f"numbers the workers node by node, which puts it on {hosts[node]} as local task "
        f"{local_id}; start the tasks with srun --distribution=block (srun's default).")
