"""Every user mistake: one line naming the fix, a non-zero exit, no traceback, nothing lost."""
import json
import os
import time

import pytest

import helpers

TINY = ("task.train_data.source=synthetic,task.train_data.num_examples=64,"
        "task.train_data.image_size=8,task.train_data.num_classes=2,trainer.global_batch_size=16,"
        "task.model.name=small_cnn,runtime.cpu_replicas=2")


def assert_one_line_error(proc, *words):
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  lines = helpers.error_lines(proc)
  assert len(lines) == 1, proc.stderr[-2000:]
  for word in words:
    assert word in lines[0], lines[0]


@pytest.mark.parametrize("override, words", [
    ("trainer.epochz=2", ["trainer.epochz", "trainer.epochs"]),
    ("trainer.epochs=two", ["trainer.epochs", "whole number"]),
    ("trainer.epochs=-3", ["trainer.epochs", ">= 0"]),
    ("runtime.cpu_replicas=3,task.train_data.shard_policy=file",  # data/auto: split unevenly
     ["global_batch_size", "3 replicas", "multiple of 3"]),
    ("task.model.name=resnet21", ["task.model.name", "resnet20"]),
    # A scalar for a mapping, and a comma inside a value: no key or fix was named (a probe).
    ("trainer.learning_rate=0.01", ["did you mean trainer.learning_rate.base_lr=0.01?"]),
    ("trainer.optimizer=adam", ["did you mean trainer.optimizer.name=adam?"]),
    ("task.train_data.path=/tmp/a,b/imgs", ["'b/imgs' has no '='", "quote that value",
                                            'task.train_data.path="/tmp/a,b/imgs"']),
    ("task.train_data.source=csv", ["task.train_data.source", "tfds"]),
    ("task.train_data.name=cifar11,task.train_data.data_dir=/nonexistent",
     ["cifar11", "/nonexistent", "TFDS_DATA_DIR"]),
])
def test_config_mistakes(tmp_path, override, words):
  proc = helpers.run_train(f"--model_dir={tmp_path / 'run'}", f"--params_override={override}",
                           timeout=60)
  assert_one_line_error(proc, *words)


def test_missing_dataset_fails_within_ten_seconds(tmp_path):
  start = time.monotonic()
  proc = helpers.run_train(f"--model_dir={tmp_path / 'run'}", TFDS_DATA_DIR=str(tmp_path / "empty"),
                           timeout=60)
  assert time.monotonic() - start < 10
  assert_one_line_error(proc, "cifar10", str(tmp_path / "empty"), "TFDS_DATA_DIR")


def test_unreadable_image_in_folder(tmp_path):
  helpers.write_image_folder(tmp_path / "images", per_class=4)
  (tmp_path / "images" / "cat" / "truncated.png").write_bytes(b"\x00\x01 definitely not a png")
  folder = (f"task.train_data.source=image_folder,task.train_data.path={tmp_path / 'images'},"
            "trainer.global_batch_size=4,task.model.name=small_cnn,runtime.cpu_replicas=2,"
            "trainer.epochs=1")
  proc = helpers.run_train(f"--model_dir={tmp_path / 'run'}", "--mode=train",
                           f"--params_override={folder}", timeout=120)
  assert_one_line_error(proc, "truncated.png")


