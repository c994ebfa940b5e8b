"""Config layering, overrides and the checks that run before TensorFlow starts."""
import dataclasses
import re

import pytest

import helpers
import yaml

from tfdp import config as config_lib
from tfdp.core import data as data_lib
from tfdp.distributed import strategy as strategy_lib
from tfdp.errors import ConfigError


def write(tmp_path, name, data):
  path = tmp_path / name
  path.write_text(yaml.safe_dump(data))
  return str(path)


def test_files_layer_in_order_and_overrides_win(tmp_path):
  a = write(tmp_path, "a.yaml", {"trainer": {"epochs": 5, "global_batch_size": 64}})
  b = write(tmp_path, "b.yaml", {"trainer": {"epochs": 7}, "runtime": {"cpu_replicas": 2}})
  config = config_lib.load_config([a, b], ["trainer.global_batch_size=32,task.model.name=small_cnn"])
  assert config.trainer.epochs == 7
  assert config.trainer.global_batch_size == 32
  assert config.runtime.cpu_replicas == 2
  assert config.task.model.name == "small_cnn"
  assert config.trainer.learning_rate.base_lr == config_lib.LearningRateConfig().base_lr


def test_a_models_arguments_merge_one_by_one_unless_another_model_is_named(tmp_path):
  job = write(tmp_path, "job.yaml", {"task": {"model": {"name": "airbench",
                                                        "kwargs": {"widths": [8, 16, 32]}}}})
  one_more = config_lib.load_config([job], ["task.model.kwargs.dirac_init=true"])
  assert one_more.task.model.kwargs == {"widths": [8, 16, 32], "dirac_init": True}
  same_name = config_lib.load_config([job], ["task.model={name: airbench, kwargs: {whiten: false}}"])
  assert same_name.task.model.kwargs == {"widths": [8, 16, 32], "whiten": False}
  other = config_lib.load_config([job], ["task.model={name: small_cnn, kwargs: {filters: 4}}"])
  assert other.task.model.kwargs == {"filters": 4}  # airbench's widths would not fit small_cnn
  # {} asks for the model's own defaults: it was merged away, keeping the file's widths (a probe)
  assert config_lib.load_config([job], ["task.model.kwargs={}"]).task.model.kwargs == {}
  # Another task with other arguments (retrieval from a matrix factorization file): the file's
  # are dropped by a {} of its own, then the run's given. Not replaced by naming the task alone:
  # the two BERT tasks share their model's arguments, and a task named where the files name none
  # is no other task (a review).
  mf = write(tmp_path, "mf.yaml", {"task": {"name": "matrix_factorization", "model": {
      "kwargs": {"global_mean": 3.2}}, "train_data": {"source": "interactions", "path": "r.csv"},
      "eval_data": {"source": "interactions", "path": "r.csv"}}})
  retrieval = config_lib.load_config([mf], ["task.name=retrieval,task.model.kwargs={}",
                                            "task.model.kwargs.embedding_dim=32"])
  assert retrieval.task.model.kwargs == {"embedding_dim": 32}
  bert = str(helpers.REPO / "configs" / "shakespeare_mlm.yaml")
  classifier = config_lib.load_config([bert], ["task.name=text_classification,"
                                               "task.model.kwargs.dropout=0.2,"
                                               "task.train_data.source=text_folder,"
                                               "task.eval_data.source=text_folder"])
  assert classifier.task.model.kwargs["num_heads"] == 4
  assert config_lib.load_config([job], ["task.name=image_classification,task.model.kwargs."
                                        "dirac_init=true"]).task.model.kwargs["widths"]
  with pytest.raises(ConfigError, match=r"\['global_mean'\] are not retrieval settings; use "
                     r"embedding_dim, l2, temperature \(task.model.kwargs=\{\} in a "
                     r"--params_override of its own drops a file's\)\.$"):
    config_lib.load_config([], ["task.name=retrieval,task.model.kwargs.global_mean=3.2,"
                                "task.train_data.source=interactions,"
                                "task.eval_data.source=interactions"])


