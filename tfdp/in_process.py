"""What the library's runs in the caller's own process (tfdp.fit, tfdp.train: a notebook) share:
their `params` as the config loader's overrides, and the caller's process-wide state kept."""
from __future__ import annotations

import contextlib

import yaml

from tfdp import config as config_lib
from tfdp.errors import ConfigError


def overrides(params) -> list[str]:
  """`params` as the config loader's --params_override texts: one string ("a.b=v,c=w"), a dict,
  or a list of them (one override each, later ones winning)."""
  if not params:
    return []
  items = list(params) if isinstance(params, (list, tuple)) else [params]
  wrong = [item for item in items if not isinstance(item, (str, dict))]
  if wrong:
    raise ConfigError(
        f"params holds {config_lib.short_repr(wrong[0])} (type {type(wrong[0]).__name__}); pass "
        "'a.b=v,c=w', a dict, or a list of 'a.b=v' strings.")
  return [item if isinstance(item, str) else yaml.safe_dump(plain(item)) for item in items if item]


def plain(value):
  """numpy scalars (np.int64(2)) as Python's, in dicts and lists too: YAML cannot represent
  them (a bare RepresenterError), and Keras takes them wherever it takes a number."""
  if isinstance(value, dict):
    return {key: plain(item) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [plain(item) for item in value]
  if type(value).__module__ == "numpy" and hasattr(value, "item"):
    return value.item()
  return value


def whole_number(name: str, value, minimum: int = 1, caller: str = "tfdp.fit") -> int:
  """A whole number as Keras takes it: a numpy integer (np.int64(5)) too."""
  import numbers  # pylint: disable=g-import-not-at-top
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ConfigError(f"{caller}: {name} must be a whole number ≥ {minimum}, got {value!r}.")
  return int(value)


@contextlib.contextmanager
def users_state_kept():
  """A run sets process-wide state for itself: the trainer's precision as Keras's global dtype
  policy, experiment.build's seed for numpy's, Python's, Keras's and TensorFlow's random. In a
  notebook that state is the user's: theirs again afterwards, or a model built in a later cell
  computes in bfloat16 and their random streams (and unseeded initializers) restart from
  tfdp's seed. Keras not loaded yet (a fresh kernel) has its own defaults to go back to, and
  TensorFlow is not started here: a run refused before it starts answers in a second."""
  import random  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  numpy_state, python_state = np.random.get_state(), random.getstate()
  policy, seeds = None, (None, None, None)  # Keras's and TensorFlow's defaults
  if "keras" in sys.modules:
    import keras  # pylint: disable=g-import-not-at-top
    policy, seeds = keras.config.dtype_policy(), compat.seed_state()
  try:
    yield
  finally:
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    if "keras" in sys.modules:
      import keras  # pylint: disable=g-import-not-at-top
      keras.config.set_dtype_policy(policy or keras.config.floatx())
      compat.restore_seed_state(seeds)
