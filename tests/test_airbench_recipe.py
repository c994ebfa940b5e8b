"""airbench's pieces ported to tfdp (configs/cifar10_airbench.yaml): lookahead, the BatchNorm-bias
learning-rate multiplier, Dirac initialization, translate test-time augmentation. Each is
checked against a reference written here from airbench's definition."""
import shutil
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import helpers  # pylint: disable=wrong-import-position
from test_multi_worker import EQUIVALENCE, probe_in_one_process, probe_two_workers  # pylint: disable=wrong-import-position
from tfdp import config as config_lib  # pylint: disable=wrong-import-position
from tfdp.core import data as data_lib  # pylint: disable=wrong-import-position
from tfdp.core import experiment  # pylint: disable=wrong-import-position
from tfdp.core import task as tasks  # pylint: disable=wrong-import-position
from tfdp.errors import ConfigError  # pylint: disable=wrong-import-position


@tasks.register_task("bn_regression")
class BatchNormRegression(tasks.Task):
  """y = x·w on a Dense-BatchNorm-Dense model: a BatchNorm beta for the multiplier to act on."""

  metric_names = ("loss",)

  def build_source(self, data):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(data.num_examples, 3)).astype(np.float32)
    y = (x @ np.array([1.5, -2.0, 0.5], np.float32)).astype(np.float32)
    return data_lib.Source([len(y)], lambda files: tf.data.Dataset.from_tensor_slices(
        {"x": x, "y": y}), "toy", info={})

  def preprocess(self, example, data, training, seed):
    return {"x": example["x"], "y": example["y"]}

  def build_model(self, source):
    import keras  # pylint: disable=g-import-not-at-top
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, use_bias=False),
                             keras.layers.BatchNormalization(momentum=0.5), keras.layers.Dense(1)])

  def model_inputs(self, batch):
    return batch["x"]

  def per_example_loss(self, batch, outputs):
    return tf.square(outputs[:, 0] - batch["y"])

  def metric_sums(self, batch, outputs, per_example_loss):
    return {"loss": (tf.reduce_sum(per_example_loss * batch["weight"]), tf.reduce_sum(batch["weight"]))}


BATCH, EXAMPLES, EPOCHS = 16, 64, 4  # 16 steps, in loops of 3: syncs cross the loop boundaries
TOY = (f"task.name=bn_regression,task.train_data.num_examples={EXAMPLES},"
       f"task.train_data.shuffle=false,trainer.global_batch_size={BATCH},trainer.epochs={EPOCHS},"
       "trainer.steps_per_loop=3,trainer.optimizer.weight_decay=0.01,"
       "trainer.learning_rate.base_lr=0.05,trainer.learning_rate.base_batch_size=16,"
       "runtime.strategy=default,trainer.export_model=false")


def reference_training(model, initial, schedule, config):
  """The same steps in plain Keras: SGD with beta's learning rate times the multiplier (its own
  optimizer), and airbench's lookahead loop written out."""
  import keras  # pylint: disable=g-import-not-at-top
  trainer, opt = config.trainer, config.trainer.optimizer
  model.set_weights(initial)
  variables = model.trainable_variables
  betas = [v for v in variables if "beta" in v.path]
  rest = [v for v in variables if "beta" not in v.path]

  class Scaled(keras.optimizers.schedules.LearningRateSchedule):
    def __call__(self, step):
      return opt.norm_bias_lr_multiplier * schedule(step)
  beta_sgd = keras.optimizers.SGD(Scaled(), momentum=opt.momentum, nesterov=opt.nesterov)
  rest_sgd = keras.optimizers.SGD(schedule, momentum=opt.momentum, nesterov=opt.nesterov,
                                  weight_decay=opt.weight_decay)
  rest_sgd.exclude_from_weight_decay(var_list=[v for v in rest if len(v.shape) <= 1])
  rng = np.random.default_rng(0)
  x = rng.normal(size=(EXAMPLES, 3)).astype(np.float32)
  y = x @ np.array([1.5, -2.0, 0.5], np.float32)
  total = EPOCHS * EXAMPLES // BATCH
  slow = [np.asarray(v) for v in variables]
  for step in range(1, total + 1):
    start = (step - 1) * BATCH % EXAMPLES
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x[start:start + BATCH], training=True)[:, 0]
                                      - y[start:start + BATCH]))
    grads = dict(zip((id(v) for v in variables), tape.gradient(loss, variables)))
    beta_sgd.apply_gradients([(grads[id(v)], v) for v in betas])
    rest_sgd.apply_gradients([(grads[id(v)], v) for v in rest])
    every = trainer.lookahead_every_steps
    if every and step % every == 0:
      decay = trainer.lookahead_decay ** every * (step / total) ** 3
      slow = [s + (1 - decay) * (np.asarray(v) - s) for s, v in zip(slow, variables)]
      for v, s in zip(variables, slow):
        v.assign(s)
    if every and step == total:
      for v, s in zip(variables, slow):
        v.assign(s)
  return [np.asarray(v) for v in model.weights]


