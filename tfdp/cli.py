"""What every tfdp-* app shares: one-line errors instead of tracebacks, and config loading."""
from __future__ import annotations

import os
import sys

from absl import flags

REPO_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def exit_with_error(prog: str, message, code: int = 2) -> None:
  print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  exit_now(code)


def exit_now(code: int) -> None:
  """Leaves without running object destructors: destroying a tf.data iterator after a long run
  stalled TF 2.21 for about a minute (see Trainer.train). Every output is written before this."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def flags_parser(prog: str):
  """absl prints usage and a traceback-like two lines on a bad flag; tfdp prints one line."""
  def parse(argv: list[str]) -> list[str]:
    try:
      return flags.FLAGS(argv)
    except flags.Error as error:
      exit_with_error(prog, f"{error}; see {prog} --helpfull.")
  return parse


def find_config(path: str) -> str:
  """A config path as given, or else relative to the repository's configs/ folder."""
  if os.path.exists(path):
    return path
  candidate = os.path.join(REPO_CONFIGS, os.path.relpath(path, "configs")
                           if path.startswith("configs") else path)
  return candidate if os.path.exists(candidate) else path


def quiet_tensorflow() -> None:
  """TensorFlow's C++ INFO lines drown the progress bar; warnings and errors still show."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
