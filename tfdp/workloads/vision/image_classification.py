"""Image classification: images → one of num_classes, cross-entropy on logits, accuracy.

The default workload (CIFAR-10): per-example normalization and stateless augmentation, models
from the vision registry (`task.model.name`), mirror and translate test-time augmentation
(`task.eval_flip`, `task.eval_translate`).
"""
from __future__ import annotations

import difflib

from tfdp.core import class_folders
from tfdp.core import data as data_lib
from tfdp.core import task as tasks
from tfdp.errors import ConfigError
from tfdp.workloads.vision import models
from tfdp.workloads.vision import sources


def _normalize(image, mean, std):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  image = tf.cast(image, tf.float32) / 255.0
  return (image - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)


def _augment(image, seed, padding: int = 4, flip: str = "random"):
  """Random crop of the reflect-padded image and horizontal flip, stateless: the same example,
  epoch and seed give the same pixels whichever replica or worker reads it. flip "alternating"
  (airbench): each image has a fixed random side, from a hash of its pixels and the run's seed
  (another seed flips another half), and the side swaps every epoch, so every image is seen both
  ways in any two epochs in a row (both from the stateless seed: data_lib.seed_parts)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  shape = tf.shape(image)
  padded = tf.pad(image, [[padding, padding], [padding, padding], [0, 0]], mode="REFLECT")
  cropped = tf.image.stateless_random_crop(padded, shape, seed=seed)
  if flip == "random":
    return tf.image.stateless_random_flip_left_right(cropped, seed=seed + 1)
  run_seed, parity = data_lib.seed_parts(seed)
  side = tf.strings.to_hash_bucket_fast(tf.strings.join([
      tf.io.serialize_tensor(image), tf.strings.as_string(run_seed)]), 2)
  flipped = tf.not_equal(side, parity)
  return tf.cond(flipped, lambda: tf.reverse(cropped, axis=[1]), lambda: cropped)


@tasks.register_task("image_classification")
class ImageClassificationTask(tasks.Task):
  """Images → one of num_classes: cross-entropy on logits, accuracy."""

  metric_names = ("loss", "accuracy")
  supports_eval_flip = True
  SOURCES = ("tfds", "image_folder", "tfrecord", "synthetic")
  ignored_keys = (*tasks.TEXT_DATA_KEYS, *tasks.INTERACTION_DATA_KEYS, "text", "recommender")
  # Keys one image source reads and the others do not.
  SOURCE_KEYS = {"name": ("tfds",), "data_dir": ("tfds",), "split": ("tfds",),
                 "image_key": ("tfrecord",), "label_key": ("tfrecord",),
                 "num_examples": ("synthetic",), "path": ("image_folder", "tfrecord")}

  @classmethod
  def ignored_data_keys(cls, data):
    sliced = "[" in data.split  # said by checks.warn_unused_slices
    return tuple(key for key, readers in cls.SOURCE_KEYS.items()
                 if data.source not in readers and not (key == "split" and sliced))

  @classmethod
  def check_source(cls, data, key):
    sources.check_source(data, key)
    if key == "task.train_data":
      class_folders.check_not_one_class(data, key)

  @classmethod
  def validate(cls, config):
    for key, data in (("task.train_data", config.train_data), ("task.eval_data", config.eval_data)):
      if data.source not in cls.SOURCES:
        raise ConfigError(f"config key '{key}.source' is '{data.source}', but task "
                          f"'image_classification' reads images: use one of {', '.join(cls.SOURCES)}.")
    # Before TensorFlow: the model's classes are training's, and labels follow folder names.
    class_folders.check_eval_classes(config.train_data, config.eval_data, "image_folder", "images")
    if config.model.name not in models.registered_models():
      close = difflib.get_close_matches(config.model.name, models.registered_models(), n=1)
      # Both: a name close to a built-in one may still be the user's own model.
      hint = ((f" Did you mean '{close[0]}'?" if close else "") + " A model of your own is "
              "registered in the process that trains: name its module in task.model.module "
              "(under tfdp.launch_notebook, register it inside train_fn).")
      raise ConfigError(f"config key 'task.model.name' is '{config.model.name}'; use one of "
                        f"{', '.join(models.registered_models())}.{hint}")

  @classmethod
  def check_saved_artifacts(cls, config, folder, context):
    """An image folder's classes against the run's: a renamed folder relabels every image
    after it (a warm start may fine-tune on other classes)."""
    class_folders.check_saved_classes(config, folder, context, "image_folder")

  def artifacts(self, source):
    return class_folders.saved_classes(source)

  def build_source(self, data):
    source = data_lib.make_source(data)
    self.check_normalization(data, source)
    shape = source.image_shape
    if data.augment and data.crop_padding and shape and data.crop_padding >= min(shape[:2]):
      raise ConfigError(  # reflect padding needs fewer pixels than a side (a mid-run failure)
          f"config key 'task.{'train' if data is self.config.train_data else 'eval'}_data."
          f"crop_padding' is "
          f"{data.crop_padding}, but the images are {shape[0]}x{shape[1]}; use fewer pixels "
          "than a side, e.g. 4 for 32x32 images.")
    if data is self.config.train_data:
      class_folders.check_classes_to_learn(source)
    return source

  def check_normalization(self, data, source) -> None:
    """mean/std broadcast over the channels only if they have 1 value or one per channel: known
    once the source is built, still before anything is written (else a traceback mid-run)."""
    channels = source.image_shape[-1] if source.image_shape else None
    if channels is None or len(data.mean) in (1, channels):
      return
    key = "task.train_data" if data is self.config.train_data else "task.eval_data"
    raise ConfigError(f"config keys '{key}.mean'/'{key}.std' have {len(data.mean)} values, but "
                      f"the images have {channels} channel(s); give {channels} values (one per "
                      "channel) or 1.")

  def preprocess(self, example, data, training, seed):
    image = example["image"]
    if training and data.augment:
      image = _augment(image, seed, data.crop_padding, data.flip)
    return {"image": _normalize(image, data.mean, data.std), "label": example["label"]}

  SAMPLE_IMAGES = 5000  # for a builder that initializes from data (airbench: 5000 images)

  def build_model(self, source):
    model = self.config.model
    shift, shape = self.config.eval_translate, source.image_shape
    if shift and shape and shift >= min(shape[0], shape[1]):  # reflect padding needs shift < side
      raise ConfigError(f"config key 'task.eval_translate' is {shift}, but the images are "
                        f"{shape[0]}x{shape[1]}; use fewer pixels than a side, e.g. 1.")
    kwargs = dict(model.kwargs)
    if models.takes_sample_images(model.name):
      kwargs["sample_images"] = (models.RESTORED if self.restoring
                                 else self.sample_images(source, self.SAMPLE_IMAGES))
    return models.build_model(model.name, source.image_shape, source.num_classes, **kwargs)

  def sample_images(self, source, count: int):
    """The source's first `count` images, normalized as evaluation sees them (NHWC numpy)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    data = self.config.train_data
    examples = source.read(list(range(len(source.file_counts)))).take(count)
    images = examples.map(tf.autograph.experimental.do_not_convert(
        lambda ex: _normalize(ex["image"], data.mean, data.std)),
                          num_parallel_calls=tf.data.AUTOTUNE).batch(count)
    return next(iter(images)).numpy()

  def model_inputs(self, batch):
    return batch["image"]

  def eval_outputs(self, model, batch):
    flip, shift = self.config.eval_flip, self.config.eval_translate
    if not (flip or shift):
      return super().eval_outputs(model, batch)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    def views(image):  # the image's logits, or their mean with its mirror's
      logits = tf.cast(model(image, training=False), tf.float32)
      if not flip:
        return logits
      mirrored = tf.reverse(image, axis=[2])  # [batch, height, width, channels]: width
      return (logits + tf.cast(model(mirrored, training=False), tf.float32)) / 2.0
    image = self.model_inputs(batch)
    if not shift:
      return views(image)
    # airbench's tta_level 2: half the unshifted views, a quarter each shift's.
    height, width = tf.shape(image)[1], tf.shape(image)[2]
    padded = tf.pad(image, [[0, 0], [shift, shift], [shift, shift], [0, 0]], mode="REFLECT")
    up_left = padded[:, :height, :width]
    down_right = padded[:, 2 * shift:, 2 * shift:]
    return 0.5 * views(image) + 0.25 * (views(up_left) + views(down_right))

  def per_example_loss(self, batch, outputs):
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    logits = tf.cast(outputs, tf.float32)
    if self.config.label_smoothing:
      labels = tf.one_hot(batch["label"], tf.shape(logits)[-1])
      return keras.losses.categorical_crossentropy(
          labels, logits, from_logits=True, label_smoothing=self.config.label_smoothing)
    return keras.losses.sparse_categorical_crossentropy(batch["label"], logits, from_logits=True)

  def metric_sums(self, batch, outputs, per_example_loss):
    return tasks.classification_sums(batch, outputs, per_example_loss)
