"""Text workloads on keras-hub's BERT: masked-LM pre-training and text classification.

Both read text from a folder (`root/<label>/*.txt|*.md`) or files (a glob), tokenize it once
with a WordPiece vocabulary (tfdp-vocab learns one; configs/vocab ships Shakespeare's) and
keep the token ids in memory: every worker builds the same examples, and the input plan shards
them like any other source. Models are built from config with random weights (keras-hub presets
download from the internet); `task.init_checkpoint` warm-starts the encoder from another run.
"""
from __future__ import annotations

import functools
import glob
import json
import os

from absl import logging

from tfdp.core import class_folders
from tfdp.core import task as tasks
from tfdp.workloads.text import inputs as text
from tfdp import paths
from tfdp.core import warm_start
from tfdp.config import checks
from tfdp.config.schema import DataConfig, TaskConfig
from tfdp.errors import ConfigError, DataError

TEXT_SOURCES = ("text_folder", "text_files")
BERT_KWARGS = ("num_layers", "num_heads", "hidden_dim", "intermediate_dim", "dropout",
               "max_sequence_length")
# Saved beside the model: a resume, --mode=eval or warm start must read tokens (and classes) as
# the run did, or every token takes another embedding row (every text another label) silently.
VOCABULARY_FILE = "vocabulary.txt"
TOKENIZER_FILE = "tokenizer.json"  # how text became those tokens: {"lowercase": ...}


def vocab_path(config: TaskConfig) -> str:
  """As given, else (a relative path that is not there) from the repository, as configs are."""
  path = config.text.vocab_path or text.SHIPPED_VOCAB
  return paths.find_config(path)


def read_documents(data: DataConfig) -> tuple[list[str], list[int], list[str]]:
  """(documents, labels, class names) of one split (text_unit): files (document), speeches of
  plays (speech), or each play's spoken text as one document (passage: text_classification cuts
  it into sequence_length-token passages, masked_lm packs it as it packs speeches)."""
  if data.source == "text_folder":
    paths, labels, classes = text.list_text_folder(data.path)
  else:
    paths = text.find_text_files(data.path)
    labels, classes = [0] * len(paths), [""]
  names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
  unknown = sorted(set(data.holdout) - set(names))
  if unknown:
    raise DataError(f"holdout names {unknown} match no file under '{data.path}'; use file names "
                    "without extension, e.g. hamlet.")
  keep = {"all": lambda n: True, "train": lambda n: n not in data.holdout,
          "holdout": lambda n: n in data.holdout}[data.split]
  documents, document_labels, read_from, contents, read_paths = [], [], set(), [], []
  no_speeches = []  # files of text that give no speeches: dropped from speech and passage units
  for path, name, label in zip(paths, names, labels):
    if not keep(name):
      continue
    read_from.add(label)
    content = text.read_text_file(path)
    contents.append(content)
    read_paths.append(path)
    if data.text_unit == "speech":
      pieces = text.split_speeches(content)
    elif data.text_unit == "passage":
      spoken = " ".join(text.split_speeches(content))
      pieces = [spoken] if spoken else []
    else:
      pieces = [content]
    documents.extend(pieces)
    document_labels.extend([label] * len(pieces))
    if not pieces and content.strip():
      no_speeches.append(path)
  if not any(c.strip() for c in contents):  # else one [CLS] [SEP] sequence, trained as data
    blank = "; its files are empty or blank" if contents else ""
    raise DataError(f"split '{data.split}' of '{data.path}' holds no text (holdout "
                    f"{list(data.holdout)}{blank}); check path, split and holdout.")
  # Speeches are a play's **NAME** turns: plain text has none, so a class of plain files would
  # train as no examples at all (its label never seen, its accuracy the others').
  silent = sorted(read_from - set(document_labels))
  if silent and data.text_unit != "document":
    which = f"class '{classes[silent[0]]}' holds" if classes != [""] else "its files hold"
    raise DataError(f"'{data.path}': {which} no speeches (**NAME** lines of a play), which "
                    f"text_unit '{data.text_unit}' reads; set text_unit: document for plain text.")
  if no_speeches:  # in a class that has speeches elsewhere: dropped without a word (a probe)
    shown = ", ".join(no_speeches[:3]) + (f" and {len(no_speeches) - 3} more"
                                          if len(no_speeches) > 3 else "")
    logging.warning("'%s': %d file(s) hold text but no speeches (**NAME** lines of a play), which "
                    "text_unit '%s' reads, and give no examples: %s; text_unit: document reads "
                    "every file whole", data.path, len(no_speeches), data.text_unit, shown)
  text.warn_empty(f"'{data.path}'", contents, read_paths,
                  "each trained as an empty document" if data.text_unit == "document"
                  else "read as no text")
  return documents, document_labels, classes


