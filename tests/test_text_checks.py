"""The text workloads refuse, in one line before TensorFlow starts, what would train or score
silently wrong: overlapping holdouts, eval classes unlike training's, classification without
classes, and a resume, evaluation or warm start with another vocabulary or other classes."""
import json

import pytest

import helpers
from test_text_tasks import VOCAB, mlm_overrides, write_corpus
from tfdp import config as config_lib
from tfdp.core import class_folders
from tfdp.config.schema import DataConfig
from tfdp.core import task as tasks
from tfdp.errors import ConfigError, DataError
from tfdp.workloads.text import tasks as text_tasks

CONFIGS = helpers.REPO / "configs"


def one_line(excinfo) -> str:
  message = str(excinfo.value)
  assert "\n" not in message, message
  return message


def classify_overrides(corpus, extra=""):
  return mlm_overrides(corpus, extra).replace("task.name=masked_lm", "task.name=text_classification")


def swapped_vocabulary(path):
  """The shipped vocabulary with two tokens' ids exchanged: the same size, every file valid."""
  tokens = VOCAB.read_text(encoding="utf-8").splitlines()
  tokens[100], tokens[101] = tokens[101], tokens[100]
  path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
  return path


def test_eval_holdout_must_equal_train_holdout_of_the_same_path():
  mlm = [str(CONFIGS / "shakespeare_mlm.yaml")]
  with pytest.raises(ConfigError) as excinfo:  # the probe's case: macbeth trained and evaluated
    config_lib.load_config(mlm, ["task.eval_data.holdout=[hamlet, macbeth]"])
  message = one_line(excinfo)
  assert "task.train_data.holdout and task.eval_data.holdout" in message, message
  assert "['macbeth'] would be trained on and evaluated" in message and "must be equal" in message, message
  for split, holdout in (("holdout", "[hamlet]"), ("all", "[]")):  # trains hamlet, or every play
    with pytest.raises(ConfigError) as excinfo:  # runlocal_text with hamlet evaluated too
      config_lib.load_config(mlm, [f"task.train_data.split={split},task.train_data.holdout="
                                   f"{holdout},task.eval_data.holdout=[edward-iii, hamlet]"])
    message = one_line(excinfo)
    assert f"(split '{split}') trains on" in message and "'hamlet'] would be trained" in message
  config_lib.load_config(mlm, ["task.train_data.split=holdout,task.train_data.holdout=[hamlet],"
                               "task.eval_data.holdout=[edward-iii]"])
  config_lib.load_config(mlm)  # the shipped configs share one list
  config_lib.load_config(mlm + [str(CONFIGS / "runlocal_text.yaml")])  # train: split holdout
  config_lib.load_config(mlm, ["task.eval_data.path=../shared/text/other"])  # another corpus


def test_classification_needs_class_folders(tmp_path):
  corpus = write_corpus(tmp_path / "corpus", documents_per_class=1, words_per_document=5)
  for key in ("train_data", "eval_data"):
    with pytest.raises(ConfigError) as excinfo:  # labels [0] for all: accuracy 1.0, always
      config_lib.load_config([], [classify_overrides(
          corpus, f",task.{key}.source=text_files,task.{key}.path={corpus}/*/*.txt")])
    message = one_line(excinfo)
    assert f"'task.{key}.source' is 'text_files'" in message and "use text_folder" in message
  config_lib.load_config([], [mlm_overrides(  # masked-LM needs no labels
      corpus, f",task.train_data.source=text_files,task.train_data.path={corpus}/*/*.txt")])


def test_an_eval_folder_with_other_classes_is_refused(tmp_path):
  train = write_corpus(tmp_path / "train", 1, 5, classes=("comedies", "histories", "tragedies"))
  evaluation = write_corpus(tmp_path / "eval", 1, 5, classes=("histories", "tragedies", "verse"))
  with pytest.raises(DataError) as excinfo:  # histories would be scored as comedies, and so on
    config_lib.load_config([], [classify_overrides(train, f",task.eval_data.path={evaluation}")])
  message = one_line(excinfo)
  assert "the eval folder lacks 'comedies'; it has 'verse', which training lacks" in message
  assert "give the eval folder the same class subfolders" in message, message
  (evaluation / "comedies").mkdir()
  (tmp_path / "train" / "verse").mkdir()  # an empty class folder is a class all the same
  config_lib.load_config([], [classify_overrides(train, f",task.eval_data.path={evaluation}")])


