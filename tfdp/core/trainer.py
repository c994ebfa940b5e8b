"""The one training engine: a custom `strategy.run` loop with Keras 3 model/optimizer/loss.

Keras 3 `model.fit` fails under MultiWorkerMirroredStrategy (keras-team/keras#20585) and its
checkpoint callbacks have no chief/worker logic, so the loop, checkpoints and outputs are ours.
The same code runs under the default, mirrored and multi-worker strategies.

Every graph tfdp traces (these loops, the input pipelines, prediction) is traced without
autograph, as Keras 3's own trainer does: its control flow is written with tf.while_loop and
tf.cond, so a task's code (preprocess, losses, metric sums) must use those too. Converting tfdp's
functions cost ~1.5 CPU s of every process's start-up (about a fifth of a small test job).
"""
from __future__ import annotations

import contextlib
import os
import re
import time
import traceback

from absl import logging
import numpy as np
import keras
import tensorflow as tf

from tfdp.distributed import compat
from tfdp.core import model_walk
from tfdp.core import outputs
from tfdp.core import regularization
from tfdp.config.schema import ExperimentConfig
from tfdp.core import optim
from tfdp.core import resume
from tfdp import errors
from tfdp.errors import ConfigError, OutputError, TrainingDiverged


@contextlib.contextmanager
def tensor_conditions_named():
  """Code traced here that needs autograph (`if`/`while`/`for` on a tensor in a task's
  preprocess, loss or metric sums, or in a user's Keras loss) fails with TensorFlow's long
  OperatorNotAllowedInGraphError: one line instead, naming that line and the fix."""
  try:
    yield
  except tf.errors.OperatorNotAllowedInGraphError as error:
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not re.search(r"[/\\](tensorflow|keras|tf_keras)[/\\]", f.filename)]
    where = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else "code"
    raise ConfigError(
        f"{where} uses a tensor as a Python bool (an if, while, for or and/or on a tensor); "
        "tfdp traces its steps and input pipelines without autograph, as Keras 3's model.fit "
        "does: write it with tf.cond or tf.where, and a loop with tf.while_loop.") from None


def summed_over_steps(strategy, batch_sums, size: int):
  """A compiled loop (iterator, num_steps) → the [size] vector `batch_sums(batch)` summed over
  num_steps batches on each replica, then over every replica and worker (one reduce per call)."""
  def replica_step(batch, totals):
    return totals + batch_sums(batch)

  @tf.function(autograph=False)
  def loop(iterator, num_steps):
    def one_step(done, totals):
      return done + 1, strategy.run(replica_step, args=(next(iterator), totals))

    _, totals = tf.while_loop(lambda done, _: done < num_steps, one_step,
                              (tf.constant(0, num_steps.dtype),
                               strategy.run(lambda: tf.zeros(size))))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, totals, axis=None)

  return loop


def _add_gradients(a, b):
  if a is None or b is None:
    return a if b is None else b
  if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):  # embeddings stay sparse
    return tf.IndexedSlices(tf.concat([a.values, b.values], 0),
                            tf.concat([a.indices, b.indices], 0), a.dense_shape)
  return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


class MetricSums:
  """A task's metrics as named weighted sums, each with its own denominator, summed over
  replicas and steps and divided only when read; `examples` counts real (weight > 0) examples."""

  def __init__(self, names, vector=None, finalize=lambda name, value: value,
               state_values=None):
    self.names = tuple(names)
    self.finalize = finalize
    vector = [0.0] * (1 + 2 * len(self.names)) if vector is None else [float(v) for v in vector]
    self.examples = vector[0]
    self.sums = {n: (vector[1 + 2 * i], vector[2 + 2 * i]) for i, n in enumerate(self.names)}
    # Task.metric_state: other additive state, read by the task (Keras metric objects).
    self.state = np.asarray(vector[1 + 2 * len(self.names):], np.float64)
    self.state_values = state_values

  def add(self, other: "MetricSums") -> None:
    self.examples += other.examples
    for name in self.names:
      (a, b), (c, d) = self.sums[name], other.sums[name]
      self.sums[name] = (a + c, b + d)
    self.state = self.state + other.state

  def value(self, name: str) -> float:
    numerator, denominator = self.sums[name]
    return self.finalize(name, numerator / denominator) if denominator else 0.0

  def values(self) -> dict:
    values = {n: self.value(n) for n in self.names}
    if self.state_values is not None and self.state.size:
      values.update(self.state_values(self.state))
    return values


