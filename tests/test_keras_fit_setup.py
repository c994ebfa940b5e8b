"""tfdp.fit with the model and optimizer as model.fit has them: a model compiled outside the
strategy's scope (fitted twice, or unbuilt), class_weight, use_ema, the optimizer settings
tf.distribute cannot run, run_eagerly, a pure dtype policy, and History as Keras's.

The cases run in tests/scripts/keras_fit_setup_cases.py (and keras_fit_setup_more.py), two
processes of several cases each, on 2 CPU replicas against single-device model.fit; these
tests judge what they report."""
import json
import math
import sys

import pytest

import helpers

pytestmark = pytest.mark.xdist_group("test_keras_fit_setup")

CASES = str(helpers.SCRIPTS / "keras_fit_setup_cases.py")


def run_group(tmp_path, group: str, **extra_env) -> dict:
  out = tmp_path / f"{group}.json"
  proc = helpers.run_python([sys.executable, CASES, group, str(out)],
                            env=helpers.env(**extra_env), cwd=tmp_path, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(out.read_text())
  result["stderr"] = proc.stderr
  return result


@pytest.fixture(scope="module")
def weights_result(tmp_path_factory):
  return run_group(tmp_path_factory.mktemp("weights"), "weights")


@pytest.fixture(scope="module")
def model_result(tmp_path_factory):
  # its pure "bfloat16" policy case segfaulted in oneDNN under the AVX2 imitation's cap
  return run_group(tmp_path_factory.mktemp("model"), "model", **helpers.UNCAPPED)


def assert_same_run(compared, tolerance=1e-5) -> None:
  keras_history, ours, difference = compared
  assert sorted(ours) == sorted(keras_history)
  for name, values in keras_history.items():
    assert ours[name] == pytest.approx(values, rel=tolerance), name
  assert difference < 1e-5


def assert_one_line(line: str, *words: str) -> None:
  assert line.startswith("tfdp.fit: ") and "\n" not in line, line
  for word in words:
    assert word in line, (word, line)


@pytest.mark.parametrize("case", ["missing_class", "soft_labels"])
def test_class_weight_maps_labels_as_keras_does(weights_result, case):
  """Seen failing on the code before: a class class_weight does not name took the last named
  class's weight (loss 4.03 against Keras's 2.33 in the probe), and soft binary labels were
  truncated (0.7 → class 0) where Keras rounds them."""
  assert_same_run(weights_result[case])


def test_validation_is_model_fits_with_swapped_ema_weights_and_validation_freq(weights_result):
  """Seen failing before: SwapEMAWeights's on_test_begin/on_test_end were never called, so
  validation used the raw weights (val_loss 1.0975 against Keras's 1.1179 in the probe); and
  validation_freq=2 over 3 epochs also validated after the last epoch (extra val_* entries)."""
  assert_same_run(weights_result["swap_ema"])
  keras_history, ours, _ = weights_result["validation_freq"]
  assert len(ours["val_loss"]) == len(keras_history["val_loss"]) == 1
  assert_same_run(weights_result["validation_freq"])


def test_validation_freq_as_a_list_of_epochs_validates_those_as_model_fit(weights_result):
  """Seen failing before: validation_freq=[1, 3] was refused (an int only; Keras takes a list)."""
  keras_history, ours, _ = weights_result["validation_freq_list"]
  assert len(ours["val_loss"]) == len(keras_history["val_loss"]) == 2
  assert_same_run(weights_result["validation_freq_list"])


def test_terminate_on_nan_ends_training_and_returns_history_as_model_fit(weights_result):
  """Seen failing before: tfdp.fit raised TrainingDiverged where model.fit returns a History
  with the epoch that diverged (loss nan), stop_training set and on_train_end called. With
  raise_error=True it stays an error, as Keras raises."""
  keras_run, ours = weights_result["terminate_on_nan"]["keras"], weights_result[
      "terminate_on_nan"]["tfdp"]
  assert ours["epochs"] == keras_run["epochs"] == [0, 1]
  assert sorted(ours["history"]) == sorted(keras_run["history"]) == ["loss"]
  first, diverged = ours["history"]["loss"]
  assert first == pytest.approx(keras_run["history"]["loss"][0], rel=1e-3)
  assert not math.isfinite(diverged) and not math.isfinite(keras_run["history"]["loss"][1])
  assert ours["stop_training"] and keras_run["stop_training"]
  assert ours["ended"] is not None and keras_run["ended"] is not None
  assert "TerminateOnNaN: training diverged" in weights_result["stderr"]
  assert_one_line(weights_result["errors"]["terminate_on_nan_raising"], "training diverged")
  assert "callback TerminateOnNaN has" not in weights_result["stderr"]  # its hook: tfdp's check


def test_mean_iou_trains_as_in_model_fit(weights_result):
  """Seen failing on the old additivity check (it assigned in cross-replica context, which
  divides an int64 update by the replica count): 'metric variable ... total_confusion_matrix
  does not add up over batches'."""
  assert not isinstance(weights_result["mean_iou"], str), weights_result["mean_iou"]
  assert_same_run(weights_result["mean_iou"])


def test_what_tfdp_does_otherwise_than_model_fit_is_said(weights_result):
  """A callback's batch hooks are never called, and a resume keeps the checkpoint's learning
  rate over compile()'s: both were silent (a probe)."""
  stderr = weights_result["stderr"]
  assert "callback BatchHooked has on_train_batch_end, which tfdp never calls" in stderr, \
      stderr[-3000:]
  assert "learning rate 0.01 (its checkpoint's), not compile()'s 0.5" in stderr, stderr[-3000:]


def test_class_and_sample_weight_together_are_said(weights_result):
  said = [l for l in weights_result["stderr"].splitlines()
          if "class_weight and sample_weight are both given" in l]
  assert len(said) == 1, weights_result["stderr"][-3000:]


def test_optimizer_settings_tf_distribute_cannot_run_are_one_line(weights_result):
  """Seen failing: a raw RuntimeError ("merge_call called while defining a new graph") from the
  traced step. The accumulation line names tfdp's own accumulation, which gives the weights
  Keras's does."""
  errors = weights_result["errors"]
  assert_one_line(errors["accumulation"], "gradient_accumulation_steps",
                  "'gradient_accumulation_steps': 2")
  assert_one_line(errors["ema_overwrite"], "ema_overwrite_frequency", "drop it")
  # Seen failing (a probe): Recall(thresholds=[0.3, 0.7]) reported as the mean of its two
  # values; an uncompiled model built outside the scope: AttributeError 'optimizer'; one
  # compiled in the scope but built outside it: a RuntimeError once the whole run had trained.
  assert_one_line(errors["vector_metric"], "gives 2 values", "one metric per threshold")
  assert_one_line(errors["uncompiled_outside"], "not compiled", "model.compile(")
  assert_one_line(errors["built_outside"], "outside the strategy's scope",
                  "tfdp.make_strategy().scope()")
  # Keras's multi-line ValueError ("tuple arity mismatch") came through as a traceback
  assert_one_line(errors["metrics_per_output"], "do not match the model's outputs",
                  "per output")
  assert weights_result["bad_dir_untouched"]
  assert weights_result["accumulation_instead"] < 1e-5


def test_a_model_whose_copy_in_the_scope_would_differ_is_refused(weights_result):
  """Built outside the scope, a model is copied into it through Keras's configs and weights.
  Seen failing (a probe): BoostedSGD(boost=10.0) trained as boost 1.0, a layer attribute changed
  after construction went back to its config's value, both silently; an adapted
  TextVectorization was a bare FailedPreconditionError ("Table not initialized")."""
  errors = weights_result["errors"]
  assert_one_line(errors["optimizer_setting_lost"], "BoostedSGD", "loses boost=10.0",
                  "get_config()", "tfdp.make_strategy().scope()")
  assert_one_line(errors["layer_changed"], "computes other outputs", "tfdp.make_strategy().scope()")
  assert_one_line(errors["layer_changed_predict"].replace("tfdp.predict: ", "tfdp.fit: ", 1),
                  "computes other outputs")
  assert_one_line(errors["lookup_table"], "fails (", "tfdp.make_strategy().scope()")
  # A probe: an attribute used only when training, set after construction, trained the copy
  # without it (loss 0.84 against model.fit's 4.09), silently.
  assert_one_line(errors["changed_in_training"], "computes other outputs in training",
                  "tfdp.make_strategy().scope()")
  assert errors["noisy"] == "no error" and errors["noisy_kept"] is True, errors["noisy"]
  # Not refused (a review): a loss whose get_config holds only its own settings (its rebuilt
  # name differs), and NaN in the data, which is the divergence line's to say.
  assert errors["own_config"] == "no error", errors["own_config"]
  assert_one_line(errors["nan_outside"], "training diverged")


@pytest.mark.parametrize("case", ["huber", "own_loss", "adamw_excluded"])
def test_settings_no_config_holds_survive_the_copy_into_the_scope(weights_result, case):
  """Keras's Huber(delta=0.3) (keras-team/keras#23286), a loss of the user's without get_config
  and AdamW's exclude_from_weight_decay: the copy trained with delta 1.0, refused the loss, and
  decayed the biases (seen failing on the old code: loss 12.99 against Keras's 11.94)."""
  assert_same_run(weights_result["settings_outside"][case])


def test_examples_of_varying_lengths_are_told_to_pad_in_the_data(weights_result):
  """A padded_batch of varying lengths: 'pad or truncate them in the task's preprocess', which a
  tfdp.fit user has not (a probe)."""
  line = weights_result["errors"]["varying_lengths"]
  assert_one_line(line, "fixed shapes", "pad_sequences", "padded_shapes", "tf.ensure_shape")
  assert "task's preprocess" not in line
  # Not batched (a probe): TF's InvalidArgumentError ('Cannot batch tensors with different
  # shapes') came through from tfdp's first read of the data. Seen failing on the old inputs.py.
  assert_one_line(weights_result["errors"]["varying_unbatched"], "fixed shapes", "pad_sequences")


def test_per_output_weights_in_a_dataset_are_one_line_as_in_arrays(weights_result):
  """(x, (y1, y2), (w1, w2)) elements: a 27-frame traceback ending in 'Cannot reshape a tensor
  with 2 elements to shape []' (a probe); arrays of that form were refused in one line."""
  assert_one_line(weights_result["errors"]["per_output_weights_dataset"],
                  "one sample weight per output", "loss_weights")


def test_a_divergence_names_what_tfdp_fit_can_change(weights_result):
  """A NaN in x: the line named trainer.learning_rate.base_lr and warmup_epochs, which tfdp.fit
  does not use (compile()'s optimizer is the recipe; a probe)."""
  line = weights_result["errors"]["nan_in_x"]
  assert_one_line(line, "training diverged", "Check x and y for NaN", "compile()",
                  "params='trainer.stop_on_nan=false'")
  assert "base_lr" not in line and "warmup" not in line


def test_an_adapted_normalization_built_outside_the_scope_computes_as_keras(weights_result):
  """Seen failing: tfdp.predict 2731 away from model.predict, as the copy's Normalization never
  finalized the adapted mean and variance its weights hold."""
  run = weights_result["adapted_outside"]
  assert run["binned"] < 1e-6  # a Discretization: carried by its config (a review: emptied)
  assert run["predict"] < 1e-3
  assert run["loss"][1] == pytest.approx(run["loss"][0], rel=1e-5)


def test_a_model_compiled_outside_the_scope_fits_twice_as_model_fit_does(model_result):
  """Two 1-epoch calls on a model compiled outside the scope (Adam, ExponentialDecay): the
  second goes on with the optimizer's state. Seen failing: a fresh optimizer each call (second
  loss 1.18 against Keras's 1.06 in the probe) and the user's optimizer.iterations left at 0."""
  run = model_result["fit_twice"]
  assert run["tfdp"] == pytest.approx(run["keras"], rel=1e-5)
  assert run["iterations"] == [8, 8]
  assert run["difference"] < 1e-5


@pytest.mark.parametrize("in_scope", [False, True])
def test_a_mixed_float16_model_fits_twice_as_model_fit_does(model_result, in_scope):
  """A review: under mixed_float16 the second fit started from a fresh optimizer (loss 0.5328
  against Keras's 0.5283) and the user's optimizer.iterations stayed 0: adopt_optimizer built
  the LossScaleOptimizer again (its build has no guard), a second loss scale and step counter,
  so the state was not copied back. Seen failing on the old optim.py (16 variables, not 14)."""
  run = model_result[f"float16_twice_in_scope_{in_scope}"]
  assert run["variables"][1] == run["variables"][0] and run["iterations"] == [8, 8], run
  assert run["tfdp"] == pytest.approx(run["keras"], rel=1e-4)
  assert "hold different variables" not in model_result["stderr"]


def test_history_and_logs_say_what_model_fit_says(model_result):
  """No learning_rate in History unless a callback logs it (test_keras_fit's ReduceLROnPlateau
  case has it), Keras's params, and a second fit without model_dir says in tfdp.fit's terms
  that the earlier run was moved. Seen failing: learning_rate in every History, and the log
  naming --start_over, a flag the library user never passed."""
  run = model_result["fit_twice"]
  assert run["history_keys"] == ["loss"]
  assert set(run["keras_params"]) <= set(run["params"])
  stderr = model_result["stderr"]
  assert "--start_over" not in stderr
  moved = [l for l in stderr.splitlines() if "model_dir=None trains a fresh run" in l]
  assert len(moved) == 1, stderr[-3000:]


def test_an_unbuilt_model_compiled_outside_the_scope(model_result):
  """A Sequential without Input is built on a batch and cloned, as a built one; an unbuilt
  subclassed model is one line. Seen failing: a raw RuntimeError ("Mixing different
  tf.distribute.Strategy objects") from optimizer.build."""
  assert_same_run(model_result["unbuilt_outside"])
  assert_one_line(model_result["errors"]["subclassed_unbuilt"], "make_strategy().scope()")


def test_use_ema_validates_raw_weights_and_ends_with_their_average(model_result):
  """As Keras's fit: validation on the raw weights, then the weights become their moving
  average, in memory and in model_dir/model.keras. Seen failing: val_loss of the averages
  (0.971 against Keras's 1.002 in the probe) and raw weights left in memory."""
  run = model_result["ema"]
  assert run["tfdp"] == pytest.approx(run["keras"], rel=1e-5)
  assert run["difference"] < 1e-5 and run["exported_difference"] < 1e-5


def test_run_eagerly_trains_compiled_and_says_so(model_result):
  """Seen failing: a call() that needs eager execution crashed deep in the traced loop with a
  raw NotImplementedError; a model that traces fine still trains, with one warning."""
  assert_same_run(model_result["eager"])
  assert_one_line(model_result["errors"]["eager_only"], "run_eagerly=True", "model.fit")
  for called in ("evaluate", "predict"):  # a bare NotImplementedError before (a probe)
    line = model_result["errors"][f"eager_only_{called}"]
    assert_one_line(line.replace(f"tfdp.{called}: ", "tfdp.fit: ", 1), "run_eagerly=True",
                    "fails when traced")
  assert model_result["bad_dir_untouched"]
  warned = [l.split("tfdp.", 1)[1].split(":", 1)[0] for l in model_result["stderr"].splitlines()
            if "compiled with run_eagerly=True; tfdp runs it compiled" in l]
  assert warned == ["fit", "fit", "evaluate", "predict"]  # one trains; the others are refused


def test_a_pure_dtype_policy_is_kept_and_recorded(model_result):
  """Seen failing: after keras.config.set_dtype_policy("bfloat16") fit left the global policy
  float32 and config.yaml recorded mixed_precision: float32."""
  assert model_result["policy_after"] == "bfloat16"
  assert model_result["policy_recorded"] == "bfloat16"


def test_keras_made_up_names_are_recorded_without_their_number():
  """A notebook cell run again builds sgd_1 where it built sgd: config.yaml recorded the number,
  so the rerun warned 'settings differ: keras.optimizer.name sgd_4 → sgd_5' (a probe). Seen
  failing with _recorded_name returning the name as it is."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.compiled import task  # pylint: disable=g-import-not-at-top
  for make, recorded in ((keras.optimizers.SGD, "sgd"), (keras.optimizers.RMSprop, "rm_sprop"),
                         (lambda: keras.Sequential([keras.layers.Dense(1)]), "sequential")):
    assert [task._recorded_name(make()) for _ in range(2)] == [recorded] * 2  # pylint: disable=protected-access
  assert task._recorded_name(keras.optimizers.Adam(name="mine_3")) == "mine_3"  # pylint: disable=protected-access


def test_numpy_integers_one_callback_and_batch_size_beside_a_batched_dataset_as_keras(
    weights_result):
  """Seen failing (a probe): numpy integers refused ('batch_size is np.int64(32); pass a
  positive whole number'), one callback a bare TypeError (not iterable), and a dataset batched
  by 16 re-batched by batch_size=64: 2 steps where model.fit takes 8, other weights."""
  forms = weights_result["argument_forms"]
  # the user's model.stop_training and model.history, as Keras sets them (history: a probe)
  assert forms["stopped"] == [2, True, True]
  assert forms["numpy_ints"] == [4, 2, 2]  # 128 / 32 steps, 2 epochs, the callback called twice
  assert forms["predicted"] == 128
  run = forms["batched"]
  assert run["tfdp"][0] == run["keras"][0] == 8
  assert run["tfdp"][1] == pytest.approx(run["keras"][1], rel=1e-5)
  assert run["difference"] < 1e-5
  assert "batch_size=64 is not used: x is a dataset batched by 16" in weights_result["stderr"]


def test_a_peer_missing_from_the_copy_into_the_scope_is_named_as_such(model_result):
  """A probe: worker 0 alone called tfdp.fit on a model built outside the scope; after 4.5
  minutes the copy's collective failed (UnavailableError) and it was told Keras cannot clone
  the model and to build it under the scope. It is the peer: a GroupMustRestart naming it. The
  collective's failure is stood in for here. Seen failing: the ConfigError's clone line."""
  assert model_result["more"]["peer_missing"] == (
      "GroupMustRestart tfdp.fit: a peer worker did not join the copy of the model into the "
      "strategy's scope (UnavailableError): every worker must make the same calls (tfdp.fit, "
      "tfdp.evaluate, tfdp.predict) in the same order; see the peer's error line.")


def test_a_copy_that_differs_is_said_whatever_braces_the_caller_holds():
  """Seen failing on the old str.format template: a caller or fix with a brace raised KeyError
  instead of the line."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.compiled import copies  # pylint: disable=g-import-not-at-top
  from tfdp.errors import ConfigError  # pylint: disable=g-import-not-at-top
  mine, copy = (keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=k)])
                for k in ("ones", "zeros"))
  with pytest.raises(ConfigError, match=r"^tfdp\.fit \{x\}: .* computes other outputs \("):
    copies.check_clone_computes_alike(mine, copy, np.ones((2, 3), np.float32), "tfdp.fit {x}")


