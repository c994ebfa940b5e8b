"""The benchmarked jobs: the config overrides of every cell and every tta run, each checked before
anything runs (one bad cell must not waste the others), and the cell specs the parent sends."""
from __future__ import annotations

import os

from tfdp import config as config_lib
from tfdp.bench import tta
from tfdp.bench.options import BenchOptions
from tfdp.core import data as data_lib
from tfdp.core import task as tasks
from tfdp.errors import ConfigError

# The Keras baseline runs model.fit on one device, whatever the user's overrides say.
ONE_DEVICE = ["runtime.strategy=default", "runtime.cpu_replicas=0", "runtime.devices=[]"]
# Scaling's workers are one replica each, and so is its 1-worker reference, whatever the config
# file says (configs/base.yaml sets cpu_replicas: 2): else efficiency compares 2 replicas with N.
ONE_REPLICA_PER_WORKER = ["runtime.strategy=auto", "runtime.cpu_replicas=1"]


def data_overrides(data: str) -> list[str]:
  if data == "cifar10":  # tfdp's default train_data: TFDS cifar10 "train", augmented
    return ["task.train_data.source=tfds", "task.train_data.name=cifar10"]
  # Small enough that the warm-up fills the cache: the timed window is the steady state.
  return ["task.train_data.source=synthetic", "task.train_data.num_examples=1024",
          "task.train_data.image_size=32", "task.train_data.num_classes=10"]


def job_overrides(opts: BenchOptions, model: str, global_batch: int, extra: list[str]) -> list[str]:
  """The benchmarked job: user overrides win over the grid, except what the setup step needs.
  With --config_file the configs give model, data and task; the grid sets batch and replicas."""
  grid = [] if opts.config_files else [f"task.model.name={model}", *data_overrides(opts.data),
                                       "task.train_data.augment=true"]
  base = [*grid, f"trainer.global_batch_size={global_batch}",
          "trainer.learning_rate.schedule=constant", *extra]
  # The cell builds the experiment and times the trainer's own loop on fresh iterators.
  setup = ["trainer.epochs=1", "trainer.export_model=false"]
  return base + list(opts.params_override) + setup


def load_checked(overrides: list[str], replicas: int | None = None,
                 config_files: list[str] = ()) -> config_lib.ExperimentConfig:
  """The checks a cell would fail on, made up front: one bad cell must not waste the others."""
  config = config_lib.load_config(list(config_files), overrides)
  if replicas:
    data_lib.check_batch_divides(config, replicas)
    from tfdp.distributed import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
    strategy_lib.check_jit_compile(config.runtime, replicas, "--replicas")
  tasks.task_class(config.task.name).check_source(config.task.train_data, "task.train_data")
  return config


def replica_grid(opts: BenchOptions) -> dict[tuple[str, int, int], list[str]]:
  """(model, global batch, replicas) → overrides, every one checked before anything runs."""
  jobs = {}
  # A job from --config_file keeps its own global batch unless --global_batch_sizes names others.
  batches = opts.global_batch_sizes or [config_lib.load_config(
      list(opts.config_files), list(opts.params_override)).trainer.global_batch_size]
  for model in opts.models:
    for batch in batches:
      for replicas in opts.replicas:
        jobs[(model, batch, replicas)] = job_overrides(opts, model, batch,
                                                       [f"runtime.cpu_replicas={replicas}"])
        load_checked(jobs[(model, batch, replicas)], replicas, opts.config_files)
  return jobs


def scaling_jobs(opts: BenchOptions) -> dict[tuple[str, int], list[str]]:
  """(model, workers) → overrides: one thread and one replica per worker (auto: the default
  strategy alone, multi_worker_mirrored for several), a fixed per-replica batch."""
  threads = ["runtime.intra_op_threads=1", "runtime.inter_op_threads=1"]
  # Forced after the user's overrides too: the efficiency column is only true with 1 replica each.
  jobs = {(m, n): job_overrides(opts, m, opts.per_replica_batch * n, threads)
          + ONE_REPLICA_PER_WORKER
          for m in opts.models for n in range(1, opts.workers + 1)}
  for (_, n), overrides in jobs.items():
    load_checked(overrides, n, opts.config_files)
  return jobs


def train_spec(opts: BenchOptions, overrides: list[str], model_dir: str, measure: list[str]) -> dict:
  return {"kind": "train", "config_files": opts.config_files, "overrides": overrides,
          "model_dir": model_dir, "measure": measure,
          "warmup": opts.warmup_steps, "steps": opts.steps, "repeats": opts.repeats}


def keras_fit_spec(opts: BenchOptions, model: str, batch: int, model_dir: str) -> dict:
  """The Keras baseline of one grid cell: one warm-up epoch, then --repeats epochs of --steps."""
  overrides = job_overrides(opts, model, batch, ONE_DEVICE) + ONE_DEVICE
  return {"kind": "keras_fit", "config_files": [], "overrides": overrides, "model_dir": model_dir,
          "steps": opts.steps, "repeats": opts.repeats}


def allreduce_sizes(opts: BenchOptions) -> list[int]:
  sizes, size = [], opts.min_bytes
  while size <= opts.max_bytes:
    sizes.append(size)
    size *= opts.size_factor
  return sizes


def allreduce_jobs(opts: BenchOptions) -> tuple[list[str], list[str]]:
  """Overrides between worker processes (ring over gRPC) and between replicas of one process."""
  user = list(opts.params_override)
  # bytes_per_pack is set per call in the pack test; a strategy-wide value would override 0.
  workers_cfg = user + ["runtime.strategy=multi_worker_mirrored", "runtime.all_reduce=ring",
                        "runtime.bytes_per_pack=0"]
  local_cfg = user + ["runtime.strategy=mirrored", f"runtime.cpu_replicas={opts.workers}"]
  for overrides in (workers_cfg, local_cfg):
    config_lib.load_config([], overrides)
  return workers_cfg, local_cfg


def tta_jobs(opts: BenchOptions) -> dict[str, list[str]]:
  """run → its overrides, every config checked before anything runs."""
  jobs = {}
  for run in opts.runs:
    jobs[run] = list(opts.params_override) + tta.run_overrides(run)
    config = config_lib.load_config(opts.config_files, jobs[run])
    if run != "tfdp" and config.task.name != "image_classification":
      raise ConfigError(f"the Keras baselines of --mode=tta train image classifiers, but this "
                        f"config's task is '{config.task.name}'; pass --runs=tfdp.")
    if config.trainer.max_steps:
      raise ConfigError("trainer.max_steps cuts an epoch short, and --mode=tta compares whole "
                        "epochs; set trainer.max_steps=0 and choose trainer.epochs.")
    for key in ("train_data", "eval_data"):  # every epoch evaluates
      tasks.task_class(config.task.name).check_source(getattr(config.task, key), f"task.{key}")
    from tfdp.distributed import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
    replicas = strategy_lib.expected_replicas(config.runtime)
    if replicas:
      data_lib.check_batch_divides(config, replicas)
  return jobs


def tta_spec(opts: BenchOptions, run: str, overrides: list[str], model_dir: str) -> dict:
  return {"kind": "tta", "run": run, "config_files": opts.config_files, "overrides": overrides,
          "model_dir": os.path.join(model_dir, run)}
