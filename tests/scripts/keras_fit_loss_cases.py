"""What a compiled loss and its metrics mean in Keras, through tfdp.fit on 2 replicas against
single-device model.fit (tests/test_keras_fit_losses.py judges the JSON this prints): masked
per-step losses, reductions other than the mean, regularization in the reported loss, metrics
whose variables a first update creates; and what tfdp cannot honour, refused in one line."""
import json
import os

import numpy as np

import tfdp
from errors_said import one_line

strategy = tfdp.make_strategy(cpu_replicas=2)
import keras  # noqa: E402  (after the strategy: logical devices first)
import tensorflow as tf  # noqa: E402

RNG = np.random.default_rng(0)
N, BATCH = 60, 16  # a last batch of 12: Keras divides it by its own rows or steps


def both(build, x, y, validation, **fit_kwargs):
  """(model.fit's history and weights, tfdp.fit's) from the same seed and data order."""
  keras.utils.set_random_seed(3)
  reference = build()
  expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                           validation_data=validation, **fit_kwargs).history
  keras.utils.set_random_seed(3)
  with strategy.scope():
    ours = build()
  got = tfdp.fit(ours, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                 validation_data=validation, model_dir=f"runs/{build.__name__}",
                 **fit_kwargs).history
  weights = max(float(np.max(np.abs(a - b)))
                for a, b in zip(reference.get_weights(), ours.get_weights()))
  return {"keras": {k: [float(v) for v in got_k] for k, got_k in expected.items()},
          "tfdp": {k: [float(v) for v in got_k] for k, got_k in got.items() if k in expected},
          "weights": weights}


def masked_steps():
  """Embedding(mask_zero) → GRU per step: Keras divides the loss by the batch's unmasked steps."""
  inputs = keras.Input((7,), dtype="int32")
  h = keras.layers.Embedding(12, 4, mask_zero=True)(inputs)
  h = keras.layers.GRU(5, return_sequences=True)(h)
  model = keras.Model(inputs, keras.layers.Dense(3)(h))
  model.compile(keras.optimizers.SGD(0.5),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
  return model


def summed_and_regularized():
  """A summed loss, an L2 kernel regularizer, a lazily built F1Score."""
  inputs = keras.Input((6,))
  h = keras.layers.Dense(8, activation="relu",
                         kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
  model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
  model.compile(keras.optimizers.SGD(0.01), keras.losses.CategoricalCrossentropy(reduction="sum"),
                metrics=[keras.metrics.F1Score(average="macro"), "accuracy"])
  return model


def activity_regularized():
  """An activity regularizer (Keras: f(output) / the batch's rows) beside a summed loss, whose
  counts are all-reduced between the model call and the read of model.losses: the padded last
  batch's copies must not count, and each replica must read its own regularization."""
  inputs = keras.Input((6,))
  h = keras.layers.Dense(8, activation="relu",
                         activity_regularizer=keras.regularizers.L2(0.05))(inputs)
  model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
  model.compile(keras.optimizers.SGD(0.01), keras.losses.CategoricalCrossentropy(reduction="sum"),
                metrics=["accuracy"])
  return model


def regularized_twice():
  """A kernel and an activity regularizer (strong: most of the loss), a float32 head."""
  inputs = keras.Input((6,))
  h = keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.5),
                         activity_regularizer=keras.regularizers.L2(0.5))(inputs)
  model = keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(h))
  model.compile(keras.optimizers.SGD(0.01),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def mixed_bfloat16_regularized(x, y, validation):
  """Under mixed_bfloat16 the activity regularization is bfloat16 and the kernel's float32, which
  Keras 3.15's own compute_loss cannot add (TypeError: a list of bfloat16 and float32); tfdp adds
  them in float32. Its history against float32 model.fit's (bfloat16's rounding apart)."""
  keras.utils.set_random_seed(3)
  expected = regularized_twice().fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                                     validation_data=validation).history
  keras.config.set_dtype_policy("mixed_bfloat16")
  try:
    keras.utils.set_random_seed(3)
    with strategy.scope():
      ours = regularized_twice()
    got = tfdp.fit(ours, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                   validation_data=validation, model_dir="runs/mixed_bfloat16").history
  except Exception as error:  # pylint: disable=broad-except
    return {"error": f"{type(error).__name__}: {error}"[:500]}
  finally:
    keras.config.set_dtype_policy("float32")
  return {"keras": {k: [float(v) for v in vs] for k, vs in expected.items()},
          "tfdp": {k: [float(v) for v in got[k]] for k in expected if k in got}}


def weighted_mean():
  """mean_with_sample_weight: divided by the batch's weights; R2Score, built lazily."""
  inputs = keras.Input((6,))
  model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
  model.compile(keras.optimizers.SGD(0.05),
                keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
                metrics=[keras.metrics.R2Score()])
  return model


