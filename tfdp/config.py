"""Typed experiment config: task / trainer / runtime dataclasses, YAML layering, strict checks.

Nothing here imports TensorFlow: every mistake a user can make in a config is caught before
TensorFlow starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import typing
from typing import Any, Sequence

import yaml

from tfdp.errors import ConfigError

DATA_SOURCES = ("tfds", "image_folder", "tfrecord", "synthetic", "text_folder", "text_files",
                "interactions")
SHARD_POLICIES = ("auto", "file", "data", "off", "tfds_split", "local")
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker_mirrored")
CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduce_to_one_device")
ALL_REDUCE = ("auto", "ring", "nccl")
OPTIMIZERS = ("sgd", "adagrad", "adam", "adamw", "lamb")
LR_SCHEDULES = ("constant", "cosine", "step", "linear", "polynomial")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16", "auto")
MODES = ("train", "eval", "train_and_eval")
MAX_INT = 2**31 - 1  # what TensorFlow's int32 shapes and counters hold
MAX_NESTING = 32  # configs are a few levels deep; deeper is a mistake (or an attack)
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000


@dataclasses.dataclass
class DataConfig:
  """Where examples come from and how they are prepared."""
  source: str = "tfds"  # one of DATA_SOURCES
  name: str = "cifar10"  # TFDS dataset name
  split: str = "train"  # TFDS split, slicing allowed: "train[:5000]"; text: all | train | holdout
  data_dir: str = ""  # TFDS data_dir; empty: $TFDS_DATA_DIR, then ~/tensorflow_datasets
  path: str = ""  # image_folder / text_folder root, or a tfrecord / text file glob
  text_unit: str = "document"  # text: document (a file), speech (plays: one per speaker turn) or
  # passage (plays: a play's speeches in order, cut into sequence_length-token passages)
  holdout: list[str] = dataclasses.field(default_factory=list)  # text: files (no extension) of
  # split holdout and left out of split train, e.g. whole plays held out for evaluation
  user_column: str = "user"  # interactions (CSV columns or TFRecord features)
  item_column: str = "item"
  label_column: str = ""  # a rating; empty: implicit feedback (every row a positive)
  weight_column: str = ""
  holdout_fraction: float = 0.0  # interactions: rows (by a stable hash of user and item) of split
  # holdout, left out of split train; all: every row
  image_key: str = "image"  # tfrecord feature names
  label_key: str = "label"
  image_size: int = 0  # resize to this square size; 0 keeps the source size
  num_classes: int = 0  # 0: read from the source
  num_examples: int = 0  # synthetic only
  augment: bool = False  # random crop (crop_padding-pixel pad) + horizontal flip
  crop_padding: int = 4  # augment: the crop's reflect padding, i.e. the largest shift in pixels
  shuffle: bool = True  # training: a new order each epoch (seeded); false keeps the source order
  cache: bool = True  # keep decoded images in memory after the first epoch, if they fit
  shuffle_buffer: int = 0  # 0: the whole dataset (exact shuffle) when cached, else 10000
  mean: list[float] = dataclasses.field(default_factory=lambda: [0.5, 0.5, 0.5])
  std: list[float] = dataclasses.field(default_factory=lambda: [0.25, 0.25, 0.25])
  shard_policy: str = "auto"  # one of SHARD_POLICIES, used with several workers; local: each
  # worker reads only its own files (a path with {worker}), never another's
  deterministic: bool = True  # tf.data element order; False may be faster
  threadpool_size: int = 0  # tf.data private thread pool; 0: TF's shared pool


@dataclasses.dataclass
class ModelConfig:
  name: str = "resnet20"  # a name from tfdp.models.registered_models()
  module: str = ""  # a Python module to import first; it may @tfdp.register_model its own
  kwargs: dict = dataclasses.field(default_factory=dict)  # passed to the builder


@dataclasses.dataclass
class TextConfig:
  """Tokenization and masking for the text tasks."""
  vocab_path: str = ""  # WordPiece vocabulary; empty: configs/vocab/shakespeare_wordpiece.txt
  lowercase: bool = True
  sequence_length: int = 128
  mask_rate: float = 0.15  # masked_lm: tokens chosen per sequence (80% [MASK], 10% random, 10% kept)
  max_predictions: int = 0  # masked_lm: prediction slots; 0: ceil(mask_rate * sequence_length)


@dataclasses.dataclass
class RecommenderConfig:
  """How user and item ids become embedding rows, the same on every worker."""
  user_vocab_path: str = ""  # one id per line (apps/split_interactions.py writes them); empty:
  item_vocab_path: str = ""  # hash ids into *_buckets rows instead
  user_buckets: int = 4096
  item_buckets: int = 4096
  oov_buckets: int = 8  # with a vocabulary: rows for ids first seen while fine-tuning


@dataclasses.dataclass
class TaskConfig:
  """What is learned: the workload (a registered task), its model, data and loss."""
  name: str = "image_classification"  # one of tfdp.tasks.registered_tasks()
  module: str = ""  # a Python module to import first; it may @tfdp.register_task its own
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  train_data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(augment=True))
  eval_data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(split="test"))
  label_smoothing: float = 0.0
  eval_flip: bool = False  # image classification: evaluate on the mean logits of each image and
  # its mirror image (test-time augmentation)
  text: TextConfig = dataclasses.field(default_factory=TextConfig)
  recommender: RecommenderConfig = dataclasses.field(default_factory=RecommenderConfig)
  init_checkpoint: str = ""  # warm start: a run's model_dir (or checkpoint prefix) to take the
  # encoder from; the task's new head starts fresh


@dataclasses.dataclass
class OptimizerConfig:
  name: str = "sgd"
  momentum: float = 0.9
  nesterov: bool = True
  weight_decay: float = 5e-4  # decoupled, applied by the optimizer on every replica alike
  beta_1: float = 0.9
  beta_2: float = 0.999
  epsilon: float = 1e-7  # adam/adamw/lamb (BERT uses 1e-6)


@dataclasses.dataclass
class LearningRateConfig:
  """lr = base_lr * global_batch_size / base_batch_size (linear scaling), warmup, then decay."""
  base_lr: float = 0.1
  base_batch_size: int = 128
  schedule: str = "cosine"
  warmup_epochs: float = 0.0
  decay_epochs: list[float] = dataclasses.field(default_factory=list)  # "step" boundaries
  decay_rate: float = 0.1  # "step" factor
  final_lr_fraction: float = 0.0  # "cosine"/"linear"/"polynomial" end, as a fraction of the peak
  power: float = 1.0  # "polynomial": (1 - progress) ** power; 1 is linear


@dataclasses.dataclass
class TrainerConfig:
  """How it is learned: batch, epochs, schedule, checkpoints."""
  global_batch_size: int = 128  # examples per optimizer step, over all replicas and micro-steps
  eval_batch_size: int = 0  # 0: global_batch_size
  gradient_accumulation_steps: int = 1  # micro-batches per optimizer step: the same global batch
  # (and trajectory) on fewer replicas, as NVIDIA's BERT recipes keep it fixed
  gradient_clip_norm: float = 0.0  # >0: clip the all-reduced gradient to this global norm
  epochs: int = 1
  max_steps: int = 0  # >0 stops after this many steps in all (smoke runs)
  steps_per_loop: int = 50  # steps per compiled call (tf.function with a tf.range loop)
  eval_every_epochs: int = 1
  checkpoint_every_steps: int = 0  # 0: at the end of every epoch only
  max_checkpoints: int = 3
  export_model: bool = True
  precise_bn_batches: int = 0  # >0: before each evaluation (and at the end), BatchNorm's moving
  # statistics are recomputed as the average over this many training batches with the weights
  # frozen, across replicas and workers (PreciseBN); 0 keeps the moving averages
  ema_decay: float = 0.0  # >0: evaluate and export an exponential moving average of the weights
  # (Keras's optimizer EMA; the checkpoint carries it); 0: the weights themselves
  stop_on_nan: bool = True  # a non-finite loss or metric stops the run, keeping the last good
  # checkpoint (no weights are saved after it)
  seed: int = 42
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  learning_rate: LearningRateConfig = dataclasses.field(default_factory=LearningRateConfig)


@dataclasses.dataclass
class RuntimeConfig:
  """Where it runs: strategy, devices, collectives, precision, threads."""
  strategy: str = "auto"
  devices: list[str] = dataclasses.field(default_factory=list)  # mirrored: e.g. ["/gpu:0", "/gpu:1"]
  cpu_replicas: int = 0  # >0: split the CPU into this many logical devices (one replica each)
  cross_device_ops: str = "auto"  # mirrored all-reduce
  num_packs: int = 1  # mirrored nccl/hierarchical_copy: gradients packed into this many chunks
  all_reduce: str = "auto"  # multi_worker_mirrored collective implementation
  bytes_per_pack: int = 0  # 0: TF's default gradient packing
  all_reduce_order: str = "variables"  # backward: gradients go to the all-reduce last layer
  # first, as backprop finishes them, so a pack (bytes_per_pack) can start before the backward
  # pass ends (DDP's buckets); variables: the model's variable order
  collective_timeout_seconds: float = 0.0  # 0: no timeout
  heartbeat_timeout_seconds: float = 30.0  # multi-worker: a silent worker counts as dead after this
  dense_embedding_gradients: bool = False  # all-reduce embedding gradients dense (TF all-gathers
  # sparse IndexedSlices instead: their cost grows with the workers; dense costs the table size)
  mixed_precision: str = "float32"  # auto: mixed_float16 on GPUs with tensor cores,
  # mixed_bfloat16 on CPUs with native bfloat16 (AVX512-BF16/AMX), else float32
  all_reduce_dtype: str = "float32"  # bfloat16: gradients cross replicas and workers in half
  # the bytes (cast before the sum, back after); variables and optimizer stay float32
  jit_compile: bool = False
  intra_op_threads: int = 0  # 0: TensorFlow's default
  inter_op_threads: int = 0
  checkpoint_on_preemption: bool = True  # SIGTERM: save a checkpoint and exit
  profile_steps: int = 0  # >0: profiler trace of this many steps (from the 2nd loop) in model_dir/train


@dataclasses.dataclass
class ExperimentConfig:
  task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
  trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
  runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)


# ---- building from dicts, with the key path in every error ---------------------------------


def short_repr(value: Any, limit: int = 80) -> str:
  """A value as an error message may show it: an alias bomb's repr is megabytes."""
  import reprlib  # pylint: disable=g-import-not-at-top
  shortener = reprlib.Repr()
  shortener.maxlevel, shortener.maxstring, shortener.maxother = 3, limit, limit
  return shortener.repr(value)[:limit * 2]


