"""Warm start (`task.init_checkpoint`): find another run's checkpoint, restore part of a model.

No TensorFlow at import; tasks call `restore_into` from their `warm_start`.
"""
from __future__ import annotations

import glob
import os
import re
import tempfile

from tfdp import paths
from tfdp.core import outputs
from tfdp.config.loader import short_repr
from tfdp.errors import ConfigError, OutputError


def find_init_checkpoint(path: str) -> str:
  """task.init_checkpoint as given: a run's model_dir, its checkpoints/ folder, or a checkpoint
  prefix (ckpt-N). Returns the checkpoint prefix; a one-line error when there is none."""
  given, path = path, os.path.abspath(os.path.expanduser(path))
  if not os.path.exists(path) and not os.path.exists(path + ".index"):
    parent, name = os.path.split(path)
    near = sorted(n for n in (os.listdir(parent) if os.path.isdir(parent) else ())
                  if n.startswith(name))  # a smoke run's folder: runs/<job>+runlocal_text
    raise ConfigError(f"task.init_checkpoint '{given}' does not exist{paths.looked_in(given)}"
                      f"{'; ' + parent + ' holds ' + ', '.join(near[:3]) if near else ''}; give "
                      "the model_dir of a finished run, or a checkpoint prefix.")
  if "[" in path:  # as in a model_dir (outputs.resolve_model_dir): `[0]` matches "0" only
    raise ConfigError(f"task.init_checkpoint '{path}' holds '[', which TensorFlow's checkpoint "
                      "reader takes for a glob pattern, so it cannot be read there; rename the "
                      "folder or link it from a path without '['.")
  for folder in (os.path.join(path, outputs.CHECKPOINT_DIR), path):
    if os.path.isfile(os.path.join(folder, "checkpoint")):  # the one a resume there would take
      try:
        return outputs.named_checkpoint(folder)
      except OutputError as e:
        raise ConfigError(f"task.init_checkpoint '{path}': {str(e).split('; ')[0]}; point it at "
                          "a checkpoint prefix (ckpt-N) whose files are all there.") from None
    indexes = glob.glob(os.path.join(glob.escape(folder), "ckpt-*.index"))
    steps = [int(m.group(1)) for p in indexes if (m := re.search(r"ckpt-(\d+)\.index$", p))]
    if steps:  # copied checkpoints without their state file: the newest
      return os.path.join(folder, f"ckpt-{max(steps)}")
  if os.path.exists(path + ".index"):
    return path
  raise ConfigError(f"task.init_checkpoint '{path}' holds no checkpoint (ckpt-N.index); give the "
                    "model_dir of a finished run, or a checkpoint prefix.")


def _trained_setting(run_folder: str, section: str, key: str):
  """`section.key` in the config.yaml of the run in `run_folder` (None where none is readable)."""
  import yaml  # pylint: disable=g-import-not-at-top
  try:
    with open(os.path.join(run_folder, outputs.CONFIG_FILE), "rb") as f:
      return (yaml.safe_load(f.read(1 << 20)) or {}).get(section, {}).get(key)
  except (OSError, ValueError, AttributeError, yaml.YAMLError):
    return None


def trained_task(run_folder: str) -> str | None:
  """task.name of the run in `run_folder`: a warm start from a run of another task is refused
  by name, before TensorFlow starts."""
  name = _trained_setting(run_folder, "task", "name")
  return name if isinstance(name, str) else None


def run_folder(checkpoint_path: str) -> str:
  """The folder of the run a checkpoint prefix (found by find_init_checkpoint) belongs to: the
  one holding its config.yaml and other files."""
  folder = os.path.dirname(checkpoint_path)
  return os.path.dirname(folder) if os.path.basename(folder) == outputs.CHECKPOINT_DIR else folder


def say_raw_weights(checkpoint_path: str) -> None:
  """A run trained with trainer.ema_decay evaluated and exported the weights' moving average,
  but its checkpoint's model holds the raw weights, which a warm start restores: said (a probe
  found the raw ones taken silently)."""
  folder = run_folder(checkpoint_path)
  decay = _trained_setting(folder, "trainer", "ema_decay")
  if isinstance(decay, (int, float)) and decay > 0:
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning("warm start: %s trained with trainer.ema_decay=%g; its raw weights are "
                    "restored, not the moving average its evaluation and model.keras hold",
                    folder, decay)


def restore_into(checkpoint_path: str, root, what: str, under: tuple[str, ...],
                 trained_by: str = "a run that trained this model's kind") -> None:
  """Restores `root` (a tf.train.Checkpoint tree naming where its objects sit in the other
  run's checkpoint; `under`: the child names to the restored part) for task.init_checkpoint; a
  mismatch is one line naming the variable: a value of another shape, one the checkpoint lacks,
  or one it holds that this model has no place for (a deeper encoder's layer)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  key, fix = "task.init_checkpoint", "use the same task.model.kwargs (and id mapping) as that run"
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  try:
    theirs = compat.checkpoint_variable_paths(checkpoint_path, under)
  except Exception:  # pylint: disable=broad-except  (unreadable: the restore below says how)
    theirs = None
  if theirs == set():  # nothing where this model's part sits: another task's run
    raise ConfigError(f"{key} '{checkpoint_path}' holds nothing for {what} (no object at "
                      f"{'/'.join(under)}); point it at {trained_by}.")
  try:
    root.read(checkpoint_path).expect_partial().assert_existing_objects_matched()
  except ValueError as e:  # a shape differs: TF names the variable and both shapes
    raise ConfigError(f"{key} '{checkpoint_path}' does not fit {what}: "
                      f"{short_repr(str(e).splitlines()[0], 300)}; {fix}.") from None
  except AssertionError as e:  # variables the checkpoint has no value for
    found = re.search(r"path=([^,]+), shape=\(([^)]*)\)", str(e))
    missing = f"{found.group(1)} (shape {found.group(2)})" if found else "some variables"
    raise ConfigError(f"{key} '{checkpoint_path}' has no value for {what}'s variable {missing}; "
                      f"{fix}.") from None
  except (tf.errors.OpError, OSError) as e:  # a data file gone or damaged
    raise ConfigError(f"{key} '{checkpoint_path}' cannot be read ({type(e).__name__}: "
                      f"{short_repr(str(e).splitlines()[0], 200)}); point it at a run whose "
                      "checkpoint files are whole.") from None
  try:
    with tempfile.TemporaryDirectory() as folder:  # this model's paths, written as the other's
      own = compat.checkpoint_variable_paths(root.write(os.path.join(folder, "own")), under)
  except Exception as e:  # pylint: disable=broad-except  (a full /tmp: restored, but unchecked)
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning("warm start: restored, but not checked for variables this model lacks (%s)",
                    short_repr(str(e), 200))
    return
  unused = sorted((theirs or set()) - own)
  if unused:
    raise ConfigError(f"{key} '{checkpoint_path}' holds {len(unused)} variable(s) of {what} that "
                      f"this model has no place for (e.g. {unused[0]}): it would start from part "
                      f"of that run; {fix}.")
