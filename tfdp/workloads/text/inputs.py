"""Text inputs: text folders, Shakespeare's speeches, WordPiece vocabularies, masked-LM examples.

Like tfdp/data.py, importing this module starts no TensorFlow: the checks that name a broken file
run first, and TensorFlow / keras_hub load inside the functions that need them.

Masked-LM examples are pure functions of (seed, epoch, example index) and the packed token ids,
so N workers that each read a shard see exactly the masks one process would have drawn.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import math
import os
import re

from absl import logging

from tfdp import logs
from tfdp.core import class_folders
from tfdp.workloads.text import learner
from tfdp import paths
from tfdp.errors import ConfigError, DataError

TEXT_EXTENSIONS = (".txt", ".md")
# Order fixes the ids of every vocabulary tfdp learns: [PAD] must be 0 (padding_mask is ids != 0).
RESERVED_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(RESERVED_TOKENS))
VOCAB_COMMAND = "tfdp-vocab --input=<folder or glob> --vocab_size=8000 --output=FILE"
SHIPPED_VOCAB = paths.SHIPPED_VOCAB


# ---- files (no TensorFlow) -------------------------------------------------------------------


def read_text_file(path: str) -> str:
  """The file's text; a file that is not UTF-8 text is named before any training starts."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise DataError(f"text file '{path}' cannot be read ({e.strerror}); fix its permissions or "
                    "remove it.") from None
  if b"\0" in raw:
    raise DataError(f"text file '{path}' is binary (it holds a NUL byte); remove it or convert it "
                    "to UTF-8 text.")
  bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
  try:
    return raw.decode("utf-8-sig")  # a leading BOM (Notepad's) is no text: it hid [PAD], **NAME**
  except UnicodeDecodeError as e:
    raise DataError(f"text file '{path}' is not UTF-8 (byte {e.start + bom}); remove it, or "
                    f"convert it {paths.utf8_conversion(path)}") from None


def _is_text_file(name: str) -> bool:
  return name.lower().endswith(TEXT_EXTENSIONS) and not name.startswith(".")


def warn_empty(where: str, texts: list[str], paths: list[str], fate: str) -> None:
  """`fate`: what becomes of an empty file (trained as an empty document, read as nothing)."""
  empty = [p for p, t in zip(paths, texts) if not t.strip()]
  if empty:
    logging.warning("text %s: %d of %d file(s) are empty (%s), e.g. %s", where, len(empty),
                    len(paths), fate, empty[0])


def list_text_folder(root: str) -> tuple[list[str], list[int], list[str]]:
  """Returns (paths, labels, class_names) for root/<class>/*.txt|*.md, sorted; reads every file
  once so a binary or non-UTF-8 file is reported by name before training starts. What is not
  read (a class folder without text files, nested folders, other files) is said in one warning."""
  if not os.path.isdir(root):
    raise DataError(f"text folder '{root}' is not a folder; point it at root/<class>/*.txt.")
  return class_folders.list_class_folders(root, "text", TEXT_EXTENSIONS, "*.txt", read_text_file)


def find_text_files(pattern: str) -> list[str]:
  """A folder (every *.txt|*.md beneath it) or a glob, sorted."""
  if os.path.isdir(pattern):
    found = []
    for folder, subfolders, files in os.walk(pattern):
      subfolders[:] = [d for d in subfolders if not d.startswith(".")]  # .git, .ipynb_checkpoints
      found.extend(os.path.join(folder, f) for f in files if _is_text_file(f))
    if not found:
      raise DataError(f"text folder '{pattern}' holds no {'/'.join(TEXT_EXTENSIONS)} files; "
                      "point it at a folder of text files or a glob such as 'corpus/*.txt'.")
    return sorted(found)
  found = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  if not found:
    raise DataError(f"'{pattern}' is neither a folder nor a glob that matches files; fix the path.")
  return found


def read_text_files(paths: str | list[str]) -> list[str]:
  """Texts of plain text files given as a list (kept in order), or a folder or glob (sorted)."""
  if isinstance(paths, str):
    paths = find_text_files(paths)
  if not paths:
    raise DataError("no text files given; pass a folder, a glob or a list of paths.")
  texts = []
  for path in paths:
    if not os.path.isfile(path):
      raise DataError(f"text file '{path}' does not exist (or is not a file); fix the path.")
    texts.append(read_text_file(path))
  warn_empty(f"files ({len(paths)})", texts, list(paths), "read as no text")
  return texts


