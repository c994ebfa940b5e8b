"""tfdp.fit cases for tests/test_keras_fit.py, one process each: `python keras_fit_cases.py CASE
OUT_JSON [replicas]`. Under tfdp-launch every worker runs the same case (TF_CONFIG set)."""
import contextlib
import functools
import json
import os
import sys

import numpy as np

import tfdp
from errors_said import one_line

CASE, OUT = sys.argv[1], sys.argv[2]
REPLICAS = int(sys.argv[3]) if len(sys.argv) > 3 else 0
strategy = tfdp.make_strategy(cpu_replicas=REPLICAS) if REPLICAS else tfdp.make_strategy()
import keras  # noqa: E402  (after the strategy: logical devices first)
import tensorflow as tf  # noqa: E402

RNG = np.random.default_rng(0)
RANK = int(os.environ.get("TFDP_WORKER_INDEX", "0"))


class Positives(keras.metrics.Metric):
  """A metric a user subclassed: the weighted count of positive predictions."""

  def __init__(self, name="positives", **kwargs):
    super().__init__(name=name, **kwargs)
    self.count = self.add_variable(shape=(), initializer="zeros", name="count")

  def update_state(self, y_true, y_pred, sample_weight=None):
    hits = tf.cast(tf.reshape(y_pred, [-1]) > 0.5, tf.float32)
    if sample_weight is not None:
      hits *= tf.reshape(tf.cast(sample_weight, tf.float32), [-1])
    self.count.assign_add(tf.reduce_sum(hits))

  def result(self):
    return self.count


def multi_output_model():
  inputs = keras.Input((6,), name="features")
  hidden = keras.layers.Dense(16, activation="relu")(inputs)
  klass = keras.layers.Dense(4, activation="softmax", name="klass")(hidden)
  binary = keras.layers.Dense(1, activation="sigmoid", name="binary")(hidden)
  value = keras.layers.Dense(1, name="value")(hidden)
  return keras.Model(inputs, {"klass": klass, "binary": binary, "value": value})


def compile_multi(model, lr=0.05):
  model.compile(
      keras.optimizers.Adam(lr),
      loss={"klass": "sparse_categorical_crossentropy", "binary": "binary_crossentropy",
            "value": "mse"},
      loss_weights={"klass": 1.0, "binary": 0.5, "value": 0.25},
      # MeanIoU: an int64 confusion matrix (once refused as not adding up over batches)
      metrics={"klass": ["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2),
                         keras.metrics.MeanIoU(4, sparse_y_pred=False, name="miou")],
               "binary": [keras.metrics.BinaryAccuracy(), keras.metrics.AUC(name="auc"),
                          keras.metrics.Precision(name="precision"),
                          keras.metrics.Recall(name="recall"), Positives()],
               "value": [keras.metrics.MeanSquaredError(name="mse"),
                         keras.metrics.MeanAbsoluteError(name="mae"),
                         keras.metrics.RootMeanSquaredError(name="rmse")]})


def multi_data(n):
  x = RNG.normal(size=(n, 6)).astype("float32")
  y = {"klass": (np.abs(x[:, 0] * 2).astype("int64") % 4),
       "binary": (x[:, 1] > 0).astype("float32")[:, None],
       "value": (x[:, 2] - x[:, 3]).astype("float32")[:, None]}
  return x, y


