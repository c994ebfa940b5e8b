"""Input pipelines: sources (TFDS, image folder, TFRecord, synthetic) → per-replica batches.

A source reads raw examples (dicts); the task's `preprocess` turns each into the model's
features and labels. Every pipeline yields dict batches of a fixed per-replica size with a
"weight" entry: the last batches of an epoch are padded with weight-0 examples (zeros shaped
by the preprocessed element spec), so every replica runs the same number of steps with the same
shapes (no empty or ragged final batch), and weighted sums count every real example once.
"""
from __future__ import annotations

import dataclasses
import glob
import math
import os
from typing import Callable

from absl import logging

from tfdp import config as config_lib
from tfdp.config import DataConfig
from tfdp.errors import DataError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")
_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM")


# ---- checks that need no TensorFlow (run before any TF work) --------------------------------


def tfds_data_dir(data: DataConfig) -> str:
  # Absolute once: TFDS resolves a relative folder against the working directory of whichever
  # process reads it (a notebook, a worker started elsewhere).
  return os.path.abspath(os.path.expanduser(data.data_dir or os.environ.get("TFDS_DATA_DIR")
                                            or "~/tensorflow_datasets"))


def check_source(data: DataConfig, key: str) -> None:
  """Fails fast (no download, no retries) when a dataset is not where the config says."""
  if data.source == "tfds":
    root = tfds_data_dir(data)
    name = data.name.split(":")[0]
    folder = os.path.join(root, name)
    infos = glob.glob(os.path.join(folder, "**", "dataset_info.json"), recursive=True)
    if not infos:
      raise DataError(
          f"{key}: TFDS dataset '{data.name}' is not prepared in {folder}; set {key}.data_dir or "
          f"TFDS_DATA_DIR to a folder holding {name}/<version>/ (tfdp never downloads), or build it "
          f"where there is network with `tfds build {name} --data_dir {root}`.")
  elif data.source == "image_folder":
    if not os.path.isdir(data.path):
      raise DataError(f"{key}.path '{data.path}' is not a folder; point it at root/<class>/*.jpg.")
  elif data.source == "tfrecord":
    if not sorted(glob.glob(data.path)):
      raise DataError(f"{key}.path '{data.path}' matches no TFRecord files; fix the glob.")
  elif data.source == "interactions":
    if "{worker" not in data.path and not os.path.isfile(data.path):  # {worker}: the task checks
      raise DataError(f"{key}.path '{data.path}' is not a file; give a CSV/TFRecord file, or a "
                      "path with {worker} for per-worker shards.")
  elif data.source == "text_folder":
    if not os.path.isdir(data.path):
      raise DataError(f"{key}.path '{data.path}' is not a folder; point it at root/<label>/*.txt.")
  elif data.source == "text_files":
    if not glob.glob(data.path, recursive=True):
      raise DataError(f"{key}.path '{data.path}' matches no text files; fix the glob.")


def list_image_folder(root: str) -> tuple[list[str], list[int], list[str]]:
  """Returns (paths, labels, class_names); checks every file's header so a broken image is
  reported by name before training starts."""
  classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
  if not classes:
    raise DataError(f"image folder '{root}' has no class subfolders; lay it out as root/<class>/*.jpg.")
  paths, labels = [], []
  for label, name in enumerate(classes):
    for file in sorted(os.listdir(os.path.join(root, name))):
      if not file.lower().endswith(IMAGE_EXTENSIONS):
        continue
      path = os.path.join(root, name, file)
      try:
        with open(path, "rb") as f:
          head = f.read(8)
      except OSError as e:
        raise DataError(f"image '{path}' cannot be read ({e.strerror}); fix its permissions or remove it.") from None
      if not head.startswith(_MAGIC):
        raise DataError(f"image '{path}' is not a readable JPEG/PNG/GIF/BMP file; replace or remove it.")
      paths.append(path)
      labels.append(label)
  if not paths:
    raise DataError(f"image folder '{root}' holds no {'/'.join(IMAGE_EXTENSIONS)} files.")
  return paths, labels, classes


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

  @property
  def num_examples(self) -> int:
    return sum(self.file_counts)


def _resize(image, size: int):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not size:
    return image
  image = tf.image.resize(image, (size, size), antialias=True)
  return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