def test_off_is_the_word_off_in_files_and_overrides(tmp_path):
  """YAML 1.1 read the documented `shard_policy: off` as False ("must be a string, got False;
  quote it"). Booleans are now YAML 1.2's true/false only. Seen failing on the old loader.py."""
  job = tmp_path / "job.yaml"
  job.write_text("task:\n  train_data: {shard_policy: off}\n")
  assert config_lib.load_config([str(job)]).task.train_data.shard_policy == "off"
  assert config_lib.load_config(
      [], ["task.eval_data.shard_policy=off"]).task.eval_data.shard_policy == "off"
  with pytest.raises(ConfigError, match="'task.train_data.augment' must be true or false, got 'yes'"):
    config_lib.load_config([], ["task.train_data.augment=yes"])
  assert config_lib.load_config([], ["task.train_data.augment=false"]).task.train_data.augment is False


def test_numbers_are_yaml_1_2s_everywhere_kwargs_too(tmp_path):
  """A review: YAML 1.1 read `1e-5` (no dot) as a string, fixed for typed float fields only:
  task.model.kwargs.l2=1e-5 reached the model as '1e-5' (refused, and its suggested `1e-05`
  too); `010` was 8 (octal) and `1:30` was 90. Seen failing on the old loader.py."""
  config = config_lib.load_config([], [
      "task.model.kwargs={l2: 1e-5, dropout: 1E-1, width: 010},trainer.seed=010"])
  assert config.task.model.kwargs == {"l2": 1e-5, "dropout": 0.1, "width": 10}
  assert config.trainer.seed == 10
  job = tmp_path / "job.yaml"
  job.write_text("task:\n  model:\n    kwargs: {l2: 1e-5, name: 1:30}\n")
  assert config_lib.load_config([str(job)]).task.model.kwargs == {"l2": 1e-5, "name": "1:30"}
  assert config_lib.load_config([], ["trainer.global_batch_size=1e3"]).trainer.global_batch_size == 1000


def test_an_apostrophe_inside_a_value_does_not_swallow_the_next_override():
  """A review: `path=runs/o'brien.csv,trainer.epochs=2` opened a quote at the apostrophe, so
  the path took the rest and epochs was never set. Seen failing: epochs 1 (the default)."""
  config = config_lib.load_config([], ["task.train_data.path=runs/o'brien.csv,trainer.epochs=2"])
  assert config.task.train_data.path == "runs/o'brien.csv" and config.trainer.epochs == 2
  assert config_lib.load_config([], ["task.train_data.path='a,b',trainer.epochs=3"]
                                ).task.train_data.path == "a,b"  # a quoted value as before


def test_an_empty_list_setting_is_no_item_not_one_empty_one(tmp_path):
  """A review: `runtime.devices=` became [''] (and passed validation); `devices:` with nothing in
  a file was refused as None. Seen failing: ['']."""
  assert config_lib.load_config([], ["runtime.devices="]).runtime.devices == []
  job = tmp_path / "job.yaml"
  job.write_text("runtime:\n  devices:\n")
  assert config_lib.load_config([str(job)]).runtime.devices == []


def test_devices_on_a_job_with_cpu_replicas_names_the_setting_to_clear():
  """runtime.devices=/gpu:0 on a base.yaml job was told 'set either cpu_replicas or devices,
  not both', though the user set only devices. Seen failing: the old line had no fix."""
  base = [str(helpers.REPO / "configs" / "base.yaml")]
  with pytest.raises(ConfigError, match=re.escape("set runtime.cpu_replicas=0 to use "
                                                  "runtime.devices")):
    config_lib.load_config(base, ["runtime.devices=/gpu:0"])
  config_lib.load_config(base, ["runtime.devices=/gpu:0,runtime.cpu_replicas=0"])  # the fix