def metrics_case():
  """Exact Keras metrics on 3 replicas with an uneven last batch; the model afterwards."""
  x, y = multi_data(181)
  x_val, y_val = multi_data(27)  # batches of 13 over 3 replicas: a last batch of 1 real example
  with strategy.scope():
    model = multi_output_model()
    compile_multi(model)
  history = tfdp.fit(model, x, y, batch_size=13, epochs=2, validation_data=(x_val, y_val),
                     model_dir="runs/metrics", verbose=0)  # 13 over 3 replicas: 5, 4, 4
  single = multi_output_model()  # single-device Keras on the same weights: the reference
  single.set_weights(model.get_weights())
  compile_multi(single)
  reference = single.evaluate(x_val, y_val, batch_size=7, verbose=0, return_dict=True)
  tfdp_val = {k[len("val_"):]: v[-1] for k, v in history.history.items() if k.startswith("val_")}
  # Each output's loss on its own, from single-device predictions (Keras 3.15's evaluate reports
  # per-output losses that do not add up to its own total here).
  single_pred = single.predict(x_val, verbose=0)
  own_losses = {f"{name}_loss": float(np.mean(keras.losses.get(fn)(y_val[name], single_pred[name])))
                for name, fn in (("klass", "sparse_categorical_crossentropy"),
                                 ("binary", "binary_crossentropy"), ("value", "mse"))}
  again = tfdp.fit(model, x, y, batch_size=13, epochs=2, validation_data=(x_val, y_val),
                   model_dir="runs/metrics", verbose=0)  # finished: its history, at once
  predicted = tfdp.predict(model, x_val, batch_size=9)
  model.save("after.keras")
  out = {"reference": {k: float(v) for k, v in reference.items()}, "tfdp": tfdp_val,
          "output_losses": own_losses,
          "tfdp_evaluate": tfdp.evaluate(model, x_val, y_val, batch_size=9),
          "predict_difference": float(max(np.abs(predicted[k] - v).max()
                                          for k, v in single.predict(x_val, verbose=0).items())),
          "keras_evaluate_after": model.evaluate(x_val, y_val, batch_size=12, verbose=0,
                                                 return_dict=True)["loss"]
                                  if REPLICAS == 1 else None,
          "rerun_history": again.history, "first_history": history.history,
          "rerun_final_eval_loss": again.final.get("eval_loss"),
          "saved": os.path.exists("after.keras"),
          "config_yaml": __import__("yaml").safe_load(open("runs/metrics/config.yaml")),
          "exported": os.path.exists("runs/metrics/model.keras")}
  changed = [w + 0.01 for w in model.get_weights()]  # weights loaded (or trained) since
  model.set_weights(changed)
  refused = one_line(lambda: tfdp.fit(model, x, y, batch_size=13, epochs=2,
                                      validation_data=(x_val, y_val), model_dir="runs/metrics"))
  kept = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), changed))
  out["changed_since"] = [refused, kept]
  return out


def small_classifier(width=6):
  return keras.Sequential([keras.Input((width,)), keras.layers.Dense(8, activation="relu"),
                           keras.layers.Dense(3)])


def compile_small(model, lr=0.1):
  model.compile(keras.optimizers.SGD(lr),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])


