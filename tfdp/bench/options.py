"""tfdp-bench's options: what the flags fill in, their lists, and every check made on them before
any TensorFlow process starts."""
from __future__ import annotations

import dataclasses
import re

from tfdp import config as config_lib
from tfdp import paths
from tfdp.bench import tta
from tfdp.errors import ConfigError, TfdpError

PROG = "tfdp-bench"
MODES = ("throughput", "scaling", "allreduce", "input", "tta")
DATA_CHOICES = ("synthetic", "cifar10")
HOSTS_CHOICES = ("loopback", "box")  # allreduce's workers: processes on 127.0.0.1, or a box
# of hosts (tfdp/bench/box.py: network namespaces, one address and one shaped link each)
LINK_RATE = re.compile(r"^[1-9][0-9]*(kbit|mbit|gbit)$")  # tc's units


MAX_TIMEOUT_SECONDS = 30 * 24 * 3600.0


class BenchError(TfdpError):
  """A measurement could not run; the message names which one and why."""


@dataclasses.dataclass
class BenchOptions:
  output_dir: str = "runs/bench"
  models: list[str] = dataclasses.field(default_factory=lambda: ["resnet20"])
  replicas: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
  global_batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [128])  # empty:
  # the --config_file job's own
  steps: int = 20  # steps (or all-reduce ops) per timed block
  warmup_steps: int = 5
  repeats: int = 3  # timed blocks; the median is reported
  data: str = "synthetic"
  config_files: list[str] = dataclasses.field(default_factory=list)  # a job from configs instead
  # of the model x data grid (e.g. configs/shakespeare_mlm.yaml): its model, data and task
  params_override: list[str] = dataclasses.field(default_factory=list)
  baseline: bool = True  # throughput: also time plain Keras model.fit
  workers: int = 2  # scaling: 1..workers; allreduce: the group size
  per_replica_batch: int = 64  # scaling
  min_bytes: int = 4 << 10  # allreduce sizes: min_bytes * size_factor**k <= max_bytes
  max_bytes: int = 64 << 20
  size_factor: int = 4
  pack_tensors: int = 256  # allreduce bytes_per_pack test: a list of this many tensors ...
  pack_tensor_bytes: int = 64 << 10  # ... of this size each (16 MiB in all by default)
  bytes_per_pack: list[int] = dataclasses.field(default_factory=lambda: [0, 4 << 20])
  tcp_bytes: int = 256 << 20
  timeout_seconds: float = 1800.0  # per measurement: one process, or one worker group
  hosts: str = "loopback"  # allreduce: where the workers run (HOSTS_CHOICES)
  link_rate: str = ""  # hosts=box: every host's link shaped to this rate ("" unshaped)
  targets: list[float] = dataclasses.field(default_factory=lambda: [0.6, 0.7, 0.8])  # tta
  runs: list[str] = dataclasses.field(default_factory=lambda: list(tta.RUNS))  # tta