class RunningMax(keras.metrics.Metric):
  def __init__(self, name="running_max", **kwargs):
    super().__init__(name=name, **kwargs)
    self.largest = self.add_variable(shape=(), initializer="zeros", name="largest")

  def update_state(self, y_true, y_pred, sample_weight=None):
    self.largest.assign(tf.maximum(self.largest, tf.reduce_max(y_pred)))

  def result(self):
    return self.largest


class OwnTrainStep(keras.Model):
  def train_step(self, data):
    return {}


class OwnComputeLoss(keras.Model):
  def compute_loss(self, *args, **kwargs):
    return super().compute_loss(*args, **kwargs) * 2.0


class OwnPredictStep(keras.Model):
  def predict_step(self, data):
    return super().predict_step(data) * 2.0


class Reconstruction(keras.layers.Layer):
  """An autoencoder's loss, added by a layer: the mean squared error of its input's rebuild."""

  def call(self, x, rebuilt):
    self.add_loss(keras.ops.mean(keras.ops.square(x - rebuilt)))
    return rebuilt


def add_loss_only():
  """Compiled without a loss: the layers' add_loss is all of it, and x alone trains it."""
  inputs = keras.Input((6,))
  rebuilt = keras.layers.Dense(6)(keras.layers.Dense(3, activation="tanh")(inputs))
  model = keras.Model(inputs, Reconstruction()(inputs, rebuilt))
  model.compile(keras.optimizers.SGD(0.1))
  return model


def add_loss_evaluated(x) -> dict:
  """tfdp.evaluate on x alone (2 replicas) against model.evaluate."""
  keras.utils.set_random_seed(3)
  with strategy.scope():
    model = add_loss_only()
  return {"tfdp": tfdp.evaluate(model, x, batch_size=8)["loss"],
          "keras": model.evaluate(x, batch_size=8, verbose=0)}


def refused_without_loss(metrics=()) -> str:
  with strategy.scope():
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile("sgd", metrics=list(metrics))
  return one_line(lambda: tfdp.fit(model, RNG.normal(size=(8, 6)).astype("float32"), batch_size=4,
                                   verbose=0, model_dir=f"runs/refused_{len(os.listdir('.'))}"))


def refused(model_class=keras.Model, metrics=(), reduction="sum_over_batch_size",
            call=tfdp.fit) -> str:
  x = RNG.normal(size=(8, 6)).astype("float32")
  with strategy.scope():
    inputs = keras.Input((6,))
    model = model_class(inputs, keras.layers.Dense(3)(inputs))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                    reduction=reduction),
                  metrics=list(metrics))
  if call is tfdp.predict:
    return one_line(lambda: tfdp.predict(model, x))
  return one_line(lambda: tfdp.fit(model, x, np.arange(8) % 3, batch_size=4, epochs=1,
                                   verbose=0, model_dir=f"runs/refused_{len(os.listdir('.'))}"))


tokens = RNG.integers(1, 12, size=(N + 20, 7))
tokens[np.arange(7)[None, :] >= RNG.integers(2, 8, size=(N + 20, 1))] = 0  # padded tails
steps_y = RNG.integers(0, 3, size=(N + 20, 7))
x = RNG.normal(size=(N + 20, 6)).astype("float32")
one_hot = keras.utils.to_categorical(np.abs(x[:, 0] * 2).astype("int64") % 3, 3)
target = (x @ RNG.normal(size=(6, 1))).astype("float32")
weights = RNG.uniform(0.2, 2.0, size=(N,)).astype("float32")
out = {
    "masked_steps": both(masked_steps, tokens[:N], steps_y[:N], (tokens[N:], steps_y[N:])),
    "summed_and_regularized": both(summed_and_regularized, x[:N], one_hot[:N],
                                   (x[N:], one_hot[N:])),
    "activity_regularized": both(activity_regularized, x[:N], one_hot[:N],
                                 (x[N:], one_hot[N:])),
    "weighted_mean": both(weighted_mean, x[:N], target[:N], (x[N:], target[N:]),
                          sample_weight=weights),
    # 64 examples: no padded batch (an add_loss sees a padded batch's copies: README)
    "add_loss_only": both(add_loss_only, x[:64], None, (x[64:], x[64:])),
    "add_loss_evaluated": add_loss_evaluated(x[:64]),
    "no_loss_nor_add_loss": refused_without_loss(),
    "metrics_without_loss": refused_without_loss(["mae"]),
    "mixed_bfloat16_regularized": mixed_bfloat16_regularized(
        x[:N], np.argmax(one_hot[:N], axis=1), (x[N:], np.argmax(one_hot[N:], axis=1))),
    "own_train_step": refused(OwnTrainStep),
    "own_compute_loss": refused(OwnComputeLoss),
    "own_predict_step": refused(OwnPredictStep, call=tfdp.predict),
    "running_max": refused(metrics=[RunningMax()]),
    "no_reduction": refused(reduction="none"),
    "reduction_none": refused(reduction=None),  # Keras takes None for "none"
}
print(json.dumps(out))
os._exit(0)  # pylint: disable=protected-access  (skip TF's slow teardown)