def metric_vector(task, batch, model_outputs, per_example):
  """[examples, numerator_1, denominator_1, ..., metric_state...] in the task's metric order:
  what the loops sum over replicas and steps (MetricSums reads it)."""
  sums = task.metric_sums(batch, model_outputs, per_example)
  for name in task.metric_names:  # checked while tracing: the task's own mistake, said so
    pair = sums.get(name) if isinstance(sums, dict) else None
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
      raise ConfigError(
          f"task '{task.config.name}': metric_sums gives {'no' if pair is None else 'a non-pair'} "
          f"{name!r}; return a (sum, count) pair for each of metric_names "
          f"{list(task.metric_names)}, e.g. 'loss': (tf.reduce_sum(per_example_loss * "
          "batch['weight']), tf.reduce_sum(batch['weight'])).")
  parts = [tf.reduce_sum(batch["weight"])]
  for name in task.metric_names:
    parts.extend(tf.cast(x, tf.float32) for x in sums[name])
  if not task.metric_state_size:
    return tf.stack(parts)
  return tf.concat([tf.stack(parts), task.metric_state(batch, model_outputs)], axis=0)


def per_example_loss(task, batch, outputs):
  """The task's loss, one value per example: a [batch, 1] loss would broadcast against the
  [batch] weights into a [batch, batch] matrix and train on a wrong loss, silently."""
  loss = task.per_example_loss(batch, outputs)
  rank = getattr(getattr(loss, "shape", None), "rank", None)
  if rank is not None and rank != 1:
    raise ConfigError(f"task '{task.config.name}': per_example_loss returned shape "
                      f"{list(loss.shape)}; return one value per example, shape [batch] (squeeze "
                      "a last axis of 1, or average over the others).")
  return loss


