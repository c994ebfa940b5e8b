"""Text inputs: folders and their one-line errors, Shakespeare's speeches and genre split,
WordPiece vocabularies, packing, and masked-LM examples that depend only on (seed, epoch, index)."""
import subprocess
import sys

import numpy as np
import pytest

import helpers
from tfdp import logs
from tfdp.workloads.text import inputs as text
from tfdp.workloads.text import learner
from tfdp.errors import ConfigError, DataError

SHAKESPEARE = helpers.REPO.parent / "shared" / "text" / "shakespeare"
NO_SHAKESPEARE = f"the Shakespeare corpus is not in {SHAKESPEARE} (see shared/README.md)"
needs_shakespeare = pytest.mark.skipif(not SHAKESPEARE.is_dir(), reason=NO_SHAKESPEARE)
VOCAB_APP = str(helpers.REPO / "apps" / "vocab.py")
SPECIAL = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}

TINY_CORPUS = [
    "The cat sat on the mat. The dog sat on the log!",
    "A bat, a rat and a cat; the rat sat.",
    "Is this a dagger which I see before me?",
]


def one_line_error(excinfo) -> str:
  message = str(excinfo.value)
  assert "\n" not in message
  return message


def write_play(path, speeches):
  """A play in the corpus' Markdown: heading, stage direction, **NAME** speeches."""
  lines = [f"# {path.stem}", "", "### SCENE I.", "", "_Enter two_", ""]
  for i, speech in enumerate(speeches):
    lines += [f"**SPEAKER{i % 2}**  ", f"{speech}  ", ""]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(lines), encoding="utf-8")


# ---- folders and files -----------------------------------------------------------------------


def test_list_text_folder_sorted_with_labels_and_empty_files(tmp_path):
  (tmp_path / "poems").mkdir()
  (tmp_path / "plays").mkdir()
  (tmp_path / ".hidden").mkdir()
  (tmp_path / "plays" / "b.md").write_text("To be", encoding="utf-8")
  (tmp_path / "plays" / "a.txt").write_text("", encoding="utf-8")  # empty: kept
  (tmp_path / "plays" / "notes.csv").write_text("x,y", encoding="utf-8")  # not text: ignored
  (tmp_path / "poems" / "z.TXT").write_text("Shall I compare thee", encoding="utf-8")
  (tmp_path / ".hidden" / "c.txt").write_text("hidden", encoding="utf-8")
  paths, labels, classes = text.list_text_folder(str(tmp_path))
  assert classes == ["plays", "poems"]
  assert [p[len(str(tmp_path)) + 1:] for p in paths] == ["plays/a.txt", "plays/b.md", "poems/z.TXT"]
  assert labels == [0, 0, 1]
  assert text.read_text_files(paths) == ["", "To be", "Shall I compare thee"]


def _not_a_folder(root):
  return root / "missing", root / "missing"


def _no_class_folders(root):
  root.mkdir()
  (root / "loose.txt").write_text("text", encoding="utf-8")
  return root, root


def _no_text_files(root):
  (root / "a").mkdir(parents=True)
  (root / "a" / "data.csv").write_text("1,2", encoding="utf-8")
  return root, root