def _too_deep(where: str) -> ConfigError:
  return ConfigError(f"{where} is nested more than {MAX_NESTING} levels deep; a tfdp config is a "
                     "few levels (task.model.kwargs...): flatten it.")


def check_nesting(data: Any, where: str) -> None:
  """Rejects data nested deeper than MAX_NESTING; walks each shared node once (YAML aliases
  can make a small file a huge tree)."""
  seen: set[int] = set()
  stack = [(data, 1)]
  while stack:
    node, depth = stack.pop()
    if not isinstance(node, (dict, list, tuple)) or id(node) in seen:
      continue
    if depth > MAX_NESTING:
      raise _too_deep(where)
    seen.add(id(node))
    children = node.values() if isinstance(node, dict) else node
    stack.extend((child, depth + 1) for child in children)
  sizes: dict[int, int] = {}

  def expanded_size(node) -> int:  # depth is bounded now: recursion is safe
    if not isinstance(node, (dict, list, tuple)):
      return 1
    if id(node) not in sizes:
      children = node.values() if isinstance(node, dict) else node
      sizes[id(node)] = 1 + sum(expanded_size(child) for child in children)
    return sizes[id(node)]
  if expanded_size(data) > MAX_CONFIG_VALUES:
    raise ConfigError(f"{where} expands to more than {MAX_CONFIG_VALUES} values (YAML aliases "
                      "repeat what they point to); a tfdp config is a few hundred: remove the "
                      "repeated aliases.")