def split_words(data: DataConfig) -> str:
  """A split in words, for messages: training and evaluation may read one path."""
  held = f", holdout {list(data.holdout)}" if data.holdout and data.split != "all" else ""
  return f"'{data.path}' (split {data.split}{held})"


def _check_text_task(config: TaskConfig) -> None:
  checks.check_positive("task.text.sequence_length", config.text.sequence_length)
  checks.check_positive("task.text.max_predictions", config.text.max_predictions, allow_zero=True)
  if not 0.0 < config.text.mask_rate < 1.0:
    raise ConfigError("config key 'task.text.mask_rate' must be in (0, 1), e.g. 0.15.")
  for key, data in (("task.train_data", config.train_data), ("task.eval_data", config.eval_data)):
    if data.source not in TEXT_SOURCES:
      raise ConfigError(f"config key '{key}.source' is '{data.source}', but task '{config.name}' "
                        f"reads text: use one of {', '.join(TEXT_SOURCES)}.")
    if data.split not in ("all", "train", "holdout"):
      raise ConfigError(f"config key '{key}.split' is '{data.split}'; text sources take all, "
                        "train (files not in holdout) or holdout.")
  if config.model.name != "bert":
    raise ConfigError(f"config key 'task.model.name' is '{config.model.name}'; task "
                      f"'{config.name}' builds keras-hub's BERT: set it to bert.")
  unknown = sorted(set(config.model.kwargs) - set(BERT_KWARGS))
  if unknown:
    raise ConfigError(f"task.model.kwargs {unknown} are not BERT settings; use "
                      f"{', '.join(BERT_KWARGS)} (task.model.kwargs={{}} in a --params_override "
                      "of its own drops a file's).")
  max_length = config.model.kwargs.get("max_sequence_length", 512)
  if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
    raise ConfigError(f"task.model.kwargs.max_sequence_length must be a whole number of at least "
                      f"2, got {max_length!r}; e.g. 128 or 512 (BERT's).")
  text.check_sequence_length(config.text.sequence_length, max_length, "task.text.sequence_length",
                             least=3 if config.name == "text_classification" else 2)
  text.read_vocabulary(vocab_path(config))  # a missing or malformed file fails here, in a line
  _check_holdouts_agree(config.train_data, config.eval_data)


def _same_path(a: str, b: str) -> bool:
  return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def _check_holdouts_agree(train: DataConfig, evaluation: DataConfig) -> None:
  """Evaluation's split holdout of the path training reads: a file it names that training reads
  too (any split) would be trained on and evaluated; with training's split train, a file only
  training's holdout names would never be read."""
  if evaluation.split != "holdout" or not _same_path(train.path, evaluation.path):
    return
  held, trained_held = set(evaluation.holdout), set(train.holdout)
  trained_too = sorted({"holdout": held & trained_held, "train": held - trained_held,
                        "all": held}[train.split])
  never_read = sorted(trained_held - held) if train.split == "train" else []
  if not trained_too and not never_read:
    return
  differences = "; ".join(
      ([f"{trained_too} would be trained on and evaluated"] if trained_too else []) +
      ([f"{never_read}, held out of training, would never be evaluated"] if never_read else []))
  if train.split == "train":
    raise ConfigError(f"task.train_data.holdout and task.eval_data.holdout differ for the same "
                      f"path '{train.path}' ({differences}); they must be equal: give both the "
                      "same list (configs/shakespeare_mlm.yaml shares it with a YAML anchor).")
  raise ConfigError(f"task.eval_data.holdout names files that task.train_data (split "
                    f"'{train.split}') trains on, for the same path '{train.path}' ({differences});"
                    " evaluate on files training does not read.")


