"""Typed experiment config: the schema, YAML layering, strict checks — one name, `tfdp.config`.

  schema   the dataclasses (task / trainer / runtime) and their choices
  loader   YAML files (and the `base:` files they stand on) and overrides → dataclasses, unknown
           keys and wrong types refused
  checks   impossible values refused, task checks asked of the task

Nothing here imports TensorFlow: every mistake a user can make in a config is caught before
TensorFlow starts.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import yaml
from absl import logging

from tfdp import errors
from tfdp.config import loader
from tfdp.config import checks
from tfdp.config.checks import validate
from tfdp.config.loader import (MAX_CONFIG_BYTES, MAX_CONFIG_VALUES, MAX_INT, MAX_NESTING,
                                check_nesting, load_yaml, parse_overrides, short_repr)
from tfdp.config.schema import *  # noqa: F401,F403  (the dataclasses and choices)
from tfdp.config.schema import ExperimentConfig, ModelConfig
from tfdp.errors import ConfigError  # noqa: F401  (callers raise it as config.ConfigError)


def from_dict(data: dict) -> ExperimentConfig:
  return loader.from_dict(ExperimentConfig, data or {})


def to_dict(config: ExperimentConfig) -> dict:
  return dataclasses.asdict(config)


MODEL_SETTINGS = "model_settings"  # a config file's settings written for its model (README)
MODEL_NAME = ("task", "model", "name")


def load_config(config_files: Sequence[str] = (), overrides: Sequence[str] = ()) -> ExperimentConfig:
  """Defaults, then each YAML file in order (after the files its `base:` names), then each
  override; validated. A file's model_settings follow the model they were written for: when a
  later layer changes task.model.name, they are left out (the layers below them decide those
  keys) and one log line names what was dropped."""
  layers = []  # (where, mapping, (model, its settings) or None)
  for path in config_files:
    for where, data in loader.file_layers(path):
      settings = _model_settings(where, data.pop(MODEL_SETTINGS, None))
      try:
        from_dict(data)  # reject unknown keys naming the file's own mistake early
      except ConfigError as e:
        raise ConfigError(f"config file '{where}': {e}") from None
      layers.append((where, data, settings))
  layers += [(errors.terms().overrides, parse_overrides(text), None) for text in overrides]
  model = _checked_models(layers)
  merged = _merge(layers, lambda written_for: written_for == model)
  stale = [layer for layer in layers if layer[2] and layer[2][0] != model]
  if stale:
    _log_dropped(stale, from_dict(_merge(layers, lambda _: True)), from_dict(merged), model)
  config = from_dict(_home_expanded(merged))
  validate(config)
  checks.warn_unused_slices(config.task)
  checks.warn_unused_keys(config.task)
  return config


def _home_expanded(section: dict) -> dict:
  """`~/data` in a path key (path, data_dir, *_path, init_checkpoint) is the home folder's, as a
  shell would expand it (inside --params_override=... it does not); a model's kwargs as given."""
  return {key: (_home_expanded(value) if isinstance(value, dict) and key != "kwargs"
                else os.path.expanduser(value) if isinstance(value, str) and value.startswith("~")
                and (key in ("path", "data_dir", "init_checkpoint") or key.endswith("_path"))
                else value) for key, value in section.items()}


def _model_name(merged: dict) -> str:
  return loader.get_path(merged, MODEL_NAME) or ModelConfig().name


def _model_settings(where: str, block) -> tuple[str, dict] | None:
  """`model_settings: {airbench: {task: ..., trainer: ...}}` → ("airbench", its settings)."""
  if block is None:
    return None
  if not (isinstance(block, dict) and len(block) == 1
          and isinstance(next(iter(block.values())), dict)):
    raise ConfigError(f"config file '{where}': model_settings must be one model's name over its "
                      f"settings (model_settings: {{airbench: {{task: ...}}}}), got "
                      f"{short_repr(block)}.")
  (model, settings), = block.items()
  if loader.get_path(settings, MODEL_NAME) is not None:
    raise ConfigError(f"config file '{where}': model_settings.{model} sets task.model.name; name "
                      "the model under task.model, outside model_settings.")
  from_dict(settings)
  return str(model), settings


def _checked_models(layers) -> str:
  """The model the run trains (settings never name one). A file's model_settings apply when the
  run trains their model, whichever layer picked it (the command line, a later file); a file
  that names one model itself and writes settings for another the run does not train is a
  mistake, said in one line."""
  merged: dict = {}
  for _, data, _ in layers:
    merged = loader.deep_merge(merged, data)
  model = _model_name(merged)
  for where, data, settings in layers:
    own = loader.get_path(data, MODEL_NAME)
    if settings and own is not None and settings[0] not in (own, model):
      raise ConfigError(f"config file '{where}' trains task.model.name {own} but its "
                        f"model_settings are written for {settings[0]}; rename the "
                        "model_settings entry or delete it.")
  return model


def _merge(layers, applies) -> dict:
  """The layers in order, each file's model_settings right after it where `applies(model)`."""
  merged: dict = {}
  for _, data, settings in layers:
    merged = loader.deep_merge(merged, data)
    if settings and applies(settings[0]):
      merged = loader.deep_merge(merged, settings[1])
  return merged


def _log_dropped(stale_layers, with_settings, without, model: str) -> None:
  """One line per model whose settings were left out, naming each key that changed."""
  before, after = to_dict(with_settings), to_dict(without)
  by_model: dict[str, tuple[list, list]] = {}
  for where, _, (written_for, values) in stale_layers:
    paths, files = by_model.setdefault(written_for, ([], []))
    files.append(where)
    paths.extend(p for p in loader.leaf_paths(values) if p not in paths
                 and loader.get_path(before, p) != loader.get_path(after, p))
  for written_for, (paths, files) in by_model.items():
    if paths:
      logging.info("config: task.model.name changed %s → %s: dropped %s (written for %s in %s)",
                   written_for, model, loader.describe_paths(paths), written_for,
                   ", ".join(files))


def dump_yaml(config: ExperimentConfig, transform=None) -> str:
  """`transform(dict) -> dict`: what the task records of it (Task.recorded_config)."""
  data = to_dict(config)
  return yaml.safe_dump(transform(data) if transform else data, sort_keys=False,
                        default_flow_style=None)


def config_to_json(config: ExperimentConfig) -> str:
  return json.dumps(to_dict(config), sort_keys=True)
