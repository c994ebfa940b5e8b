"""Weight-0 padding made of real rows: the short last batch of an epoch (or of an uneven split's
share) is filled with copies of its own real rows at weight 0, so BatchNorm's batch statistics
see real data while weighted sums count every real example once (data.make_dataset_fn)."""
from __future__ import annotations

from tfdp.errors import DataError, terms


def zeros_batch(spec, batch: int):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not spec.shape.is_fully_defined():
    raise DataError(f"examples must have fixed shapes to be batched, got {spec}; "
                    f"{terms().fixed_shapes_fix}.")
  shape = [batch, *spec.shape]
  if spec.dtype == tf.string:
    return tf.fill(shape, "")
  return tf.zeros(shape, spec.dtype)


def fill_with_own_rows(batch: dict, size: int) -> dict:
  """A short batch of r real rows → `size` rows: row i is real row i mod r, weight 0 past r. When
  r divides the per-replica batch, each replica's batch statistics (BatchNorm's mean and biased
  variance) are those of the real rows alone."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  real = tf.shape(batch["weight"])[0]

  def filled():
    position = tf.range(size)
    rows = tf.nest.map_structure(lambda x: tf.gather(x, position % real), batch)
    return {**rows, "weight": tf.where(position < real, rows["weight"],
                                       tf.zeros_like(rows["weight"]))}

  # A full batch passes as it is (no copy); static shapes either way.
  return tf.cond(real == size, lambda: tf.nest.map_structure(
      lambda x: tf.ensure_shape(x, [size, *x.shape[1:]]), batch), filled)


def spread_over_slots(batch: dict, slots: int, per_slot: int) -> dict:
  """An uneven split's step of m real rows → `slots` per-replica batches of `per_slot` rows: slot
  t holds the next floor or ceil of m / slots real rows, then weight-0 copies of them (of the
  step's rows, for a slot with none)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  real = tf.shape(batch["weight"])[0]
  position = tf.range(slots * per_slot)
  slot, row = position // per_slot, position % per_slot
  base, extra = real // slots, real % slots
  count = base + tf.cast(slot < extra, tf.int32)
  offset = slot * base + tf.minimum(slot, extra)
  index = tf.where(count > 0, offset + row % tf.maximum(count, 1), row % real)
  rows = tf.nest.map_structure(lambda x: tf.gather(x, index), batch)
  return {**rows, "weight": tf.where(row < count, rows["weight"], tf.zeros_like(rows["weight"]))}


def then_copies_of_last(batches, copies: int, zeros: dict):
  """`batches`, then `copies` weight-0 copies of its last batch (a scan carries it)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  flagged = batches.map(lambda b: (b, False)).concatenate(
      tf.data.Dataset.from_tensors((zeros, True)).repeat(copies))

  def step(last, flagged_batch):
    batch, is_copy = flagged_batch
    out = tf.cond(is_copy, lambda: {**last, "weight": tf.zeros_like(last["weight"])},
                  lambda: batch)
    return out, out

  return flagged.scan(zeros, step)
