"""The one training engine: a custom `strategy.run` loop with Keras 3 model/optimizer/loss.

Keras 3 `model.fit` fails under MultiWorkerMirroredStrategy (keras-team/keras#20585) and its
checkpoint callbacks have no chief/worker logic, so the loop, checkpoints and outputs are ours.
The same code runs under the default, mirrored and multi-worker strategies.
"""
from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time

from absl import logging
import keras
import tensorflow as tf

from tfdp import compat
from tfdp import outputs
from tfdp.errors import Preempted
from tfdp.config import ExperimentConfig, LearningRateConfig, OptimizerConfig


class WarmupDecaySchedule(keras.optimizers.schedules.LearningRateSchedule):
  """Linear warmup to `peak_lr`, then constant, cosine, linear or step decay."""

  def __init__(self, peak_lr, warmup_steps, total_steps, schedule="cosine", boundaries=(),
               decay_rate=0.1, final_lr_fraction=0.0):
    self.peak_lr = float(peak_lr)
    self.warmup_steps = int(warmup_steps)
    self.total_steps = max(int(total_steps), 1)
    self.schedule = schedule
    self.boundaries = [int(b) for b in boundaries]
    self.decay_rate = float(decay_rate)
    self.final_lr_fraction = float(final_lr_fraction)

  def __call__(self, step):
    step = tf.cast(step, tf.float32)
    peak = tf.constant(self.peak_lr, tf.float32)
    final = peak * self.final_lr_fraction
    decay_len = float(max(self.total_steps - self.warmup_steps, 1))
    progress = tf.clip_by_value((step - self.warmup_steps) / decay_len, 0.0, 1.0)
    if self.schedule == "cosine":
      lr = final + (peak - final) * 0.5 * (1.0 + tf.cos(math.pi * progress))
    elif self.schedule == "linear":
      lr = peak + (final - peak) * progress
    elif self.schedule == "step":
      passed = tf.add_n([tf.cast(step >= b, tf.float32) for b in self.boundaries])
      lr = peak * tf.pow(self.decay_rate, passed)
    else:
      lr = peak
    if self.warmup_steps:
      lr = tf.where(step < self.warmup_steps, peak * (step + 1.0) / self.warmup_steps, lr)
    return lr

  def get_config(self):
    return {"peak_lr": self.peak_lr, "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps, "schedule": self.schedule,
            "boundaries": self.boundaries, "decay_rate": self.decay_rate,
            "final_lr_fraction": self.final_lr_fraction}


def scaled_learning_rate(base_lr: float, global_batch_size: int, base_batch_size: int) -> float:
  """The linear scaling rule (Goyal et al. 2017): lr grows with the global batch."""
  return base_lr * global_batch_size / base_batch_size


def make_schedule(lr: LearningRateConfig, global_batch: int, steps_per_epoch: int,
                  total_steps: int) -> WarmupDecaySchedule:
  return WarmupDecaySchedule(
      scaled_learning_rate(lr.base_lr, global_batch, lr.base_batch_size),
      warmup_steps=round(lr.warmup_epochs * steps_per_epoch), total_steps=total_steps,
      schedule=lr.schedule, boundaries=[round(e * steps_per_epoch) for e in lr.decay_epochs],
      decay_rate=lr.decay_rate, final_lr_fraction=lr.final_lr_fraction)


def make_optimizer(opt: OptimizerConfig, learning_rate, model, mixed_float16: bool = False):
  """Call inside strategy.scope(). Weight decay skips biases and normalization parameters."""
  wd = opt.weight_decay or None
  if opt.name == "sgd":
    optimizer = keras.optimizers.SGD(learning_rate, momentum=opt.momentum, nesterov=opt.nesterov,
                                     weight_decay=wd)
  elif opt.name == "adamw":
    optimizer = keras.optimizers.AdamW(learning_rate, weight_decay=opt.weight_decay,
                                       beta_1=opt.beta_1, beta_2=opt.beta_2)
  else:
    optimizer = keras.optimizers.Adam(learning_rate, beta_1=opt.beta_1, beta_2=opt.beta_2,
                                      weight_decay=wd)
  if wd or opt.name == "adamw":
    optimizer.exclude_from_weight_decay(
        var_list=[v for v in model.trainable_variables if len(v.shape) <= 1])
  if mixed_float16:
    optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
  optimizer.build(model.trainable_variables)
  return optimizer


