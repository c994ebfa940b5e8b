"""Input pipelines: a Source of raw examples → per-replica batches (the readers: a registry).

A source reads raw examples (dicts); the task's `preprocess` turns each into the model's
features and labels. Every pipeline yields dict batches of a fixed per-replica size with a
"weight" entry: the last batches of an epoch are padded with weight-0 copies of the epoch's own
real examples (BatchNorm's batch statistics see real data), so every replica runs the same number
of steps with the same shapes (no empty or ragged final batch), and weighted sums count every
real example once. Data each worker reads alone (local) is the exception to equal shapes: each
worker's batch is its shards' share of the global batch (collectives need equal gradients only).
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import TYPE_CHECKING, Callable

from absl import logging

from tfdp.core import local_shards
from tfdp.core import padding
from tfdp.errors import ConfigError, DataError

if TYPE_CHECKING:  # annotations only: core.task imports this module, and config imports core.task
  from tfdp.config.schema import DataConfig, ExperimentConfig


# ---- sources ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Source:
  """Raw examples (dicts; images here: `{"image": uint8 HWC, "label": int64}`) split into files
  (shard units), and what a task needs to know to build its model from them."""
  file_counts: list[int]  # examples per file, in order
  read: Callable  # read(file_indices: list[int]) -> tf.data.Dataset of examples
  kind: str
  read_slice: Callable | None = None  # TFDS: read_slice(i, n) reads the i-th of n even splits
  num_classes: int = 0
  image_shape: tuple = ()
  info: dict = dataclasses.field(default_factory=dict)  # other facts (a vocabulary size, ...)
  # After a decode error inside tf.data (whose message names no file): the first file that
  # fails on its own, with TensorFlow's reason, or None.
  find_unreadable: Callable[[], str | None] | None = None
  # A local source: the data's index of each of its shard files (file_counts in that order, as
  # local_shards.map_shards decided); empty: the workers' files numbered in rank order.
  shards: tuple[int, ...] = ()

  @property
  def num_examples(self) -> int:
    return sum(self.file_counts)


# ---- sources: a registry of readers by `source` name -------------------------------------------

# The built-in readers live with their workload and are imported when first named (as tasks are):
# core knows no workload. A task that reads its own data (text, interactions) builds its Source in
# Task.build_source and needs no entry here.
_BUILTIN_SOURCES = {name: "tfdp.workloads.vision.sources"
                    for name in ("tfds", "image_folder", "tfrecord", "synthetic")}
_SOURCES: dict[str, "SourceReader"] = {}


@dataclasses.dataclass(frozen=True)
class SourceReader:
  check: Callable[[DataConfig, str], None]  # before TensorFlow starts: fail fast, one line
  make: Callable[[DataConfig], Source]


def register_source(name: str, check: Callable[[DataConfig, str], None],
                    make: Callable[[DataConfig], Source]) -> None:
  """`task.*_data.source: name` reads through `make` (after `check`)."""
  _SOURCES[name] = SourceReader(check, make)


def _reader(data: DataConfig) -> SourceReader | None:
  if data.source not in _SOURCES and data.source in _BUILTIN_SOURCES:
    importlib.import_module(_BUILTIN_SOURCES[data.source])  # registers its readers
  return _SOURCES.get(data.source)


def check_source(data: DataConfig, key: str) -> None:
  """Fails fast (no download, no retries) when a dataset is not where the config says. A source
  no reader is registered for is its task's to check (Task.check_source)."""
  reader = _reader(data)
  if reader is not None:
    reader.check(data, key)


def make_source(data: DataConfig) -> Source:
  reader = _reader(data)
  if reader is None:
    raise DataError(f"data source '{data.source}' has no reader; the task must build it "
                    "(Task.build_source).")
  reader.check(data, "data")
  return reader.make(data)



# ---- sharding and batching -------------------------------------------------------------------