def test_dropout_trains_alike_whether_the_model_was_built_in_the_scope_or_outside(model_result):
  """A probe: with one seed, a Dropout model built outside the scope trained other weights than
  the same model built inside it (0.23 apart here): the copy made in the scope drew new seed
  states, which get_weights leaves out. They are copied in, and back after training. Seen
  failing on the old fit.py (stash)."""
  result = model_result["more"]["dropout"]
  assert result["apart"] < 1e-6, result
  inside, outside = result["seeds"]
  assert inside and inside == outside, result  # the user's model goes on from training's


def test_labels_in_a_one_element_list_train_a_model_of_one_output_as_model_fit(model_result):
  """A probe: Model(i, [Dense(1)(i)]) compiled with ["mse"] and given y=[y] (or (x, (y,))
  elements) trains in model.fit; tfdp refused it: 'y does not fit the loss ... Expected an
  instance of tuple'. Seen failing on the old task.py (stash)."""
  keras_loss, arrays, dataset, keras_eval, ours = model_result["more"]["one_element_list"]
  assert arrays == pytest.approx(keras_loss, rel=1e-5) and dataset == pytest.approx(keras_loss,
                                                                                    rel=1e-5)
  assert ours["loss"] == pytest.approx(keras_eval, rel=1e-5)


