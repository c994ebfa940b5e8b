"""YAML files and --params_override text → nested mappings → dataclasses, strictly.

Generic: it knows no tfdp schema (the dataclass type is an argument), so its one-line errors
name key paths of whatever config it builds.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from typing import Any

import yaml

from tfdp import errors
from tfdp.errors import ConfigError

MAX_INT = 2**31 - 1  # what TensorFlow's int32 shapes and counters hold
MAX_NESTING = 32  # configs are a few levels deep; deeper is a mistake (or an attack)
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000
# Names the config tfdp-train and tfdp-bench load when no --config_file is given (tfdp.paths).
DEFAULT_CONFIG_VARIABLE = "TFDP_DEFAULT_CONFIG"


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


def _field_for(cls: type, value: Any, key: str) -> str:
  """A scalar given for a mapping (trainer.learning_rate=0.01): the key of that mapping it was
  likely meant for, its first of the value's type (base_lr, a float; optimizer.name, a str)."""
  hints = typing.get_type_hints(cls)
  for field in dataclasses.fields(cls):
    if type(value) in (int, float, str) and hints[field.name] in (
        (int, float) if type(value) in (int, float) else (str,)):
      return f"; did you mean {key}.{field.name}={_yaml_text(value)}?"
  return ""


def _coerce(value: Any, tp: Any, key: str) -> Any:
  """Returns value as type tp, or raises ConfigError naming key."""
  origin = typing.get_origin(tp)
  if dataclasses.is_dataclass(tp):
    if value is None:
      value = {}
    if not isinstance(value, dict):
      raise ConfigError(f"config key '{key}' must be a mapping of keys, got {short_repr(value)}"
                        f"{_field_for(tp, value, key) or '.'}")
    return from_dict(tp, value, key + ".")
  if origin is list:
    (item_tp,) = typing.get_args(tp)
    if value is None or value == "":  # `a.b=` or `b:` with nothing: none, not one empty item
      value = []
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


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
  """data (a nested mapping) → an instance of the dataclass cls; unknown keys and wrong types
  are one-line errors naming the key path."""
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  kwargs = {}
  for key, value in data.items():
    if key not in names:
      if isinstance(key, str) and key.split(".")[0] in names:
        raise ConfigError(f"config key '{prefix}{key}' is a dotted path inside a YAML mapping, "
                          f"where keys nest; write {_nested(prefix + key, value)}, or "
                          f"{prefix}{key}={_yaml_text(value)} in {errors.terms().overrides}.")
      close = difflib.get_close_matches(str(key), names, n=1)
      hint = f"did you mean '{prefix}{close[0]}'?" if close else f"known keys: {', '.join(names)}."
      raise ConfigError(f"unknown config key '{prefix}{key}'; {hint}")
    kwargs[key] = _coerce(value, hints[key], prefix + key)
  return cls(**kwargs)


def _yaml_text(value: Any) -> str:
  """A value as a user would write it in YAML (`resnet8`, not `'resnet8'`), kept short."""
  if value is None or isinstance(value, (str, int, float, bool)):
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("...\n").strip()[:40]
  return short_repr(value, 40)


def _nested(dotted: str, value: Any) -> str:
  """`a.b` and 1 → `{a: {b: 1}}`, the YAML mapping that a dotted key means."""
  text = _yaml_text(value)
  for key in reversed(dotted.split(".")):
    text = f"{{{key}: {text}}}"
  return text


def deep_merge(base: dict, override: dict) -> dict:
  """override layered on base: mappings merge key by key. A model's `kwargs` (its arguments fit
  only that model) are replaced whole by a layer that names another model or gives `{}` (the
  model's own defaults), and otherwise merge argument by argument
  (`task.model.kwargs.dirac_init=true` keeps the file's widths)."""
  merged = dict(base)
  renamed = "name" in override and override["name"] != base.get("name")
  for key, value in override.items():
    if isinstance(value, dict) and isinstance(merged.get(key), dict):
      if key != "kwargs":
        merged[key] = deep_merge(merged[key], value)
      else:
        merged[key] = dict(value) if renamed or not value else {**merged[key], **value}
    else:
      merged[key] = value
  return merged


def _split_top_level(text: str, sep: str = ",") -> list[str]:
  """Splits on sep outside brackets and quotes, so `a=[1,2],b=x` is two overrides."""
  parts, depth, quote, current, last = [], 0, "", [], ""
  for ch in text:
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"" and last in "=[{(,:":  # a value's opening quote: not an apostrophe inside
      quote = ch  # one (runs/o'brien.csv swallowed the next override)
    elif ch in "[{(":
      depth += 1
    elif ch in "]})":
      depth -= 1
    elif ch == sep and depth == 0:
      parts.append("".join(current))
      current, last = [], ""
      continue
    current.append(ch)
    last = ch if not ch.isspace() else last
  parts.append("".join(current))
  return [p.strip() for p in parts if p.strip()]