def resolve_shard_policy(policy: str, source: Source, num_pipelines: int,
                         recorded: str | None = None, may_resize: bool = False) -> str:
  """TF's AUTO rule made explicit: shard files when every pipeline gets one, else elements;
  elements also where the group may change size (`may_resize`: tfdp-launch --min_workers) or a
  resumed run read elements (`recorded`: its sharding): they are one order on any worker count,
  whereas file shards cannot resume on another count mid-epoch (the launcher could not shrink).
  A source that holds only this worker's own data (a {worker} path) is `local`."""
  if source.kind == "local" or policy == "local":
    if source.kind != "local":
      raise DataError("shard_policy 'local' needs a source each worker reads alone: a path with "
                      "{worker}; use shard_policy auto or data.")
    return "local"
  if num_pipelines == 1:
    return "off"
  num_files = len(source.file_counts)
  if policy == "auto":
    if num_files < num_pipelines:
      return "data"
    if recorded in ("off", "data") or (recorded is None and may_resize):
      logging.info("data: shard_policy auto → data, not file: %s", "the run read one order of "
                   "elements" if recorded else "the group may resize (tfdp-launch --min_workers)")
      return "data"
    return "file"
  if policy == "file" and num_files < num_pipelines:
    raise DataError(f"shard_policy 'file' needs at least one file per worker, but the source has "
                    f"{num_files} file(s) for {num_pipelines} workers; use shard_policy data or auto.")
  if policy == "tfds_split" and source.kind != "tfds":
    raise DataError("shard_policy 'tfds_split' works with TFDS sources only; use data or file.")
  return policy


def shard_counts(policy: str, source: Source, num_pipelines: int) -> list[int]:
  """Real examples each input pipeline reads per epoch under the policy."""
  n = source.num_examples
  if policy in ("off", "local"):  # local: this worker's own count (the others' are exchanged)
    return [n] * num_pipelines
  if policy == "file":
    return [sum(source.file_counts[i::num_pipelines]) for i in range(num_pipelines)]
  return [len(range(i, n, num_pipelines)) for i in range(num_pipelines)]  # data, tfds_split


