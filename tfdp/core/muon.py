"""airbench94_muon's optimizer (Keller Jordan 2024, "Muon: an optimizer for hidden layers"): conv
kernels take Muon's orthogonalized momentum step at a fixed weight norm; every other variable
takes PyTorch's SGD with Nesterov momentum and coupled weight decay, in airbench's units.
"""
from __future__ import annotations

import keras
import tensorflow as tf

# The quintic Newton-Schulz coefficients of airbench94_muon.py: steepest at zero, so 3 steps
# take every singular value to roughly 0.5-1.5 (not exactly 1, which does not hurt training).
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def is_filter(variable) -> bool:
  """A kernel of rank >= 3, a convolution's: the variables that take Muon's step."""
  return len(variable.shape) >= 3


def orthogonalized(update, steps: int = 3):
  """A matrix's nearest semi-orthogonal one, roughly (U S' V^T for U S V^T, S' ~ 0.5-1.5), by
  `steps` quintic Newton-Schulz iterations on its [out, fan_in] form (a kernel [..., out] is
  flattened to [fan_in, out] first; the transpose changes nothing: the iteration runs on the
  wide side)."""
  a, b, c = NEWTON_SCHULZ
  shape = update.shape
  x = tf.reshape(tf.cast(update, tf.float32), [-1, shape[-1]])
  wide = x.shape[0] <= x.shape[1]
  x = x if wide else tf.transpose(x)
  x = x / (tf.norm(x) + 1e-7)  # every singular value <= 1
  for _ in range(steps):
    gram = tf.matmul(x, x, transpose_b=True)
    x = a * x + tf.matmul(b * gram + c * tf.matmul(gram, gram), x)
  return tf.reshape(x if wide else tf.transpose(x), shape)


class Muon(keras.optimizers.Optimizer):
  """Muon on every filter (is_filter; out channels last, as Conv1D/2D/3D keep them; make_optimizer
  refuses a depthwise kernel): momentum m = mu m + g, Nesterov g + mu m, the kernel rescaled to
  Frobenius norm sqrt(out channels) (a scale BatchNorm ignores), then a step of `filter_lr` along
  the orthogonalized direction. Everything else (the head's kernel, biases, normalization) is
  PyTorch's SGD on the loss summed over the global batch (tfdp's mean gradient times
  `global_batch`), coupled decay `weight_decay` / lr per step, as airbench94_muon.py's two groups:
  `head_lr` for matrices, `bias_lr` for vectors. The schedule (`learning_rate`) is the fraction of
  each group's rate, 1 falling to 0 there."""

  def __init__(self, learning_rate, global_batch: int, filter_lr: float = 0.24,
               head_lr: float = 0.67, bias_lr: float = 0.053, momentum: float = 0.85,
               filter_momentum: float = 0.6, weight_decay: float = 0.004,
               newton_schulz_steps: int = 3, name="muon", **kwargs):
    if int(global_batch) < 1:  # its SGD part scales the mean gradient by it: 0 would stop it
      raise ValueError(f"Muon needs the global batch (examples per step), got {global_batch}")
    super().__init__(learning_rate, name=name, **kwargs)
    self.global_batch = int(global_batch)
    self.filter_lr, self.head_lr, self.bias_lr = float(filter_lr), float(head_lr), float(bias_lr)
    self.momentum, self.filter_momentum = float(momentum), float(filter_momentum)
    self.summed_weight_decay = float(weight_decay)  # not Keras's decoupled one (kept off)
    self.newton_schulz_steps = int(newton_schulz_steps)

  def build(self, var_list):
    if self.built:
      return
    super().build(var_list)
    self.momentums = [self.add_variable_from_reference(v, name="momentum") for v in var_list]

  def update_step(self, gradient, variable, learning_rate):
    fraction = tf.cast(learning_rate, variable.dtype)
    gradient = tf.cast(tf.convert_to_tensor(gradient), variable.dtype)  # IndexedSlices too
    buffer = self.momentums[self._get_variable_index(variable)]
    if is_filter(variable):
      mu = self.filter_momentum
      self.assign(buffer, mu * buffer + gradient)
      direction = orthogonalized(gradient + mu * buffer, self.newton_schulz_steps)
      norm = tf.sqrt(float(variable.shape[-1])) / (tf.norm(variable) + 1e-12)
      self.assign(variable, variable * norm - fraction * self.filter_lr * direction)
      return
    lr = self.head_lr if len(variable.shape) == 2 else self.bias_lr
    summed = gradient * float(self.global_batch) + (self.summed_weight_decay / lr) * variable
    self.assign(buffer, self.momentum * buffer + summed)
    self.assign_sub(variable, fraction * lr * (summed + self.momentum * buffer))

  def get_config(self):
    config = super().get_config()
    config.update(global_batch=self.global_batch, filter_lr=self.filter_lr,
                  head_lr=self.head_lr, bias_lr=self.bias_lr, momentum=self.momentum,
                  filter_momentum=self.filter_momentum, weight_decay=self.summed_weight_decay,
                  newton_schulz_steps=self.newton_schulz_steps)
    return config
