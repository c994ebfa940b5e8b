"""More tfdp.fit cases for tests/test_keras_fit_setup.py, run in keras_fit_setup_cases.py's
"model" process (each was a process of its own: ~5 CPU s of TensorFlow's import apiece). Each
returns what its test judges; what tfdp logs lands in that process's stderr."""
import numpy as np

import tfdp
from errors_said import one_line

import keras  # noqa: E402  (the caller made the strategy first: logical devices)
import tensorflow as tf  # noqa: E402

# 2 CPU replicas (the caller's strategy), 40 rows: batches of 8 split evenly.
X = np.random.RandomState(1).randn(40, 3).astype("float32")
Y = X.sum(1, keepdims=True)


def dropout_in_and_outside_the_scope(strategy) -> dict:
  """One seed, one Dropout model built in the scope and outside it: the weights trained apart,
  and the seed states the user's models go on from."""
  def build():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.5), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(64, 8)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
  with strategy.scope():
    inside = build()
  outside = build()
  for name, model in (("in", inside), ("out", outside)):
    tfdp.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
             model_dir=f"runs/dropout_{name}", strategy=strategy)
  seeds = lambda m: [np.asarray(v.value).tolist() for v in m.variables  # noqa: E731
                     if v.name == "seed_generator_state"]
  return {"apart": max(float(np.abs(a - b).max())
                       for a, b in zip(inside.get_weights(), outside.get_weights())),
          "seeds": [seeds(inside), seeds(outside)]}


def labels_in_a_one_element_list() -> list:
  """Model(i, [Dense(1)(i)]) compiled with ["mse"], y=[y] and (x, (y,)) elements: Keras's
  losses, tfdp's from arrays and from a dataset, Keras's evaluate, tfdp's."""
  def build():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, [keras.layers.Dense(1)(inputs)])
    model.compile("sgd", ["mse"])
    return model
  keras_loss = build().fit(X, [Y], batch_size=8, shuffle=False, verbose=0).history["loss"]
  arrays = tfdp.fit(build(), X, [Y], batch_size=8, shuffle=False, verbose=0,
                    model_dir="runs/list_arrays")
  dataset = tfdp.fit(build(), tf.data.Dataset.from_tensor_slices((X, (Y,))).batch(8),
                     verbose=0, model_dir="runs/list_dataset")
  return [keras_loss, arrays.history["loss"], dataset.history["loss"],
          build().evaluate(X, [Y], verbose=0), tfdp.evaluate(build(), X, [Y])]


def batched_before_repeat() -> list:
  """Validation batches of 8, 8, 7 repeated, validation_steps=3; a stream and a finite dataset
  with a short batch mid-way (their warnings land in stderr)."""
  def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model
  val = tf.data.Dataset.from_tensor_slices((X[:23], Y[:23])).batch(8).repeat()
  keras_run = build().fit(X, Y, batch_size=8, shuffle=False, validation_data=val,
                          validation_steps=3, verbose=0)
  ours = tfdp.fit(build(), X, Y, batch_size=8, shuffle=False, validation_data=val,
                  validation_steps=3, verbose=0, model_dir="runs/repeat_val")
  stream = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
  tfdp.fit(build(), stream.repeat(), epochs=2, steps_per_epoch=3, verbose=0,
           model_dir="runs/repeat_stream")
  tfdp.fit(build(), stream.repeat(2), verbose=0, model_dir="runs/repeat_finite")
  return [keras_run.history["val_loss"], ours.history["val_loss"], ours.final["eval_examples"]]


def generator_validation_and_shuffle_batch() -> str:
  """A generator as validation_data (its one line, returned); shuffle='batch' (said in stderr)."""
  x, y = np.ones((16, 3), "float32"), np.ones((16, 1), "float32")
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile("sgd", "mse")
  line = one_line(lambda: tfdp.fit(model, x, y, validation_data=((x, y) for _ in range(2)),
                                   verbose=0, model_dir="runs/generator"))
  tfdp.fit(model, x, y, shuffle="batch", verbose=0, model_dir="runs/shuffle_batch")
  return line


def peer_missing_from_the_copy() -> str:
  """Worker 0 alone copies a model built outside the scope: the peer's collective failure is
  stood in for by a clone_model that raises UnavailableError (put back after)."""
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile("sgd", "mse")

  def unavailable(*args, **kwargs):
    raise tf.errors.UnavailableError(None, None, "Collective ops is aborted by: peer gone")
  clone_model = keras.models.clone_model
  keras.models.clone_model = unavailable
  try:
    tfdp.fit(model, np.zeros((8, 4)), np.zeros((8, 2)), verbose=0, model_dir="runs/peer")
  except tfdp.TfdpError as error:
    return f"{type(error).__name__} {error}"
  finally:
    keras.models.clone_model = clone_model
  return "no error"


def cases(strategy) -> dict:
  return {"dropout": dropout_in_and_outside_the_scope(strategy),
          "one_element_list": labels_in_a_one_element_list(),
          "batched_before_repeat": batched_before_repeat(),
          "generator_validation": generator_validation_and_shuffle_batch(),
          "peer_missing": peer_missing_from_the_copy()}
