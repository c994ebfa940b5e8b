"""Padding is real rows at weight 0: BatchNorm sees real data; each example counts once."""
import numpy as np
import pytest

import helpers
from tfdp import config as config_lib
from tfdp.core import data as data_lib
from tfdp.core import regularization
from tfdp.core import task as tasks

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

TASK = tasks.make_task(config_lib.TaskConfig())  # image_classification


def data_config(**kw):
  kw.setdefault("mean", [0.0, 0.0, 0.0])
  kw.setdefault("std", [1.0, 1.0, 1.0])
  return config_lib.DataConfig(**kw)


def id_source(count, kind="test"):
  """`count` in-memory id images (helpers.id_image), label id % 4."""
  images = np.stack([helpers.id_image(i, 6) for i in range(count)]) if count else (
      np.zeros([0, 6, 6, 3], np.uint8))
  labels = np.arange(count, dtype=np.int64) % 4
  return data_lib.Source([count], lambda files: tf.data.Dataset.from_tensor_slices(
      {"image": images, "label": labels}), kind, num_classes=4, image_shape=(6, 6, 3))


def batches(plan, data, pipeline=0, training=True, epochs=1, start_step=0):
  ctx = tf.distribute.InputContext(plan.num_pipelines, pipeline,
                                   plan.num_pipelines * plan.replicas_per_pipeline)
  return list(data_lib.make_dataset_fn(plan, data, TASK, training=training, seed=3, epochs=epochs,
                                       start_step=start_step)(ctx))


def test_batchnorm_moving_statistics_are_those_of_the_real_examples_alone():
  """26 examples in steps of 8 (one replica): each epoch's last batch holds 2 real rows. Only a
  padding that repeats those rows a whole number of times (2 real + 3 copies of them = 8) keeps
  the batch mean and biased variance, so only then can the moving statistics match exactly; zero
  padding pulls both towards 0 (momentum 0.5: the last batch weighs half)."""
  data = data_config(source="test", augment=True)
  plan = data_lib.plan_input(id_source(26), data, global_batch=8, num_replicas=1, num_pipelines=1)
  assert plan.steps_per_epoch == 4
  padded, alone = (keras.Sequential([keras.Input((6, 6, 3)), keras.layers.BatchNormalization(
      momentum=0.5)]) for _ in range(2))
  for batch in batches(plan, data, epochs=2):
    real = batch["weight"] > 0
    padded(batch["image"], training=True)
    alone(tf.boolean_mask(batch["image"], real), training=True)  # 8, 8, 8, then 2 rows
  assert [int(b["weight"].numpy().sum()) for b in batches(plan, data)] == [8, 8, 8, 2]
  for mine, reference in zip(padded.layers[0].non_trainable_weights,
                             alone.layers[0].non_trainable_weights):  # moving mean, variance
    np.testing.assert_allclose(mine.numpy(), reference.numpy(), rtol=1e-5, atol=1e-6)


def test_weighted_loss_and_accuracy_count_every_example_once():
  data = data_config(source="test")
  source = id_source(26)
  plan = data_lib.plan_input(source, data, global_batch=8, num_replicas=1, num_pipelines=1)
  projection = tf.random.stateless_normal([6 * 6 * 3, 4], seed=[0, 1])

  def sums(batch):
    logits = tf.reshape(batch["image"], [tf.shape(batch["image"])[0], -1]) @ projection
    per_example = keras.losses.sparse_categorical_crossentropy(batch["label"], logits,
                                                               from_logits=True)
    return {name: np.array(pair, np.float64)
            for name, pair in tasks.classification_sums(batch, logits, per_example).items()}

  padded = [sums(b) for b in batches(plan, data, training=False)]
  images = np.stack([helpers.id_image(i, 6) for i in range(26)]).astype(np.float32) / 255.0
  alone = sums({"image": tf.constant(images), "label": tf.range(26, dtype=tf.int64) % 4,
                "weight": tf.ones([26])})
  for name in ("loss", "accuracy"):
    np.testing.assert_allclose(sum(p[name] for p in padded), alone[name], rtol=1e-5)
  assert alone["loss"][1] == 26
  last = batches(plan, data, training=False)[-1]
  ids = helpers.image_ids(last["image"].numpy())
  assert list(ids) == [24, 25] * 4 and list(last["weight"].numpy()) == [1, 1] + [0] * 6