# ---- Shakespeare's plays (Markdown: **NAME** speaker lines, _..._ stage directions) ----------

_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*\s*$")
# `_[Aside]_` within a line, and `\[Within]_` (the opening `_` missing) at its start.
_INLINE_DIRECTION = re.compile(r"_*\\?\[[^\]]*\]_|(?<!\w)_[^_]*_(?!\w)")
_MARKDOWN_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|])")  # \[ → [, \- → -


def _direction_opens(line: str) -> str | None:
  """The closing mark of a stage direction that starts on this line (`_` or `*`), else None."""
  if line.startswith("_"):
    return "_"
  if line.startswith("*") and not line.startswith("**"):
    return "*"
  return None


def split_speeches(markdown_text: str) -> list[str]:
  """One string per speech: the spoken lines after a **NAME** line up to the next speaker (or
  heading), stage directions (`_..._` or `*...*`, possibly over several lines) and headings
  dropped, whitespace collapsed to single spaces. Speeches with no words are dropped."""
  speeches, current, direction_end = [], None, None

  def finish():
    if current:
      text = " ".join(" ".join(current).split())
      if text:
        speeches.append(text)

  for raw in markdown_text.splitlines():
    line = raw.strip()
    if direction_end:  # inside a stage direction that spans lines
      if line.endswith(direction_end):
        direction_end = None
      continue
    if not line:
      continue
    if line.startswith("#"):
      finish()
      current = None
      continue
    if _SPEAKER.match(line):
      finish()
      current = []
      continue
    mark = _direction_opens(line)
    if mark:
      if len(line) > 1 and line.endswith(mark):  # the line is a direction
        continue
      marks = [m.start() for m in re.finditer(rf"(?<!\\){re.escape(mark)}", line)]
      if len(marks) % 2:  # one left open (`_Enter KING, _and_ Attendants,`): it spans lines
        direction_end = mark
        continue
      # closed inside the line: the speech goes on after it (`_Aside_ A little more than kin.`
      # lost the line, and every line after it up to one ending in `_`: a probe)
      line = line[marks[1] + 1:].strip()
    if current is not None:
      current.append(_MARKDOWN_ESCAPE.sub(r"\1", _INLINE_DIRECTION.sub(" ", line)))
  finish()
  return speeches


@dataclasses.dataclass(frozen=True)
class Speech:
  text: str
  label: int  # index into GenreSplit.class_names
  play: str  # file name without extension, e.g. "hamlet"


@dataclasses.dataclass
class GenreSplit:
  train: list[Speech]
  eval: list[Speech]
  class_names: list[str]  # the genre folders, sorted
  eval_plays: list[str]


def default_eval_plays(root: str) -> list[str]:
  """The held-out plays when none are named: the first play (by sorted file name) of every
  genre, so each genre is evaluated on one play no training speech came from. For the shipped
  corpus: a-midsummer-night-s-dream, edward-iii, all-s-well-that-ends-well, antony-and-cleopatra,
  a-winter-s-tale, hamlet."""
  paths, labels, _ = list_text_folder(root)
  first = {}
  for path, label in zip(paths, labels):
    first.setdefault(label, _play_name(path))
  return [first[label] for label in sorted(first)]


def _play_name(path: str) -> str:
  return os.path.splitext(os.path.basename(path))[0]


def genre_split(root: str, eval_plays: list[str] | None = None) -> GenreSplit:
  """Speeches labelled by genre folder, with whole plays held out for evaluation (a speech of an
  evaluated play never trains the model: lines of one play share names and phrasing)."""
  paths, labels, class_names = list_text_folder(root)
  plays = [_play_name(p) for p in paths]
  held_out = list(eval_plays) if eval_plays is not None else default_eval_plays(root)
  unknown = sorted(set(held_out) - set(plays))
  if unknown:
    raise DataError(f"eval plays {unknown} are not in '{root}'; name plays by file name without "
                    f"extension, e.g. {plays[0]}.")
  split = GenreSplit([], [], class_names, held_out)
  for path, label, play in zip(paths, labels, plays):
    side = split.eval if play in held_out else split.train
    side.extend(Speech(text, label, play) for text in split_speeches(read_text_file(path)))
  for name, side in (("training", split.train), ("evaluation", split.eval)):
    if not side:
      raise DataError(f"text folder '{root}' gives no {name} speeches with eval plays {held_out}; "
                      "hold out fewer plays, and check the files use **NAME** speaker lines.")
  return split


# ---- vocabulary ------------------------------------------------------------------------------


