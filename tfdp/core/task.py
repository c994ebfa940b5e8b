"""Workloads as tasks: what a run reads, which model it trains, its loss and its metrics.

The trainer, input planning, checkpoints, outputs and the launcher know no workload; the task
tells them (TF Model Garden's `base_task.py`, without its weight):

  build_source(data)            raw examples of one split: a `tfdp.core.data.Source`
  preprocess(example, training, seed)
                                one raw example → the model's features and labels, fixed shapes
                                (a tf.data map; `seed` is stateless: (run seed, epoch, index))
  build_model(source)           a Keras model, called inside `strategy.scope()`
  per_example_loss(batch, outputs)
                                a [batch] loss, before the example weight
  metric_sums(batch, outputs, per_example_loss)
                                {name: (numerator, denominator)}, weighted, for one batch; the
                                trainer sums both parts over replicas and steps and divides last
                                (flax's lm1b: token accuracy divides by tokens, not sequences)
  metric_state(batch, outputs)  optional: any other additive state (Keras metric objects'
                                variables), summed the same way and read by metric_state_values

Every batch is a dict with a "weight" entry: 0 for padding examples, 1 otherwise.
`task.name` picks a registered task; `register_task` adds a user's own.

These methods are traced without autograph, as Keras 3's model.fit traces a model's code: a
condition or loop on a tensor is written with tf.cond, tf.where or tf.while_loop (a Python `if`
on a tensor stops the run with a one-line error naming its line).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, NamedTuple

from absl import logging

from tfdp.errors import ConfigError

if TYPE_CHECKING:  # annotations only: config.checks imports this module
  from tfdp.config.schema import DataConfig, TaskConfig

_REGISTRY: dict[str, type] = {}
# The built-in tasks, imported when first named (TF Model Garden's task_factory with its
# registry_imports, torchtitan's models.<name> on use): core imports no workload.
_BUILTIN_TASKS = {
    "image_classification": "tfdp.workloads.vision.image_classification",
    "masked_lm": "tfdp.workloads.text.tasks",
    "text_classification": "tfdp.workloads.text.tasks",
    "matrix_factorization": "tfdp.workloads.recommenders.tasks",
    "retrieval": "tfdp.workloads.recommenders.tasks",
    "keras_model": "tfdp.compiled.task",  # made by tfdp.fit from a compiled model, not a config
}


REQUIRED_METHODS = ("build_model", "model_inputs", "per_example_loss")  # Task's raise


def register_task(name: str) -> Callable[[type], type]:
  """Class decorator: `@tfdp.register_task("my_task") class MyTask(tfdp.Task)`. What would fail
  later with a bare traceback is said here, in one line: a class that is no Task, a method every
  task needs left out, a name of tfdp's own (which of the two ran would depend on import
  order)."""
  def decorate(cls: type) -> type:
    who = f"register_task('{name}')"
    if not (isinstance(cls, type) and issubclass(cls, Task)):
      raise ConfigError(f"{who}: {getattr(cls, '__name__', cls)} is not a tfdp.Task; declare it "
                        f"as class {getattr(cls, '__name__', 'MyTask')}(tfdp.Task).")
    missing = [m for m in REQUIRED_METHODS if getattr(cls, m) is getattr(Task, m)]
    if missing:
      raise ConfigError(f"{who}: {cls.__name__} does not define {', '.join(missing)}, which "
                        "every task needs (README: 'Your own workload').")
    if name in _BUILTIN_TASKS and not cls.__module__.startswith(_BUILTIN_TASKS[name]):
      raise ConfigError(f"{who}: '{name}' is tfdp's own task; register {cls.__name__} under "
                        "another name and select it with task.name.")
    earlier = _REGISTRY.get(name)
    if earlier is not None and (earlier.__module__, earlier.__qualname__) != (
        cls.__module__, cls.__qualname__):  # a notebook cell run again re-registers quietly
      logging.warning("register_task: '%s' is now %s.%s, no longer %s.%s", name, cls.__module__,
                      cls.__qualname__, earlier.__module__, earlier.__qualname__)
    _REGISTRY[name] = cls
    return cls
  return decorate


def registered_tasks() -> list[str]:
  return sorted(set(_REGISTRY) | set(_BUILTIN_TASKS))


def task_class(name: str) -> type:
  if name not in _REGISTRY and name in _BUILTIN_TASKS:
    importlib.import_module(_BUILTIN_TASKS[name])  # registers it
  if name not in _REGISTRY:
    raise ConfigError(f"config key 'task.name' is '{name}'; use one of "
                      f"{', '.join(registered_tasks())} (a task of your own is registered in the "
                      "process that trains: name its module in task.module).")
  return _REGISTRY[name]


class SavedRunUse(NamedTuple):
  """How a run uses an earlier run's saved files (Task.check_saved_artifacts)."""
  action: str  # "resume", "--mode=eval", "warm start from task.init_checkpoint '...'"
  fix: str
  warm_start: bool = False