def test_one_class_folder_is_refused_before_anything_is_written(tmp_path):
  corpus = write_corpus(tmp_path / "corpus", 2, 5, classes=("comedies",))
  proc = helpers.run_train(f"--model_dir={tmp_path / 'run'}",
                           f"--params_override={classify_overrides(corpus)}", timeout=120)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  lines = helpers.error_lines(proc)  # else: loss 0 and accuracy 1.0 from the first step
  assert len(lines) == 1 and "one class (its only class folder is 'comedies')" in lines[0], lines
  assert not (tmp_path / "run").exists()


WARM_START = tasks.SavedRunUse("warm start", "drop task.init_checkpoint", warm_start=True)


def test_saved_vocabulary_and_classes_are_compared(tmp_path):
  corpus = write_corpus(tmp_path / "corpus", 1, 5)  # plays, poems
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  (run / "checkpoints" / "ckpt-1.index").write_bytes(b"")
  (run / text_tasks.VOCABULARY_FILE).write_text(VOCAB.read_text(encoding="utf-8"))
  (run / class_folders.CLASS_NAMES_FILE).write_text(json.dumps(["plays", "verse"]))
  task = text_tasks.TextClassificationTask
  context = tasks.SavedRunUse("resume", "pass --start_over")
  config = config_lib.load_config([], [classify_overrides(corpus)]).task
  with pytest.raises(DataError) as excinfo:
    task.check_saved_artifacts(config, str(run), context)
  message = one_line(excinfo)
  assert message.startswith("resume: task.eval_data.path") and "lacks 'verse'" in message
  # A warm start restores the encoder only: the head, and its classes, are new.
  warm = config_lib.load_config([], [classify_overrides(corpus, f",task.init_checkpoint={run}")])
  task.check_saved_artifacts(warm.task, str(run), WARM_START)
  (run / class_folders.CLASS_NAMES_FILE).write_text(json.dumps(["plays", "poems"]))
  task.check_saved_artifacts(config, str(run), context)
  other = swapped_vocabulary(tmp_path / "other_vocab.txt")
  changed = config_lib.load_config([], [classify_overrides(
      corpus, f",task.init_checkpoint={run},task.text.vocab_path={other}")]).task
  for task_class in (task, text_tasks.MaskedLMTask):  # from a classifier's or a masked-LM run
    with pytest.raises(ConfigError) as excinfo:
      task_class.check_saved_artifacts(changed, str(run), WARM_START)
    message = one_line(excinfo)
    assert f"task.text.vocab_path '{other}' is not the vocabulary that run used" in message
    assert "token id 100" in message and f"task.text.vocab_path={run}" in message, message