def _type_name(tp: Any) -> str:
  return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
  """Returns value as type tp, or raises ConfigError naming key."""
  origin = typing.get_origin(tp)
  if dataclasses.is_dataclass(tp):
    if value is None:
      value = {}
    if not isinstance(value, dict):
      raise ConfigError(f"config key '{key}' must be a mapping of keys, got {short_repr(value)}.")
    return _from_dict(tp, value, key + ".")
  if origin is list:
    (item_tp,) = typing.get_args(tp)
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
      value = [value]  # `a.b=x` on the command line means a one-item list
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"config key '{key}' must be a list of {_type_name(item_tp)}, got "
                        f"{short_repr(value)}.")
    return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
  if tp is dict or origin is dict:
    if not isinstance(value, dict):
      raise ConfigError(f"config key '{key}' must be a mapping, got {short_repr(value)}.")
    return dict(value)
  if tp is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f"config key '{key}' must be true or false, got {short_repr(value)}.")
  if tp is int:
    if isinstance(value, float) and value.is_integer():
      value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
      if abs(value) > MAX_INT:
        raise ConfigError(f"config key '{key}' is {value:.3g}, beyond what TensorFlow counts "
                          f"(at most {MAX_INT}); use a realistic value.")
      return value
    raise ConfigError(f"config key '{key}' must be a whole number, got {short_repr(value)}.")
  if tp is float:
    if isinstance(value, str) and re.fullmatch(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+",
                                               value.strip()):
      value = float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string; YAML 1.2 and users don't
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      if not math.isfinite(value):
        raise ConfigError(f"config key '{key}' is {value}; it must be a finite number.")
      return float(value)
    raise ConfigError(f"config key '{key}' must be a number, got {short_repr(value)}.")
  if tp is str:
    if isinstance(value, str):
      return value
    if value is None:
      return ""
    raise ConfigError(f"config key '{key}' must be a string, got {short_repr(value)}; quote it "
                      "in YAML.")
  raise ConfigError(f"config key '{key}' has an unsupported type {tp}.")  # a bug in tfdp