def test_a_dataset_batched_before_its_repeat_validates_exactly_and_warns_where_it_differs(
    model_result):
  """A probe: batches of 8, 8, 7 repeated, with validation_steps=3, were validated as 24
  examples (the first one twice: val_loss 1.686 against model.fit's 1.748); a training stream
  or a finite dataset with a short batch mid-way was cut into other steps without a word.
  Validation now takes the examples of its first validation_steps batches; the rest is said.
  Seen failing on the old inputs.py (stash): 24 examples."""
  keras_val, ours_val, examples = model_result["more"]["batched_before_repeat"]
  assert examples == 23 and ours_val == pytest.approx(keras_val, rel=1e-5)
  stderr = model_result["stderr"]
  assert ("x's batches are uneven within the stream (a batch of 8 among the first 3): tfdp "
          "batches its examples by 16, so an epoch takes 48 examples where model.fit's takes 40"
          in stderr), stderr[-3000:]
  assert ("x's batches are uneven within the data (a batch of 8 before its last): tfdp batches "
          "its examples by 16, 5 steps where model.fit takes 6" in stderr), stderr[-3000:]


def test_a_generator_as_validation_data_and_shuffle_batch_are_said_as_such(model_result):
  """A probe: a generator as validation_data was told 'validation_data is a generator; pass
  (x_val, y_val) ...', without the from_generator wrap that x's line gives; shuffle='batch'
  (Keras's HDF5 chunks) shuffled every example without a word. Seen failing on the old
  inputs.py and fit.py (stash)."""
  line = model_result["more"]["generator_validation"]
  assert "validation_data is a generator" in line and "from_generator" in line, line
  assert "shuffle='batch' shuffles every example here" in model_result["stderr"], \
      model_result["stderr"][-3000:]
