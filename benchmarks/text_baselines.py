"""The baselines the text results are measured against, from the configs' own data.

  python benchmarks/text_baselines.py [configs/shakespeare_mlm.yaml configs/shakespeare_genre.yaml]

masked_lm: the accuracy of always predicting the most frequent token (masking picks tokens
uniformly among non-special ones, so this is that token's share of the evaluation tokens).
text_classification: the accuracy of always predicting the most frequent class of the
evaluation examples (speeches, passages or documents, as the config's text_unit cuts them).
"""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfdp import cli  # pylint: disable=wrong-import-position
from tfdp import config as config_lib  # pylint: disable=wrong-import-position
from tfdp import tasks  # pylint: disable=wrong-import-position
from tfdp import text  # pylint: disable=wrong-import-position
from tfdp import text_tasks  # pylint: disable=wrong-import-position


def main(paths):
  for path in paths:
    config = config_lib.load_config([cli.find_config(path)])
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
      source = task.build_source(config.task.eval_data)  # speeches, passages, documents
      labels = [int(example["label"]) for example in source.read([0]).as_numpy_iterator()]
      classes = source.info["class_names"]
      label, count = collections.Counter(labels).most_common(1)[0]
      print(f"{path}: majority class {classes[label]!r}: accuracy {count / len(labels):.4f} "
            f"({len(labels)} evaluation examples)")


if __name__ == "__main__":
  main(sys.argv[1:] or ["configs/shakespeare_mlm.yaml", "configs/shakespeare_genre.yaml"])
