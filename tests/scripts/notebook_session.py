"""A notebook session as one process (tests/test_api.py judges what it prints): cells run in
the README's order, a config run in between, re-run cells, a Ctrl-C, and a few mistakes. Prints
JSON."""
import gc
import json
import glob
import os
import random
import signal

import numpy as np
import yaml

import tfdp
from errors_said import one_line

TINY = {"task": {"train_data": {"source": "synthetic", "num_examples": 32, "image_size": 8,
                                "num_classes": 2},
                 "eval_data": {"source": "synthetic", "num_examples": 16, "image_size": 8,
                               "num_classes": 2},
                 "model": {"name": "small_cnn"}},
        "trainer": {"global_batch_size": 16, "epochs": 1, "export_model": False},
        # not the float32 the session's Keras computes in: the run must leave that as it was
        "runtime": {"cpu_replicas": 2, "mixed_precision": "mixed_bfloat16"}}


def attempt(fn):
  """fn()'s value, or what it raised as 'Type: message' (the test judges either)."""
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"


def random_draws() -> list:
  """The next draws of numpy's, Python's, Keras's and TensorFlow's global random streams (the
  user's) and of an unseeded initializer."""
  return [float(np.random.rand()), random.random(), float(keras.random.uniform(())),
          float(tf.random.uniform(())), float(keras.initializers.GlorotUniform()((1,))[0])]


def seeded_draws() -> list:
  """random_draws() right after seeding every stream with 5 (the session then re-seeds)."""
  keras.utils.set_random_seed(5)
  draws = random_draws()
  keras.utils.set_random_seed(5)
  return draws


out = {}
strategy = tfdp.make_strategy(cpu_replicas=2)
out["same_strategy"] = tfdp.make_strategy() is strategy and tfdp.make_strategy(
    cpu_replicas=2) is strategy  # the cell run again; the README's `make_strategy().scope()`
out["misspelt_setting"] = one_line(lambda: tfdp.make_strategy(cpu_repl=3))
import keras  # noqa: E402  (after the strategy, as the README says)
import tensorflow as tf  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 6)).astype("float32")
y = (np.abs(x[:, 0] * 2).astype("int64") % 3)
with tfdp.make_strategy().scope():
  model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
  model.compile(keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
# A config run in between makes a strategy of its own; the model stays in the one it was built in.
with open("tiny.yaml", "w") as f:
  json.dump(TINY, f)  # JSON is YAML
keras.config.set_dtype_policy("float32")
expected = seeded_draws()
tfdp.train("tiny.yaml", model_dir="runs/config_run", verbose=False)  # a path, not a list
out["policy_after_train"] = keras.config.dtype_policy().name  # mixed_bfloat16 before
out["users_strategy_after_train"] = tfdp.make_strategy() is strategy  # train's 1 replica before
out["train_bad_mode"] = one_line(lambda: tfdp.train("tiny.yaml", model_dir="runs/m", mode="bogus"))
out["train_eval_untrained"] = one_line(lambda: tfdp.train("tiny.yaml", model_dir="runs/none",
                                                          mode="eval"))
out["train_not_a_path"] = one_line(lambda: tfdp.train([123], model_dir="runs/n"))
out["random_by_train"] = [random_draws(), expected]
expected = seeded_draws()
history = tfdp.fit(model, x, y, batch_size=16, epochs=1, model_dir="runs/fit", verbose=0)
out["random_by_fit"] = [random_draws(), expected]
out["fit_replicas"] = history.final["replicas"]
with open("runs/fit/config.yaml") as f:  # what ran: the strategy given, not the config's auto
  out["fit_recorded_runtime"] = {k: v for k, v in yaml.safe_load(f)["runtime"].items()
                                 if k in ("strategy", "cpu_replicas", "devices")}
out["evaluate_without_y"] = one_line(lambda: tfdp.evaluate(model, x))
predicted = tfdp.predict(model, tf.data.Dataset.from_tensor_slices(x).batch(5))
out["predict_inputs_dataset"] = float(np.max(np.abs(predicted - model.predict(x, verbose=0))))
out["predict_bad_batch"] = one_line(lambda: tfdp.predict(model, x, batch_size=2.5))
out["predict_nothing"] = one_line(lambda: tfdp.predict(model, x[:0]))
out["predict_wrong_shape"] = one_line(lambda: tfdp.predict(model, x[:, :5]))
with tfdp.make_strategy().scope():
  uncompiled = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
out["evaluate_uncompiled"] = one_line(lambda: tfdp.evaluate(uncompiled, x, y))
# Keras's evaluate and predict arguments, and what Keras returns without return_dict.
with tfdp.make_strategy().scope():
  loss_only = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
  loss_only.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
out["evaluate_returns"] = {
    "list": [attempt(lambda: tfdp.evaluate(model, x, y, return_dict=False, verbose=0)),
             model.evaluate(x, y, verbose=0)],
    "loss": [attempt(lambda: tfdp.evaluate(loss_only, x, y, 16, 0, return_dict=False)),
             loss_only.evaluate(x, y, 16, 0)],
    "dict": attempt(lambda: sorted(tfdp.evaluate(model, x, y, return_dict=True, verbose=0)))}
out["predict_verbose"] = attempt(lambda: float(np.max(np.abs(
    tfdp.predict(model, x, verbose=0) - model.predict(x, verbose=0)))))
out["evaluate_refused"] = [attempt(lambda: one_line(lambda: tfdp.evaluate(model, x, y, 16, y))),
                           attempt(lambda: one_line(lambda: tfdp.evaluate(model, x, y, steps=2))),
                           attempt(lambda: one_line(
                               lambda: tfdp.predict(model, x, callbacks=[object()])))]
# steps: a dataset's first batches, as Keras's (a dataset that repeats for ever needs it).
forever = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
out["steps"] = {
    "predict": attempt(lambda: float(np.max(np.abs(
        tfdp.predict(model, forever.map(lambda a, b: a), steps=3)
        - model.predict(forever.map(lambda a, b: a), steps=3, verbose=0))))),
    "predicted_rows": attempt(lambda: len(tfdp.predict(model, forever.map(lambda a, b: a),
                                                       steps=3))),
    "evaluate": [attempt(lambda: tfdp.evaluate(model, forever, steps=3, return_dict=False)),
                 model.evaluate(forever, steps=3, verbose=0)],
    "no_steps": attempt(lambda: one_line(lambda: tfdp.evaluate(model, forever)))}
# Built outside the scope (after make_strategy): evaluated and predicted on a copy made in it.
outside = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
out["predict_uncompiled_outside"] = attempt(lambda: float(np.max(np.abs(
    tfdp.predict(outside, x) - outside.predict(x, verbose=0)))))
out["evaluate_uncompiled_outside"] = attempt(lambda: one_line(
    lambda: tfdp.evaluate(outside, x, y)))
outside.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
out["evaluate_outside"] = attempt(lambda: [tfdp.evaluate(outside, x, y)["loss"],
                                           outside.evaluate(x, y, verbose=0)])


# Ctrl-C in the middle of a fit without model_dir: the error says where to resume from, and that
# resumes; the finished run, returned at once, reports counts as ints, as the run that trained.
class CtrlC(keras.callbacks.Callback):
  def on_epoch_end(self, epoch, logs=None):
    if epoch == 0:
      os.kill(os.getpid(), signal.SIGINT)


with tfdp.make_strategy().scope():
  stopped = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)], name="stopped")
  stopped.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
