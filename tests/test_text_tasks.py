"""The BERT workloads end to end: masked-LM equivalence across topologies (ring all-reduce over
real worker processes, logical replicas, gradient accumulation), warm start, bad input."""
import shutil
import subprocess
import sys

import numpy as np
import pytest

import helpers

LAUNCH_APP = str(helpers.REPO / "apps" / "launch.py")
VOCAB = helpers.REPO / "configs" / "vocab" / "shakespeare_wordpiece.txt"


def words_of_vocabulary():
  tokens = VOCAB.read_text().split("\n")
  return [t for t in tokens if t.isalpha() and t.islower() and len(t) > 2]


def write_corpus(root, documents_per_class=12, words_per_document=160, classes=("plays", "poems"),
                 seed=0):
  """root/<class>/<name>.txt of words the vocabulary knows; returns root."""
  rng = np.random.default_rng(seed)
  words = words_of_vocabulary()
  for label, name in enumerate(classes):
    (root / name).mkdir(parents=True, exist_ok=True)
    # Each class repeats 20 five-word phrases of its own 40 words: a language with structure
    # to learn, and a learnable class.
    pool = words[label::len(classes)][:40]
    phrases = [" ".join(rng.choice(pool, size=5)) for _ in range(20)]
    for d in range(documents_per_class):
      chosen = rng.choice(phrases, size=words_per_document // 5)
      (root / name / f"{name}-{d:02d}.txt").write_text(". ".join(chosen) + ".\n")
  return root


def mlm_overrides(corpus, extra=""):
  return ",".join([
      "task.name=masked_lm", "task.model.name=bert",
      "task.model.kwargs={num_layers: 1, num_heads: 2, hidden_dim: 32, intermediate_dim: 64, "
      "dropout: 0.0, max_sequence_length: 32}",
      f"task.text.vocab_path={VOCAB}", "task.text.sequence_length=32",
      "task.train_data.source=text_folder", f"task.train_data.path={corpus}",
      "task.train_data.split=all", "task.train_data.shard_policy=data",
      "task.eval_data.source=text_folder", f"task.eval_data.path={corpus}",
      "task.eval_data.split=all",
      "trainer.global_batch_size=16", "trainer.epochs=1", "trainer.max_steps=20",
      "trainer.steps_per_loop=5", "trainer.export_model=false",
      "trainer.optimizer.name=adamw", "trainer.optimizer.weight_decay=0.01",
      "trainer.gradient_clip_norm=0.5", "trainer.learning_rate.base_lr=0.002",
      "trainer.learning_rate.base_batch_size=16", "trainer.learning_rate.schedule=linear",
      "trainer.learning_rate.warmup_epochs=0.1",
  ]) + extra


def test_masked_lm_four_workers_equal_four_replicas_equal_four_accumulation_steps(tmp_path):
  corpus = write_corpus(tmp_path / "corpus", words_per_document=200)  # > 8 x 16 sequences
  steps = ",trainer.max_steps=8"  # each run's cost is its start-up and tracing, not its steps
  (tmp_path / "mw").mkdir()
  proc = subprocess.run(
      [sys.executable, LAUNCH_APP, "--num_workers=4", "--", sys.executable, helpers.PROBE,
       str(tmp_path / "run_mw"), mlm_overrides(corpus, steps), str(tmp_path / "mw"), "train"],
      env=helpers.env(), cwd=str(helpers.REPO), capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  assert "all_reduce=ring" in proc.stdout
  workers = [helpers.load_probe(tmp_path / "mw", rank) for rank in range(4)]
  replicas = helpers.run_probe(tmp_path, "replicas", mlm_overrides(
      corpus, f"{steps},runtime.strategy=mirrored,runtime.cpu_replicas=4"))
  accumulated = helpers.run_probe(tmp_path, "accumulated", mlm_overrides(
      corpus, f"{steps},runtime.strategy=default,trainer.gradient_accumulation_steps=4"))
  one = workers[0]
  for run in (*workers, replicas, accumulated):
    assert run["info"]["step"] == 8
    assert run["info"]["autograph"] == []  # tokenizer, packing, masking: traced without it
    assert helpers.max_relative_difference(run["initial"], one["initial"]) == 0.0
  assert helpers.max_relative_difference(one["final"], one["initial"]) > 1e-3  # it trained
  assert all(np.array_equal(w["final"][k], one["final"][k]) for w in workers for k in one["final"])
  # The attention key bias has an exactly zero gradient (softmax ignores a shift shared by a
  # row): it moves only by round-off (~1e-10), and a relative measure of it means nothing. The
  # pooler gets no gradient at all in masked-LM training.
  moved = {k for k in one["final"] if np.abs(one["final"][k] - one["initial"][k]).max() > 1e-6}
  assert set(one["final"]) - moved == {"transformer_layer_0/self_attention_layer/key/bias",
                                       "pooled_dense/kernel", "pooled_dense/bias"}
  for other in (replicas, accumulated):
    assert helpers.max_relative_difference({k: other["final"][k] for k in moved},
                                           {k: one["final"][k] for k in moved}) <= 1e-5
    assert max(np.abs(other["final"][k] - one["final"][k]).max()
               for k in one["final"] if k not in moved) <= 1e-8


def test_masked_lm_learns_and_a_classifier_warm_starts_from_its_encoder(tmp_path):
  corpus = write_corpus(tmp_path / "corpus")
  # Pre-trained on one replica (each replica is one more trace of the step); the classifier
  # below warm-starts on 2, into mirrored variables.
  pre = helpers.run_probe(tmp_path, "mlm", mlm_overrides(
      corpus, ",trainer.max_steps=0,trainer.epochs=6,runtime.cpu_replicas=1"), "train_and_eval")
  before, after = pre["info"]["eval_before"], pre["info"]["eval_after"]
  assert after["loss"] < before["loss"] - 1.0, (before, after)  # masked-token loss falls
  classify = mlm_overrides(corpus).replace("task.name=masked_lm", "task.name=text_classification")
  fine = helpers.run_probe(tmp_path, "genre", classify + f",task.init_checkpoint={tmp_path / 'mlm'}"
                           ",trainer.max_steps=4,runtime.cpu_replicas=2")
  encoder = [k for k in pre["final"] if not k.startswith("mlm_head/")]
  assert len(encoder) > 20 and all(k in fine["initial"] for k in encoder)
  for name in encoder:  # the classifier started from the pre-trained encoder, exactly
    assert np.array_equal(fine["initial"][name], pre["final"][name]), name
  head = [k for k in fine["initial"] if k.startswith("classifier/")]
  assert head and not any(k in pre["final"] for k in head)  # the head is new


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp("corpus"), documents_per_class=2,
                      words_per_document=40)


def bad_input_cases(corpus, tmp):
  (tmp / "empty").mkdir(exist_ok=True)
  (tmp / "binary" / "a").mkdir(parents=True, exist_ok=True)
  (tmp / "binary" / "a" / "x.txt").write_bytes(b"\x00\x01\x02 not text")
  (tmp / "other_run" / "checkpoints").mkdir(parents=True, exist_ok=True)
  (tmp / "runs" / "mlm+runlocal_text").mkdir(parents=True, exist_ok=True)
  return {
      "empty text folder": (f",task.train_data.path={tmp / 'empty'}", "has no class subfolders"),
      "binary file": (f",task.train_data.path={tmp / 'binary'}", "x.txt"),
      "missing vocabulary": (f",task.text.vocab_path={tmp / 'nope.txt'}", "nope.txt"),
      "sequence beyond the model": (",task.text.sequence_length=64",
                                    "task.text.sequence_length=64 is longer than"),
      "missing init_checkpoint": (f",task.init_checkpoint={tmp / 'other_run'}",
                                  "holds no checkpoint"),
      "unknown task": (",task.name=masked_lmm", "did you mean 'masked_lm'"),
      # a probe: 'holds no checkpoint' for a folder that is not there, beside the smoke run's
      "absent init_checkpoint": (f",task.init_checkpoint={tmp / 'runs' / 'mlm'}",
                                 f"does not exist; {tmp / 'runs'} holds mlm+runlocal_text;"),
      # a probe: a relative path from another folder named neither the folder nor the path
      "relative text folder": (",task.train_data.path=no/such/corpus",
                               f"is not a folder (looked in {helpers.REPO}/no/such/corpus)"),
  }


@pytest.mark.parametrize("case", ["empty text folder", "binary file", "missing vocabulary",
                                  "sequence beyond the model", "missing init_checkpoint",
                                  "unknown task", "absent init_checkpoint",
                                  "relative text folder"])
def test_bad_text_input_is_one_line(tmp_path, small_corpus, case):
  extra, words = bad_input_cases(small_corpus, tmp_path)[case]
  proc = helpers.run_train(f"--model_dir={tmp_path / 'run'}",
                           f"--params_override={mlm_overrides(small_corpus, extra)}")
  assert proc.returncode != 0
  errors = helpers.error_lines(proc)
  assert len(errors) == 1 and words in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


def two_layers(corpus) -> str:
  return mlm_overrides(corpus, ",trainer.max_steps=1").replace("num_layers: 1", "num_layers: 2")


@pytest.fixture(scope="module")
def two_layer_run(tmp_path_factory, small_corpus):
  """One step of a 2-layer encoder whose weights are averaged (trainer.ema_decay): the init run
  of the warm-start tests below."""
  run = tmp_path_factory.mktemp("two_layer") / "run"
  first = helpers.run_train(f"--model_dir={run}", "--mode=train",
                            f"--params_override={two_layers(small_corpus)},trainer.ema_decay=0.5")
  assert first.returncode == 0, first.stderr[-2000:]
  return run


@pytest.mark.xdist_group("test_text_tasks_two_layer_run")
def test_an_init_checkpoint_of_another_shape_names_the_variable(tmp_path, small_corpus,
                                                                two_layer_run):
  wider = two_layers(small_corpus).replace("hidden_dim: 32", "hidden_dim: 48") + \
      f",task.init_checkpoint={two_layer_run}"
  proc = helpers.run_train(f"--model_dir={tmp_path / 'wide'}", "--mode=train",
                           f"--params_override={wider}")
  assert proc.returncode != 0
  errors = helpers.error_lines(proc)
  assert len(errors) == 1 and "does not fit this model's encoder" in errors[0], proc.stderr[-2000:]
  assert "embeddings" in errors[0] and "Traceback" not in proc.stderr


@pytest.mark.xdist_group("test_text_tasks_two_layer_run")
def test_a_warm_start_uses_all_of_the_encoder_or_says_why_not(tmp_path, small_corpus,
                                                              two_layer_run):
  """A 2-layer encoder warm-started into a 1-layer one restored the first layer and ignored the
  second without a word; a checkpoint whose data file is gone was a traceback; and a finished
  warm-started run could not be evaluated once its init run was moved away (a helper's probe).
  A warm start from a run with trainer.ema_decay took its raw weights silently (a probe; seen
  failing on the old experiment.py: no warning). The failed start left the empty folder made
  above its model_dir (seen failing on the old outputs.py cleanup)."""
  two = two_layers(small_corpus)
  shutil.copytree(two_layer_run, tmp_path / "two")  # this test moves it and breaks its files
  one = mlm_overrides(small_corpus, ",trainer.max_steps=1")
  proc = helpers.run_train(f"--model_dir={tmp_path / 'new' / 'one'}", "--mode=train",
                           f"--params_override={one},task.init_checkpoint={tmp_path / 'two'}")
  errors = helpers.error_lines(proc)
  assert len(errors) == 1 and "that this model has no place for" in errors[0], proc.stderr[-3000:]
  assert "variable(s) of this model's encoder" in errors[0], errors[0]  # the second layer's
  assert not (tmp_path / "new").exists()  # nor the folder made above it (once left behind)
  # the same depth warm-starts; then its init run goes, and the run is still evaluated
  same = f"{two},task.init_checkpoint={tmp_path / 'two'}"
  warm = helpers.run_train(f"--model_dir={tmp_path / 'warm'}", f"--params_override={same}")
  assert warm.returncode == 0 and "warm start: restored from" in warm.stderr, warm.stderr[-3000:]
  # its init run averaged its weights: the raw ones are restored, said (a probe: silently)
  assert "trained with trainer.ema_decay=0.5; its raw weights are restored" in warm.stderr
  (tmp_path / "two").rename(tmp_path / "moved")
  again = helpers.run_train(f"--model_dir={tmp_path / 'warm'}", "--mode=eval")
  assert again.returncode == 0, again.stderr[-3000:]
  # a checkpoint with its data file gone: one line, nothing written (its state file names it:
  # said before TensorFlow starts; given as a prefix, the restore says it cannot be read)
  for data in (tmp_path / "moved" / "checkpoints").glob("ckpt-*.data-*"):
    data.unlink()
  (prefix,) = [p.with_suffix("") for p in (tmp_path / "moved" / "checkpoints").glob("*.index")]
  for init, said in ((tmp_path / "moved", ".data-*' is missing"), (prefix, "cannot be read")):
    proc = helpers.run_train(f"--model_dir={tmp_path / 'broken'}", "--mode=train",
                             f"--params_override={two},task.init_checkpoint={init}")
    errors = helpers.error_lines(proc)
    assert len(errors) == 1 and said in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "broken").exists()


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_masked_lm_trains_in_mixed_precision(tmp_path, small_corpus, precision):
  run = helpers.run_probe(tmp_path, "mixed", mlm_overrides(
      small_corpus, f",trainer.max_steps=0,trainer.epochs=3,runtime.mixed_precision={precision}"),
      "train_and_eval", **helpers.UNCAPPED)
  assert run["info"]["step"] == 3
  assert np.isfinite(run["info"]["eval_after"]["loss"])
  assert helpers.max_relative_difference(run["final"], run["initial"]) > 0  # it applied updates


