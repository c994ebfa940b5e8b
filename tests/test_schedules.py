"""The learning-rate schedules and the linear scaling rule, value by value."""
import math

import pytest

tf = pytest.importorskip("tensorflow")

from tfdp import config as config_lib  # pylint: disable=wrong-import-position
from tfdp.core import optim as trainer_lib  # pylint: disable=wrong-import-position


def values(schedule, steps):
  return [float(schedule(step)) for step in steps]


def test_linear_scaling_rule():
  assert trainer_lib.scaled_learning_rate(0.1, 1024, 256) == pytest.approx(0.4)
  assert trainer_lib.scaled_learning_rate(0.1, 64, 128) == pytest.approx(0.05)


def test_warmup_then_cosine():
  s = trainer_lib.WarmupDecaySchedule(0.4, warmup_steps=4, total_steps=12, schedule="cosine")
  expected = [0.4 * (k + 1) / 4 for k in range(4)]
  expected += [0.4 * 0.5 * (1 + math.cos(math.pi * (k - 4) / 8)) for k in range(4, 13)]
  assert values(s, range(13)) == pytest.approx(expected, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("name, expected", [
    ("linear", [1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0]),
    ("constant", [1.0] * 7),
    ("step", [1.0, 1.0, 0.1, 0.1, 0.1, 0.01, 0.01]),
])
def test_decay_shapes_without_warmup(name, expected):
  s = trainer_lib.WarmupDecaySchedule(1.0, warmup_steps=0, total_steps=5, schedule=name,
                                      boundaries=[2, 5], decay_rate=0.1)
  assert values(s, range(7)) == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_cosine_ends_at_the_final_fraction():
  s = trainer_lib.WarmupDecaySchedule(1.0, 0, 10, "cosine", final_lr_fraction=0.1)
  assert values(s, [0, 5, 10, 20]) == pytest.approx([1.0, 0.55, 0.1, 0.1], rel=1e-6)


def test_make_schedule_turns_epochs_into_steps_and_scales_the_peak():
  lr = config_lib.LearningRateConfig(base_lr=0.1, base_batch_size=128, schedule="step",
                                     warmup_epochs=0.5, decay_epochs=[2.0], decay_rate=0.5)
  s = trainer_lib.make_schedule(lr, global_batch=256, steps_per_epoch=10, total_steps=40)
  assert (s.peak_lr, s.warmup_steps, s.boundaries) == (pytest.approx(0.2), 5, [20])
  assert values(s, [0, 4, 5, 19, 20]) == pytest.approx([0.04, 0.2, 0.2, 0.2, 0.1], rel=1e-6)
