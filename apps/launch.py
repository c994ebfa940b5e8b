"""tfdp-launch: run N local copies of a training command, each a worker with its own TF_CONFIG.

  tfdp-launch --num_workers=2 -- tfdp-train --model_dir=runs/mw
  tfdp-launch --num_workers=4 --max_restarts=2 --min_workers=2 -- tfdp-train --model_dir=runs/mw
  tfdp-launch --num_workers=2 --gpus_per_worker=1 -- python my_script.py

Flags before the command are the launcher's; the command starts at the first word that is no
flag (or after `--`) and runs as given, its own flags too (`--host` after `python x.py` is the
script's). The workers run in a private loopback-only network unless --allow_remote.
"""

import pathlib
import sys

if not __package__:  # Run as a script: make the repo root importable.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app
from absl import flags

import apps
from tfdp import cli
from tfdp.distributed import launch as launcher
from tfdp.errors import TfdpError

flags.DEFINE_integer("num_workers", 2, "Number of worker processes.")
flags.DEFINE_integer("max_restarts", 0, "Reruns of the whole group on failure.")
flags.DEFINE_integer(
    "min_workers", None,
    "Let a restart run fewer workers, down to this many (unset: every restart runs all "
    "--num_workers). A worker slot (TFDP_WORKER_SLOT, its index in the full group) that is "
    "the first to fail in 2 group attempts in a row is dropped; fewer than --min_workers left "
    "stops the launcher with one line naming the missing slots. Each restart logs one line: "
    "'restart R of M: N workers (was K; why)'.", lower_bound=1)
flags.DEFINE_string(
    "slots_file", None,
    "With --min_workers: a file listing the worker slots that may start (numbers 0 .. "
    "num_workers-1, one per line; written with all of them if missing), read at every restart. "
    "The launcher rewrites it without a slot it drops; list the slot again when its host is "
    "back and the group grows back at its next restart. Without it a dropped slot stays out.")
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
  command = argv[1:]  # absl left everything from the first word that is no flag (`--` dropped)
  try:
    return launcher.launch(
        command, FLAGS.num_workers, max_restarts=FLAGS.max_restarts,
        host=FLAGS.host, allow_remote=FLAGS.allow_remote,
        stop_grace_seconds=FLAGS.stop_grace_seconds,
        gpus_per_worker=FLAGS.gpus_per_worker,
        allow_many_workers=FLAGS.allow_many_workers, min_workers=FLAGS.min_workers,
        slots_file=FLAGS.slots_file)
  except TfdpError as error:
    cli.exit_with_error(PROG, error)
  except KeyboardInterrupt:  # outside a group's run (start-up, between restarts): no worker runs
    print(f"{PROG}: interrupted before a worker group ran (none is left running).",
          file=sys.stderr, flush=True)
    return 130


def run() -> None:
  apps.lend_help_to_console_script(__name__)
  # POSIX parsing: the launcher's flags end at the command, as srun's and torchrun's do; absl's
  # default reads flags anywhere, so a script's --host became the launcher's, silently.
  FLAGS.set_gnu_getopt(False)
  app.run(main, flags_parser=cli.flags_parser(PROG))


if __name__ == "__main__":
  run()