def _binary_file(root):
  (root / "a").mkdir(parents=True)
  (root / "a" / "good.txt").write_text("fine", encoding="utf-8")
  (root / "a" / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
  return root, root / "a" / "image.txt"


def _latin1_file(root):
  (root / "a").mkdir(parents=True)
  (root / "a" / "old.md").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
  return root, root / "a" / "old.md"


@pytest.mark.parametrize("make, words", [
    (_not_a_folder, "is not a folder"),
    (_no_class_folders, "no class subfolders"),
    (_no_text_files, "holds no .txt/.md files"),
    (_binary_file, "is binary"),
    (_latin1_file, "is not UTF-8"),
])
def test_list_text_folder_bad_input_is_one_line_naming_the_file(tmp_path, make, words):
  root, named = make(tmp_path / "corpus")
  with pytest.raises(DataError) as excinfo:
    text.list_text_folder(str(root))
  message = one_line_error(excinfo)
  assert words in message and f"'{named}'" in message, message


@pytest.mark.parametrize("given, words", [
    ("{tmp}/nothing/*.txt", "neither a folder nor a glob that matches files"),
    (["{tmp}/gone.txt"], "does not exist"),
    (["{tmp}/nul.txt"], "is binary"),
    ("{tmp}/empty_folder", "holds no .txt/.md files"),
])
def test_read_text_files_bad_input_is_one_line_naming_the_file(tmp_path, given, words):
  (tmp_path / "nul.txt").write_bytes(b"text\0more")
  (tmp_path / "empty_folder").mkdir()
  fill = lambda s: s.format(tmp=tmp_path)
  given = fill(given) if isinstance(given, str) else [fill(p) for p in given]
  named = given if isinstance(given, str) else given[0]
  with pytest.raises(DataError) as excinfo:
    text.read_text_files(given)
  message = one_line_error(excinfo)
  assert words in message and named in message, message


def test_a_text_folder_says_which_classes_it_reads_nothing_from(tmp_path, caplog):
  """A probe's folder: neg's files were in neg/2020/, so neg trained with no example, silently."""
  import logging  # pylint: disable=g-import-not-at-top
  (tmp_path / "pos").mkdir()
  (tmp_path / "neg" / "2020").mkdir(parents=True)
  (tmp_path / "pos" / "a.txt").write_text("good", encoding="utf-8")
  (tmp_path / "neg" / "2020" / "b.txt").write_text("bad", encoding="utf-8")
  (tmp_path / "pos" / "c.csv").write_text("x", encoding="utf-8")
  with caplog.at_level(logging.WARNING):
    paths, labels, classes = text.list_text_folder(str(tmp_path))
  assert classes == ["neg", "pos"] and labels == [1]
  said = [r.getMessage() for r in caplog.records if "text folder" in r.getMessage()]
  assert len(said) == 1, caplog.text
  for words in ("'neg' hold no text files", "1 files in nested folders", "1 '.csv' files"):
    assert words in said[0], said[0]


@pytest.mark.parametrize("unit, fate", [("document", "each trained as an empty document"),
                                        ("speech", "read as no text")])
def test_empty_files_are_said_with_what_becomes_of_them_and_no_text_is_refused(
    tmp_path, caplog, unit, fate):
  """Empty files only: masked-LM stopped with a traceback (np.stack of nothing), or trained one
  [CLS] [SEP] sequence as data; an empty file beside text was said to be 'kept' under speech."""
  import logging  # pylint: disable=g-import-not-at-top
  from tfdp.config.schema import DataConfig  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.text import tasks as text_tasks  # pylint: disable=g-import-not-at-top
  (tmp_path / "empty.txt").write_text("", encoding="utf-8")
  (tmp_path / "blank.txt").write_text("  \n\n", encoding="utf-8")
  blank = DataConfig(source="text_files", path=str(tmp_path / "*.txt"), split="all",
                     text_unit=unit)
  with pytest.raises(DataError, match="its files are empty or blank"):
    text_tasks.read_documents(blank)
  (tmp_path / "play.txt").write_text(PLAY, encoding="utf-8")
  with caplog.at_level(logging.WARNING):
    text_tasks.read_documents(blank)
  assert f"2 of 3 file(s) are empty ({fate})" in caplog.text, caplog.text


def test_read_text_files_from_folder_and_glob(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "b.txt").write_text("second", encoding="utf-8")
  (tmp_path / "sub" / "a.md").write_text("third", encoding="utf-8")
  (tmp_path / "a.txt").write_text("first", encoding="utf-8")
  assert text.read_text_files(str(tmp_path)) == ["first", "second", "third"]
  assert text.read_text_files(str(tmp_path / "*.txt")) == ["first", "second"]


def test_import_starts_no_tensorflow():
  code = ("import sys, tfdp.workloads.text.inputs; "
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', "
          "'keras_hub')))")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        env=helpers.env(), cwd=str(helpers.REPO))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "[]"


# ---- Shakespeare -----------------------------------------------------------------------------

PLAY = """# A Play

## ACT I

### SCENE I. A heath.

_Thunder. Enter two Witches, and a Captain
bleeding_

**FIRST WITCH**  
When shall we   three meet again  
In thunder, lightning, or in rain?

**SECOND WITCH**  
When the hurlyburly's done,  
_Aside_  
\\[Aside]_ When the battle's lost and won.

_Exit FIRST WITCH_

Fair is foul, \\-- and foul is fair.

### SCENE II. A camp.

A line nobody speaks.

**CAPTAIN**  
_\\[Within]_  
Doubtful it stood;

**ALL**  
_Exeunt_
"""


def test_split_speeches_keeps_spoken_lines_only():
  assert text.split_speeches(PLAY) == [
      "When shall we three meet again In thunder, lightning, or in rain?",
      "When the hurlyburly's done, When the battle's lost and won. Fair is foul, -- and foul is "
      "fair.",
      "Doubtful it stood;",
  ]


def test_a_stage_direction_that_opens_a_line_keeps_the_speech_after_it(tmp_path):
  """A probe: `_Aside_ A little more than kin.` was taken to open a direction spanning lines,
  and every line up to one ending in `_` was lost; a file beginning with a BOM (Notepad's) lost
  its first speech, and a vocabulary with one 'lacked [PAD]'. Seen failing so on the old code."""
  play = ("**HAMLET**\n_Aside_ A little more than kin.\n**KING**\n*Flourish.\nExeunt.*\n"
          "How is it.\n_Burthen _\\[dispersedly, within_\nThe watch-dogs bark!\n")
  assert text.split_speeches(play) == ["A little more than kin.",
                                       "How is it. The watch-dogs bark!"]  # the Tempest's kept
  # a direction with a mark inside its first line still spans lines (a review)
  assert text.split_speeches("**A**\n_Enter KING, _and_ Attendants,\nwith others_\nspoken\n"
                             ) == ["spoken"]
  (tmp_path / "bom.md").write_bytes("\ufeff**HAMLET**\nTo be.\n\n**OPHELIA**\nGood my lord.\n"
                                    .encode("utf-8"))
  assert text.split_speeches(text.read_text_file(str(tmp_path / "bom.md"))) == [
      "To be.", "Good my lord."]
  (tmp_path / "vocab.txt").write_bytes("\ufeff[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\ncat\n"
                                       .encode("utf-8"))
  assert text.read_vocabulary(str(tmp_path / "vocab.txt"))[0] == "[PAD]"


