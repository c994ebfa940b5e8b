"""The all-reduce and loss scaling are right: N replicas train the same weights as one.

Each run is a real `tfdp-train` process (logical CPU devices must be set before TensorFlow
starts), with a model without BatchNorm, fixed seed and the same global batch.
"""
import numpy as np
import pytest

import helpers

tf = pytest.importorskip("tensorflow")

COMMON = ",".join([
    "task.model.name=small_cnn", "task.model.kwargs={batch_norm: false, filters: 8}",
    "task.train_data.source=synthetic", "task.train_data.num_examples=650",  # last batch: 10 of 32
    "task.train_data.image_size=8", "task.train_data.num_classes=4", "task.train_data.augment=true",
    "task.eval_data.source=synthetic", "task.eval_data.num_examples=100",
    "task.eval_data.image_size=8", "task.eval_data.num_classes=4",
    "trainer.global_batch_size=32", "trainer.epochs=1", "trainer.steps_per_loop=7",
    "trainer.learning_rate.base_lr=0.05",
    "trainer.learning_rate.base_batch_size=32", "trainer.learning_rate.warmup_epochs=0.2",
    "runtime.strategy=mirrored",
])


def model_weights(model_dir):
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.saving.load_model(str(model_dir / "model.keras"))
  reader = tf.train.load_checkpoint(str(model_dir / "checkpoints"))
  steps = int(reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"))
  return {v.path: np.asarray(v) for v in model.weights}, steps


def train(tmp_path, replicas):
  model_dir = tmp_path / f"r{replicas}"
  proc = helpers.run_train(f"--model_dir={model_dir}", "--mode=train",
                           f"--params_override={COMMON},runtime.cpu_replicas={replicas}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"replicas={replicas}" in proc.stdout
  return model_weights(model_dir)


def max_relative_difference(a, b):
  return max(float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-12)) for k in b)


def test_two_and_four_replicas_match_one(tmp_path):
  one, steps = train(tmp_path, 1)
  assert steps == 21  # ceil(650 / 32): the padded final step trained too
  initial_like = {k: np.zeros_like(v) for k, v in one.items()}
  assert max_relative_difference(initial_like, one) > 0.5  # the weights moved: a real comparison
  for replicas in (2, 4):
    weights, steps = train(tmp_path, replicas)
    assert steps == 21
    assert max_relative_difference(weights, one) <= 1e-5, replicas
