"""Trains one config, then evaluates its final state four ways in the same process: with and
without the weight average (trainer.ema_decay), with and without mirrored test-time
augmentation (task.eval_flip). One training run shows what each adds.

  python benchmarks/eval_variants.py --config_file=configs/cifar10_quick.yaml \
      --model_dir=/tmp/runs/variants [--params_override=...]

Prints one JSON line: {"ema+flip": acc, "ema": acc, "weights+flip": acc, "weights": acc, ...}.
"ema" equals "weights" when trainer.ema_decay is 0; task.eval_translate stays as configured.
"""
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

from tfdp import cli
from tfdp import config as config_lib
from tfdp.core import experiment
from tfdp.errors import TfdpError

PROG = "eval-variants"
flags.DEFINE_multi_string("config_file", None, "tfdp config files, merged in order.")
flags.DEFINE_multi_string("params_override", None, "tfdp config overrides: a.b=1,c.d=x.")
flags.DEFINE_string("model_dir", None, "Where the run writes (must not hold a run).")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1 or not FLAGS.model_dir:
    cli.exit_with_error(PROG, "pass --model_dir and only --flag=value options.")
  cli.quiet_tensorflow()
  try:
    config = config_lib.load_config(FLAGS.config_file or [], FLAGS.params_override or [])
    exp = experiment.build(config, FLAGS.model_dir)
  except TfdpError as error:
    cli.exit_with_error(PROG, error)
  start = time.time()
  result = exp.run()
  seconds = time.time() - start
  trainer, task = exp.trainer, exp.task
  found = {"seconds": round(seconds, 1), "final_eval_accuracy": result.get("eval_accuracy"),
           # every variant keeps the config's translate evaluation: say which one that was
           "eval_translate": task.config.eval_translate}
  for flip in (True, False):
    task.config = dataclasses.replace(task.config, eval_flip=flip)
    trainer.retrace_eval_loop()  # eval_flip is read when the loop traces
    name = "+flip" if flip else ""
    with trainer.evaluation_weights():
      found["ema" + name] = exp.trainer.evaluate(exp.eval_dataset,
                                                 exp.eval_plan.steps_per_epoch).value("accuracy")
    found["weights" + name] = exp.trainer.evaluate(exp.eval_dataset,
                                                   exp.eval_plan.steps_per_epoch).value("accuracy")
  print(json.dumps(found), flush=True)
  os._exit(0)  # pylint: disable=protected-access  (as the apps: skip TF's slow teardown)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(PROG))