@pytest.mark.parametrize("unknown, said", [(0, None), (1, "10.0% of the tokens"), (10, "every")])
def test_text_the_vocabulary_does_not_cover_is_said_or_refused(caplog, unknown, said):
  """A probe: Greek text under the shipped vocabulary was all [UNK], and a masked LM trained on
  it to loss 0.0000 (nothing to predict), exit 0; another casing made 12.8% of Hamlet [UNK],
  silently. Seen failing: no check existed."""
  import logging  # pylint: disable=g-import-not-at-top
  special = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
  row = [2] + [1] * unknown + [9] * (10 - unknown) + [3, 0, 0]  # 10 tokens, [PAD]s apart
  sequences = np.asarray([row, row])
  with pytest.raises(DataError, match=r"the text of corpus/ gives no tokens"):
    text.check_unknown_share(np.asarray([[2, 3, 0]]), special, "corpus/", "v.txt", True)
  if said == "every":
    with pytest.raises(DataError, match=r"every token of corpus/ is \[UNK\] under the "
                                        r"vocabulary 'v.txt'.*task.text.lowercase \(True\)"):
      text.check_unknown_share(sequences, special, "corpus/", "v.txt", True)
    return
  with caplog.at_level(logging.WARNING):
    text.check_unknown_share(sequences, special, "corpus/", "v.txt", True)
  assert (said in caplog.text) if said else "[UNK]" not in caplog.text, caplog.text


def test_a_play_folder_says_which_files_give_no_speeches_and_cut_documents_are_said(tmp_path,
                                                                                    caplog):
  """A probe: plain files beside a play in a class folder were dropped without a word under
  text_unit speech (a class of plain files alone is refused), and document classification kept
  ~30 of a 300-word file's tokens, unsaid. Seen failing: neither was logged."""
  import logging  # pylint: disable=g-import-not-at-top
  from tfdp.config.schema import DataConfig  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.text import tasks as text_tasks  # pylint: disable=g-import-not-at-top
  (tmp_path / "play.md").write_text(PLAY, encoding="utf-8")
  (tmp_path / "notes.txt").write_text("plain words, no speaker lines", encoding="utf-8")
  data = DataConfig(source="text_files", path=str(tmp_path / "*"), split="all", text_unit="speech")
  with caplog.at_level(logging.INFO):
    documents, _, _ = text_tasks.read_documents(data)
    text.classification_sequences([np.arange(5, 50), np.arange(5, 8)], [0, 1], 12)
  assert len(documents) == 3
  assert (f"1 file(s) hold text but no speeches (**NAME** lines of a play), which text_unit "
          f"'speech' reads, and give no examples: {tmp_path / 'notes.txt'}") in caplog.text
  assert ("1 of 2 example(s) are longer than sequence_length - 2 = 10 tokens (up to 45) and "
          "keep only their first 10; raise task.text.sequence_length") in caplog.text, caplog.text


def small_corpus(root):
  """Three genres of two plays each; every speech names its play."""
  for genre, plays in {"comedy": ["b-play", "a-play"], "history": ["d-play", "c-play"],
                       "tragedy": ["e-play", "f-play"]}.items():
    for play in plays:
      write_play(root / genre / f"{play}.md", [f"{play} speaks {i}" for i in range(3)])
  return root


def test_genre_split_holds_whole_plays_out(tmp_path):
  root = str(small_corpus(tmp_path / "plays"))
  split = text.genre_split(root)
  assert split.class_names == ["comedy", "history", "tragedy"]
  assert split.eval_plays == ["a-play", "c-play", "e-play"]  # the first of each genre by name
  train_plays = {s.play for s in split.train}
  eval_plays = {s.play for s in split.eval}
  assert train_plays == {"b-play", "d-play", "f-play"} and eval_plays == set(split.eval_plays)
  assert len(split.train) == len(split.eval) == 9
  for speech in split.train + split.eval:
    assert speech.text.startswith(speech.play)  # the speech came from that play's file
    assert split.class_names[speech.label] == {"a": "comedy", "b": "comedy", "c": "history",
                                               "d": "history", "e": "tragedy",
                                               "f": "tragedy"}[speech.play[0]]
  chosen = text.genre_split(root, eval_plays=["f-play"])
  assert {s.play for s in chosen.eval} == {"f-play"} and len(chosen.train) == 15


@pytest.mark.parametrize("eval_plays, words", [
    (["hamlet"], "are not in"),
    (["a-play", "b-play", "c-play", "d-play", "e-play", "f-play"], "no training speeches"),
])
def test_genre_split_bad_eval_plays(tmp_path, eval_plays, words):
  root = str(small_corpus(tmp_path / "plays"))
  with pytest.raises(DataError) as excinfo:
    text.genre_split(root, eval_plays)
  message = one_line_error(excinfo)
  assert words in message and root in message, message


@needs_shakespeare
def test_genre_split_of_the_corpus():
  split = text.genre_split(str(SHAKESPEARE))
  assert split.class_names == ["comedies", "histories", "problems", "roman", "romances", "tragedies"]
  assert split.eval_plays == ["a-midsummer-night-s-dream", "edward-iii", "all-s-well-that-ends-well",
                              "antony-and-cleopatra", "a-winter-s-tale", "hamlet"]
  train_plays = {s.play for s in split.train}
  eval_plays = {s.play for s in split.eval}
  assert not train_plays & eval_plays
  assert len(train_plays) + len(eval_plays) == 38
  assert {s.label for s in split.train} == {s.label for s in split.eval} == set(range(6))
  assert len(split.train) + len(split.eval) == 31354  # one speech per **NAME** line


