"""Bad input, table-driven: every case a real `tfdp-train` / `tfdp-launch` process that must
exit non-zero with exactly one `error:` line naming the field or file and the fix, print no
traceback, and leave model_dir byte-identical (an earlier run in it is never discarded)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

import helpers

# Every test of this module on one xdist worker: a module-scoped fixture here trains in real
# processes, and would train again on each worker that ran one of the tests using it.
pytestmark = pytest.mark.xdist_group("test_hardening")

LAUNCH_APP = str(helpers.REPO / "apps" / "launch.py")
TINY = ("task.train_data.source=synthetic,task.train_data.num_examples=64,"
        "task.train_data.image_size=8,task.train_data.num_classes=2,"
        "task.eval_data.source=synthetic,task.eval_data.num_examples=32,"
        "task.eval_data.image_size=8,task.eval_data.num_classes=2,trainer.global_batch_size=16,"
        "task.model.name=small_cnn,runtime.cpu_replicas=2,trainer.epochs=2")
TWO_WORKERS = {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]}
# What sbatch gives the batch script of a 2-task job; srun adds SLURM_STEP_* for its tasks.
BATCH_SCRIPT = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-2]",
                "SLURM_TASKS_PER_NODE": "1(x2)"}
SLURM = dict(BATCH_SCRIPT, SLURM_STEP_ID="0")


@dataclasses.dataclass
class Case:
  id: str
  words: tuple[str, ...]  # the error line names these (the field or file, and the fix)
  args: tuple[str, ...] = ()  # tfdp-train arguments besides --model_dir
  override: str = ""  # appended to TINY
  env: dict = dataclasses.field(default_factory=dict)
  setup: Callable[[Path], None] | None = None  # makes files in the case's folder
  launch: bool = False  # a tfdp-launch case (args are its arguments)
  trained: bool = False  # model_dir holds a real checkpointed run (else an earlier run's files)
  spoil: Callable[[Path], None] | None = None  # damages the trained model_dir
  started: bool = False  # found only once training ran: the earlier run is kept, not untouched


def tf_config(task: dict, cluster: dict | None = None) -> dict:
  return {"TF_CONFIG": json.dumps({"cluster": cluster or TWO_WORKERS, "task": task})}


def write(name: str, content: str | bytes):
  def setup(folder: Path):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
  return setup


_HELD = []  # run locks (and ports) this test process holds, as another process would


def held_by_another_run(folder: Path) -> None:
  import fcntl  # pylint: disable=g-import-not-at-top
  fd = os.open(folder / "run" / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
  fcntl.flock(fd, fcntl.LOCK_EX)
  os.write(fd, f"pid={os.getpid()} host={socket.gethostname()} since=now\n".encode())
  _HELD.append(fd)


HELD_PORT = "{held_port}"  # replaced by the port hold_a_port bound for the case


def hold_a_port(folder: Path) -> None:
  """A free port on 127.0.0.1 this test process listens on, as another program would."""
  holder = socket.socket()
  holder.bind(("127.0.0.1", 0))
  holder.listen()
  _HELD.append(holder)
  (folder / "held_port").write_text(str(holder.getsockname()[1]))


def held_port(folder: Path) -> str:
  path = folder / "held_port"
  return path.read_text() if path.exists() else HELD_PORT


IN_USE = ("in use by another tfdp run", f"pid {os.getpid()} on host {socket.gethostname()}",
          "another --model_dir")


def alias_bomb() -> str:
  lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
  lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
  return "task:\n  model:\n    kwargs:\n" + "".join(f"      {line}\n" for line in lines)


def image_folder(corrupt_name: str | None):
  """A two-class image folder; corrupt_name gets a valid PNG signature followed by garbage."""
  def setup(folder: Path):
    helpers.write_image_folder(folder / "images", per_class=8, size=8)
    if corrupt_name:
      (folder / "images" / "cat" / corrupt_name).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
  return setup


def broken_tfds_info(folder: Path):
  """cifar10 with every file linked from the real one except a broken dataset_info.json."""
  real = helpers.CIFAR_DIR / "cifar10" / "3.0.2"
  copy = folder / "tfds" / "cifar10" / "3.0.2"
  copy.mkdir(parents=True)
  for item in real.iterdir():
    (copy / item.name).symlink_to(item)
  (copy / "dataset_info.json").unlink()
  (copy / "dataset_info.json").write_text("{ not json")


def truncate_data(model_dir: Path):
  data = next((model_dir / "checkpoints").glob("ckpt-8.data-*"))
  data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


FOLDER = "{folder}"  # replaced by the case's own folder in args and overrides
IMAGES = "task.train_data.source=image_folder,task.train_data.path={folder}/images,task.train_data.image_size=0"

# A task that warm-starts (a recommender), for the init_checkpoint cases.
WARM_STARTING = ("task.name=matrix_factorization,task.model.name=mf,task.model.kwargs={},"
                 "task.train_data.source=interactions,task.train_data.path={folder}/r.csv,"
                 "task.train_data.label_column=rating,task.train_data.split=all,"
                 "task.eval_data.source=interactions,task.eval_data.path={folder}/r.csv,"
                 "task.eval_data.label_column=rating,task.eval_data.split=all")
RATINGS = "user,item,rating\n1,2,3.0\n2,1,4.0\n"
CASES = [
    # ---- TF_CONFIG ---------------------------------------------------------------------------
    Case("tf_config_not_json", ("TF_CONFIG", "JSON"), env={"TF_CONFIG": "{cluster: oops"}),
    Case("tf_config_evaluator", ("evaluator", "--mode=eval"),
         env=tf_config({"type": "evaluator", "index": 0})),
    Case("tf_config_superscript_port", ("port", "numeric"),
         env=tf_config({"type": "worker", "index": 0}, {"worker": ["127.0.0.1:²³⁴⁵"]})),
    Case("tf_config_arabic_indic_port", ("port", "numeric"),
         env=tf_config({"type": "worker", "index": 0}, {"worker": ["127.0.0.1:٢٣٤٥", "127.0.0.1:1"]})),
    Case("tf_config_port_out_of_range", ("70000", "1..65535"),
         env=tf_config({"type": "worker", "index": 0}, {"worker": ["127.0.0.1:70000"]})),
    Case("tf_config_index_out_of_range", ("task.index 5", "indices 0..1"),
         env=tf_config({"type": "worker", "index": 5})),
    Case("tf_config_ps", ("ps", "parameter-server"), env=tf_config({"type": "ps", "index": 0})),
    Case("tf_config_no_task_type", ("task.type",), env=tf_config({"index": 0})),
    Case("tf_config_index_as_string", ("task.index", "without quotes"),
         env=tf_config({"type": "worker", "index": "0"})),
    Case("tf_config_rpc_layer_verbs", ("rpc_layer", "grpc+verbs", '"grpc"'),
         env={"TF_CONFIG": json.dumps({"cluster": TWO_WORKERS, "rpc_layer": "grpc+verbs",
                                       "task": {"type": "worker", "index": 0}})}),
    Case("tf_config_chief_missing", ("cluster.chief",), env=tf_config({"type": "chief", "index": 0})),
    # Was a 40-line traceback ending in TF's "UnknownError: Could not start gRPC server".
    Case("tf_config_port_in_use", ("127.0.0.1:{held_port}", "in use", "another", "TF_CONFIG", "stop"),
         env=tf_config({"type": "worker", "index": 0},
                       {"worker": ["127.0.0.1:{held_port}", "127.0.0.1:1"]}), setup=hold_a_port),
    # ---- Slurm -------------------------------------------------------------------------------
    Case("slurm_superscript_ntasks", ("SLURM_NTASKS", "srun"), env=dict(SLURM, SLURM_NTASKS="²")),
    Case("slurm_procid_out_of_range", ("SLURM_PROCID 7", "srun"), env=dict(SLURM, SLURM_PROCID="7")),
    Case("slurm_unbalanced_nodelist", ("nodelist", "SLURM_JOB_NODELIST"),
         env=dict(SLURM, SLURM_JOB_NODELIST="node[1-2")),
    Case("slurm_nodes_and_tasks_per_node_disagree", ("SLURM_TASKS_PER_NODE", "srun"),
         env=dict(SLURM, SLURM_TASKS_PER_NODE="1(x3)", SLURM_NTASKS="3")),
    Case("slurm_backwards_range", ("runs backwards",), env=dict(SLURM, SLURM_JOB_NODELIST="node[2-1]")),
    # Was worker 0 of 2 waiting out runtime.startup_timeout_seconds, then killed (137).
    Case("slurm_batch_script_without_srun",
         ("batch script of a 2-task job", "start tfdp-train with srun"), env=BATCH_SCRIPT),
    # A TF_CONFIG left in the environment gave every srun task the same place: one failed with
    # "Address already in use", the other waited out the start-up timeout.
    Case("slurm_tf_config_disagrees_with_srun",
         ("worker 0 (rank 0 of 2 workers)", "task 1 of 2 (SLURM_PROCID=1)", "unset TF_CONFIG"),
         env=dict(SLURM, SLURM_PROCID="1", **tf_config({"type": "worker", "index": 0}))),
    # ---- config files and overrides ----------------------------------------------------------
    Case("config_binary_file", ("bin.yaml", "UTF-8"),
         args=("--config_file={folder}/bin.yaml",), setup=write("bin.yaml", bytes(range(128, 256)))),
    Case("config_nul_bytes", ("nul.yaml", "binary"),
         args=("--config_file={folder}/nul.yaml",), setup=write("nul.yaml", b"trainer:\x00 {}\n")),
    Case("config_directory", ("is a directory", "YAML file"), args=("--config_file={folder}",)),
    Case("config_missing_file", ("nope.yaml", "does not exist"), args=("--config_file={folder}/nope.yaml",)),
    Case("config_bad_yaml", ("bad.yaml", "not valid YAML at line"),
         args=("--config_file={folder}/bad.yaml",), setup=write("bad.yaml", "trainer:\n  epochs: [1,\n")),
    Case("config_not_a_mapping", ("list.yaml", "mapping"),
         args=("--config_file={folder}/list.yaml",), setup=write("list.yaml", "- 1\n- 2\n")),
    Case("config_alias_bomb", ("bomb.yaml", "expands to more than"),
         args=("--config_file={folder}/bomb.yaml",), setup=write("bomb.yaml", alias_bomb())),
    Case("config_deeply_nested_file", ("deep.yaml", "nested"),
         args=("--config_file={folder}/deep.yaml",),
         setup=write("deep.yaml", "task: " + "[" * 3000 + "]" * 3000 + "\n")),
    Case("override_nested_3000_levels", ("--params_override", "nested"),
         args=("--params_override=" + '{"task": ' * 3000 + "1" + "}" * 3000,)),
    Case("override_dotted_key_too_deep", ("nested",), args=("--params_override=" + "a." * 3000 + "b=1",)),
    Case("override_without_equals", ("'='",), args=("--params_override=trainer",)),
    Case("unknown_key", ("trainer.epochz", "trainer.epochs"), override="trainer.epochz=2"),
    Case("wrong_type", ("trainer.epochs", "whole number"), override="trainer.epochs=two"),
    Case("negative_epochs", ("trainer.epochs", ">= 0"), override="trainer.epochs=-3"),
    Case("negative_watchdog", ("runtime.watchdog_seconds", ">= 0"),
         override="runtime.watchdog_seconds=-1"),
    Case("nan_learning_rate", ("trainer.learning_rate.base_lr", "finite"),
         override="trainer.learning_rate.base_lr=.nan"),
    Case("inf_weight_decay", ("trainer.optimizer.weight_decay", "finite"),
         override="trainer.optimizer.weight_decay=.inf"),
    Case("negative_momentum", ("trainer.optimizer.momentum", "[0, 1)"), override="trainer.optimizer.momentum=-5"),
    Case("beta_2_above_one", ("trainer.optimizer.beta_2", "[0, 1)"),
         override="trainer.optimizer.name=adam,trainer.optimizer.beta_2=1.5"),
    Case("huge_global_batch", ("trainer.global_batch_size", "2147483647"),
         override="trainer.global_batch_size=100000000000000000000"),
    Case("final_lr_fraction_above_one", ("final_lr_fraction", "[0, 1]"),
         override="trainer.learning_rate.final_lr_fraction=2"),
    Case("label_smoothing_one", ("task.label_smoothing", "[0, 1)"), override="task.label_smoothing=1"),
    Case("unknown_optimizer", ("trainer.optimizer.name", "adam"), override="trainer.optimizer.name=adan"),
    Case("unknown_task", ("task.name", "masked_lm"), override="task.name=mlm"),
    Case("unknown_model", ("task.model.name", "resnet20"), override="task.model.name=resnet21"),
    Case("batch_does_not_split", ("global_batch_size", "multiple of 3"),  # file shards: no uneven
         override="runtime.cpu_replicas=3,task.train_data.shard_policy=file"),
    Case("model_kwargs_rejected_by_keras", ("task.model.kwargs", "small_cnn"),
         override="task.model.kwargs.filters=-4"),
    Case("model_kwargs_unknown", ("task.model.kwargs", "small_cnn"), override="task.model.kwargs.widht=3"),
    # A builder of another signature, or one with a bug: the builder is named, not the kwargs.
    Case("model_builder_signature", ("model 'noargs'", "sig_mod.noargs", "input_shape, num_classes"),
         override="task.model.module=sig_mod,task.model.name=noargs,task.model.kwargs={}",
         env={"PYTHONPATH": "{folder}"},
         setup=write("sig_mod.py", "import tfdp\n\n\n@tfdp.register_model('noargs')\n"
                                   "def noargs():\n  return None\n")),
    Case("model_builder_raises", ("model 'buggy'", "bug_mod.py:6", "ValueError: a bug",
                                  "the builder (bug_mod)"),
         override="task.model.module=bug_mod,task.model.name=buggy,task.model.kwargs={}",
         env={"PYTHONPATH": "{folder}"},
         setup=write("bug_mod.py", "import tfdp\n\n\n@tfdp.register_model('buggy')\n"
                                   "def buggy(input_shape, num_classes):\n  raise ValueError('a bug')\n")),
    Case("model_module_syntax_error", ("task.model.module", "syntax error", "broken_mod.py"),
         override="task.model.module=broken_mod", env={"PYTHONPATH": "{folder}"},
         setup=write("broken_mod.py", "def f(:\n")),
    Case("model_module_relative", ("task.model.module", "relative"), override="task.model.module=.foo"),
    Case("model_module_raises", ("task.module", "failed on import", "ZeroDivisionError"),
         override="task.module=raising_mod", env={"PYTHONPATH": "{folder}"},
         setup=write("raising_mod.py", "1 / 0\n")),
    Case("model_module_missing", ("task.model.module", "PYTHONPATH"), override="task.model.module=no_such_mod"),
    Case("bad_mode_flag", ("--mode",), args=("--mode=fit",)),
    Case("stray_argument", ("unexpected arguments",), args=("train",)),
    # ---- data --------------------------------------------------------------------------------
    Case("tfds_not_prepared", ("cifar10", "TFDS_DATA_DIR"),
         override="task.train_data.source=tfds,task.train_data.data_dir={folder}/none"),
    # An IndexError traceback from the source's read of no file.
    Case("tfds_split_empty", ("cifar10", "'train[50000:]' holds no examples", "train[:1000]"),
         override="task.train_data.source=tfds,task.train_data.split=train[50000:]"),
    Case("tfds_version_not_prepared", ("cifar10:9.9.9", "9.9.9"),
         override="task.train_data.source=tfds,task.train_data.name=cifar10:9.9.9"),
    Case("tfds_broken_dataset_info", ("cifar10", "{folder}/tfds", "tfds build"),
         override="task.train_data.source=tfds,task.train_data.data_dir={folder}/tfds",
         setup=broken_tfds_info),
    Case("image_folder_missing", ("task.train_data.path", "not a folder"),
         override=IMAGES.replace("images", "nothing")),
    Case("image_folder_relative_missing", (f"looked in {helpers.REPO / 'no_such_images'}",),
         override="task.train_data.source=image_folder,task.train_data.path=no_such_images"),
    Case("image_folder_without_classes", ("no class subfolders",), override=IMAGES,
         setup=write("images/README.txt", "empty")),
    Case("image_folder_first_image_corrupt", ("0-corrupt.png", "replace or remove it"),
         override=IMAGES, setup=image_folder("0-corrupt.png")),
    Case("image_folder_later_image_corrupt", ("7-corrupt.png", "replace or remove it"),
         override=IMAGES, setup=image_folder("7-corrupt.png"), started=True),
    # One class folder: loss 0 and accuracy 100% from the first step, silently.
    Case("image_folder_one_class", ("task.train_data", "one class", "'cat'", "two or more"),
         override=IMAGES + ",task.train_data.num_classes=0", setup=lambda folder: helpers.write_image_folder(
             folder / "images", per_class=4, classes=("cat",))),
    Case("image_folder_one_class_of_ten", ("task.train_data", "one class", "'cat'", "two or more"),
         override=IMAGES + ",task.train_data.num_classes=10,task.eval_data.num_classes=10",
         setup=lambda folder: helpers.write_image_folder(folder / "images", per_class=4,
                                                         classes=("cat",))),
    Case("synthetic_one_class", ("task.train_data", "one class", "two or more"),
         override="task.train_data.num_classes=1"),
    Case("image_folder_not_an_image", ("x.png", "JPEG/PNG"), override=IMAGES,
         setup=lambda folder: (image_folder(None)(folder),
                               write("images/dog/x.png", "hello")(folder))),
    Case("tfrecord_glob_matches_nothing", ("task.train_data.path", "no TFRecord files"),
         override="task.train_data.source=tfrecord,task.train_data.path={folder}/*.tfrecord"),
    Case("text_folder_empty", ("text",), override="task.name=masked_lm,task.model.name=bert,"
         "task.train_data.source=text_folder,task.train_data.path={folder}/texts",
         setup=write("texts/README", "")),
    Case("interactions_missing", ("task.train_data.path", "{folder}/ratings.csv"),
         override="task.name=matrix_factorization,task.model.name=matrix_factorization,"
         "task.train_data.source=interactions,task.train_data.path={folder}/ratings.csv,"
         "task.train_data.label_column=rating,task.eval_data.source=interactions,"
         "task.eval_data.path={folder}/ratings.csv,task.eval_data.label_column=rating,"
         "task.eval_data.split=all,task.train_data.split=all"),
    Case("recommender_negative_embedding_dim", ("task.model.kwargs.embedding_dim", ">= 1"),
         override="task.name=matrix_factorization,task.model.name=matrix_factorization,"
         "task.model.kwargs.embedding_dim=-3,task.train_data.source=interactions,"
         "task.train_data.path={folder}/r.csv,task.train_data.label_column=rating,"
         "task.train_data.split=all,task.eval_data.source=interactions,"
         "task.eval_data.path={folder}/r.csv,task.eval_data.label_column=rating,"
         "task.eval_data.split=all"),
    # Once a traceback after config.yaml and train/ were written (issue 20, "Also").
    Case("mean_std_not_one_per_channel", ("task.train_data.mean", "3 channel", "2 values"),
         override="task.train_data.mean=[0.5, 0.5],task.train_data.std=[0.2, 0.2]"),
    # Was found, then failed to restore (or a task's other refusal came first).
    Case("init_checkpoint_with_bracket", ("task.init_checkpoint", "lr[0.1]", "without '['"),
         override=WARM_STARTING + ",task.init_checkpoint={folder}/lr[0.1]",
         setup=lambda folder: (write("lr[0.1]/checkpoints/ckpt-1.index", "")(folder),
                               write("r.csv", RATINGS)(folder))),
    Case("init_checkpoint_missing", ("task.init_checkpoint", "{folder}/nowhere"),
         override=WARM_STARTING + ",task.init_checkpoint={folder}/nowhere",
         setup=write("r.csv", RATINGS)),
    # An image task cannot warm-start: said before TensorFlow starts (a probe: after 8 s).
    Case("init_checkpoint_image_task", ("task.init_checkpoint", "no encoder to warm-start"),
         override="task.init_checkpoint={folder}/nowhere"),
    # ---- model_dir and checkpoints -----------------------------------------------------------
    Case("eval_without_checkpoint", ("--mode=eval", "train first"), args=("--mode=eval",)),
    Case("model_dir_is_a_file", ("--model_dir", "file"), args=("--model_dir={folder}/afile",),
         setup=write("afile", "x")),
    Case("model_dir_inside_a_file", ("--model_dir", "afile"), args=("--model_dir={folder}/afile/run",),
         setup=write("afile", "x")),
    # Said the trained run 'has none' (no checkpoint): start_over read no checkpoint (a probe).
    Case("eval_start_over", ("starting over", "--mode=eval", "evaluate without starting over"),
         args=("--mode=eval", "--start_over"), trained=True),
    Case("model_dir_world_writable", ("--model_dir", "{folder}/run", "chmod o-w"),
         setup=lambda folder: (folder / "run").chmod(0o777)),  # anyone could swap checkpoints
    # Two runs in one model_dir overwrote each other's checkpoints and metrics.
    Case("model_dir_in_use", IN_USE, setup=held_by_another_run),
    Case("model_dir_in_use_start_over", IN_USE, args=("--start_over",), setup=held_by_another_run),
    Case("model_dir_in_use_trained", IN_USE, trained=True, setup=held_by_another_run),
    Case("model_dir_in_use_eval", IN_USE, args=("--mode=eval",), trained=True,
         setup=held_by_another_run),
    Case("checkpoint_state_garbage", ("checkpoints/checkpoint", "--start_over"), trained=True,
         spoil=lambda d: (d / "checkpoints" / "checkpoint").write_bytes(b"\x00garbage\xff")),
    Case("checkpoint_state_unparsable", ("checkpoints/checkpoint", "model_checkpoint_path", "--start_over"),
         trained=True, spoil=lambda d: (d / "checkpoints" / "checkpoint").write_text("hello\n")),
    # Each names the way on: the line that points the state at the newest whole checkpoint (the
    # only fix once the newest was removed; each said "fix or remove it").
    Case("checkpoint_index_missing", ("ckpt-8.index", "missing", "--start_over", "resume from ckpt-4",
                                      """echo 'model_checkpoint_path: "ckpt-4"' > {folder}/run/"""),
         trained=True, spoil=lambda d: (d / "checkpoints" / "ckpt-8.index").unlink()),
    Case("checkpoint_newest_removed", ("names 'ckpt-8'", "ckpt-8.index' is missing", "--start_over",
                                       """'model_checkpoint_path: "ckpt-4"' > {folder}/run/"""),
         trained=True, spoil=lambda d: [p.unlink() for p in (d / "checkpoints").glob("ckpt-8.*")]),
    Case("checkpoint_every_one_removed", ("names 'ckpt-8'", "fix or remove it", "--start_over"),
         trained=True, spoil=lambda d: [p.unlink() for p in (d / "checkpoints").glob("ckpt-*")]),
    # --start_over, then a model that fails to build: the earlier run stayed in previous-<time>/
    # and a plain re-run started from step 0 (a probe). It is put back.
    Case("start_over_then_the_model_fails", ("task.model.kwargs", "small_cnn"),
         args=("--start_over",), override="task.model.kwargs.filters=-4", trained=True),
    # checkpoints/ removed by hand after the run: a fresh run overwrote its export and added
    # its rows to the old metrics.csv, silently (a probe).
    Case("checkpoints_removed_outputs_kept", ("holds a run's outputs (metrics.csv",
                                              "no checkpoint to resume it from", "--start_over"),
         trained=True, spoil=lambda d: shutil.rmtree(d / "checkpoints")),
    # A `[` in model_dir: TensorFlow's checkpoint reader globs the path, so a run there saved
    # checkpoints it could never resume ("Failed to find any matching files"; a probe).
    Case("model_dir_with_a_bracket", ("holds '['", "glob pattern", "can never resume",
                                      "lr_0.1 for lr[0.1]", "once its folder is renamed"),
         args=("--model_dir={folder}/lr[0.1]",),
         setup=lambda folder: (write("lr[0.1]/checkpoints/ckpt-8.index", "x")(folder),
                               write("lr[0.1]/checkpoints/ckpt-8.data-00000-of-00001", "x")(folder))),
    Case("checkpoint_state_file_missing", ("no 'checkpoint' state file", "(ckpt-8.index)",
                                           "--start_over", "resume from ckpt-8",
                                           """'model_checkpoint_path: "ckpt-8"' > {folder}/run/"""),
         trained=True, spoil=lambda d: (d / "checkpoints" / "checkpoint").unlink()),
    Case("checkpoint_index_garbage", ("ckpt-8", "damaged", "--start_over"), trained=True,
         spoil=lambda d: (d / "checkpoints" / "ckpt-8.index").write_bytes(os.urandom(300))),
    Case("checkpoint_data_truncated", ("ckpt-8", "damaged", "to resume from ckpt-4",
                                       "model_checkpoint_path", "--start_over"), trained=True,
         spoil=truncate_data),
    # A probe's --mode=eval without the run's config: the fix is that config, not removing a
    # good checkpoint (the line said only that).
    Case("checkpoint_of_another_model", ("ckpt-8", "variable", "shape", "another --model_dir",
                                         "--config_file={folder}/run/config.yaml"),
         trained=True, override="task.model.name=resnet8"),
    Case("checkpoint_of_another_width", ("ckpt-8", "(8,)", "(32,)"), trained=True,
         override="task.model.kwargs.filters=8"),
    # --start_over once moved a data folder's train/ and eval/ aside (issue 20, "Also").
    Case("start_over_on_a_folder_without_a_run", ("starting over would move", "{folder}/data",
                                                  "no tfdp run"),
         args=("--model_dir={folder}/data", "--start_over"),
         setup=lambda folder: (write("data/train/a.txt", "mine\n")(folder),
                               write("data/eval/b.txt", "mine\n")(folder))),
    # A resume that would give the restored step another meaning (issue 20, item 1).
    Case("resume_with_another_batch_and_length", ("global_batch_size was 16, now 32",
                                                  "trainer.global_batch_size", "--start_over",
                                                  "new --model_dir"),
         trained=True, override="trainer.global_batch_size=32,trainer.epochs=4"),
    # Its fix once read "a constant schedule may train longer", which a probe took as leave to
    # switch this run to constant (its learning rate jumped from 0.0087 to 0.025).
    Case("resume_longer_with_a_cosine_schedule", ("total_steps was 8, now 16", "cosine",
                                                  "--start_over", "constant schedule from its start"),
         trained=True, override="trainer.epochs=4"),
    Case("resume_with_another_seed", ("data_order_seed was 42, now 7", "trainer.seed"),
         trained=True, override="trainer.seed=7"),
    # What the checkpoint holds beside the weights: was TF's "variable ... has shape ..." (or a
    # 600-character AssertionError) saying "if it is damaged, remove it".
    Case("resume_with_another_optimizer", ("optimizer was sgd, now adam",
                                           "trainer.optimizer.name", "--start_over"),
         trained=True, override="trainer.optimizer.name=adam"),
    Case("resume_with_other_epoch_steps", ("epoch_steps was 4, now 2", "trainer.steps_per_epoch",
                                           "--start_over"),
         trained=True, override="trainer.steps_per_epoch=2,trainer.epochs=4"),
    Case("resume_with_lookahead", ("lookahead was False, now True",
                                   "trainer.lookahead_every_steps", "--start_over"),
         trained=True, override="trainer.lookahead_every_steps=2"),
    Case("resume_with_a_weight_average", ("weight_average was False, now True",
                                          "trainer.ema_decay", "--start_over"),
         trained=True, override="trainer.ema_decay=0.9"),
    Case("run_record_garbage", ("run.json", "--start_over"), trained=True,
         spoil=lambda d: (d / "checkpoints" / "run.json").write_text("{ not json")),
    # A model that pools any image size restores fine at another: it would score images it never
    # saw at that size (10% on real data), where train_and_eval refuses the same data.
    Case("eval_images_of_another_size", ("16x16x3", "trained run's 8x8x3",
                                         "task.eval_data.image_size=8"),
         args=("--mode=eval",), trained=True, override="task.eval_data.image_size=16"),
    Case("eval_of_damaged_checkpoint", ("ckpt-8", "damaged"), args=("--mode=eval",), trained=True,
         spoil=truncate_data),
    # ---- tfdp-launch ---------------------------------------------------------------------------
    Case("launch_too_many_workers", ("--num_workers 1000", "--allow_many_workers"), launch=True,
         args=("--num_workers=1000", "--", "true")),
    Case("launch_unknown_host", ("no-such-host.invalid", "--host"), launch=True,
         args=("--host=no-such-host.invalid", "--allow_remote", "--", "true")),
    Case("launch_remote_host_without_opt_in", ("10.1.2.3", "--allow_remote"), launch=True,
         args=("--host=10.1.2.3", "--", "true")),
    Case("launch_zero_workers", ("--num_workers", "at least 1"), launch=True,
         args=("--num_workers=0", "--", "true")),
    Case("launch_negative_restarts", ("--max_restarts",), launch=True,
         args=("--max_restarts=-1", "--", "true")),
    Case("launch_no_command", ("no worker command", "--"), launch=True, args=("--num_workers=2",)),
    Case("launch_command_not_found", ("no-such-program",), launch=True,
         args=("--", "no-such-program")),
    Case("launch_bad_gpus_per_worker", ("--gpus_per_worker",), launch=True,
         args=("--gpus_per_worker=lots", "--", "true")),
    Case("launch_nan_stop_grace", ("--stop_grace_seconds", "nan", "30"), launch=True,
         args=("--stop_grace_seconds=nan", "--", "true")),  # nan: workers never SIGKILLed
    Case("launch_inf_stop_grace", ("--stop_grace_seconds", "inf", "30"), launch=True,
         args=("--stop_grace_seconds=inf", "--", "true")),
    Case("launch_negative_stop_grace", ("--stop_grace_seconds", "-1", "30"), launch=True,
         args=("--stop_grace_seconds=-1", "--", "true")),
    Case("launch_unknown_flag", ("'num_worker'", "did you mean --num_workers?"), launch=True, args=("--num_worker=2", "--", "true")),
]
NEEDS_CIFAR = {"tfds_version_not_prepared", "tfds_broken_dataset_info"}


def snapshot(folder: Path) -> dict:
  """Every file and folder under `folder` with its content hash: byte-identical or not."""
  if not folder.exists():
    return {}
  return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
                                       else "dir") for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
  """A real tiny run with checkpoints at steps 4 and 8."""
  model_dir = tmp_path_factory.mktemp("trained") / "run"
  proc = helpers.run_train(f"--model_dir={model_dir}", f"--params_override={TINY}", timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (model_dir / "checkpoints" / "ckpt-8.index").exists()
  return model_dir


def earlier_run(model_dir: Path) -> None:
  """What an earlier start leaves: a failed start must keep every byte of it. (No epoch rows:
  an epoch's row comes after its checkpoint, and rows without one are refused on their own.)"""
  for name, text in {"config.yaml": "earlier: run\n", "metrics.csv": "epoch,step\n",
                     "notes/keep.txt": "mine\n"}.items():
    (model_dir / name).parent.mkdir(parents=True, exist_ok=True)
    (model_dir / name).write_text(text)


def test_there_are_at_least_sixty_cases():
  assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_touches_nothing(case: Case, tmp_path, request):
  if case.id in NEEDS_CIFAR and not helpers.HAVE_CIFAR:
    pytest.skip(helpers.NO_CIFAR_REASON)
  check_refused(case, tmp_path, request)


# Inputs that are wrong whatever TensorFlow would say: refused before it is imported (a second,
# not the four `import tensorflow` takes here), so a cluster job with a typo fails at once.
BEFORE_TENSORFLOW = ("tf_config_ps", "slurm_backwards_range", "slurm_batch_script_without_srun",
                     "slurm_tf_config_disagrees_with_srun", "model_dir_in_use",
                     "model_dir_world_writable", "batch_does_not_split", "tfds_not_prepared",
                     "eval_without_checkpoint", "checkpoint_state_garbage", "run_record_garbage",
                     "resume_with_another_seed", "resume_with_another_batch_and_length",
                     "init_checkpoint_image_task", "tfds_version_not_prepared",
                     "tfds_broken_dataset_info", "resume_with_another_optimizer",
                     "resume_with_lookahead", "resume_with_a_weight_average")


@pytest.mark.parametrize("case_id", BEFORE_TENSORFLOW)
def test_checks_that_need_no_tensorflow_refuse_before_it_is_imported(case_id, tmp_path, request):
  if case_id in NEEDS_CIFAR and not helpers.HAVE_CIFAR:
    pytest.skip(helpers.NO_CIFAR_REASON)
  no_tensorflow = tmp_path / "no_tensorflow"
  (no_tensorflow / "tensorflow").mkdir(parents=True)
  (no_tensorflow / "tensorflow" / "__init__.py").write_text(
      "raise ImportError('tensorflow imported before the checks that need none')\n")
  (case,) = [c for c in CASES if c.id == case_id]
  env = {**case.env, "PYTHONPATH": os.pathsep.join(
      x for x in (str(no_tensorflow), case.env.get("PYTHONPATH")) if x)}
  check_refused(dataclasses.replace(case, env=env), tmp_path, request)


def check_refused(case: Case, tmp_path: Path, request) -> None:
  """Runs `case`: one `error:` line naming its words, no traceback, model_dir untouched."""
  fill = lambda text: text.replace(FOLDER, str(tmp_path)).replace(HELD_PORT, held_port(tmp_path))  # noqa: E731
  model_dir = tmp_path / "run"
  if case.trained:
    shutil.copytree(request.getfixturevalue("trained_run"), model_dir)
    if case.spoil:
      case.spoil(model_dir)
  else:
    earlier_run(model_dir)
  if case.setup:
    case.setup(tmp_path)
  env = {k: fill(v) for k, v in case.env.items()}
  if "PYTHONPATH" in env:
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(helpers.REPO), str(helpers.SCRIPTS)])
  args = [fill(a) for a in case.args]
  before = snapshot(tmp_path)
  if case.launch:
    proc = subprocess.run([sys.executable, LAUNCH_APP, *args], capture_output=True, text=True,
                          timeout=120, env=helpers.env(**env), cwd=str(helpers.REPO))
  else:
    if not any(a.startswith("--model_dir") for a in args):
      args.insert(0, f"--model_dir={model_dir}")
    override = ",".join(x for x in (TINY, fill(case.override)) if x)
    if not any(a.startswith("--params_override") for a in args):
      args.append(f"--params_override={override}")
    proc = helpers.run_train(*args, timeout=300, **env)
  assert proc.returncode != 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
  lines = helpers.error_lines(proc)
  assert len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith(("tfdp-train: error: ", "tfdp-launch: error: ")), lines[0]
  assert "tfdp-" not in proc.stdout, proc.stdout[-2000:]
  assert len(lines[0]) <= 1100, len(lines[0])
  for word in case.words:
    assert fill(word) in lines[0], lines[0]
  after = snapshot(tmp_path)
  if case.started:  # the earlier run's files are all kept; its config.yaml beside the new one
    moved = {k: v for k, v in after.items() if k.startswith("run/config.") and k != "run/config.yaml"}
    assert list(moved.values()) == [before["run/config.yaml"]], sorted(after)
    before = {k: v for k, v in before.items() if k != "run/config.yaml"}
    after = {k: v for k, v in after.items() if k in before}
  assert after == before  # nothing written, moved or removed


