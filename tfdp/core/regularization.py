"""A replica step's regularization losses (`model.losses`), as Keras would count them.

Two things differ from one Keras step on one device:
- MirroredStrategy traces each replica's step in a thread of its own and switches threads at
  every all-reduce, while Keras keeps a layer's `add_loss` values (activity regularization) in
  lists on the shared layer: read after an all-reduce, `model.losses` may hold another replica's.
  The step keeps them (`Step.keep`) right after the model call; `model_losses` reads them.
- Keras adds a layer's activity regularization as f(output) / rows. tfdp pads an epoch's last
  batch with weight-0 copies of real examples, which f would count again: in a step, each such
  layer is handed f(output with the padded rows zeroed) instead, exact for a regularizer that
  sums over rows (L1, L2 and L1L2 do). Keras then divides by all rows, the trainer's
  global-batch convention; a task may scale it to its own (tfdp.fit: Keras's, by the real rows).
"""
from __future__ import annotations

import contextlib
import threading

from tfdp.core import model_walk

# The open steps are each replica thread's own; the layers (and their stand-ins) are shared.
_LOCAL = threading.local()
_INSTALLED: dict = {}  # id(layer) -> [layer, its own regularizer, steps open on it]
_LOCK = threading.Lock()


def _open_steps() -> list:
  if not hasattr(_LOCAL, "steps"):
    _LOCAL.steps = []
  return _LOCAL.steps


def regularized_layers(model) -> list:
  """Every layer of `model` (nested models too) that has an activity regularizer."""
  return [layer for layer in model_walk.every_layer(model)
          if getattr(layer, "activity_regularizer", None) is not None]


class Step:
  """One replica step's padding mask, activity scale, recorded activity sums and kept losses."""

  def __init__(self, real, scale):
    self.real, self.scale, self.recorded, self.losses = real, scale, [], None

  def keep(self, model) -> list:
    """`model.losses` now, right after the model call (before an all-reduce lets another
    replica's thread call the model), in float32: under a mixed policy an activity
    regularization is in the compute dtype and a kernel's in float32, which add_n cannot add."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    self.losses = [tf.cast(loss, tf.float32) for loss in model.losses]
    return self.losses


class _RealRows:
  """Stands in for one layer's regularizer while steps are open on it."""

  def __init__(self, regularizer):
    self.regularizer = regularizer

  def __call__(self, output):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    steps = _open_steps()
    if not steps:  # a call outside tfdp's steps (another thread's step is open)
      return self.regularizer(output)
    step = steps[-1]
    rank, rows = output.shape.rank, step.real.shape[0]
    if not rank or rows is None or output.shape[0] != rows:
      return self.regularizer(output)  # rows the padding mask does not describe: as Keras
    mask = tf.reshape(tf.cast(step.real > 0, output.dtype), [-1] + [1] * (rank - 1))
    value = self.regularizer(output * mask)
    step.recorded.append(tf.cast(value, tf.float32))
    return value if step.scale is None else value * tf.cast(step.scale, value.dtype)


@contextlib.contextmanager
def replica_step(layers: list, real, scale_of=lambda: None):
  """Open while a replica's step is traced. `layers` (regularized_layers) have their activity
  regularizers see only the rows whose weight in `real` (the batch's padding mask, [rows]) is
  above 0, times `scale_of()` (asked only when there are such layers: it may all-reduce)."""
  steps = _open_steps()
  with _LOCK:
    for layer in layers:
      entry = _INSTALLED.setdefault(id(layer), [layer, layer.activity_regularizer, 0])
      if entry[2] == 0:
        layer.activity_regularizer = _RealRows(entry[1])
      entry[2] += 1
  step = None
  try:
    step = Step(real, scale_of() if layers else None)
    steps.append(step)
    yield step
  finally:
    if step is not None and steps and steps[-1] is step:
      steps.pop()
    with _LOCK:
      for layer in layers:
        entry = _INSTALLED[id(layer)]
        entry[2] -= 1
        if entry[2] == 0:
          layer.activity_regularizer = entry[1]
          del _INSTALLED[id(layer)]


def model_losses(model) -> list:
  """The losses this thread's innermost open step kept, else `model.losses`."""
  steps = _open_steps()
  if steps and steps[-1].losses is not None:
    return steps[-1].losses
  return model.losses


def reported_once(count, rows):
  """Added to `add_n(model.losses) * count` (the regularization reported for each of a replica's
  `count` real rows, as Keras reports it for each row of a batch), this makes the activity
  regularization recorded in this thread's innermost open step count once, as Keras's does:
  Keras divided it by the `rows` of the padded batch. 0.0 when none was recorded."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  steps = _open_steps()
  if not steps or not steps[-1].recorded:
    return 0.0
  step = steps[-1]
  share = tf.cast(count, tf.float32) / tf.cast(rows, tf.float32)
  if step.scale is not None:
    share *= tf.cast(step.scale, tf.float32)
  return tf.add_n(step.recorded) * (1.0 - share)