def test_activity_regularization_counts_the_real_rows_only():
  """A padded batch (5 real rows, then copies of 3 of them at weight 0): inside a replica step,
  Keras's f(output) / rows counts the real rows alone (still divided by all 8 rows, the trainer's
  global-batch convention), and the layer has its own regularizer back afterwards."""
  inner = keras.layers.Dense(3, activity_regularizer=keras.regularizers.L2(0.5))
  model = keras.Sequential([keras.Input((4,)), keras.Sequential([inner]), keras.layers.Dense(2)])
  x = tf.random.stateless_normal([5, 4], seed=[2, 3])
  padded, real = tf.concat([x, x[:3]], axis=0), tf.constant([1.0] * 5 + [0.0] * 3)
  own = inner.activity_regularizer
  layers = regularization.regularized_layers(model)
  assert layers == [inner]
  with regularization.replica_step(layers, real) as step:
    model(padded)
    (kept,) = step.keep(model)
  assert inner.activity_regularizer is own
  np.testing.assert_allclose(float(kept), float(own(inner(x))) / 8, rtol=1e-6)
  model(padded)  # outside a step: Keras's own, every row
  np.testing.assert_allclose(float(model.losses[0]), float(own(inner(padded))) / 8, rtol=1e-6)


def test_whole_padding_batches_repeat_the_last_and_a_resume_sees_the_same(tmp_path):
  """Uneven file shards (53 and 28 examples, batches of 4): the short pipeline pads 7 whole
  batches after its real ones; a resume inside them (step 9 of epoch 2) reads the last real batch
  back and yields exactly what the uninterrupted run yields from there."""
  records = helpers.write_tfrecords(tmp_path, [23, 17, 30, 11])
  data = data_config(source="tfrecord", path=records, shard_policy="file", cache=False)
  plan = data_lib.plan_input(data_lib.make_source(data), data, global_batch=8, num_replicas=2,
                             num_pipelines=2)
  assert plan.counts == [53, 28] and plan.steps_per_epoch == 14
  full = batches(plan, data, pipeline=1, epochs=2)
  last_real = full[6]  # rows 24..27
  assert last_real["weight"].numpy().sum() == 4
  for batch in full[7:14]:
    assert batch["weight"].numpy().sum() == 0
    np.testing.assert_array_equal(batch["image"], last_real["image"])
  resumed = batches(plan, data, pipeline=1, epochs=2, start_step=14 + 9)
  assert len(resumed) == len(full) - 23
  for mine, reference in zip(resumed, full[23:]):
    np.testing.assert_array_equal(mine["image"], reference["image"])
    np.testing.assert_array_equal(mine["weight"], reference["weight"])


def test_a_pipeline_with_no_real_examples_pads_with_zeros():
  data = data_config(source="test")
  plan = data_lib.plan_input(id_source(0, kind="local"), data, global_batch=8, num_replicas=2,
                             num_pipelines=2, local_counts=[((), [9]), ((), [0])])
  # Rows per step follow the shards (tfdp.core.local_shards): worker 0 holds all 9 examples and
  # takes all 8 rows of a step, so 2 steps an epoch; the empty worker still runs every step.
  assert plan.policy == "local" and plan.steps_per_epoch == 2 and plan.shard_batches == (8, 0)
  empty = batches(plan, data, pipeline=1, epochs=2)
  assert len(empty) == 4
  assert all(b["weight"].numpy().sum() == 0 and not b["image"].numpy().any() for b in empty)


class _TextTask:
  """A task whose preprocessed examples keep a string feature."""

  def preprocess(self, example, data, training, seed):
    del data, training, seed
    return {"text": example["text"], "label": example["label"]}


@pytest.mark.parametrize("count, expected", [(5, [b"e", b"e", b"e", b"e"]), (0, [b""] * 4)])
def test_string_features_pad_with_real_strings_or_empty_ones(count, expected):
  words = np.array([b"a", b"b", b"c", b"d", b"e"][:count], dtype=object)
  source = data_lib.Source([count], lambda files: tf.data.Dataset.from_tensor_slices(
      {"text": tf.constant(words, tf.string, [count]),
       "label": tf.range(count, dtype=tf.int64)}), "local")
  data = data_config(source="test", shuffle=False)
  plan = data_lib.plan_input(source, data, global_batch=4, num_replicas=1, num_pipelines=1,
                             local_counts=[((), [count])])
  ctx = tf.distribute.InputContext(1, 0, 1)
  out = list(data_lib.make_dataset_fn(plan, data, _TextTask(), training=True, seed=0)(ctx))
  assert len(out) == max(plan.steps_per_epoch, 1)
  assert list(out[-1]["text"].numpy()) == expected
  assert list(out[-1]["weight"].numpy()) == [float(count > 0), 0, 0, 0]