def max_difference(a, b) -> float:
  """max over variables (in model order) of max|a - b| / max|b|."""
  return max(float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-12)) for x, y in zip(a, b))


@pytest.mark.parametrize("piece", ["trainer.lookahead_every_steps=5",
                                   "trainer.optimizer.norm_bias_lr_multiplier=8"])
def test_lookahead_and_the_batchnorm_bias_multiplier_follow_their_definitions(tmp_path, piece):
  """tfdp's loop against plain Keras steps: the multiplier is exactly beta's learning rate times
  8 under Nesterov momentum and a changing (cosine) rate, weight decay unchanged; lookahead is
  airbench's rule, the final weights the slow ones."""
  import keras  # pylint: disable=g-import-not-at-top
  config = config_lib.load_config([], [f"{TOY},{piece}"])
  exp = experiment.build(config, str(tmp_path), "train", verbose=False)
  model = exp.trainer.model
  initial = [np.asarray(v) for v in model.weights]
  exp.run()
  trained = [np.asarray(v) for v in model.weights]
  expected = reference_training(keras.models.clone_model(model), initial,
                                exp.trainer.schedule, config)
  assert max_difference(trained, expected) <= 1e-5
  plain = reference_training(keras.models.clone_model(model), initial, exp.trainer.schedule,
                             config_lib.load_config([], [TOY]))
  assert max_difference(trained, plain) > 1e-3  # the piece changes training


LOOKAHEAD = (f"{EQUIVALENCE},trainer.epochs=2,trainer.lookahead_every_steps=5,"
             "trainer.checkpoint_every_steps=7,trainer.max_checkpoints=20")


def test_lookahead_resumed_mid_run_and_on_two_workers_equals_one_uninterrupted_run(tmp_path):
  """2 epochs of 21 steps on 2 replicas, a checkpoint every 7: resuming from step 14 (slow and
  fast weights apart: the last sync was at step 10) on two workers of one replica each ends
  where the uninterrupted one-process run ends, and both workers end there, bitwise alike.
  (One resumed run on two workers: a resumed one-process run and a 2-worker run from step 0
  before, one launch more for the same two properties.)"""
  whole = probe_in_one_process(tmp_path, LOOKAHEAD)
  assert whole["info"]["step"] == 42
  run = tmp_path / "run_one" / "checkpoints"
  resumed_dir = tmp_path / "run_mw"  # probe_two_workers' model_dir
  shutil.copytree(tmp_path / "run_one", resumed_dir)
  for path in (resumed_dir / "checkpoints").glob("ckpt-*"):
    if int(path.name.split(".")[0].split("-")[1]) > 14:
      path.unlink()
  (resumed_dir / "checkpoints" / "checkpoint").write_text(
      'model_checkpoint_path: "ckpt-14"\nall_model_checkpoint_paths: "ckpt-14"\n')
  assert (run / "ckpt-42.index").exists()
  w0, w1, out = probe_two_workers(tmp_path, LOOKAHEAD)
  assert "at step 14" in out, out[-3000:]  # resumed there, not trained from step 0
  assert w0["info"]["step"] == w1["info"]["step"] == 42
  assert all(np.array_equal(w0["final"][k], w1["final"][k]) for k in w0["final"])
  assert helpers.max_relative_difference(w0["final"], whole["final"]) <= 1e-5


def test_dirac_initialization_passes_each_input_channel_through():
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.vision import models  # pylint: disable=g-import-not-at-top
  for dirac in (True, False):
    with warnings.catch_warnings():  # NumPy 2's DeprecationWarning on np.array(a variable)
      warnings.simplefilter("error", DeprecationWarning)
      model = models.build_model("airbench", (16, 16, 3), 10, widths=(8, 16, 16),
                                 dirac_init=dirac)
    convs = [l for l in model.layers if isinstance(l, keras.layers.Conv2D)
             and l.kernel_size == (3, 3)]
    assert len(convs) == 6
    for conv in convs:
      channels = conv.input.shape[-1]
      x = tf.random.stateless_normal((2, 6, 6, channels), seed=(3, 4))
      y = np.asarray(conv(x))
      shared = min(channels, conv.filters)
      assert np.allclose(y[..., :shared], np.asarray(x)[..., :shared], atol=1e-6) == dirac
      assert np.std(y[..., shared:]) > 0 if shared < conv.filters else True  # the rest random


