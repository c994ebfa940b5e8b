"""Workloads as tasks: what a run reads, which model it trains, its loss and its metrics.

The trainer, input planning, checkpoints, outputs and the launcher know no workload; the task
tells them (TF Model Garden's `base_task.py`, without its weight):

  build_source(data)            raw examples of one split: a `tfdp.data.Source`
  preprocess(example, training, seed)
                                one raw example → the model's features and labels, fixed shapes
                                (a tf.data map; `seed` is stateless: (run seed, epoch, index))
  build_model(source)           a Keras model, called inside `strategy.scope()`
  per_example_loss(batch, outputs)
                                a [batch] loss, before the example weight
  metric_sums(batch, outputs, per_example_loss)
                                {name: (numerator, denominator)}, weighted, for one batch; the
                                trainer sums both parts over replicas and steps and divides last
                                (flax's lm1b: token accuracy divides by tokens, not sequences)

Every batch is a dict with a "weight" entry: 0 for padding examples, 1 otherwise.
`task.name` picks a registered task; `register_task` adds a user's own.
"""
from __future__ import annotations

import difflib
from typing import Callable

from tfdp import models
from tfdp.config import DataConfig, TaskConfig
from tfdp.errors import ConfigError

_REGISTRY: dict[str, type] = {}


def register_task(name: str) -> Callable[[type], type]:
  """Class decorator: `@tfdp.register_task("my_task") class MyTask(tfdp.tasks.Task)`."""
  def decorate(cls: type) -> type:
    _REGISTRY[name] = cls
    return cls
  return decorate


def registered_tasks() -> list[str]:
  return sorted(_REGISTRY)


def find_init_checkpoint(path: str) -> str:
  """task.init_checkpoint as given: a run's model_dir, its checkpoints/ folder, or a checkpoint
  prefix (ckpt-N). Returns the checkpoint prefix; a one-line error when there is none."""
  import glob  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  path = os.path.abspath(os.path.expanduser(path))
  for folder in (os.path.join(path, "checkpoints"), path):
    indexes = glob.glob(os.path.join(folder, "ckpt-*.index"))
    steps = [int(m.group(1)) for p in indexes if (m := re.search(r"ckpt-(\d+)\.index$", p))]
    if steps:
      return os.path.join(folder, f"ckpt-{max(steps)}")
  if os.path.exists(path + ".index"):
    return path
  raise ConfigError(f"task.init_checkpoint '{path}' holds no checkpoint (ckpt-N.index); give the "
                    "model_dir of a finished run, or a checkpoint prefix.")


def restore_into(checkpoint_path: str, root, what: str) -> None:
  """Restores `root` (a tf.train.Checkpoint tree naming where its objects sit in the other
  run's checkpoint) for task.init_checkpoint; a mismatch is one line naming the variable."""
  import re  # pylint: disable=g-import-not-at-top
  key, fix = "task.init_checkpoint", "use the same task.model.kwargs (and id mapping) as that run"
  try:
    root.read(checkpoint_path).expect_partial().assert_existing_objects_matched()
  except ValueError as e:  # a shape differs: TF names the variable and both shapes
    raise ConfigError(f"{key} '{checkpoint_path}' does not fit {what}: "
                      f"{str(e).splitlines()[0]}; {fix}.") from None
  except AssertionError as e:  # variables the checkpoint has no value for
    found = re.search(r"path=([^,]+), shape=\(([^)]*)\)", str(e))
    missing = f"{found.group(1)} (shape {found.group(2)})" if found else "some variables"
    raise ConfigError(f"{key} '{checkpoint_path}' has no value for {what}'s variable {missing}; "
                      f"{fix}.") from None


def task_class(name: str) -> type:
  if name not in _REGISTRY:
    raise ConfigError(f"config key 'task.name' is '{name}'; use one of "
                      f"{', '.join(registered_tasks())}.")
  return _REGISTRY[name]


def make_task(config: TaskConfig, worker: int = 0, num_workers: int = 1) -> "Task":
  """`worker`/`num_workers`: which worker builds it (a task may read only its own data)."""
  task = task_class(config.name)(config)
  task.worker, task.num_workers = worker, num_workers
  return task