def test_a_run_keeps_its_vocabulary_and_classes_and_refuses_others(tmp_path):
  corpus = write_corpus(tmp_path / "corpus", documents_per_class=2, words_per_document=40)
  run = tmp_path / "run"
  first = helpers.run_train(f"--model_dir={run}", "--mode=train",
                            f"--params_override={classify_overrides(corpus, ',trainer.max_steps=1')}")
  assert first.returncode == 0, first.stderr[-2000:]
  assert (run / "vocabulary.txt").read_text() == VOCAB.read_text()
  assert json.loads((run / "class_names.json").read_text()) == ["plays", "poems"]
  other_vocab = swapped_vocabulary(tmp_path / "other_vocab.txt")
  other_classes = write_corpus(tmp_path / "other", 1, 5, classes=("plays", "songs"))
  cases = {  # each refused in preflight: no TensorFlow, nothing written
      "resume": ("--mode=train", f",trainer.max_steps=2,task.text.vocab_path={other_vocab}",
                 "resume: task.text.vocab_path"),
      "eval vocabulary": ("--mode=eval", f",task.text.vocab_path={other_vocab}",
                          "--mode=eval: task.text.vocab_path"),
      "eval classes": ("--mode=eval", f",task.train_data.path={tmp_path / 'gone'},"
                       f"task.eval_data.path={other_classes}", "lacks 'poems'"),
      "warm start": ("--mode=train", f",task.text.vocab_path={other_vocab},"
                     f"task.init_checkpoint={run},trainer.max_steps=1",
                     "warm start from task.init_checkpoint"),
  }
  for name, (mode, extra, words) in cases.items():
    model_dir = tmp_path / "warm" if name == "warm start" else run
    proc = helpers.run_train(f"--model_dir={model_dir}", mode,
                             f"--params_override={classify_overrides(corpus, extra)}")
    errors = helpers.error_lines(proc)
    assert proc.returncode != 0 and len(errors) == 1 and words in errors[0], (name, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
  assert not (tmp_path / "warm").exists()


def test_a_run_tokenized_with_other_casing_is_refused_on_resume_and_warm_start(tmp_path):
  """task.text.lowercase changed: the same vocabulary, the text cut into other tokens."""
  corpus = write_corpus(tmp_path / "corpus", 1, 5)
  run = tmp_path / "run"
  run.mkdir()
  (run / text_tasks.TOKENIZER_FILE).write_text(json.dumps({"lowercase": True}))
  cased = config_lib.load_config([], [classify_overrides(corpus, ",task.text.lowercase=false")])
  for context in (tasks.SavedRunUse("resume", "pass --start_over"), WARM_START):
    for task_class in (text_tasks.TextClassificationTask, text_tasks.MaskedLMTask):
      with pytest.raises(ConfigError) as excinfo:
        task_class.check_saved_artifacts(cased.task, str(run), context)
      message = one_line(excinfo)
      assert "task.text.lowercase is False" in message and "task.text.lowercase=True" in message
  same = config_lib.load_config([], [classify_overrides(corpus)])  # lowercase: true, the default
  text_tasks.MaskedLMTask.check_saved_artifacts(same.task, str(run), WARM_START)


@pytest.mark.parametrize("task_name, source, classes, said", [
    ("image_classification", "image_folder", (), "image folder '{root}' has no class subfolders"),
    ("image_classification", "image_folder", ("cat",), "task.train_data has one class (its only "
                                                         "class folder is 'cat')"),
    ("text_classification", "text_folder", (), "text folder '{root}' has no class subfolders"),
    ("text_classification", "text_folder", ("plays",), "task.train_data has one class (its only "
                                                         "class folder is 'plays')"),
    ("masked_lm", "text_folder", (), "text folder '{root}' has no class subfolders"),
    ("masked_lm", "text_folder", ("plays",), None),  # one genre: masked-LM learns no labels
])
def test_a_folder_without_classes_or_a_classifiers_of_one_is_refused_before_tensorflow(
    tmp_path, task_name, source, classes, said):
  """Task.check_source is what preflight runs before TensorFlow starts. These were found once the
  files were read, after TensorFlow had started: ~4 CPU s a mistake (the suite's profile, the
  AVX2-only EPYC). Seen failing on the old sources.py and text tasks.py: nothing raised."""
  root = tmp_path / "data"
  for name in classes:
    (root / name).mkdir(parents=True)
  root.mkdir(exist_ok=True)
  (root / "README").write_text("beside the class folders")
  data = DataConfig(source=source, path=str(root))
  task_class = tasks.task_class(task_name)
  if said is None:
    task_class.check_source(data, "task.train_data")
    return
  with pytest.raises(DataError) as excinfo:
    task_class.check_source(data, "task.train_data")
  assert one_line(excinfo).startswith(said.format(root=root)), one_line(excinfo)
  if classes:  # evaluated, one class is scored (against training's classes)
    task_class.check_source(data, "task.eval_data")


def test_synthetic_data_of_one_class_is_refused_before_tensorflow():
  """As a folder of one class, above (the hardening case synthetic_one_class started TensorFlow
  first). Seen failing on 2003b58's class_folders.py: nothing raised."""
  data, task_class = DataConfig(source="synthetic", num_classes=1), tasks.task_class(
      "image_classification")
  with pytest.raises(DataError) as excinfo:
    task_class.check_source(data, "task.train_data")
  assert one_line(excinfo).startswith("task.train_data has one class: a classifier")
