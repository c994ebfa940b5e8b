"""The library API: make a single-device Keras script data-parallel in a few lines.

    import tfdp
    strategy = tfdp.make_strategy(cpu_replicas=2)  # first: devices are fixed when TF starts
    result = tfdp.fit(build_model, train_ds, eval_ds, model_dir="runs/mine", epochs=5,
                      global_batch_size=256, strategy=strategy)

`build_model()` returns an uncompiled Keras model that outputs logits; tfdp calls it inside
`strategy.scope()`. `train_ds`/`eval_ds` are unbatched `tf.data` datasets of
`(uint8 image HWC, int label)`: tfdp batches, shards, pads and distributes them.
"""
from __future__ import annotations

import yaml

from tfdp import config as config_lib
from tfdp import data as data_lib
from tfdp.errors import DataError


def dataset_source(dataset, num_classes: int = 0) -> data_lib.Source:
  """Wraps an unbatched (image, label) tf.data.Dataset; counts it once (a pass over labels)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  spec = dataset.element_spec
  if not (isinstance(spec, tuple) and len(spec) == 2):
    raise DataError("the dataset must yield (image, label) pairs, e.g. tfds.load(..., "
                    "as_supervised=True), unbatched.")
  image_spec = spec[0]
  if image_spec.shape.rank != 3 or not image_spec.shape.is_fully_defined():
    raise DataError(f"dataset images must be unbatched HxWxC with a known size, got shape "
                    f"{image_spec.shape}; call .unbatch() or resize them first.")
  count, top = dataset.map(lambda image, label: tf.cast(label, tf.int64)).reduce(
      (tf.constant(0, tf.int64), tf.constant(-1, tf.int64)),
      lambda acc, label: (acc[0] + 1, tf.maximum(acc[1], label)))

  def read(file_indices):
    del file_indices  # one stream
    return dataset.map(lambda image, label: {"image": tf.cast(image, tf.uint8),
                                             "label": tf.cast(label, tf.int64)})

  return data_lib.Source([int(count)], read, "dataset", num_classes=num_classes or int(top) + 1,
                         image_shape=tuple(image_spec.shape))


def fit(model_fn, train_dataset, eval_dataset=None, *, model_dir: str, epochs: int = 1,
        global_batch_size: int = 128, strategy=None, params: str | dict = "", config_files=(),
        verbose=True) -> dict:
  """Trains model_fn() on train_dataset with tfdp's engine; returns the final metrics (and the
  trainer, whose `.model` is the trained model). Resumes from model_dir's checkpoint."""
  overrides = [params if isinstance(params, str) else yaml.safe_dump(params)] if params else []
  config = config_lib.load_config(list(config_files), overrides)
  for name, value in (("epochs", epochs), ("global_batch_size", global_batch_size)):
    if not isinstance(value, int) or isinstance(value, bool):
      raise config_lib.ConfigError(f"tfdp.fit: {name} must be a whole number, got {value!r}.")
    setattr(config.trainer, name, value)
  config_lib.validate(config)
  from tfdp import experiment  # pylint: disable=g-import-not-at-top
  train_source = dataset_source(train_dataset)
  eval_source = (dataset_source(eval_dataset, train_source.num_classes)
                 if eval_dataset is not None else None)
  return experiment.run(config, model_dir, "train" if eval_dataset is None else "train_and_eval",
                        train_source=train_source, eval_source=eval_source, model_fn=model_fn,
                        strategy=strategy, verbose=verbose)