def _parse_number_list(text: str, flag: str, kind: type, what: str) -> list:
  try:
    values = [kind(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise ConfigError(f"--{flag} must be {what} separated by commas, got '{text}'.") from None
  if not values:
    raise ConfigError(f"--{flag} is empty; give at least one number.")
  return values


def parse_int_list(text: str, flag: str) -> list[int]:
  """`1,2,4` → [1, 2, 4]; one line naming the flag otherwise."""
  return _parse_number_list(text, flag, int, "whole numbers")


def parse_float_list(text: str, flag: str) -> list[float]:
  """`0.6,0.7` → [0.6, 0.7]; one line naming the flag otherwise."""
  return _parse_number_list(text, flag, float, "numbers")


def parse_name_list(text: str) -> list[str]:
  return [v.strip() for v in text.split(",") if v.strip()]


def check_options(mode: str, opts: BenchOptions) -> None:
  """Every flag mistake fails here, before any TensorFlow process starts."""
  if mode not in MODES:
    raise ConfigError(f"--mode '{mode}' is unknown; use one of {', '.join(MODES)}.")
  if opts.data not in DATA_CHOICES:
    raise ConfigError(f"--data '{opts.data}' is unknown; use one of {', '.join(DATA_CHOICES)}.")
  if mode == "tta":
    check_tta_flags(opts)
    opts.config_files = opts.config_files or [paths.default_job()]  # tfdp-train's rule
  if opts.config_files:
    opts.config_files = [paths.find_config(f) for f in opts.config_files]
    opts.models = [config_lib.load_config(opts.config_files,  # the name a cell reports
                                          list(opts.params_override)).task.model.name]
  if opts.config_files and opts.baseline and mode == "throughput":
    raise ConfigError("--baseline times the --models x --data grid in plain Keras, not a "
                      "--config_file job; add --nobaseline.")
  if not opts.models:  # names are checked with each config (task.model.module may register more)
    raise ConfigError("--models is empty; name at least one model, e.g. resnet20.")
  for flag in ("steps", "repeats", "workers", "per_replica_batch", "min_bytes", "max_bytes",
               "pack_tensors", "pack_tensor_bytes", "tcp_bytes", "timeout_seconds"):
    if getattr(opts, flag) <= 0:
      raise ConfigError(f"--{flag} is {getattr(opts, flag)}; it must be > 0.")
  if not opts.timeout_seconds <= MAX_TIMEOUT_SECONDS:  # nan, inf: a traceback (a probe)
    raise ConfigError(f"--timeout_seconds is {opts.timeout_seconds}; use a number of seconds up "
                      f"to {MAX_TIMEOUT_SECONDS:.0f} (30 days).")
  if opts.warmup_steps < 0:
    raise ConfigError(f"--warmup_steps is {opts.warmup_steps}; it must be >= 0.")
  for flag in ("replicas", "global_batch_sizes"):
    if any(v <= 0 for v in getattr(opts, flag)):
      raise ConfigError(f"--{flag} has a value <= 0; use positive numbers.")
  if any(v < 0 for v in opts.bytes_per_pack):
    raise ConfigError("--bytes_per_pack has a negative value; use 0 (one pack) or a byte count.")
  if mode == "allreduce":
    if opts.workers < 2:
      raise ConfigError("--workers must be >= 2 for allreduce: one process has nothing to reduce with.")
    if opts.size_factor < 2 or opts.min_bytes > opts.max_bytes:
      raise ConfigError("allreduce sizes need --size_factor >= 2 and --min_bytes <= --max_bytes.")
    if any(v % 4 for v in (opts.min_bytes, opts.pack_tensor_bytes)):
      raise ConfigError("--min_bytes and --pack_tensor_bytes must be multiples of 4 (float32).")
  check_box_flags(mode, opts)


def check_box_flags(mode: str, opts: BenchOptions) -> None:
  if opts.hosts not in HOSTS_CHOICES:
    raise ConfigError(f"--hosts '{opts.hosts}' is unknown; use one of {', '.join(HOSTS_CHOICES)}.")
  if opts.link_rate and not LINK_RATE.match(opts.link_rate):
    raise ConfigError(f"--link_rate '{opts.link_rate}' is not a rate; write e.g. 100mbit or 1gbit "
                      "(empty: unshaped).")
  if opts.hosts == "loopback":
    if opts.link_rate:
      raise ConfigError("--link_rate shapes the links of a box of hosts; add --hosts=box.")
    return
  if mode != "allreduce":
    raise ConfigError(f"--hosts=box measures --mode=allreduce only, not --mode={mode}; "
                      "benchmarks/cluster_scaling.py trains across a box.")


def check_tta_flags(opts: BenchOptions) -> None:
  if not opts.targets or any(not 0 < t < 1 for t in opts.targets):
    raise ConfigError(f"--targets {opts.targets} must be accuracies between 0 and 1 (exclusive), "
                      "e.g. --targets=0.6,0.7,0.8.")
  unknown = [r for r in opts.runs if r not in tta.RUNS]
  if unknown or not opts.runs or len(set(opts.runs)) != len(opts.runs):
    raise ConfigError(f"--runs '{','.join(opts.runs)}' must name each run once, from "
                      f"{', '.join(tta.RUNS)}.")
