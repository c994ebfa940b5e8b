"""Learning-rate schedules and optimizers from config: linear scaling, warmup, decay; weight decay
that skips biases and normalization; the optimizer's own all-reduce switched off (the trainer
reduces once, then clips and applies).
"""
from __future__ import annotations

import math

import keras
import tensorflow as tf

from tfdp.config.schema import LearningRateConfig, OptimizerConfig
from tfdp.core import model_walk
from tfdp.core import muon
from tfdp.distributed import compat
from tfdp.errors import ConfigError


class WarmupDecaySchedule(keras.optimizers.schedules.LearningRateSchedule):
  """Linear warmup to `peak_lr`, then constant, cosine, linear or step decay."""

  def __init__(self, peak_lr, warmup_steps, total_steps, schedule="cosine", boundaries=(),
               decay_rate=0.1, final_lr_fraction=0.0, power=1.0):
    self.peak_lr = float(peak_lr)
    self.warmup_steps = int(warmup_steps)
    self.total_steps = max(int(total_steps), 1)
    self.schedule = schedule
    self.boundaries = [int(b) for b in boundaries]
    self.decay_rate = float(decay_rate)
    self.final_lr_fraction = float(final_lr_fraction)
    self.power = float(power) if schedule == "polynomial" else 1.0

  def __call__(self, step):
    step = tf.cast(step, tf.float32)
    peak = tf.constant(self.peak_lr, tf.float32)
    final = peak * self.final_lr_fraction
    decay_len = float(max(self.total_steps - self.warmup_steps, 1))
    progress = tf.clip_by_value((step - self.warmup_steps) / decay_len, 0.0, 1.0)
    if self.schedule == "cosine":
      lr = final + (peak - final) * 0.5 * (1.0 + tf.cos(math.pi * progress))
    elif self.schedule in ("linear", "polynomial"):
      lr = final + (peak - final) * tf.pow(1.0 - progress, self.power)
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
            "final_lr_fraction": self.final_lr_fraction, "power": self.power}


def scaled_learning_rate(base_lr: float, global_batch_size: int, base_batch_size: int) -> float:
  """The linear scaling rule (Goyal et al. 2017): lr grows with the global batch."""
  return base_lr * global_batch_size / base_batch_size


def make_schedule(lr: LearningRateConfig, global_batch: int, steps_per_epoch: int,
                  total_steps: int, optimizer: OptimizerConfig | None = None
                  ) -> WarmupDecaySchedule:
  """muon's schedule is a fraction of its rates, which are per batch already (its SGD part sums
  the loss, its filter step is scale-free): base_lr is not scaled with the batch there."""
  fraction = optimizer is not None and optimizer.name == "muon"
  return WarmupDecaySchedule(
      lr.base_lr if fraction else scaled_learning_rate(lr.base_lr, global_batch,
                                                       lr.base_batch_size),
      warmup_steps=round(lr.warmup_epochs * steps_per_epoch), total_steps=total_steps,
      schedule=lr.schedule, boundaries=[round(e * steps_per_epoch) for e in lr.decay_epochs],
      decay_rate=lr.decay_rate, final_lr_fraction=lr.final_lr_fraction, power=lr.power)


DEPTHWISE_LAYERS = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D,
                    keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)


def make_optimizer(opt: OptimizerConfig, learning_rate, model, mixed_float16: bool = False,
                   ema_decay: float = 0.0, global_batch: int = 0):
  """Call inside strategy.scope(). Weight decay skips biases and normalization parameters.
  ema_decay > 0 keeps Keras's moving average of the weights in the optimizer, so checkpoints
  carry it. (Its `ema_overwrite_frequency`, a lookahead, fails under MirroredStrategy: a
  merge_call inside a cond; tfdp's own is `Lookahead` below.) `global_batch`: muon's SGD part
  steps on the loss summed over it, as airbench's."""
  wd = opt.weight_decay or None
  ema = {"use_ema": True, "ema_momentum": ema_decay} if ema_decay else {}
  if opt.name == "sgd":
    optimizer = keras.optimizers.SGD(learning_rate, momentum=opt.momentum, nesterov=opt.nesterov,
                                     weight_decay=wd, **ema)
  elif opt.name == "muon":
    if not any(muon.is_filter(v) for v in model.trainable_variables):
      raise ConfigError(
          f"trainer.optimizer.name=muon is airbench94_muon's, Muon on conv filters, and model "
          f"'{model.name}' has no trainable kernel of rank 3 or more; use sgd or adamw (or "
          "tfdp.fit with keras.optimizers.Muon, which takes dense matrices).")
    depthwise = [layer.name for layer in model_walk.every_layer(model)
                 if isinstance(layer, DEPTHWISE_LAYERS) and layer.trainable]
    if depthwise:  # a [k, k, in, 1] kernel as a [k*k*in, 1] matrix: its step a unit vector
      raise ConfigError(
          f"trainer.optimizer.name=muon steps each conv kernel as a [fan_in, out channels] "
          f"matrix, which the depthwise kernel of layer '{depthwise[0]}' is not; use sgd or "
          "adamw for this model.")
    optimizer = muon.Muon(learning_rate, global_batch, filter_lr=opt.filter_lr,
                          head_lr=opt.head_lr, bias_lr=opt.bias_lr, momentum=opt.momentum,
                          filter_momentum=opt.filter_momentum, weight_decay=opt.weight_decay,
                          **ema)
    wd = None  # its own decay, coupled, on every variable but the filters
  elif opt.name == "adamw":
    optimizer = keras.optimizers.AdamW(learning_rate, weight_decay=opt.weight_decay,
                                       beta_1=opt.beta_1, beta_2=opt.beta_2, epsilon=opt.epsilon,
                                       **ema)
  elif opt.name == "adagrad":  # sparse-friendly: updates only the embedding rows a batch touches
    optimizer = keras.optimizers.Adagrad(learning_rate, epsilon=opt.epsilon, weight_decay=wd,
                                         **ema)
  elif opt.name == "lamb":  # layer-wise trust ratio: large-batch BERT (You et al. 2019)
    optimizer = keras.optimizers.Lamb(learning_rate, beta_1=opt.beta_1, beta_2=opt.beta_2,
                                      epsilon=opt.epsilon, weight_decay=wd, **ema)
  else:
    optimizer = keras.optimizers.Adam(learning_rate, beta_1=opt.beta_1, beta_2=opt.beta_2,
                                      epsilon=opt.epsilon, weight_decay=wd, **ema)
  if wd or opt.name == "adamw":
    optimizer.exclude_from_weight_decay(
        var_list=[v for v in model.trainable_variables if len(v.shape) <= 1])
  if mixed_float16:
    optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
  optimizer.build(model.trainable_variables)
  compat.skip_optimizer_all_reduce(optimizer)  # the trainer all-reduces, then clips and applies
  return optimizer