def _read_saved(path: str, context: tasks.SavedRunUse) -> str:
  try:
    return text.read_text_file(path)
  except DataError as e:
    raise DataError(f"{context.action}: the run's saved '{path}' cannot be read ({e}); restore it, "
                    f"or {context.fix}.") from None


def _check_saved_tokenizer(config: TaskConfig, folder: str, context: tasks.SavedRunUse) -> None:
  """The same casing as the run that saved it: lowercasing the other way cuts the same text
  into other tokens, silently."""
  saved_path = os.path.join(folder, TOKENIZER_FILE)
  if not os.path.exists(saved_path):  # a run from before tokenizer settings were saved
    return
  try:
    saved = json.loads(_read_saved(saved_path, context))["lowercase"]
  except (ValueError, KeyError, TypeError) as e:
    raise DataError(f"{context.action}: the run's saved '{saved_path}' cannot be read ({e}); "
                    f"restore it, or {context.fix}.") from None
  if saved != config.text.lowercase:
    raise ConfigError(f"{context.action}: task.text.lowercase is {config.text.lowercase}, but "
                      f"that run tokenized with lowercase={saved} ('{saved_path}'), so the same "
                      f"text would become other tokens; set task.text.lowercase={saved}, or "
                      f"{context.fix}.")


def _check_saved_vocabulary(config: TaskConfig, folder: str, context: tasks.SavedRunUse) -> None:
  """The same tokens, id for id, as the run that saved its vocabulary (one of the same size
  would load without a word, every embedding row then another token's)."""
  saved_path = os.path.join(folder, VOCABULARY_FILE)
  if not os.path.exists(saved_path):  # a run from before vocabularies were saved
    return
  saved = [t.strip() for t in _read_saved(saved_path, context).splitlines() if t.strip()]
  path = vocab_path(config)
  now = text.read_vocabulary(path)
  if saved == now:
    return
  changed = next((i for i, (a, b) in enumerate(zip(saved, now)) if a != b), None)
  difference = (f"token id {changed} is {saved[changed]!r} there, {now[changed]!r} here"
                if changed is not None else f"{len(saved)} tokens there, {len(now)} here")
  raise ConfigError(f"{context.action}: task.text.vocab_path '{path}' is not the vocabulary that run "
                    f"used ('{saved_path}': {difference}), so tokens would take other embedding "
                    f"rows; set task.text.vocab_path={saved_path}, or {context.fix}.")