def per_replica_batch(key: str, batch: int, num_replicas: int) -> int:
  """The global batch is the user's number; every replica (and micro-step) gets the same padded
  shape: an equal share, or where none is whole the largest share (ceil), the rest weight-0
  padding. `num_replicas` here counts replicas x gradient accumulation steps."""
  if batch < 1:
    raise ConfigError(f"config key '{key}' is {batch}; use a positive batch size.")
  return -(-batch // num_replicas)


def describe_split(batch: int, num_replicas: int, accumulation: int = 1) -> str:
  """'per-replica batch 6 (16 over 3 replicas: 2 rows of padding per step)' (uneven), or
  'per-replica batch 4' (even)."""
  slots = num_replicas * accumulation
  per_replica = per_replica_batch("", batch, slots)
  if per_replica * slots == batch:
    return f"per-replica batch {per_replica}"
  over = f"{num_replicas} replica{'s' * (num_replicas != 1)}" + (
      f" x {accumulation} accumulation steps" if accumulation > 1 else "")
  padding = per_replica * slots - batch
  return (f"per-replica batch {per_replica} ({batch} over {over}: "
          f"{padding} row{'s' * (padding != 1)} of padding per step)")


# An uneven split gives pipelines unequal real shares of each step's block of the one global
# order; file and TFDS-split shards are no such order. Local data takes any global batch: each
# shard's rows per step are its own share (split_local_batch).
UNEVEN_POLICIES = ("off", "data", "local")


def _refuse_uneven(key: str, batch: int, slots: int, policy: str) -> None:
  if batch % slots and policy not in UNEVEN_POLICIES:
    lower = batch - batch % slots
    raise ConfigError(
        f"config key '{key}' is {batch}, which does not split evenly over {slots} replicas x "
        f"accumulation steps, and shard_policy {policy} cannot split it unevenly (each worker "
        f"reads its own shard, not its share of one global order); use a multiple of {slots} "
        f"such as {lower or slots}, or shard_policy data.")


def check_batch_divides(config: ExperimentConfig, num_replicas: int) -> None:
  """Before TensorFlow starts, where the replica count is known from the config alone (the
  input plan checks again, with the resolved shard policy, once the strategy is made)."""
  steps = config.trainer.gradient_accumulation_steps
  for key, batch, slots, data in (
      ("trainer.global_batch_size", config.trainer.global_batch_size, num_replicas * steps,
       config.task.train_data),
      ("trainer.eval_batch_size", config.trainer.eval_batch_size
       or config.trainer.global_batch_size, num_replicas, config.task.eval_data)):
    per_replica_batch(key, batch, slots)
    if data.shard_policy in ("file", "tfds_split"):
      _refuse_uneven(key, batch, slots, data.shard_policy)


@dataclasses.dataclass
class InputPlan:
  """What the trainer needs to know about one split, identical on every worker."""
  source: Source
  policy: str
  num_pipelines: int
  per_replica_batch: int
  replicas_per_pipeline: int
  steps_per_epoch: int  # optimizer steps
  counts: list[int]
  accumulation_steps: int = 1  # per-replica batches (micro-steps) per optimizer step
  # Real examples per optimizer step when they do not split evenly (the rest of each step is
  # weight-0 padding); 0: an even split, every row of a full step real.
  uneven_global_batch: int = 0
  # Local data: every shard's (rows per step, examples), by the data's shard index, and the
  # shards each pipeline reads; a pipeline's per-replica batch is its shards' rows per step over
  # its replicas x micro-steps (pipeline_replica_batch), so workers' batches differ.
  shard_batches: tuple[int, ...] = ()
  shard_counts: tuple[int, ...] = ()
  pipeline_shards: tuple[tuple[int, ...], ...] = ()

  def pipeline_replica_batch(self, pipeline: int) -> int:
    if not self.shard_batches:
      return self.per_replica_batch
    rows = sum(self.shard_batches[shard] for shard in self.pipeline_shards[pipeline])
    return max(-(-rows // (self.replicas_per_pipeline * self.accumulation_steps)), 1)

  @property
  def pipeline_batch(self) -> int:
    return self.per_replica_batch * self.replicas_per_pipeline

  @property
  def step_batch(self) -> int:
    """Examples one pipeline gives per optimizer step."""
    return self.pipeline_batch * self.accumulation_steps

  @property
  def global_batch(self) -> int:
    """Real examples per optimizer step (the trainer divides the summed loss by it)."""
    if self.shard_batches:
      return sum(self.shard_batches)
    return self.uneven_global_batch or self.step_batch * self.num_pipelines

  @property
  def padded_global_batch(self) -> int:
    """Rows per optimizer step, padding included."""
    return self.step_batch * self.num_pipelines

  def block_share(self, pipeline: int) -> tuple[int, int]:
    """Uneven split: (first, count) of the positions of each step's block of global_batch
    examples this pipeline reads; its replicas and micro-steps split them as evenly as whole
    rows allow (slot t of T: floor or ceil of count / T)."""
    slots = self.replicas_per_pipeline * self.accumulation_steps
    base, extra = divmod(self.global_batch, slots * self.num_pipelines)
    first_slot = pipeline * slots
    first = first_slot * base + min(first_slot, extra)
    return first, slots * base + min(max(extra - first_slot, 0), slots)


def plan_input(source: Source, data: DataConfig, global_batch: int, num_replicas: int,
               num_pipelines: int, batch_key: str = "trainer.global_batch_size",
               accumulation_steps: int = 1, local_counts: list | None = None,
               policy: str | None = None) -> InputPlan:
  """Decides once how one split is batched and sharded; the trainer takes its global batch and
  steps per epoch from the plan that shaped the batches. `local_counts`: every worker's
  (shard indices, examples per shard) of a local source (exchanged between workers), so all
  agree on each shard's rows per step and the steps per epoch instead of hanging in a
  collective. `policy`: resolve_shard_policy's answer where the caller decided it (a resume)."""
  policy = policy or resolve_shard_policy(data.shard_policy, source, num_pipelines)
  replicas_per_pipeline = num_replicas // num_pipelines
  if policy == "local":
    per_worker = local_counts or [(list(source.shards), list(source.file_counts))]
    pipeline_shards, shard_examples = local_shards.number_shards(per_worker)
    batches, steps = local_shards.split_local_batch(shard_examples, global_batch, batch_key)
    plan = InputPlan(source, policy, num_pipelines, 0, replicas_per_pipeline, steps,
                     [sum(counts) for _, counts in per_worker], accumulation_steps,
                     shard_batches=tuple(batches), shard_counts=tuple(shard_examples),
                     pipeline_shards=pipeline_shards)
    plan.per_replica_batch = max(map(plan.pipeline_replica_batch, range(num_pipelines)))
    return plan
  counts = shard_counts(policy, source, num_pipelines)
  slots = num_replicas * accumulation_steps
  _refuse_uneven(batch_key, global_batch, slots, policy)
  per_replica = per_replica_batch(batch_key, global_batch, slots)
  if per_replica * slots != global_batch:  # every step is block [k·G, (k+1)·G) of one order
    steps = math.ceil(source.num_examples / global_batch)
    return InputPlan(source, policy, num_pipelines, per_replica, replicas_per_pipeline,
                     max(steps, 1), counts, accumulation_steps, global_batch)
  steps = math.ceil(max(counts) / (per_replica * replicas_per_pipeline * accumulation_steps))
  return InputPlan(source, policy, num_pipelines, per_replica, replicas_per_pipeline, max(steps, 1),
                   counts, accumulation_steps)


def fits_in_memory(source: Source, num_examples: int, fraction: float = 0.5) -> bool:
  """Decoded uint8 images of one pipeline take at most `fraction` of the available memory
  (sources without images: counted as one byte per example)."""
  import psutil  # pylint: disable=g-import-not-at-top
  needed = num_examples * math.prod(source.image_shape)
  if needed <= fraction * psutil.virtual_memory().available:
    return True
  logging.warning("data: not caching %.1f GiB of decoded images: more than %d%% of free memory",
                  needed / 2**30, fraction * 100)
  return False


SHUFFLE_WHOLE_BYTES = 2 << 30  # a cached source up to this size shuffles in one buffer


def shuffle_buffer(source: Source, data: DataConfig) -> int:
  """The shuffle buffer, from the config and the data alone: sized from a process's free memory
  (as it once was), workers with less free memory shuffled into another order, which under
  shard_policy data duplicates some examples and drops others. At least 1: an empty local shard
  still takes part (every step is padding for it)."""
  if data.shuffle_buffer:
    return data.shuffle_buffer
  whole = data.cache and source.num_examples * math.prod(source.image_shape) <= SHUFFLE_WHOLE_BYTES
  return max(source.num_examples if whole else 10000, 1)


_EPOCH_STRIDE = 1000003  # one seed's epochs never reach the next seed's


def epoch_seed(seed, epoch):
  """One epoch's seed (its shuffles, and the first half of each example's stateless seed)."""
  return seed * _EPOCH_STRIDE + epoch


def seed_parts(stateless_seed):
  """From a preprocess stateless seed (its seed[0] is epoch_seed(seed, epoch)): the run's seed,
  and 0 or 1, alternating from one epoch to the next."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  first = tf.cast(stateless_seed[0], tf.int64)
  return tf.math.floordiv(first, _EPOCH_STRIDE), first % 2


def make_dataset_fn(plan: InputPlan, data: DataConfig, task, *, training: bool, seed: int,
                    epochs: int = 1, start_step: int = 0):
  """Returns dataset_fn(input_context) for `strategy.distribute_datasets_from_function`.

  Training streams epochs [start_step // steps, epochs) in one dataset and skips the steps of the
  first epoch already done, so a resumed run sees exactly the batches it would have seen.
  `task.preprocess(example, data, training, seed)` gets a stateless seed made of (seed, epoch,
  the example's position in the epoch's order): the same on every worker and replica. Its
  seed[0] is epoch_seed(seed, epoch), whose parity alternates with the epoch (seed_parts).

  Padding is real data at weight 0, so BatchNorm's batch statistics see no zeros: the epoch's
  last (short) step of a pipeline repeats its own real rows, and whole steps of padding after it
  (uneven shards) repeat that filled last step. Filled per step, not per replica: a step holds
  the same rows for any replica count (the replicas' averaged batch means agree). Only a pipeline
  with no real examples pads with zeros. An uneven split (plan.uneven_global_batch) reads each
  pipeline's share of every step's block of the one order instead of a shard (one_uneven_epoch).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  source, policy = plan.source, plan.policy
  size = plan.step_batch  # padding is filled per step, then split into per-replica batches
  padded_len = plan.steps_per_epoch * plan.step_batch
  start_epoch, skip_steps = divmod(start_step, plan.steps_per_epoch)
  use_cache = data.cache and fits_in_memory(source, max(plan.counts))
  buffer = shuffle_buffer(source, data)

  def prepare(example, epoch):
    stateless_seed = tf.stack([epoch_seed(seed, epoch), example["index"]])
    features = task.preprocess(example, data, training, stateless_seed)
    weight = tf.cast(example.get("weight", 1.0), tf.float32)  # a source may weigh its examples
    return {**features, "weight": weight}

  def finish(ds, per_replica: int, step_rows: int):
    if per_replica != step_rows:
      ds = ds.rebatch(per_replica, drop_remainder=True)
    options = tf.data.Options()
    options.deterministic = data.deterministic
    if data.threadpool_size:
      options.threading.private_threadpool_size = data.threadpool_size
    # tfdp shards itself (policy above); TF's auto-sharding would shard a second time.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)

  def dataset_fn(ctx: tf.distribute.InputContext):
    pipeline = ctx.input_pipeline_id if plan.num_pipelines > 1 else 0
    n = plan.num_pipelines
    if plan.shard_batches:  # local data: every shard's own share of each step
      per_replica = plan.pipeline_replica_batch(pipeline)
      step_rows = per_replica * plan.replicas_per_pipeline * plan.accumulation_steps
      epoch_range = (start_epoch, epochs) if training else (0, 1)
      return finish(_local_steps(plan, pipeline, step_rows, prepare, data, training, seed,
                                 epoch_range, skip_steps if training else 0),
                    per_replica, step_rows)
    files = list(range(len(source.file_counts)))
    if policy == "file":
      files = files[pipeline::n]
    base = source.read_slice(pipeline, n) if policy == "tfds_split" else source.read(files)
    if use_cache:
      base = base.cache()
    real = plan.counts[pipeline] if policy != "local" else source.num_examples
    spec = base.enumerate().map(
        lambda i, ex: prepare({**ex, "index": i}, tf.constant(0, tf.int64))).element_spec
    zeros = tf.nest.map_structure(lambda s: padding.zeros_batch(s, size), spec)
    if plan.uneven_global_batch:  # this pipeline's share of each step's block, not a shard
      first_position, share = plan.block_share(pipeline)
      whole_steps, last_block = divmod(source.num_examples, plan.global_batch)
      real = whole_steps * share + min(max(last_block - first_position, 0), share)
    real_end = -(-real // size) * size  # the end of the last step holding a real example

    def one_uneven_epoch(epoch, skip: int):
      """As one_epoch, for an uneven split: step k holds this pipeline's share of positions
      [k·G, (k+1)·G) of the epoch's order (G the global batch), spread over its slots."""
      global_batch = plan.global_batch
      real_steps = -(-real // share)
      first = min(skip // size, real_steps - 1)  # past the real steps: read the last one back
      ds = base
      if training and data.shuffle:
        ds = ds.shuffle(buffer, seed=epoch_seed(seed, epoch), reshuffle_each_iteration=False)
      ds = ds.enumerate().map(lambda i, ex: {**ex, "index": i})
      ds = ds.filter(lambda ex: (ex["index"] >= first * global_batch) & (
          ex["index"] % global_batch >= first_position) & (
              ex["index"] % global_batch < first_position + share))
      ds = ds.map(lambda ex: prepare(ex, epoch), num_parallel_calls=tf.data.AUTOTUNE,
                  deterministic=data.deterministic).batch(share)
      ds = ds.map(lambda b: padding.spread_over_slots(
          b, plan.replicas_per_pipeline * plan.accumulation_steps, plan.per_replica_batch))
      if plan.steps_per_epoch > real_steps:
        ds = padding.then_copies_of_last(ds, plan.steps_per_epoch - real_steps, zeros)
      return ds.skip(skip // size - first)

    def one_epoch(epoch, skip: int):
      """The epoch's steps (pipeline batches) from example `skip` on (a multiple of a step)."""
      if real == 0:  # an empty shard: nothing real to repeat
        return tf.data.Dataset.from_tensors(zeros).repeat((padded_len - skip) // size)
      if plan.uneven_global_batch:
        return one_uneven_epoch(epoch, skip)
      ds = base
      if training and data.shuffle:
        ds = ds.shuffle(buffer, seed=epoch_seed(seed, epoch), reshuffle_each_iteration=False)
      # Position in the (same on every worker) shuffled order: a stable per-example seed.
      ds = ds.enumerate().map(lambda i, ex: {**ex, "index": i})
      if policy == "data":
        ds = ds.shard(n, pipeline)
      # Resumed past the real examples: read the last real step back, as the padding repeats it.
      first = skip if skip < real else real_end - size
      ds = ds.take(real).skip(first).map(lambda ex: prepare(ex, epoch),
                                         num_parallel_calls=tf.data.AUTOTUNE,
                                         deterministic=data.deterministic)
      ds = ds.batch(size).map(lambda b: padding.fill_with_own_rows(b, size))
      if padded_len > real_end:
        ds = padding.then_copies_of_last(ds, (padded_len - real_end) // size, zeros)
      return ds.skip((skip - first) // size)

    first_epoch, end = (start_epoch, epochs) if training else (0, 1)
    ds = tf.data.Dataset.range(first_epoch + 1, end).flat_map(lambda epoch: one_epoch(epoch, 0))
    if first_epoch < end:
      first_skip = skip_steps * plan.step_batch if first_epoch == start_epoch else 0
      ds = one_epoch(tf.constant(first_epoch, tf.int64), first_skip).concatenate(ds)
    return finish(ds, plan.per_replica_batch, size)

  # Its map functions, and the task's preprocess in them, are traced without autograph (see
  # tfdp/core/trainer.py).
  return tf.autograph.experimental.do_not_convert(dataset_fn)


def _local_steps(plan: InputPlan, pipeline: int, step_rows: int, prepare, data: DataConfig,
                 training: bool, seed: int, epoch_range: tuple[int, int], skip_steps: int):
  """Local data, epochs [first, end) skipping `skip_steps` steps of the first: step k holds rows
  [k·b, (k+1)·b) of the epoch's order of each shard this worker reads (b the shard's rows per
  step, split_local_batch; the order a function of the seed, the epoch and the shard alone, so
  any mapping of shards to workers takes the same examples in a step), filled to `step_rows`
  with weight-0 copies of its own rows; a step with none repeats the last at weight 0."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  source, shards = plan.source, plan.pipeline_shards[pipeline]
  spec = source.read([0]).map(lambda ex: prepare({**ex, "index": tf.constant(0, tf.int64)},
                                                 tf.constant(0, tf.int64))).element_spec
  zeros = tf.nest.map_structure(lambda s: padding.zeros_batch(s, step_rows), spec)
  empty = tf.nest.map_structure(lambda s: padding.zeros_batch(s, 0), spec)

  def shard_steps(file: int, shard: int, epoch):
    count, rows = source.file_counts[file], plan.shard_batches[shard]
    ds = source.read([file])
    if training and data.shuffle:
      ds = ds.shuffle(data.shuffle_buffer or max(count, 1), reshuffle_each_iteration=False,
                      seed=epoch_seed(seed, epoch) * 1009 + shard)
    ds = ds.enumerate().map(lambda i, ex: prepare({**ex, "index": i * len(plan.shard_counts)
                                                   + shard}, epoch),
                            num_parallel_calls=tf.data.AUTOTUNE, deterministic=data.deterministic)
    real_steps = -(-count // rows) if count else 0
    ds = ds.batch(max(rows, 1)).take(real_steps)
    return ds.concatenate(tf.data.Dataset.from_tensors(empty).repeat(
        plan.steps_per_epoch - real_steps))

  def fill(last, batch):
    out = tf.cond(tf.shape(batch["weight"])[0] > 0,
                  lambda: padding.fill_with_own_rows(batch, step_rows),
                  lambda: {**last, "weight": tf.zeros_like(last["weight"])})
    return out, out

  def one_epoch(epoch, skip: int):
    steps = [shard_steps(file, shard, epoch) for file, shard in enumerate(shards)]
    ds = steps[0] if len(steps) == 1 else tf.data.Dataset.zip(tuple(steps)).map(
        lambda *parts: tf.nest.map_structure(lambda *x: tf.concat(x, 0), *parts))
    return ds.scan(zeros, fill).skip(skip)

  first, end = epoch_range
  ds = tf.data.Dataset.range(first + 1, end).flat_map(lambda epoch: one_epoch(epoch, 0))
  if first < end:
    ds = one_epoch(tf.constant(first, tf.int64), skip_steps).concatenate(ds)
  return ds


def log_plan(name: str, plan: InputPlan) -> None:
  split = describe_split(plan.global_batch, plan.num_pipelines * plan.replicas_per_pipeline,
                         plan.accumulation_steps)
  if plan.shard_batches:  # local: each shard's share of a step, so all end their epoch together
    split = (f"global batch {plan.global_batch} as rows per step of shards "
             f"{list(plan.shard_batches)}, per-replica batch by worker "
             f"{[plan.pipeline_replica_batch(p) for p in range(plan.num_pipelines)]}")
  logging.info("data %s: %d examples, %d step(s)/epoch, %s, shard policy %s over %d "
               "pipeline(s), real examples per pipeline %s", name, plan.source.num_examples,
               plan.steps_per_epoch, split, plan.policy, plan.num_pipelines, plan.counts)
