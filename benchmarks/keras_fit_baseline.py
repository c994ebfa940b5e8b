"""Plain single-device Keras `model.fit`: the yardstick tfdp-bench holds tfdp's loop against.

  python benchmarks/keras_fit_baseline.py --params_override=task.model.name=small_cnn \
      --steps_per_epoch=20 --epochs=3

Same model builder (tfdp.workloads.vision.models), same batches (tfdp.core.data's (images, labels, mask); Keras takes
the mask as sample weights), same global batch, SGD with the config's settings; Keras defaults
otherwise. One warm-up epoch (tracing) is not timed, then --epochs epochs are; prints one JSON line.
"""
import json
import math
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

from tfdp import cli
from tfdp import config as config_lib
from tfdp.core import data as data_lib
from tfdp.core import task as tasks
from tfdp import tta
from tfdp.errors import TfdpError

PROG = "keras-fit-baseline"
flags.DEFINE_multi_string("params_override", None, "tfdp config overrides: a.b=1,c.d=x.")
flags.DEFINE_integer("steps_per_epoch", 20, "Steps per epoch (one timed block).")
flags.DEFINE_integer("epochs", 3, "Timed epochs after the warm-up epoch.")
flags.DEFINE_integer("steps_per_execution", 1, "Keras steps per compiled call (Keras default 1).")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1 or FLAGS.steps_per_epoch <= 0 or FLAGS.epochs <= 0:
    cli.exit_with_error(PROG, "pass only --flag=value options; --steps_per_epoch and --epochs > 0.")
  cli.quiet_tensorflow()
  try:
    config = config_lib.load_config([], FLAGS.params_override or [])
    data_cfg, batch = config.task.train_data, config.trainer.global_batch_size
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    runtime = config.runtime  # thread pools as tfdp would set them
    if runtime.intra_op_threads:
      tf.config.threading.set_intra_op_parallelism_threads(runtime.intra_op_threads)
    if runtime.inter_op_threads:
      tf.config.threading.set_inter_op_parallelism_threads(runtime.inter_op_threads)
    keras.utils.set_random_seed(config.trainer.seed)
    from tfdp.distributed import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
    keras.mixed_precision.set_dtype_policy(strategy_lib.resolve_precision(runtime.mixed_precision)[0])
    task = tasks.make_task(config.task)
    source = task.build_source(data_cfg)
    plan = data_lib.plan_input(source, data_cfg, batch, num_replicas=1, num_pipelines=1)
    steps = (FLAGS.epochs + 1) * FLAGS.steps_per_epoch
    dataset = data_lib.make_dataset_fn(
        plan, data_cfg, task, training=True, seed=config.trainer.seed,
        epochs=math.ceil(steps / plan.steps_per_epoch) + 1)(tf.distribute.InputContext())
    dataset = tta.keras_batches(dataset, task)  # the same batches, as model.fit takes them
    model = task.build_model(source)
  except TfdpError as error:
    cli.exit_with_error(PROG, error)
  opt, lr = config.trainer.optimizer, config.trainer.learning_rate
  model.compile(
      optimizer=keras.optimizers.SGD(lr.base_lr * batch / lr.base_batch_size,
                                     momentum=opt.momentum, nesterov=opt.nesterov,
                                     weight_decay=opt.weight_decay or None),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
      jit_compile=runtime.jit_compile, steps_per_execution=FLAGS.steps_per_execution)

  class EpochTimer(keras.callbacks.Callback):
    def __init__(self):
      super().__init__()
      self.seconds: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
      self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
      self.seconds.append(time.perf_counter() - self.start)

  timer = EpochTimer()
  model.fit(dataset, epochs=FLAGS.epochs + 1, steps_per_epoch=FLAGS.steps_per_epoch,
            callbacks=[timer], verbose=0, shuffle=False)
  timed = timer.seconds[1:]  # the first epoch traces and fills caches
  step_ms = [t / FLAGS.steps_per_epoch * 1000 for t in timed]
  print(json.dumps({
      "model": config.task.model.name, "global_batch": batch, "image_size": source.image_shape[0],
      "data": data_cfg.source if data_cfg.source != "tfds" else f"{data_cfg.name}:{data_cfg.split}",
      "steps_per_epoch": FLAGS.steps_per_epoch, "timed_epochs": len(timed),
      "steps_per_execution": FLAGS.steps_per_execution,
      "images_per_sec": batch / statistics.median(step_ms) * 1000,
      "step_ms": statistics.median(step_ms), "step_ms_min": min(step_ms), "step_ms_max": max(step_ms),
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}), flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(PROG))
