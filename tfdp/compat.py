"""Workarounds for TensorFlow/Keras behaviour, each with the reason and a test in test_compat.py.

Keep private imports (tensorflow.python…, keras.src…) here and nowhere else.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def mean_aggregated_moving_statistics():
  """Keras 3 creates BatchNormalization moving_mean/moving_variance with aggregation "none"
  (tf.keras 2 used MEAN). Under MirroredStrategy each replica then keeps its own copy, updated from
  its own sub-batch only, and the copies drift apart: evaluation and export read whichever copy
  sits on the device. (Measured here with Keras 3.15; no upstream issue found.) Inside this scope
  non-trainable float variables are created with MEAN aggregation, so the update is averaged over
  replicas and every copy stays equal, as in tf.keras 2."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def creator(next_creator, **kwargs):
    aggregation = kwargs.get("aggregation")
    dtype = kwargs.get("dtype")
    if (not kwargs.get("trainable", True)
        and aggregation in (None, tf.VariableAggregation.NONE)
        and dtype is not None and tf.as_dtype(dtype).is_floating):
      kwargs["aggregation"] = tf.VariableAggregation.MEAN
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    yield