def check_vocab_size(vocab_size: int) -> None:
  """Needs no TensorFlow and no text: tfdp-vocab can check --vocab_size before reading a corpus."""
  if vocab_size <= len(RESERVED_TOKENS):
    raise DataError(f"vocab_size {vocab_size} leaves no room beside the {len(RESERVED_TOKENS)} "
                    "reserved tokens; use a few thousand.")


def check_vocab_holds_characters(texts: list[str], vocab_size: int, lowercase: bool) -> None:
  """The learner's first tokens are the text's characters, each twice (`x` starting a word, `##x`
  inside one); a smaller vocabulary left some out, and every word with one became [UNK] (a
  probe: --vocab_size 6 wrote the reserved tokens and '!')."""
  count = learner.learner_characters(texts, lowercase)
  needed = len(RESERVED_TOKENS) + 2 * count
  if vocab_size < needed:
    raise DataError(f"vocab_size {vocab_size} cannot hold the {count} characters the text uses, "
                    f"each as a word's start and inside a word (##x), beside the "
                    f"{len(RESERVED_TOKENS)} reserved tokens (words with the others would be "
                    f"[UNK]); use at least {needed}, a few thousand to learn word pieces.")


def without_output(paths: list[str], output: str) -> list[str]:
  """The corpus files `paths` less the vocabulary file `output` about to be written. One that an
  earlier run wrote inside the corpus folder was read as text (a probe: 6657 words, not 6322),
  and is left out; any other input file there would be replaced by the vocabulary (a probe:
  exit 0, the corpus file gone), and is refused."""
  kept = [p for p in paths if os.path.realpath(p) != os.path.realpath(output)]
  if len(kept) == len(paths):
    return paths
  with open(output, encoding="utf-8", errors="replace") as f:
    head = [f.readline().rstrip("\n") for _ in RESERVED_TOKENS]
  if tuple(head) != RESERVED_TOKENS:
    raise DataError(f"--output '{output}' is one of the input files, which the vocabulary would "
                    "replace; write it outside the corpus.")
  if not kept:
    raise DataError(f"the input holds no text file besides the vocabulary '{output}'; point "
                    "--input at the corpus.")
  return kept


def learn_vocabulary(texts: list[str], vocab_size: int, path: str, lowercase: bool = True
                     ) -> list[str]:
  """Learns a WordPiece vocabulary (reserved tokens first, [PAD] = 0) and writes it to `path`, one
  token per line; returns it. vocab_size is an upper bound: keras_hub's learner keeps the pieces
  seen at least K times, for a K of 10 or more that gives 95-100% of it where one does (see
  apps/vocab.py). Learning takes minutes on a large corpus: learn once, ship the file."""
  check_vocab_size(vocab_size)
  texts = [t for t in texts if t.strip()]
  if not texts:
    raise DataError(f"no text to learn a vocabulary for '{path}' from; the input files are empty.")
  check_vocab_holds_characters(texts, vocab_size, lowercase)
  folder = os.path.dirname(os.path.abspath(path))
  partial = path + ".partial"
  def written(write) -> None:
    try:
      os.makedirs(folder, exist_ok=True)
      with open(partial, "w", encoding="utf-8") as f:
        write(f)
    except OSError as e:
      with contextlib.suppress(OSError):  # a disk that filled up leaves no half file behind
        os.unlink(partial)
      above = paths.nearest_existing(folder)
      why = (f"it lies under '{above}', a file, not a folder" if not os.path.isdir(above)
             else e.strerror)  # makedirs said "File exists" (a probe)
      raise DataError(f"vocabulary file '{path}' cannot be written ({why}); choose "
                      "another --output.") from None
  written(lambda f: None)  # before minutes of learning: --output a folder, read-only, ...
  os.unlink(partial)  # an interrupted run leaves no empty .partial behind (a probe)
  if os.path.isdir(path):
    raise DataError(f"--output '{path}' is a folder; name the vocabulary file, e.g. "
                    f"{os.path.join(path, 'vocab.txt')}.")
  # Checked first: a mistake is answered before TensorFlow's seconds of loading, and its
  # start-up lines are hidden (at the level cli.quiet_tensorflow set), as in every other app.
  tf = logs.start_tensorflow()
  import keras_hub  # pylint: disable=g-import-not-at-top
  vocab = tf.autograph.experimental.do_not_convert(  # as every map tfdp makes
      keras_hub.tokenizers.compute_word_piece_vocabulary)(
      tf.data.Dataset.from_tensor_slices(texts), vocab_size, lowercase=lowercase,
      reserved_tokens=list(RESERVED_TOKENS))
  written(lambda f: f.writelines(token + "\n" for token in vocab))
  try:
    os.replace(partial, path)  # a stopped run leaves no half-written vocabulary behind
  except OSError as e:
    raise DataError(f"vocabulary file '{path}' cannot be written ({e.strerror}); choose another "
                    "--output.") from None
  return list(vocab)


