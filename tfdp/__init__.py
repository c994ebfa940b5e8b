"""tfdp: data-parallel training of Keras 3 models with tf.distribute.

Importing tfdp does not start TensorFlow (configs and clusters are checked first); it turns
TensorFlow's oneDNN kernels on where TF would leave them off on an AVX2 CPU (strategy.enable_onednn).
"""
from tfdp.distributed import strategy as _strategy
_strategy.enable_onednn()
from tfdp.core.data import Source
from tfdp.core.task import Task, register_task
from tfdp.errors import TfdpError
from tfdp.workloads.vision.models import register_model


def fit(*args, **kwargs):
  """See tfdp.compiled.fit.fit: `tfdp.fit(model, x, y, batch_size=..., epochs=...)` takes what
  keras.Model.fit takes (a compiled model) and returns a keras.callbacks.History."""
  from tfdp import api  # pylint: disable=g-import-not-at-top
  return api.fit(*args, **kwargs)


def evaluate(*args, **kwargs):
  """See tfdp.compiled.predict.evaluate: Keras's evaluate, exact on any replica/worker count."""
  from tfdp.compiled import predict  # pylint: disable=g-import-not-at-top
  return predict.evaluate(*args, **kwargs)


def predict(*args, **kwargs):
  """See tfdp.compiled.predict.predict: one row per real example, in order, on every worker."""
  from tfdp.compiled import predict as predict_lib  # pylint: disable=g-import-not-at-top
  return predict_lib.predict(*args, **kwargs)


def train(*args, **kwargs):
  """See tfdp.api.train: a config-defined run (any task) in this process."""
  from tfdp import api  # pylint: disable=g-import-not-at-top
  return api.train(*args, **kwargs)


def plot_metrics(model_dir: str, path: str | None = None):
  """See tfdp.plots.plot_metrics: a run's metrics.csv drawn against epochs."""
  from tfdp import plots  # pylint: disable=g-import-not-at-top
  return plots.plot_metrics(model_dir, path)


def launch_notebook(train_fn, num_workers: int = 2, **kwargs):
  """See tfdp.notebook.launch_notebook: train_fn on N local workers, results gathered back."""
  from tfdp import notebook  # pylint: disable=g-import-not-at-top
  return notebook.launch_notebook(train_fn, num_workers, **kwargs)


def make_strategy(**runtime_overrides):
  """A tf.distribute strategy from runtime settings, e.g. make_strategy(cpu_replicas=2); with no
  arguments it picks as `runtime.strategy: auto` does. Called again with no arguments or the
  same ones (a notebook cell run twice, `with tfdp.make_strategy().scope():` after
  `tfdp.make_strategy(cpu_replicas=2)`), it returns the strategy made before. A refusal is one
  line starting `tfdp.make_strategy:`."""
  from tfdp import errors  # pylint: disable=g-import-not-at-top
  from tfdp.compiled import fit as fit_lib  # pylint: disable=g-import-not-at-top
  with errors.speaking_as(fit_lib.terms(caller="tfdp.make_strategy")):
    return _make_strategy(runtime_overrides)


def _make_strategy(runtime_overrides: dict):
  from tfdp import config, in_process, logs  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import cluster
  from tfdp.distributed import strategy
  import yaml  # pylint: disable=g-import-not-at-top
  # Through the config loader: a misspelt or mistyped setting gets its one line, naming the key.
  runtime = config.load_config(
      [], [yaml.safe_dump({"runtime": in_process.plain(runtime_overrides)})]).runtime
  made = strategy.last_made(None if not runtime_overrides else runtime)
  if made is not None:  # the devices are fixed once TensorFlow runs: the same strategy again
    return made
  logs.start_tensorflow()
  # The cluster too: under TF_CONFIG naming several workers (tfdp.launch_notebook, tfdp-launch)
  # `auto` is MultiWorkerMirroredStrategy.
  return strategy.make_strategy(runtime, cluster.resolve_cluster(), for_user=True)[0]


__all__ = ["Source", "Task", "TfdpError", "evaluate", "fit", "launch_notebook", "make_strategy",
           "plot_metrics", "predict", "register_model", "register_task", "train"]