# ---- vocabulary ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("vocab") / "vocab.txt")
  vocab = text.learn_vocabulary(TINY_CORPUS, 80, path)
  return path, vocab


def test_learned_vocabulary_round_trips_text(tiny_vocab):
  path, vocab = tiny_vocab
  with open(path, encoding="utf-8") as f:
    assert f.read().splitlines() == vocab
  assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
  assert 20 < len(vocab) <= 80 and len(set(vocab)) == len(vocab)
  tokenizer = text.load_tokenizer(path)
  assert text.special_token_ids(tokenizer) == SPECIAL
  ids = np.asarray(tokenizer.tokenize("The rat sat on the mat, Dagger!"))
  assert text.UNK_ID not in ids and len(ids) > 7  # "dagger" is split into pieces
  assert tokenizer.detokenize(ids) == "the rat sat on the mat , dagger !"
  unknown = np.asarray(tokenizer.tokenize("the zebra sat"))  # no "z" in the corpus
  assert unknown.tolist().count(text.UNK_ID) == 1


def test_learn_vocabulary_from_nothing_is_an_error(tmp_path):
  with pytest.raises(DataError) as excinfo:
    text.learn_vocabulary(["", "  \n"], 100, str(tmp_path / "v.txt"))
  assert str(tmp_path / "v.txt") in one_line_error(excinfo)
  assert not (tmp_path / "v.txt").exists()


@pytest.mark.parametrize("content, words", [
    (None, "does not exist"),
    ("", "is empty"),
    ("the\ncat\n", "lacks the reserved token"),
    ("[UNK]\n[PAD]\n[CLS]\n[SEP]\n[MASK]\ncat\n", "must start with [PAD]"),
    ("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\ncat\ncat\n", "lists 'cat' twice"),
    # "Need minval < maxval, got 0 >= 0", deep in masking, blaming the data (a probe)
    ("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n", "holds only the reserved tokens"),
])
def test_bad_vocabulary_file_is_one_line_naming_file_and_command(tmp_path, content, words):
  path = tmp_path / "vocab.txt"
  if content is not None:
    path.write_text(content, encoding="utf-8")
  with pytest.raises(DataError) as excinfo:
    text.load_tokenizer(str(path))
  message = one_line_error(excinfo)
  assert words in message and f"'{path}'" in message and "tfdp-vocab --input=" in message, message
  # Never told to write over the user's own file (a probe); seen failing on the old inputs.py
  output = path if content is None else tmp_path / "vocab_learned.txt"
  assert f"--output={output}`" in message, message
  assert content is None or f"task.text.vocab_path={output}" in message, message


@needs_shakespeare
def test_shipped_vocabulary_knows_the_plays():
  tokenizer = text.load_tokenizer(text.SHIPPED_VOCAB)
  assert 5000 < tokenizer.vocabulary_size() <= 8000
  assert text.special_token_ids(tokenizer) == SPECIAL
  ids = []
  for play in ["tragedies/hamlet.md", "comedies/twelfth-night.md", "histories/edward-iii.md"]:
    speeches = text.split_speeches(text.read_text_file(str(SHAKESPEARE / play)))
    ids.extend(np.concatenate([np.asarray(tokenizer.tokenize(s)) for s in speeches[:300]]))
  ids = np.asarray(ids)
  assert len(ids) > 20000
  assert np.mean(ids == text.UNK_ID) < 0.01
  assert np.asarray(tokenizer.tokenize("\u732b")).tolist() == [text.UNK_ID]  # the rate can rise


# ---- packing and masking ---------------------------------------------------------------------


def test_pack_tokens_fixed_length_cls_first_and_no_token_lost():
  tf = pytest.importorskip("tensorflow")
  rng = np.random.default_rng(0)
  docs = [rng.integers(5, 50, size=n).astype(np.int32) for n in (1, 7, 30, 0, 12, 9, 43)]
  dataset = tf.data.Dataset.from_generator(lambda: iter(docs),
                                           output_signature=tf.TensorSpec([None], tf.int32))
  sequence_length = 8
  packed = np.stack(list(text.pack_tokens(dataset, sequence_length).as_numpy_iterator()))
  assert packed.shape[1] == sequence_length and len(packed) == 16  # 108 tokens in pieces of 7
  assert (packed[:, 0] == text.CLS_ID).all()
  stream = np.concatenate([docs[0]] + [np.concatenate([[text.SEP_ID], d]) for d in docs[1:]])
  body = packed[:, 1:].reshape(-1)
  assert (body[len(stream):] == text.PAD_ID).all() and len(body) - len(stream) < sequence_length - 1
  np.testing.assert_array_equal(body[:len(stream)], stream)


