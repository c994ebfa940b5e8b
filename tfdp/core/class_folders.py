"""Data laid out as root/<class>/<files> (image folders, text genres): label i is the i-th class
folder in sorted order, so two folders with other classes would label alike names differently."""
from __future__ import annotations

import json
import os
from collections.abc import Callable

from absl import logging

from tfdp.config.schema import DataConfig
from tfdp.errors import DataError

CLASS_NAMES_FILE = "class_names.json"  # a run's classes, in label order, saved in model_dir
NOT_CLASSES = ("__pycache__",)  # beside code, never a class


class SkippedFiles:
  """What a class folder tree holds that trains nothing, said in one warning: a class folder
  without files read (its label never trained), files of other kinds, nested folders (only a
  class folder's own files are read) and files beside the class folders."""

  def __init__(self, root: str, kind: str, extensions: tuple[str, ...]):
    """`kind`: image, text (an image folder, image files)."""
    self.root, self.kind, self.extensions, self.empty, self.kinds = root, kind, extensions, [], {}
    for entry in os.listdir(root):
      if not entry.startswith(".") and os.path.isfile(os.path.join(root, entry)):
        self.kinds["files beside the class folders"] = (
            self.kinds.get("files beside the class folders", 0) + 1)

  def add(self, path: str) -> None:
    if os.path.isdir(path):
      kind, count = "files in nested folders", sum(len(files) for _, _, files in os.walk(path))
    else:
      kind, count = f"'{os.path.splitext(path)[1].lower() or 'no extension'}' files", 1
    self.kinds[kind] = self.kinds.get(kind, 0) + count

  def say(self, classes: list[str]) -> None:
    said = []
    if self.empty:
      said.append(f"class folder(s) {', '.join(repr(n) for n in self.empty)} hold no "
                  f"{self.kind} files, so this folder has no example of their labels")
    if self.kinds:
      said.append("skipped " + ", ".join(f"{n} {k}" for k, n in self.kinds.items()) +
                  f" (read: {'/'.join(self.extensions)} directly in a class folder)")
    if said:
      logging.warning("%s folder '%s' (classes %s): %s", self.kind, self.root,
                      ", ".join(classes), "; ".join(said))


def class_names(root: str) -> list[str]:
  """The class subfolders, sorted. Hidden ones are no class: a Jupyter `.ipynb_checkpoints`
  would be an empty class 0 that shifts every label."""
  return sorted(d for d in os.listdir(root) if not d.startswith(".") and d not in NOT_CLASSES
                and os.path.isdir(os.path.join(root, d)))


def list_class_folders(root: str, kind: str, extensions: tuple[str, ...], example: str,
                       check: Callable[[str], None]) -> tuple[list[str], list[int], list[str]]:
  """(paths, labels, class_names) of root/<class>/<file>, sorted: a class folder's own files that
  end in `extensions` (`kind`: image, text); `check(path)` reads each one, so a broken file is
  named before training starts. What is not read is said in one warning (SkippedFiles)."""
  classes = class_names(root)
  if not classes:
    raise DataError(_no_class_subfolders(root, kind, example))
  paths, labels = [], []
  skipped = SkippedFiles(root, kind, extensions)
  for label, name in enumerate(classes):
    found = len(paths)
    for file in sorted(os.listdir(os.path.join(root, name))):
      path = os.path.join(root, name, file)
      if file.startswith("."):
        continue  # hidden: e.g. macOS's "._cat.jpg" metadata
      if not (file.lower().endswith(extensions) and os.path.isfile(path)):  # a FIFO would hang
        skipped.add(path)
        continue
      check(path)
      paths.append(path)
      labels.append(label)
    if len(paths) == found:
      skipped.empty.append(name)
  if not paths:
    raise DataError(f"{kind} folder '{root}' holds no {'/'.join(extensions)} files in its class "
                    f"subfolders; lay it out as root/<class>/{example}.")
  skipped.say(classes)
  return paths, labels, classes


def check_has_classes(root: str, kind: str, example: str) -> None:
  """Before TensorFlow starts (a source's check): a folder without class subfolders is refused
  in a second, from one listing (list_class_folders reads the files once TensorFlow runs)."""
  if not class_names(root):
    raise DataError(_no_class_subfolders(root, kind, example))


def check_not_one_class(data: DataConfig, key: str) -> None:
  """check_classes_to_learn before TensorFlow starts (Task.check_source of a classifier): a
  training folder of one class folder, or synthetic data of one class (another source's
  num_classes is checked against its labels once it is read)."""
  if data.source in ("image_folder", "text_folder") and os.path.isdir(data.path):
    classes = class_names(data.path)
    if len(classes) == 1:
      raise DataError(_one_class(key, classes[0]))
  elif data.source == "synthetic" and data.num_classes == 1:
    raise DataError(_one_class(key, ""))


def _no_class_subfolders(root: str, kind: str, example: str) -> str:
  return f"{kind} folder '{root}' has no class subfolders; lay it out as root/<class>/{example}."


def check_classes_to_learn(source, key: str = "task.train_data") -> None:
  """One class: its logits are one number, softmax makes it 1, so the loss is 0 and accuracy
  100% from the first step while nothing is learned; refused before anything is written."""
  names = source.info.get("class_names") or []
  if source.num_classes != 1 and len(names) != 1:  # one folder under num_classes=10: one class
    return
  raise DataError(_one_class(key, names[0] if len(names) == 1 else ""))


def _one_class(key: str, folder: str) -> str:
  held = f" (its only class folder is '{folder}')" if folder else ""
  return (f"{key} has one class{held}: a classifier of one class learns nothing (loss 0, "
          "accuracy 100% from the first step); give it two or more classes (one subfolder per "
          "class).")


def saved_classes(source) -> dict:
  """Task.artifacts: the classes a folder source labelled, for a resume or eval to compare."""
  names = source.info.get("class_names")
  return {CLASS_NAMES_FILE: json.dumps(list(names))} if names else {}


def check_saved_classes(config, folder: str, context, source: str) -> None:
  """Task.check_saved_artifacts: a folder with other class folders than the run saved (one
  renamed, added or removed) would relabel every example after it, silently. `source`: the
  folder source (image_folder, text_folder)."""
  saved_path = os.path.join(folder, CLASS_NAMES_FILE)
  if context.warm_start or not os.path.exists(saved_path):
    return
  try:
    with open(saved_path, encoding="utf-8") as f:
      saved = json.load(f)
    if not isinstance(saved, list):
      raise ValueError("not a JSON list")
  except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
    raise DataError(f"{context.action}: the run's saved '{saved_path}' cannot be read ({e}); "
                    f"restore it, or {context.fix}.") from None
  for key, data in (("task.eval_data", config.eval_data), ("task.train_data", config.train_data)):
    if data.source != source or not os.path.isdir(data.path):
      continue  # a split this mode does not read; a missing one is check_source's to report
    found = class_names(data.path)
    if found != saved:
      raise DataError(f"{context.action}: {key}.path '{data.path}' has other class folders than "
                      f"the run trained on ('{saved_path}': "
                      f"{differences(saved, found, 'the folder', 'the run')}), and labels follow "
                      "the sorted folder names; give the folder the run's class subfolders "
                      f"(an empty one is fine), or {context.fix}.")


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
