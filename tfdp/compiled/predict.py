"""`tfdp.evaluate` and `tfdp.predict`: a compiled model's evaluation and predictions, exact and
distributed on any replica or worker count (Keras's own are broken under
MultiWorkerMirroredStrategy): every example is counted once, padding never, and predictions come
back one row per real example, in the input's order, on every worker."""
from __future__ import annotations

import numpy as np
from absl import logging

from tfdp.compiled import inputs as inputs_lib


def _speaking_as(caller: str):
  """The input and model checks tfdp.fit shares speak as `caller` (tfdp.evaluate, tfdp.predict)."""
  import functools  # pylint: disable=g-import-not-at-top

  def wrap(function):
    @functools.wraps(function)
    def called(*args, **kwargs):
      from tfdp import errors  # pylint: disable=g-import-not-at-top
      from tfdp.compiled import fit as fit_lib  # pylint: disable=g-import-not-at-top
      with errors.speaking_as(fit_lib.terms(caller=caller)):
        return function(*args, **kwargs)
    return called
  return wrap


def _keras_arguments(verbose, steps, callbacks, x):
  """Keras's evaluate/predict arguments: `verbose` is taken (tfdp prints no progress bar: its
  loop is one compiled call); `steps` takes a dataset's first batches, as Keras's (a dataset that
  repeats for ever needs it); `callbacks` are refused. Returns x, cut to `steps`."""
  from tfdp import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfdp import errors  # pylint: disable=g-import-not-at-top
  from tfdp.errors import ConfigError  # pylint: disable=g-import-not-at-top
  caller = errors.terms().caller
  import numbers  # pylint: disable=g-import-not-at-top
  if not (verbose == "auto" if isinstance(verbose, str) else isinstance(
      verbose, numbers.Integral) and not isinstance(verbose, bool) and 0 <= verbose <= 2):
    shown = (config_lib.short_repr(verbose) if isinstance(verbose, (str, int, float))
             else f"of type {type(verbose).__name__}")
    raise ConfigError(f"{caller}: verbose is {shown}; pass 'auto', 0, 1 or 2 (Keras's order: "
                      "x, y, batch_size, verbose, sample_weight; or name them).")
  if callbacks:
    raise ConfigError(f"{caller}: callbacks are not called by {caller}; drop them (tfdp.fit "
                      "calls a callback's epoch hooks).")
  if steps is None:
    return x
  if not inputs_lib.is_dataset(x):
    raise ConfigError(f"{caller}: steps is taken with a dataset (its first steps batches); for "
                      "arrays, pass the rows you want (x[:n]).")
  from tfdp import in_process  # pylint: disable=g-import-not-at-top
  return x.take(in_process.whole_number("steps", steps, caller=caller))


def _check_workers_hold_alike(cluster, model, source, plan, config) -> None:
  """Every worker passes the same data and model: other sizes hung the evaluation's all-reduce
  with no word, or gathered rows of another count (a probe), and other weights mixed two
  models' predictions."""
  from tfdp import errors  # pylint: disable=g-import-not-at-top
  from tfdp.core import resume  # pylint: disable=g-import-not-at-top
  from tfdp.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  mine = {"examples": source.num_examples, "steps": plan.steps_per_epoch,
          "content": source.info.get("content"), "weights": resume.weights_digest(model)}
  differs = cluster_lib.compare_workers(cluster, mine, config.runtime.heartbeat_timeout_seconds,
                                        topic="inputs")
  if differs is None:
    return
  held, rank, key = differs
  theirs, first = held[rank][key], held[0][key]
  what = ("a model of other weights than worker 0's" if key == "weights" else
          "arrays of other contents than worker 0's" if key == "content" else
          f"{theirs} {'examples' if key == 'examples' else 'batches'} where worker 0 holds {first}")
  raise ConfigError(f"{errors.terms().caller}: worker {rank} holds {what}; every worker must "
                    "pass the same data and the same model (built after one "
                    "keras.utils.set_random_seed, or under the strategy's scope).")