def test_a_key_set_again_in_one_override_wins_as_in_a_later_flag():
  """`a.b=1` pairs compose by appending (tests and scripts add `,trainer.epochs=1` to a shared
  string): the later value wins, as a later --params_override does; README says so."""
  assert config_lib.load_config([], ["trainer.epochs=2,trainer.epochs=3"]).trainer.epochs == 3
  assert config_lib.load_config([], ["trainer.epochs=2", "trainer.epochs=3"]).trainer.epochs == 3


def test_yaml_and_json_overrides_and_lists():
  config = config_lib.load_config([], ['{"trainer": {"epochs": 3}}',
                                       "trainer.learning_rate.decay_epochs=[1,2],"
                                       "trainer.learning_rate.schedule=step"])
  assert config.trainer.epochs == 3
  assert config.trainer.learning_rate.decay_epochs == [1.0, 2.0]


def test_dump_round_trips():
  config = config_lib.load_config([], ["runtime.cpu_replicas=4,task.train_data.split=train[:10]"])
  again = config_lib.from_dict(yaml.safe_load(config_lib.dump_yaml(config)))
  assert dataclasses.asdict(again) == dataclasses.asdict(config)


@pytest.mark.parametrize("override, words", [
    ("trainer.epoch=3", ["trainer.epoch", "trainer.epochs"]),
    ("trainer.ema_decay=1", ["trainer.ema_decay", "[0, 1)"]),
    ("trainer.ema_decay=-0.5", ["trainer.ema_decay", "[0, 1)"]),
    ("task.name=masked_lm,task.eval_flip=true", ["task.eval_flip", "masked_lm", "eval_flip=false"]),
    ("task.train_data.crop_padding=-2", ["task.train_data.crop_padding", ">= 0"]),
    ("task.train_data.flip=mirror", ["task.train_data.flip", "alternating"]),
    ("runtime.mixed_precision=bf16", ["runtime.mixed_precision", "auto"]),
    ("runtime.nope=1", ["runtime.nope"]),
    ("trainer.epochs=three", ["trainer.epochs", "whole number"]),
    ("trainer.epochs=-1", ["trainer.epochs", ">= 0"]),
    ("trainer.epochs=0", ["trainer.epochs", ">= 1", "trainer.max_steps"]),  # not "done" untrained
    ("trainer.epochs: 2", ["'trainer.epochs'", "trainer.epochs=2", "{trainer: {epochs: 2}}"]),
    ("task: {model.name: resnet8}", ["task.model.name=resnet8", "{task: {model: {name: resnet8}}}"]),
    ("{trainer: {epochs: 2001-13-45}}", ["--params_override", "month must be in 1..12", "quote"]),
    ("trainer.epochs=2001-13-45", ["trainer.epochs", "whole number"]),  # was a ValueError traceback
    ("trainer.global_batch_size=0", ["trainer.global_batch_size", "> 0"]),
    ("task.model.name=resnet2000", ["task.model.name", "resnet20"]),
    ("task.train_data.source=hdf5", ["task.train_data.source", "tfds"]),
    ("runtime.strategy=mirored", ["runtime.strategy", "mirrored"]),
    ("runtime.cross_device_ops=mpi", ["runtime.cross_device_ops", "nccl"]),
    ("trainer.learning_rate.schedule=step", ["decay_epochs"]),
    ("trainer.optimizer=sgd", ["trainer.optimizer", "mapping"]),
    ("trainer.optimizer.filter_lr=-0.2", ["trainer.optimizer.filter_lr", "> 0"]),
    ("trainer.optimizer.filter_momentum=1.5", ["trainer.optimizer.filter_momentum", "[0, 1)"]),
    ("trainer.export_model=maybe", ["trainer.export_model", "true or false"]),
    ("runtime.strategy=one_device,runtime.cpu_replicas=2", ["mirrored"]),
    ("trainer", ["="]),
])
def test_bad_values_are_one_line_errors_naming_the_key(override, words):
  with pytest.raises(ConfigError) as info:
    config_lib.load_config([], [override])
  message = str(info.value)
  assert "\n" not in message
  for word in words:
    assert word in message