def check_compiled_optimizer(optimizer) -> None:
  """A compiled optimizer's settings that Keras applies inside a cond holding a merge_call,
  which tf.distribute refuses while tracing ("merge_call called while defining a new graph"):
  one line up front instead, naming what does the same."""
  optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # under a LossScaleOptimizer
  steps = getattr(optimizer, "gradient_accumulation_steps", None)
  if steps:
    raise ConfigError(
        f"the optimizer's gradient_accumulation_steps={steps} cannot run under "
        "tf.distribute (Keras applies it in a cond that needs a merge_call); drop it from the "
        f"optimizer and pass a batch_size {steps}x larger with params={{'trainer': "
        f"{{'gradient_accumulation_steps': {steps}}}}}: each step then takes the mean gradient "
        f"of {steps} batches, as Keras's (a learning-rate schedule counts those steps, where "
        "Keras's counts batches).")
  every = getattr(optimizer, "ema_overwrite_frequency", None)
  if getattr(optimizer, "use_ema", False) and every:
    raise ConfigError(
        f"the optimizer's ema_overwrite_frequency={every} cannot run under "
        "tf.distribute (Keras overwrites the weights in a cond that needs a merge_call); drop "
        "it: use_ema=True alone still ends fit with the weights' moving average, as model.fit "
        "does.")


def adopt_optimizer(optimizer, model):
  """A user's compiled optimizer (tfdp.fit), used as it is: built for the model's variables and
  with its own all-reduce off while tfdp trains (compat.restore_optimizer_all_reduce gives it
  back afterwards). Call inside strategy.scope()."""
  check_compiled_optimizer(optimizer)
  if not optimizer.built:  # as Keras's fit: LossScaleOptimizer.build has no guard of its own
    optimizer.build(model.trainable_variables)  # (a second scale and step counter, reset)
  compat.skip_optimizer_all_reduce(optimizer)
  return optimizer


class Lookahead(tf.Module):
  """airbench's lookahead (Zhang et al. 2019): slow copies of the trainable weights; after every
  `every` steps, slow += (1 - d) * (weights - slow) and the weights restart from slow, with
  d = decay ** every * (step / total_steps) ** 3 (airbench: 0.95 ** 5 * progress ** 3), and after
  the last step the weights are the slow ones. Runs in cross-replica context (the train loop's
  body, outside strategy.run): every copy of a mirrored weight is equal on every replica and
  worker, so each assigns the same values with no collective (Keras's ema_overwrite_frequency
  needs a merge_call inside a cond, which MirroredStrategy refuses). Make inside
  strategy.scope(); the checkpoint carries `slow`."""

  def __init__(self, weights, every: int, decay: float, total_steps: int):
    super().__init__(name="lookahead")
    self.weights = list(weights)
    self.every, self.decay, self.total_steps = int(every), float(decay), max(int(total_steps), 1)
    self.slow = [tf.Variable(tf.identity(w.value), trainable=False, name="slow")
                 for w in self.weights]

  def start(self, step) -> None:
    """At step 0 the slow weights are the weights (after any warm start); later, a checkpoint's."""
    def copy():
      for slow, weight in zip(self.slow, self.weights):
        slow.assign(weight.value)
      return tf.constant(0)
    tf.cond(tf.equal(step, 0), copy, lambda: tf.constant(0))

  def after_step(self, step) -> None:
    """`step`: the global step just taken (1 after the first)."""
    step = tf.cast(step, tf.int64)
    sync = tf.equal(step % self.every, 0)
    last = step >= self.total_steps

    def update():
      progress = tf.cast(step, tf.float32) / float(self.total_steps)
      decay = tf.where(sync, self.decay ** self.every * progress ** 3, 1.0)
      for slow, weight in zip(self.slow, self.weights):
        slow.assign_add((1.0 - decay) * (weight.value - slow))
        weight.assign(slow)
      return tf.constant(0)
    tf.cond(tf.logical_or(sync, last), update, lambda: tf.constant(0))
