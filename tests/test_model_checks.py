"""A user's model builder (task.model.module) that returns something the image task cannot
train as its classifier is named in one line before anything trains or is written: logits of
another width, a softmax, a fixed Input of another size, None. An unbuilt model (a Sequential
without an Input, a subclassed model) is built on the data's images and trains; a compiled one
trains with one warning that its compile() settings are not used."""
from __future__ import annotations

import logging
import sys

import pytest

import helpers
import test_hardening as hardening

pytestmark = pytest.mark.xdist_group("test_model_checks")

sys.path.insert(0, str(helpers.SCRIPTS))
import user_builders  # noqa: E402,F401  pylint: disable=g-import-not-at-top,unused-import

USER = "task.model.module=user_builders,task.model.name="


def build(name: str, shape=(8, 8, 3), classes: int = 3):
  from tfdp.workloads.vision import models  # pylint: disable=g-import-not-at-top
  return models.build_model(name, shape, classes)


@pytest.mark.parametrize("name, words", [
    # trained silently: eval_accuracy 0.67, an exported (None, 10)
    ("user_wrong_size", ("'user_wrong_size'", "10 values per example", "3 classes",
                         "task.train_data.num_classes", "Dense(num_classes)")),
    # trained its probabilities as logits
    ("user_softmax", ("ends in a softmax", "return logits (drop the softmax)")),
    ("user_softmax_layer", ("ends in a softmax", "return logits (drop the softmax)")),
    # Keras's multi-line shape error at the first batch
    ("user_fixed_shape", ("takes inputs of shape 64x64x3", "images are 8x8x3",
                          "keras.Input(input_shape)", "task.train_data.image_size")),
    # an AttributeError in the trainer
    ("user_returns_none", ("returned None, not a keras.Model", "return the model",
                           "user_builders.user_returns_none")),
    ("user_call_fails", ("fails on the data's images (8x8x3)", "fix the builder")),
    # Keras's bare 'not enough values to unpack' in apply_gradients (a probe)
    ("user_int_outputs", ("outputs int32, not float logits", "Dense(num_classes)")),
    ("user_spatial", ("user_spatial) outputs shape 8x8x3 per example",)),
])
def test_a_builder_mistake_is_one_line_naming_the_fix(name, words):
  from tfdp.errors import ConfigError  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError) as error:
    build(name)
  message = str(error.value)
  assert "\n" not in message and f"model '{name}'" in message, message
  for word in words:
    assert word in message, message


@pytest.mark.parametrize("name", ["user_sequential_unbuilt", "user_subclassed"])
def test_an_unbuilt_model_is_built_on_the_datas_images(name):
  model = build(name)  # was unbuilt: apply_gradients failed with "not enough values to unpack"
  assert model.built and model.trainable_variables
  assert model.compute_output_spec(__import__("keras").KerasTensor((None, 8, 8, 3))).shape == (
      None, 3)


def test_a_compiled_model_warns_that_its_compile_settings_are_not_used(caplog):
  with caplog.at_level(logging.WARNING):
    build("user_compiled")
    build("user_fine")
  said = [r.getMessage() for r in caplog.records if "compile()" in r.getMessage()]
  assert len(said) == 1 and "\n" not in said[0], said
  for word in ("'user_compiled'", "trainer.optimizer", "learning_rate", "task's loss", "tfdp.fit"):
    assert word in said[0], said[0]


def test_a_builder_that_needs_a_keyword_or_is_a_partial_builds():
  """A required keyword given by task.model.kwargs was refused as a wrong signature, and a
  functools.partial builder (no __qualname__) stopped in an AttributeError traceback."""
  from tfdp.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.vision import models  # pylint: disable=g-import-not-at-top
  assert models.build_model("user_needs_width", (8, 8, 3), 3, width=2).built
  assert build("user_partial").built
  with pytest.raises(ConfigError, match=r"task.model.kwargs \{\} do not fit .*'width'"):
    build("user_needs_width")  # not given: the kwargs' to fix, not the signature's


def test_builtin_models_pass_the_checks():
  for name in ("small_cnn", "resnet8", "airbench"):
    assert build(name, (16, 16, 3), 10).built


def test_tfdp_train_refuses_in_one_line_and_leaves_model_dir_as_it_was(tmp_path, request):
  """A real process: one error line, no traceback, an earlier run's files untouched (the check
  runs where the model is built, before config.yaml is written)."""
  case = hardening.Case("user_wrong_size", ("'user_wrong_size'", "10 values per example",
                                            "2 classes"),
                        override=USER + "user_wrong_size")
  hardening.check_refused(case, tmp_path, request)


def test_tfdp_train_trains_an_unbuilt_subclassed_model(tmp_path):
  model_dir = tmp_path / "run"
  proc = helpers.run_train(f"--model_dir={model_dir}",
                           f"--params_override={hardening.TINY},{USER}user_subclassed",
                           timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (model_dir / "checkpoints").is_dir() and (model_dir / "metrics.csv").exists()