def forms_case():
  """Input forms: dict inputs, batched and unbatched datasets, sample and class weights; bad
  input one-liners; a subclassed model without get_config exports its weights."""
  x = RNG.normal(size=(96, 6)).astype("float32")
  y = (np.abs(x[:, 0] * 2).astype("int64") % 3)
  weights = RNG.uniform(0.1, 2.0, size=96).astype("float32")
  out = {}
  # Weighted loss at lr 0 (weights never move): tfdp's train loss is Keras's weighted loss.
  with strategy.scope():
    model = small_classifier()
    compile_small(model, lr=0.0)
  class_weight = {0: 1.0, 1: 3.0, 2: 0.5}
  history = tfdp.fit(model, x, y, batch_size=16, epochs=1, sample_weight=weights,
                     class_weight=class_weight, shuffle=False, model_dir="runs/weights", verbose=0)
  combined = weights * np.array([class_weight[int(c)] for c in y], np.float32)
  single = small_classifier()
  single.set_weights(model.get_weights())
  compile_small(single, lr=0.0)
  out["weighted"] = [history.history["loss"][0],
                     single.evaluate(x, y, sample_weight=combined, batch_size=96, verbose=0,
                                     return_dict=True)["loss"]]
  # Dict inputs (two named inputs), from arrays and from a batched dataset.
  with strategy.scope():
    a, b = keras.Input((3,), name="a"), keras.Input((3,), name="b")
    joined = keras.layers.Concatenate()([keras.layers.Dense(4)(a), keras.layers.Dense(4)(b)])
    two = keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(joined))
    compile_small(two)
  dict_x = {"a": x[:, :3], "b": x[:, 3:]}
  out["dict_arrays"] = tfdp.fit(two, dict_x, y, batch_size=16, epochs=1, model_dir="runs/dict",
                                verbose=0).final["train_loss"]
  batched = tf.data.Dataset.from_tensor_slices((dict_x, y)).batch(16)
  h = tfdp.fit(two, batched, epochs=1, model_dir="runs/dict_ds", verbose=0)
  out["batched_dataset"] = [h.params["batch_size"], h.final["step"]]
  # Batched with drop_remainder (a static batch dimension), into a model without keras.Input and
  # into one whose dict's first key is not its first input: each batch was taken for one example.
  dropped = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
  with strategy.scope():
    no_input = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)])
    compile_small(no_input)
  h = tfdp.fit(no_input, dropped, epochs=1, model_dir="runs/dropped", verbose=0)
  rank_three = RNG.normal(size=(96, 2, 3)).astype("float32")
  with strategy.scope():
    image, vector = keras.Input((2, 3), name="img"), keras.Input((3,), name="a")
    mixed = keras.Model([image, vector], keras.layers.Dense(3)(keras.layers.Concatenate()(
        [keras.layers.Flatten()(image), vector])))
    compile_small(mixed)
  mixed_dropped = tf.data.Dataset.from_tensor_slices(
      ({"img": rank_three, "a": x[:, :3]}, y)).batch(16, drop_remainder=True)
  out["drop_remainder"] = {
      "no_input": [h.params["batch_size"], h.final["step"]],
      "no_input_predict_rows": int(tfdp.predict(no_input, dropped.map(lambda a, b: a)).shape[0]),
      "no_input_evaluated": tfdp.evaluate(no_input, dropped)["examples"],
      "dict_first_key": tfdp.fit(mixed, mixed_dropped, epochs=1, model_dir="runs/dropped_dict",
                                 verbose=0).final["step"]}
  unbatched = tf.data.Dataset.from_tensor_slices((x, y, weights))
  with strategy.scope():
    plain = small_classifier()
    compile_small(plain)
  h = tfdp.fit(plain, unbatched, batch_size=32, epochs=1, model_dir="runs/unbatched", verbose=0)
  out["unbatched_dataset"] = [h.params["batch_size"], h.final["step"]]
  # Keras's own methods on the trained model, in this process (2 replicas, even batches).
  out["after_fit"] = {"evaluate": plain.evaluate(x, y, batch_size=16, verbose=0, return_dict=True),
                      "tfdp_evaluate": tfdp.evaluate(plain, x, y, batch_size=16),
                      "predict_rows": int(plain.predict(x, batch_size=16, verbose=0).shape[0])}
  # One-hot labels with a categorical loss and CategoricalAccuracy, on 3 of 2 x 16 + 3 rows.
  with strategy.scope():
    onehot = small_classifier()
    onehot.compile(keras.optimizers.SGD(0.1), keras.losses.CategoricalCrossentropy(from_logits=True),
                   metrics=[keras.metrics.CategoricalAccuracy(name="categorical_accuracy")])
  y_onehot = np.eye(3, dtype=np.float32)[y]
  h = tfdp.fit(onehot, x, y_onehot, batch_size=16, epochs=1, validation_data=[x[:35], y_onehot[:35]],
               model_dir="runs/onehot", verbose=0)
  single = small_classifier()
  single.set_weights(onehot.get_weights())
  single.compile(keras.optimizers.SGD(0.1), keras.losses.CategoricalCrossentropy(from_logits=True),
                 metrics=[keras.metrics.CategoricalAccuracy(name="categorical_accuracy")])
  out["onehot"] = [h.history["val_categorical_accuracy"][-1], h.history["val_loss"][-1],
                   single.evaluate(x[:35], y_onehot[:35], verbose=0, return_dict=True)]
  out["errors"] = {}
  # Bad input: one line each.
  out["errors"].update({
      "lengths": one_line(lambda: tfdp.fit(plain, x, y[:50], model_dir="runs/bad")),
      "split_with_dataset": one_line(lambda: tfdp.fit(plain, unbatched.batch(8),
                                                      validation_split=0.2, model_dir="runs/bad")),
      "infinite": one_line(lambda: tfdp.fit(plain, unbatched.repeat().batch(8),
                                            model_dir="runs/bad")),
      "one_hot_sparse": one_line(lambda: tfdp.fit(plain, x, np.eye(3)[y], batch_size=16,
                                                  model_dir="runs/bad")),
      "model_checkpoint": one_line(lambda: tfdp.fit(
          plain, x, y, callbacks=[keras.callbacks.ModelCheckpoint("m.keras")],
          model_dir="runs/bad")),
      "ids_categorical": one_line(lambda: tfdp.fit(onehot, x, y, batch_size=16,
                                                   model_dir="runs/bad")),
  })
  # Arrays are shuffled by the user's keras.utils.set_random_seed, as model.fit shuffles them.
  start, by_seed = plain.get_weights(), []
  for seed in (1, 2, 1):
    plain.set_weights(start)
    keras.utils.set_random_seed(seed)
    tfdp.fit(plain, x, y, batch_size=16, epochs=1, model_dir=f"runs/seeded_{len(by_seed)}",
             verbose=0)
    by_seed.append(plain.get_weights())
  out["seeded"] = [max(float(np.abs(a - b).max()) for a, b in zip(by_seed[i], by_seed[j]))
                   for i, j in ((0, 1), (0, 2))]
  with strategy.scope():  # the history's train_steps column took its place (a probe)
    named_steps = small_classifier()
    named_steps.compile(keras.optimizers.SGD(0.1),
                        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        metrics=[keras.metrics.SparseCategoricalAccuracy(name="steps")])
  out["errors"]["metric_named_steps"] = one_line(lambda: tfdp.fit(named_steps, x, y,
                                                                  model_dir="runs/bad"))
  # Keras's bare errors from inside the traced step, or after an epoch (validation_data): now one
  # line before anything runs (a probe; runs/bad stays unwritten).
  out["errors"]["validation_width"] = one_line(lambda: tfdp.fit(
      plain, x, y, validation_data=(x[:, :4], y), model_dir="runs/bad", verbose=0))
  out["errors"]["validation_labels"] = one_line(lambda: tfdp.fit(
      plain, x, y, validation_data=(x, np.zeros((96, 5), np.float32)), model_dir="runs/bad",
      verbose=0))
  out["errors"]["labels_shape"] = one_line(lambda: tfdp.fit(
      plain, x, np.zeros((96, 5), np.float32), model_dir="runs/bad", verbose=0))
  out["errors"]["per_step_weights"] = one_line(lambda: tfdp.fit(  # "384 entries for 96 examples"
      plain, x, y, sample_weight=np.ones((96, 4), np.float32), model_dir="runs/bad"))
  out["errors"]["per_step_weights_dataset"] = one_line(lambda: tfdp.fit(  # a bare reshape error
      plain, tf.data.Dataset.from_tensor_slices((x, y, np.ones((96, 4), np.float32))).batch(16),
      model_dir="runs/bad"))
  out["errors"]["sparse_x"] = one_line(lambda: tfdp.fit(  # "a value without rows"
      plain, tf.sparse.from_dense(x), y, model_dir="runs/bad"))
  class MaskProbe(keras.layers.Layer):  # keeps the replicas' mean of one dropout mask
    def build(self, shape):
      self.mask = self.add_weight(shape=(16, 8), initializer="zeros", trainable=False,
                                  aggregation="mean", name="mask")
      self.drop = keras.layers.Dropout(0.5)

    def call(self, h, training=None):
      if training:
        self.mask.assign(self.drop(keras.ops.ones((16, 8)), training=True))
      return h

  with strategy.scope():
    probed = keras.Sequential([keras.Input((6,)), MaskProbe(), keras.layers.Dense(3)])
    compile_small(probed)
  tfdp.fit(probed, x, y, batch_size=32, epochs=1, model_dir="runs/dropout_masks", verbose=0)
  out["dropout_mask_values"] = sorted({round(float(v), 3) for v in
                                       np.ravel(probed.layers[0].mask.numpy())})
  stream = iter(list(zip(x, y)))  # a one-shot source: counted, then empty
  one_shot = tf.data.Dataset.from_generator(lambda: stream, output_signature=(
      tf.TensorSpec([6], tf.float32), tf.TensorSpec([], tf.int64))).batch(16)
  out["errors"]["one_shot"] = one_line(lambda: tfdp.fit(plain, one_shot, model_dir="runs/bad"))
  out["bad_dir_untouched"] = not os.path.exists("runs/bad")
  # Fewer examples than one batch: one step, as Keras takes it (tfdp refused it once).
  out["fewer_than_a_batch"] = tfdp.fit(plain, x[:10], y[:10], batch_size=16, epochs=1,
                                       model_dir="runs/small", verbose=0).final["step"]
  # A subclassed model without get_config: the run finishes, the weights are exported.

  class NoConfig(keras.Model):
    def __init__(self, scale):  # an array argument: Keras cannot record it in a config
      super().__init__()
      self.scale = scale
      self.dense = keras.layers.Dense(3)

    def call(self, inputs):
      return self.dense(inputs * self.scale)

  with strategy.scope():
    sub = NoConfig(np.ones(6, np.float32))  # not built: tfdp.fit builds it on a batch, as Keras
    compile_small(sub)
  h = tfdp.fit(sub, x, y, batch_size=16, epochs=1, model_dir="runs/subclassed", verbose=0)
  outside = NoConfig(np.ones(6, np.float32))  # built outside the scope: Keras cannot clone it
  outside(x[:2])
  compile_small(outside)
  out["errors"]["subclassed_outside"] = one_line(lambda: tfdp.fit(outside, x, y, batch_size=16))
  with strategy.scope():  # probabilities, trained as logits: a warning, once
    softmax = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, activation="softmax")])
    compile_small(softmax)
  tfdp.fit(softmax, x, y, batch_size=16, epochs=1, model_dir="runs/softmax", verbose=0)
  out["subclassed_export"] = [h.final.get("exported"), os.path.exists(
      "runs/subclassed/model.weights.h5")]
  return out


