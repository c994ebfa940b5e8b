r"""tfdp-train: train / evaluate one experiment config, on one host or as one worker of many.

  tfdp-train                                   # the default job: configs/cifar10_quick.yaml
  tfdp-train --config_file=configs/cifar10_quick.yaml --config_file=configs/runlocal.yaml \
      --params_override=runtime.cpu_replicas=2 --model_dir=/tmp/run
  tfdp-train --params_override=trainer.epochs=2,trainer.global_batch_size=256 \
      --model_dir=runs/batch256                # another job: a folder of its own
  tfdp-train --print_config                    # the final config, as config.yaml records it
"""
import os
import sys

if not __package__:  # run as a script: make the repo root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags
from absl import logging

import apps
from tfdp import cli
from tfdp import config as config_lib
from tfdp import logs
from tfdp import paths
from tfdp.core import controller
from tfdp.core import outputs
from tfdp.distributed import cluster
from tfdp.errors import ConfigError, OutputError, Preempted, TfdpError

DEFAULT_CONFIG = paths.default_job()
PROG = "tfdp-train"

# absl ends a multi flag's help with "; repeat this option...": these end without a period.
flags.DEFINE_multi_string("config_file", None, "YAML config, layered in order (later wins). "
                          f"Default: {DEFAULT_CONFIG}")
flags.DEFINE_multi_string("params_override", None, "Overrides, applied after the config files: "
                          "a.b=1,c.d=x or a YAML/JSON mapping such as {a: {b: 1}}")
flags.DEFINE_string("model_dir", None, "Checkpoints, metrics.csv, summaries, config.yaml, model. "
                    "Default: runs/<config file names joined by +>, e.g. runs/cifar10_quick, "
                    "runs/cifar10_quick+runlocal.")
flags.DEFINE_enum("mode", "train_and_eval", config_lib.MODES, "What to run.")
flags.DEFINE_bool("print_config", False, "Print the final config (the task's file paths "
                  "absolute, as config.yaml records them) and exit.")
flags.DEFINE_bool("start_over", False, "Train from step 0 even if model_dir holds a run: the "
                  "earlier run moves to model_dir/previous-<time>/ (nothing is deleted).")
cli.define_tf_log_level_flag()
flags.declare_key_flag("tf_log_level")  # shown by --help beside the flags above
FLAGS = flags.FLAGS


def main(argv):
  cli.stay_off_pid_1()  # in a container without an init: SIGKILL must reach this process
  # First, before TensorFlow starts a thread: SIGTERM/Ctrl-C stop this process at any point
  # (MultiWorkerMirroredStrategy's own SIGTERM handler would swallow them).
  controller.StopRequest.install(PROG)
  cli.guard_output_pipes()  # under tfdp-launch, the launcher may die before we do
  if len(argv) > 1:
    cli.exit_with_error(PROG, f"unexpected arguments {argv[1:]}; pass options as --flag=value.")
  try:
    config_files = _config_files()
    model_dir = FLAGS.model_dir or default_model_dir(config_files)
    # Before the config is loaded: a model module it names may import Keras, and so TensorFlow.
    logs.quiet_tensorflow(logs.tf_log_level(FLAGS.tf_log_level))
    with logs.tensorflow_loading():
      config = config_lib.load_config(config_files, FLAGS.params_override or [])
    if FLAGS.print_config:  # as config.yaml will record it: its file paths absolute
      from tfdp.core import task as task_lib  # pylint: disable=g-import-not-at-top
      print(config_lib.dump_yaml(config, task_lib.with_absolute_paths))
      return 0
    # TensorFlow starts in experiment.build once the checks that need no TensorFlow (config,
    # cluster, model_dir, data paths) have passed.
    from tfdp.core import experiment  # pylint: disable=g-import-not-at-top
    try:
      result = experiment.run(config, model_dir, FLAGS.mode, start_over=_start_over())
    except Preempted as stop:
      cli.exit_with_error(PROG, stop, code=stop.exit_code)
    except OutputError as error:
      cli.exit_with_error(PROG, f"{error}{_job_hint(str(error), model_dir)}")
    except KeyboardInterrupt:
      cli.exit_with_error(PROG, "interrupted; the last checkpoint is kept, re-run to resume", 130)
  except TfdpError as error:
    cli.exit_with_error(PROG, error)
  summary = {k: v for k, v in result.items() if k != "trainer"}
  print(f"{PROG}: done: " + ", ".join(f"{k}={_shown(v)}" for k, v in summary.items()), flush=True)
  cli.exit_now(0)