def _from_dict(cls: type, data: dict, prefix: str = "") -> Any:
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  kwargs = {}
  for key, value in data.items():
    if key not in names:
      close = difflib.get_close_matches(str(key), names, n=1)
      hint = f"did you mean '{prefix}{close[0]}'?" if close else f"known keys: {', '.join(names)}."
      raise ConfigError(f"unknown config key '{prefix}{key}'; {hint}")
    kwargs[key] = _coerce(value, hints[key], prefix + key)
  return cls(**kwargs)


def from_dict(data: dict) -> ExperimentConfig:
  return _from_dict(ExperimentConfig, data or {})


def to_dict(config: ExperimentConfig) -> dict:
  return dataclasses.asdict(config)


def _deep_merge(base: dict, override: dict) -> dict:
  merged = dict(base)
  for key, value in override.items():
    if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "kwargs":
      merged[key] = _deep_merge(merged[key], value)
    else:
      merged[key] = value
  return merged


def _split_top_level(text: str, sep: str = ",") -> list[str]:
  """Splits on sep outside brackets and quotes, so `a=[1,2],b=x` is two overrides."""
  parts, depth, quote, current = [], 0, "", []
  for ch in text:
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "[{(":
      depth += 1
    elif ch in "]})":
      depth -= 1
    elif ch == sep and depth == 0:
      parts.append("".join(current))
      current = []
      continue
    current.append(ch)
  parts.append("".join(current))
  return [p.strip() for p in parts if p.strip()]


def parse_overrides(text: str) -> dict:
  """`a.b=1,c.d=x` or a YAML/JSON mapping → nested dict."""
  text = text.strip()
  if not text:
    return {}
  if len(text) > MAX_CONFIG_BYTES:
    raise ConfigError(f"--params_override is {len(text)} characters long; put settings that "
                      "large in a --config_file.")
  if text.startswith("{") or "\n" in text or (":" in text and "=" not in text):
    data = _safe_load(text, "--params_override")
    if not isinstance(data, dict):
      raise ConfigError(f"--params_override must be a mapping or a.b=1 pairs, got "
                        f"{short_repr(text)}.")
    check_nesting(data, "--params_override")
    return data
  result: dict = {}
  for item in _split_top_level(text):
    if "=" not in item:
      raise ConfigError(f"--params_override item '{item}' has no '='; write it as key.path=value.")
    path, raw = item.split("=", 1)
    keys = path.strip().split(".")
    if len(keys) > MAX_NESTING:
      raise ConfigError(f"--params_override key '{short_repr(path)}' is nested more than "
                        f"{MAX_NESTING} levels deep; tfdp keys are a few levels (a.b.c).")
    if not all(keys):
      raise ConfigError(f"--params_override key '{path}' is malformed; write it as a.b.c=value.")
    try:
      value = _safe_load(raw, f"--params_override value of '{path}'") if raw.strip() else ""
    except ConfigError:
      value = raw  # not YAML: the plain string
    check_nesting(value, f"--params_override value of '{path}'")
    node = result
    for k in keys[:-1]:
      node = node.setdefault(k, {})
      if not isinstance(node, dict):
        raise ConfigError(f"--params_override sets '{path}' and a key inside it; keep one.")
    node[keys[-1]] = value
  return result


