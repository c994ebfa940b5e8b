"""Recommenders on user–item interactions, where each worker may hold its own shard.

`task.*_data.source: interactions` reads a CSV or TFRecord file; a path with `{worker}` makes
every worker read only its own file (shard policy `local`), and the workers exchange their
example counts so that all run the same number of steps, the shorter shards padded with
weight-0 rows. Ids become embedding rows the same way on every worker (a vocabulary file with
out-of-vocabulary rows, or hashing: tfdp.interactions.IdMapping), decided by config alone.
"""
from __future__ import annotations

import math

from tfdp import interactions
from tfdp import tasks
from tfdp.config import DataConfig, TaskConfig
from tfdp.errors import ConfigError


def id_mappings(config: TaskConfig) -> tuple[interactions.IdMapping, interactions.IdMapping]:
  rec = config.recommender

  def mapping(vocab_path, buckets):
    if vocab_path:
      return interactions.IdMapping.from_vocabulary_file(vocab_path, oov_buckets=rec.oov_buckets)
    return interactions.IdMapping.hashed(buckets)

  return (mapping(rec.user_vocab_path, rec.user_buckets),
          mapping(rec.item_vocab_path, rec.item_buckets))


def holdout_split(frame, data: DataConfig):
  """Split `train` / `holdout` / `all` of the rows, by a stable hash of (user, item): the same
  rows on every worker and in every run, without a second file."""
  if data.split == "all" or not data.holdout_fraction:
    return frame
  keys = interactions.stable_hash(frame["user"].to_numpy() * 1000003 + frame["item"].to_numpy(),
                                  seed=7)
  held = keys < data.holdout_fraction * 2.0**64
  return frame[held if data.split == "holdout" else ~held]


@tasks.register_task("matrix_factorization")
class MatrixFactorizationTask(tasks.Task):
  """Explicit ratings: rating ≈ mean + b_user + b_item + p_user · q_item, squared error.
  Reports RMSE and MAE over every real rating (sums over workers, divided once)."""

  metric_names = ("loss", "rmse", "mae")
  KWARGS = ("embedding_dim", "l2", "global_mean")

  @classmethod
  def validate(cls, config: TaskConfig) -> None:
    for key, data in (("task.train_data", config.train_data), ("task.eval_data", config.eval_data)):
      if data.source != "interactions":
        raise ConfigError(f"config key '{key}.source' is '{data.source}', but task "
                          "'matrix_factorization' reads interactions: set it to interactions.")
      if data.split not in ("all", "train", "holdout"):
        raise ConfigError(f"config key '{key}.split' is '{data.split}'; interactions take all, "
                          "train or holdout (with holdout_fraction).")
      if not data.label_column:
        raise ConfigError(f"config key '{key}.label_column' is empty; matrix_factorization needs "
                          "explicit ratings (the rating column's name).")
    unknown = sorted(set(config.model.kwargs) - set(cls.KWARGS))
    if unknown:
      raise ConfigError(f"task.model.kwargs {unknown} are not matrix_factorization settings; use "
                        f"{', '.join(cls.KWARGS)}.")

  def build_source(self, data: DataConfig):
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdp import data as data_lib  # pylint: disable=g-import-not-at-top
    local = "{worker" in data.path
    # One process with a {worker} path is refused: it would train on one shard of many.
    path = interactions.resolve_shard_path(data.path, self.worker if self.num_workers > 1 else None,
                                           self.num_workers)
    frame = interactions.read_interactions(path, data.user_column, data.item_column,
                                           data.label_column, data.weight_column,
                                           worker=self.worker if local else None)
    frame = holdout_split(frame, data)
    if not local:
      interactions.check_not_empty(frame, path)
    users, items = id_mappings(self.config)
    columns = {"user": users.lookup(frame["user"].to_numpy()).astype(np.int64),
               "item": items.lookup(frame["item"].to_numpy()).astype(np.int64),
               "label": frame["label"].to_numpy(np.float32),
               "weight": frame["weight"].to_numpy(np.float32)}
    read = lambda files: tf.data.Dataset.from_tensor_slices(columns)
    return data_lib.Source([len(frame)], read, "local" if local else "interactions",
                           info={"users": users.num_rows, "items": items.num_rows,
                                 "mappings": {"user": users.to_dict(), "item": items.to_dict()}})

  def preprocess(self, example, data, training, seed):
    del data, training, seed
    return {k: example[k] for k in ("user", "item", "label")}

  def build_model(self, source):
    import keras  # pylint: disable=g-import-not-at-top
    kwargs = {"embedding_dim": 32, "l2": 0.0, "global_mean": 0.0, **self.config.model.kwargs}
    reg = keras.regularizers.L2(kwargs["l2"]) if kwargs["l2"] else None
    dim = int(kwargs["embedding_dim"])
    user, item = (keras.Input((), dtype="int64", name=k) for k in ("user", "item"))
    init = keras.initializers.RandomNormal(stddev=1.0 / math.sqrt(dim))

    def table(rows, width, name, initializer):
      return keras.layers.Embedding(rows, width, embeddings_initializer=initializer,
                                    embeddings_regularizer=reg, name=name)

    p = table(source.info["users"], dim, "user_factors", init)(user)
    q = table(source.info["items"], dim, "item_factors", init)(item)
    b_user = table(source.info["users"], 1, "user_bias", "zeros")(user)[:, 0]
    b_item = table(source.info["items"], 1, "item_bias", "zeros")(item)[:, 0]
    dot = keras.ops.sum(p * q, axis=-1)
    rating = keras.layers.Rescaling(1.0, offset=float(kwargs["global_mean"]))(dot + b_user + b_item)
    return keras.Model({"user": user, "item": item}, rating, name="matrix_factorization")

  def model_inputs(self, batch):
    return {"user": batch["user"], "item": batch["item"]}

  def per_example_loss(self, batch, outputs):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.square(tf.cast(outputs, tf.float32) - batch["label"])

  def metric_sums(self, batch, outputs, per_example_loss):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    weight = batch["weight"]
    count = tf.reduce_sum(weight)
    absolute = tf.abs(tf.cast(outputs, tf.float32) - batch["label"])
    squared = tf.reduce_sum(per_example_loss * weight)
    return {"loss": (squared, count), "rmse": (squared, count),
            "mae": (tf.reduce_sum(absolute * weight), count)}

  def finalize_metric(self, name, value):
    return math.sqrt(max(value, 0.0)) if name == "rmse" else value
