"""Value checks of an experiment config, before TensorFlow starts: one line naming the key.

Task-specific checks are the task's (`Task.validate`): this module asks `core.task` for them and
imports no workload.
"""
from __future__ import annotations

import difflib
import importlib
from typing import Sequence

from tfdp.config.loader import short_repr
from tfdp.config.schema import (ALL_REDUCE, CROSS_DEVICE_OPS, DATA_SOURCES, LR_SCHEDULES,
                                FLIPS, OPTIMIZERS, PRECISIONS, SHARD_POLICIES, STRATEGIES, DataConfig,
                                ExperimentConfig, TaskConfig)
from tfdp.core import task as tasks
from tfdp.errors import ConfigError


def check_choice(key: str, value: str, choices: Sequence[str]) -> None:
  if value not in choices:
    close = difflib.get_close_matches(value, choices, n=1)
    hint = f"did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"config key '{key}' is '{value}'; use one of {', '.join(choices)}. {hint}")


def check_positive(key: str, value: float, allow_zero: bool = False) -> None:
  if value < 0 or (value == 0 and not allow_zero):
    bound = ">= 0" if allow_zero else "> 0"
    raise ConfigError(f"config key '{key}' is {value}; it must be {bound}.")


def _validate_data(prefix: str, data: DataConfig) -> None:
  check_choice(prefix + "source", data.source, DATA_SOURCES)
  check_choice(prefix + "shard_policy", data.shard_policy, SHARD_POLICIES)
  check_choice(prefix + "text_unit", data.text_unit, ("document", "speech", "passage"))
  check_choice(prefix + "flip", data.flip, FLIPS)
  if not 0.0 <= data.holdout_fraction < 1.0:
    raise ConfigError(f"config key '{prefix}holdout_fraction' must be in [0, 1), e.g. 0.1.")
  if data.source == "tfds" and not data.name:
    raise ConfigError(f"config key '{prefix}name' is empty; name a TFDS dataset such as cifar10.")
  if data.source in ("image_folder", "tfrecord", "text_folder", "text_files",
                     "interactions") and not data.path:
    raise ConfigError(f"config key '{prefix}path' is empty; {data.source} needs a path.")
  if data.source == "synthetic":
    check_positive(prefix + "num_examples", data.num_examples)
    check_positive(prefix + "num_classes", data.num_classes)
    check_positive(prefix + "image_size", data.image_size)
  for key in ("image_size", "num_classes", "shuffle_buffer", "threadpool_size", "crop_padding"):
    check_positive(prefix + key, getattr(data, key), allow_zero=True)
  if len(data.mean) != len(data.std) or any(s <= 0 for s in data.std):
    raise ConfigError(f"config keys '{prefix}mean'/'{prefix}std' need equal lengths and std > 0.")
  _validate_shard_mapping(prefix, data)


def _validate_shard_mapping(prefix: str, data: DataConfig) -> None:
  """shards_per_worker / worker_shards map a {worker} path's shards onto the workers: every shard
  once (the worker count is checked against them when the data is read: data.map_shards)."""
  check_positive(prefix + "shards_per_worker", data.shards_per_worker, allow_zero=True)
  if not (data.shards_per_worker or data.worker_shards):
    return
  if "{worker" not in data.path:
    key = "shards_per_worker" if data.shards_per_worker else "worker_shards"
    raise ConfigError(f"config key '{prefix}{key}' maps {{worker}} shards onto workers, but "
                      f"'{prefix}path' '{data.path}' has no {{worker}} placeholder; drop it, or "
                      "give a path with {worker}.")
  if data.shards_per_worker and data.worker_shards:
    raise ConfigError(f"config keys '{prefix}shards_per_worker' and '{prefix}worker_shards' are "
                      "both set; keep one.")
  lists = data.worker_shards
  flat = [s for shards in lists if isinstance(shards, list) for s in shards]
  if (not all(isinstance(shards, list) and shards for shards in lists)
      or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in flat)):
    raise ConfigError(f"config key '{prefix}worker_shards' is {short_repr(lists, 100)}; give one "
                      "non-empty list of shard indices (integers >= 0) per worker, e.g. [[0, 1], [2]].")
  if lists and sorted(flat) != list(range(len(flat))):
    missing = sorted(set(range(max(flat) + 1)) - set(flat))
    twice = sorted({s for s in flat if flat.count(s) > 1})
    raise ConfigError(f"config key '{prefix}worker_shards' is {short_repr(lists, 100)}: every "
                      f"shard 0..n-1 must be read by one worker once (missing {missing}, twice "
                      f"{twice}), or its examples would count twice or never.")


