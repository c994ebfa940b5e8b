"""configs/base.yaml, `base:` chains and model_settings: the default job's recipe follows its
model, so swapping the model leaves a job on the neutral base (issue 22 item 7)."""
import dataclasses
import logging

import pytest
import yaml

import helpers

from tfdp import config as config_lib
from tfdp import paths
from tfdp.errors import ConfigError

CONFIGS = helpers.REPO / "configs"
DEFAULT_JOB = str(helpers.REPO / paths.DEFAULT_JOB)
BASE = str(helpers.REPO / paths.BASE_JOB)


def load(files, overrides=(), caplog=None):
  """The config, and the lines tfdp.config logged while loading it."""
  with caplog.at_level(logging.INFO):
    caplog.clear()
    config = config_lib.load_config(files, list(overrides))
  return config, [r.getMessage() for r in caplog.records if r.getMessage().startswith("config:")]


def dropped_line(lines):
  assert len(lines) == 1, lines
  return lines[0]


@pytest.mark.parametrize("job", [DEFAULT_JOB, str(CONFIGS / "cifar10_airbench.yaml")])
def test_swapping_only_the_model_leaves_the_job_on_the_neutral_base(job, caplog):
  config, lines = load([job], ["task.model.name=small_cnn"], caplog)
  job_alone = config_lib.load_config([job])
  # The job's own keys outside model_settings stay (its epochs); everything else is base.yaml's.
  on_base = config_lib.load_config([BASE], [f"task.model.name=small_cnn,"
                                            f"trainer.epochs={job_alone.trainer.epochs}"])
  assert dataclasses.asdict(config) == dataclasses.asdict(on_base)
  assert config.task.model.kwargs == {} and not config.task.eval_flip
  assert job_alone.task.model.kwargs and job_alone.task.eval_flip  # what was dropped
  line = dropped_line(lines)
  assert "task.model.name changed airbench → small_cnn" in line
  for key in ("task.model.kwargs", "label_smoothing", "eval_flip", "trainer.learning_rate.{base_lr",
              "trainer.optimizer.{momentum, weight_decay}", "global_batch_size"):
    assert key in line
  assert "written for airbench in" in line and job in line


def test_keeping_the_model_keeps_its_settings_and_logs_nothing(caplog):
  alone, lines = load([DEFAULT_JOB], [], caplog)
  assert not lines
  config, lines = load([DEFAULT_JOB], ["task.model.name=airbench,trainer.epochs=2"], caplog)
  assert not lines
  assert config.task.model.kwargs == alone.task.model.kwargs == {"widths": [32, 64, 128],
                                                                 "dirac_init": True}
  assert (config.task.label_smoothing, config.task.eval_flip) == (0.2, True)
  assert config.trainer.learning_rate == alone.trainer.learning_rate
  assert config.trainer.learning_rate != config_lib.load_config([BASE]).trainer.learning_rate
  # Away and back again: the last word is airbench, so its settings stay.
  config, lines = load([DEFAULT_JOB], ["task.model.name=small_cnn", "task.model.name=airbench"],
                       caplog)
  assert not lines and dataclasses.asdict(config) == dataclasses.asdict(alone)


def test_a_later_layers_own_values_survive_the_swap(tmp_path, caplog):
  mine = tmp_path / "mine.yaml"
  mine.write_text(yaml.safe_dump({"task": {"model": {"name": "resnet20", "kwargs": {"width": 8}},
                                           "label_smoothing": 0.1}}))
  config, lines = load([DEFAULT_JOB, str(mine)], ["trainer.global_batch_size=96"], caplog)
  assert config.task.model.kwargs == {"width": 8} and config.task.label_smoothing == 0.1
  assert config.trainer.global_batch_size == 96
  assert config.trainer.learning_rate == config_lib.load_config([BASE]).trainer.learning_rate
  line = dropped_line(lines)
  assert "airbench → resnet20" in line and "eval_flip" in line
  for kept in ("kwargs", "label_smoothing", "global_batch_size"):
    assert kept not in line  # the later layer set them: nothing of airbench's was lost there


def test_a_job_of_ones_own_on_base_yaml(tmp_path):
  (tmp_path / "base.yaml").write_text((CONFIGS / "base.yaml").read_text())
  (tmp_path / "digits.yaml").write_text(
      "base: base.yaml\ntask:\n  model: {name: small_cnn}\n  train_data: {augment: false}\n"
      "model_settings:\n  small_cnn:\n    task: {model: {kwargs: {filters: 8}}}\n")
  config = config_lib.load_config([str(tmp_path / "digits.yaml")])
  assert config.task.model.kwargs == {"filters": 8} and not config.task.train_data.augment
  assert config.trainer == config_lib.load_config([BASE]).trainer


