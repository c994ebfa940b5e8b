"""A compiled Keras model as a tfdp task: its compile() is the recipe.

The loss is Keras's own compiled loss, applied per example (each output's Loss object with no
reduction, times its loss weight, times the example's sample weight), so the trainer can divide
by the global batch and count padding as nothing. The metrics are Keras's own metric objects
(strings resolved by Keras, per output, `weighted_metrics` too), updated without touching their
variables: each batch's update is taken statelessly from the metrics' initial state
(`keras.StatelessScope`), the difference is summed over replicas, steps and workers like any
tfdp sum, and the metrics' own `result()` reads the total. Every metric whose state adds up
(Mean, AUC's confusion counts, Precision, ...: Keras's `aggregation="sum"`) is then exactly what
single-device Keras reports on the same weights and data.
"""
from __future__ import annotations

import contextlib
import re

import numpy as np

from tfdp.compiled import inputs as inputs_lib
from tfdp.core import regularization
from tfdp.core import task as tasks
from tfdp.distributed import compat
from tfdp import errors
from tfdp.errors import ConfigError, DataError


TRAINING_STEPS = ("train_step", "test_step", "compute_loss", "compute_metrics")


def keras_error_line(error) -> str:
  """The line of a Keras layer's error that says what is wrong, without its call report and
  terminal escapes."""
  plain = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Keras's bold: terminal escapes
  said = [line.strip() for line in plain.splitlines() if line.strip() and not
          line.startswith(("Exception encountered", "Arguments received", "•"))]
  return (said or [type(error).__name__])[0]


@contextlib.contextmanager
def _said_as_compile_mismatch():
  """Keras's multi-line error when compile()'s losses or metrics do not fit the outputs (as
  model.fit fails on them too), in one line."""
  try:
    yield
  except (ValueError, KeyError) as e:  # KeyError: a loss's output missing from dict labels
    raise ConfigError(
        f"compile()'s losses or metrics do not match the model's outputs (Keras: "
        f"{keras_error_line(e)[:200]}); give them per output, e.g. metrics={{'<output name>': "
        "['mae']}, or as a list in the outputs' order.") from None


