"""The all-reduce and loss scaling are right: N replicas train the same weights as one, the
weights really move, training learns, and BatchNorm statistics agree across replicas.

Each run is a fresh process (logical CPU devices must be set before TensorFlow starts) built
through tfdp.core.experiment.build by tests/scripts/probe.py, with a fixed seed and global batch.
"""
import numpy as np
import pytest

import helpers

# Every test of this module on one xdist worker: a module-scoped fixture here trains in real
# processes, and would train again on each worker that ran one of the tests using it.
pytestmark = pytest.mark.xdist_group("test_equivalence")

COMMON = ",".join([
    "task.model.name=small_cnn", "task.model.kwargs={batch_norm: false, filters: 8}",
    "task.train_data.source=synthetic", "task.train_data.num_examples=650",  # last batch: 10 of 32
    "task.train_data.image_size=8", "task.train_data.num_classes=4", "task.train_data.augment=true",
    "task.eval_data.source=synthetic", "task.eval_data.num_examples=100",
    "task.eval_data.image_size=8", "task.eval_data.num_classes=4",
    "trainer.global_batch_size=32", "trainer.epochs=1", "trainer.steps_per_loop=7",
    "trainer.learning_rate.base_lr=0.05",
    "trainer.learning_rate.base_batch_size=32", "trainer.learning_rate.warmup_epochs=0.2",
    "runtime.strategy=mirrored",
])


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
  """COMMON on 2 replicas, run once: two tests compare against it."""
  return helpers.run_probe(tmp_path_factory.mktemp("common"), "r2",
                           f"{COMMON},runtime.cpu_replicas=2")


def test_two_and_four_replicas_match_one_and_training_learns(tmp_path, two_replicas):
  one = helpers.run_probe(tmp_path, "r1", f"{COMMON},runtime.cpu_replicas=1", "train_and_eval")
  assert one["info"]["step"] == 21  # ceil(650 / 32): the padded final step trained too
  # The weights moved away from where they started: an update that does nothing fails here.
  assert helpers.max_relative_difference(one["final"], one["initial"]) > 0.1
  # ... and training learned (synthetic classes are learnable; 4 classes: chance is 0.25).
  before, after = one["info"]["eval_before"], one["info"]["eval_after"]
  assert after["loss"] < 0.5 * before["loss"], (before, after)
  assert after["accuracy"] >= 0.7 and before["accuracy"] <= 0.45, (before, after)
  four = helpers.run_probe(tmp_path, "r4", f"{COMMON},runtime.cpu_replicas=4")
  for replicas, run in ((2, two_replicas), (4, four)):
    assert run["info"]["step"] == 21
    assert helpers.max_relative_difference(run["initial"], one["initial"]) == 0.0
    assert helpers.max_relative_difference(run["final"], one["final"]) <= 1e-5, replicas


BATCHNORM = COMMON.replace("task.model.kwargs={batch_norm: false, filters: 8}",
                           "task.model.kwargs={}").replace(
                               "task.model.name=small_cnn",
                               "task.model.name=input_bn,task.model.module=models_for_tests")


def test_batchnorm_statistics_are_averaged_across_replicas_by_the_trainer(tmp_path):
  one = helpers.run_probe(tmp_path, "r1", f"{BATCHNORM},runtime.cpu_replicas=1")
  two = helpers.run_probe(tmp_path, "r2", f"{BATCHNORM},runtime.cpu_replicas=2")
  means = [k for k in two["copies"] if k.endswith("moving_mean")]
  assert means and [k for k in two["copies"] if k.endswith("moving_variance")]
  for name, copies in two["copies"].items():
    assert len(copies) == 2 and copies[0] == copies[1], name  # one value, whichever device reads
  for name in means:
    # BatchNorm on the input: the mean of the two equal sub-batch means is the batch mean, so
    # the moving mean is the one-replica run's (the variance is not: it lacks the between-half
    # term). The checkpoint and the exported model hold this same value.
    moved = np.abs(np.asarray(one["copies"][name][0])).max()
    assert moved > 1e-3, name  # it moved from its initial 0
    assert np.allclose(two["copies"][name][0], one["copies"][name][0], rtol=1e-5, atol=1e-7), name
    assert np.allclose(two["final"][name], one["final"][name], rtol=1e-5, atol=1e-7), name