def test_start_over_moves_an_unreadable_run_aside_and_trains_from_step_zero(trained_run, tmp_path):
  model_dir = tmp_path / "run"
  shutil.copytree(trained_run, model_dir)
  (model_dir / "checkpoints" / "checkpoint").write_text("hello\n")  # unreadable state
  earlier = snapshot(model_dir)
  proc = helpers.run_train(f"--model_dir={model_dir}", f"--params_override={TINY}", "--mode=train",
                           "--start_over", timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (attic,) = model_dir.glob("previous-*")
  kept = snapshot(attic)
  for name, digest in earlier.items():  # every byte of the earlier run is still there
    if name != ".lock":  # the lock is the folder's, not the run's: it stays
      assert kept[name] == digest, name  # its config.yaml too (was left behind, then replaced)
  assert (model_dir / "config.yaml").exists() and not list(model_dir.glob("config.*.yaml"))
  assert sorted(p.name for p in (model_dir / "checkpoints").glob("*.index")) == ["ckpt-4.index",
                                                                                 "ckpt-8.index"]


def test_a_damaged_newest_checkpoint_is_left_by_the_steps_the_errors_name(trained_run, tmp_path):
  """Damaged ckpt-8: the error names the command that points the state at ckpt-4 (before, it said
  "remove it"; once removed, the next error said "fix or remove it" again); run as given, the run
  resumes from step 4 and finishes. The same once ckpt-8's files are gone. Seen failing: the
  first error named no older checkpoint, and the second said only "fix or remove it"."""
  model_dir = tmp_path / "run"
  shutil.copytree(trained_run, model_dir)
  truncate_data(model_dir)
  train = lambda: helpers.run_train(f"--model_dir={model_dir}", f"--params_override={TINY}",  # noqa: E731
                                    "--mode=train", timeout=300)

  def follow(proc, kept: str) -> None:
    (line,) = helpers.error_lines(proc)
    command = re.search(rf"run: (echo .*?) \({kept}\)", line)
    assert proc.returncode == 2 and command, line
    subprocess.run(command.group(1), shell=True, check=True)

  follow(train(), "older checkpoints stay")
  resumed = train()
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from" in resumed.stderr and "ckpt-4" in resumed.stderr, resumed.stderr[-3000:]
  assert (model_dir / "checkpoints" / "ckpt-8.index").exists()
  shutil.rmtree(model_dir)  # again, this time removing the damaged files first
  shutil.copytree(trained_run, model_dir)
  truncate_data(model_dir)
  for path in (model_dir / "checkpoints").glob("ckpt-8.*"):
    path.unlink()
  follow(train(), "older checkpoints stay")
  assert train().returncode == 0


def test_a_finished_run_run_again_keeps_its_config_and_export_unless_the_export_is_stale(
    trained_run, tmp_path):
  """Nothing trains: config.yaml stays what trained (a changed setting is said to be unused, not
  written as if it had run), and model.keras is not written again; an export older than the
  last checkpoint (a run killed before its export) is. Seen failing: config.yaml said
  base_lr 5.0 (the real one moved to config.<time>.yaml), and model.keras was rewritten."""
  model_dir = tmp_path / "run"
  shutil.copytree(trained_run, model_dir)
  before = snapshot(model_dir)
  export_time = (model_dir / "model.keras").stat().st_mtime_ns
  proc = helpers.run_train(f"--model_dir={model_dir}", "--mode=train",
                           f"--params_override={TINY},trainer.learning_rate.base_lr=5", timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "holds a finished run" in proc.stderr and "were not used" in proc.stderr, proc.stderr
  assert "trainer.learning_rate.base_lr 0.1 → 5.0" in proc.stderr, proc.stderr[-3000:]  # which
  after = snapshot(model_dir)
  assert {k: v for k, v in after.items() if k != ".lock"} == {
      k: v for k, v in before.items() if k != ".lock"}
  assert (model_dir / "model.keras").stat().st_mtime_ns == export_time
  # trainer.export_model alone is used, not unused (a probe: said unused, then exported)
  proc = helpers.run_train(f"--model_dir={model_dir}", "--mode=train",
                           f"--params_override={TINY},trainer.export_model=false", timeout=300)
  assert proc.returncode == 0 and "holds a finished run" not in proc.stderr, proc.stderr[-3000:]
  index = model_dir / "checkpoints" / "ckpt-8.index"
  os.utime(index, ns=(export_time + 10**9, export_time + 10**9))  # saved after the export
  again = helpers.run_train(f"--model_dir={model_dir}", "--mode=train",
                            f"--params_override={TINY}", timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert (model_dir / "model.keras").stat().st_mtime_ns > export_time + 10**9


def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(trained_run, tmp_path):
  model_dir = tmp_path / "run"
  shutil.copytree(trained_run, model_dir)
  checkpoints, metrics = snapshot(model_dir / "checkpoints"), (model_dir / "metrics.csv").read_text()
  diverge = (f"{TINY},trainer.epochs=4,trainer.steps_per_loop=1,trainer.learning_rate.base_lr=1e30,"
             "trainer.learning_rate.schedule=constant")
  proc = helpers.run_train(f"--model_dir={model_dir}", f"--params_override={diverge}",
                           "--mode=train", timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = helpers.error_lines(proc)
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  for word in ("diverged", "loss nan", "step 8) is kept", "base_lr", "stop_on_nan"):
    assert word in lines[0], lines[0]
  assert int(re.search(r"in step (\d+);", lines[0]).group(1)) > 8, lines[0]
  assert snapshot(model_dir / "checkpoints") == checkpoints  # no NaN weights saved
  assert (model_dir / "metrics.csv").read_text() == metrics


def test_stop_on_nan_off_trains_on(trained_run, tmp_path):
  model_dir = tmp_path / "run"
  diverge = (f"{TINY},trainer.epochs=1,trainer.learning_rate.base_lr=1e30,"
             "trainer.learning_rate.schedule=constant,trainer.stop_on_nan=false")
  proc = helpers.run_train(f"--model_dir={model_dir}", f"--params_override={diverge}",
                           "--mode=train", timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (model_dir / "checkpoints" / "ckpt-4.index").exists()


def test_an_empty_metrics_csv_is_set_aside_after_the_checkpoint_is_saved(tmp_path):
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  (model_dir / "metrics.csv").write_text("")
  proc = helpers.run_train(f"--model_dir={model_dir}", f"--params_override={TINY},trainer.epochs=1",
                           "--mode=train", timeout=300)
  assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert (model_dir / "checkpoints" / "ckpt-4.index").exists()
  (aside,) = model_dir.glob("metrics.csv.bad-*")
  assert aside.read_text() == ""
  assert "metrics.csv" in proc.stderr and str(aside.name) in proc.stderr  # one line says where
  assert (model_dir / "metrics.csv").read_text().startswith("epoch,")


def test_a_start_that_fails_after_making_a_new_model_dir_removes_it(trained_run, tmp_path):
  """A warm start the task cannot take left an empty model_dir when it failed after making it;
  it is now refused with the config, before the folder is made. (A failure after the folder is
  made, which removes it: test_text_tasks's warm start from a checkpoint that cannot be read.)"""
  model_dir = tmp_path / "new" / "run"
  proc = helpers.run_train(f"--model_dir={model_dir}", "--mode=train",
                           f"--params_override={TINY},task.init_checkpoint={trained_run}",
                           timeout=300)
  assert proc.returncode == 2 and "warm-start" in helpers.error_lines(proc)[0], proc.stderr[-3000:]
  assert not model_dir.exists()


def test_eval_without_a_config_file_reads_the_config_that_trained_the_run(trained_run, tmp_path):
  """`tfdp-train --mode=eval --model_dir=RUN` (the README's "evaluate the latest checkpoint")
  built the default job's model and failed on the checkpoint, after TensorFlow had started, with
  three remedies. It now reads RUN/config.yaml; a tfdp.fit run (whose record tfdp-train cannot
  rebuild) is one line naming tfdp.evaluate. Seen failing on the old apps/train.py (exit 2)."""
  model_dir = tmp_path / "run"
  shutil.copytree(trained_run, model_dir)
  proc = helpers.run_train(f"--model_dir={model_dir}", "--mode=eval", timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "the run's own" in proc.stderr, proc.stderr[-3000:]
  result = json.loads((model_dir / "eval.json").read_text())
  assert result["step"] == 8 and result["eval_examples"] == 32
  # what was evaluated (a probe: an eval of another split overwrote eval.json, unnamed)
  assert result["eval_data"]["source"] == "synthetic", result
  fit_run = tmp_path / "fit_run"
  fit_run.mkdir()
  (fit_run / "config.yaml").write_text("task: {name: keras_model}\nkeras: {model_name: mlp}\n")
  (fit_run / "checkpoints").mkdir()
  (fit_run / "checkpoints" / "checkpoint").write_text('model_checkpoint_path: "ckpt-8"\n')
  proc = helpers.run_train(f"--model_dir={fit_run}", "--mode=eval", timeout=60)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  (line,) = helpers.error_lines(proc)
  assert "tfdp.fit run" in line and "tfdp.evaluate(" in line, line
  # Its config.yaml deleted: the default job was evaluated, and told to set image_size=16,
  # then about its classes (a probe); now the missing config is named, before TensorFlow.
  (model_dir / "config.yaml").unlink()
  proc = helpers.run_train(f"--model_dir={model_dir}", "--mode=eval", timeout=60)
  assert helpers.error_lines(proc) == [
      f"tfdp-train: error: --mode=eval: '{model_dir}' has no config.yaml (the config that trained "
      "its checkpoint); pass that config with --config_file."], proc.stderr[-3000:]
  assert "cluster: " not in proc.stdout


def test_a_fit_runs_checkpoint_of_another_model_does_not_offer_its_record_as_a_config(
    trained_run, tmp_path):
  """tfdp.fit with another model in the same model_dir was told to pass
  --config_file=<run>/config.yaml, which tfdp-train refuses ("unknown config key 'keras'"): a
  tfdp.fit run's config.yaml records the Keras model, it is no job config. Seen failing on the
  old trainer.py (the hint was there)."""
  model_dir = tmp_path / "run"
  shutil.copytree(trained_run, model_dir)
  (model_dir / "config.yaml").write_text("task: {name: keras_model}\nkeras: {model_name: mlp}\n")
  proc = helpers.run_train(f"--model_dir={model_dir}", "--mode=train",
                           f"--params_override={TINY},task.model.name=resnet8", timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  (line,) = helpers.error_lines(proc)
  assert "cannot be resumed" in line and "another --model_dir" in line, line
  assert "--config_file" not in line, line