def parse_overrides(text: str) -> dict:
  """`a.b=1,c.d=x` or a YAML/JSON mapping → nested dict."""
  text = text.strip()
  if not text:
    return {}
  if len(text) > MAX_CONFIG_BYTES:
    raise ConfigError(f"{errors.terms().overrides} is {len(text)} characters long; put settings "
                      "that large in a config file.")
  if text.startswith("{") or "\n" in text or (":" in text and "=" not in text):
    data = _safe_load(text, errors.terms().overrides)
    if not isinstance(data, dict):
      raise ConfigError(f"{errors.terms().overrides} must be a mapping or a.b=1 pairs, got "
                        f"{short_repr(text)}.")
    check_nesting(data, errors.terms().overrides)
    return data
  result: dict = {}
  items = _split_top_level(text)
  for i, item in enumerate(items):
    if "=" not in item:
      comma = (f" (if it is the rest of '{items[i - 1]}', whose value holds a comma, quote that "
               f"value: {items[i - 1].split('=', 1)[0]}=\"{items[i - 1].split('=', 1)[1]},{item}\")"
               if i and "=" in items[i - 1] else "")
      raise ConfigError(f"{errors.terms().overrides} item '{item}' has no '='; write it as "
                        f"key.path=value{comma}.")
    path, raw = item.split("=", 1)
    keys = path.strip().split(".")
    if len(keys) > MAX_NESTING:
      raise ConfigError(f"{errors.terms().overrides} key '{short_repr(path)}' is nested more than "
                        f"{MAX_NESTING} levels deep; tfdp keys are a few levels (a.b.c).")
    if not all(keys):
      raise ConfigError(f"{errors.terms().overrides} key '{path}' is malformed; write it as "
                        "a.b.c=value.")
    try:
      value = (_safe_load(raw, f"{errors.terms().overrides} value of '{path}'") if raw.strip()
               else "")
    except DuplicateKeyError:
      raise
    except ConfigError:
      value = raw  # not YAML: the plain string
    check_nesting(value, f"{errors.terms().overrides} value of '{path}'")
    node = result
    for k in keys[:-1]:
      node = node.setdefault(k, {})
      if not isinstance(node, dict):
        raise ConfigError(f"{errors.terms().overrides} sets '{path}' and a key inside it; keep "
                          "one.")
    node[keys[-1]] = value  # a key set again later wins, as a later --params_override does
  return result


class DuplicateKeyError(ConfigError):
  """A YAML mapping names one key twice."""


class _StrictLoader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
  """yaml.SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last one
  and silently drops the first (a whole `trainer:` block, say)."""

  def compose_mapping_node(self, anchor):
    node = super().compose_mapping_node(anchor)
    first_line: dict = {}
    for key_node, _ in node.value:  # as written: `<<:` merges add their keys only when built
      if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
        continue
      key = self.construct_object(key_node)  # `1` and `01`, `true` and `True` are one key
      line = key_node.start_mark.line + 1
      if key in first_line:
        lines = f"line {line}" if line == first_line[key] else f"lines {first_line[key]} and {line}"
        raise DuplicateKeyError(f"gives the key '{str(key)[:40]}' twice in one mapping ({lines}); "
                                "merge the two into one")
      first_line[key] = line
    return node


# YAML 1.2's booleans and numbers (its core schema): YAML 1.1 (PyYAML's default) reads
# on/off/yes/no as true/false, so `shard_policy: off` arrived as False; `1e-5` (no dot) as a
# string, refused where a number was meant (task.model.kwargs.l2=1e-5); `010` as 8 and `1:30`
# as 90. A bool setting given `yes` is then a one-line error.
_YAML_1_1_ONLY = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML_1_1_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:bool",
                                    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"),
                                    list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+.0123456789"))
_StrictLoader.add_constructor(  # base 10 always: YAML 1.2 has no 1.1 octal `010`
    "tag:yaml.org,2002:int", lambda loader, node: int(loader.construct_scalar(node), 10))


