"""Which GPUs each local worker may use: one CUDA_VISIBLE_DEVICES per process.

Several training processes on one host that all see every GPU each plan NCCL
over all of them: TensorFlow then fails with 'Duplicate GPU detected', or the
GPUs are oversubscribed. The launcher therefore gives every local worker its
own block of GPUs through CUDA_VISIBLE_DEVICES (cluster.py does the same for
Slurm tasks that share a node).

Plain Python on purpose, no TensorFlow: CUDA reads CUDA_VISIBLE_DEVICES once,
when a process first touches a GPU, so the value has to be decided before any
worker starts TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence

from tfdp.errors import ClusterError

AUTO = -1  # --gpus_per_worker=auto: split the visible GPUs evenly.
# Set in a process whose CUDA_VISIBLE_DEVICES tfdp already narrowed, so that it
# is not split a second time (e.g. resolve_cluster called twice under Slurm).
ASSIGNED_BY_VAR = "TFDP_GPUS_ASSIGNED_BY"
_DEVICE_FILE = re.compile(r"nvidia[0-9]+")
_GPU_ID = re.compile(r"[0-9]+|(GPU|MIG)-\S+")


def parse_gpus_per_worker(value: int | str) -> int:
  """'auto' or -1 -> AUTO; '0' -> 0 (CPU only); 'N' -> N GPUs per worker."""
  text = str(value).strip().lower()
  if text in ("auto", "-1"):
    return AUTO
  if not re.fullmatch(r"[0-9]+", text):  # ASCII only: int() rejects "²", which isdigit() takes
    raise ClusterError(
        f"--gpus_per_worker must be auto, 0 (CPU only) or a positive number of "
        f"GPUs per worker, got {value!r}; e.g. --gpus_per_worker=auto.")
  return int(text)


def parse_visible_devices(text: str) -> list[str]:
  """GPU ids in a CUDA_VISIBLE_DEVICES value, as given (ordinals or UUIDs).

  CUDA stops at the first entry that is not a GPU ordinal or a GPU-/MIG- UUID
  and ignores the rest, which is why '-1' or '' hide every GPU; this follows it.
  """
  ids = []
  for entry in text.split(","):
    entry = entry.strip()
    if not _GPU_ID.fullmatch(entry):
      break
    ids.append(entry)
  return ids


def count_nvidia_device_files(dev_dir: str = "/dev") -> int:
  """How many /dev/nvidiaN files: the GPUs seen without CUDA_VISIBLE_DEVICES."""
  try:
    names = os.listdir(dev_dir)
  except OSError:
    return 0
  return sum(1 for name in names if _DEVICE_FILE.fullmatch(name))


def visible_gpus(env: Mapping[str, str],
                 num_device_files: int) -> tuple[list[str], str]:
  """The launcher's GPU ids and, for messages, where they came from.

  CUDA_VISIBLE_DEVICES wins if set (ids kept as given, so '4,5' stays 4 and 5);
  else CUDA numbers the device files 0..N-1, even in a container that only
  shows e.g. /dev/nvidia2 and /dev/nvidia3.
  """
  if "CUDA_VISIBLE_DEVICES" in env:
    text = env["CUDA_VISIBLE_DEVICES"]
    return parse_visible_devices(text), f"CUDA_VISIBLE_DEVICES={text!r}"
  return ([str(index) for index in range(num_device_files)],
          f"{num_device_files} /dev/nvidiaN device file"
          f"{'s' if num_device_files != 1 else ''}")


def split_gpus(ids: Sequence[str], num_parts: int,
               per_part: int) -> list[list[str]]:
  """Consecutive blocks of `per_part` ids, one per part; the rest stay idle."""
  return [list(ids[part * per_part:(part + 1) * per_part])
          for part in range(num_parts)]


def _plural(count: int, word: str) -> str:
  return f"{count} {word}{'s' if count != 1 else ''}"


@dataclasses.dataclass(frozen=True)
class GpuPlan:
  """CUDA_VISIBLE_DEVICES for each local worker.

  Attributes:
    devices: Per worker, its CUDA_VISIBLE_DEVICES value ('' = CPU only), or
      None: the workers inherit the launcher's environment unchanged.
    visible: The GPU ids the launcher saw.
    idle: Visible GPUs that no worker got.
  """

  devices: list[str] | None
  visible: list[str] = dataclasses.field(default_factory=list)
  idle: list[str] = dataclasses.field(default_factory=list)

  def describe(self) -> str:
    """One log line on who got which GPUs; '' when no GPU is involved."""
    if self.devices is None or not self.visible:
      return ""
    if not any(self.devices):
      return (f"workers run on CPU (CUDA_VISIBLE_DEVICES=''); "
              f"{_plural(len(self.idle), 'visible GPU')} left idle.")
    line = "GPUs per worker (CUDA_VISIBLE_DEVICES): " + " ".join(
        f"w{index}={value}" for index, value in enumerate(self.devices))
    if self.idle:
      line += (f"; {_plural(len(self.idle), 'GPU')} left idle: "
               f"{','.join(self.idle)}.")
    return line


def plan_worker_gpus(num_workers: int, gpus_per_worker: int | str,
                     env: Mapping[str, str],
                     num_device_files: int) -> GpuPlan:
  """Decides every local worker's CUDA_VISIBLE_DEVICES.

  Args:
    num_workers: Local worker processes (>= 1).
    gpus_per_worker: AUTO (-1 or 'auto'): G // W consecutive GPUs each, or the
      env left unchanged if there are no GPUs; 0: every worker on CPU
      (CUDA_VISIBLE_DEVICES=''); N > 0: N GPUs each, N * W must fit.
    env: The launcher's environment; its CUDA_VISIBLE_DEVICES, if set, lists
      the GPUs to hand out.
    num_device_files: /dev/nvidiaN count, used when CUDA_VISIBLE_DEVICES is
      unset (see count_nvidia_device_files).

  Raises:
    ClusterError: too few GPUs for the workers (one line naming the fix).
  """
  if num_workers < 1:
    raise ValueError(f"num_workers must be at least 1, got {num_workers}")
  per_worker = parse_gpus_per_worker(gpus_per_worker)
  visible, source = visible_gpus(env, num_device_files)
  count = len(visible)
  workers = _plural(num_workers, "worker")
  if per_worker == 0:
    return GpuPlan([""] * num_workers, visible, visible)
  if per_worker == AUTO:
    if not count:  # A CPU run: keep whatever the launcher has, even ''.
      return GpuPlan(None)
    if count < num_workers:
      raise ClusterError(
          f"{workers} but only {_plural(count, 'GPU')} visible ({source}), "
          f"and every local worker needs its own GPU; use --num_workers "
          f"{count}, or --gpus_per_worker=0 to train on CPU.")
    per_worker = count // num_workers
  elif per_worker * num_workers > count:
    if count // num_workers:
      fix = f"use --gpus_per_worker={count // num_workers} (or auto), or "
    elif count >= per_worker:
      fix = f"use --num_workers {count // per_worker}, or "
    else:
      fix = "use "
    raise ClusterError(
        f"--gpus_per_worker={per_worker} with {workers} needs "
        f"{_plural(per_worker * num_workers, 'GPU')} but {count} "
        f"{'is' if count == 1 else 'are'} visible ({source}); {fix}"
        "--gpus_per_worker=0 to train on CPU.")
  blocks = split_gpus(visible, num_workers, per_worker)
  return GpuPlan([",".join(block) for block in blocks], visible,
                 visible[per_worker * num_workers:])