def test_classification_sequences_cut_or_keep_every_token_in_passages():
  rng = np.random.default_rng(0)
  docs = [rng.integers(5, 50, size=n).astype(np.int32) for n in (3, 12, 0, 5)]
  length = 7  # pieces of 5 tokens between [CLS] and [SEP]

  cut, labels = text.classification_sequences(docs, [0, 1, 2, 3], length)
  assert cut.shape == (4, length) and cut.dtype == np.int32 and labels.tolist() == [0, 1, 2, 3]
  np.testing.assert_array_equal(cut[1], [text.CLS_ID, *docs[1][:5], text.SEP_ID])
  np.testing.assert_array_equal(cut[0], [text.CLS_ID, *docs[0], text.SEP_ID, 0, 0])
  np.testing.assert_array_equal(cut[2], [text.CLS_ID, text.SEP_ID, 0, 0, 0, 0, 0])

  whole, labels = text.classification_sequences(docs, [0, 1, 2, 3], length, whole=True)
  # 3 → 1 passage, 12 → 3 (5 + 5 + 2), an empty document → 1 empty one, 5 → 1.
  assert labels.tolist() == [0, 1, 1, 1, 2, 3] and whole.shape == (6, length)
  assert (whole[:, 0] == text.CLS_ID).all() and ((whole == text.SEP_ID).sum(1) == 1).all()
  for label, doc in enumerate(docs):  # every token once, in order, within its own document
    rows = whole[labels == label]
    body = np.concatenate([row[1:list(row).index(text.SEP_ID)] for row in rows])
    np.testing.assert_array_equal(body, doc)
  with pytest.raises(ConfigError) as excinfo:
    text.classification_sequences(docs, [0, 1, 2, 3], 2)
  assert "at least 3" in one_line_error(excinfo)


def masked_examples(sequences, seed=1, epoch=0, vocab_size=50, **kw):
  """mask_tokens over example i = row i, in a tf.data pipeline batched by 16."""
  tf = pytest.importorskip("tensorflow")

  def mask(index, ids):
    return text.mask_tokens(ids, text.example_seed(seed, epoch, index), vocab_size, SPECIAL, **kw)

  ds = tf.data.Dataset.from_tensor_slices(sequences).enumerate().map(
      tf.autograph.experimental.do_not_convert(mask)).batch(16)  # as tfdp's pipelines trace it
  parts = list(ds.as_numpy_iterator())
  features = {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
  return features, np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])