def outputs_of(model, x, which: str = "x"):
  """The model's outputs on a small batch of x, or one line saying the model does not take it."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    return model(x, training=False)
  except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
    raise DataError(f"the model does not take {which} as given ({which}: {_spec_of(x)}; "
                    f"Keras: {keras_error_line(e)[:240]}); pass x in the shape "
                    "and structure of the model's inputs.") from None


@tasks.register_task("keras_model")
class CompiledModelTask(tasks.Task):
  """Made by tfdp.fit (`CompiledModelTask(config).attach(model, inputs)`), never from a config
  alone."""

  metric_names = ("loss",)
  float32_outputs = False  # Keras's losses cast themselves, and read the outputs' masks

  def __init__(self, config):
    super().__init__(config)
    self.model = None
    self.inputs = None
    self.sample = None  # attach's batch of up to 8 training examples

  def build_source(self, data):
    raise ConfigError("task 'keras_model' trains the compiled model given to tfdp.fit; a config "
                      "cannot name it: use tfdp.fit(model, x, y, ...) or another task.name.")

  @classmethod
  def check_source(cls, data, key):
    del data, key  # the data is tfdp.fit's, checked there

  # ---- set up once, eagerly, before the trainer traces anything -----------------------------

  def attach(self, model, inputs, steps=TRAINING_STEPS) -> "CompiledModelTask":
    """Resolves the compiled loss and metrics against one real batch (Keras does it on the
    first batch of fit); `steps`: the Keras step methods the caller's loop stands in for. Keeps
    that batch (`sample`: up to 8 examples) for the checks that follow."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import keras  # pylint: disable=g-import-not-at-top
    self.model, self.inputs = model, inputs
    compile_loss, compile_metrics = check_compiled(model)
    check_not_overridden(model, steps)
    self.sample = sample = inputs_lib.first_examples(inputs.train)
    y_pred = outputs_of(model, sample["x"])
    if compile_loss is None:  # the layers' add_loss is the loss (its labels, if any, unused)
      return self._attach_without_loss(model)
    if any(t.dtype == tf.string for t in tf.nest.flatten(sample["y"])):
      raise DataError("y holds strings; pass numeric labels (class ids, e.g. from "
                      "keras.layers.StringLookup, or numbers).")
    y_true = self._align(sample["y"], y_pred)
    _check_labels(model, compile_loss, y_true, y_pred)
    with _said_as_compile_mismatch():
      if not compile_loss.built:
        compile_loss.build(y_true, y_pred)
    self._flat_losses, loss_names = [], []
    for path, loss, weight, name in compile_loss._flat_losses:  # pylint: disable=protected-access
      reduction = _reduction(loss, _at(y_pred, path))
      self._flat_losses.append((tuple(path), _unreduced(loss), 1.0 if weight is None else
                                float(weight), reduction))
      loss_names.append(f"{name}_loss")
    self._check_losses_take(y_true, y_pred, "y")
    if getattr(inputs, "validation", None) is not None:  # not after an epoch has trained
      held = inputs_lib.first_examples(inputs.validation)
      held_pred = outputs_of(model, held["x"], "validation_data's x")
      self._check_losses_take(self._align(held["y"], held_pred), held_pred, "validation_data's y")
    # Keras divides a masked loss by the batch's unmasked steps (a sum by nothing, a
    # mean_with_sample_weight by the weights): over the global batch, which needs its counts.
    self._global_counts = any(r != "mean" or compat.keras_mask(_at(y_pred, p)) is not None
                              for p, _, _, r in self._flat_losses)
    # Several losses: each is reported too, as Keras does (before its loss weight).
    self.metric_names = ("loss", *loss_names) if len(loss_names) > 1 else ("loss",)
    self._y_true_structure = compile_loss._y_true_build_structure  # pylint: disable=protected-access
    self._y_pred_structure = compile_loss._y_pred_build_structure  # pylint: disable=protected-access
    self._metrics = compile_metrics
    self._metric_variables, self._metric_initial = [], []
    if compile_metrics is not None:
      with _said_as_compile_mismatch():
        if not compile_metrics.built:
          compile_metrics.build(y_true, y_pred)
      _check_metrics_add_up(model, compile_metrics, sample["x"], y_true)
      _check_one_value_each(compile_metrics)
      compile_metrics.reset_state()
      for variable in compile_metrics.variables:
        if getattr(variable, "aggregation", "sum") not in ("sum", "none", None):
          raise ConfigError(f"metric variable '{variable.path}' is aggregated by "
                            f"'{variable.aggregation}', not summed, so it cannot "
                            "be combined across replicas; drop that metric or "
                            "compute it after training with tfdp.predict.")
        self._metric_variables.append(variable)
        self._metric_initial.append(np.asarray(tf.identity(variable.value).numpy()))
    self._state_sizes = [int(v.size) for v in self._metric_initial]
    self.metric_state_size = int(sum(self._state_sizes))
    self._metric_names = list(self.metric_state_values(np.zeros(self.metric_state_size)))
    taken = sorted(set(self._metric_names) & {"steps", "examples"})
    if taken:  # the history's row would lose it to the count (train_steps, eval_examples)
      raise ConfigError(f"a compiled metric is named '{taken[0]}', the name of tfdp's own count "
                        f"of {taken[0]} in the history and tfdp.evaluate; give it another name "
                        f"(e.g. name='{taken[0]}_metric').")
    return self

  def _attach_without_loss(self, model) -> "CompiledModelTask":
    if not model.losses:  # read after the eager call on the sample
      raise ConfigError("the model is compiled without a loss and its layers add none "
                        "(add_loss), so nothing would train; compile it with loss=...")
    self._flat_losses, self._global_counts, self.metric_names = [], False, ("loss",)
    self._metrics, self._metric_variables, self._metric_initial = None, [], []
    self._state_sizes, self.metric_state_size, self._metric_names = [], 0, []
    return self

  def _check_losses_take(self, y_true, y_pred, which: str) -> None:
    """Each compiled loss on a few examples, eagerly: labels it cannot take fail here in one
    line, not as Keras's error from inside the traced step (or, for validation_data, after an
    epoch has trained)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    for path, loss, _, _ in self._flat_losses:
      try:
        loss(_at(y_true, path), _at(y_pred, path))
      except (ValueError, TypeError, KeyError, IndexError, tf.errors.InvalidArgumentError) as e:
        raise DataError(
            f"{which} does not fit the loss on the model's outputs ({which}: "
            f"{_spec_of(_at(y_true, path))}; outputs: {_spec_of(_at(y_pred, path))}; Keras: "
            f"{keras_error_line(e)[:200]}); pass labels that loss takes (for a sparse loss, "
            "labels within its classes: ids 0..n-1; one-hot rows for a categorical one; the "
            "outputs' shape for mse).") from None

  def _align(self, y_true, y_pred):
    """Labels in the structure of the outputs (a dict of labels for a list of named outputs)."""
    import keras  # pylint: disable=g-import-not-at-top
    if isinstance(y_true, dict) and isinstance(y_pred, (list, tuple)):
      names = list(getattr(self.model, "output_names", None) or [])
      if set(names) == set(y_true):
        return [y_true[n] for n in names]
    if isinstance(y_pred, (list, tuple)) and not keras.tree.is_nested(y_true) and len(y_pred) == 1:
      return [y_true]
    if isinstance(y_true, (list, tuple)) and len(y_true) == 1 and not keras.tree.is_nested(y_pred):
      return y_true[0]  # [y] for a model whose one output Keras unwrapped (a probe: refused)
    return y_true

  # ---- the Task contract ------------------------------------------------------------------

  def build_model(self, source):
    del source
    return self.model

  def make_optimizer(self, model):
    return model.optimizer

  def preprocess(self, example, data, training, seed):
    del data, training, seed
    return {"x": example["x"], "y": example["y"], "sample_weight": example["sample_weight"],
            "index": example["index"]}  # the example's place in its epoch: tfdp.predict's order

  def model_inputs(self, batch):
    return batch["x"]

  def _losses(self, batch, outputs, rows: str) -> list:
    """Each compiled loss per example, before its loss weight and the sample weight, scaled so
    that its sum over a global batch of `rows` ("all": padding included, what the trainer divides
    by; "real": what a reported mean divides by) is Keras's reduced loss of that batch."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    y_true = self._align(batch["y"], outputs)
    real, weight = batch["weight"], batch["sample_weight"]
    per_output, counts = [], []
    for path, loss, _, reduction in self._flat_losses:
      y_pred = _at(outputs, path)
      values = tf.cast(loss(_at(y_true, path), y_pred), tf.float32)  # masked steps are 0
      axes = list(range(1, values.shape.rank or 1))
      mask = compat.keras_mask(y_pred)
      if mask is None and reduction == "mean":  # per token, per pixel: their mean, as Keras
        per_output.append(tf.reduce_mean(values, axis=axes) if axes else values)
        counts.append(None)
        continue
      per_output.append(tf.reduce_sum(values, axis=axes) if axes else values)
      if reduction == "sum":
        counts.append(1.0)  # divided by nothing
      elif reduction == "mean_with_sample_weight":
        counts.append(tf.reduce_sum(weight * real))
      else:  # a masked mean: the batch's unmasked steps of its real rows
        steps = tf.reshape(tf.cast(mask, tf.float32), [tf.shape(real)[0], -1])
        counts.append(tf.reduce_sum(tf.reduce_sum(steps, axis=1) * real))
    if not self._global_counts:
      return per_output
    totals = _rows_over_replicas(
        real, [c for c in counts if c is not None and not isinstance(c, float)])
    batch_rows = totals[0] if rows == "all" else totals[1]
    divisors = iter(tf.unstack(totals[2:]))
    return [values if count is None else values * (
        batch_rows if isinstance(count, float) else tf.math.divide_no_nan(batch_rows, next(divisors)))
            for values, count in zip(per_output, counts)]

  def activity_scale(self, batch):
    """Keras divides a batch's activity regularization by its own rows: all rows over real rows,
    counted over every replica (1 but for a padded batch)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    totals = _rows_over_replicas(batch["weight"])
    return tf.math.divide_no_nan(totals[0], totals[1])

  def per_example_loss(self, batch, outputs):
    weighted = [v * w for v, (_, _, w, _) in zip(self._losses(batch, outputs, "all"),
                                                   self._flat_losses)]
    if not weighted:  # no compiled loss: the layers' add_loss (model.losses) is all of it
      return 0.0 * batch["sample_weight"]
    return sum(weighted[1:], weighted[0]) * batch["sample_weight"]

  def metric_sums(self, batch, outputs, per_example_loss):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    weight = batch["weight"]  # the padding mask; per_example_loss carries the sample weight
    count = tf.reduce_sum(weight)
    losses = self._losses(batch, outputs, "real") if self._global_counts or len(
        self.metric_names) > 1 else None
    if self._global_counts:  # reported per real row, not per row of the padded batch
      per_example_loss = sum(v * w for v, (_, _, w, _) in zip(losses, self._flat_losses)) * (
          batch["sample_weight"])
    total = tf.reduce_sum(per_example_loss * weight)
    regularizers = regularization.model_losses(self.model)
    if regularizers:  # Keras reports the regularization in its loss, once per batch
      total += tf.cast(tf.add_n(regularizers), tf.float32) * count
      total += regularization.reported_once(count, tf.shape(weight)[0])
    sums = {"loss": (total, count)}
    if len(self.metric_names) > 1:
      for name, values in zip(self.metric_names[1:], losses):
        sums[name] = (tf.reduce_sum(values * batch["sample_weight"] * weight), count)
    return sums

  def metric_state(self, batch, outputs):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import keras  # pylint: disable=g-import-not-at-top
    metrics = self._metrics
    initial = [tf.constant(v) for v in self._metric_initial]
    pad = batch["weight"]
    weighted = pad * batch["sample_weight"]
    with keras.StatelessScope(state_mapping=list(zip(self._metric_variables, initial))) as scope:
      y_true = metrics._flatten_y(self._align(batch["y"], outputs))  # pylint: disable=protected-access
      y_pred = metrics._flatten_y(outputs)  # pylint: disable=protected-access
      for lists, sample_weight in ((metrics._flat_metrics, pad),  # pylint: disable=protected-access
                                   (metrics._flat_weighted_metrics, weighted)):  # pylint: disable=protected-access
        for metric_list, y_t, y_p in zip(lists, y_true, y_pred):
          if metric_list:
            mask = compat.keras_mask(y_p)  # per step: the weight broadcasts over the steps
            rank = mask.shape.rank if mask is not None else 1
            metric_list.update_state(y_t, y_p, sample_weight=tf.reshape(
                sample_weight, [-1] + [1] * (rank - 1)))
      updated = [scope.get_current_value(v) for v in self._metric_variables]
    return tf.concat([tf.reshape(tf.cast(new, tf.float32) - tf.cast(old, tf.float32), [-1])
                      for new, old in zip(updated, initial)], axis=0)

  def metric_state_values(self, state) -> dict:
    import keras  # pylint: disable=g-import-not-at-top
    if self._metrics is None or not self._metric_variables:
      return {}
    values, offset = [], 0
    for initial, size in zip(self._metric_initial, self._state_sizes):
      total = initial.astype(np.float64) + np.asarray(state[offset:offset + size]).reshape(initial.shape)
      values.append(keras.ops.convert_to_tensor(total.astype(initial.dtype)))
      offset += size
    with keras.StatelessScope(state_mapping=list(zip(self._metric_variables, values))):
      # Read inside the scope: a result() that returns a variable itself reads the scope's value.
      return {name: float(np.asarray(keras.ops.convert_to_numpy(value)).mean())
              for name, value in self._metrics.result().items()}

  def reported_metric_names(self) -> list[str]:
    return [*self.metric_names, *self._metric_names]

  # ---- the record ---------------------------------------------------------------------------

  def recorded_config(self, config: dict) -> dict:
    """config.yaml says what ran: the compiled model and the data given, none of the config
    recipes that tfdp.fit does not apply."""
    trainer = {k: v for k, v in config["trainer"].items() if k not in ("optimizer", "learning_rate",
                                                                       "ema_decay")}
    data_keys = ("source", "shuffle", "shuffle_buffer", "shard_policy", "deterministic")
    task = {"name": "keras_model",
            "train_data": {k: config["task"]["train_data"][k] for k in data_keys},
            "eval_data": {k: config["task"]["eval_data"][k] for k in data_keys}}
    # the precision the layers computed in (a pure "bfloat16" policy is not a config value)
    runtime = {**config["runtime"], "mixed_precision": self.model.dtype_policy.name}
    return {"task": task, "trainer": trainer, "runtime": runtime, "keras": self.describe()}

  def describe(self) -> dict:
    import keras  # pylint: disable=g-import-not-at-top
    model = self.model
    def spec(tensors):
      return keras.tree.map_structure(lambda t: f"{t.dtype}{list(t.shape)}", tensors)
    described = {"model_class": f"{type(model).__module__}.{type(model).__name__}",
                 "model_name": _recorded_name(model), "parameters": int(model.count_params())}
    try:
      described["inputs"], described["outputs"] = spec(model.inputs), spec(model.outputs)
    except (AttributeError, ValueError):  # a subclassed model has no symbolic inputs
      pass
    optimizer = model.optimizer
    described["optimizer"] = {"class": type(optimizer).__name__,
                              **{k: _plain(v) for k, v in optimizer.get_config().items()},
                              "name": _recorded_name(optimizer)}
    described["losses"] = [{"output": "/".join(map(str, path)) or None,
                            "loss": type(loss).__name__ if type(loss).__name__ != "LossFunctionWrapper"
                            else loss.name, "weight": weight}
                           for path, loss, weight, _ in self._flat_losses]
    described["metrics"] = self._metric_names
    described["data"] = self.inputs.describe()
    return described


def _recorded_name(layer_or_optimizer) -> str:
  """Keras numbers the names it makes up per process (sgd, sgd_1, ...): a notebook cell run
  again names the same setting, so config.yaml keeps the unnumbered name."""
  made_up = re.sub("([a-z])([A-Z])", r"\1_\2", re.sub("(.)([A-Z][a-z]+)", r"\1_\2",
                                                     type(layer_or_optimizer).__name__)).lower()
  name = layer_or_optimizer.name
  return made_up if re.fullmatch(rf"{re.escape(made_up)}(_\d+)?", name) else name


def check_compiled(model):
  """The model's compiled loss and metrics; one line if it was not compiled. The loss may be
  None: a model whose layers add its loss (`add_loss`), compiled without one, as Keras trains
  it; `attach` checks, once the model has run, that there is such a loss."""
  compile_loss, compile_metrics = compat.compiled_loss_and_metrics(model)
  if getattr(model, "optimizer", None) is None:
    raise ConfigError("the model is not compiled with an optimizer and a loss; "
                      "call model.compile(optimizer=..., loss=..., "
                      "metrics=[...]) first.")
  if compile_loss is None and compile_metrics is not None:
    raise ConfigError("the model is compiled with metrics but no loss (its loss is add_loss's "
                      "alone), which tfdp does not score; compile it with a loss, or drop "
                      "metrics=.")
  return compile_loss, compile_metrics


def needs_labels(model) -> bool:
  """False for a model compiled without a loss (its layers add it): x alone trains it."""
  return compat.compiled_loss_and_metrics(model)[0] is not None


def check_not_overridden(model, steps) -> None:
  """tfdp's own loop runs the model's call, compiled losses and metrics, never Keras's step
  methods: a model that overrides one would train or score otherwise than it says."""
  mine = [name for name in steps
          if next(c for c in type(model).__mro__ if name in vars(c)).__module__.split(".")[0]
          != "keras"]
  if mine:
    loop, keras_way = (("prediction loop", "predict with model.predict") if mine == ["predict_step"]
                       else ("training loop", "train with model.fit"))
    raise ConfigError(
        f"{type(model).__name__} overrides {', '.join(mine)}, which tfdp's own {loop} never "
        "calls (it runs call(), the compiled loss and metrics); move that logic into call(), a "
        f"loss or a metric, or {keras_way}.")


def _reduction(loss, y_pred) -> str:
  """Keras's reduction of a compiled loss, as tfdp.fit applies it: mean, sum or
  mean_with_sample_weight; others are refused."""
  import keras  # pylint: disable=g-import-not-at-top
  given = getattr(loss, "reduction", "sum_over_batch_size")  # None is Keras's "none" too
  reduction = {"sum_over_batch_size": "mean", None: "none"}.get(given, given)
  name = getattr(loss, "name", type(loss).__name__)
  if reduction not in ("mean", "sum", "mean_with_sample_weight"):
    raise ConfigError(f"loss '{name}' has reduction={given!r}, which gives no "
                      "single loss to train; use sum_over_batch_size (the "
                      "default), sum or mean_with_sample_weight.")
  if reduction == "mean_with_sample_weight" and len(keras.ops.shape(y_pred)) > 2:
    raise ConfigError(f"loss '{name}' with reduction={reduction!r} on outputs of "
                      "several values per example is not supported; use "
                      "sum_over_batch_size (the default).")
  return reduction


def _rows_over_replicas(real, counts=()):
  """[the batch's rows, its real rows (`real`: the padding mask), *counts], each summed over
  every replica and worker; constants to the gradient."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.stop_gradient(_summed_over_replicas(tf.stack(
      [tf.cast(tf.shape(real)[0], tf.float32), tf.reduce_sum(real), *counts])))