def read_vocabulary(path: str) -> list[str]:
  """The tokens of a vocabulary file, checked for the reserved tokens tfdp's examples use."""
  learn = f"learn one with `{VOCAB_COMMAND.replace('FILE', path)}`"
  if not os.path.isfile(path):
    raise DataError(f"vocabulary file '{path}' does not exist; {learn}.")
  # Not over the user's own file (a probe): a new one beside it, for task.text.vocab_path
  stem, extension = os.path.splitext(path)
  learned = f"{stem}_learned{extension or '.txt'}"
  learn = (f"learn one with `{VOCAB_COMMAND.replace('FILE', learned)}` and set "
           f"task.text.vocab_path={learned}")
  tokens = [line.strip() for line in read_text_file(path).splitlines() if line.strip()]
  if not tokens:
    raise DataError(f"vocabulary file '{path}' is empty; {learn}.")
  missing = [t for t in RESERVED_TOKENS if t not in tokens]
  if missing:
    raise DataError(f"vocabulary file '{path}' lacks the reserved token(s) {missing}; {learn}.")
  if len(tokens) == len(RESERVED_TOKENS):  # "Need minval < maxval" deep in masking (a probe)
    raise DataError(f"vocabulary file '{path}' holds only the reserved tokens, no word to "
                    f"tokenize text into; {learn}.")
  seen = set()
  repeated = next((t for t in tokens if t in seen or seen.add(t)), None)
  if repeated is not None:
    raise DataError(f"vocabulary file '{path}' lists {repeated!r} twice (ids would be ambiguous); "
                    f"{learn}.")
  if tokens[0] != "[PAD]":
    raise DataError(f"vocabulary file '{path}' must start with [PAD] (id 0, the padding id), not "
                    f"{tokens[0]!r}; {learn}.")
  return tokens


UNKNOWN_WARN_SHARE = 0.02  # of a split's tokens: the shipped vocabulary on its plays gives 0