def random_sequences(count=200, length=64, vocab_size=50, seed=0):
  """[CLS] + ordinary tokens with some [SEP]/[UNK], then padding of random length."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, vocab_size, size=(count, length)).astype(np.int32)
  ids[:, 0] = text.CLS_ID
  ids[rng.random((count, length)) < 0.05] = text.SEP_ID
  ids[rng.random((count, length)) < 0.02] = text.UNK_ID
  ids[:, 0] = text.CLS_ID
  for row, pad_from in enumerate(rng.integers(length // 2, length + 1, size=count)):
    ids[row, pad_from:] = text.PAD_ID
  return ids


def test_mask_tokens_is_a_function_of_seed_epoch_and_index():
  tf = pytest.importorskip("tensorflow")
  sequences = random_sequences(count=40)
  features, labels, weights = masked_examples(sequences)
  again, _, _ = masked_examples(sequences)
  for key in features:
    np.testing.assert_array_equal(features[key], again[key])
  # Example 5 alone (as another worker would see it) gets the masks it got in a batch.
  alone, alone_labels, alone_weights = text.mask_tokens(
      tf.constant(sequences[5]), text.example_seed(1, 0, 5), 50, SPECIAL)
  for key in features:
    np.testing.assert_array_equal(alone[key].numpy(), features[key][5])
  np.testing.assert_array_equal(alone_labels.numpy(), labels[5])
  np.testing.assert_array_equal(alone_weights.numpy(), weights[5])
  next_epoch, _, _ = masked_examples(sequences, epoch=1)
  other_seed, _, _ = masked_examples(sequences, seed=2)
  for other in (next_epoch, other_seed):
    same = [np.array_equal(a, b) for a, b in zip(features["mask_positions"], other["mask_positions"])]
    assert sum(same) <= 2, sum(same)


def test_mask_tokens_proportions_and_what_may_be_chosen():
  sequences = random_sequences(count=300)
  features, labels, weights = masked_examples(sequences)
  positions, masked = features["mask_positions"], features["token_ids"]
  slots = text.max_predictions_for(64)
  assert positions.shape == labels.shape == weights.shape == (len(sequences), slots)
  candidates = ~np.isin(sequences, list(SPECIAL.values()))
  np.testing.assert_array_equal(features["padding_mask"], (sequences != text.PAD_ID).astype(int))
  assert (features["segment_ids"] == 0).all()
  chosen_count = weights.sum(axis=1).astype(int)
  np.testing.assert_array_equal(chosen_count, np.round(0.15 * candidates.sum(axis=1)).astype(int))
  originals, replaced = [], []
  for row in range(len(sequences)):
    real = positions[row, :chosen_count[row]]
    assert (weights[row, :chosen_count[row]] == 1).all() and (weights[row, chosen_count[row]:] == 0).all()
    assert (positions[row, chosen_count[row]:] == 0).all() and (labels[row, chosen_count[row]:] == 0).all()
    assert (np.diff(real) > 0).all()  # distinct, sorted
    assert candidates[row, real].all()  # never [CLS], [SEP], [UNK], [PAD] or [MASK]
    np.testing.assert_array_equal(labels[row, :chosen_count[row]], sequences[row, real])
    untouched = np.ones(64, bool)
    untouched[real] = False
    np.testing.assert_array_equal(masked[row, untouched], sequences[row, untouched])
    originals.extend(sequences[row, real])
    replaced.extend(masked[row, real])
  originals, replaced = np.asarray(originals), np.asarray(replaced)
  assert len(originals) > 1500
  assert abs(candidates.sum() * 0.15 / len(originals) - 1) < 0.01
  to_mask = np.mean(replaced == text.MASK_ID)
  kept = np.mean(replaced == originals)
  to_random = np.mean((replaced != text.MASK_ID) & (replaced != originals))
  assert abs(to_mask - 0.8) < 0.03 and abs(kept - 0.1) < 0.03 and abs(to_random - 0.1) < 0.03, \
      (to_mask, kept, to_random)
  random_ids = replaced[(replaced != text.MASK_ID) & (replaced != originals)]
  assert ((random_ids >= 5) & (random_ids < 50)).all()  # random tokens are ordinary tokens


def test_tiny_bert_masked_lm_takes_a_batch():
  tf = pytest.importorskip("tensorflow")
  keras_hub = pytest.importorskip("keras_hub")
  tokenizer = text.load_tokenizer(text.SHIPPED_VOCAB)
  vocab_size, sequence_length = tokenizer.vocabulary_size(), 32
  text.check_sequence_length(sequence_length, 32, "task.sequence_length")
  docs = ["Now is the winter of our discontent", "Made glorious summer by this sun of York;",
          "And all the clouds that lour'd upon our house", "In the deep bosom of the ocean buried."]
  token_ids = tf.data.Dataset.from_tensor_slices(docs).map(tokenizer.tokenize)
  special = text.special_token_ids(tokenizer)

  def mask(index, ids):
    return text.mask_tokens(ids, text.example_seed(7, 0, index), vocab_size, special)

  batch = next(iter(text.pack_tokens(token_ids, sequence_length).enumerate().map(mask).batch(8)))
  features, labels, weights = batch
  backbone = keras_hub.models.BertBackbone(
      vocabulary_size=vocab_size, num_layers=1, num_heads=2, hidden_dim=32, intermediate_dim=64,
      max_sequence_length=sequence_length)
  model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
  logits = model(features)
  batch_size = features["token_ids"].shape[0]
  assert batch_size == 2  # 4 short lines pack into two sequences of 32
  assert tuple(logits.shape) == (batch_size, text.max_predictions_for(sequence_length), vocab_size)
  loss = tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
  loss = float(tf.reduce_sum(loss * weights) / tf.reduce_sum(weights))
  assert abs(loss - np.log(vocab_size)) < 1.0  # random weights: close to a uniform guess


@pytest.mark.parametrize("length, limit, words", [
    (600, 512, "task.sequence_length=600 is longer than the model's max_sequence_length 512"),
    (1, 512, "leaves no room"),
])
def test_check_sequence_length(length, limit, words):
  with pytest.raises(ConfigError) as excinfo:
    text.check_sequence_length(length, limit, "task.sequence_length")
  assert words in one_line_error(excinfo)


# ---- tfdp-vocab ------------------------------------------------------------------------------


def run_vocab(*args):
  return subprocess.run([sys.executable, VOCAB_APP, *args], capture_output=True, text=True,
                        timeout=300, env=helpers.env(PYTHONPATH=helpers.REPO),
                        cwd=str(helpers.REPO))


def test_vocab_app_learns_a_vocabulary(tmp_path, tiny_vocab):
  (tmp_path / "corpus").mkdir()
  for i, line in enumerate(TINY_CORPUS):
    (tmp_path / "corpus" / f"{i}.txt").write_text(line, encoding="utf-8")
  output = tmp_path / "out" / "vocab.txt"
  proc = run_vocab(f"--input={tmp_path / 'corpus'}", "--vocab_size=80", f"--output={output}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  _, learned_here = tiny_vocab  # the same corpus and size through text.learn_vocabulary
  assert f"wrote {len(learned_here)} tokens" in proc.stdout and "from 3 file(s)" in proc.stdout, \
      proc.stdout
  assert output.read_text(encoding="utf-8").splitlines() == learned_here
  # Every word is seen fewer than 10 times: no minimum count the learner tries gives more.
  assert (f"note: {len(learned_here)} tokens, fewer than --vocab_size=80: the learner keeps the "
          "word pieces seen at least K times, and no K of 10 or more gives within 5% of the "
          "target") in proc.stdout, proc.stdout
  noise = [l for l in proc.stderr.splitlines() if logs._STARTUP_LINE.match(l)]  # pylint: disable=protected-access
  assert not noise, proc.stderr  # TensorFlow's loading lines are hidden, as in every other app


def test_vocab_app_leaves_out_its_own_vocabulary_and_refuses_to_replace_a_corpus_file(
    tmp_path, tiny_vocab):
  """A probe: --output inside the --input folder was read as text on the next run (more words,
  another vocabulary), and --output naming a corpus file replaced it, exit 0. Seen failing with
  the old app: 'from 4 file(s)' on the second run (61 tokens, not the corpus's own)."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i, line in enumerate(TINY_CORPUS):
    (corpus / f"{i}.txt").write_text(line, encoding="utf-8")
  _, learned_here = tiny_vocab  # the same corpus and size through text.learn_vocabulary
  for run in range(2):  # the second finds the first's vocabulary in the folder
    proc = run_vocab(f"--input={corpus}", "--vocab_size=80", f"--output={corpus / 'vocab.txt'}")
    assert proc.returncode == 0 and "from 3 file(s)" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert ("left out" in proc.stdout) == (run == 1), proc.stdout
    assert (corpus / "vocab.txt").read_text(encoding="utf-8").splitlines() == learned_here
  proc = run_vocab(f"--input={corpus}", "--vocab_size=80", f"--output={corpus / '0.txt'}")
  assert proc.returncode == 2 and helpers.error_lines(proc) == [
      f"tfdp-vocab: error: --output '{corpus / '0.txt'}' is one of the input files, which the "
      "vocabulary would replace; write it outside the corpus."], proc.stderr[-2000:]
  assert (corpus / "0.txt").read_text(encoding="utf-8") == TINY_CORPUS[0]


def test_an_interrupted_vocabulary_leaves_no_file_behind(tmp_path, monkeypatch):
  """A probe: Ctrl-C while the learner ran left an empty vocab.txt.partial (the check that the
  output can be written, made before minutes of learning). Seen failing: the file was there."""
  import keras_hub  # pylint: disable=g-import-not-at-top

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(keras_hub.tokenizers, "compute_word_piece_vocabulary", interrupted)
  with pytest.raises(KeyboardInterrupt):
    text.learn_vocabulary(["a b c"], 100, str(tmp_path / "vocab.txt"))
  assert not list(tmp_path.iterdir())


def test_vocab_app_plays_on_plain_text_says_it_has_no_speeches(tmp_path):
  (tmp_path / "notes.txt").write_text("plain words, no speaker lines", encoding="utf-8")
  proc = run_vocab(f"--input={tmp_path / 'notes.txt'}", "--plays", "--vocab_size=80",
                   f"--output={tmp_path / 'vocab.txt'}")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  # it said 'the input files are empty'
  assert "has none; drop --plays for plain text" in proc.stderr, proc.stderr[-2000:]


def test_docs_name_functions_that_exist():
  """configs/vocab/README.md named tfdp.text.*, a module that does not exist."""
  import importlib  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  readme = (helpers.REPO / "configs" / "vocab" / "README.md").read_text(encoding="utf-8")
  named = re.findall(r"`(tfdp(?:\.\w+)+)\.(\w+)", readme)
  assert named
  for module, function in named:
    assert hasattr(importlib.import_module(module), function), (module, function)


def test_vocab_app_says_the_learner_stops_within_five_percent_of_the_size(tmp_path):
  # 400 words seen 10 to 2000 times: some minimum count gives 95-100 tokens, and the learner
  # stops there, short of 100 (not for want of text: the tfdp-vocab note said so before).
  shipped = helpers.REPO / "configs" / "vocab" / "shakespeare_wordpiece.txt"
  words = [w for w in shipped.read_text(encoding="utf-8").split()
           if w.isalpha() and w.islower() and len(w) > 3][:400]
  (tmp_path / "corpus.txt").write_text(
      "\n".join(" ".join([w] * (2000 // (i + 1) + 10)) for i, w in enumerate(words)))
  proc = run_vocab(f"--input={tmp_path / 'corpus.txt'}", "--vocab_size=100",
                   f"--output={tmp_path / 'v.txt'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  learned = len((tmp_path / "v.txt").read_text(encoding="utf-8").splitlines())
  assert 95 <= learned < 100
  assert (f"note: {learned} tokens, not --vocab_size=100: the learner stops once it is within 5% "
          "below the target") in proc.stdout, proc.stdout
  assert "no K" not in proc.stdout


def test_a_bad_vocab_size_is_refused_before_tensorflow_loads(tmp_path):
  (tmp_path / "corpus").mkdir()
  (tmp_path / "corpus" / "a.txt").write_text(TINY_CORPUS[0], encoding="utf-8")
  proc = run_vocab(f"--input={tmp_path / 'nowhere'}", "--vocab_size=-5",  # before the corpus
                   f"--output={tmp_path / 'v.txt'}")
  assert proc.returncode == 2 and proc.stderr.splitlines() == [
      "tfdp-vocab: error: vocab_size -5 leaves no room beside the 5 reserved tokens; use a few "
      "thousand."], proc.stderr
  code = ("import sys; from tfdp.workloads.text import inputs\n"
          "try: inputs.learn_vocabulary(['a b'], -5, 'v.txt')\n"
          "except Exception as e: print(type(e).__name__, 'tensorflow' in sys.modules)")
  checked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, env=helpers.env(PYTHONPATH=helpers.REPO), cwd=str(tmp_path))
  assert checked.stdout.split() == ["DataError", "False"], checked.stderr[-2000:]
  assert not (tmp_path / "v.txt").exists()


def test_a_vocabulary_too_small_for_the_texts_characters_is_refused(tmp_path):
  """--vocab_size 6 wrote the 5 reserved tokens and '!' (exit 0): every word [UNK]. The learner's
  first tokens are the characters, each twice (x, ##x): the smallest size that holds them all is
  learned as such, one below is refused before learning. Seen failing on the old code (no
  error, a vocabulary of 21 tokens)."""
  characters = sorted(set("".join(TINY_CORPUS).lower()) - {" "})
  needed = len(text.RESERVED_TOKENS) + 2 * len(characters)
  with pytest.raises(DataError) as raised:
    text.learn_vocabulary(TINY_CORPUS, needed - 1, str(tmp_path / "small.txt"))
  assert one_line_error(raised) == (
      f"vocab_size {needed - 1} cannot hold the {len(characters)} characters the text uses, each "
      "as a word's start and inside a word (##x), beside the 5 reserved tokens (words with the "
      f"others would be [UNK]); use at least {needed}, a few thousand to learn word pieces.")
  assert not list(tmp_path.iterdir())
  text.learn_vocabulary(TINY_CORPUS, needed, str(tmp_path / "enough.txt"))
  tokenizer = text.load_tokenizer(str(tmp_path / "enough.txt"))
  tokens = [tokenizer.id_to_token(int(i)) for line in TINY_CORPUS for i in tokenizer.tokenize(line)]
  assert len(tokens) > len(" ".join(TINY_CORPUS).split()) and "[UNK]" not in tokens


@pytest.mark.parametrize("texts", [
    ["\ufeffab ba ab", "ab ab ba"], ["a\u200bb ba ab"], ["a\u00adb ba"],  # BOM, ZWSP, soft hyphen
    ["a\u00a0b ba ab"],  # a no-break space stays in its word (and folds to a space)
    ["ab " + "c" * 56 + " ba"],  # a word longer than 50: dropped
    ["a,b; ab!", "中文字 ab"], ["Ab BA ab"],  # punctuation and CJK alone; case
    ["ǰ a", "ΐ a"], ["a\u034fb \u3164 \ufe0fa"],  # folding recomposes; ignorables dropped
])
@pytest.mark.parametrize("lowercase", [True, False])
def test_the_characters_counted_are_those_the_learner_takes(texts, lowercase):
  """A review: a BOM, a zero-width space or a soft hyphen were counted as characters of words
  (a size that works refused), a no-break space was not (one too small let through), nor were
  words over 50 characters left out. Seen failing on the first count (str.isspace, no split)."""
  import keras_hub  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  vocab = keras_hub.tokenizers.compute_word_piece_vocabulary(
      tf.data.Dataset.from_tensor_slices(texts), 200, lowercase=lowercase,
      reserved_tokens=list(text.RESERVED_TOKENS))
  learned = {token for token in vocab[len(text.RESERVED_TOKENS):] if len(token) == 1}
  assert learner.learner_characters(texts, lowercase) == len(learned), sorted(learned)


@pytest.mark.parametrize("make_input, words", [
    (lambda tmp: tmp / "empty", "holds no .txt/.md files"),
    (lambda tmp: tmp / "nowhere", "neither a folder nor a glob"),
    (lambda tmp: tmp / "binary", "is binary"),
])
def test_vocab_app_errors_in_one_line(tmp_path, make_input, words):
  (tmp_path / "empty").mkdir()
  (tmp_path / "binary").mkdir()
  (tmp_path / "binary" / "a.txt").write_bytes(b"\0\1\2")
  proc = run_vocab(f"--input={make_input(tmp_path)}", f"--output={tmp_path / 'v.txt'}")
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr
  lines = helpers.error_lines(proc)
  assert len(lines) == 1 and lines[0].startswith("tfdp-vocab: error:") and words in lines[0], \
      proc.stderr
  assert not (tmp_path / "v.txt").exists()


@pytest.mark.parametrize("kind", ["image", "text"])
def test_a_fifo_named_like_an_example_is_skipped_and_said_not_opened(tmp_path, caplog, kind):
  """Both folder readers walk their class folders with one loop (class_folders): the image one
  opened anything named *.png, and a FIFO there blocked the run for ever before it started."""
  import logging  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.vision import sources  # pylint: disable=g-import-not-at-top
  for name in ("a", "b"):
    helpers.write_image_folder(tmp_path, per_class=1, size=8, classes=(name,))
    (tmp_path / name / "x.txt").write_text("words", encoding="utf-8")
  os.mkfifo(tmp_path / "b" / ("pipe.png" if kind == "image" else "pipe.txt"))
  listed = []
  reader = sources.list_image_folder if kind == "image" else text.list_text_folder
  with caplog.at_level(logging.WARNING):
    worker = threading.Thread(target=lambda: listed.append(reader(str(tmp_path))), daemon=True)
    worker.start()
    worker.join(30)
  if worker.is_alive():  # unblock the reader so the test process can end
    with open(tmp_path / "b" / ("pipe.png" if kind == "image" else "pipe.txt"), "wb"):
      pass
    pytest.fail("the reader opened the FIFO and waited on it")
  paths, labels, classes = listed[0]
  assert classes == ["a", "b"] and labels == [0, 1] and not any("pipe" in p for p in paths)
  assert f"'{os.path.splitext('pipe.png' if kind == 'image' else 'pipe.txt')[1]}' files" in caplog.text


def test_an_unwritable_vocab_output_is_refused_before_learning(tmp_path):
  """A review: --output was first written after minutes of learning (a folder, or one that
  cannot be made, failed only then). Now before TensorFlow starts, leaving no partial file.
  Seen failing: TensorFlow loaded (True), and the folder case's IsADirectoryError line."""
  (tmp_path / "file").write_text("a file where a folder is wanted")
  (tmp_path / "folder").mkdir()
  for output, said in ((tmp_path / "file" / "v.txt",  # it said "(File exists)" (a probe)
                        f"cannot be written (it lies under '{tmp_path / 'file'}', a file, not a "
                        "folder)"),
                       (tmp_path / "folder", "is a folder; name the vocabulary file")):
    code = ("import sys; from tfdp.workloads.text import inputs\n"
            f"try: inputs.learn_vocabulary(['a b c'], 100, {str(output)!r})\n"
            "except Exception as e: print(type(e).__name__, 'tensorflow' in sys.modules, e)")
    checked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env=helpers.env(PYTHONPATH=helpers.REPO))
    assert checked.stdout.split()[:2] == ["DataError", "False"], checked.stdout + checked.stderr[-2000:]
    assert said in checked.stdout, checked.stdout
  assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]
  assert not list((tmp_path / "folder").iterdir())