def _summed_over_replicas(value):
  """`value` summed over every replica and worker (from inside a replica's step)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  context = tf.distribute.get_replica_context()
  if context is None:  # cross-replica context: this is already every replica's value
    return value
  return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


def _check_metrics_add_up(model, metrics, x, y_true) -> None:
  """tfdp combines a metric across replicas and steps by summing each step's change to its
  variables: check that on up to 8 examples, half at a time against all at once. A first update
  also creates the variables of metrics built lazily (F1Score, R2Score, AUC(multi_label)). The
  changes are read in a StatelessScope, as metric_state reads them: an update assigned in
  cross-replica context is divided by the replica count, which an int64 variable (MeanIoU's
  confusion matrix) cannot take (a probe: refused as not adding up)."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  part = lambda rows: lambda t: t[rows]  # pylint: disable=unnecessary-lambda-assignment
  metrics.update_state(keras.tree.map_structure(part(slice(0, 1)), y_true),  # builds them
                       model(tf.nest.map_structure(part(slice(0, 1)), x), training=False))
  metrics.reset_state()
  start = [tf.identity(v.value) for v in metrics.variables]

  def change(rows):
    with keras.StatelessScope(state_mapping=list(zip(metrics.variables, start))) as scope:
      metrics.update_state(keras.tree.map_structure(part(rows), y_true),
                           model(tf.nest.map_structure(part(rows), x), training=False))
      updated = [scope.get_current_value(v) for v in metrics.variables]
    return [np.asarray(new, np.float64) - np.asarray(old, np.float64)
            for new, old in zip(updated, start)]

  count = int(tf.nest.flatten(x)[0].shape[0])
  if count < 2:
    return
  first, second, both = (change(slice(0, count // 2)), change(slice(count // 2, count)),
                         change(slice(0, count)))
  for variable, a, b, ab in zip(metrics.variables, first, second, both):
    if not (np.all(np.isfinite(ab)) and np.allclose(a + b, ab, rtol=1e-4, atol=1e-5)):
      raise ConfigError(f"metric variable '{variable.path}' does not add up over "
                        "batches (its update is not a sum of per-example parts, "
                        "e.g. a running maximum), so tfdp cannot combine it "
                        "across replicas; drop that metric or compute it after "
                        "training with tfdp.predict.")


def _check_one_value_each(metrics) -> None:
  """A metric of several values (one per threshold or class) was reported as their mean: tfdp's
  metrics.csv, History and evaluate hold one number per metric."""
  import keras  # pylint: disable=g-import-not-at-top
  for name, value in metrics.result().items():
    size = int(np.size(keras.ops.convert_to_numpy(value)))
    if size > 1:
      raise ConfigError(
          f"metric '{name}' gives {size} values (one per threshold or class), and tfdp reports "
          "one number per metric; pass one metric per threshold (e.g. Recall(thresholds=0.3, "
          "name='recall_at_0.3')), or average='macro' or 'micro' (F1Score, FBetaScore).")


def _plain(value):
  if isinstance(value, (bool, int, float, str)) or value is None:
    return value
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return str(value)


def _at(structure, path):
  for key in path:
    structure = structure[key]
  return structure


def _spec_of(x) -> str:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return str(tf.nest.map_structure(lambda t: f"{t.dtype.name}[one example: {list(t.shape[1:])}]", x))


def _unreduced(loss):
  """The compiled loss object, per example. A shallow copy made by hand: copy.copy of a Keras
  Loss goes through its config (KerasSaveable.__reduce__), which fails for a user's own loss
  function or class that is not registered with Keras."""
  unreduced = object.__new__(type(loss))
  unreduced.__dict__.update(loss.__dict__)
  unreduced.reduction = "none"
  return unreduced


def _check_labels(model, compile_loss, y_true, y_pred) -> None:
  """One-hot labels with a sparse loss and the reverse, and from_logits against a softmax or
  sigmoid output, fail or train wrongly deep inside Keras: say so before anything runs."""
  import keras  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  user_loss = compile_loss._user_loss  # pylint: disable=protected-access
  if keras.tree.is_nested(user_loss) or keras.tree.is_nested(y_pred):
    return  # per-output losses: Keras checks their structure
  loss = keras.losses.get(user_loss) if isinstance(user_loss, str) else user_loss
  name = getattr(loss, "name", "") or getattr(loss, "__name__", "")
  labels = np.asarray(y_true)
  width = y_pred.shape[-1]
  sparse = "sparse_categorical" in name
  if sparse and labels.ndim == len(y_pred.shape) and labels.shape[-1] == width > 1:
    raise DataError(f"y looks one-hot (last dimension {width}), but the loss is "
                    f"{name}, which takes class ids; pass integer labels "
                    "(y.argmax(-1)) or use CategoricalCrossentropy.")
  if "categorical" in name and not sparse and width > 1 and (
      labels.ndim < len(y_pred.shape) or labels.shape[-1] == 1):
    raise DataError(f"y holds class ids, but the loss is {name}, which takes "
                    "one-hot labels; use SparseCategoricalCrossentropy or "
                    "keras.utils.to_categorical(y).")
  if not (getattr(model, "_is_graph_network", False) or isinstance(model, keras.Sequential)):
    return  # a subclassed model's call() may apply its own softmax: no layer says so
  from_logits = getattr(loss, "from_logits", None)
  if from_logits is None:
    config = getattr(loss, "get_config", lambda: {})()
    from_logits = config.get("from_logits")
  last = model.layers[-1] if getattr(model, "layers", None) else None
  activation = getattr(getattr(last, "activation", None), "__name__", "")
  if from_logits and activation in ("softmax", "sigmoid"):
    logging.warning(errors.as_caller("the loss has from_logits=True but the model's last layer "
                                     "applies %s; its outputs are probabilities, not logits (use "
                                     "from_logits=False or drop the activation)."), activation)
  elif from_logits is False and activation in ("linear", "") and last is not None and (
      "crossentropy" in name):
    logging.warning(errors.as_caller("the loss takes probabilities (from_logits=False) but the "
                                     "model's last layer has no softmax/sigmoid; if it outputs "
                                     "logits, pass from_logits=True."))
