"""Data laid out as root/<class>/<files> (image folders, text genres): label i is the i-th class
folder in sorted order, so two folders with other classes would label alike names differently."""
from __future__ import annotations

import os

from tfdp.config.schema import DataConfig
from tfdp.errors import DataError


def class_names(root: str) -> list[str]:
  """The class subfolders, sorted. Hidden ones are no class: a Jupyter `.ipynb_checkpoints`
  would be an empty class 0 that shifts every label."""
  return sorted(d for d in os.listdir(root)
                if not d.startswith(".") and os.path.isdir(os.path.join(root, d)))


def differences(expected: list[str], found: list[str], found_in: str, expected_in: str) -> str:
  quoted = lambda names: ", ".join(f"'{n}'" for n in names)  # noqa: E731
  missing = [c for c in expected if c not in found]
  extra = [c for c in found if c not in expected]
  return "; ".join(([f"{found_in} lacks {quoted(missing)}"] if missing else []) +
                   ([f"it has {quoted(extra)}, which {expected_in} lacks"] if extra else []) or
                   ["the same names, in another order"])  # a saved list edited by hand


def check_eval_classes(train: DataConfig, evaluation: DataConfig, source: str, kind: str) -> None:
  """An eval folder without one of training's classes (a, c for a, b, c) would score its 'c' as
  the model's 'b', silently. `source`: the folder source both read; `kind`: images, texts."""
  if not (train.source == evaluation.source == source and os.path.isdir(train.path)
          and os.path.isdir(evaluation.path)):
    return  # a folder that is missing is check_source's to report
  trained, evaluated = class_names(train.path), class_names(evaluation.path)
  if trained == evaluated:
    return
  raise DataError(f"task.eval_data.path '{evaluation.path}' and task.train_data.path "
                  f"'{train.path}' have different class folders "
                  f"({differences(trained, evaluated, 'the eval folder', 'training')}), and labels "
                  f"follow the sorted folder names, so eval {kind} would be scored as other "
                  "classes; give the eval folder the same class subfolders as the training folder "
                  "(an empty one is fine).")