def _safe_load(text: str, where: str) -> Any:
  """yaml.safe_load, refusing repeated keys, with one-line errors; PyYAML recurses once per
  nesting level."""
  try:
    return yaml.load(text, Loader=_StrictLoader)  # nosec: a SafeLoader
  except DuplicateKeyError as e:
    raise DuplicateKeyError(f"{where} {e}.") from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}" if mark else ""
    raise ConfigError(f"{where} is not valid YAML{at} ({short_repr(str(e).splitlines()[0])}); "
                      "fix its syntax.") from None
  except (ValueError, OverflowError) as e:  # a scalar that looks like a date but is none
    raise ConfigError(f"{where} is not valid YAML ({short_repr(str(e))}); fix the value, or "
                      "quote it to mean a string.") from None
  except RecursionError:
    raise _too_deep(where) from None


def load_yaml(path: str) -> dict:
  if os.path.isdir(path):
    raise ConfigError(f"config file '{path}' is a directory; give the path of a YAML file in it, "
                      "e.g. configs/cifar10_quick.yaml.")
  if not os.path.isfile(path):
    if path == os.environ.get(DEFAULT_CONFIG_VARIABLE):
      raise ConfigError(f"config file '{path}' does not exist; it is named by the environment "
                        f"variable {DEFAULT_CONFIG_VARIABLE}: fix or unset it, or pass "
                        f"{errors.terms().config_files}.")
    raise ConfigError(f"config file '{path}' does not exist; check the "
                      f"{errors.terms().config_files} path.")
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
  if data is None:  # an empty file (or comments only) would run the schema's defaults unsaid
    raise ConfigError(f"config file '{path}' is empty (it holds no settings); give it settings "
                      "(a job of your own: base: base.yaml and what you change), or leave it out.")
  if not isinstance(data, dict):
    raise ConfigError(f"config file '{path}' must hold a mapping with task/trainer/runtime keys.")
  check_nesting(data, f"config file '{path}'")
  return data


BASE_KEY = "base"  # a config file's `base: other.yaml`: that file is loaded first, this one on it
MAX_BASES = 8  # a chain of bases longer than this is a mistake (or a loop)


def file_layers(path: str) -> list[tuple[str, dict]]:
  """path's mapping and those of the files its `base:` names (relative to its folder), the
  deepest base first: (path, mapping) each, the `base` key removed."""
  layers, chain = [], []
  while path:
    real = os.path.realpath(path)
    if real in chain:
      raise ConfigError(f"config file '{path}' is its own base (through {len(chain)} base: lines); "
                        "remove the base: line that loops.")
    if len(chain) >= MAX_BASES:
      raise ConfigError(f"config file '{layers[0][0]}' has more than {MAX_BASES} bases in a chain; "
                        "layer fewer files.")
    chain.append(real)
    data = load_yaml(path)
    base = data.pop(BASE_KEY, None)
    layers.insert(0, (path, data))
    if base is not None and (not isinstance(base, str) or not base.strip()):
      raise ConfigError(f"config file '{path}': base must name a YAML file (e.g. base: base.yaml), "
                        f"got {short_repr(base)}.")
    if base is not None:
      base_path = os.path.join(os.path.dirname(path), base.strip())
      if os.path.isdir(base_path):
        raise ConfigError(f"config file '{path}' names base '{base}', which is a folder "
                          f"({os.path.abspath(base_path)}); name a YAML file in it, e.g. "
                          f"base: {os.path.join(base.strip(), 'base.yaml')}.")
      if not os.path.isfile(base_path):
        raise ConfigError(f"config file '{path}' names base '{base}', which is not there "
                          f"({os.path.abspath(base_path)}: a base is found beside the file "
                          "that names it); copy it there or fix the base: line.")
      base = base_path
    path = base
  return layers


def get_path(data: dict, keys: tuple[str, ...], default: Any = None) -> Any:
  for key in keys:
    if not isinstance(data, dict) or key not in data:
      return default
    data = data[key]
  return data


def leaf_paths(data: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
  """The key paths deep_merge sets one by one (a `kwargs` mapping is one value)."""
  paths = []
  for key, value in data.items():
    if isinstance(value, dict) and value and key != "kwargs":
      paths.extend(leaf_paths(value, prefix + (key,)))
    else:
      paths.append(prefix + (key,))
  return paths


def describe_paths(paths: list[tuple[str, ...]]) -> str:
  """`a.b.c, a.b.d, e` → `a.b.{c, d}, e`: one short line."""
  groups: dict[tuple[str, ...], list[str]] = {}
  for keys in paths:
    groups.setdefault(keys[:-1], []).append(keys[-1])
  parts = []
  for parent, names in groups.items():
    dotted = ".".join(parent) + "." if parent else ""
    parts.append(dotted + (names[0] if len(names) == 1 else "{" + ", ".join(names) + "}"))
  return ", ".join(parts)
