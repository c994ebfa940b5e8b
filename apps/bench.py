r"""tfdp-bench: throughput, multi-worker scaling, all-reduce bandwidth, input pipeline rate,
time to accuracy against plain Keras.

  tfdp-bench --mode=throughput --models=resnet20,small_cnn --replicas=1,2 --global_batch_sizes=128
  tfdp-bench --mode=scaling --models=resnet20 --workers=2 --per_replica_batch=64
  tfdp-bench --mode=allreduce --workers=2 --min_bytes=4096 --max_bytes=67108864
  tfdp-bench --mode=allreduce --workers=3 --hosts=box --link_rate=100mbit   # separate hosts
  tfdp-bench --mode=input --models=resnet20 --data=cifar10
  tfdp-bench --mode=tta --targets=0.6,0.7,0.8   # the default job (configs/cifar10_quick.yaml)
Each mode writes <output_dir>/<mode>.csv and <mode>.png and prints a table; tta also writes
tta_targets.csv (seconds to each target per run, and tfdp's speed-up).
"""
import os
import sys

if not __package__:  # run as a script: make the repo root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags

import apps
from tfdp import bench
from tfdp import cli
from tfdp import paths
from tfdp.errors import ConfigError, TfdpError

PROG = bench.PROG
DEFAULTS = bench.BenchOptions()


def _csv(values) -> str:
  return ",".join(str(v) for v in values)


flags.DEFINE_enum("mode", "throughput", bench.MODES, "What to measure.")
flags.DEFINE_string("output_dir", DEFAULTS.output_dir, "Where <mode>.csv and <mode>.png go.")
flags.DEFINE_string("models", _csv(DEFAULTS.models), "Models (tfdp registry names), comma-separated.")
flags.DEFINE_string("replicas", _csv(DEFAULTS.replicas), "throughput/input: logical CPU replicas.")
flags.DEFINE_string("global_batch_sizes", _csv(DEFAULTS.global_batch_sizes),
                    "throughput/input: global batch sizes (with --config_file: the config's "
                    "own unless given).")
flags.DEFINE_integer("steps", DEFAULTS.steps, "Steps (all-reduce ops) per timed block.")
flags.DEFINE_integer("warmup_steps", DEFAULTS.warmup_steps, "Untimed steps before the blocks.")
flags.DEFINE_integer("repeats", DEFAULTS.repeats, "Timed blocks; the median is reported.")
flags.DEFINE_enum("data", DEFAULTS.data, bench.DATA_CHOICES,
                  "synthetic (1024 cached 32x32 images) or cifar10 (TFDS, train split).")
# absl ends a multi flag's help with "; repeat this option...": these end without a period.
flags.DEFINE_multi_string("config_file", None, "Benchmark the job of these configs (e.g. "
                          "configs/shakespeare_mlm.yaml) instead of the --models x --data grid; "
                          f"tta: default {paths.default_job()}")
flags.DEFINE_multi_string("params_override", None, "tfdp config overrides for every run: a.b=1,c.d=x "
                          "(tta: trainer.epochs=N sets the epochs of all runs)")
flags.DEFINE_bool("baseline", DEFAULTS.baseline, "throughput: also time plain Keras model.fit.")
flags.DEFINE_integer("workers", DEFAULTS.workers, "scaling: 1..N worker processes; allreduce: N.")
flags.DEFINE_integer("per_replica_batch", DEFAULTS.per_replica_batch, "scaling: batch per worker.")
flags.DEFINE_integer("min_bytes", DEFAULTS.min_bytes, "allreduce: smallest tensor, bytes.")
flags.DEFINE_integer("max_bytes", DEFAULTS.max_bytes, "allreduce: largest tensor, bytes.")
flags.DEFINE_integer("size_factor", DEFAULTS.size_factor, "allreduce: size step (2 or 4).")
flags.DEFINE_integer("pack_tensors", DEFAULTS.pack_tensors, "allreduce: tensors in the pack test.")
flags.DEFINE_integer("pack_tensor_bytes", DEFAULTS.pack_tensor_bytes, "allreduce: bytes of each.")
flags.DEFINE_string("bytes_per_pack", _csv(DEFAULTS.bytes_per_pack),
                    "allreduce: bytes_per_pack values to compare (0: one pack).")