def check_unknown_share(sequences, special: dict[str, int], where: str, vocab: str,
                        lowercase: bool) -> None:
  """Text the vocabulary does not cover became [UNK], silently: all of it trained a masked LM to
  loss 0.0000 (nothing to predict: [UNK] is never masked), exit 0; another casing than the
  vocabulary's made 12.8% of Hamlet's tokens [UNK] (a probe). Refused when every token is
  [UNK], said above UNKNOWN_WARN_SHARE."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  tokens = np.isin(sequences, [special[t] for t in ("[PAD]", "[CLS]", "[SEP]")], invert=True)
  count = int(tokens.sum())
  if not count:  # zero-width spaces alone pass the blank-text check and tokenize to nothing
    raise DataError(f"the text of {where} gives no tokens, only [CLS] [SEP] rows; check its "
                    "files.")
  share = float((sequences == special["[UNK]"]).sum()) / count
  learn = (f"learn a vocabulary for this text (`{VOCAB_COMMAND}`) and set task.text.vocab_path, "
           f"or check task.text.lowercase ({lowercase}) against how '{vocab}' was learned")
  if share == 1.0:
    raise DataError(f"every token of {where} is [UNK] under the vocabulary '{vocab}': nothing "
                    f"would be learned; {learn}.")
  if share > UNKNOWN_WARN_SHARE:
    logging.warning("%.1f%% of the tokens of %s are [UNK] under the vocabulary '%s' (words with "
                    "a character or piece it lacks); %s", 100 * share, where, vocab, learn)


def load_tokenizer(path: str, sequence_length: int | None = None, lowercase: bool = True):
  """keras_hub WordPieceTokenizer for a vocabulary file; `lowercase` must match how it was learned
  (tfdp-vocab lowercases by default)."""
  import keras_hub  # pylint: disable=g-import-not-at-top
  return keras_hub.tokenizers.WordPieceTokenizer(
      vocabulary=read_vocabulary(path), sequence_length=sequence_length, lowercase=lowercase,
      oov_token="[UNK]", special_tokens=list(RESERVED_TOKENS))


def special_token_ids(tokenizer) -> dict[str, int]:
  """{"[PAD]": 0, "[UNK]": ..., "[CLS]": ..., "[SEP]": ..., "[MASK]": ...} for a tokenizer."""
  return {token: int(tokenizer.token_to_id(token)) for token in RESERVED_TOKENS}


# ---- masked-LM examples ----------------------------------------------------------------------


def check_sequence_length(sequence_length: int, max_sequence_length: int, key: str,
                          least: int = 2) -> None:
  """A longer sequence fails deep in the position embedding; say which key to change instead.
  `least`: 2 for [CLS] and a token, 3 where a [SEP] closes each (classification)."""
  if sequence_length > max_sequence_length:
    raise ConfigError(f"{key}={sequence_length} is longer than the model's max_sequence_length "
                      f"{max_sequence_length}; lower {key} or raise max_sequence_length.")
  if sequence_length < least:
    room = "after [CLS]" if least == 2 else "between [CLS] and [SEP]"
    raise ConfigError(f"{key}={sequence_length} leaves no room for a token {room}; use at "
                      f"least {least} (BERT uses 128 or 512).")


def pack_tokens(token_ids_dataset, sequence_length: int, cls_id: int = CLS_ID,
                sep_id: int = SEP_ID, pad_id: int = PAD_ID):
  """tf.data transform: documents' 1-D token ids → fixed-length [sequence_length] int32 sequences.

  Documents are concatenated with [SEP] between them and cut into pieces of sequence_length - 1
  tokens, each behind a [CLS]; only the last sequence is padded. Packing wastes no compute on
  padding for short documents (speeches) and loses no token.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  body = sequence_length - 1
  if body < 1:
    raise ConfigError(f"sequence_length {sequence_length} leaves no room for a token after [CLS].")

  def with_separator(i, ids):
    separator = tf.fill([tf.minimum(i, 1)], tf.constant(sep_id, tf.int32))  # none before the 1st
    return tf.concat([separator, tf.cast(ids, tf.int32)], 0)

  def as_sequence(piece):
    ids = tf.concat([[cls_id], piece], 0)
    ids = tf.pad(ids, [[0, sequence_length - tf.shape(ids)[0]]], constant_values=pad_id)
    return tf.ensure_shape(ids, [sequence_length])

  # Pieces of `body` tokens through a carried remainder: one element per piece, not per token.
  def cut(carry, ids):
    stream = tf.concat([carry, ids], 0)
    full = tf.shape(stream)[0] // body * body
    return stream[full:], tf.reshape(stream[:full], [-1, body])

  ends = tf.data.Dataset.from_tensors(tf.fill([body], tf.constant(-1, tf.int32)))
  untraced = tf.autograph.experimental.do_not_convert  # as every map tfdp makes
  pieces = (token_ids_dataset.enumerate().map(untraced(with_separator))
            .concatenate(ends)  # flushes the remainder; -1 marks the tokens that are not real
            .scan(tf.zeros([0], tf.int32), untraced(cut))
            .unbatch()
            .map(untraced(lambda piece: tf.boolean_mask(piece, piece >= 0))))
  return (pieces.filter(untraced(lambda piece: tf.size(piece) > 0))
          .map(untraced(as_sequence)))


def classification_sequences(token_ids, labels, sequence_length: int, whole: bool = False,
                             cls_id: int = CLS_ID, sep_id: int = SEP_ID):
  """Documents' 1-D token ids → ([n, sequence_length] int32 `[CLS] piece [SEP]` rows padded with
  [PAD], [n] int64 labels). A document gives its first sequence_length - 2 tokens; with whole,
  every token, in consecutive pieces of sequence_length - 2 (passages: the last one shorter, none
  spanning two documents, each labelled with its document's label)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  body = sequence_length - 2  # room for [CLS] and [SEP]
  if body < 1:
    raise ConfigError(f"sequence_length {sequence_length} leaves no room for a token between "
                      "[CLS] and [SEP]; use at least 3.")
  pieces, piece_labels, cut = [], [], []
  for ids, label in zip(token_ids, labels):
    ids = np.asarray(ids, np.int32)
    starts = range(0, max(len(ids), 1), body) if whole else [0]
    if len(ids) > body and not whole:
      cut.append(len(ids))
    pieces.extend(ids[start:start + body] for start in starts)
    piece_labels.extend([label] * len(starts))
  sequences = np.full((len(pieces), sequence_length), PAD_ID, np.int32)
  sequences[:, 0] = cls_id
  for row, piece in zip(sequences, pieces):
    row[1:1 + len(piece)] = piece
    row[1 + len(piece)] = sep_id
  if cut:  # said: it trained on ~30 of a document's 300 words without a word (a probe)
    logging.info("text: %d of %d example(s) are longer than sequence_length - 2 = %d tokens (up "
                 "to %d) and keep only their first %d; raise task.text.sequence_length to keep "
                 "more (text_unit passage reads every token)", len(cut), len(pieces), body,
                 max(cut), body)
  return sequences, np.asarray(piece_labels, np.int64)


def max_predictions_for(sequence_length: int, mask_rate: float = 0.15) -> int:
  """Prediction slots that always fit mask_rate of a full sequence (BERT: 20 for 128)."""
  return max(1, math.ceil(mask_rate * sequence_length))


def example_seed(seed, epoch, index):
  """Stateless seed of one example: the same (seed, epoch, index) gives the same draws wherever
  the example lands (worker, replica, batch)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
  seed, epoch, index = (tf.cast(x, tf.int64) for x in (seed, epoch, index))
  return tf.stack([data_lib.epoch_seed(seed, epoch), index])