class _BertTask(tasks.Task):
  """What both text tasks share: the vocabulary, the tokenizer and the encoder."""

  # label_smoothing: BERT's losses are sparse (warned, as the recommenders warn it)
  ignored_keys = (*tasks.IMAGE_DATA_KEYS, *tasks.INTERACTION_DATA_KEYS, "recommender",
                  "label_smoothing")

  @classmethod
  def check_source(cls, data: DataConfig, key: str) -> None:
    if data.source == "text_folder":
      if not os.path.isdir(data.path):
        raise DataError(f"{key}.path '{data.path}' is not a folder{paths.looked_in(data.path)}; "
                        "point it at root/<label>/*.txt.")
      class_folders.check_has_classes(data.path, "text", "*.txt")
    if data.source == "text_files" and not glob.glob(data.path, recursive=True):
      raise DataError(f"{key}.path '{data.path}' matches no text files"
                      f"{paths.looked_in(data.path)}; fix the glob.")

  @classmethod
  def validate(cls, config: TaskConfig) -> None:
    _check_text_task(config)

  @classmethod
  def check_saved_artifacts(cls, config, folder, context):
    _check_saved_vocabulary(config, folder, context)
    _check_saved_tokenizer(config, folder, context)

  def artifacts(self, source):
    del source
    tokens = text.read_vocabulary(vocab_path(self.config))
    return {VOCABULARY_FILE: "".join(t + "\n" for t in tokens),
            TOKENIZER_FILE: json.dumps({"lowercase": self.config.text.lowercase})}

  def tokenizer(self):
    return text.load_tokenizer(vocab_path(self.config), lowercase=self.config.text.lowercase)

  @functools.cached_property
  def _vocabulary(self) -> tuple[int, dict]:
    tokenizer = self.tokenizer()
    return tokenizer.vocabulary_size(), text.special_token_ids(tokenizer)

  @property
  def vocabulary_size(self) -> int:
    return self._vocabulary[0]

  def build_backbone(self, vocabulary_size: int):
    import keras_hub  # pylint: disable=g-import-not-at-top
    kwargs = {"num_layers": 2, "num_heads": 2, "hidden_dim": 128, "intermediate_dim": 512,
              "dropout": 0.1, "max_sequence_length": 512, **self.config.model.kwargs}
    try:
      return keras_hub.models.BertBackbone(vocabulary_size=vocabulary_size, **kwargs)
    except (TypeError, ValueError) as e:
      raise ConfigError(f"task.model.kwargs do not fit BERT: {str(e).splitlines()[0]}") from None

  def warm_start(self, checkpoint_path: str) -> None:
    """Restores the encoder (`model.backbone` in the other run's checkpoint) into this run's."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    warm_start.restore_into(checkpoint_path, tf.train.Checkpoint(
        model=tf.train.Checkpoint(backbone=self.encoder)), "this model's encoder",
        under=("model", "backbone"), trained_by="a masked_lm run (a classifier's run stores no "
        "encoder there)")


@tasks.register_task("masked_lm")
class MaskedLMTask(_BertTask):
  """BERT pre-training: 15% of the tokens of packed sequences chosen, predicted from context.
  Loss and accuracy are per masked token (their denominators count predictions, not
  sequences)."""

  metric_names = ("loss", "accuracy")

  def build_source(self, data):
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
    documents, _, _ = read_documents(data)
    tokenizer = self.tokenizer()
    length = self.config.text.sequence_length
    ids = tf.data.Dataset.from_tensor_slices(documents).map(
        tf.autograph.experimental.do_not_convert(tokenizer))
    special = text.special_token_ids(tokenizer)  # a vocabulary's own ([CLS] 101 in BERT's)
    sequences = np.stack(list(text.pack_tokens(ids, length, special["[CLS]"], special["[SEP]"])
                              .as_numpy_iterator()))
    text.check_unknown_share(sequences, special, split_words(data), vocab_path(self.config),
                             self.config.text.lowercase)
    read = lambda files: tf.data.Dataset.from_tensor_slices({"token_ids": sequences})
    return data_lib.Source([len(sequences)], read, "text")

  def _max_predictions(self) -> int:
    cfg = self.config.text
    return cfg.max_predictions or text.max_predictions_for(cfg.sequence_length, cfg.mask_rate)

  def preprocess(self, example, data, training, seed):
    del data, training  # the same masking in evaluation: a fixed, comparable task
    features, labels, weights = text.mask_tokens(
        example["token_ids"], seed, *self._vocabulary,
        self.config.text.mask_rate, self._max_predictions())
    return {**features, "mask_labels": labels, "mask_weights": weights}

  def build_model(self, source):
    import keras_hub  # pylint: disable=g-import-not-at-top
    self.encoder = self.build_backbone(self.vocabulary_size)
    return keras_hub.models.BertMaskedLM(self.encoder, preprocessor=None)

  def model_inputs(self, batch):
    return {k: batch[k] for k in ("token_ids", "padding_mask", "segment_ids", "mask_positions")}

  def _token_losses(self, batch, outputs):
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return keras.losses.sparse_categorical_crossentropy(
        batch["mask_labels"], tf.cast(outputs, tf.float32), from_logits=True)

  def per_example_loss(self, batch, outputs):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    losses = self._token_losses(batch, outputs)
    # Divided by the prediction slots, a constant: summed over the global batch this is the
    # mean loss per masked token for full sequences, whatever the replica count.
    return tf.reduce_sum(losses * batch["mask_weights"], axis=-1) / self._max_predictions()

  def metric_sums(self, batch, outputs, per_example_loss):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    losses = self._token_losses(batch, outputs)
    weights = batch["mask_weights"] * batch["weight"][:, None]  # padding examples count nothing
    correct = tf.cast(tf.equal(tf.argmax(outputs, -1, output_type=tf.int32),
                               tf.cast(batch["mask_labels"], tf.int32)), tf.float32)
    tokens = tf.reduce_sum(weights)
    return {"loss": (tf.reduce_sum(losses * weights), tokens),
            "accuracy": (tf.reduce_sum(correct * weights), tokens)}


@tasks.register_task("text_classification")
class TextClassificationTask(_BertTask):
  """Which class a text belongs to (e.g. the genre of a Shakespeare speech or passage): the BERT
  encoder's [CLS] output, dropout, a dense head. Texts are cut to sequence_length tokens; with
  text_unit passage every token of a play is classified, in consecutive passages."""

  metric_names = ("loss", "accuracy")

  @classmethod
  def validate(cls, config):
    super().validate(config)
    for key, data in (("task.train_data", config.train_data), ("task.eval_data", config.eval_data)):
      if data.source != "text_folder":
        raise ConfigError(f"config key '{key}.source' is '{data.source}', but "
                          f"{config.name} learns its labels from class subfolders: use "
                          "text_folder, a folder of root/<class>/*.txt|*.md (text_files gives "
                          "every text one label: accuracy 1.0, meaning nothing).")
    class_folders.check_eval_classes(config.train_data, config.eval_data, "text_folder", "texts")

  @classmethod
  def check_source(cls, data, key):
    super().check_source(data, key)
    if key == "task.train_data":
      class_folders.check_not_one_class(data, key)

  @classmethod
  def check_saved_artifacts(cls, config, folder, context):
    """Also the classes: labels number the sorted class folders, so a folder with other classes
    would score texts as other labels (a warm start restores only the encoder: a new head)."""
    super().check_saved_artifacts(config, folder, context)
    class_folders.check_saved_classes(config, folder, context, "text_folder")

  def artifacts(self, source):
    return {**super().artifacts(source), **class_folders.saved_classes(source)}

  def build_source(self, data):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
    documents, labels, classes = read_documents(data)
    tokenizer = self.tokenizer()
    special = text.special_token_ids(tokenizer)  # a vocabulary's own ([CLS] 101 in BERT's)
    tokenized = tf.data.Dataset.from_tensor_slices(documents).map(
        tf.autograph.experimental.do_not_convert(tokenizer))
    sequences, labels = text.classification_sequences(
        tokenized.as_numpy_iterator(), labels, self.config.text.sequence_length,
        whole=data.text_unit == "passage", cls_id=special["[CLS]"], sep_id=special["[SEP]"])
    text.check_unknown_share(sequences, special, split_words(data), vocab_path(self.config),
                             self.config.text.lowercase)
    read = lambda files: tf.data.Dataset.from_tensor_slices(
        {"token_ids": sequences, "label": labels})
    source = data_lib.Source([len(sequences)], read, "text", num_classes=len(classes),
                             info={"class_names": classes})
    if data is self.config.train_data:
      class_folders.check_classes_to_learn(source)
    return source

  def preprocess(self, example, data, training, seed):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    del data, training, seed
    ids = example["token_ids"]
    return {"token_ids": ids, "padding_mask": tf.cast(ids != text.PAD_ID, tf.int32),
            "segment_ids": tf.zeros_like(ids), "label": example["label"]}

  def build_model(self, source):
    import keras  # pylint: disable=g-import-not-at-top
    backbone = self.build_backbone(self.vocabulary_size)
    inputs = {k: keras.Input((None,), dtype="int32", name=k)
              for k in ("token_ids", "padding_mask", "segment_ids")}
    pooled = backbone(inputs)["pooled_output"]
    pooled = keras.layers.Dropout(backbone.dropout)(pooled)
    logits = keras.layers.Dense(source.num_classes, name="classifier")(pooled)
    self.encoder = backbone
    return keras.Model(inputs, logits, name="bert_classifier")

  def model_inputs(self, batch):
    return {k: batch[k] for k in ("token_ids", "padding_mask", "segment_ids")}

  def per_example_loss(self, batch, outputs):
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return keras.losses.sparse_categorical_crossentropy(batch["label"], tf.cast(outputs, tf.float32),
                                                        from_logits=True)

  def metric_sums(self, batch, outputs, per_example_loss):
    return tasks.classification_sums(batch, outputs, per_example_loss)