class Trainer:
  """Owns model, optimizer, checkpoints and the compiled step loops for one strategy.

  Knows no workload: the task gives the model's inputs, the per-example loss and the metric
  sums of each batch (a dict whose "weight" is 0 for padding). `global_batch` and
  `steps_per_epoch` come from the input plan that shaped the batches.
  """

  def __init__(self, config: ExperimentConfig, strategy, write_plan: outputs.WritePlan,
               model_fn, task, global_batch: int, steps_per_epoch: int,
               accumulation_steps: int = 1, precision: str = "float32", verbose: bool = True):
    self.config = config
    self.strategy = strategy
    self.write_plan = write_plan
    self.task = task
    self.steps_per_epoch = steps_per_epoch
    self.verbose = verbose and write_plan.is_chief
    trainer = config.trainer
    self.global_batch = global_batch
    self.accumulation_steps = accumulation_steps
    self.total_steps = trainer.epochs * steps_per_epoch
    if trainer.max_steps:
      self.total_steps = min(self.total_steps, trainer.max_steps)
    self.precision = precision  # decided once (strategy.resolve_precision): never "auto"
    keras.mixed_precision.set_dtype_policy(precision)
    with strategy.scope():
      self.model = model_fn()
      if not isinstance(self.model, keras.Model):  # else an AttributeError deep in the optimizer
        raise ConfigError(f"task '{task.config.name}': build_model returned a "
                          f"{type(self.model).__name__}; return a keras.Model.")
      self._replica_local = (compat.replica_local_statistics(self.model)
                             if strategy.num_replicas_in_sync > 1 else [])
      self._regularized = regularization.regularized_layers(self.model)
      own_optimizer = task.make_optimizer(self.model)  # a compiled model's (tfdp.fit)
      if own_optimizer is None:
        self.schedule = optim.make_schedule(trainer.learning_rate, self.global_batch,
                                            steps_per_epoch, self.total_steps, trainer.optimizer)
        self.optimizer = optim.make_optimizer(trainer.optimizer, self.schedule, self.model,
                                              precision == "mixed_float16", trainer.ema_decay,
                                              global_batch=self.global_batch)
      else:
        self.optimizer = optim.adopt_optimizer(own_optimizer, self.model)
        self.schedule = self._own_learning_rate
      # The global step counts training steps, taken or skipped: under mixed_float16 the loss
      # scale skips non-finite steps and `optimizer.iterations` does not advance on them
      # (keras-team/keras#20878), but checkpoints, resume and the data position must.
      self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                               aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      self._lookahead = (optim.Lookahead(self.model.trainable_variables,
                                         trainer.lookahead_every_steps, trainer.lookahead_decay,
                                         self.total_steps)
                         if trainer.lookahead_every_steps else None)
    # Per trainable variable: the factor its gradient is scaled by before the update (an exact
    # learning-rate multiplier for SGD), or None.
    multiplier = trainer.optimizer.norm_bias_lr_multiplier
    betas = ({id(layer.beta) for layer in self.batchnorm_layers() if layer.center}
             if multiplier != 1.0 and own_optimizer is None else set())
    self._gradient_multipliers = [multiplier if id(v) in betas else None
                                  for v in self.model.trainable_variables]
    extra = {"lookahead": self._lookahead} if self._lookahead is not None else {}
    seeds = model_walk.seed_states(self.model)  # a resume goes on with Dropout's masks (a probe)
    self._checkpoint_parts = {"model": self.model, "optimizer": self.optimizer,
                              "step": self._step, **extra, **({"seeds": seeds} if seeds else {})}
    self.checkpoint = tf.train.Checkpoint(**self._checkpoint_parts)
    # A non-chief's copies are never read: it keeps none (see save) beyond the one being written.
    self.manager = tf.train.CheckpointManager(
        self.checkpoint, write_plan.checkpoint_dir,
        max_to_keep=trainer.max_checkpoints if write_plan.is_chief else 1)
    if config.runtime.jit_compile:
      # XLA compiles the per-replica forward/backward; the optimizer's cross-replica update
      # (a merge_call) stays outside the compiled function.
      self._forward_backward = tf.function(self._forward_backward, jit_compile=True,
                                           autograph=False)
    self._wire_dtype = (None if config.runtime.all_reduce_dtype == "float32"
                        else tf.as_dtype(config.runtime.all_reduce_dtype))
    self._num_sums = 1 + 2 * len(task.metric_names) + task.metric_state_size
    # This worker's stop request, read by every step; outside the strategy: each worker's own.
    self._stop_flag = tf.Variable(0.0, trainable=False, name="stop_requested")
    self._train_loop = self._make_train_loop()
    self.retrace_eval_loop()

  def retrace_eval_loop(self) -> None:
    """A new compiled eval loop: the task's eval settings (task.eval_flip) are read when it traces
    (benchmarks/eval_variants.py evaluates one state several ways)."""
    self._eval_loop = summed_over_steps(self.strategy, self._eval_sums, self._num_sums)

  def _own_learning_rate(self, step):
    """A compiled optimizer's learning rate now (its schedule counts its own iterations)."""
    del step
    rate = self.optimizer.learning_rate
    return tf.identity(getattr(rate, "value", rate))

  # ---- per-replica steps ---------------------------------------------------------------------

  def _sums(self, batch, model_outputs, per_example):
    return metric_vector(self.task, batch, model_outputs, per_example)

  def metric_sums(self, vector) -> MetricSums:
    return MetricSums(self.task.metric_names, vector, self.task.finalize_metric,
                      self.task.metric_state_values)

  def _forward_backward(self, batch):
    with regularization.replica_step(self._regularized, batch["weight"],
                                     lambda: self.task.activity_scale(batch)) as step:
      with tf.GradientTape() as tape:
        outputs = self.task.loss_outputs(self.model(self.task.model_inputs(batch), training=True))
        regularizers = step.keep(self.model)
        per_example = per_example_loss(self.task, batch, outputs)
        # Divide by the *global* batch: the all-reduce SUM of replica gradients is then the
        # gradient of the mean loss over the whole batch, whatever the replica count.
        loss = tf.nn.compute_average_loss(per_example, sample_weight=batch["weight"],
                                          global_batch_size=self.global_batch)
        if regularizers:  # once per optimizer step, whatever the micro-steps
          loss += (tf.nn.scale_regularization_loss(tf.add_n(regularizers))
                   / self.accumulation_steps)
        scaled = (self.optimizer.scale_loss(loss) if hasattr(self.optimizer, "scale_loss")
                  else loss)
      grads = tape.gradient(scaled, self.model.trainable_variables)
      return grads, self._sums(batch, outputs, per_example)

  def _train_step(self, batches, totals, stop_flag=None):
    """One optimizer step from `gradient_accumulation_steps` micro-batches on this replica.
    With `stop_flag` (this worker's stop request, 0 or 1) returns (totals, the flag summed over
    every replica and worker): it rides on the gradients' all-reduce, so every worker sees the
    same sum after the same step at no extra collective."""
    grads = None
    for batch in batches:  # a Python loop: the micro-steps are unrolled in the graph
      micro_grads, sums = self._forward_backward(batch)
      totals += sums
      grads = micro_grads if grads is None else [_add_gradients(a, b)
                                                 for a, b in zip(grads, micro_grads)]
    # tfdp all-reduces (SUM) itself, so the global-norm clip and the loss scale's finite check
    # see the gradient of the whole global batch; the optimizer's own all-reduce is off
    # (compat.skip_optimizer_all_reduce).
    if self.config.runtime.dense_embedding_gradients:
      grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    flag = [] if stop_flag is None else [tf.reshape(tf.cast(stop_flag, tf.float32), [1])]
    reduced = compat.all_reduce_gradients(  # appended: the gradients keep their order
        [*grads, *flag], self._wire_dtype,
        backward_order=self.config.runtime.all_reduce_order == "backward")
    grads, agreed = reduced[:len(grads)], reduced[len(grads):]
    if self.config.trainer.gradient_clip_norm:
      clip = self.config.trainer.gradient_clip_norm
      if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
        clip = clip * tf.cast(self.optimizer.dynamic_scale, tf.float32)  # grads are still scaled
      grads, _ = tf.clip_by_global_norm(grads, clip)
    grads = [g if m is None or g is None else g * m
             for g, m in zip(grads, self._gradient_multipliers)]
    # Variables the loss does not reach (BertMaskedLM's unused pooler) have no gradient.
    self.optimizer.apply_gradients(
        [(g, v) for g, v in zip(grads, self.model.trainable_variables) if g is not None])
    return totals if stop_flag is None else (totals, tf.cast(agreed[0], tf.float32))

  def _eval_sums(self, batch):
    with regularization.replica_step(self._regularized, batch["weight"],
                                     lambda: self.task.activity_scale(batch)) as step:
      outputs = self.task.loss_outputs(self.task.eval_outputs(self.model, batch))
      step.keep(self.model)
      return self._sums(batch, outputs, per_example_loss(self.task, batch, outputs))

  # ---- compiled loops ------------------------------------------------------------------------

  def _make_train_loop(self):
    strategy = self.strategy

    def train_loop(iterator, num_steps):
      totals = strategy.run(lambda: tf.zeros(self._num_sums + 1))
      if self._lookahead is not None:
        with strategy.scope():
          self._lookahead.start(self._step)

      def not_done(taken, totals, stopped, asked_here):  # pylint: disable=unused-argument
        return tf.logical_and(taken < tf.cast(num_steps, tf.int64), tf.logical_not(stopped))

      def one_step(taken, totals, stopped, asked_here):
        del stopped, asked_here
        batches = tuple(next(iterator) for _ in range(self.accumulation_steps))
        # Read every step (the signal thread sets it while this runs): a stop is agreed after
        # the step it reaches every worker in, whatever steps_per_loop is.
        flag = self._stop_flag.read_value()
        totals = strategy.run(self._train_step_with_flag, args=(batches, totals, flag))
        taken += 1
        if self._lookahead is not None:  # cross-replica context: every copy alike
          with strategy.scope():
            self._lookahead.after_step(self._step + taken)
        # The same sum everywhere: all leave after this step; this worker's flag names the stop.
        return taken, totals, strategy.experimental_local_results(totals)[0][-1] > 0, flag > 0

      taken, totals, _, asked_here = tf.while_loop(
          not_done, one_step,
          (tf.constant(0, tf.int64), totals, tf.constant(False), tf.constant(False)))
      self._step.assign_add(taken)
      # BatchNorm statistics drift per replica in Keras 3: average them once per loop, so
      # evaluation, checkpoints and export always see one value (see compat.py).
      strategy.run(lambda: compat.average_across_replicas(self._replica_local))
      return strategy.reduce(tf.distribute.ReduceOp.SUM, totals, axis=None), taken, asked_here

    return tf.function(compat.custom_gradients_dropped(train_loop), autograph=False)

  def _train_step_with_flag(self, batches, totals, stop_flag):
    with compat.replica_random_streams():  # each replica its own dropout masks
      totals, agreed = self._train_step(batches, totals[:-1], stop_flag)
    return tf.concat([totals, tf.reshape(agreed, [1])], axis=0)

  # ---- checkpoints ---------------------------------------------------------------------------

  def state_fields(self) -> dict:
    """What the checkpoint holds beside the weights (resume.STATE_FIELDS)."""
    optimizer = getattr(self.optimizer, "inner_optimizer", self.optimizer)  # loss scaling
    return {"optimizer": type(optimizer).__name__.lower(),  # as trainer.optimizer.name spells it
            "weight_average": bool(getattr(optimizer, "use_ema", False)),
            "lookahead": self._lookahead is not None}

  @property
  def global_step(self) -> int:
    return int(self._step.numpy())

  def restore(self, latest: str | None, to_evaluate: bool = False) -> int:
    """Restores `latest`, the checkpoint the resume's checks read (resume.Prior; every worker
    reads the chief's); None: a fresh start. `to_evaluate`: --mode=eval, which resumes nothing."""
    if latest:
      try:
        tf.train.Checkpoint(**{k: v for k, v in self._checkpoint_parts.items() if k != "seeds"}
                            ).restore(latest).assert_existing_objects_matched()
        self._restore_seeds(latest, say=not to_evaluate)
      except (tf.errors.OpError, ValueError, AssertionError, IndexError, KeyError) as e:
        config = os.path.join(os.path.dirname(os.path.dirname(latest)), outputs.CONFIG_FILE)
        own = (f"give this run the config it trained with ({errors.terms().config_files}={config}) "
               "or "
               if os.path.exists(config) and not outputs.is_fit_record(config) else "")
        raise OutputError(
            f"checkpoint '{latest}' cannot be resumed by this run "
            f"({resume.describe_restore_error(e)}); if it is another model's or config's, {own}use "
            f"another {errors.terms().model_dir}; if it is damaged, "
            f"{outputs.older_checkpoint_fix(latest)}."
        ) from None
      logging.info("%s %s at step %d", "evaluating" if to_evaluate else "resumed from", latest,
                   self.global_step)
      self._restored = [self.global_step]  # a non-chief's manager knows its own saves only
    return self.global_step

  _restored = ()  # the step of the chief's checkpoint the run resumed from, on every worker

  def _restore_seeds(self, latest: str, say: bool) -> None:
    """The random layers' seed states, where `latest` holds one for each (none is no reason
    not to resume: an older tfdp's checkpoint, or a model that had fewer random layers)."""
    seeds = self._checkpoint_parts.get("seeds", [])
    saved = {n.split("/")[1] for n, _ in tf.train.list_variables(latest) if n.startswith("seeds/")}
    if seeds and len(saved) == len(seeds):
      tf.train.Checkpoint(seeds=seeds).read(latest).expect_partial()
    elif seeds and say:
      logging.warning("%s holds %d seed state(s) for this model's %d random layer(s) (an older "
                      "tfdp's, or another model's): they draw new masks from here on", latest,
                      len(saved), len(seeds))

  @property
  def last_saved_step(self) -> int | None:
    latest = self.manager.latest_checkpoint
    return max([*self._restored, *([int(latest.rsplit("-", 1)[1])] if latest else [])],
               default=None)

  run_record = None  # what a step means (experiment._run_record); the chief keeps it beside
  run_record_from_step = 0  # the checkpoints, from the first save on
  prior_record = None  # the restored run's record (resume.Prior), which run_record continues

  def save(self) -> None:
    # A checkpoint is good only if its weights are: the loss checked before a save was computed
    # with the weights of the step before, not with those the last update made.
    if not self._weights_finite():
      raise TrainingDiverged(
          f"training diverged: the weights after step {self.global_step} are not finite (or "
          f"too large to square in float32); stopped without saving, "
          f"{errors.checkpoint_kept(self.last_saved_step)}. "
          f"{errors.terms().diverged_fix}.")
    if self.write_plan.is_chief and self.run_record is not None:
      # Written before the checkpoint: a checkpoint of this run never exists without it.
      old = (self.prior_record if self.run_record_from_step
             else None)  # a fresh run: a record left without a checkpoint is stale
      record = resume.updated_run_record(old, self.run_record, self.run_record_from_step)
      if record != getattr(self, "_run_record_written", None):
        resume.write_run_record(self.write_plan.model_dir, record)
        self._run_record_written = record
    # Every worker saves (variables may need collectives); only the chief's copy is kept.
    with outputs.checkpoint_save_errors(self.write_plan, self.global_step, self.last_saved_step):
      self.manager.save(checkpoint_number=self.global_step)
    self.write_plan.discard_worker_checkpoints()

  def _weights_finite(self) -> bool:
    """Whether every replica's trainable weights are finite and their squares are too (a
    weight beyond ~1e19 is blown up, and makes the next loss overflow): one all-reduce, so
    every worker decides alike. With trainer.stop_on_nan=false, always true."""
    if not self.config.trainer.stop_on_nan:
      return True
    if getattr(self, "_weights_check", None) is None:
      variables = self.model.trainable_variables

      @tf.function(autograph=False)
      def weights_check():
        def replica_bad():
          squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(v, tf.float32))) for v in variables])
          return 1.0 - tf.cast(tf.math.is_finite(squares), tf.float32)
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, self.strategy.run(replica_bad),
                                    axis=None)
      self._weights_check = weights_check
    return float(self._weights_check()) == 0.0

  # ---- the weights evaluation and export see ------------------------------------------------

  # tfdp.fit sets it for a compiled optimizer with use_ema, as Keras's fit: evaluation and export
  # see the weights as they are, and fit overwrites them with their average when it ends.
  raw_weights_evaluated = False

  @contextlib.contextmanager
  def evaluation_weights(self):
    """With trainer.ema_decay, the moving average of the weights is swapped in (on every replica
    and worker alike) for evaluation, PreciseBN and export, and the weights are put back after,
    so training goes on from its own weights; without it, the weights as they are."""
    averages = compat.weight_averages(self.optimizer)
    if not averages or self.raw_weights_evaluated:
      yield
      return
    variables = self.model.trainable_variables
    kept = [tf.identity(v.value) for v in variables]
    self._assign_everywhere(variables, [a.value for a in averages])
    try:
      yield
    finally:
      self._assign_everywhere(variables, kept)

  def _assign_everywhere(self, variables, values) -> None:
    with self.strategy.scope():  # cross-replica context: a mirrored variable's every copy
      for variable, value in zip(variables, values):
        variable.assign(value)

  # ---- precise BatchNorm statistics -----------------------------------------------------------

  def batchnorm_layers(self) -> list:
    return [layer for layer in model_walk.every_layer(self.model)
            if isinstance(layer, keras.layers.BatchNormalization)]

  def precise_batchnorm(self, dataset, num_batches: int) -> int:
    """PreciseBN (pycls, Detectron2): BatchNorm's moving statistics, which lag the weights in
    short runs (momentum 0.99 keeps 0.99^k of the initial values), become their average over
    `num_batches` training batches with the weights frozen, across replicas and workers, from a
    distributed dataset of its own (the training order is left alone). Returns the batches."""
    layers = self.batchnorm_layers()
    if not layers or num_batches <= 0:
      return 0
    stats = [v for layer in layers for v in (layer.moving_mean, layer.moving_variance)]
    strategy = self.strategy
    if getattr(self, "_batch_statistics_step", None) is None:
      @tf.function(autograph=False)
      def batch_statistics_step(iterator):
        def replica_fn(batch):
          self.model(self.task.model_inputs(batch), training=True)  # momentum 0: the batch's own
          compat.average_across_replicas(stats)  # statistics, averaged over every replica
        strategy.run(replica_fn, args=(next(iterator),))
      self._batch_statistics_step = batch_statistics_step
    momenta = [layer.momentum for layer in layers]
    kept = [np.asarray(v) for v in stats]
    totals = [np.zeros_like(k, dtype=np.float64) for k in kept]
    holder = [iter(dataset)]  # destroyed off this thread, as evaluate's (its whole pipeline)
    try:
      for layer in layers:  # read when the step is traced (Keras 3 keeps it as a Python float)
        layer.momentum = 0.0
      for _ in range(num_batches):
        self._batch_statistics_step(holder[0])
        for total, variable in zip(totals, stats):
          total += np.asarray(variable)
    except Exception:
      self._set_replica_values(stats, kept)  # a failed pass must not leave one batch's statistics
      raise
    finally:
      for layer, momentum in zip(layers, momenta):
        layer.momentum = momentum
      from tfdp.core import controller  # pylint: disable=g-import-not-at-top  (it drives this)
      controller.drop_in_background(holder, "tfdp-release-precise-bn-iterator")
    self._set_replica_values(stats, [(t / num_batches).astype(k.dtype) for t, k in zip(totals, kept)])
    return num_batches

  def _set_replica_values(self, variables, values) -> None:
    constants = [tf.constant(v) for v in values]

    @tf.function(autograph=False)
    def assign_everywhere():  # every replica's own copy (BatchNorm statistics are per replica)
      self.strategy.run(lambda: [v.assign(c) for v, c in zip(variables, constants)])
    assign_everywhere()

  # ---- public loops: the outer loop that calls them is tfdp.core.controller.Controller --------------------------------------------------------------------------

  def trace_train_loop(self, iterator) -> float:
    """Traces the training loop for this iterator before its first call runs it (a stop test and
    the log can then tell tracing from training); returns the seconds it took."""
    started = time.perf_counter()
    self._train_loop.get_concrete_function(iterator, tf.constant(1))
    return time.perf_counter() - started

  def run_steps(self, iterator, num_steps: int) -> tuple[MetricSums, bool, bool, int]:
    """Runs up to num_steps training steps (one compiled call) from a distributed iterator.
    Returns their summed metrics, whether a worker asked to stop (request_stop; agreed by the
    all-reduce, the loop then left early), whether this worker's flag fed it, and the steps."""
    sums, taken, asked_here = self._train_loop(iterator, tf.constant(num_steps))
    sums = sums.numpy()
    return self.metric_sums(sums[:-1]), bool(sums[-1] > 0), bool(asked_here), int(taken)

  def request_stop(self, requested: bool = True) -> None:
    """Thread-safe: the running loop leaves after the step every worker has seen it in."""
    self._stop_flag.assign(1.0 if requested else 0.0)

  def evaluate(self, dist_dataset, steps: int) -> MetricSums:
    holder = [iter(dist_dataset)]
    sums = self._eval_loop(holder[0], tf.constant(steps)).numpy()
    from tfdp.core import controller  # pylint: disable=g-import-not-at-top  (it drives this)
    controller.drop_in_background(holder, "tfdp-release-eval-iterator")
    return self.metric_sums(sums)