def _tfds_source(data: DataConfig) -> Source:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    builder = tfds.builder(data.name, data_dir=tfds_data_dir(data))
    split = builder.info.splits[data.split]
  except Exception as e:  # pylint: disable=broad-except  (TFDS raises AssertionError, ParseError...)
    detail = " ".join(str(e).split())
    detail = detail.split("}\": ", 1)[-1] if "Failed to construct dataset" in detail else detail
    raise DataError(f"TFDS dataset '{data.name}' split '{data.split}' in "
                    f"{tfds_data_dir(data)} cannot be read ({type(e).__name__}: {detail[:300]}); "
                    "fix the name, version or split, or prepare the dataset again with "
                    "`tfds build`.") from None
  instructions = split.file_instructions
  features = builder.info.features
  num_classes = data.num_classes or features["label"].num_classes
  shape = tuple(features["image"].shape)
  if data.image_size:
    shape = (data.image_size, data.image_size, shape[-1])

  def as_examples(ds):
    return ds.map(lambda ex: {"image": _resize(ex["image"], data.image_size),
                              "label": tf.cast(ex["label"], tf.int64)},
                  num_parallel_calls=tf.data.AUTOTUNE)

  def load(split_name):
    return as_examples(builder.as_dataset(split=split_name, shuffle_files=False,
                                          read_config=tfds.ReadConfig(try_autocache=False)))

  def read(file_indices):
    datasets = [load(_instruction_split(builder, instructions[i])) for i in file_indices]
    ds = datasets[0]
    for more in datasets[1:]:
      ds = ds.concatenate(more)
    return ds

  def read_slice(index, count):
    return load(tfds.even_splits(data.split, count)[index])

  return Source([fi.take for fi in instructions], read, "tfds", read_slice,
                num_classes=num_classes, image_shape=shape)


def _instruction_split(builder, fi) -> str:
  """The TFDS split string that reads exactly one file instruction (skip/take in one file)."""
  name = os.path.basename(fi.filename)
  for split_name, split in builder.info.splits.items():
    files = [os.path.basename(f) for f in split.filenames]
    if name in files:
      start = sum(split.shard_lengths[:files.index(name)]) + fi.skip
      return f"{split_name}[{start}:{start + fi.take}]"
  raise DataError(f"TFDS file {fi.filename} belongs to no split; the prepared dataset is damaged.")


def _decode_file(path, size: int):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
  return _resize(image, size)


def _image_folder_source(data: DataConfig) -> Source:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  paths, labels, classes = list_image_folder(data.path)
  size = data.image_size
  if not size:
    try:
      first = _decode_file(paths[0], 0)
    except tf.errors.OpError as e:
      raise DataError(f"image '{paths[0]}' cannot be decoded ({e.message.splitlines()[0][:200]}); "
                      "replace or remove it.") from None
    size = int(first.shape[0])
    if first.shape[0] != first.shape[1]:
      raise DataError(f"image folder '{data.path}' has non-square images ({paths[0]} is "
                      f"{first.shape[1]}x{first.shape[0]}); set image_size to resize them.")

  def read(file_indices):
    ds = tf.data.Dataset.from_tensor_slices(([paths[i] for i in file_indices],
                                             [labels[i] for i in file_indices]))
    return ds.map(lambda p, l: {"image": _decode_file(p, size), "label": tf.cast(l, tf.int64)},
                  num_parallel_calls=tf.data.AUTOTUNE)

  def find_unreadable():
    for path in paths:
      try:
        _decode_file(path, size)
      except tf.errors.OpError as e:
        return f"'{path}': {e.message.splitlines()[0][:200]}"
    return None

  return Source([1] * len(paths), read, "image_folder", num_classes=data.num_classes or len(classes),
                image_shape=(size, size, 3), find_unreadable=find_unreadable)