def user_loss(y_true, y_pred):  # a user's own loss function, not registered with Keras
  return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True) * 0.5


def parity_case():
  """tfdp.fit against model.fit on one device (shuffle off, even batches): a user's own loss
  function, in the scope and cloned into it; callbacks that change the learning rate and
  restore the best weights, on a clone; validation_steps counted in the validation data's own
  batches. Then bad input, one line each."""
  x = RNG.normal(size=(96, 6)).astype("float32")
  y = (np.abs(x[:, 0] * 2).astype("int64") % 3)
  keras.utils.set_random_seed(3)
  initial = small_classifier().get_weights()
  val = tf.data.Dataset.from_tensor_slices((x[:40], y[:40])).batch(8)

  def callbacks():
    return [keras.callbacks.ReduceLROnPlateau(monitor="loss", min_delta=10.0, patience=0,
                                              factor=0.5),
            # val_loss falls every epoch: "best" (max) stays epoch 1's, restored at the stop
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, mode="max",
                                          restore_best_weights=True)]

  def compiled(in_scope):
    with strategy.scope() if in_scope else contextlib.nullcontext():
      model = small_classifier()
      model.set_weights(initial)
      model.compile(keras.optimizers.SGD(0.3), user_loss, metrics=["accuracy"])
    return model

  arguments = dict(batch_size=16, epochs=4, shuffle=False, validation_data=val,
                   validation_steps=2, verbose=0)
  out = {}
  reference = compiled(in_scope=False)
  keras_history = reference.fit(x, y, callbacks=callbacks(), **arguments)
  out["keras"] = {"history": keras_history.history, "weights": reference.get_weights()}
  fitted = {}
  for name, in_scope in (("in_scope", True), ("cloned", False)):
    model = fitted[name] = compiled(in_scope)
    history = tfdp.fit(model, x, y, callbacks=callbacks(), model_dir=f"runs/parity_{name}",
                       **arguments)
    out[name] = {"history": history.history, "weights": model.get_weights(),
                 "steps": history.params["steps"]}
  # The same model_dir again goes on from the weights EarlyStopping restored, as model.fit
  # goes on from the model: the finished run (3 epochs) returns them, a 4th epoch trains on.
  again = {}
  for name, model in fitted.items():
    handed_back = model.get_weights()
    arguments_again = {**arguments, "epochs": 3}
    tfdp.fit(model, x, y, model_dir=f"runs/parity_{name}", **arguments_again)
    finished = max(float(np.abs(a - b).max()) for a, b in zip(handed_back, model.get_weights()))
    history = tfdp.fit(model, x, y, model_dir=f"runs/parity_{name}", **arguments)  # epochs=4
    again[name] = {"finished": finished, "loss": history.history["loss"],
                   "weights": model.get_weights()}
  # Without callbacks that change it, the model is not saved again at the run's end.
  from tfdp.core import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  saves, save = [], trainer_lib.Trainer.save
  trainer_lib.Trainer.save = lambda self: (saves.append(self.global_step), save(self))[-1]
  try:
    tfdp.fit(compiled(True), x, y, **{**arguments, "epochs": 2}, model_dir="runs/saves")
  finally:
    trainer_lib.Trainer.save = save
  again["saves_without_change"] = saves
  keras_history = reference.fit(x, y, **{**arguments, "epochs": 1})  # on from its fit above
  again["keras"] = {"loss": keras_history.history["loss"], "weights": reference.get_weights()}
  out["again"] = again
  # A layer frozen in on_train_begin stays frozen, as in model.fit; a History among the
  # callbacks is the one fit returns.
  class Freeze(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
      self.model.layers[0].trainable = False

  frozen = {}
  for name in ("keras", "in_scope", "cloned"):
    model = compiled(name == "in_scope")
    given = keras.callbacks.History()
    fit = model.fit if name == "keras" else functools.partial(
        tfdp.fit, model, model_dir=f"runs/frozen_{name}")
    returned = fit(x, y, callbacks=[Freeze(), given], **{**arguments, "epochs": 2})
    frozen[name] = {"loss": returned.history["loss"], "weights": model.get_weights(),
                    "returned_given": returned is given}
  out["frozen"] = frozen
  # steps_per_epoch: epochs of 2 steps within one pass of arrays (6 batches), and epochs of 4
  # steps going on across the passes of a dataset that repeats for ever.
  stream = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
  for name, data, steps in (("steps_arrays", (x, y), 2), ("steps_stream", (stream,), 4)):
    extra = {"batch_size": 16, "shuffle": False} if len(data) == 2 else {}
    reference = compiled(in_scope=False)
    keras_history = reference.fit(*data, epochs=3, steps_per_epoch=steps, verbose=0, **extra)
    model = compiled(in_scope=True)
    history = tfdp.fit(model, *data, epochs=3, steps_per_epoch=steps, verbose=0,
                       model_dir=f"runs/{name}", **extra)
    out[name] = {"keras": keras_history.history["loss"], "tfdp": history.history["loss"],
                 "keras_weights": reference.get_weights(), "weights": model.get_weights(),
                 "step": history.final["step"]}
  # The stream's run again, stopped after epoch 1 and resumed for all 3: its record is the
  # epoch's, not the run-long pass's (more epochs were refused as "other training data").
  model = compiled(in_scope=True)
  tfdp.fit(model, stream, epochs=1, steps_per_epoch=4, verbose=0, model_dir="runs/stream_parts")
  resumed = tfdp.fit(model, stream, epochs=3, steps_per_epoch=4, verbose=0,
                     model_dir="runs/stream_parts")
  out["steps_stream_resumed"] = {"weights": model.get_weights(), "step": resumed.final["step"]}
  plain_weights = compiled(in_scope=True)
  tfdp.fit(plain_weights, x, y, batch_size=16, epochs=1, sample_weight=list(np.ones(96)),
           model_dir="runs/list_weights", verbose=0)  # a list of numbers: one per example
  plain = compiled(in_scope=True)
  with strategy.scope():
    features = keras.Input((6,))
    two_outputs = keras.Model(features, [plain(features), plain(features)])
    two_outputs.compile("sgd", ["mse", "mse"])

  class Batches(keras.utils.PyDataset):
    def __len__(self):
      return 3

    def __getitem__(self, index):
      return x[index * 16:(index + 1) * 16], y[index * 16:(index + 1) * 16]

  out["errors"] = {
      "no_y": one_line(lambda: tfdp.fit(plain, x, model_dir="runs/bad")),
      "dataset_without_y": one_line(lambda: tfdp.fit(
          plain, tf.data.Dataset.from_tensor_slices(x).batch(8), model_dir="runs/bad")),
      "generator": one_line(lambda: tfdp.fit(plain, ((x[:8], y[:8]) for _ in range(3)),
                                             model_dir="runs/bad")),
      "py_dataset": one_line(lambda: tfdp.fit(plain, Batches(), model_dir="runs/bad")),
      "per_output_weights": one_line(lambda: tfdp.fit(
          two_outputs, x, [y, y], sample_weight={"a": np.ones(96), "b": np.ones(96)},
          model_dir="runs/bad")),
      "input_width": one_line(lambda: tfdp.fit(plain, x[:, :5], y, model_dir="runs/bad")),
      "string_labels": one_line(lambda: tfdp.fit(plain, x, y.astype(str), model_dir="runs/bad")),
      "empty": one_line(lambda: tfdp.fit(plain, x[:0], y[:0], model_dir="runs/bad")),
      "string_x": one_line(lambda: tfdp.fit(plain, "x.npy", y, model_dir="runs/bad")),
      "no_epochs_lengths": one_line(lambda: tfdp.fit(plain, x, y[:50], epochs=0,
                                                     model_dir="runs/bad")),
      "label_out_of_range": one_line(lambda: tfdp.fit(plain, x, y + 5, model_dir="runs/range",
                                                      verbose=0)),
  }
  out["bad_dir_untouched"] = not os.path.exists("runs/bad")
  return out


def equivalence_case():
  """Shuffling off: the final weights, for 1 replica = 2 replicas = 2 workers; an EarlyStopping
  that stops every worker after the same epoch; tfdp.evaluate counting every example once."""
  x = RNG.normal(size=(100, 6)).astype("float32")
  y = (np.abs(x[:, 0] * 2).astype("int64") % 3)
  keras.utils.set_random_seed(1)
  with strategy.scope():
    model = small_classifier()
    compile_small(model)
  stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1)
  slower = keras.callbacks.ReduceLROnPlateau(monitor="loss", min_delta=10.0, patience=0,
                                             factor=0.5)
  history = tfdp.fit(model, x, y, batch_size=20, epochs=5, shuffle=False,
                     callbacks=[stop, slower],
                     validation_data=(x[:37], y[:37]), model_dir="runs/equivalence", verbose=0)
  evaluated = tfdp.evaluate(model, x[:37], y[:37], batch_size=10)
  weights = [w.tolist() for w in model.get_weights()]
  # A second fit in this process: its start-up exchange's keys are new (a probe: 'key
  # tfdp/plan/0 already exists' on 2 workers); and shuffled arrays under seed 0 (a probe:
  # 'a tensor as a Python bool', tensorflow/tensorflow#17284).
  keras.utils.set_random_seed(0)
  again = tfdp.fit(model, x, y, batch_size=20, epochs=2, model_dir="runs/again", verbose=0)
  # Built outside the scope with each worker's own seed: each trained its own model, silently.
  keras.utils.set_random_seed(10 + RANK)
  apart = small_classifier()
  compile_small(apart)
  keras.utils.set_random_seed(1)
  refused = one_line(lambda: tfdp.fit(apart, x, y, batch_size=20, epochs=1, shuffle=False,
                                      model_dir="runs/apart", verbose=0))
  # Other data on each worker: the evaluation's all-reduce hung with no word (a probe).
  uneven = one_line(lambda: tfdp.evaluate(model, x[:37 + RANK], y[:37 + RANK], batch_size=10))
  # Arrays of one shape but other contents: each worker trained its share of its own (a probe).
  mixed_fit = one_line(lambda: tfdp.fit(model, x + RANK, y, batch_size=20, epochs=1,
                                        shuffle=False, model_dir="runs/mixed", verbose=0))
  mixed_evaluate = one_line(lambda: tfdp.evaluate(model, x[:37] + RANK, y[:37], batch_size=10))
  return {"weights": weights, "again_epochs": len(again.history["loss"]), "apart": refused,
          "uneven": uneven, "mixed_fit": mixed_fit, "mixed_evaluate": mixed_evaluate,
          "epochs": len(history.history["loss"]), "stopped_epoch": stop.stopped_epoch,
          "evaluate_examples": evaluated["examples"], "evaluate_loss": evaluated["loss"],
          "learning_rate": float(np.asarray(model.optimizer.learning_rate)),
          "val_loss": history.history["val_loss"][-1]}


result = {"metrics": metrics_case, "forms": forms_case, "equivalence": equivalence_case,
          "parity": parity_case}[CASE]()
with open(f"{OUT}.{RANK}", "w") as f:
  json.dump(result, f, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))
os._exit(0)  # pylint: disable=protected-access  (skip TF's slow teardown)