def test_passages_are_a_plays_speeches_in_order_cut_to_the_sequence_length(tmp_path):
  from test_text import write_play  # pylint: disable=g-import-not-at-top
  from tfdp import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfdp.core import task as tasks  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.text import tasks as text_tasks  # pylint: disable=g-import-not-at-top
  words = words_of_vocabulary()
  speeches = {"comedy/a-play": [" ".join(words[i:i + 7]) for i in range(0, 70, 7)],
              "tragedy/b-play": [" ".join(words[i:i + 3]) for i in range(100, 106, 3)]}
  for name, spoken in speeches.items():
    write_play(tmp_path / "plays" / f"{name}.md", spoken)
  (tmp_path / "plays" / "tragedy" / "notes.md").write_text("no speaker lines here\n")
  config = config_lib.load_config([], [
      f"task.name=text_classification,task.model.name=bert,task.text.vocab_path={VOCAB},"
      "task.text.sequence_length=32,task.model.kwargs={max_sequence_length: 32},"
      f"task.train_data.source=text_folder,task.train_data.path={tmp_path / 'plays'},"
      "task.train_data.split=all,task.train_data.text_unit=passage,"
      f"task.eval_data.source=text_folder,task.eval_data.path={tmp_path / 'plays'},"
      "task.eval_data.split=all"])
  documents, labels, classes = text_tasks.read_documents(config.task.train_data)
  # One document per play (a file without speeches gives none), its speeches joined in order:
  # no speaker names, headings or stage directions.
  assert classes == ["comedy", "tragedy"] and labels == [0, 1]
  assert documents == [" ".join(speeches["comedy/a-play"]), " ".join(speeches["tragedy/b-play"])]
  task = tasks.make_task(config.task)
  examples = list(task.build_source(config.task.train_data).read([0]).as_numpy_iterator())
  tokenizer = task.tokenizer()
  for label, document in enumerate(documents):
    ids = [e["token_ids"] for e in examples if e["label"] == label]
    assert len(ids) == -(-len(tokenizer(document)) // 30)  # pieces of 30 tokens: every token
    body = np.concatenate([row[1:list(row).index(3)] for row in ids])  # between [CLS] and [SEP]
    np.testing.assert_array_equal(body, np.asarray(tokenizer(document)))
  assert len(examples) > 2  # the comedy's 70 words fill more than one 32-token passage
  # A class of plain text files (no **NAME** lines) gave no passages: it trained as no examples,
  # its label never seen, without a word (a helper's probe: accuracy 1.0 over the other class).
  (tmp_path / "plays" / "notes").mkdir()
  (tmp_path / "plays" / "notes" / "a.txt").write_text("plain text, no speaker lines\n")
  with pytest.raises(text_tasks.DataError, match="class 'notes' holds no speeches.*text_unit: "
                                                 "document"):
    text_tasks.read_documents(config.task.train_data)
  with pytest.raises(Exception) as excinfo:
    config_lib.load_config([], ["task.train_data.text_unit=passages"])
  assert "did you mean 'passage'" in str(excinfo.value)


def test_a_vocabulary_with_its_reserved_tokens_elsewhere_packs_with_its_own_ids(tmp_path):
  """A review: read_vocabulary takes [UNK], [CLS], [SEP] and [MASK] anywhere (BERT's own file
  has them at 100-103), but sequences were packed and framed with ids 2 and 3, tfdp's: another
  token each. Seen failing: every sequence started with id 2, not the vocabulary's [CLS]."""
  from tfdp import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfdp.core import task as tasks  # pylint: disable=g-import-not-at-top
  tokens = [t for t in VOCAB.read_text().split("\n") if t]
  reserved = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
  moved = ["[PAD]", "[unused0]", "[unused1]", "[unused2]", "[unused3]",
           *[t for t in tokens if t not in reserved], *reserved[1:]]
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("\n".join(moved) + "\n")
  corpus = write_corpus(tmp_path / "corpus", documents_per_class=2, words_per_document=40)
  for name, extra in (("masked_lm", ",task.train_data.split=train"), ("text_classification", "")):
    config = config_lib.load_config([], [
        f"task.name={name},task.model.name=bert,task.text.vocab_path={vocab},"
        "task.text.sequence_length=16,task.model.kwargs={max_sequence_length: 16},"
        f"task.train_data.source=text_folder,task.train_data.path={corpus},"
        f"task.train_data.split=all,task.eval_data.source=text_folder,"
        f"task.eval_data.path={corpus},task.eval_data.split=all" + extra])
    task = tasks.make_task(config.task)
    cls, sep = len(moved) - 3, len(moved) - 2
    rows = [e["token_ids"] for e in
            task.build_source(config.task.train_data).read([0]).as_numpy_iterator()]
    assert rows and all(row[0] == cls for row in rows), (name, rows[0])
    assert not any(2 in row or 3 in row for row in rows), name  # [unused1], [unused2]
    assert any(sep in row for row in rows), name


@pytest.mark.parametrize("task_name, setting, words", [
    ("masked_lm", "task.model.kwargs.max_sequence_length=abc",
     "task.model.kwargs.max_sequence_length must be a whole number of at least 2, got 'abc'"),
    ("masked_lm", "task.model.kwargs.max_sequence_length=null", "got None"),
    ("text_classification", "task.text.sequence_length=2",
     "task.text.sequence_length=2 leaves no room for a token between [CLS] and [SEP]; use at "
     "least 3"),
])
def test_bert_lengths_are_checked_before_tensorflow_starts(tmp_path, task_name, setting, words):
  """A review: max_sequence_length=abc (or null) stopped --print_config with a TypeError
  traceback, exit 0; sequence_length=2 passed for a classifier that needs 3, failing after the
  corpus was tokenized. Seen failing: the TypeError; no error."""
  from tfdp import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.text import tasks as text_tasks  # pylint: disable=g-import-not-at-top
  with pytest.raises(text_tasks.ConfigError) as raised:  # the config's checks, as it loads
    config_lib.load_config([], [
        f"task.name={task_name},task.model.name=bert,task.text.vocab_path={VOCAB},"
        "task.text.sequence_length=16,task.model.kwargs={max_sequence_length: 16},"
        f"task.train_data.source=text_folder,task.train_data.path={tmp_path},"
        f"task.eval_data.source=text_folder,task.eval_data.path={tmp_path}", setting])
  assert words in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