def _config_files() -> list[str]:
  """--config_file as given; without it the default job, but --mode=eval of a run reads the
  config that trained it (the run's config.yaml): the default job's model would not fit."""
  if FLAGS.config_file:
    return [cli.find_config(p) for p in FLAGS.config_file]
  default = [cli.find_config(DEFAULT_CONFIG)]  # configs/ beside the package, from any folder
  folder = FLAGS.model_dir or default_model_dir(default)  # the run evaluated (not the cwd)
  recorded = os.path.join(folder, outputs.CONFIG_FILE)
  trained = outputs.checkpoint_state(folder)
  if FLAGS.mode != "eval" or not os.path.isfile(trained):
    return default  # nothing to evaluate: preflight says so
  if not os.path.isfile(recorded):  # the default job's model would be built, and misfit
    raise ConfigError(f"--mode=eval: '{folder}' has no {outputs.CONFIG_FILE} (the config "
                      "that trained its checkpoint); pass that config with --config_file.")
  try:
    fit_record = outputs.is_fit_record(recorded)
  except OSError as e:  # its folder's permissions, say: one line, not a traceback
    raise ConfigError(f"--mode=eval: '{recorded}' cannot be read ({e.strerror}); make it "
                      "readable, or pass the run's config with --config_file.") from None
  if fit_record:
    raise ConfigError(f"'{folder}' holds a tfdp.fit run, which tfdp-train cannot "
                      "rebuild; evaluate it in Python: tfdp.evaluate(keras.models.load_model("
                      f"'{os.path.join(folder, 'model.keras')}'), x, y).")
  logging.info("--mode=eval: no --config_file given: the run's own %s", recorded)
  return [recorded]


# How the resume checks say a run's setting differs from this config's (tfdp/core/resume.py,
# experiment.py): where another job's folder or the default job may be the cause.
CONFIG_REFUSALS = (" this config cannot resume", " stopped at step", " whose checkpoint this config",
                   " this config would")


def _job_hint(message: str, model_dir: str) -> str:
  """A run refused for another job's settings: where the folder or the settings came from when
  the flags did not say (a second job in the default folder; the default job over a run)."""
  where = f"'{os.path.abspath(os.path.expanduser(model_dir))}' holds a run"
  if not any(where + said in message for said in CONFIG_REFUSALS):
    return ""  # not a setting of this config's (its outputs without a checkpoint, a group size)
  if not FLAGS.model_dir:
    return (f" (--model_dir was not given: {model_dir} is named after the config files, not "
            "--params_override; give another job its own --model_dir)")
  recorded = os.path.join(model_dir, outputs.CONFIG_FILE)
  if not FLAGS.config_file and os.path.isfile(recorded):
    return (" (no --config_file was given, so this is the default job; to resume that run, pass "
            f"--config_file={recorded})")
  return ""


def _shown(value) -> str:
  """Four decimals, but a small float (a decayed learning rate of 6.25e-05) in its digits, not
  as 0.0001 or 0.0000."""
  if not isinstance(value, float):
    return str(value)
  return f"{value:.4g}" if 0 < abs(value) < 1e-3 else f"{value:.4f}"


def default_model_dir(config_files: list[str]) -> str:
  """runs/ and every config file's name: two jobs that share an overlay (runlocal.yaml) get
  two folders, not one that refuses the second."""
  names = [os.path.splitext(os.path.basename(path))[0] for path in config_files]
  return os.path.join("runs", "+".join(names))


def _start_over() -> bool:
  """--start_over, unless this process is a restart (tfdp-launch --max_restarts, Slurm
  --requeue) of a group that already started over: it resumes the run it was training."""
  if not FLAGS.start_over:
    return False
  restart = cluster.group_restart()
  if restart:
    name, count = restart
    logging.warning("--start_over ignored: this is restart %s (%s), which resumes the run "
                    "the first start began", count, name)
    return False
  return True


def run():
  apps.lend_help_to_console_script(__name__)
  app.run(main, flags_parser=cli.flags_parser(PROG))


if __name__ == "__main__":
  run()
