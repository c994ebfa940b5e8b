"""The baselines the text results are measured against, from the configs' own data.

  python benchmarks/text_baselines.py [configs/shakespeare_mlm.yaml configs/shakespeare_genre.yaml]
  python benchmarks/text_baselines.py configs/shakespeare_genre.yaml --params_override=...

masked_lm: the accuracy of always predicting the most frequent token (masking picks tokens
uniformly among non-special ones, so this is that token's share of the evaluation tokens).
text_classification: the accuracy of always predicting the most frequent class of the
evaluation examples (speeches, passages or documents, as the config's text_unit cuts them), and
of a bag-of-words naive Bayes classifier (add-one smoothing) over the same WordPiece tokens of the
same training examples: how much class signal the examples carry without any encoder.
"""
import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfdp import cli  # pylint: disable=wrong-import-position
from tfdp import config as config_lib  # pylint: disable=wrong-import-position
from tfdp.core import task as tasks  # pylint: disable=wrong-import-position
from tfdp.workloads.text import inputs as text  # pylint: disable=wrong-import-position
from tfdp.workloads.text import tasks as text_tasks  # pylint: disable=wrong-import-position


def examples(task, data):
  """(token ids [n, length], labels [n]) of a text_classification split, as training sees them."""
  rows = list(task.build_source(data).read([0]).as_numpy_iterator())
  return (np.stack([r["token_ids"] for r in rows]), np.asarray([int(r["label"]) for r in rows]))


def naive_bayes_accuracy(train_ids, train_labels, eval_ids, eval_labels, num_classes,
                         vocabulary_size):
  """Multinomial naive Bayes on token counts (reserved tokens ignored), add-one smoothing."""
  counts = np.ones((num_classes, vocabulary_size))
  real = train_ids >= len(text.RESERVED_TOKENS)
  np.add.at(counts, (np.broadcast_to(train_labels[:, None], train_ids.shape)[real],
                     train_ids[real]), 1)
  log_p = np.log(counts / counts.sum(1, keepdims=True))
  log_p[:, :len(text.RESERVED_TOKENS)] = 0.0
  log_prior = np.log(np.bincount(train_labels, minlength=num_classes) / len(train_labels))
  scores = log_p[:, eval_ids].sum(-1).T + log_prior  # [n, classes]
  return float(np.mean(scores.argmax(-1) == eval_labels))


def main(paths, overrides=()):
  for path in paths:
    config = config_lib.load_config([cli.find_config(path)], overrides)
    task = tasks.make_task(config.task)
    if config.task.name == "masked_lm":
      source = task.build_source(config.task.eval_data)
      tokens = collections.Counter()
      for example in source.read([0]).as_numpy_iterator():
        tokens.update(int(t) for t in example["token_ids"] if t >= len(text.RESERVED_TOKENS))
      token, count = tokens.most_common(1)[0]
      vocab = text.read_vocabulary(text_tasks.vocab_path(config.task))
      print(f"{path}: most frequent token {vocab[token]!r}: accuracy {count / sum(tokens.values()):.4f} "
            f"({sum(tokens.values())} evaluation tokens)")
    else:
      eval_ids, eval_labels = examples(task, config.task.eval_data)  # speeches, passages, ...
      classes = task.build_source(config.task.eval_data).info["class_names"]
      label, count = collections.Counter(eval_labels.tolist()).most_common(1)[0]
      print(f"{path}: majority class {classes[label]!r}: accuracy {count / len(eval_labels):.4f} "
            f"({len(eval_labels)} evaluation examples)")
      train_ids, train_labels = examples(task, config.task.train_data)
      accuracy = naive_bayes_accuracy(train_ids, train_labels, eval_ids, eval_labels, len(classes),
                                      task.vocabulary_size)
      print(f"{path}: bag-of-words naive Bayes (trained on the {len(train_labels)} training "
            f"examples): accuracy {accuracy:.4f}")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("configs", nargs="*",
                      default=["configs/shakespeare_mlm.yaml", "configs/shakespeare_genre.yaml"])
  parser.add_argument("--params_override", action="append", default=[])
  args = parser.parse_args()
  main(args.configs, args.params_override)