def _safe_load(text: str, where: str) -> Any:
  """yaml.safe_load with one-line errors; PyYAML recurses once per nesting level."""
  try:
    return yaml.safe_load(text)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}" if mark else ""
    raise ConfigError(f"{where} is not valid YAML{at} ({short_repr(str(e).splitlines()[0])}); "
                      "fix its syntax.") from None
  except RecursionError:
    raise _too_deep(where) from None


def load_yaml(path: str) -> dict:
  if os.path.isdir(path):
    raise ConfigError(f"config file '{path}' is a directory; give the path of a YAML file in it, "
                      "e.g. --config_file=configs/cifar10_quick.yaml.")
  if not os.path.isfile(path):
    raise ConfigError(f"config file '{path}' does not exist; check the --config_file path.")
  try:
    with open(path, "rb") as f:
      raw = f.read(MAX_CONFIG_BYTES + 1)
  except OSError as e:
    raise ConfigError(f"config file '{path}' cannot be read ({e.strerror}); check its "
                      "permissions.") from None
  if len(raw) > MAX_CONFIG_BYTES:
    raise ConfigError(f"config file '{path}' is larger than {MAX_CONFIG_BYTES >> 20} MB; a tfdp "
                      "config is a few hundred lines: check that this is the right file.")
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {e.start} is "
                      f"{raw[e.start]:#04x}); give a YAML file.") from None
  if "\x00" in text:
    raise ConfigError(f"config file '{path}' holds binary data (a NUL byte); give a YAML file.")
  data = _safe_load(text, f"config file '{path}'")
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"config file '{path}' must hold a mapping with task/trainer/runtime keys.")
  check_nesting(data, f"config file '{path}'")
  return data


def load_config(config_files: Sequence[str] = (), overrides: Sequence[str] = ()) -> ExperimentConfig:
  """Defaults, then each YAML file in order, then each override; validated."""
  merged: dict = {}
  for path in config_files:
    layer = load_yaml(path)
    from_dict(layer)  # reject unknown keys naming the file's own mistake early
    merged = _deep_merge(merged, layer)
  for text in overrides:
    merged = _deep_merge(merged, parse_overrides(text))
  config = from_dict(merged)
  validate(config)
  return config


def dump_yaml(config: ExperimentConfig) -> str:
  return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=None)


# ---- value checks -------------------------------------------------------------------------


def _check_choice(key: str, value: str, choices: Sequence[str]) -> None:
  if value not in choices:
    close = difflib.get_close_matches(value, choices, n=1)
    hint = f"did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"config key '{key}' is '{value}'; use one of {', '.join(choices)}. {hint}")


def _check_positive(key: str, value: float, allow_zero: bool = False) -> None:
  if value < 0 or (value == 0 and not allow_zero):
    bound = ">= 0" if allow_zero else "> 0"
    raise ConfigError(f"config key '{key}' is {value}; it must be {bound}.")


def _validate_data(prefix: str, data: DataConfig) -> None:
  _check_choice(prefix + "source", data.source, DATA_SOURCES)
  _check_choice(prefix + "shard_policy", data.shard_policy, SHARD_POLICIES)
  _check_choice(prefix + "text_unit", data.text_unit, ("document", "speech", "passage"))
  if not 0.0 <= data.holdout_fraction < 1.0:
    raise ConfigError(f"config key '{prefix}holdout_fraction' must be in [0, 1), e.g. 0.1.")
  if data.source == "tfds" and not data.name:
    raise ConfigError(f"config key '{prefix}name' is empty; name a TFDS dataset such as cifar10.")
  if data.source in ("image_folder", "tfrecord", "text_folder", "text_files",
                     "interactions") and not data.path:
    raise ConfigError(f"config key '{prefix}path' is empty; {data.source} needs a path.")
  if data.source == "synthetic":
    _check_positive(prefix + "num_examples", data.num_examples)
    _check_positive(prefix + "num_classes", data.num_classes)
    _check_positive(prefix + "image_size", data.image_size)
  for key in ("image_size", "num_classes", "shuffle_buffer", "threadpool_size", "crop_padding"):
    _check_positive(prefix + key, getattr(data, key), allow_zero=True)
  if len(data.mean) != len(data.std) or any(s <= 0 for s in data.std):
    raise ConfigError(f"config keys '{prefix}mean'/'{prefix}std' need equal lengths and std > 0.")