def test_settings_for_a_model_picked_on_the_command_line_apply(tmp_path):
  """A probe's file on cifar10_quick (airbench) with model_settings for small_cnn, trained with
  --params_override=task.model.name=small_cnn: refused, 'trains airbench but its model_settings
  are written for small_cnn'. Seen failing on the old tfdp/config/__init__.py."""
  (tmp_path / "my.yaml").write_text(
      f"base: {CONFIGS / 'cifar10_quick.yaml'}\n"
      "model_settings:\n  small_cnn:\n    trainer: {global_batch_size: 256}\n")
  swapped = config_lib.load_config([str(tmp_path / "my.yaml")], ["task.model.name=small_cnn"])
  assert swapped.trainer.global_batch_size == 256
  for other in ([], ["task.model.name=resnet20"]):  # the run trains another model: left out
    assert config_lib.load_config([str(tmp_path / "my.yaml")], other) == config_lib.load_config(
        [str(CONFIGS / "cifar10_quick.yaml")], other)


def write(tmp_path, name, text):
  (tmp_path / name).write_text(text)
  return str(tmp_path / name)


@pytest.mark.parametrize("files, words", [
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, ["its own base", "base:"]),
    ({"a.yaml": "base: missing.yaml\n"}, ["missing.yaml", "not there"]),
    # Once "names base '.', which is not there" for a folder that is there; an empty file ran
    # the schema's defaults (CIFAR-10) without a word (a probe).
    ({"a.yaml": "base: .\n"}, ["which is a folder", "e.g. base: ./base.yaml"]),
    ({"a.yaml": "# nothing yet\n"}, ["is empty (it holds no settings)", "leave it out"]),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": ""}, ["b.yaml' is empty"]),
    ({"a.yaml": "base: [b.yaml]\n"}, ["base must name a YAML file"]),
    # A typo in a base file was said without the file (a probe).
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "trainer: {epoch: 3}\n"},
     ["b.yaml': unknown config key 'trainer.epoch'", "trainer.epochs"]),
    ({"a.yaml": "task: {model: {name: small_cnn}}\nmodel_settings: {airbench: {task: "
                "{eval_flip: true}}}\n"}, ["small_cnn", "written for airbench", "delete it"]),
    ({"a.yaml": "model_settings: {task: {eval_flip: true}, trainer: {epochs: 1}}\n"},
     ["one model's name over its settings"]),
    ({"a.yaml": "task: {model: {name: small_cnn}}\nmodel_settings: {small_cnn: {task: "
                "{model: {name: resnet8}}}}\n"}, ["sets task.model.name", "outside"]),
    ({"a.yaml": "task: {model: {name: small_cnn}}\nmodel_settings: {small_cnn: {task: "
                "{eval_flp: true}}}\n"}, ["task.eval_flp", "task.eval_flip"]),
])
def test_bad_bases_and_model_settings_are_one_line_errors(tmp_path, files, words):
  paths_written = [write(tmp_path, name, text) for name, text in files.items()]
  with pytest.raises(ConfigError) as info:
    config_lib.load_config(paths_written[:1])
  message = str(info.value)
  assert "\n" not in message
  for word in words:
    assert word in message


def test_a_missing_base_is_named_where_it_was_looked_for(tmp_path, monkeypatch):
  """A config file named relatively: the message said '(base.yaml)', not where it looked."""
  (tmp_path / "jobs").mkdir()
  write(tmp_path / "jobs", "mine.yaml", "base: base.yaml\n")
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError) as info:
    config_lib.load_config(["jobs/mine.yaml"])
  assert f"({tmp_path / 'jobs' / 'base.yaml'}: a base is found beside the file" in str(info.value)


def test_the_default_job_with_its_model_and_data_swapped_trains(tmp_path):
  """The issue's new user: tfdp-train with no --config_file, a small CNN, a 10-class folder of
  digit-like images, 3 replicas; no task.model.kwargs={} or task.eval_flip=false needed."""
  helpers.write_image_folder(tmp_path / "digits", per_class=6, classes=[str(d) for d in range(10)])
  folder = tmp_path / "digits"
  job = (f"task.model.name=small_cnn,task.train_data.source=image_folder,"
         f"task.train_data.path={folder},task.eval_data.source=image_folder,"
         f"task.eval_data.path={folder},runtime.cpu_replicas=3,trainer.global_batch_size=12,"
         "trainer.epochs=1,trainer.steps_per_loop=5")
  proc = helpers.run_train(f"--model_dir={tmp_path / 'run'}", f"--params_override={job}",
                           TFDP_DEFAULT_CONFIG="", timeout=300)  # "": tfdp-train's own default
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "changed airbench → small_cnn: dropped task.model.kwargs" in proc.stderr
  recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
  assert recorded["task"]["eval_flip"] is False and recorded["task"]["label_smoothing"] == 0.0
  assert "replicas=3" in proc.stdout
  assert "eval_accuracy" in (tmp_path / "run" / "metrics.csv").read_text()
