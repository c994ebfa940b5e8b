"""Runs N local copies of a training command, each with its own TF_CONFIG.

Usage: python apps/launch.py --num_workers 2 [--max_restarts 1]
  [--gpus_per_worker auto] [--host 127.0.0.1] [--allow_remote]
  -- python apps/train.py ...
"""

import pathlib
import sys

if not __package__:  # Run as a script: make the repo root importable.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app
from absl import flags

from tfdp import cli
from tfdp.distributed import launch as launcher
from tfdp.errors import TfdpError

flags.DEFINE_integer("num_workers", 2, "Number of worker processes.")
flags.DEFINE_integer("max_restarts", 0, "Reruns of the whole group on failure.")
flags.DEFINE_string(
    "gpus_per_worker", "auto",
    "GPUs per worker, each its own CUDA_VISIBLE_DEVICES: auto (the visible "
    "GPUs split evenly; a CPU run stays as it is), 0 (CPU only) or N.")
flags.DEFINE_string("host", "127.0.0.1", "Address written into TF_CONFIG.")
flags.DEFINE_bool(
    "allow_remote", False,
    "Allow a non-loopback --host and run the workers on the shared network (by default they run "
    "in a private network namespace, loopback only: nothing outside the group reaches their ports).")
flags.DEFINE_bool("allow_many_workers", False, "Allow more than 4 local workers per CPU core.")
flags.DEFINE_float("stop_grace_seconds", launcher.DEFAULT_STOP_GRACE_SECONDS,
                   "Wait between SIGTERM and SIGKILL when stopping workers.")
FLAGS = flags.FLAGS
PROG = "tfdp-launch"


def main(argv: list[str]) -> int:
  command = argv[1:]
  if command[:1] == ["--"]:
    command = command[1:]
  try:
    return launcher.launch(
        command, FLAGS.num_workers, max_restarts=FLAGS.max_restarts,
        host=FLAGS.host, allow_remote=FLAGS.allow_remote,
        stop_grace_seconds=FLAGS.stop_grace_seconds,
        gpus_per_worker=FLAGS.gpus_per_worker,
        allow_many_workers=FLAGS.allow_many_workers)
  except TfdpError as error:
    cli.exit_with_error(PROG, error)


def run() -> None:
  app.run(main, flags_parser=cli.flags_parser(PROG))


if __name__ == "__main__":
  run()