def validate(config: ExperimentConfig) -> None:
  """Raises ConfigError for impossible values. Replica-count checks are in expected_replicas."""
  task, trainer, runtime = config.task, config.trainer, config.runtime
  from tfdp import tasks  # pylint: disable=g-import-not-at-top  (no TensorFlow there)
  for key, module in (("task.module", task.module), ("task.model.module", task.model.module)):
    if module:
      import importlib  # pylint: disable=g-import-not-at-top
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
  _check_choice("task.name", task.name, tasks.registered_tasks())
  if task.eval_flip and not tasks.task_class(task.name).supports_eval_flip:
    raise ConfigError(f"config key 'task.eval_flip' is true, but task '{task.name}' has no images "
                      "to mirror; set task.eval_flip=false.")
  tasks.task_class(task.name).validate(task)
  _validate_data("task.train_data.", task.train_data)
  _validate_data("task.eval_data.", task.eval_data)
  if not 0.0 <= task.label_smoothing < 1.0:
    raise ConfigError("config key 'task.label_smoothing' must be in [0, 1).")
  _check_positive("task.text.sequence_length", task.text.sequence_length)
  _check_positive("task.text.max_predictions", task.text.max_predictions, allow_zero=True)
  if not 0.0 < task.text.mask_rate < 1.0:
    raise ConfigError("config key 'task.text.mask_rate' must be in (0, 1), e.g. 0.15.")
  _check_positive("trainer.global_batch_size", trainer.global_batch_size)
  _check_positive("trainer.eval_batch_size", trainer.eval_batch_size, allow_zero=True)
  _check_positive("trainer.epochs", trainer.epochs, allow_zero=True)
  _check_positive("trainer.max_steps", trainer.max_steps, allow_zero=True)
  _check_positive("trainer.steps_per_loop", trainer.steps_per_loop)
  _check_positive("trainer.gradient_accumulation_steps", trainer.gradient_accumulation_steps)
  _check_positive("trainer.gradient_clip_norm", trainer.gradient_clip_norm, allow_zero=True)
  _check_positive("trainer.optimizer.epsilon", trainer.optimizer.epsilon)
  _check_positive("trainer.eval_every_epochs", trainer.eval_every_epochs)
  _check_positive("trainer.checkpoint_every_steps", trainer.checkpoint_every_steps, allow_zero=True)
  _check_positive("trainer.max_checkpoints", trainer.max_checkpoints)
  _check_positive("trainer.precise_bn_batches", trainer.precise_bn_batches, allow_zero=True)
  if not 0.0 <= trainer.ema_decay < 1.0:
    raise ConfigError(f"config key 'trainer.ema_decay' is {trainer.ema_decay}; it must be in "
                      "[0, 1), e.g. 0.99 (0 turns the average off).")
  _check_choice("trainer.optimizer.name", trainer.optimizer.name, OPTIMIZERS)
  _check_positive("trainer.optimizer.weight_decay", trainer.optimizer.weight_decay, allow_zero=True)
  for key in ("momentum", "beta_1", "beta_2"):
    if not 0.0 <= getattr(trainer.optimizer, key) < 1.0:
      raise ConfigError(f"config key 'trainer.optimizer.{key}' is "
                        f"{getattr(trainer.optimizer, key)}; it must be in [0, 1), e.g. 0.9.")
  lr = trainer.learning_rate
  _check_choice("trainer.learning_rate.schedule", lr.schedule, LR_SCHEDULES)
  _check_positive("trainer.learning_rate.base_lr", lr.base_lr)
  _check_positive("trainer.learning_rate.base_batch_size", lr.base_batch_size)
  _check_positive("trainer.learning_rate.warmup_epochs", lr.warmup_epochs, allow_zero=True)
  _check_positive("trainer.learning_rate.decay_rate", lr.decay_rate)
  _check_positive("trainer.learning_rate.power", lr.power)
  if not 0.0 <= lr.final_lr_fraction <= 1.0:
    raise ConfigError("config key 'trainer.learning_rate.final_lr_fraction' must be in [0, 1].")
  if lr.schedule == "step" and not lr.decay_epochs:
    raise ConfigError("config key 'trainer.learning_rate.decay_epochs' is empty; the step "
                      "schedule needs boundaries such as [30, 60].")
  _check_choice("runtime.strategy", runtime.strategy, STRATEGIES)
  _check_choice("runtime.cross_device_ops", runtime.cross_device_ops, CROSS_DEVICE_OPS)
  _check_choice("runtime.all_reduce", runtime.all_reduce, ALL_REDUCE)
  _check_choice("runtime.mixed_precision", runtime.mixed_precision, PRECISIONS)
  _check_choice("runtime.all_reduce_dtype", runtime.all_reduce_dtype, ("float32", "bfloat16"))
  _check_choice("runtime.all_reduce_order", runtime.all_reduce_order, ("variables", "backward"))
  _check_positive("runtime.heartbeat_timeout_seconds", runtime.heartbeat_timeout_seconds)
  _check_positive("runtime.num_packs", runtime.num_packs)
  for key in ("cpu_replicas", "bytes_per_pack", "collective_timeout_seconds",
              "intra_op_threads", "inter_op_threads", "profile_steps"):
    _check_positive("runtime." + key, getattr(runtime, key), allow_zero=True)
  if runtime.cpu_replicas and runtime.devices:
    raise ConfigError("set either 'runtime.cpu_replicas' or 'runtime.devices', not both.")
  if runtime.strategy in ("default", "one_device") and (runtime.cpu_replicas > 1
                                                        or len(runtime.devices) > 1):
    raise ConfigError(f"runtime.strategy '{runtime.strategy}' runs one replica; set "
                      "runtime.strategy=mirrored to use several devices.")


