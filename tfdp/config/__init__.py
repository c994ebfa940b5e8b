"""Typed experiment config: the schema, YAML layering, strict checks — one name, `tfdp.config`.

  schema   the dataclasses (task / trainer / runtime) and their choices
  loader   YAML files and overrides → dataclasses, unknown keys and wrong types refused
  checks   impossible values refused, task checks asked of the task

Nothing here imports TensorFlow: every mistake a user can make in a config is caught before
TensorFlow starts.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import yaml

from tfdp.config import loader
from tfdp.config.checks import validate
from tfdp.config.loader import (MAX_CONFIG_BYTES, MAX_CONFIG_VALUES, MAX_INT, MAX_NESTING,
                                check_nesting, load_yaml, parse_overrides, short_repr)
from tfdp.config.schema import *  # noqa: F401,F403  (the dataclasses and choices)
from tfdp.config.schema import ExperimentConfig
from tfdp.errors import ConfigError  # noqa: F401  (callers raise it as config.ConfigError)


def from_dict(data: dict) -> ExperimentConfig:
  return loader.from_dict(ExperimentConfig, data or {})


def to_dict(config: ExperimentConfig) -> dict:
  return dataclasses.asdict(config)


def load_config(config_files: Sequence[str] = (), overrides: Sequence[str] = ()) -> ExperimentConfig:
  """Defaults, then each YAML file in order, then each override; validated."""
  merged: dict = {}
  for path in config_files:
    layer = load_yaml(path)
    from_dict(layer)  # reject unknown keys naming the file's own mistake early
    merged = loader.deep_merge(merged, layer)
  for text in overrides:
    merged = loader.deep_merge(merged, parse_overrides(text))
  config = from_dict(merged)
  validate(config)
  return config


def dump_yaml(config: ExperimentConfig, transform=None) -> str:
  """`transform(dict) -> dict`: what the task records of it (Task.recorded_config)."""
  data = to_dict(config)
  return yaml.safe_dump(transform(data) if transform else data, sort_keys=False,
                        default_flow_style=None)


def config_to_json(config: ExperimentConfig) -> str:
  return json.dumps(to_dict(config), sort_keys=True)