class Task:
  """The base: subclasses say what their examples, model, loss and metrics are."""

  metric_names: tuple[str, ...] = ("loss",)  # the order of the trainer's sums vector
  supports_eval_flip = False  # task.eval_flip: its inputs are images whose mirror is one too

  def __init__(self, config: TaskConfig):
    self.config = config
    self.worker, self.num_workers = 0, 1  # make_task sets them

  @classmethod
  def validate(cls, config: TaskConfig) -> None:
    """Checks that need no TensorFlow (config.validate calls it): raise ConfigError/DataError."""

  def build_source(self, data: DataConfig):
    from tfdp import data as data_lib  # pylint: disable=g-import-not-at-top
    return data_lib.make_source(data)

  def preprocess(self, example: dict, data: DataConfig, training: bool, seed) -> dict:
    del data, training, seed
    return example

  def build_model(self, source):
    raise NotImplementedError

  def warm_start(self, checkpoint_path: str) -> None:
    """Called after build_model, before training from step 0, with task.init_checkpoint."""
    raise ConfigError(f"task '{self.config.name}' has no encoder to warm-start; remove "
                      "task.init_checkpoint.")

  def model_inputs(self, batch: dict):
    raise NotImplementedError

  def per_example_loss(self, batch: dict, outputs):
    raise NotImplementedError

  def eval_outputs(self, model, batch: dict):
    """The model's outputs for evaluation (a task may add test-time augmentation)."""
    return model(self.model_inputs(batch), training=False)

  def metric_sums(self, batch: dict, outputs, per_example_loss) -> dict:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    weight = batch["weight"]
    return {"loss": (tf.reduce_sum(per_example_loss * weight), tf.reduce_sum(weight))}

  def artifacts(self, source) -> dict:
    """Files the chief writes into model_dir beside the model: {file name: text} (e.g. the id
    mapping a recommender's inference must use)."""
    del source
    return {}

  def finalize_metric(self, name: str, value: float) -> float:
    """The reported value from numerator / denominator (e.g. a square root for an RMSE)."""
    del name
    return value


def _normalize(image, mean, std):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  image = tf.cast(image, tf.float32) / 255.0
  return (image - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)


def _augment(image, seed, padding: int = 4):
  """Random crop of the reflect-padded image and horizontal flip, stateless: the same example,
  epoch and seed give the same pixels whichever replica or worker reads it."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  shape = tf.shape(image)
  padded = tf.pad(image, [[padding, padding], [padding, padding], [0, 0]], mode="REFLECT")
  image = tf.image.stateless_random_crop(padded, shape, seed=seed)
  return tf.image.stateless_random_flip_left_right(image, seed=seed + 1)


@register_task("image_classification")
class ImageClassificationTask(Task):
  """Images → one of num_classes: cross-entropy on logits, accuracy."""

  metric_names = ("loss", "accuracy")
  supports_eval_flip = True
  SOURCES = ("tfds", "image_folder", "tfrecord", "synthetic")

  @classmethod
  def validate(cls, config):
    for key, data in (("task.train_data", config.train_data), ("task.eval_data", config.eval_data)):
      if data.source not in cls.SOURCES:
        raise ConfigError(f"config key '{key}.source' is '{data.source}', but task "
                          f"'image_classification' reads images: use one of {', '.join(cls.SOURCES)}.")
    if config.model.name not in models.registered_models():
      close = difflib.get_close_matches(config.model.name, models.registered_models(), n=1)
      hint = f" Did you mean '{close[0]}'?" if close else ""
      raise ConfigError(f"config key 'task.model.name' is '{config.model.name}'; use one of "
                        f"{', '.join(models.registered_models())}.{hint}")

  def preprocess(self, example, data, training, seed):
    image = example["image"]
    if training and data.augment:
      image = _augment(image, seed, data.crop_padding)
    return {"image": _normalize(image, data.mean, data.std), "label": example["label"]}

  SAMPLE_IMAGES = 5000  # for a builder that initializes from data (airbench: 5000 images)

  def build_model(self, source):
    model = self.config.model
    kwargs = dict(model.kwargs)
    if models.takes_sample_images(model.name):
      kwargs["sample_images"] = self.sample_images(source, self.SAMPLE_IMAGES)
    return models.build_model(model.name, source.image_shape, source.num_classes, **kwargs)

  def sample_images(self, source, count: int):
    """The source's first `count` images, normalized as evaluation sees them (NHWC numpy)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    data = self.config.train_data
    examples = source.read(list(range(len(source.file_counts)))).take(count)
    images = examples.map(lambda ex: _normalize(ex["image"], data.mean, data.std),
                          num_parallel_calls=tf.data.AUTOTUNE).batch(count)
    return next(iter(images)).numpy()

  def model_inputs(self, batch):
    return batch["image"]

  def eval_outputs(self, model, batch):
    if not self.config.eval_flip:
      return super().eval_outputs(model, batch)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    image = self.model_inputs(batch)
    mirrored = tf.reverse(image, axis=[2])  # [batch, height, width, channels]: width
    return (tf.cast(model(image, training=False), tf.float32)
            + tf.cast(model(mirrored, training=False), tf.float32)) / 2.0

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
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    weight = batch["weight"]
    correct = tf.cast(tf.equal(tf.argmax(outputs, -1), batch["label"]), tf.float32)
    count = tf.reduce_sum(weight)
    return {"loss": (tf.reduce_sum(per_example_loss * weight), count),
            "accuracy": (tf.reduce_sum(correct * weight), count)}


from tfdp import recommender_tasks  # pylint: disable=wrong-import-position,unused-import  (registers)
from tfdp import text_tasks  # pylint: disable=wrong-import-position,unused-import  (registers them)
