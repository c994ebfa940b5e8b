"""The library API: `fit` (a compiled Keras model, Keras's arguments: tfdp.compiled.fit) and
`train` (a config-defined run of any task), in this process."""
from __future__ import annotations

import os

from tfdp import config as config_lib
from tfdp import errors
from tfdp import in_process
from tfdp.core import outputs


def fit(*args, **kwargs):
  """See tfdp.compiled.fit.fit: a compiled Keras model and Keras's fit arguments."""
  from tfdp.compiled import fit as fit_lib  # pylint: disable=g-import-not-at-top
  return fit_lib.fit(*args, **kwargs)


def train(config_files=(), params: str | dict | list = "", *, model_dir: str,
          mode: str = "train_and_eval", verbose=True, start_over: bool = False) -> dict:
  """What `tfdp-train --config_file=... --params_override=... [--start_over]` runs, in this
  process (a notebook): any task, its data from the config. `config_files`: a path or a list of
  them; none gives the schema's defaults (tfdp-train's default job is
  configs/cifar10_quick.yaml: name it to run that). `params`: "a.b=v,c=w", a dict, or a list
  of either (as several --params_override). Returns a dict: the final metrics, the trainer (its
  `.model`) and `history`, a pandas DataFrame of metrics.csv."""
  from tfdp import cli  # pylint: disable=g-import-not-at-top
  if isinstance(config_files, (str, os.PathLike)):
    config_files = [config_files]
  with errors.speaking_as(TRAIN_TERMS):
    bad = [p for p in config_files if not isinstance(p, (str, os.PathLike))]
    if bad:  # os.fspath's bare TypeError otherwise
      raise config_lib.ConfigError(f"config_files holds {bad[0]!r}; give config file paths (a "
                                   "path or a list of paths).")
    config = config_lib.load_config([cli.find_config(os.fspath(p)) for p in config_files],
                                    in_process.overrides(params))
    from tfdp.core import experiment  # pylint: disable=g-import-not-at-top
    # TensorFlow starts in experiment.build, after the checks that need none (as tfdp-train's).
    with in_process.users_state_kept():
      return _finished(experiment.run(config, model_dir, mode, verbose=verbose,
                                      start_over=start_over))


TRAIN_TERMS = errors.Terms(
    "tfdp.train", "model_dir", f"pass start_over=True {errors.START_OVER_DOES}", "params",
    "config_files",
    "tfdp.train(start_over=True): the earlier run in %s was moved to %s",
    "checkpoint saved in {model_dir}; call tfdp.train with the same model_dir to resume",
    mode="mode", evaluate_it="mode='eval' evaluates it")


def _finished(result: dict) -> dict:
  """A run's result with its history; the training iterator released without stalling."""
  from tfdp.core import controller  # pylint: disable=g-import-not-at-top
  controller.release_in_background(result["trainer"])
  metrics_csv = os.path.join(result["model_dir"], outputs.METRICS_FILE)
  import pandas as pd  # pylint: disable=g-import-not-at-top
  result["history"] = pd.read_csv(metrics_csv) if os.path.exists(metrics_csv) else pd.DataFrame()
  return result