def test_bad_files(tmp_path):
  with pytest.raises(ConfigError, match="does not exist"):
    config_lib.load_config([str(tmp_path / "missing.yaml")])
  broken = tmp_path / "broken.yaml"
  broken.write_text("trainer: {epochs: [\n")
  with pytest.raises(ConfigError, match="not valid YAML"):
    config_lib.load_config([str(broken)])
  unknown = write(tmp_path, "unknown.yaml", {"trainer": {"epochz": 1}})
  with pytest.raises(ConfigError, match="trainer.epochz"):
    config_lib.load_config([unknown])


def test_a_key_given_twice_in_one_mapping_is_refused_not_dropped(tmp_path):
  # PyYAML keeps the last of two keys silently: the first trainer block would be lost.
  twice = tmp_path / "twice.yaml"
  twice.write_text("trainer: {epochs: 2}\nruntime: {cpu_replicas: 2}\ntrainer: {max_steps: 3}\n")
  with pytest.raises(ConfigError) as info:
    config_lib.load_config([str(twice)])
  message = str(info.value)
  assert "\n" not in message
  for word in (str(twice), "'trainer'", "lines 1 and 3", "merge"):
    assert word in message, message
  with pytest.raises(ConfigError, match="--params_override .*'epochs' twice.*merge"):
    config_lib.load_config([], ["{trainer: {epochs: 2, epochs: 3}}"])
  with pytest.raises(ConfigError, match="'task.model.kwargs'.*'a' twice"):
    config_lib.load_config([], ["task.model.kwargs={a: 1, a: 2}"])
  merged = tmp_path / "merged.yaml"  # a key beside a `<<:` merge overrides it: no repeat
  merged.write_text("short: &short {epochs: 2, max_steps: 3}\nlong: {one: &long {<<: *short, "
                    "epochs: 4}}\ntrainer: {<<: *long, max_steps: 5}\n")
  assert config_lib.loader.load_yaml(str(merged)) == yaml.safe_load(merged.read_text())


def test_a_missing_default_config_names_the_variable_that_chose_it(tmp_path, monkeypatch):
  missing = str(tmp_path / "nonexist.yaml")
  monkeypatch.setenv("TFDP_DEFAULT_CONFIG", missing)
  with pytest.raises(ConfigError, match="TFDP_DEFAULT_CONFIG: fix or unset it") as info:
    config_lib.load_config([missing])
  assert "--config_file path" not in str(info.value)
  monkeypatch.delenv("TFDP_DEFAULT_CONFIG")
  with pytest.raises(ConfigError, match="check the --config_file path"):
    config_lib.load_config([missing])


def test_batch_must_split_over_replicas():
  config = config_lib.load_config([], ["trainer.global_batch_size=130"])
  data_lib.check_batch_divides(config, 4)  # split unevenly (tests/test_uneven_batch.py)
  config = config_lib.load_config([], ["trainer.global_batch_size=130",
                                       "task.train_data.shard_policy=file"])
  data_lib.check_batch_divides(config, 2)
  with pytest.raises(ConfigError, match="global_batch_size.*4 replicas.*128.*shard_policy data"):
    data_lib.check_batch_divides(config, 4)
  assert strategy_lib.expected_replicas(config.runtime, 1) is None  # auto: depends on GPUs found
  config = config_lib.load_config([], ["runtime.cpu_replicas=3"])
  assert strategy_lib.expected_replicas(config.runtime, 1) == 3
  assert strategy_lib.expected_replicas(config.runtime, 2) is None  # multi-worker: known at run time


