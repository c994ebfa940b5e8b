"""Image sources: TFDS, an image folder, TFRecord files, synthetic images (`task.*_data.source`).

Each reads raw examples `{"image": uint8 HWC, "label": int64}` split into files (shard units);
the core input plan shards, batches and pads them. Registered with `core.data` by name.
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os

from tfdp import paths
from tfdp.config import DataConfig
from tfdp.core import class_folders
from tfdp.core import data as data_lib
from tfdp.core.data import Source
from tfdp.errors import DataError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")
_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM")



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
    _check_tfds_version(data, key, root, folder, infos)
  elif data.source == "image_folder":
    if not os.path.isdir(data.path):
      raise DataError(f"{key}.path '{data.path}' is not a folder{paths.looked_in(data.path)}; "
                      "point it at root/<class>/*.jpg.")
    class_folders.check_has_classes(data.path, "image", "*.jpg")
  elif data.source == "tfrecord":
    if not sorted(glob.glob(data.path)):
      raise DataError(f"{key}.path '{data.path}' matches no TFRecord files; fix the glob.")


def _check_tfds_version(data: DataConfig, key: str, root: str, folder: str,
                        infos: list[str]) -> None:
  """The prepared version TFDS will read: named and present, and its dataset_info.json JSON.
  Found here, before TensorFlow starts, not by TFDS's builder after it."""
  versions = {os.path.basename(os.path.dirname(info)): info for info in infos}
  version = data.name.split(":", 1)[1] if ":" in data.name else "*"  # "3.*.*" is TFDS's too
  matching = [v for v in versions if fnmatch.fnmatchcase(v, version)]
  if not matching:
    raise DataError(f"{key}: TFDS dataset '{data.name}' has no version {version} prepared in "
                    f"{folder} (prepared: {', '.join(sorted(versions))}); name one of those, or "
                    f"build it with `tfds build {data.name} --data_dir {root}`.")
  if len(matching) > 1:
    return  # TFDS picks among them; leave the reading to it
  try:
    with open(versions[matching[0]], encoding="utf-8") as f:
      json.load(f)
  except (OSError, ValueError) as e:
    raise DataError(f"{key}: TFDS dataset '{data.name}' in {root} cannot be read "
                    f"({versions[matching[0]]}: {type(e).__name__}: {str(e)[:200]}); prepare the "
                    f"dataset again with `tfds build {data.name.split(':')[0]} --data_dir {root}`.") from None


def list_image_folder(root: str) -> tuple[list[str], list[int], list[str]]:
  """Returns (paths, labels, class_names); checks every file's header so a broken image is
  reported by name before training starts."""
  return class_folders.list_class_folders(root, "image", IMAGE_EXTENSIONS, "*.jpg", _check_image)


