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

import os
import threading

import yaml

from tfdp import config as config_lib
from tfdp.core import data as data_lib
from tfdp import logs
from tfdp.core import outputs
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
  """Trains model_fn() on train_dataset with tfdp's engine; returns the final metrics, the
  trainer (whose `.model` is the trained model) and `history`, a pandas DataFrame with one row
  per epoch (metrics.csv; on the chief). Resumes from model_dir's checkpoint."""
  config = config_lib.load_config(list(config_files), _overrides(params))
  for name, value in (("epochs", epochs), ("global_batch_size", global_batch_size)):
    if not isinstance(value, int) or isinstance(value, bool):
      raise config_lib.ConfigError(f"tfdp.fit: {name} must be a whole number, got {value!r}.")
    setattr(config.trainer, name, value)
  config_lib.validate(config)
  logs.start_tensorflow()
  from tfdp.core import experiment  # pylint: disable=g-import-not-at-top
  train_source = dataset_source(train_dataset)
  eval_source = (dataset_source(eval_dataset, train_source.num_classes)
                 if eval_dataset is not None else None)
  return _finished(experiment.run(
      config, model_dir, "train" if eval_dataset is None else "train_and_eval",
      train_source=train_source, eval_source=eval_source, model_fn=model_fn, strategy=strategy,
      verbose=verbose))


def train(config_files=(), params: str | dict = "", *, model_dir: str,
          mode: str = "train_and_eval", verbose=True) -> dict:
  """What `tfdp-train --config_file=... --params_override=...` runs, in this process (a notebook):
  any task, its data from the config. Returns as `fit` does."""
  from tfdp import cli  # pylint: disable=g-import-not-at-top
  config = config_lib.load_config([cli.find_config(p) for p in config_files], _overrides(params))
  logs.start_tensorflow()
  from tfdp.core import experiment  # pylint: disable=g-import-not-at-top
  return _finished(experiment.run(config, model_dir, mode, verbose=verbose))


def _overrides(params: str | dict) -> list[str]:
  return [params if isinstance(params, str) else yaml.safe_dump(params)] if params else []


def _finished(result: dict) -> dict:
  """A run's result with its history; the training iterator released without stalling."""
  release_in_background(result["trainer"])
  metrics_csv = os.path.join(result["model_dir"], outputs.METRICS_FILE)
  import pandas as pd  # pylint: disable=g-import-not-at-top
  result["history"] = pd.read_csv(metrics_csv) if os.path.exists(metrics_csv) else pd.DataFrame()
  return result


def release_in_background(trainer) -> None:
  """Destroys the finished run's training iterator on a daemon thread, so fit returns at once.

  Destroying it can block for up to a minute in TF 2.21 (measured here after four ~80 s runs:
  61.9 s, 9.8 s, 1.2 s, 0.3 s; the suspect is tf.data's autotune thread, whose wait between
  optimizations grows to 60 s: kOptimizationPeriodMaxMs in tensorflow/core/framework/model.h).
  Meanwhile the main thread kept running (its 50 ms sleeps took at most 0.8 s); the apps avoid
  the destructor altogether by leaving with os._exit.

  Not a daemon thread: Python kills daemon threads at exit, and one killed inside TensorFlow's
  C++ code aborted the process ("FATAL: exception not rethrown", seen here). The interpreter
  waits for this one instead, so a script's exit can take as long as the destructor."""
  holder = [trainer.__dict__.pop("_train_iterator", None)]
  if holder[0] is None:
    return
  threading.Thread(target=holder.clear, name="tfdp-release-train-iterator").start()
