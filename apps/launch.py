"""Runs N local copies of a training command, each with its own TF_CONFIG.

Usage: python apps/launch.py --num_workers 2 [--max_restarts 1]
  [--host 127.0.0.1] [--allow_remote] -- python apps/train.py ...
"""

import pathlib
import sys

if not __package__:  # Run as a script: make the repo root importable.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app
from absl import flags

from tfdp import launch as launcher
from tfdp.errors import TfdpError

flags.DEFINE_integer("num_workers", 2, "Number of worker processes.")
flags.DEFINE_integer("max_restarts", 0, "Reruns of the whole group on failure.")
flags.DEFINE_string("host", "127.0.0.1", "Address written into TF_CONFIG.")
flags.DEFINE_bool("allow_remote", False, "Allow a non-loopback --host.")
flags.DEFINE_float("stop_grace_seconds", launcher.DEFAULT_STOP_GRACE_SECONDS,
                   "Wait between SIGTERM and SIGKILL when stopping workers.")
FLAGS = flags.FLAGS


def _exit_with_error(message: str) -> None:
  print(f"tfdp-launch: error: {' '.join(str(message).split())}",
        file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return FLAGS(argv)
  except flags.Error as error:  # absl would print two lines and exit 1.
    _exit_with_error(error)


def main(argv: list[str]) -> int:
  command = argv[1:]
  if command[:1] == ["--"]:
    command = command[1:]
  try:
    return launcher.launch(
        command, FLAGS.num_workers, max_restarts=FLAGS.max_restarts,
        host=FLAGS.host, allow_remote=FLAGS.allow_remote,
        stop_grace_seconds=FLAGS.stop_grace_seconds)
  except TfdpError as error:
    _exit_with_error(error)


def run() -> None:
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