def _tfrecord_source(data: DataConfig) -> Source:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  files = sorted(glob.glob(data.path))
  spec = {data.image_key: tf.io.FixedLenFeature([], tf.string),
          data.label_key: tf.io.FixedLenFeature([], tf.int64)}

  def parse(record):
    ex = tf.io.parse_single_example(record, spec)
    image = tf.io.decode_image(ex[data.image_key], channels=3, expand_animations=False)
    return {"image": _resize(image, data.image_size), "label": ex[data.label_key]}

  counts, max_label, first = [], -1, None
  try:
    for f in files:
      labels = tf.data.TFRecordDataset(f).map(lambda r: tf.io.parse_single_example(r, spec)[data.label_key])
      n, top = labels.reduce((tf.constant(0, tf.int64), tf.constant(-1, tf.int64)),
                             lambda acc, l: (acc[0] + 1, tf.maximum(acc[1], l)))
      counts.append(int(n))
      max_label = max(max_label, int(top))
      if first is None and int(n):
        first = next(iter(tf.data.TFRecordDataset(f).take(1).map(parse)))
  except tf.errors.OpError as e:
    raise DataError(f"TFRecord files '{data.path}' cannot be parsed with features "
                    f"'{data.image_key}' (bytes) and '{data.label_key}' (int64): "
                    f"{e.message.splitlines()[0]}") from None
  if first is None:
    raise DataError(f"TFRecord files '{data.path}' hold no examples.")

  shape = tuple(first["image"].shape)

  def parse_known_shape(record):  # every image must match the first: batches need one shape
    example = parse(record)
    return {**example, "image": tf.ensure_shape(example["image"], shape)}

  def read(file_indices):
    return tf.data.TFRecordDataset([files[i] for i in file_indices]).map(
        parse_known_shape, num_parallel_calls=tf.data.AUTOTUNE)

  return Source(counts, read, "tfrecord", num_classes=data.num_classes or max_label + 1,
                image_shape=shape)


def _synthetic_source(data: DataConfig) -> Source:
  """Example i: class i % num_classes; pixels are noise averaged with a colour of its class, so
  a model can learn it (tests check that training learns) for benchmarks it costs the same as noise."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  size, classes = data.image_size, data.num_classes

  def example(i):
    label = i % classes
    noise = tf.random.stateless_uniform((size, size, 3), seed=tf.stack([i, 7]), maxval=256,
                                        dtype=tf.int32)
    colour = tf.random.stateless_uniform((3,), seed=tf.stack([label, 11]), maxval=256,
                                         dtype=tf.int32)
    return {"image": tf.cast((noise + colour) // 2, tf.uint8), "label": label}

  def read(file_indices):
    del file_indices  # one virtual file
    return tf.data.Dataset.range(data.num_examples).map(example, num_parallel_calls=tf.data.AUTOTUNE)

  return Source([data.num_examples], read, "synthetic", num_classes=classes,
                image_shape=(size, size, 3))


def make_source(data: DataConfig) -> Source:
  check_source(data, "data")
  return {"tfds": _tfds_source, "image_folder": _image_folder_source,
          "tfrecord": _tfrecord_source, "synthetic": _synthetic_source}[data.source](data)


# ---- sharding and batching -------------------------------------------------------------------


def resolve_shard_policy(policy: str, source: Source, num_pipelines: int) -> str:
  """TF's AUTO rule made explicit: shard files when every pipeline gets one, else elements.
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
    return "file" if num_files >= num_pipelines else "data"
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

  @property
  def pipeline_batch(self) -> int:
    return self.per_replica_batch * self.replicas_per_pipeline

  @property
  def step_batch(self) -> int:
    """Examples one pipeline gives per optimizer step."""
    return self.pipeline_batch * self.accumulation_steps

  @property
  def global_batch(self) -> int:
    return self.step_batch * self.num_pipelines


def plan_input(source: Source, data: DataConfig, global_batch: int, num_replicas: int,
               num_pipelines: int, batch_key: str = "trainer.global_batch_size",
               accumulation_steps: int = 1, local_counts: list[int] | None = None) -> InputPlan:
  """Decides once how one split is batched and sharded; the trainer takes its global batch and
  steps per epoch from the plan that shaped the batches. `local_counts`: every worker's example
  count of a local source (exchanged between workers), so all agree on the steps per epoch and
  pad the shorter shards instead of hanging in a collective."""
  policy = resolve_shard_policy(data.shard_policy, source, num_pipelines)
  counts = (list(local_counts) if policy == "local" and local_counts is not None
            else shard_counts(policy, source, num_pipelines))
  per_replica = config_lib.per_replica_batch(batch_key, global_batch,
                                             num_replicas * accumulation_steps)
  replicas_per_pipeline = num_replicas // num_pipelines
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


