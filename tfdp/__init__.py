"""tfdp: data-parallel training of Keras 3 models with tf.distribute.

Importing tfdp does not start TensorFlow (configs and clusters are checked first).
"""
from tfdp.errors import TfdpError
from tfdp.models import register_model
from tfdp.tasks import Task, register_task


def fit(*args, **kwargs):
  """See tfdp.api.fit."""
  from tfdp import api  # pylint: disable=g-import-not-at-top
  return api.fit(*args, **kwargs)


def make_strategy(**runtime_overrides):
  """A tf.distribute strategy from runtime settings, e.g. make_strategy(cpu_replicas=2)."""
  from tfdp import config, strategy  # pylint: disable=g-import-not-at-top
  runtime = config.RuntimeConfig(**runtime_overrides)
  config.validate(config.ExperimentConfig(runtime=runtime))
  return strategy.make_strategy(runtime)[0]


__all__ = ["Task", "TfdpError", "fit", "make_strategy", "register_model", "register_task"]
