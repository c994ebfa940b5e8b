"""tfdp.fit takes what keras.Model.fit takes: a compiled model, Keras's data forms and arguments,
Keras's own metrics exact under padding, callbacks, a usable model and History afterwards.

The cases run in tests/scripts/keras_fit_cases.py, one process each (the multi-worker one under
tfdp-launch); these tests judge what they report."""
import json
import re
import sys

import numpy as np
import pytest

import helpers

# Every test of this module on one xdist worker: a module-scoped fixture here trains in real
# processes, and would train again on each worker that ran one of the tests using it.
pytestmark = pytest.mark.xdist_group("test_keras_fit")

CASES = str(helpers.SCRIPTS / "keras_fit_cases.py")
LAUNCH_APP = str(helpers.REPO / "apps" / "launch.py")


def run_case(tmp_path, case: str, replicas: int = 0, workers: int = 0) -> list[dict]:
  tmp_path.mkdir(parents=True, exist_ok=True)
  out = tmp_path / f"{case}.json"
  command = [sys.executable, CASES, case, str(out), str(replicas)]
  if workers:
    command = [sys.executable, LAUNCH_APP, "--num_workers", str(workers), "--", *command]
  proc = helpers.run_python(command, env=helpers.env(), cwd=tmp_path, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = [json.loads((tmp_path / f"{case}.json.{rank}").read_text())
             for rank in range(max(workers, 1))]
  results[0]["stderr"] = proc.stderr
  return results


@pytest.fixture(scope="module")
def metrics_result(tmp_path_factory):
  return run_case(tmp_path_factory.mktemp("metrics"), "metrics", replicas=3)[0]


def test_keras_metrics_are_exact_on_3_replicas_with_a_padded_last_batch(metrics_result):
  """Every compiled metric (per output, Keras's objects and strings, a subclassed one) equals
  single-device Keras `evaluate` on the same weights: 27 validation examples in batches of 13
  over 3 replicas (5, 4 and 4 rows: a batch Keras's own fit cannot split) leave a last batch
  with 1 real example, fewer than the replicas. Seen failing: with
  the padding weight dropped from the unweighted metrics' update (sample_weight=None in
  CompiledModelTask.metric_state), accuracy, AUC, precision, the subclassed count, ... differ;
  and before the subclassed metric's result was read inside the stateless scope, it read 0."""
  reference, ours = metrics_result["reference"], metrics_result["tfdp"]
  # Keras 3.15's evaluate reports per-output losses that do not add up to its own total loss
  # (measured here: 1.570 against 1.614); each output's loss is checked against the loss
  # function on single-device predictions instead, the total against Keras's.
  compared = [k for k in reference if not k.endswith("_loss") or k == "loss"]
  assert len(compared) >= 12 and "klass_miou" in compared, compared
  for name in compared:
    assert ours[name] == pytest.approx(reference[name], rel=1e-5, abs=1e-6), name
  for name, value in metrics_result["output_losses"].items():
    assert ours[name] == pytest.approx(value, rel=1e-5), name
  for name, value in metrics_result["tfdp_evaluate"].items():
    if name in compared:
      assert value == pytest.approx(reference[name], rel=1e-5, abs=1e-6), name
  assert metrics_result["tfdp_evaluate"]["examples"] == 27
  recorded = metrics_result["config_yaml"]  # what ran, never a default that did not
  assert recorded["task"]["name"] == "keras_model" and "model" not in recorded["task"]
  assert "optimizer" not in recorded["trainer"] and "learning_rate" not in recorded["trainer"]
  keras_record = recorded["keras"]
  assert keras_record["model_class"].endswith(".Functional"), keras_record
  assert keras_record["optimizer"]["class"] == "Adam"
  assert sorted(l["weight"] for l in keras_record["losses"]) == [0.25, 0.5, 1.0]
  assert keras_record["data"]["train_examples"] == 181


def test_the_model_is_usable_afterwards_and_a_finished_run_returns_its_history(metrics_result):
  assert metrics_result["predict_difference"] < 1e-5  # tfdp.predict: every row, in order
  assert metrics_result["saved"] and metrics_result["exported"]  # model.save, model_dir export
  first, again = metrics_result["first_history"], metrics_result["rerun_history"]
  assert len(first["loss"]) == 2 and again["loss"] == first["loss"]
  assert again["val_loss"] == first["val_loss"]
  assert metrics_result["rerun_final_eval_loss"] == pytest.approx(first["val_loss"][-1])
  # Weights changed since the run handed them back: the same model_dir would restore the run's
  # checkpoint over them (seen failing on the old code: silently replaced, a probe's 10 epochs
  # of model.fit lost).
  refused, kept = metrics_result["changed_since"]
  assert refused.startswith("tfdp.fit: the model's weights changed since its run in "
                            "runs/metrics handed them back") and "another model_dir" in refused
  assert kept == 0.0


@pytest.fixture(scope="module")
def forms_result(tmp_path_factory):
  return run_case(tmp_path_factory.mktemp("forms"), "forms", replicas=2)[0]


def test_input_forms_and_weights(forms_result):
  """Sample and class weights give Keras's weighted loss (lr 0 keeps the weights: the epoch's
  train loss is the loss of the initial weights); dict inputs train; a batched dataset keeps its
  batch (16: 96 examples, 6 steps), an unbatched one takes batch_size."""
  ours, keras_loss = forms_result["weighted"]
  assert ours == pytest.approx(keras_loss, rel=1e-5)
  assert np.isfinite(forms_result["dict_arrays"])
  assert forms_result["batched_dataset"] == [16, 6]
  assert forms_result["unbatched_dataset"] == [32, 3]
  # Seeds 1 and 2 shuffle the arrays differently, seed 1 twice alike (seen failing on the old
  # code: tfdp's own fixed seed, the same weights for every user seed).
  other_seed, same_seed = forms_result["seeded"]
  assert other_seed > 1e-4 and same_seed == 0.0
  # Each replica draws its own dropout mask: their mean is 1 where one kept and one dropped
  # (seen failing without compat.replica_random_streams in the trainer: only 0 and 2).
  assert forms_result["dropout_mask_values"] == [0.0, 1.0, 2.0]
  # drop_remainder's static batch dimension: each batch was one example (1 step, 6 predictions
  # of shape (16, 3)) for a model without keras.Input; the dict's first key ('a', rank 2) against
  # the first input ('img', rank 3) was refused. Seen failing on the old heuristic (a probe).
  assert forms_result["drop_remainder"] == {"no_input": [16, 6], "no_input_predict_rows": 96,
                                            "no_input_evaluated": 96, "dict_first_key": 6}


def test_keras_methods_work_on_the_trained_model_and_one_hot_metrics_are_exact(forms_result):
  """model.evaluate / model.predict in the same process after tfdp.fit (2 replicas), equal to
  tfdp.evaluate; CategoricalAccuracy and the categorical loss on one-hot labels, 35 validation
  examples in batches of 16 (a padded last batch, given as a list [x, y]), equal to single-device
  Keras."""
  after = forms_result["after_fit"]
  assert after["predict_rows"] == 96
  for name in ("loss", "accuracy"):
    assert after["tfdp_evaluate"][name] == pytest.approx(after["evaluate"][name], rel=1e-5)
  accuracy, loss, reference = forms_result["onehot"]
  assert accuracy == pytest.approx(reference["categorical_accuracy"], rel=1e-6)
  assert loss == pytest.approx(reference["loss"], rel=1e-5)


def assert_one_lines(errors: dict, expected: dict) -> None:
  """Each case's error is one line (no terminal escapes either) holding the expected words,
  said by the function the user called ("tfdp.fit: ...")."""
  for case, words in expected.items():
    line = errors[case]
    assert words in line and "\n" not in line and "\x1b" not in line, (case, line)
    assert re.match(r"tfdp\.(fit|evaluate|predict): ", line), (case, line)


def test_bad_input_is_one_line_naming_the_fix(forms_result):
  errors = forms_result["errors"]
  expected = {"lengths": "different lengths", "split_with_dataset": "validation_data",
              "infinite": "steps_per_epoch",
              "one_hot_sparse": "one-hot", "model_checkpoint": "drop it from callbacks",
              "subclassed_outside": "make_strategy().scope()",
              "ids_categorical": "one-hot labels",
              # a bare, empty StopIteration before (a probe)
              "one_shot": "x gave no examples when read again",
              "metric_named_steps": "named 'steps', the name of tfdp's own count",
              "validation_width": "the model does not take validation_data's x as given",
              "validation_labels": "validation_data's y does not fit the loss",
              "labels_shape": "y does not fit the loss on the model's outputs",
              "per_step_weights": "has shape (96, 4): weights per timestep",
              "per_step_weights_dataset": "sample weight of shape [4] per example",
              "sparse_x": "tf.SparseTensor, which tfdp cannot split into rows"}
  assert_one_lines(errors, expected)
  assert all(errors[case].startswith("tfdp.fit: ") for case in expected)
  assert forms_result["bad_dir_untouched"]
  assert forms_result["fewer_than_a_batch"] == 1  # model.fit takes it; tfdp refused it once
  # A softmax output with a from_logits=True loss: one warning (the run goes on).
  warned = [line for line in forms_result["stderr"].splitlines()
            if "from_logits=True but the model's last layer applies softmax" in line]
  assert len(warned) == 1, forms_result["stderr"][-3000:]


@pytest.fixture(scope="module")
def parity_result(tmp_path_factory):
  return run_case(tmp_path_factory.mktemp("parity"), "parity", replicas=2)[0]


@pytest.mark.parametrize("built", ["in_scope", "cloned"])
def test_a_users_own_loss_and_callbacks_train_as_model_fit_does(parity_result, built):
  """2 replicas against model.fit on one device: a loss function Keras has no registration
  for; ReduceLROnPlateau halving the rate after epoch 2 (epoch 3's loss shows it) and
  EarlyStopping restoring epoch 1's weights at its stop; validation_steps=2 counting the
  validation dataset's batches of 8 (16 of its 40 examples). Seen failing: the loss copied
  through its config (TypeError: could not be deserialized), the clone given to Keras's
  clone_model without the user's objects (ConfigError), the callbacks acting on the user's
  model instead of the clone that trains (epoch 3's loss and the final weights differ), and
  validation_steps counted in training batches (val_loss over 40 examples)."""
  keras_run, ours = parity_result["keras"], parity_result[built]
  assert len(keras_run["history"]["loss"]) == 3  # stopped early, not after 4 epochs
  for name, values in keras_run["history"].items():
    assert ours["history"][name] == pytest.approx(values, rel=1e-5), name
  assert keras_run["history"]["learning_rate"][-1] == pytest.approx(0.15)
  for a, b in zip(ours["weights"], keras_run["weights"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert ours["steps"] == 6  # History.params, as Keras's


@pytest.mark.parametrize("built", ["in_scope", "cloned"])
def test_the_same_model_dir_goes_on_from_the_weights_a_callback_restored(parity_result, built):
  """A review: EarlyStopping restored epoch 1's weights at its stop, but the run's last
  checkpoint held epoch 3's, saved before the callbacks: the finished run called again handed
  back epoch 3's weights, and a 4th epoch trained on from them, silently (model.fit goes on
  from the model). The run now saves again after the callbacks' on_train_end. Seen failing
  without that save: 'finished' 0.1, and the 4th epoch's loss and weights apart from Keras's."""
  ours, keras_run = parity_result["again"][built], parity_result["again"]["keras"]
  assert ours["finished"] == 0.0
  # no second save where nothing changed after it (a review: every final checkpoint twice)
  assert parity_result["again"]["saves_without_change"] == [6, 12]
  assert ours["loss"][-1] == pytest.approx(keras_run["loss"][0], rel=1e-5)
  for a, b in zip(ours["weights"], keras_run["weights"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("built", ["in_scope", "cloned"])
def test_a_layer_frozen_in_on_train_begin_stays_frozen_and_a_given_history_is_returned(
    parity_result, built):
  """A review: the training loop was traced before on_train_begin, so a layer a callback froze
  there trained all the same; and fit returned a History of its own where model.fit returns
  the one among the callbacks. Seen failing on the old controller.py and callbacks.py: the
  losses apart from Keras's, and returned_given False."""
  keras_run, ours = parity_result["frozen"]["keras"], parity_result["frozen"][built]
  assert ours["loss"] == pytest.approx(keras_run["loss"], rel=1e-5)
  for a, b in zip(ours["weights"], keras_run["weights"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert keras_run["returned_given"] and ours["returned_given"]


@pytest.mark.parametrize("case", ["steps_arrays", "steps_stream"])
def test_steps_per_epoch_goes_on_through_the_data_as_model_fit_does(parity_result, case):
  """3 epochs of steps_per_epoch steps: 2 within one pass of arrays, and 4 across the passes of
  a dataset that repeats for ever, epoch 2 going on where epoch 1 ended. Seen failing: arrays
  ignored steps_per_epoch (6 steps an epoch), and each epoch restarted the stream."""
  run = parity_result[case]
  assert run["step"] == 3 * {"steps_arrays": 2, "steps_stream": 4}[case]
  assert run["tfdp"] == pytest.approx(run["keras"], rel=1e-5)
  for a, b in zip(run["weights"], run["keras_weights"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  if case == "steps_stream":  # stopped after epoch 1, resumed for 3: the same run
    resumed = parity_result["steps_stream_resumed"]
    assert resumed["step"] == 12
    for a, b in zip(resumed["weights"], run["weights"]):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_more_bad_input_is_one_line_naming_the_fix(parity_result):
  """Each was a bare traceback, or trained silently (no labels: on zeros), or named the wrong
  cause (a label outside the classes: "could not be decoded"). Seen failing on the code before:
  a string x (its characters taken for rows: "different lengths (5 and 96)"; with as many
  labels as characters, tf.data's bare ValueError), and epochs=0 with x and y of different lengths
  (returned an empty History, where model.fit's data adapter refuses them)."""
  errors = parity_result["errors"]
  expected = {"no_y": "pass y", "dataset_without_y": "(x, y)",
              "generator": "tf.data.Dataset.from_generator", "py_dataset": "PyDataset",
              "per_output_weights": "one weight per example", "input_width": "expected axis -1",
              "string_labels": "numeric labels", "empty": "x is empty",
              "string_x": "x holds a value without rows (a scalar, a string",
              "no_epochs_lengths": "x and y have different lengths (96 and 50)",
              "label_out_of_range": "which is outside the valid range of [0, 3)"}
  assert_one_lines(errors, expected)
  assert "decoded" not in errors["label_out_of_range"]
  assert "labels within its classes" in errors["label_out_of_range"]
  assert parity_result["bad_dir_untouched"]


def test_a_model_keras_cannot_serialize_exports_its_weights(forms_result):
  exported, exists = forms_result["subclassed_export"]
  assert exported.endswith("model.weights.h5") and exists


def test_one_replica_two_replicas_and_two_workers_train_alike(tmp_path):
  """Shuffling off, fp32: final weights of 1 replica = 2 replicas = 2 worker processes ≤ 1e-5.
  The EarlyStopping (min_delta 10: no epoch improves enough) stops every worker after the same
  epoch, ReduceLROnPlateau halves every worker's learning rate once, and tfdp.evaluate on 2 workers counts each of 37 examples once. Seen failing: with
  EarlyStopping decided by the chief alone, worker 1 trained on and the group hung."""
  one = run_case(tmp_path / "one", "equivalence", replicas=1)[0]
  two = run_case(tmp_path / "two", "equivalence", replicas=2)[0]
  workers = run_case(tmp_path / "workers", "equivalence", workers=2)
  for other in (two, *workers):
    for a, b in zip(one["weights"], other["weights"]):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert other["epochs"] == one["epochs"] == 2
    assert other["learning_rate"] == one["learning_rate"] == pytest.approx(0.05)  # halved once
    assert other["evaluate_examples"] == 37
    assert other["evaluate_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
  # A second fit in one process trains, shuffled under seed 0, on workers too. A model whose
  # weights differ between workers (built outside the scope with each worker's own seed) is
  # refused on every worker; within one process there is one copy of it.
  assert one["again_epochs"] == two["again_epochs"] == workers[0]["again_epochs"] == 2
  for result in workers:
    assert result["apart"].startswith("tfdp.fit: workers disagree after restore and data "
                                      "planning: worker 1 has initial weights="), result["apart"]
    assert "keras.utils.set_random_seed on every worker" in result["apart"]
  assert one["apart"] == two["apart"] == one["uneven"] == "no error"
  assert one["mixed_fit"] == two["mixed_evaluate"] == "no error"
  for result in workers:  # arrays of one shape, other contents on each worker
    assert result["mixed_fit"].startswith("tfdp.fit: workers disagree after restore and data "
                                          "planning: worker 1 has train data_digest="), result
    assert result["mixed_fit"].endswith("; every worker must pass the same data (x, y, "
                                        "validation_data) to tfdp.fit."), result["mixed_fit"]
    assert result["mixed_evaluate"].startswith(
        "tfdp.evaluate: worker 1 holds arrays of other contents than worker 0's;"), result
  for result in workers:  # at once on both, not a hung all-reduce
    assert result["uneven"] == ("tfdp.evaluate: worker 1 holds 38 examples where worker 0 holds "
                                "37; every worker must pass the same data and the same model "
                                "(built after one keras.utils.set_random_seed, or under the "
                                "strategy's scope)."), result["uneven"]
