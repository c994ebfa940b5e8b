"""trainer.optimizer.name=muon (tfdp/core/muon.py): airbench94_muon's optimizer, checked against
the algebra it claims: Newton-Schulz on the singular values, Muon's step at a fixed filter norm,
and PyTorch's SGD on a summed loss with coupled decay for everything else."""
import numpy as np
import pytest
import tensorflow as tf

from tfdp.core import muon

A, B, C = muon.NEWTON_SCHULZ


def quintic(s, steps):
  """What the iteration does to each singular value of the Frobenius-normalized matrix."""
  for _ in range(steps):
    s = A * s + B * s ** 3 + C * s ** 5
  return s


@pytest.mark.parametrize("shape", [(3, 3, 8, 16), (3, 3, 4, 64), (12, 10), (10, 12)])
def test_newton_schulz_maps_each_singular_value_and_keeps_the_singular_vectors(shape):
  """Wide and tall flattenings ([fan_in, out]) alike: U p(S / |G|_F) V^T."""
  rng = np.random.default_rng(0)
  update = rng.normal(size=shape).astype(np.float32)
  got = muon.orthogonalized(tf.constant(update), steps=3).numpy()
  assert got.shape == shape
  matrix = update.reshape(-1, shape[-1]).astype(np.float64)
  u, s, vt = np.linalg.svd(matrix, full_matrices=False)
  expected = u @ np.diag(quintic(s / np.linalg.norm(matrix), 3)) @ vt
  np.testing.assert_allclose(got.reshape(-1, shape[-1]), expected, atol=2e-5)
  # Orthogonalized, roughly: no direction keeps the gradient's spread of scales.
  kept = np.linalg.svd(got.reshape(-1, shape[-1]), compute_uv=False)
  assert kept.max() < 1.6 and kept.max() / kept.min() < s.max() / s.min()


def make(var_shapes, global_batch=4, **kwargs):
  variables = [tf.Variable(np.random.default_rng(i).normal(size=s).astype(np.float32))
               for i, s in enumerate(var_shapes)]
  optimizer = muon.Muon(0.5, global_batch, filter_lr=0.24, head_lr=0.67, bias_lr=0.053,
                        momentum=0.85, filter_momentum=0.6, weight_decay=0.004, **kwargs)
  optimizer.build(variables)
  return optimizer, variables


def test_a_filter_steps_along_the_orthogonalized_nesterov_momentum_at_a_fixed_norm():
  optimizer, (kernel,) = make([(3, 3, 4, 8)])
  rng = np.random.default_rng(7)
  grads = [rng.normal(size=(3, 3, 4, 8)).astype(np.float32) for _ in range(2)]
  weight, buffer = kernel.numpy().astype(np.float64), 0.0
  for grad in grads:
    optimizer.apply_gradients([(tf.constant(grad), kernel)])
    buffer = 0.6 * buffer + grad
    nesterov = grad + 0.6 * buffer
    weight = weight * np.sqrt(8) / np.linalg.norm(weight)  # sqrt(out channels)
    direction = muon.orthogonalized(tf.constant(nesterov.astype(np.float32))).numpy()
    weight = weight - 0.5 * 0.24 * direction
    np.testing.assert_allclose(kernel.numpy(), weight, rtol=1e-5, atol=1e-6)


def test_the_rest_is_pytorchs_sgd_on_the_summed_loss_with_coupled_decay():
  """airbench94_muon.py: SGD(lr, momentum 0.85, nesterov, weight_decay=wd/lr) on a loss summed
  over the batch; tfdp's gradient is the batch mean, so the sum is that times the global batch."""
  optimizer, (head, bias) = make([(6, 10), (10,)], global_batch=4)
  rng = np.random.default_rng(3)
  expected = {"head": (head.numpy().astype(np.float64), 0.67, 0.0),
              "bias": (bias.numpy().astype(np.float64), 0.053, 0.0)}
  for _ in range(3):
    grads = {"head": rng.normal(size=(6, 10)), "bias": rng.normal(size=(10,))}
    optimizer.apply_gradients([(tf.constant(grads["head"], tf.float32), head),
                               (tf.constant(grads["bias"], tf.float32), bias)])
    for key, (weight, lr, buffer) in expected.items():
      summed = grads[key] * 4 + (0.004 / lr) * weight
      buffer = 0.85 * buffer + summed
      expected[key] = (weight - 0.5 * lr * (summed + 0.85 * buffer), lr, buffer)
  np.testing.assert_allclose(head.numpy(), expected["head"][0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(bias.numpy(), expected["bias"][0], rtol=1e-5, atol=1e-6)


def test_muon_on_a_model_without_conv_filters_is_a_one_line_error():
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.config.schema import OptimizerConfig  # pylint: disable=g-import-not-at-top
  from tfdp.core import optim  # pylint: disable=g-import-not-at-top
  from tfdp.errors import ConfigError  # pylint: disable=g-import-not-at-top
  dense = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)], name="mlp")
  with pytest.raises(ConfigError, match="model 'mlp' has no trainable kernel of rank 3") as error:
    optim.make_optimizer(OptimizerConfig(name="muon"), 1.0, dense, global_batch=8)
  assert "\n" not in str(error.value) and "use sgd or adamw" in str(error.value)
  conv = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3)])
  assert isinstance(optim.make_optimizer(OptimizerConfig(name="muon"), 1.0, conv, global_batch=8),
                    muon.Muon)


@pytest.mark.parametrize("depthwise", ["DepthwiseConv2D", "SeparableConv2D"])
def test_muon_on_a_depthwise_kernel_is_a_one_line_error(depthwise):
  """A depthwise kernel [k, k, in, 1] flattened to [k*k*in, 1] took Muon's step as one unit
  vector, silently. Seen failing (no error) before make_optimizer looked for them."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.config.schema import OptimizerConfig  # pylint: disable=g-import-not-at-top
  from tfdp.core import optim  # pylint: disable=g-import-not-at-top
  from tfdp.errors import ConfigError  # pylint: disable=g-import-not-at-top
  layer = getattr(keras.layers, depthwise)
  args = (3,) if depthwise == "DepthwiseConv2D" else (4, 3)
  model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3),
                            layer(*args, name="dw")])
  with pytest.raises(ConfigError, match="depthwise kernel of layer 'dw'") as error:
    optim.make_optimizer(OptimizerConfig(name="muon"), 1.0, model, global_batch=8)
  assert "\n" not in str(error.value) and "use sgd or adamw" in str(error.value)


def test_muons_schedule_is_each_rates_fraction_whatever_the_batch():
  """Its rates are per batch already (a summed loss; a scale-free filter step): a batch override
  (runlocal.yaml's 128) must not scale them again, as the linear rule does for sgd."""
  from tfdp.config import schema  # pylint: disable=g-import-not-at-top
  from tfdp.core import optim  # pylint: disable=g-import-not-at-top
  LearningRateConfig, OptimizerConfig = schema.LearningRateConfig, schema.OptimizerConfig
  lr = LearningRateConfig(base_lr=1.0, base_batch_size=2000, schedule="linear")
  for batch in (128, 2000, 4000):
    schedule = optim.make_schedule(lr, batch, 10, 100, OptimizerConfig(name="muon"))
    assert float(schedule(0)) == 1.0 and float(schedule(50)) == pytest.approx(0.5)
  sgd = optim.make_schedule(lr, 128, 10, 100, OptimizerConfig(name="sgd"))
  assert float(sgd(0)) == pytest.approx(128 / 2000)