def _setup(model, x, y, sample_weight, batch_size, strategy, needs_labels: bool):
  """`needs_labels`: tfdp.evaluate's; tfdp.predict reads inputs alone."""
  from tfdp import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfdp import errors  # pylint: disable=g-import-not-at-top
  from tfdp.compiled import fit as fit_lib  # pylint: disable=g-import-not-at-top
  from tfdp.compiled import task as task_lib  # pylint: disable=g-import-not-at-top
  from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  if needs_labels and getattr(model, "weights", None):  # before any copy is made
    task_lib.check_compiled(model)
  strategy, model, users_model = fit_lib.strategy_for(model, strategy)
  if users_model is not None:  # read only: the user's model stays as it was
    logging.warning("%s: the model was built outside the strategy's scope: running a copy made "
                    "inside it, with its weights", errors.terms().caller)
  ranks = inputs_lib.input_ranks(model)
  batch_size = inputs_lib.check_batch_size("batch_size", batch_size)
  if needs_labels:
    source = inputs_lib.make_inputs(x, y, sample_weight=sample_weight,  # (a dataset: its own)
                                    batch_size=None if inputs_lib.is_dataset(x) else 1,
                                    model_input_ranks=ranks, steps_name="steps",
                                    labels=task_lib.needs_labels(model)).train
  else:  # inputs alone (a dataset's labels are kept, unused)
    source = inputs_lib.predict_source(x, ranks)
  if users_model is not None:
    fit_lib.check_clone_computes_alike(users_model, model,
                                       inputs_lib.first_examples(source)["x"], errors.terms().caller)
  if getattr(model, "run_eagerly", False):  # traced all the same: a call() that cannot be, said
    fit_lib.check_traces(model, inputs_lib.first_examples(source)["x"])
  batch = batch_size or inputs_lib.DEFAULT_BATCH_SIZE
  replicas = strategy.num_replicas_in_sync
  batch = -(-batch // replicas) * replicas  # whole per-replica batches; padding is weight 0
  data = config_lib.DataConfig(source="keras", shuffle=False, cache=False)
  config = config_lib.ExperimentConfig()
  config.task.name = "keras_model"
  task = task_lib.CompiledModelTask(config.task)
  cluster = cluster_lib.resolve_cluster()
  plan = data_lib.plan_input(source, data, batch, replicas, max(cluster.num_workers, 1))
  if cluster.is_multi_worker:
    _check_workers_hold_alike(cluster, model, source, plan, config)
  dataset = strategy.distribute_datasets_from_function(
      data_lib.make_dataset_fn(plan, data, task, training=False, seed=0))
  return strategy, model, source, task, plan, dataset


@_speaking_as("tfdp.evaluate")
def evaluate(model, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=True, *, strategy=None):
  """Keras's `model.evaluate`, exact across replicas and workers. Returns the metrics and
  `examples` (the count) as a dict, unlike Keras's default; return_dict=False returns what Keras
  returns then: the loss alone, or the list in model.metrics_names order."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.core import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  x = _keras_arguments(verbose, steps, callbacks, x)
  strategy, model, source, task, plan, dataset = _setup(model, x, y, sample_weight, batch_size,
                                                        strategy, needs_labels=True)
  task.attach(model, inputs_lib.KerasData(source, None, plan.global_batch, False),
              steps=("test_step", "compute_loss", "compute_metrics"))
  size = 1 + 2 * len(task.metric_names) + task.metric_state_size

  def replica_sums(batch):
    outputs = model(batch["x"], training=False)
    return trainer_lib.metric_vector(task, batch, outputs, task.per_example_loss(batch, outputs))

  loop = trainer_lib.summed_over_steps(strategy, replica_sums, size)  # tfdp's own eval loop
  with trainer_lib.tensor_conditions_named():
    totals = loop(iter(dataset), tf.constant(plan.steps_per_epoch)).numpy()
  sums = trainer_lib.MetricSums(task.metric_names, totals, task.finalize_metric,
                                task.metric_state_values)
  if not return_dict:
    return compat.metrics_in_keras_order(model, sums.values())
  return {**sums.values(), "examples": int(sums.examples)}


@_speaking_as("tfdp.predict")
def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None, *,
            strategy=None):
  """Keras's `model.predict`: the outputs for every real example, in order (numpy, nested as
  the model's outputs), on every worker."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.compiled import task as task_lib  # pylint: disable=g-import-not-at-top
  from tfdp.core import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  x = _keras_arguments(verbose, steps, callbacks, x)
  strategy, model, source, task, plan, dataset = _setup(model, x, None, None, batch_size, strategy,
                                                        needs_labels=False)
  del task
  task_lib.check_not_overridden(model, ("predict_step",))
  task_lib.outputs_of(model, inputs_lib.first_examples(source, 2)["x"])

  def replica_outputs(batch):
    return model(batch["x"], training=False), batch["weight"], batch["index"]

  @tf.function(autograph=False)
  def step(iterator):
    per_replica = strategy.run(replica_outputs, args=(next(iterator),))
    return tf.nest.map_structure(lambda v: strategy.gather(v, axis=0), per_replica)

  iterator = iter(dataset)
  with trainer_lib.tensor_conditions_named():
    parts = [step(iterator) for _ in range(plan.steps_per_epoch)]
  outputs = tf.nest.map_structure(lambda *t: np.concatenate([np.asarray(a) for a in t]),
                                  *[p[0] for p in parts])
  weight = np.concatenate([np.asarray(p[1]) for p in parts])
  index = np.concatenate([np.asarray(p[2]) for p in parts])
  real = np.flatnonzero(weight > 0)
  order = real[np.argsort(index[real], kind="stable")]
  if len(order) != source.num_examples:
    raise RuntimeError(f"tfdp.predict: gathered {len(order)} rows for {source.num_examples} "
                       "examples")
  return tf.nest.map_structure(lambda a: a[order], outputs)