def _check_image(path: str) -> None:
  try:
    with open(path, "rb") as f:
      head = f.read(8)
  except OSError as e:
    raise DataError(f"image '{path}' cannot be read ({e.strerror}); fix its permissions or remove it.") from None
  if not head.startswith(_MAGIC):
    raise DataError(f"image '{path}' is not a readable JPEG/PNG/GIF/BMP file; replace or remove it.")


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
  if not sum(fi.take for fi in instructions):  # train[:0], train[50000:]: read() had no file
    raise DataError(f"TFDS dataset '{data.name}' split '{data.split}' holds no examples; give a "
                    f"slice with some, e.g. {data.split.split('[')[0]}[:1000].")
  features = builder.info.features
  if data.num_classes and data.num_classes < features["label"].num_classes:  # a mid-run failure
    raise DataError(f"TFDS dataset '{data.name}' has {features['label'].num_classes} classes but "
                    f"num_classes is {data.num_classes}; set task.*_data.num_classes to "
                    f"{features['label'].num_classes} (or 0: the dataset decides).")
  if data.num_classes > features["label"].num_classes:
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning("TFDS dataset '%s' has %d classes but num_classes is %d: the model's %d other "
                    "outputs are never a label (set task.*_data.num_classes to 0: the dataset "
                    "decides)", data.name, features["label"].num_classes, data.num_classes,
                    data.num_classes - features["label"].num_classes)
  num_classes = data.num_classes or features["label"].num_classes
  shape = tuple(features["image"].shape)
  if data.image_size:
    shape = (data.image_size, data.image_size, shape[-1])

  @tf.autograph.experimental.do_not_convert  # as every map tfdp makes (tfdp/core/trainer.py)
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
  if data.num_classes and data.num_classes < len(classes):  # labels past it: a mid-run failure
    raise DataError(f"image folder '{data.path}' has {len(classes)} class folders "
                    f"({', '.join(classes)}) but num_classes is {data.num_classes}; set "
                    f"task.*_data.num_classes to {len(classes)} (or 0: the folders decide).")
  if data.num_classes > len(classes):  # a probe: extra outputs no example ever trains, silently
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning("image folder '%s' has %d class folders but num_classes is %d: the model's "
                    "%d other outputs are never a label (set task.*_data.num_classes to 0: the "
                    "folders decide)", data.path, len(classes), data.num_classes,
                    data.num_classes - len(classes))
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
                      f"{first.shape[1]}x{first.shape[0]}); set task.*_data.image_size to "
                      f"resize them, e.g. {max(int(first.shape[0]), int(first.shape[1]))}.")

  @tf.autograph.experimental.do_not_convert
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
                image_shape=(size, size, 3), find_unreadable=find_unreadable,
                info={"files": _file_list(paths, data.path, sizes=False), "class_names": classes})


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
  untraced = tf.autograph.experimental.do_not_convert
  try:
    for f in files:
      labels = tf.data.TFRecordDataset(f).map(untraced(
          lambda r: tf.io.parse_single_example(r, spec)[data.label_key]))
      n, top = labels.reduce((tf.constant(0, tf.int64), tf.constant(-1, tf.int64)),
                             untraced(lambda acc, l: (acc[0] + 1, tf.maximum(acc[1], l))))
      counts.append(int(n))
      max_label = max(max_label, int(top))
      if first is None and int(n):
        first = next(iter(tf.data.TFRecordDataset(f).take(1).map(untraced(parse))))
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

  @tf.autograph.experimental.do_not_convert
  def read(file_indices):
    return tf.data.TFRecordDataset([files[i] for i in file_indices]).map(
        parse_known_shape, num_parallel_calls=tf.data.AUTOTUNE)

  if data.num_classes and data.num_classes <= max_label:  # labels past it: a mid-run failure
    raise DataError(f"TFRecord files '{data.path}' hold label {max_label} but num_classes is "
                    f"{data.num_classes}; set task.*_data.num_classes to {max_label + 1} (or 0: "
                    "the labels decide).")
  return Source(counts, read, "tfrecord", num_classes=data.num_classes or max_label + 1,
                image_shape=shape, info={"files": _file_list(files, os.path.dirname(data.path), sizes=True)})


def _file_list(paths, root: str, sizes: bool) -> list:
  """Every file read, by name (and size: not for image folders, whose files may be millions on a
  network file system): multi-worker runs compare a digest of it, so a glob or a folder that
  holds other files on another host is found before training (not silently)."""
  return [(os.path.relpath(p, root), os.path.getsize(p) if sizes else None) for p in paths]


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

  @tf.autograph.experimental.do_not_convert
  def read(file_indices):
    del file_indices  # one virtual file
    return tf.data.Dataset.range(data.num_examples).map(example, num_parallel_calls=tf.data.AUTOTUNE)

  return Source([data.num_examples], read, "synthetic", num_classes=classes,
                image_shape=(size, size, 3))


for _name, _make in (("tfds", _tfds_source), ("image_folder", _image_folder_source),
                     ("tfrecord", _tfrecord_source), ("synthetic", _synthetic_source)):
  data_lib.register_source(_name, check_source, _make)