def built_source(task: "Task", data: DataConfig):
  """task.build_source(data), checked: the engine reads a tfdp.Source, not a bare dataset."""
  from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
  source = task.build_source(data)
  if not isinstance(source, data_lib.Source):
    raise ConfigError(f"task '{task.config.name}': build_source returned a "
                      f"{type(source).__name__}; return tfdp.Source([examples], read, kind), "
                      "where read(file_indices) gives a tf.data.Dataset of example dicts.")
  return source


def make_task(config: TaskConfig, worker: int = 0, num_workers: int = 1) -> "Task":
  """`worker`/`num_workers`: which worker builds it (a task may read only its own data)."""
  task = task_class(config.name)(config)
  task.worker, task.num_workers = worker, num_workers
  return task


# What each kind of data reads (DataConfig's keys), for the ignored_keys of tasks of another kind.
IMAGE_DATA_KEYS = ("data.name", "data.data_dir", "data.image_key", "data.label_key",
                   "data.image_size", "data.num_classes", "data.num_examples", "data.augment",
                   "data.crop_padding", "data.flip", "data.mean", "data.std")
TEXT_DATA_KEYS = ("data.text_unit", "data.holdout")
INTERACTION_DATA_KEYS = ("data.user_column", "data.item_column", "data.label_column",
                         "data.weight_column", "data.holdout_fraction")


class Task:
  """The base: subclasses say what their examples, model, loss and metrics are."""

  metric_names: tuple[str, ...] = ("loss",)  # the order of the trainer's sums vector
  metric_state_size = 0  # entries of metric_state, after the sums
  # Under mixed precision the model's outputs are bfloat16 or float16: the loss and metrics see
  # them in float32, as Keras computes losses (tf.square(outputs - y) would mix dtypes).
  float32_outputs = True
  supports_eval_flip = False  # task.eval_flip: its inputs are images whose mirror is one too
  # Keys under task. this task never reads ("data.x": in train_data and eval_data): set away
  # from their defaults (and not off), they are named in one warning (they would do nothing,
  # silently).
  ignored_keys: tuple[str, ...] = ()

  def __init__(self, config: TaskConfig):
    self.config = config
    self.worker, self.num_workers = 0, 1  # make_task sets them
    # experiment.build sets it before build_model: a checkpoint will be restored over the new
    # weights (a resume, --mode=eval), so an initialization from data need not read any.
    self.restoring = False

  @classmethod
  def ignored_data_keys(cls, data: DataConfig) -> tuple[str, ...]:
    """Keys of one data section this task never reads with that section's source (an image
    source's keys another image source does not read), beside ignored_keys."""
    del data
    return ()

  @classmethod
  def unused_keys(cls, config: TaskConfig, defaults: TaskConfig) -> list[str]:
    """The ignored keys `config` sets away from `defaults` (the schema's), as dotted keys."""
    def set_here(path: str) -> bool:
      value, default = config, defaults
      for part in path.split("."):
        value, default = getattr(value, part), getattr(default, part)
      return bool(value) and value != default  # false, 0 or empty: off, as good as unset
    sections = ("train_data", "eval_data")
    paths = [f"{section}.{key[len('data.'):]}" if key.startswith("data.") else key
             for key in cls.ignored_keys
             for section in (sections if key.startswith("data.") else ("",))]
    paths += [f"{section}.{key}" for section in sections
              for key in cls.ignored_data_keys(getattr(config, section))]
    return [f"task.{path}" for path in paths if set_here(path)]

  @classmethod
  def validate(cls, config: TaskConfig) -> None:
    """Checks that need no TensorFlow (config.validate calls it): raise ConfigError/DataError."""

  @classmethod
  def check_source(cls, data: DataConfig, key: str) -> None:
    """Before TensorFlow starts, for each split it reads (`key`: task.train_data, ...): that the
    data is where the config says; one line (DataError) if not. The base checks a registered
    source (core.data's readers) when the task reads one (this class's build_source); a task
    that builds its own source checks it here."""
    if cls.build_source is not Task.build_source:
      return  # not the config's registered source: the default tfds/cifar10 is not its data
    from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
    data_lib.check_source(data, key)

  def build_source(self, data: DataConfig):
    from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
    return data_lib.make_source(data)

  def preprocess(self, example: dict, data: DataConfig, training: bool, seed) -> dict:
    del data, training, seed
    return example

  def build_model(self, source):
    raise NotImplementedError

  def warm_start(self, checkpoint_path: str) -> None:
    """Called after build_model, before training from step 0, with task.init_checkpoint."""
    raise ConfigError(f"task '{self.config.name}' has no encoder to warm-start; remove "
                      "task.init_checkpoint.")

  def model_inputs(self, batch: dict):
    raise NotImplementedError

  def per_example_loss(self, batch: dict, outputs):
    raise NotImplementedError

  def loss_outputs(self, outputs):
    """The model's outputs as the loss and metrics see them: float32 (float32_outputs)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
    if not self.float32_outputs:
      return outputs

    def widened(t):  # the mixed-precision dtypes only (a float64 layer's outputs stay theirs)
      if t.dtype not in (tf.bfloat16, tf.float16):
        return t
      cast, mask = tf.cast(t, tf.float32), compat.keras_mask(t)
      return cast if mask is None else compat.with_keras_mask(cast, mask)  # a Keras loss reads it
    return tf.nest.map_structure(widened, outputs)

  def eval_outputs(self, model, batch: dict):
    """The model's outputs for evaluation (a task may add test-time augmentation)."""
    return model(self.model_inputs(batch), training=False)

  def metric_sums(self, batch: dict, outputs, per_example_loss) -> dict:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    weight = batch["weight"]
    return {"loss": (tf.reduce_sum(per_example_loss * weight), tf.reduce_sum(weight))}

  def activity_scale(self, batch: dict):
    """The factor on a layer's activity regularization, which Keras divides by the batch's rows
    (padding included): None keeps that, the trainer's global-batch convention."""
    del batch
    return None

  def metric_state(self, batch: dict, outputs):
    """A float32 [metric_state_size] vector: this batch's additive contribution to metrics that
    are not one quotient (an AUC's confusion counts); summed over replicas, steps and workers."""
    del batch, outputs
    raise NotImplementedError

  def metric_state_values(self, state) -> dict:
    """{name: value} from the summed metric_state (a numpy vector)."""
    del state
    return {}

  def reported_metric_names(self) -> list[str]:
    """Every metric a run reports, in order (the progress line's columns)."""
    return list(self.metric_names)

  def make_optimizer(self, model):
    """The optimizer to train with, or None for the config's (trainer.optimizer and
    trainer.learning_rate). Called inside strategy.scope()."""
    del model
    return None

  def recorded_config(self, config: dict) -> dict:
    """The config as model_dir/config.yaml records it: what this task trained with, its file
    paths absolute (a relative one means the folder the run started in; a later --mode=eval of
    the run reads its config.yaml from anywhere)."""
    return with_absolute_paths(config)

  def artifacts(self, source) -> dict:
    """Files the chief writes into model_dir beside the model: {file name: text} (e.g. the id
    mapping a recommender's inference must use)."""
    del source
    return {}

  @classmethod
  def check_saved_artifacts(cls, config: TaskConfig, folder: str,
                            context: "SavedRunUse") -> None:
    """Before TensorFlow starts and anything is written: refuse (one line) when `folder` (the run
    resumed or evaluated, or the warm start's run) saved artifacts that this task config would
    contradict. `context`: the action and its fix for the message, and whether it is a warm
    start (which restores the encoder only: a new head)."""
    del config, folder, context

  def finalize_metric(self, name: str, value: float) -> float:
    """The reported value from numerator / denominator (e.g. a square root for an RMSE)."""
    del name
    return value


