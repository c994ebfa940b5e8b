"""tfdp-bench --mode=tta, child side: one run trained to the end, as a curve of eval accuracy
against wall seconds. Each run is a fresh process (`python -m tfdp.bench CELL_JSON`, kind "tta").

Every run consumes the experiment tfdp builds for its config (`experiment.build`): the task, its
model builder and seed, the input plans and the learning-rate schedule. Only the loop differs:

  tfdp            `Experiment.run()`: tfdp's own strategy.run loop on the config's replicas
  keras_recipe    `model.fit` on one device with tfdp's recipe: the trainer's optimizer (its
                  schedule, weight-decay exclusions and gradient clip), the task's loss (label
                  smoothing included), tfdp's training and eval batches (augmentation,
                  normalization, global batch) and precision; Keras' defaults otherwise (one
                  step per call). Not what tfdp adds to evaluation: no weight average
                  (trainer.ema_decay), mirror/translate test-time augmentation or PreciseBN;
                  nor lookahead or the BatchNorm-bias lr multiplier
  keras_tutorial  `model.fit` as the Keras tutorials do: Adam(1e-3), batch 32, no augmentation,
                  SparseCategoricalCrossentropy(from_logits=True), float32 (the same model
                  builder and tfdp's normalization, so only the recipe differs)

Time zero, the same for all three: `time.time()` just before the training call starts
(`Experiment.run()` or `model.fit()`), after the model, optimizer and input pipelines are built.
An epoch's time is `time.time()` at the end of its evaluation: all three evaluate on the test
split after every epoch, so evaluation time is inside every curve; so is tfdp's per-epoch
bookkeeping, which the Keras runs do not do (metrics.csv, metrics.png and a checkpoint, written
after the epoch's time is taken: they count in the next epoch's).
"""
from __future__ import annotations

import time

from tfdp import config as config_lib
from tfdp.distributed.cluster import Cluster
from tfdp.errors import ConfigError

RUNS = ("tfdp", "keras_recipe", "keras_tutorial")
TUTORIAL_BATCH = 32  # model.fit's default batch_size
TUTORIAL_LEARNING_RATE = 1e-3  # keras.optimizers.Adam's default


def run_overrides(run: str) -> list[str]:
  """What each run changes in the config (after the user's overrides)."""
  every_epoch = ["trainer.eval_every_epochs=1", "trainer.export_model=false"]
  if run == "tfdp":
    return every_epoch
  one_device = ["runtime.strategy=default", "runtime.cpu_replicas=0", "runtime.devices=[]",
                "trainer.gradient_accumulation_steps=1",  # model.fit takes the whole batch
                # what tfdp adds to evaluation, which model.fit does not have:
                "trainer.ema_decay=0", "task.eval_flip=false", "task.eval_translate=0",
                "trainer.precise_bn_batches=0",
                # and to the update, which a Keras optimizer in model.fit does not do:
                "trainer.lookahead_every_steps=0", "trainer.optimizer.norm_bias_lr_multiplier=1"]
  if run == "keras_recipe":
    return every_epoch + one_device
  if run == "keras_tutorial":
    return every_epoch + one_device + [
        "task.train_data.augment=false", f"trainer.global_batch_size={TUTORIAL_BATCH}",
        f"trainer.eval_batch_size={TUTORIAL_BATCH}", "runtime.mixed_precision=float32",
        "runtime.jit_compile=false"]
  raise ConfigError(f"--runs has '{run}'; use some of {', '.join(RUNS)}.")


def keras_batches(dataset, task):
  """tfdp's dict batches as model.fit takes them: (inputs, labels, sample weights); the weight-0
  examples that pad an epoch's last batch then count nowhere."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return dataset.map(tf.autograph.experimental.do_not_convert(
      lambda b: (task.model_inputs(b), b["label"], b["weight"])))


def run_cell(spec: dict, cluster: Cluster) -> dict:
  """Trains one run of the spec ({"run", "config_files", "overrides", "model_dir"}) on the
  resolved cluster."""
  from tfdp.core import experiment  # pylint: disable=g-import-not-at-top  (starts TensorFlow)
  config = config_lib.load_config(spec["config_files"], spec["overrides"])
  exp = experiment.build(config, spec["model_dir"], "train_and_eval", cluster=cluster,
                         verbose=False)
  if "accuracy" not in exp.task.metric_names:
    raise ConfigError(f"task '{config.task.name}' reports no accuracy "
                      f"({', '.join(exp.task.metric_names)}), and --mode=tta times accuracy "
                      "targets; choose a task that has one.")
  curve = _train_tfdp(exp) if spec["run"] == "tfdp" else _fit_keras(exp, spec["run"])
  return {"run": spec["run"], "model": config.task.model.name,
          "strategy": "keras_fit" if spec["run"] != "tfdp" else exp.strategy_plan.kind,
          "replicas": exp.replicas, "global_batch": exp.train_plan.global_batch,
          "steps_per_epoch": exp.train_plan.steps_per_epoch, "curve": curve}


def _train_tfdp(exp) -> list[dict]:
  from tfdp import plots  # pylint: disable=g-import-not-at-top
  start = time.time()
  exp.run()
  metrics = plots.read_metrics(exp.model_dir)  # wall_time: time.time() after the epoch's eval
  return [{"epoch": int(row["epoch"]), "seconds": row["wall_time"] - start,
           "eval_accuracy": row["eval_accuracy"], "train_accuracy": row.get("train_accuracy")}
          for _, row in metrics.iterrows()]


def _fit_keras(exp, run: str) -> list[dict]:
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
  config, task, model = exp.config, exp.task, exp.trainer.model
  train = keras_batches(exp.train_dataset_fn()(tf.distribute.InputContext()), task)
  evaluation = keras_batches(data_lib.make_dataset_fn(
      exp.eval_plan, config.task.eval_data, task, training=False,
      seed=config.trainer.seed)(tf.distribute.InputContext()), task)
  accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
  if run == "keras_recipe":
    optimizer = exp.trainer.optimizer
    if config.trainer.gradient_clip_norm:  # tfdp clips the reduced gradient; one device: the same
      (getattr(optimizer, "inner_optimizer", None) or optimizer).global_clipnorm = (
          config.trainer.gradient_clip_norm)

    def task_loss(labels, logits):  # Keras casts labels to the loss dtype
      return task.per_example_loss({"label": tf.cast(labels, tf.int64)}, logits)
    model.compile(optimizer=optimizer, loss=task_loss, weighted_metrics=[accuracy],
                  jit_compile=config.runtime.jit_compile)
  else:
    model.compile(optimizer=keras.optimizers.Adam(TUTORIAL_LEARNING_RATE),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[accuracy])
  curve: list[dict] = []

  class EvalClock(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):  # after the epoch's validation
      curve.append({"epoch": epoch + 1, "seconds": time.time() - start,
                    "eval_accuracy": float(logs["val_accuracy"]),
                    "train_accuracy": float(logs["accuracy"])})

  start = time.time()
  model.fit(train, epochs=config.trainer.epochs, steps_per_epoch=exp.train_plan.steps_per_epoch,
            validation_data=evaluation, validation_steps=exp.eval_plan.steps_per_epoch,
            callbacks=[EvalClock()], verbose=0)
  return curve
