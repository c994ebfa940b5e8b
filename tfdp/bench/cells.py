"""What runs inside a child process (`python -m tfdp.bench CELL_JSON`): one measurement, whose
result is printed as one line (processes.RESULT_PREFIX + JSON). Each cell builds tfdp's own
config, strategy, data, model and trainer; TensorFlow starts here, never in the parent.

  train      Trainer.run_steps on the real pipeline, on one cached batch, and the pipeline alone
  keras_fit  plain single-device Keras `model.fit` on the same experiment: the throughput baseline
  allreduce  all-reduce SUM of float32 tensors between replicas, per size and bytes_per_pack
  tta        one time-to-accuracy run (tta.run_cell)
"""
from __future__ import annotations

import json
import math
import os
import resource
import statistics
import time
from typing import Any, Callable

from tfdp import config as config_lib
from tfdp.bench import tta
from tfdp.bench.options import PROG, BenchError
from tfdp.bench.processes import RESULT_PREFIX
from tfdp.distributed.cluster import Cluster
from tfdp.errors import TfdpError

MAX_BLOCK_BYTES = 256 << 20  # caps all-reduce ops per timed block, so 64 MiB sizes take seconds


def ops_per_block(size: int, wanted: int) -> int:
  return max(1, min(wanted, MAX_BLOCK_BYTES // size))


# What one example of a task is: the rows' examples_per_sec and the reports' labels say it.
EXAMPLE_UNITS = {"image_classification": "images", "masked_lm": "sequences",
                 "text_classification": "sequences", "matrix_factorization": "ratings",
                 "retrieval": "pairs"}


def example_unit(task_name: str) -> str:
  return EXAMPLE_UNITS.get(task_name, "examples")  # a user's own task


def describe_data(data: config_lib.DataConfig) -> str:
  return data.source if data.source != "tfds" else f"{data.name}:{data.split}"


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _median_ms(seconds: list[float], ops: int) -> float:
  return statistics.median(seconds) / ops * 1000.0


def _time_blocks(run: Callable[[int], Any], warmup: int, steps: int, repeats: int) -> list[float]:
  if warmup:
    run(warmup)
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    run(steps)
    seconds.append(time.perf_counter() - start)
  return seconds


def _run_loops(trainer, iterator, num_steps: int) -> None:
  """num_steps training steps as tfdp-train runs them: steps_per_loop steps per compiled call."""
  per_call = trainer.config.trainer.steps_per_loop
  while num_steps > 0:
    trainer.run_steps(iterator, min(per_call, num_steps))
    num_steps -= per_call


def _wait_for_peers(folder: str, count: int, timeout: float = 600.0) -> None:
  """A file barrier: this process's file in `folder`, then wait until `count` are there."""
  import uuid  # pylint: disable=g-import-not-at-top
  with open(os.path.join(folder, uuid.uuid4().hex), "w"):
    pass
  deadline = time.monotonic() + timeout
  while len(os.listdir(folder)) < count:
    if time.monotonic() > deadline:
      raise BenchError(f"{count} processes were to start timing together; "
                       f"{len(os.listdir(folder))} came in {timeout:.0f}s.")
    time.sleep(0.02)


def _flops(exp) -> dict:
  """The model's training FLOPs per example and the peak of the devices this cell trains on."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.core import flops  # pylint: disable=g-import-not-at-top
  per_example, peak, how = flops.trainer_flops_and_peak(
      exp.trainer, lambda: exp.train_dataset_fn(epochs=1)(
          tf.distribute.InputContext()).element_spec)
  return {"train_flops_per_example": per_example, "peak_flops": peak, "peak_how": how,
          "precision": exp.trainer.precision}


def _build(spec: dict, cluster: Cluster):
  """tfdp's whole flow, built once: strategy, data plan, task, model, trainer."""
  from tfdp.core import experiment  # pylint: disable=g-import-not-at-top  (starts TensorFlow)
  config = config_lib.load_config(spec.get("config_files", []), spec["overrides"])
  return experiment.build(config, spec["model_dir"], "train", cluster=cluster, verbose=False)


def train_cell(spec: dict, cluster: Cluster) -> dict:
  """Times Trainer.run_steps on the real pipeline, on one cached batch, and the pipeline alone."""
  # The cell times the trainer's own compiled loop on the experiment's own input pipeline.
  exp = _build(spec, cluster)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  config, trainer, replicas, plan = exp.config, exp.trainer, exp.replicas, exp.train_plan
  data_cfg, batch = config.task.train_data, plan.global_batch
  # At least one untimed step per fresh iterator: it traces, and it fills shuffle buffers.
  warmup, steps, repeats = max(spec["warmup"], 1), spec["steps"], spec["repeats"]
  num_pipelines = plan.num_pipelines
  source = plan.source
  epochs = math.ceil((warmup + steps * repeats) / plan.steps_per_epoch) + 1
  dataset_fn = exp.train_dataset_fn(epochs=epochs)

  def time_training(fn) -> list[float]:
    iterator = iter(trainer.strategy.distribute_datasets_from_function(fn))
    run = lambda n: _run_loops(trainer, iterator, n)
    run(warmup)
    if spec.get("start_together"):  # independent processes time one window (cluster_scaling)
      _wait_for_peers(**spec["start_together"])
    return _time_blocks(run, 0, steps, repeats)

  out = {"model": config.task.model.name, "data": describe_data(data_cfg),
         "image_size": source.image_shape[0] if source.image_shape else 0,
         "strategy": exp.strategy_plan.kind,
         "replicas": replicas, "global_batch": batch,
         "num_workers": cluster.num_workers, "rank": cluster.rank, "steps": steps,
         "repeats": repeats}
  if "pipeline" in spec["measure"]:
    # The per-pipeline tf.data dataset alone: one training step takes replicas_per_pipeline batches.
    ctx = tf.distribute.InputContext(num_pipelines, max(cluster.rank, 0), replicas)
    iterator = iter(dataset_fn(ctx))

    def pull(n: int) -> None:
      for _ in range(n * plan.replicas_per_pipeline * plan.accumulation_steps):
        next(iterator)

    seconds = _time_blocks(pull, warmup, steps, repeats)
    out["pipeline_examples_per_sec"] = steps * plan.step_batch / statistics.median(seconds)
  seconds = time_training(dataset_fn)
  out.update(step_ms=_median_ms(seconds, steps), step_ms_min=min(seconds) / steps * 1000,
             step_ms_max=max(seconds) / steps * 1000,
             examples_per_sec=steps * batch / statistics.median(seconds))
  if config.task.name in ("masked_lm", "text_classification"):  # examples are sequences
    out["tokens_per_sec"] = out["examples_per_sec"] * config.task.text.sequence_length
  if "cached" in spec["measure"]:
    # The same loop fed one cached batch: what a step costs when input never waits.
    cached = time_training(lambda ctx: dataset_fn(ctx).take(1).cache().repeat())
    out["cached_step_ms"] = _median_ms(cached, steps)
    out["input_wait_fraction"] = max(0.0, 1.0 - out["cached_step_ms"] / out["step_ms"])
  out["peak_rss_mb"] = _peak_rss_mb()
  # What a step all-reduces: float32 bytes of every trainable variable (tfdp reduces them all).
  out["gradient_bytes"] = 4 * sum(v.shape.num_elements() for v in trainer.model.trainable_variables)
  return {**out, **_flops(exp), "unit": example_unit(config.task.name)}


def keras_fit_cell(spec: dict, cluster: Cluster) -> dict:
  """Plain single-device Keras `model.fit`, the yardstick tfdp's loop is held against: the same
  experiment (model builder, batches, global batch, precision, threads, seed; one device), SGD
  with the config's settings, Keras' defaults otherwise (one step per call). One warm-up epoch
  (tracing) is not timed, then spec["repeats"] epochs of spec["steps"] steps are."""
  exp = _build(spec, cluster)
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  config, plan, model = exp.config, exp.train_plan, exp.trainer.model
  steps_per_epoch, epochs, batch = spec["steps"], spec["repeats"], plan.global_batch
  data_epochs = math.ceil((epochs + 1) * steps_per_epoch / plan.steps_per_epoch) + 1
  dataset = tta.keras_batches(exp.train_dataset_fn(epochs=data_epochs)(
      tf.distribute.InputContext()), exp.task)  # the same batches, as model.fit takes them
  opt, lr = config.trainer.optimizer, config.trainer.learning_rate
  model.compile(
      optimizer=keras.optimizers.SGD(lr.base_lr * batch / lr.base_batch_size,
                                     momentum=opt.momentum, nesterov=opt.nesterov,
                                     weight_decay=opt.weight_decay or None),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
      jit_compile=config.runtime.jit_compile, steps_per_execution=1)
  seconds: list[float] = []
  # tfdp's own loop on this one-device experiment, timed between Keras's epochs (A, B, A, B in
  # one process): the 1-device ratio then sees the same load, which separate cells do not.
  tfdp_iterator = iter(exp.trainer.strategy.distribute_datasets_from_function(
      exp.train_dataset_fn(epochs=data_epochs)))
  tfdp_seconds: list[float] = []

  class EpochTimer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
      self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
      seconds.append(time.perf_counter() - self.start)
      start = time.perf_counter()
      _run_loops(exp.trainer, tfdp_iterator, steps_per_epoch)  # the first traces, as Keras's
      tfdp_seconds.append(time.perf_counter() - start)

  model.fit(dataset, epochs=epochs + 1, steps_per_epoch=steps_per_epoch, callbacks=[EpochTimer()],
            verbose=0, shuffle=False)
  timed = seconds[1:]  # the first epoch traces and fills caches
  step_ms = [t / steps_per_epoch * 1000 for t in timed]
  tfdp_step_ms = statistics.median(tfdp_seconds[1:]) / steps_per_epoch * 1000
  return {"model": config.task.model.name, "data": describe_data(config.task.train_data),
          "image_size": plan.source.image_shape[0], "global_batch": batch,
          "steps_per_epoch": steps_per_epoch, "timed_epochs": len(timed),
          "examples_per_sec": batch / statistics.median(step_ms) * 1000,
          "step_ms": statistics.median(step_ms), "step_ms_min": min(step_ms),
          "step_ms_max": max(step_ms), "tfdp_interleaved_step_ms": tfdp_step_ms,
          "peak_rss_mb": _peak_rss_mb(), **_flops(exp), "unit": example_unit(config.task.name)}


def allreduce_cell(spec: dict, cluster: Cluster) -> dict:
  """All-reduce SUM of float32 (and runtime.all_reduce_dtype) tensors via strategy.run + the
  replica context, timed per size."""
  from tfdp.distributed import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.load_config([], spec["overrides"])
  strategy, plan = strategy_lib.make_strategy(config.runtime, cluster)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  n = strategy.num_replicas_in_sync
  warmup, steps, repeats = spec["warmup"], spec["steps"], spec["repeats"]

  def reducer(options=None):
    def replica_fn(value):
      # identity places the input on this replica's device (no copy): a function argument has
      # no device, and the all-reduce needs one as its destination.
      value = tf.nest.map_structure(tf.identity, value)
      return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value,
                                                            options=options)

    @tf.function(autograph=False)
    def all_reduce(values):
      return strategy.run(replica_fn, args=(values,))
    return all_reduce

  def measure(shapes: list[int], fn, dtype=tf.float32) -> float:
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.ones([k], dtype) for k in shapes])
    nbytes = dtype.size * sum(shapes)

    def run(ops: int):
      for _ in range(ops):
        result = fn(values)
      return float(tf.nest.flatten(strategy.experimental_local_results(result))[0][0])

    if run(max(1, ops_per_block(nbytes, warmup))) != n:  # the sum of n ones: it really reduced
      raise BenchError(f"all-reduce of {nbytes} bytes over {n} replicas returned a wrong sum.")
    block = ops_per_block(nbytes, steps)
    return statistics.median(_time_blocks(run, 0, block, repeats)) / block

  plain = reducer()
  # runtime.all_reduce_dtype=bfloat16: each size's float32 gradient also as it crosses then,
  # the same elements in half the bytes, measured in this same run.
  dtypes = [tf.float32] + ([tf.as_dtype(config.runtime.all_reduce_dtype)]
                           if config.runtime.all_reduce_dtype != "float32" else [])
  sizes = [{"bytes": s * dtype.size // 4, "dtype": dtype.name,
            "seconds": measure([s // 4], plain, dtype)} for s in spec["sizes"] for dtype in dtypes]
  packs = []
  if spec["pack"]:
    shapes = [spec["pack_tensor_bytes"] // 4] * spec["pack_tensors"]
    for bytes_per_pack in spec["bytes_per_pack"]:
      options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=bytes_per_pack)
      packs.append({"bytes": 4 * sum(shapes), "num_tensors": len(shapes),
                    "bytes_per_pack": bytes_per_pack, "seconds": measure(shapes, reducer(options))})
  return {"replicas": n, "implementation": plan.all_reduce or plan.cross_device_ops or "none",
          "sizes": sizes, "packs": packs, "peak_rss_mb": _peak_rss_mb()}


# Each cell gets the cluster cell_main resolved once (the cell builds on it, then leaves with it).
CELLS: dict[str, Callable[[dict, Cluster], dict]] = {
    "train": train_cell, "keras_fit": keras_fit_cell, "allreduce": allreduce_cell,
    "tta": tta.run_cell}


def cell_main(argv: list[str]) -> None:
  from tfdp import cli  # pylint: disable=g-import-not-at-top
  if len(argv) != 2:
    cli.exit_with_error(PROG, "usage: python -m tfdp.bench CELL_JSON (tfdp-bench runs this itself).")
  cli.quiet_tensorflow()
  from tfdp.distributed import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  try:
    spec = json.loads(argv[1])
    cluster = cluster_lib.resolve_cluster()
    result = CELLS[spec["kind"]](spec, cluster)
  except TfdpError as error:
    cli.exit_with_error(PROG, error)
  print(RESULT_PREFIX + json.dumps(result), flush=True)
  cluster_lib.leave_together(cluster)  # a group's cells: none leaves early
  cli.exit_now(0)  # no iterator teardown: a trained Controller keeps its iterator (see there)