def classification_sums(batch: dict, logits, per_example_loss, label_key: str = "label") -> dict:
  """Loss and accuracy of a classifier as weighted sums: {name: (numerator, denominator)}."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  weight = batch["weight"]
  correct = tf.cast(tf.equal(tf.argmax(logits, -1), batch[label_key]), tf.float32)
  count = tf.reduce_sum(weight)
  return {"loss": (tf.reduce_sum(per_example_loss * weight), count),
          "accuracy": (tf.reduce_sum(correct * weight), count)}


def with_absolute_paths(config: dict) -> dict:
  """A config dict as config.yaml records it (and --print_config shows it): the task's file
  paths absolute."""
  return {**config, "task": _absolute_paths(config["task"])} if "task" in config else config


def _absolute_paths(section: dict) -> dict:
  """Each `path`, `*_path` and `data_dir` under `section` made absolute where it names files
  here (a {worker} pattern or a glob: where it matches), so a later --mode=eval finds them from
  any folder; one found elsewhere (the shipped vocabulary, beside the package) and a model's
  own kwargs are left as given."""
  import glob  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  done = {}
  for key, value in section.items():
    if isinstance(value, dict) and key != "kwargs":
      value = _absolute_paths(value)
    elif ((key in ("path", "data_dir") or key.endswith("_path")) and isinstance(value, str)
          and value and not os.path.isabs(os.path.expanduser(value))
          and (os.path.exists(value) or glob.glob(re.sub(r"\{worker[^}]*\}", "*", value)))):
      value = os.path.abspath(value)
    done[key] = value
  return done