flags.DEFINE_integer("tcp_bytes", DEFAULTS.tcp_bytes, "allreduce: bytes pushed through loopback TCP (in whole 4 MiB chunks, at least one).")
flags.DEFINE_enum("hosts", DEFAULTS.hosts, bench.HOSTS_CHOICES, "allreduce: workers on "
                  "127.0.0.1 (loopback), or each on its own host of a cluster in a box (box: "
                  "network namespaces on one bridge; needs user namespaces or root).")
flags.DEFINE_string("link_rate", DEFAULTS.link_rate, "--hosts=box: every host's link shaped to "
                    "this rate with tc tbf, e.g. 100mbit or 1gbit; empty: unshaped.")
flags.DEFINE_float("timeout_seconds", DEFAULTS.timeout_seconds, "Limit per run: one process or "
                   "one worker group (tta: per training run).")
flags.DEFINE_string("targets", _csv(DEFAULTS.targets), "tta: eval accuracies to time, in (0, 1).")
flags.DEFINE_string("runs", _csv(DEFAULTS.runs), "tta: which of tfdp, keras_recipe (model.fit "
                    "with tfdp's recipe), keras_tutorial (model.fit, Adam, batch 32) to train.")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    cli.exit_with_error(PROG, f"unexpected arguments {argv[1:]}; pass options as --flag=value.")
  try:
    if FLAGS["models"].present and FLAGS.config_file:  # it was dropped without a word (a probe)
      raise ConfigError(
          "--models names the grid's models, and a --config_file job trains its config's model; "
          "drop --models, or choose the model with --params_override=task.model.name=NAME.")
    opts = bench.BenchOptions(
        output_dir=FLAGS.output_dir, models=bench.parse_name_list(FLAGS.models),
        replicas=bench.parse_int_list(FLAGS.replicas, "replicas"),
        global_batch_sizes=(  # a --config_file job keeps its batch unless the flag is given
            bench.parse_int_list(FLAGS.global_batch_sizes, "global_batch_sizes")
            if FLAGS["global_batch_sizes"].present or not FLAGS.config_file else []),
        steps=FLAGS.steps, warmup_steps=FLAGS.warmup_steps, repeats=FLAGS.repeats,
        data=FLAGS.data, config_files=FLAGS.config_file or [],
        params_override=FLAGS.params_override or [], baseline=FLAGS.baseline,
        workers=FLAGS.workers, per_replica_batch=FLAGS.per_replica_batch,
        min_bytes=FLAGS.min_bytes, max_bytes=FLAGS.max_bytes, size_factor=FLAGS.size_factor,
        pack_tensors=FLAGS.pack_tensors, pack_tensor_bytes=FLAGS.pack_tensor_bytes,
        bytes_per_pack=bench.parse_int_list(FLAGS.bytes_per_pack, "bytes_per_pack"),
        tcp_bytes=FLAGS.tcp_bytes, timeout_seconds=FLAGS.timeout_seconds,
        hosts=FLAGS.hosts, link_rate=FLAGS.link_rate,
        targets=bench.parse_float_list(FLAGS.targets, "targets"),
        runs=bench.parse_name_list(FLAGS.runs))
    bench.run_mode(FLAGS.mode, opts)
  except TfdpError as error:
    cli.exit_with_error(PROG, error)
  except KeyboardInterrupt:
    cli.exit_with_error(PROG, "interrupted; every measurement process was stopped.", code=130)
  return 0


def run():
  apps.lend_help_to_console_script(__name__)
  app.run(main, flags_parser=cli.flags_parser(PROG))


if __name__ == "__main__":
  run()