def per_replica_batch(key: str, batch: int, num_replicas: int) -> int:
  """The global batch is the user's number; every replica (and micro-step) gets an equal share.
  `num_replicas` here counts replicas x gradient accumulation steps."""
  if batch % num_replicas:
    lower = batch - batch % num_replicas
    raise ConfigError(
        f"config key '{key}' is {batch}, which does not split evenly over {num_replicas} "
        f"replicas x accumulation steps; use a multiple of {num_replicas} such as "
        f"{lower or num_replicas}.")
  return batch // num_replicas


def check_batch_divides(config: ExperimentConfig, num_replicas: int) -> None:
  """Before TensorFlow starts, where the replica count is known from the config alone (the
  input plan divides, with the same check, once the strategy is made)."""
  steps = config.trainer.gradient_accumulation_steps
  per_replica_batch("trainer.global_batch_size", config.trainer.global_batch_size,
                    num_replicas * steps)
  per_replica_batch("trainer.eval_batch_size",
                    config.trainer.eval_batch_size or config.trainer.global_batch_size, num_replicas)


def gpus_may_be_visible(env=None) -> bool:
  """False only when this process surely sees no GPU (asked without starting TensorFlow)."""
  from tfdp import gpus  # pylint: disable=g-import-not-at-top
  env = os.environ if env is None else env
  if "CUDA_VISIBLE_DEVICES" in env:
    return bool(gpus.parse_visible_devices(env["CUDA_VISIBLE_DEVICES"]))
  return gpus.count_nvidia_device_files() > 0


def expected_replicas(runtime: RuntimeConfig, num_workers: int = 1,
                      gpus_visible: bool | None = None) -> int | None:
  """Replica count known from the config alone (None when it depends on GPUs found)."""
  per_worker = None
  if num_workers > 1:
    return None  # one replica per worker on CPU, one per GPU otherwise: known once TF runs
  if runtime.cpu_replicas:
    if gpus_may_be_visible() if gpus_visible is None else gpus_visible:
      return None  # GPUs, if TensorFlow finds any, replace CPU replicas (strategy.plan_strategy)
    per_worker = runtime.cpu_replicas
  elif runtime.devices:
    per_worker = len(runtime.devices)
  elif runtime.strategy in ("default", "one_device"):
    per_worker = 1
  if per_worker is None:
    return None
  return per_worker * max(1, num_workers)


def config_to_json(config: ExperimentConfig) -> str:
  return json.dumps(to_dict(config), sort_keys=True)