def test_translate_tta_weights_airbench_views_and_bad_values_are_one_line_errors():
  import keras  # pylint: disable=g-import-not-at-top
  images = tf.random.stateless_uniform((3, 5, 6, 2), seed=(1, 2))
  model = keras.Sequential([keras.Input((5, 6, 2)), keras.layers.Flatten(), keras.layers.Dense(3)])
  logits = lambda x: np.asarray(model(np.ascontiguousarray(x)), np.float64)

  def task(**overrides):
    config = config_lib.load_config([], [",".join(f"task.{k}={v}" for k, v in overrides.items())])
    return tasks.make_task(config.task)
  padded = np.pad(images.numpy(), [(0, 0), (1, 1), (1, 1), (0, 0)], mode="reflect")
  shifted = (padded[:, :5, :6], padded[:, 2:, 2:])  # airbench: [0:32, 0:32] and [2:34, 2:34]
  mirror = lambda x: (logits(x) + logits(x[:, :, ::-1])) / 2
  expected = 0.5 * mirror(images.numpy()) + 0.25 * (mirror(shifted[0]) + mirror(shifted[1]))
  both = task(eval_flip="true", eval_translate=1).eval_outputs(model, {"image": images})
  np.testing.assert_allclose(both, expected, rtol=1e-5, atol=1e-6)
  alone = task(eval_translate=1).eval_outputs(model, {"image": images})
  np.testing.assert_allclose(alone, 0.5 * logits(images) + 0.25 * (logits(shifted[0])
                                                                  + logits(shifted[1])),
                             rtol=1e-5, atol=1e-6)
  assert not np.allclose(both, mirror(images.numpy()), atol=1e-4)  # the shifts count
  source = data_lib.Source([4], None, "images", num_classes=3, image_shape=(5, 6, 2))
  with pytest.raises(ConfigError, match=r"'task.eval_translate' is 5, but the images are 5x6; "
                                        r"use fewer pixels than a side"):
    task(eval_translate=5).build_model(source)  # before training: reflect padding would fail
  for override, words in (("task.eval_translate=-1", ["task.eval_translate", ">= 0"]),
                          ("task.name=masked_lm,task.eval_translate=1", ["eval_translate=0"]),
                          ("trainer.lookahead_decay=0", ["trainer.lookahead_decay", "(0, 1]"]),
                          ("trainer.lookahead_every_steps=-5", ["lookahead_every_steps"]),
                          ("trainer.optimizer.name=adam,trainer.optimizer.norm_bias_lr_multiplier=64",
                           ["norm_bias_lr_multiplier", "name=sgd"])):
    with pytest.raises(ConfigError) as error:
      config_lib.load_config([], [override])
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_batchnorm_scale_false_fixes_every_scale_at_one_as_airbench_does():
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.vision import models  # pylint: disable=g-import-not-at-top
  x = tf.random.stateless_normal((8, 16, 16, 3), seed=(5, 6)) * 3.0 + 1.0
  for learned in (True, False):
    model = models.build_model("airbench", (16, 16, 3), 10, widths=(8, 16, 16),
                               batchnorm_scale=learned)
    norms = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
    assert len(norms) == 6 and all(l.epsilon == 1e-12 for l in norms)
    scales = [v for v in model.trainable_variables if "gamma" in v.path]
    betas = [v for v in model.trainable_variables if "beta" in v.path]
    assert (len(scales), len(betas)) == ((6, 6) if learned else (0, 6))
    for layer in norms:  # a scale of 2 would double each channel's spread; fixed: always unit
      if learned:
        layer.gamma.assign(tf.fill(layer.gamma.shape, 2.0))
      probe = keras.Model(model.input, layer.output)
      spread = np.std(np.asarray(probe(x, training=True)), axis=(0, 1, 2))
      np.testing.assert_allclose(spread, 2.0 if learned else 1.0, rtol=1e-3)


def test_torch_default_init_draws_each_kernel_within_one_over_root_fan_in():
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.vision import models  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(7)
  model = models.build_model("airbench", (16, 16, 3), 10, widths=(8, 16, 16),
                             torch_default_init=True)
  kernels = [l.kernel for l in model.layers if isinstance(l, (keras.layers.Conv2D,
                                                              keras.layers.Dense))][1:]  # not the stem
  assert len(kernels) == 7
  for kernel in kernels:
    values = np.asarray(kernel)
    bound = 1.0 / np.sqrt(np.prod(values.shape[:-1]))  # PyTorch: uniform(+-1/sqrt(fan_in))
    assert np.abs(values).max() <= bound and np.abs(values).max() > 0.9 * bound
    assert abs(np.var(values) - bound ** 2 / 3) < 0.2 * bound ** 2 / 3
  same_shape = [np.asarray(k) for k in kernels if tuple(k.shape) == (3, 3, 16, 16)]
  assert len(same_shape) == 3 and not np.allclose(same_shape[0], same_shape[1])  # not one draw


def test_head_init_std_starts_the_head_uniform_at_that_spread():
  """airbench94_muon's head: PyTorch's init rescaled to std 1 (with logit_scale 1/256)."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.vision import models  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(7)
  model = models.build_model("airbench", (16, 16, 3), 10, widths=(8, 16, 64),
                             torch_default_init=True, head_init_std=1.0)
  head = np.asarray([l for l in model.layers if isinstance(l, keras.layers.Dense)][0].kernel)
  assert head.shape == (64, 10)
  assert abs(head.std() - 1.0) < 0.1 and np.abs(head).max() <= 3 ** 0.5


def test_a_negative_head_init_std_is_refused_in_one_line():
  """It was ignored: the head started as the convs do, as if 0 had been given."""
  from tfdp.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.vision import models  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match="head_init_std must be >= 0") as raised:
    models.build_model("airbench", (16, 16, 3), 10, widths=(8, 16, 64), head_init_std=-1.0)
  assert "\n" not in str(raised.value)