def test_a_run_fixed_after_its_first_step_failed_is_not_told_its_settings_changed(tmp_path):
  """A JPEG truncated mid-data fails only in the first step, after config.yaml is written. The
  user replaces it and runs again with another batch: that run starts afresh, yet the old
  experiment.py warned that its settings 'differ from the earlier run's and apply from now on'."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  helpers.write_image_folder(tmp_path / "images", per_class=4)
  jpeg = tf.io.encode_jpeg(helpers.id_image(0, size=32)).numpy()
  (tmp_path / "images" / "cat" / "truncated.jpg").write_bytes(jpeg[:len(jpeg) // 2])
  folder = (f"task.train_data.source=image_folder,task.train_data.path={tmp_path / 'images'},"
            "task.model.name=small_cnn,runtime.cpu_replicas=2,trainer.epochs=1")
  run = f"--model_dir={tmp_path / 'run'}"
  proc = helpers.run_train(run, "--mode=train", f"--params_override={folder},"
                           "trainer.global_batch_size=4", timeout=120)
  assert_one_line_error(proc, "truncated.jpg", "replace or remove it")
  assert (tmp_path / "run" / "config.yaml").exists()  # the first step had begun
  (tmp_path / "images" / "cat" / "truncated.jpg").unlink()
  proc = helpers.run_train(run, "--mode=train", f"--params_override={folder},"
                           "trainer.global_batch_size=8", timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "settings differ" not in proc.stderr, proc.stderr[-2000:]
  assert "saved no checkpoint" in proc.stderr, proc.stderr[-2000:]
  assert "global_batch_size: 8" in (tmp_path / "run" / "config.yaml").read_text()


def test_eval_folder_missing_a_training_class(tmp_path):
  helpers.write_image_folder(tmp_path / "train", per_class=4, classes=("a", "b", "c"))
  helpers.write_image_folder(tmp_path / "eval", per_class=2, classes=("a", "c"))
  folders = (f"task.train_data.source=image_folder,task.train_data.path={tmp_path / 'train'},"
             f"task.eval_data.source=image_folder,task.eval_data.path={tmp_path / 'eval'},"
             "trainer.global_batch_size=4,task.model.name=small_cnn,runtime.cpu_replicas=2")
  # Folder names need no TensorFlow: refused before it loads (the README's ~0.2 s), which a
  # tensorflow package that fails on import shows.
  no_tensorflow = tmp_path / "no_tensorflow" / "tensorflow"
  no_tensorflow.mkdir(parents=True)
  (no_tensorflow / "__init__.py").write_text("raise ImportError('tensorflow imported')\n")
  path = os.pathsep.join(str(p) for p in (no_tensorflow.parent, helpers.REPO, helpers.SCRIPTS))
  proc = helpers.run_train(f"--model_dir={tmp_path / 'run'}", f"--params_override={folders}",
                           timeout=120, PYTHONPATH=path)
  assert_one_line_error(proc, "lacks 'b'", "same class subfolders")
  assert not (tmp_path / "run").exists()


def test_a_renamed_class_folder_is_refused_on_eval_and_resume(tmp_path):
  """Image labels follow the sorted class folders: a probe renamed 'fish' to 'ant' and its
  --mode=eval scored 0.0000 (every label shifted), silently; a resume trained on the shifted
  labels. The run now saves class_names.json and compares it, as text runs do. Seen failing:
  on the old code the eval ran (exit 0) and no class_names.json was written."""
  helpers.write_image_folder(tmp_path / "images", per_class=4, classes=("cat", "dog", "fish"))
  folder = (f"task.train_data.source=image_folder,task.train_data.path={tmp_path / 'images'},"
            f"task.eval_data.source=image_folder,task.eval_data.path={tmp_path / 'images'},"
            "trainer.global_batch_size=4,task.model.name=small_cnn,task.model.kwargs={},"
            "runtime.cpu_replicas=2,trainer.epochs=1,task.eval_flip=false")
  run = tmp_path / "run"
  first = helpers.run_train(f"--model_dir={run}", f"--params_override={folder}", timeout=240)
  assert first.returncode == 0, first.stderr[-3000:]
  assert json.loads((run / "class_names.json").read_text()) == ["cat", "dog", "fish"]
  (tmp_path / "images" / "fish").rename(tmp_path / "images" / "ant")
  before = sorted(p.name for p in run.iterdir())
  for mode, more in (("eval", ""), ("train_and_eval", ",trainer.epochs=2")):
    proc = helpers.run_train(f"--model_dir={run}", f"--mode={mode}",
                             f"--params_override={folder}{more}", timeout=120)
    assert_one_line_error(proc, "has other class folders than the run trained on",
                          "lacks 'fish'", "has 'ant'")
  assert sorted(p.name for p in run.iterdir()) == before


def test_unwritable_model_dir(tmp_path):
  (tmp_path / "afile").write_text("x")
  proc = helpers.run_train(f"--model_dir={tmp_path / 'afile' / 'run'}",
                           f"--params_override={TINY}", timeout=60)
  assert_one_line_error(proc, "--model_dir", "afile")


def test_bad_flags_and_files(tmp_path):
  assert_one_line_error(helpers.run_train("--mode=fit", timeout=60), "--mode")
  assert_one_line_error(helpers.run_train(f"--config_file={tmp_path / 'nope.yaml'}", timeout=60),
                        "nope.yaml", "does not exist")
  assert_one_line_error(helpers.run_train("--params_override=trainer", timeout=60), "'='")


def test_a_failing_run_leaves_model_dir_untouched(tmp_path):
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  kept = {"metrics.csv": "epoch,step\n1,10\n", "config.yaml": "earlier: run\n",
          "checkpoints/checkpoint": 'model_checkpoint_path: "ckpt-10"\n'}
  for name, text in kept.items():
    (model_dir / name).parent.mkdir(parents=True, exist_ok=True)
    (model_dir / name).write_text(text)
  for override in ("runtime.cpu_replicas=3", "task.train_data.data_dir=/nonexistent"):
    proc = helpers.run_train(f"--model_dir={model_dir}", f"--params_override={override}", timeout=60)
    assert proc.returncode == 2
  assert {p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if p.is_file()} == set(kept)
  for name, text in kept.items():
    assert (model_dir / name).read_text() == text


def test_jit_compile_with_several_replicas_is_refused(tmp_path):
  proc = helpers.run_train(f"--model_dir={tmp_path / 'run'}", "--mode=train",
                           f"--params_override={TINY},runtime.jit_compile=true", timeout=120)
  assert_one_line_error(proc, "runtime.jit_compile", "2")


def test_evaluation_images_the_model_was_not_built_for_are_refused_before_training(tmp_path):
  # Before: a bare Keras traceback ("expected shape=(None, 8, 8, 3), found shape=(8, 32, 32, 3)")
  # at the first evaluation, after an epoch of training.
  eval_16 = (",task.eval_data.source=synthetic,task.eval_data.num_examples=32,"
             "task.eval_data.image_size=16,task.eval_data.num_classes=2")
  proc = helpers.run_train(f"--model_dir={tmp_path / 'run'}", f"--params_override={TINY}{eval_16}",
                           timeout=120)
  assert_one_line_error(proc, "16x16x3 images", "8x8x3", "task.eval_data.image_size=8")
  assert not (tmp_path / "run").exists()


def test_evaluation_labels_past_the_models_classes_are_refused():
  from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
  from tfdp.core import experiment  # pylint: disable=g-import-not-at-top
  source = lambda classes: data_lib.Source([4], None, "synthetic", num_classes=classes,
                                           image_shape=(8, 8, 3))
  trained = experiment.model_input(source(4))
  experiment.check_eval_fits_model(trained, source(2), "task.train_data's")  # every label fits
  with pytest.raises(data_lib.DataError, match="6 classes.*task.train_data's 4"):
    experiment.check_eval_fits_model(trained, source(6), "task.train_data's")
  gray = data_lib.Source([4], None, "synthetic", num_classes=4, image_shape=(8, 8, 1))
  with pytest.raises(data_lib.DataError, match="8x8x1 images.*evaluate on images of 3 channel"):
    experiment.check_eval_fits_model(trained, gray, "task.train_data's")  # no resize fixes it