def validate(config: ExperimentConfig) -> None:
  """Raises ConfigError for impossible values. Replica-count checks are in expected_replicas."""
  task, trainer, runtime = config.task, config.trainer, config.runtime
  for key, module in (("task.module", task.module), ("task.model.module", task.model.module)):
    if module:
      if module.startswith("."):
        raise ConfigError(f"config key '{key}' is '{module}', a relative module name; give the "
                          "absolute name of a module on PYTHONPATH, e.g. my_models.")
      try:
        importlib.import_module(module)
      except ImportError as e:
        raise ConfigError(f"config key '{key}' names '{module}', which cannot be imported ({e}); "
                          "put it on PYTHONPATH.") from None
      except SyntaxError as e:
        raise ConfigError(f"config key '{key}' names '{module}', which has a syntax error "
                          f"({e.msg}, {e.filename} line {e.lineno}); fix the module.") from None
      except Exception as e:  # pylint: disable=broad-except  (the user's module raised on import)
        raise ConfigError(f"config key '{key}' names '{module}', which failed on import "
                          f"({type(e).__name__}: {short_repr(str(e), 200)}); fix the module.") from None
  check_choice("task.name", task.name, tasks.registered_tasks())
  if task.eval_flip and not tasks.task_class(task.name).supports_eval_flip:
    raise ConfigError(f"config key 'task.eval_flip' is true, but task '{task.name}' has no images "
                      "to mirror; set task.eval_flip=false.")
  check_positive("task.eval_translate", task.eval_translate, allow_zero=True)
  if task.eval_translate and not tasks.task_class(task.name).supports_eval_flip:
    raise ConfigError(f"config key 'task.eval_translate' is {task.eval_translate}, but task "
                      f"'{task.name}' has no images to shift; set task.eval_translate=0.")
  if task.init_checkpoint and tasks.task_class(task.name).warm_start is tasks.Task.warm_start:
    raise ConfigError(f"task '{task.name}' has no encoder to warm-start; remove "
                      "task.init_checkpoint.")  # as Task.warm_start says, before TF starts
  tasks.task_class(task.name).validate(task)
  _validate_data("task.train_data.", task.train_data)
  _validate_data("task.eval_data.", task.eval_data)
  if not 0.0 <= task.label_smoothing < 1.0:
    raise ConfigError("config key 'task.label_smoothing' must be in [0, 1).")
  check_positive("trainer.global_batch_size", trainer.global_batch_size)
  check_positive("trainer.eval_batch_size", trainer.eval_batch_size, allow_zero=True)
  check_positive("trainer.epochs", trainer.epochs, allow_zero=True)
  if trainer.epochs == 0:  # it would export the untrained model and say "done"
    raise ConfigError("config key 'trainer.epochs' is 0; it must be >= 1 (for a shorter run, "
                      "set trainer.max_steps=N to stop after N steps).")
  check_positive("trainer.max_steps", trainer.max_steps, allow_zero=True)
  check_positive("trainer.steps_per_epoch", trainer.steps_per_epoch, allow_zero=True)
  check_positive("trainer.steps_per_loop", trainer.steps_per_loop)
  check_positive("trainer.gradient_accumulation_steps", trainer.gradient_accumulation_steps)
  check_positive("trainer.gradient_clip_norm", trainer.gradient_clip_norm, allow_zero=True)
  check_positive("trainer.optimizer.epsilon", trainer.optimizer.epsilon)
  check_positive("trainer.eval_every_epochs", trainer.eval_every_epochs)
  check_positive("trainer.checkpoint_every_steps", trainer.checkpoint_every_steps, allow_zero=True)
  check_positive("trainer.max_checkpoints", trainer.max_checkpoints)
  check_positive("trainer.precise_bn_batches", trainer.precise_bn_batches, allow_zero=True)
  if not 0.0 <= trainer.ema_decay < 1.0:
    raise ConfigError(f"config key 'trainer.ema_decay' is {trainer.ema_decay}; it must be in "
                      "[0, 1), e.g. 0.99 (0 turns the average off).")
  check_positive("trainer.lookahead_every_steps", trainer.lookahead_every_steps, allow_zero=True)
  if not 0.0 < trainer.lookahead_decay <= 1.0:
    raise ConfigError(f"config key 'trainer.lookahead_decay' is {trainer.lookahead_decay}; it "
                      "must be in (0, 1], e.g. 0.95.")
  check_choice("trainer.optimizer.name", trainer.optimizer.name, OPTIMIZERS)
  multiplier = trainer.optimizer.norm_bias_lr_multiplier
  check_positive("trainer.optimizer.norm_bias_lr_multiplier", multiplier)
  if multiplier != 1.0 and trainer.optimizer.name != "sgd":
    raise ConfigError(f"config key 'trainer.optimizer.norm_bias_lr_multiplier' is {multiplier}, "
                      f"but {trainer.optimizer.name} adapts its step to the gradient's scale; "
                      "use trainer.optimizer.name=sgd or set it to 1.")
  check_positive("trainer.optimizer.weight_decay", trainer.optimizer.weight_decay, allow_zero=True)
  for key in ("filter_lr", "head_lr", "bias_lr"):
    check_positive(f"trainer.optimizer.{key}", getattr(trainer.optimizer, key))
  for key in ("momentum", "beta_1", "beta_2", "filter_momentum"):
    if not 0.0 <= getattr(trainer.optimizer, key) < 1.0:
      raise ConfigError(f"config key 'trainer.optimizer.{key}' is "
                        f"{getattr(trainer.optimizer, key)}; it must be in [0, 1), e.g. 0.9.")
  lr = trainer.learning_rate
  check_choice("trainer.learning_rate.schedule", lr.schedule, LR_SCHEDULES)
  check_positive("trainer.learning_rate.base_lr", lr.base_lr)
  check_positive("trainer.learning_rate.base_batch_size", lr.base_batch_size)
  check_positive("trainer.learning_rate.warmup_epochs", lr.warmup_epochs, allow_zero=True)
  check_positive("trainer.learning_rate.decay_rate", lr.decay_rate)
  check_positive("trainer.learning_rate.power", lr.power)
  if not 0.0 <= lr.final_lr_fraction <= 1.0:
    raise ConfigError("config key 'trainer.learning_rate.final_lr_fraction' must be in [0, 1].")
  if lr.schedule == "step" and not lr.decay_epochs:
    raise ConfigError("config key 'trainer.learning_rate.decay_epochs' is empty; the step "
                      "schedule needs boundaries such as [30, 60].")
  if any(e < 0 for e in lr.decay_epochs) or list(lr.decay_epochs) != sorted(lr.decay_epochs):
    raise ConfigError(f"config key 'trainer.learning_rate.decay_epochs' is {lr.decay_epochs}; "
                      "give epochs of 0 or more in increasing order, such as [30, 60].")
  check_choice("runtime.strategy", runtime.strategy, STRATEGIES)
  check_choice("runtime.cross_device_ops", runtime.cross_device_ops, CROSS_DEVICE_OPS)
  check_choice("runtime.all_reduce", runtime.all_reduce, ALL_REDUCE)
  check_choice("runtime.mixed_precision", runtime.mixed_precision, PRECISIONS)
  check_choice("runtime.all_reduce_dtype", runtime.all_reduce_dtype, ("float32", "bfloat16"))
  check_choice("runtime.all_reduce_order", runtime.all_reduce_order, ("variables", "backward"))
  check_positive("runtime.heartbeat_timeout_seconds", runtime.heartbeat_timeout_seconds)
  check_positive("runtime.num_packs", runtime.num_packs)
  for key in ("cpu_replicas", "bytes_per_pack", "collective_timeout_seconds", "watchdog_seconds",
              "intra_op_threads", "inter_op_threads", "profile_steps", "startup_timeout_seconds"):
    check_positive("runtime." + key, getattr(runtime, key), allow_zero=True)
  if runtime.cpu_replicas and runtime.devices:
    raise ConfigError(f"runtime.devices and runtime.cpu_replicas ({runtime.cpu_replicas}; "
                      "configs/base.yaml sets 2) both choose the replicas; set "
                      "runtime.cpu_replicas=0 to use runtime.devices.")
  if runtime.strategy in ("default", "one_device") and (runtime.cpu_replicas > 1
                                                        or len(runtime.devices) > 1):
    raise ConfigError(f"runtime.strategy '{runtime.strategy}' runs one replica; set "
                      "runtime.strategy=mirrored to use several devices.")


def warn_unused_keys(task) -> None:
  """Settings the task never reads, set all the same (a probe: num_classes or mean on a text
  task did nothing, silently): named in one warning when the config is loaded."""
  unused = tasks.task_class(task.name).unused_keys(task, TaskConfig())
  if unused:
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning("config: task '%s' does not read %s; they do nothing here (drop them)",
                    task.name, ", ".join(unused))


def warn_unused_slices(task) -> None:
  """A sliced split where the source is not TFDS (runlocal.yaml over a folder job) reads all of
  its data: said once, when the config is loaded."""
  for key, data in (("task.train_data", task.train_data), ("task.eval_data", task.eval_data)):
    if data.source != "tfds" and "[" in data.split:
      from absl import logging  # pylint: disable=g-import-not-at-top
      logging.warning("config key '%s.split' is '%s', but slicing is for TFDS splits: source %s "
                      "reads all its data (a smaller run: a smaller folder or file)", key,
                      data.split, data.source)
