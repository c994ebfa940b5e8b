"""tfdp traces its graphs without autograph (tfdp/core/trainer.py), as Keras 3's trainer does:
autograph converted none of a workload's functions (converting them cost ~1.5 CPU s of every
process's start-up), and code that would need it fails in one line naming its line. (The masked
LM's probes in test_text_tasks check the text pipeline the same way.)"""
import numpy as np
import pytest

import helpers
from test_recommender import job as recommender_job, write_planted

tf = pytest.importorskip("tensorflow")

from tfdp import config as config_lib  # pylint: disable=wrong-import-position
from tfdp.core import experiment  # pylint: disable=wrong-import-position
from tfdp.core import task as tasks  # pylint: disable=wrong-import-position
from tfdp.distributed import compat  # pylint: disable=wrong-import-position
from tfdp.errors import ConfigError  # pylint: disable=wrong-import-position

# Everything tfdp traces for an image classifier: the whitened stem's sample map, augmentation,
# padding of a short last batch, gradient accumulation over 2 replicas, lookahead, the
# BatchNorm-bias multiplier, a weight average, PreciseBN and flip + translate evaluation.
AIRBENCH_EVERYTHING = ",".join([
    "task.model.name=airbench", "task.model.kwargs={widths: [4, 4, 4]}",
    "task.train_data.source=synthetic", "task.train_data.num_examples=72",
    "task.train_data.image_size=16", "task.train_data.num_classes=4",
    "task.train_data.augment=true", "task.eval_data.source=synthetic",
    "task.eval_data.num_examples=20", "task.eval_data.image_size=16",
    "task.eval_data.num_classes=4", "task.eval_flip=true", "task.eval_translate=1",
    "trainer.global_batch_size=16", "trainer.epochs=1", "trainer.steps_per_loop=2",
    "trainer.gradient_accumulation_steps=2", "trainer.lookahead_every_steps=2",
    "trainer.optimizer.norm_bias_lr_multiplier=4", "trainer.ema_decay=0.9",
    "trainer.precise_bn_batches=1", "trainer.export_model=false",
    "runtime.strategy=mirrored", "runtime.cpu_replicas=2",
])


@pytest.mark.parametrize("workload", ["image classification", "matrix factorization"])
def test_autograph_converts_nothing_a_workload_traces(tmp_path, workload):
  if workload == "image classification":
    overrides = AIRBENCH_EVERYTHING
  else:
    root = write_planted(tmp_path, users=20, per_user=10)
    overrides = recommender_job(root, extra=",trainer.epochs=1,trainer.global_batch_size=32")
  run = helpers.run_probe(tmp_path, "run", overrides, mode="train_and_eval")
  assert run["info"]["step"] > 0 and run["info"]["eval_after"]["examples"] > 0
  # Mutations seen: the train loop's @tf.function without autograph=False lists Trainer._sums
  # and the rest of the step; the dataset function without do_not_convert, data.py's lambdas.
  assert run["info"]["autograph"] == []


@tasks.register_task("needs_autograph_in_its_loss")
class NeedsAutographInItsLoss(tasks.Task):
  """A regression whose loss branches on a tensor with a Python `if`."""

  metric_names = ("loss",)

  def build_source(self, data):
    import tfdp.core.data as data_lib  # pylint: disable=g-import-not-at-top
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    return data_lib.Source([8], lambda files: tf.data.Dataset.from_tensor_slices(
        {"x": x, "y": x.sum(1)}), "toy", info={})

  def preprocess(self, example, data, training, seed):
    return example

  def build_model(self, source):
    import keras  # pylint: disable=g-import-not-at-top
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

  def model_inputs(self, batch):
    return batch["x"]

  def per_example_loss(self, batch, outputs):
    error = outputs[:, 0] - batch["y"]
    if tf.reduce_mean(error) > 0:  # the line the error names
      return tf.square(error)
    return tf.abs(error)

  def metric_sums(self, batch, outputs, per_example_loss):
    return {"loss": (tf.reduce_sum(per_example_loss * batch["weight"]),
                     tf.reduce_sum(batch["weight"]))}


def test_a_task_that_needs_autograph_fails_in_one_line_naming_its_line(tmp_path):
  config = config_lib.load_config([], [
      "task.name=needs_autograph_in_its_loss,task.train_data.num_examples=8,"
      "trainer.global_batch_size=4,trainer.epochs=1,trainer.export_model=false,"
      "runtime.strategy=default"])
  exp = experiment.build(config, str(tmp_path / "run"), "train", verbose=False)
  with pytest.raises(ConfigError) as raised:
    exp.run()
  message = str(raised.value)
  assert "test_autograph.py:" in message and "(per_example_loss)" in message, message
  assert "tf.cond" in message and "\n" not in message
  # Not by autograph: tfdp's own functions stayed unconverted in this process too.
  assert not [f for f in compat.autograph_converted_functions() if "/tfdp/" in f]