def test_evaluation_counts_only_real_examples(tmp_path):
  # 10 examples, labels i % 4; a model that always predicts class 0 is right for 0, 4 and 8.
  # An eval batch of 8 over 2 replicas pads 6 slots with label-0 examples: counting them would
  # give 9/16 or 9/10.
  known = (f"{COMMON},task.model.name=always_class_0,task.model.module=models_for_tests,"
           "task.model.kwargs={},task.eval_data.num_examples=10,trainer.eval_batch_size=8,"
           "runtime.cpu_replicas=2")
  run = helpers.run_probe(tmp_path, "eval", known, mode="eval")
  result = run["info"]["eval_before"]
  assert result["examples"] == 10
  assert result["accuracy"] == 0.3
  # logits [2, 0, 0, 0]: cross-entropy log(1 + 3e^-2) for class 0, log(e^2 + 3) otherwise
  right, wrong = np.log(1 + 3 * np.exp(-2.0)), np.log(np.exp(2.0) + 3)
  assert abs(result["loss"] - (3 * right + 7 * wrong) / 10) < 1e-5


# 70 examples, global batch 32: steps of 32, 32 and 6 real examples (26 padding slots), twice.
REFERENCE = ",".join([
    "task.model.name=small_cnn", "task.model.kwargs={batch_norm: false, filters: 8, l2: 0.01}",
    "task.train_data.source=synthetic", "task.train_data.num_examples=70",
    "task.train_data.image_size=8", "task.train_data.num_classes=4",
    "task.train_data.augment=false", "task.train_data.shuffle=false",
    "trainer.global_batch_size=32", "trainer.epochs=2", "trainer.steps_per_loop=2",
    "trainer.export_model=false", "trainer.optimizer.weight_decay=0.001",
    "trainer.learning_rate.base_lr=0.05", "trainer.learning_rate.base_batch_size=16",  # peak 0.1
    "trainer.learning_rate.warmup_epochs=1", "trainer.learning_rate.schedule=cosine",
    "runtime.strategy=mirrored", "runtime.cpu_replicas=2",
])


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_training_matches_a_plain_tensorflow_reference(tmp_path, accumulation_steps):
  """Catches what equivalence across replica counts cannot: a bug that is the same for every
  count (padding counted in the loss, a wrong schedule or scaling rule, L2 scaled wrongly, L2
  counted once per micro-step)."""
  out = tmp_path / "out"
  out.mkdir()
  job = f"{REFERENCE},trainer.gradient_accumulation_steps={accumulation_steps}"
  proc = helpers.subprocess.run(
      [helpers.sys.executable, str(helpers.SCRIPTS / "reference.py"), str(tmp_path / "run"),
       job, str(out)], capture_output=True, text=True, timeout=600, env=helpers.env(),
      cwd=str(helpers.REPO))
  assert proc.returncode == 0, proc.stderr[-3000:]
  tfdp_weights, reference = dict(np.load(out / "tfdp.npz")), dict(np.load(out / "reference.npz"))
  initial = dict(np.load(out / "initial.npz"))
  assert helpers.max_relative_difference(reference, initial) > 0.05  # six real updates
  assert helpers.max_relative_difference(tfdp_weights, reference) <= 1e-5


def test_bfloat16_all_reduce_stays_close_to_float32_and_really_casts(tmp_path, two_replicas):
  """runtime.all_reduce_dtype=bfloat16 sends half the bytes: the trajectory moves off the
  float32 one by bfloat16 rounding (8 bits of mantissa), and no further."""
  exact = two_replicas
  halved = helpers.run_probe(tmp_path, "bf16",
                             f"{COMMON},runtime.cpu_replicas=2,runtime.all_reduce_dtype=bfloat16")
  assert helpers.max_relative_difference(halved["initial"], exact["initial"]) == 0.0
  difference = helpers.max_relative_difference(halved["final"], exact["final"])
  assert 1e-6 < difference < 0.05, difference  # the cast happened; training was not derailed


MUON = ",".join([COMMON, "trainer.optimizer.name=muon", "trainer.optimizer.head_lr=0.01",
                 "trainer.optimizer.bias_lr=0.01", "trainer.learning_rate.base_lr=1",
                 "trainer.learning_rate.schedule=linear", "trainer.learning_rate.warmup_epochs=0"])


def test_muon_on_two_replicas_matches_one_and_learns(tmp_path):
  """trainer.optimizer.name=muon (airbench94_muon's): its SGD part steps on the loss summed over
  the global batch, so replicas that passed their own batch would part from one replica."""
  one = helpers.run_probe(tmp_path, "r1", f"{MUON},runtime.cpu_replicas=1", "train_and_eval")
  before, after = one["info"]["eval_before"], one["info"]["eval_after"]
  assert after["loss"] < 0.5 * before["loss"] and after["accuracy"] >= 0.7, (before, after)
  two = helpers.run_probe(tmp_path, "r2", f"{MUON},runtime.cpu_replicas=2")
  assert two["info"]["step"] == one["info"]["step"] == 21
  assert helpers.max_relative_difference(two["final"], one["final"]) <= 1e-5