def test_shipped_configs_load_alone_and_with_their_smoke_layer():
  configs = sorted(p.name for p in (helpers.REPO / "configs").glob("*.yaml"))
  assert {"cifar10_quick.yaml", "shakespeare_mlm.yaml", "shakespeare_genre.yaml",
          "bert_base.yaml"} <= set(configs)
  for name in configs:
    layers = [str(helpers.REPO / "configs" / name)]
    if name.startswith("runlocal"):
      continue  # overlays, loaded on their base below
    if name.startswith("shakespeare"):
      layers.append(str(helpers.REPO / "configs" / "runlocal_text.yaml"))
    elif name.startswith("cifar10"):
      layers.append(str(helpers.REPO / "configs" / "runlocal.yaml"))
    config = config_lib.load_config(layers[:1])
    assert config_lib.load_config(layers).task.name == config.task.name


def test_model_module_registers_a_users_model(tmp_path, monkeypatch):
  (tmp_path / "my_models.py").write_text(
      "import tfdp\n@tfdp.register_model('my_net')\ndef build(input_shape, num_classes):\n"
      "  raise NotImplementedError\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ConfigError, match="my_net"):
    config_lib.load_config([], ["task.model.name=my_net"])
  config = config_lib.load_config([], ["task.model.module=my_models,task.model.name=my_net"])
  assert config.task.model.name == "my_net"
  with pytest.raises(ConfigError, match="task.model.module.*no_such_module"):
    config_lib.load_config([], ["task.model.module=no_such_module"])


def test_a_sliced_split_on_a_folder_source_is_said_to_read_everything(tmp_path, caplog):
  """runlocal.yaml's `train[:1024]` layered on an image folder job trained on the whole folder,
  silently: slicing is TFDS's."""
  import logging  # pylint: disable=g-import-not-at-top
  (tmp_path / "images" / "a").mkdir(parents=True)
  folder = {"source": "image_folder", "path": str(tmp_path / "images")}
  files = [write(tmp_path, "job.yaml", {"task": {"train_data": folder, "eval_data": folder}}),
           str(helpers.REPO / "configs" / "runlocal.yaml")]
  with caplog.at_level(logging.WARNING):
    config_lib.load_config(files[:1], [])
  assert "slicing" not in caplog.text
  with caplog.at_level(logging.WARNING):
    config_lib.load_config(files, [])
  said = [r.getMessage() for r in caplog.records if "slicing is for TFDS" in r.getMessage()]
  assert [m.split("'")[1] for m in said] == ["task.train_data.split", "task.eval_data.split"]
  assert "train[:1024]" in said[0] and "image_folder reads all its data" in said[0], said
  caplog.clear()  # validated again before the run (experiment.preflight): not said again
  with caplog.at_level(logging.WARNING):
    config_lib.validate(config_lib.load_config(files, []))
  assert sum("slicing is for TFDS" in r.getMessage() for r in caplog.records) == 2, caplog.text


@pytest.mark.parametrize("task, override, said", [
    ("shakespeare_genre", "task.train_data.num_classes=5,task.eval_data.mean=[9, 9, 9],"
     "task.label_smoothing=0.1", "task 'text_classification' does not read "
     "task.train_data.num_classes, task.eval_data.mean, task.label_smoothing;"),
    ("insteval_mf", "task.train_data.image_size=8,task.text.sequence_length=64",
     "task 'matrix_factorization' does not read task.train_data.image_size, task.text;"),
    ("cifar10_quick", "task.train_data.holdout_fraction=0.1,task.train_data.source=image_folder,"
     "task.train_data.path=configs,task.train_data.split=test",
     "task 'image_classification' does not read task.train_data.holdout_fraction, "
     "task.train_data.split;"),
])
def test_settings_a_task_never_reads_are_named_in_one_warning(caplog, task, override, said):
  """A probe: num_classes and mean on a text task, image_size on a recommender and a plain split
  on an image folder were accepted and did nothing, silently. Seen failing on the old config
  (no warning); the shipped configs load without one."""
  import logging  # pylint: disable=g-import-not-at-top
  config_file = str(helpers.REPO / "configs" / f"{task}.yaml")
  with caplog.at_level(logging.WARNING):
    config_lib.load_config([config_file], [])
  assert "does not read" not in caplog.text
  with caplog.at_level(logging.WARNING):
    config_lib.load_config([config_file], [override])
  warned = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
  assert len(warned) == 1 and said in warned[0], caplog.text


def test_a_home_folder_path_is_expanded_in_path_keys_only(monkeypatch, tmp_path):
  """A probe's task.train_data.path=~/imgs (no shell expands it inside --params_override) was
  looked for in ./~/imgs; a model's kwargs are the model's, as given. Seen failing on the old
  tfdp/config/__init__.py (the path stayed '~/imgs')."""
  monkeypatch.setenv("HOME", str(tmp_path))
  config = config_lib.load_config([], [
      "task.train_data.path=~/imgs,task.text.vocab_path=~/v.txt,task.model.kwargs={path: ~/x}"])
  assert config.task.train_data.path == str(tmp_path / "imgs")
  warm = config_lib.load_config([], [  # a task that warm-starts (an image task refuses it)
      "task.name=matrix_factorization,task.train_data.source=interactions,"
      "task.eval_data.source=interactions,task.train_data.label_column=r,"
      "task.eval_data.label_column=r,task.train_data.path=r.csv,task.eval_data.path=r.csv,"
      "task.model.kwargs={},task.init_checkpoint=~/runs/mlm"])
  assert warm.task.init_checkpoint == str(tmp_path / "runs" / "mlm")
  assert config.task.text.vocab_path == str(tmp_path / "v.txt")
  assert config.task.model.kwargs == {"path": "~/x"}


def test_numpy_numbers_in_params_are_taken_as_keras_takes_them():
  """A review: tfdp.train(..., {"trainer": {"epochs": np.int64(2)}}) and
  tfdp.make_strategy(cpu_replicas=np.int64(2)) died in yaml.safe_dump with a bare
  RepresenterError. Seen failing: that error."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfdp import in_process  # pylint: disable=g-import-not-at-top
  overrides = in_process.overrides([{"trainer": {"epochs": np.int64(2), "seed": np.int32(5)},
                                     "task": {"model": {"kwargs": {"l2": np.float32(0.5),
                                                                   "widths": [np.int64(3)]}}}}])
  config = config_lib.load_config([], overrides)
  assert (config.trainer.epochs, config.trainer.seed) == (2, 5)
  assert config.task.model.kwargs == {"l2": 0.5, "widths": [3]}
  assert in_process.plain({"cpu_replicas": np.int64(2)}) == {"cpu_replicas": 2}


@pytest.mark.parametrize("setting, words", [
    ("trainer.learning_rate.decay_epochs=[60, -1]",
     "'trainer.learning_rate.decay_epochs' is [60.0, -1.0]; give epochs of 0 or more in "
     "increasing order"),
    ("task.name=matrix_factorization,task.train_data.source=interactions,"
     "task.eval_data.source=interactions,task.train_data.label_column=r,"
     "task.eval_data.label_column=r,task.recommender.oov_buckets=-2",
     "'task.recommender.oov_buckets' is -2; give 0 or more rows"),
    # a probe: said after TensorFlow had started, the strategy built and the data planned
    ("task.init_checkpoint=/some/run",
     "task 'image_classification' has no encoder to warm-start; remove task.init_checkpoint."),
])
def test_settings_that_would_do_nothing_or_fail_late_are_refused_as_the_config_loads(setting,
                                                                                      words):
  """A review: negative or unordered decay_epochs were taken; oov_buckets=-2 failed after
  TensorFlow started, without the key's name; so was an image task's init_checkpoint. Seen
  failing: no error for each. (A BERT task's
  label_smoothing, refused here before, is now warned as every task warns a key it never
  reads: test_settings_a_task_never_reads_are_named_in_one_warning.)"""
  with pytest.raises(ConfigError) as raised:
    config_lib.load_config([], [setting])
  assert words in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