def _memory_mb() -> dict:
  """This process's memory now and at its peak: a leak shows as growth from epoch to epoch."""
  import resource  # pylint: disable=g-import-not-at-top
  import psutil  # pylint: disable=g-import-not-at-top
  return {"rss_mb": psutil.Process().memory_info().rss / 2**20,
          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class _StopRequest:
  """SIGTERM (preemption, `kill`, the launcher stopping a group) or a first Ctrl-C asks for a
  checkpoint and a clean exit at the next loop boundary; every worker agrees on that boundary
  through the loop's all-reduce. A second Ctrl-C interrupts at once."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, enabled: bool):
    self.signum = 0
    self._previous = {}
    if enabled:
      for signum in self.SIGNALS:
        try:
          self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread (e.g. some notebook runners)
          pass

  @property
  def requested(self) -> bool:
    return bool(self.signum)

  def _handle(self, signum, frame):
    del frame
    if signum == signal.SIGINT and self.signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signum = self.signum or signum

  def restore(self):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)


@dataclasses.dataclass
class LoopResult:
  loss_sum: float = 0.0
  correct: float = 0.0
  count: float = 0.0

  def add(self, other: "LoopResult") -> None:
    self.loss_sum += other.loss_sum
    self.correct += other.correct
    self.count += other.count

  @property
  def loss(self) -> float:
    return self.loss_sum / max(self.count, 1.0)

  @property
  def accuracy(self) -> float:
    return self.correct / max(self.count, 1.0)


class Trainer:
  """Owns model, optimizer, checkpoints and the compiled step loops for one strategy.

  `train_plan`/`eval_plan` are tfdp.data.InputPlan objects (fixed per-replica batch, padded with
  mask=0 examples), and `make_train_dataset(start_step)`/`make_eval_dataset()` return
  distributed datasets of `(images, labels, mask)`.
  """

  def __init__(self, config: ExperimentConfig, strategy, write_plan: outputs.WritePlan,
               model_fn, steps_per_epoch: int, verbose: bool = True):
    self.config = config
    self.strategy = strategy
    self.write_plan = write_plan
    self.steps_per_epoch = steps_per_epoch
    self.verbose = verbose and write_plan.is_chief
    trainer = config.trainer
    self.global_batch = trainer.global_batch_size
    self.total_steps = trainer.epochs * steps_per_epoch
    if trainer.max_steps:
      self.total_steps = min(self.total_steps, trainer.max_steps)
    precision = config.runtime.mixed_precision
    keras.mixed_precision.set_dtype_policy(precision)
    with strategy.scope():
      self.model = model_fn()
      self._replica_local = (compat.replica_local_statistics(self.model)
                             if strategy.num_replicas_in_sync > 1 else [])
      self.schedule = make_schedule(trainer.learning_rate, self.global_batch, steps_per_epoch,
                                    self.total_steps)
      self.optimizer = make_optimizer(trainer.optimizer, self.schedule, self.model,
                                      mixed_float16=precision == "mixed_float16")
      # The global step counts training steps, taken or skipped: under mixed_float16 the loss
      # scale skips non-finite steps and `optimizer.iterations` does not advance on them
      # (keras-team/keras#20878), but checkpoints, resume and the data position must.
      self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                               aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      if config.task.label_smoothing:
        self._loss = keras.losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=config.task.label_smoothing, reduction=None)
      else:
        self._loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer,
                                          step=self._step)
    self.manager = tf.train.CheckpointManager(self.checkpoint, write_plan.checkpoint_dir,
                                              max_to_keep=trainer.max_checkpoints)
    if config.runtime.jit_compile:
      # XLA compiles the per-replica forward/backward; the optimizer's cross-replica update
      # (a merge_call) stays outside the compiled function.
      self._forward_backward = tf.function(self._forward_backward, jit_compile=True)
    self._train_loop = self._make_train_loop()
    self._eval_loop = self._make_eval_loop()

  # ---- per-replica steps ---------------------------------------------------------------------

  def _per_example_loss(self, labels, logits):
    logits = tf.cast(logits, tf.float32)
    if self.config.task.label_smoothing:
      labels = tf.one_hot(labels, tf.shape(logits)[-1])
    return self._loss(labels, logits)

  def _sums(self, labels, logits, per_example, mask):
    correct = tf.cast(tf.equal(tf.argmax(logits, -1), labels), tf.float32)
    return tf.stack([tf.reduce_sum(per_example * mask), tf.reduce_sum(correct * mask),
                     tf.reduce_sum(mask)])

  def _forward_backward(self, images, labels, mask):
    with tf.GradientTape() as tape:
      logits = self.model(images, training=True)
      per_example = self._per_example_loss(labels, logits)
      # Divide by the *global* batch: the all-reduce SUM of replica gradients is then the
      # gradient of the mean loss over the whole batch, whatever the replica count.
      loss = tf.nn.compute_average_loss(per_example, sample_weight=mask,
                                        global_batch_size=self.global_batch)
      if self.model.losses:
        loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
      scaled = self.optimizer.scale_loss(loss) if hasattr(self.optimizer, "scale_loss") else loss
    grads = tape.gradient(scaled, self.model.trainable_variables)
    return grads, self._sums(labels, logits, per_example, mask)

  def _train_step(self, batch, totals):
    images, labels, mask = batch
    grads, sums = self._forward_backward(images, labels, mask)
    if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
      grads = compat.agree_on_finite_gradients(grads)
    # Keras' TF optimizer all-reduces (SUM) the gradients across replicas in apply_gradients.
    self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
    return totals + sums

  def _eval_step(self, batch, totals):
    images, labels, mask = batch
    logits = self.model(images, training=False)
    return totals + self._sums(labels, logits, self._per_example_loss(labels, logits), mask)

  # ---- compiled loops ------------------------------------------------------------------------

  def _make_train_loop(self):
    strategy = self.strategy

    @tf.function
    def train_loop(iterator, num_steps, stop_flag):
      totals = strategy.run(lambda: tf.zeros(4))
      for _ in tf.range(num_steps):
        totals = strategy.run(self._train_step_with_flag, args=(next(iterator), totals))
      self._step.assign_add(tf.cast(num_steps, tf.int64))
      # BatchNorm statistics drift per replica in Keras 3: average them once per loop, so
      # evaluation, checkpoints and export always see one value (see compat.py).
      strategy.run(lambda: compat.average_across_replicas(self._replica_local))
      totals = strategy.run(lambda t: t + tf.stack([0.0, 0.0, 0.0, stop_flag]), args=(totals,))
      return strategy.reduce(tf.distribute.ReduceOp.SUM, totals, axis=None)

    return train_loop

  def _train_step_with_flag(self, batch, totals):
    return tf.concat([self._train_step(batch, totals[:3]), totals[3:]], axis=0)

  def _make_eval_loop(self):
    strategy = self.strategy

    @tf.function
    def eval_loop(iterator, num_steps):
      totals = strategy.run(lambda: tf.zeros(3))
      for _ in tf.range(num_steps):
        totals = strategy.run(self._eval_step, args=(next(iterator), totals))
      return strategy.reduce(tf.distribute.ReduceOp.SUM, totals, axis=None)

    return eval_loop

  # ---- checkpoints ---------------------------------------------------------------------------

  @property
  def global_step(self) -> int:
    return int(self._step.numpy())

  def restore(self) -> int:
    """Restores the newest checkpoint in model_dir (every worker reads the chief's)."""
    latest = tf.train.latest_checkpoint(self.write_plan.restore_dir)
    if latest:
      self.checkpoint.restore(latest).assert_existing_objects_matched()
      logging.info("resumed from %s at step %d", latest, self.global_step)
    return self.global_step

  def save(self) -> None:
    # Every worker saves (variables may need collectives); only the chief's copy is kept.
    self.manager.save(checkpoint_number=self.global_step)

  # ---- public loops --------------------------------------------------------------------------

  def run_steps(self, iterator, num_steps: int, stop_requested: bool = False
                ) -> tuple[LoopResult, bool]:
    """Runs num_steps training steps (one compiled call) from a distributed iterator. Returns
    their summed metrics and whether any worker asked to stop (agreed by the all-reduce)."""
    sums = self._train_loop(iterator, tf.constant(num_steps),
                            tf.constant(float(stop_requested))).numpy()
    return LoopResult(*map(float, sums[:3])), bool(sums[3] > 0)

  def evaluate(self, dist_dataset, steps: int) -> LoopResult:
    sums = self._eval_loop(iter(dist_dataset), tf.constant(steps)).numpy()
    return LoopResult(*map(float, sums))

  def train(self, train_dataset_fn, eval_dataset=None, eval_steps: int = 0) -> dict:
    """Trains from the restored step to total_steps. Returns the last epoch's metrics."""
    trainer_cfg = self.config.trainer
    start = self.global_step
    if start >= self.total_steps:
      logging.info("already trained: step %d of %d", start, self.total_steps)
      return {}
    iterator = iter(train_dataset_fn(start))
    # Kept alive on purpose: destroying it after a long run stalled TF 2.21 here for about a
    # minute (end of CIFAR-10 runs: ~RootDataset::Iterator waiting on tf.data's autotune thread),
    # before the model was exported. The apps leave with os._exit once every output is written.
    self._train_iterator = iterator
    stop = _StopRequest(self.config.runtime.checkpoint_on_preemption)
    writer = (tf.summary.create_file_writer(self.write_plan.path("train")) if self.write_plan.is_chief
              else tf.summary.create_noop_writer())
    eval_writer = (tf.summary.create_file_writer(self.write_plan.path("eval"))
                   if self.write_plan.is_chief and eval_dataset is not None
                   else tf.summary.create_noop_writer())
    step, last_row = start, {}
    try:
      while step < self.total_steps:
        epoch = step // self.steps_per_epoch
        epoch_end = min((epoch + 1) * self.steps_per_epoch, self.total_steps)
        epoch_totals, epoch_start_time, epoch_images = LoopResult(), time.time(), 0
        bar = keras.utils.Progbar(epoch_end - epoch * self.steps_per_epoch,
                                  stateful_metrics=["loss", "acc", "img/s", "lr"],
                                  verbose=1 if self.verbose else 0)
        if self.verbose:
          print(f"Epoch {epoch + 1}/{math.ceil(self.total_steps / self.steps_per_epoch)}",
                flush=True)
        while step < epoch_end:
          n = min(trainer_cfg.steps_per_loop, epoch_end - step)
          if trainer_cfg.checkpoint_every_steps:
            next_ckpt = (step // trainer_cfg.checkpoint_every_steps + 1) * trainer_cfg.checkpoint_every_steps
            n = min(n, next_ckpt - step)
          t0 = time.time()
          loop, stop_agreed = self.run_steps(iterator, n, stop.requested)
          seconds = time.time() - t0
          step += n
          epoch_totals.add(loop)
          epoch_images += n * self.global_batch
          images_per_sec = n * self.global_batch / max(seconds, 1e-9)
          lr = float(self.schedule(step - 1))
          bar.update(step - epoch * self.steps_per_epoch,
                     values=[("loss", loop.loss), ("acc", loop.accuracy),
                             ("img/s", images_per_sec), ("lr", lr)])
          with writer.as_default(step=step):
            tf.summary.scalar("loss", loop.loss)
            tf.summary.scalar("accuracy", loop.accuracy)
            tf.summary.scalar("learning_rate", lr)
            tf.summary.scalar("images_per_sec", images_per_sec)
          if stop_agreed:  # some worker was asked to stop: all save at this same step
            self.save()
            name = signal.Signals(stop.signum).name if stop.signum else "a peer's SIGTERM"
            logging.warning("stop requested (%s): saved checkpoint at step %d", name, step)
            raise Preempted(step, stop.signum or signal.SIGTERM)
          if trainer_cfg.checkpoint_every_steps and step % trainer_cfg.checkpoint_every_steps == 0:
            self.save()
        epoch_seconds = time.time() - epoch_start_time
        row = {"epoch": epoch + 1, "step": step, "train_loss": epoch_totals.loss,
               "train_accuracy": epoch_totals.accuracy,
               "learning_rate": float(self.schedule(step - 1)),
               "images_per_sec": epoch_images / max(epoch_seconds, 1e-9),
               "epoch_seconds": epoch_seconds, **_memory_mb()}
        is_last = step >= self.total_steps
        if eval_dataset is not None and ((epoch + 1) % trainer_cfg.eval_every_epochs == 0 or is_last):
          result = self.evaluate(eval_dataset, eval_steps)
          row.update(eval_loss=result.loss, eval_accuracy=result.accuracy,
                     eval_examples=int(result.count))
          with eval_writer.as_default(step=step):
            tf.summary.scalar("loss", result.loss)
            tf.summary.scalar("accuracy", result.accuracy)
          if self.verbose:
            print(f"eval: loss {result.loss:.4f} accuracy {result.accuracy:.4f} "
                  f"({int(result.count)} examples)", flush=True)
        row["wall_time"] = time.time()
        outputs.append_metrics(self.write_plan, row)
        if not trainer_cfg.checkpoint_every_steps or step % trainer_cfg.checkpoint_every_steps:
          self.save()
        last_row = row
    finally:
      stop.restore()
      writer.flush()
      eval_writer.flush()
    return last_row
