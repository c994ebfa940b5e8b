"""tfdp.fit reduces a compiled loss as Keras does and reports what Keras reports, on 2 replicas
against single-device model.fit, or refuses in one line what its own loop cannot honour (cases in
tests/scripts/keras_fit_loss_cases.py, one process)."""
import json
import sys

import pytest

import helpers

pytestmark = pytest.mark.xdist_group("test_keras_fit_losses")  # its cases once (test_xdist_groups)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
  # uncapped: its mixed_bfloat16 case would abort in oneDNN under the AVX2 imitation's cap
  proc = helpers.run_python([sys.executable, str(helpers.SCRIPTS / "keras_fit_loss_cases.py")],
                            env=helpers.env(**helpers.UNCAPPED),
                            cwd=tmp_path_factory.mktemp("loss_cases"), timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["masked_steps", "summed_and_regularized",
                                  "activity_regularized", "weighted_mean", "add_loss_only"])
def test_losses_and_metrics_are_keras_own_with_a_last_batch_of_other_size(cases, case):
  """Every history value and the final weights equal model.fit's (60 examples in batches of 16).
  Seen failing on the old tfdp/compiled/task.py: a masked per-step loss was averaged over the
  padded steps too (loss 0.61 for Keras's 1.01) and an accuracy on it crashed; reduction="sum"
  trained a mean (gradients 16x smaller); the regularization was missing from loss and val_loss;
  F1Score and R2Score, whose variables a first update creates, were missing from the history;
  an activity regularization counted the padded rows and was read, after the summed loss's
  all-reduce, from another replica's call (weights 0.2 apart with the old trainer)."""
  result = cases[case]  # add_loss_only: seen failing on the old code (refused: no loss)
  assert set(result["tfdp"]) == set(result["keras"]), result
  # loss, a metric, and their val_ forms (a model compiled without a loss: loss and val_loss)
  assert len(result["keras"]) >= (2 if case == "add_loss_only" else 4), result
  for name, expected in result["keras"].items():
    assert result["tfdp"][name] == pytest.approx(expected, rel=1e-5, abs=1e-6), name
  assert result["weights"] < 1e-5


def test_regularizations_of_two_dtypes_add_up_under_mixed_bfloat16(cases):
  """An activity regularization in bfloat16 beside a kernel one in float32 (most of the loss
  here): Keras 3.15's model.fit raises TypeError on them; tfdp.fit reports within bfloat16's
  rounding of float32 model.fit. Seen failing on the old trainer (the same TypeError from AddN)."""
  result = cases["mixed_bfloat16_regularized"]
  assert "error" not in result, result
  assert set(result["tfdp"]) == set(result["keras"]) == {"loss", "val_loss"}, result
  for name, expected in result["keras"].items():
    assert result["tfdp"][name] == pytest.approx(expected, rel=0.03), name


def test_a_model_compiled_without_a_loss_is_evaluated_on_x_alone(cases):
  """Its layers' add_loss is its loss (the add_loss_only case trains it). Seen failing on the old
  tfdp/compiled/task.py: 'the model is not compiled with an optimizer and a loss'."""
  result = cases["add_loss_evaluated"]
  assert result["tfdp"] == pytest.approx(result["keras"], rel=1e-5)


@pytest.mark.parametrize("case, said", [
    ("own_train_step", "tfdp.fit: OwnTrainStep overrides train_step"),
    ("own_compute_loss", "tfdp.fit: OwnComputeLoss overrides compute_loss"),
    ("own_predict_step", "tfdp.predict: OwnPredictStep overrides predict_step, which tfdp's own "
     "prediction loop never calls"),  # it said "training loop ... train with model.fit"
    ("running_max", "tfdp.fit: metric variable 'running_max/largest' does not add up"),
    ("no_reduction", "tfdp.fit: loss 'sparse_categorical_crossentropy' has reduction='none'"),
    ("reduction_none", "tfdp.fit: loss 'sparse_categorical_crossentropy' has reduction=None"),
    ("no_loss_nor_add_loss", "tfdp.fit: the model is compiled without a loss and its layers add "
     "none"),
    ("metrics_without_loss", "tfdp.fit: the model is compiled with metrics but no loss")])
def test_what_tfdp_cannot_honour_is_refused_in_one_line(cases, case, said):
  """Each was trained or scored silently otherwise before (an override ignored, a running
  maximum summed over batches)."""
  assert cases[case].startswith(said), cases[case]
  assert "\n" not in cases[case]