fit_args = dict(batch_size=16, epochs=3, validation_data=(x[:40], y[:40]), verbose=0)
try:
  tfdp.fit(stopped, x, y, callbacks=[CtrlC()], **fit_args)
  out["stopped_said"] = "not stopped"
except Exception as e:  # pylint: disable=broad-except
  out["stopped_said"] = f"{type(e).__name__}: {e}"
said_dir = out["stopped_said"].split("model_dir='")[-1].split("'")[0]
if os.path.isdir(said_dir):
  resumed = tfdp.fit(stopped, x, y, model_dir=said_dir, **fit_args)
  again = tfdp.fit(stopped, x, y, model_dir=said_dir, **fit_args)  # finished: returned at once
  counts = ("epoch", "step", "train_steps", "eval_examples")
  out["resumed_epochs"] = resumed.epoch
  out["count_types"] = [{k: type(h.final[k]).__name__ for k in counts} for h in (resumed, again)]
  # a resume refused, in tfdp.fit's words (its arguments, not tfdp-train's flags)
  out["fit_resume_another_seed"] = one_line(lambda: tfdp.fit(
      stopped, x, y, model_dir=said_dir, params="trainer.seed=7", **fit_args))
out["resume_another_seed"] = one_line(lambda: tfdp.train(
    "tiny.yaml", params="trainer.seed=7", model_dir="runs/config_run", verbose=False))
# a list of overrides, as several --params_override
out["params_list"] = one_line(lambda: tfdp.train(
    "tiny.yaml", params=["trainer.seed=7", "trainer.epochs=1"], model_dir="runs/config_run",
    verbose=False, start_over=True))
out["moved_aside"] = len(glob.glob("runs/config_run/previous-*"))
out["params_malformed"] = one_line(lambda: tfdp.train(
    "tiny.yaml", params="trainer.epochs", model_dir="runs/config_run", verbose=False))
out["params_wrong"] = attempt(lambda: one_line(lambda: tfdp.train(
    "tiny.yaml", params=["trainer.seed=7", 7], model_dir="runs/config_run", verbose=False)))
# Every run's traced training loop is gone with its trainer (none of theirs is kept here)
gc.collect()
out["train_loops_alive"] = sum(type(o).__name__ == "FuncGraph" and o.name.startswith("train_loop")
                               for o in gc.get_objects())
print(json.dumps(out))