def mask_tokens(token_ids, stateless_seed, vocab_size: int, special_ids: dict[str, int],
                mask_rate: float = 0.15, max_predictions: int | None = None):
  """BERT masking of one packed sequence → (features, labels, sample_weights) for BertMaskedLM.

  round(mask_rate * n) of the n tokens that are not special ids are chosen (at least one when
  n > 0; [PAD], [UNK], [CLS], [SEP] and [MASK] never are); of them 80% become [MASK], 10% a
  random non-special token, 10% stay. features holds token_ids,
  padding_mask, segment_ids and mask_positions [max_predictions] (sorted, padded with 0); labels
  are the original ids there (0 in padding slots) and sample_weights 1 for real predictions, 0 for
  padding slots. special_ids: special_token_ids(tokenizer). stateless_seed: example_seed(seed,
  epoch, index), as the input pipeline gives every example.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  token_ids = tf.cast(token_ids, tf.int32)
  length = tf.shape(token_ids)[0]
  if max_predictions is None and token_ids.shape[0] is None:
    raise ValueError("mask_tokens: pass max_predictions for sequences of unknown length.")
  slots = max_predictions or max_predictions_for(token_ids.shape[0], mask_rate)
  pad_id, mask_id = special_ids["[PAD]"], special_ids["[MASK]"]
  special = sorted(set(special_ids.values()))
  choose_seed, kind_seed, random_seed = tf.unstack(
      tf.random.experimental.stateless_split(stateless_seed, 3))

  candidate = tf.reduce_all(token_ids[:, None] != tf.constant(special, tf.int32)[None, :], axis=1)
  num_candidates = tf.reduce_sum(tf.cast(candidate, tf.int32))
  wanted = tf.cast(tf.round(mask_rate * tf.cast(num_candidates, tf.float32)), tf.int32)
  count = tf.minimum(tf.minimum(tf.maximum(wanted, 1), num_candidates), slots)
  # A random order of the candidates (non-candidates score -1 and sort last).
  score = tf.where(candidate, tf.random.stateless_uniform([length], choose_seed), -1.0)
  order = tf.math.top_k(score, k=tf.minimum(slots, length)).indices
  order = tf.pad(order, [[0, slots - tf.shape(order)[0]]])
  real = tf.range(slots) < count
  positions = tf.sort(tf.where(real, order, length))  # chosen positions first, ascending
  real = positions < length
  positions = tf.where(real, positions, 0)
  labels = tf.where(real, tf.gather(token_ids, positions), 0)

  kind = tf.random.stateless_uniform([slots], kind_seed)
  excluded = set(special)
  allowed = [i for i in range(vocab_size) if i not in excluded]  # random replacements
  random_ids = tf.gather(tf.constant(allowed, tf.int32), tf.random.stateless_uniform(
      [slots], random_seed, maxval=len(allowed), dtype=tf.int32))
  replacement = tf.where(kind < 0.8, mask_id, tf.where(kind < 0.9, random_ids, labels))
  chosen = tf.boolean_mask(positions, real)
  masked = tf.tensor_scatter_nd_update(token_ids, chosen[:, None],
                                       tf.boolean_mask(replacement, real))
  features = {
      "token_ids": masked,
      "padding_mask": tf.cast(token_ids != pad_id, tf.int32),
      "segment_ids": tf.zeros_like(token_ids),
      "mask_positions": positions,
  }
  return features, labels, tf.cast(real, tf.float32)