def _zeros_like_spec(spec):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not spec.shape.is_fully_defined():
    raise DataError(f"preprocessed examples must have fixed shapes to be batched, got {spec}; "
                    "pad or truncate them in the task's preprocess.")
  if spec.dtype == tf.string:
    return tf.fill(spec.shape, "")
  return tf.zeros(spec.shape, spec.dtype)


def make_dataset_fn(plan: InputPlan, data: DataConfig, task, *, training: bool, seed: int,
                    epochs: int = 1, start_step: int = 0):
  """Returns dataset_fn(input_context) for `strategy.distribute_datasets_from_function`.

  Training streams epochs [start_step // steps, epochs) in one dataset and skips the steps of the
  first epoch already done, so a resumed run sees exactly the batches it would have seen.
  `task.preprocess(example, data, training, seed)` gets a stateless seed made of (seed, epoch,
  the example's position in the epoch's order): the same on every worker and replica.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  source, policy = plan.source, plan.policy
  padded_len = plan.steps_per_epoch * plan.step_batch
  start_epoch, skip_steps = divmod(start_step, plan.steps_per_epoch)
  use_cache = data.cache and fits_in_memory(source, max(plan.counts))
  buffer = max(data.shuffle_buffer or (source.num_examples if use_cache else 10000), 1)  # an
  # empty local shard still takes part: every step is padding for it

  def prepare(example, epoch):
    stateless_seed = tf.stack([seed * 1000003 + epoch, example["index"]])
    features = task.preprocess(example, data, training, stateless_seed)
    weight = tf.cast(example.get("weight", 1.0), tf.float32)  # a source may weigh its examples
    return {**features, "weight": weight}

  def dataset_fn(ctx: tf.distribute.InputContext):
    pipeline = ctx.input_pipeline_id if plan.num_pipelines > 1 else 0
    n = plan.num_pipelines
    files = list(range(len(source.file_counts)))
    if policy == "file":
      files = files[pipeline::n]
    base = source.read_slice(pipeline, n) if policy == "tfds_split" else source.read(files)
    if use_cache:
      base = base.cache()
    real = plan.counts[pipeline] if policy != "local" else source.num_examples
    spec = base.enumerate().map(
        lambda i, ex: prepare({**ex, "index": i}, tf.constant(0, tf.int64))).element_spec
    pad = tf.data.Dataset.from_tensors(tf.nest.map_structure(_zeros_like_spec, spec))

    def one_epoch(epoch):
      ds = base
      if training and data.shuffle:
        ds = ds.shuffle(buffer, seed=seed * 1000003 + epoch, reshuffle_each_iteration=False)
      # Position in the (same on every worker) shuffled order: a stable per-example seed.
      ds = ds.enumerate().map(lambda i, ex: {**ex, "index": i})
      if policy == "data":
        ds = ds.shard(n, pipeline)
      skip = tf.where(epoch == start_epoch, tf.constant(skip_steps * plan.step_batch, tf.int64),
                      tf.constant(0, tf.int64))
      ds = ds.skip(skip).map(lambda ex: prepare(ex, epoch), num_parallel_calls=tf.data.AUTOTUNE,
                             deterministic=data.deterministic)
      return ds.concatenate(pad.repeat(padded_len - tf.maximum(tf.constant(real, tf.int64), skip)))

    epochs_ds = tf.data.Dataset.range(start_epoch if training else 0, epochs if training else 1)
    ds = epochs_ds.flat_map(one_epoch)
    ds = ds.batch(plan.per_replica_batch, drop_remainder=True)
    options = tf.data.Options()
    options.deterministic = data.deterministic
    if data.threadpool_size:
      options.threading.private_threadpool_size = data.threadpool_size
    # tfdp shards itself (policy above); TF's auto-sharding would shard a second time.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)

  return dataset_fn


def log_plan(name: str, plan: InputPlan) -> None:
  logging.info("data %s: %d examples, %d step(s)/epoch of %d per replica, shard policy %s over %d "
               "pipeline(s), real examples per pipeline %s", name, plan.source.num_examples,
               plan.steps_per_epoch, plan.per_replica_batch, plan.policy, plan.num_pipelines,
               plan.counts)
