"""What every tfdp-* app shares: one-line errors instead of tracebacks, and config loading."""
from __future__ import annotations

import os
import re
import sys

from absl import flags

from tfdp import logs
from tfdp import paths



def exit_with_error(prog: str, message, code: int | None = None) -> None:
  """One line, and the exit code a scheduler acts on: the error's own (tfdp.errors), else 2."""
  if code is None:
    code = getattr(message, "exit_code", None) or 2
  # one write under the signal watcher's lock: its SIGTERM line (the launcher stopping this
  # worker as it fails) once landed inside this one, before its newline (a probe)
  logs.write_stderr_line(f"{prog}: error: {' '.join(str(message).split())}")
  exit_now(code)


def exit_now(code: int) -> None:
  """Leaves without running object destructors: destroying a tf.data iterator after a long run
  stalled TF 2.21 for about a minute (see Trainer.train). Every output is written before this."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


prog = "tfdp"  # the running app's name, for one-line errors raised far from the app

PASSED_ON_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def stay_off_pid_1() -> None:
  """A container started without an init (a Kubeflow TFJob's `command`, `docker run` without
  --init) makes this process PID 1, to which the kernel delivers no signal it has no handler
  for, SIGKILL included (pid_namespaces(7)): the start-up watcher's kill left a worker whose
  peer never came waiting for ever. As PID 1, forks: the child runs on; this process passes
  signals on, reaps what is left to it, and leaves with the child's exit code (128+N when a
  signal N killed it), as tini does. Call first, before any thread starts."""
  if os.getpid() != 1:
    return
  import signal  # pylint: disable=g-import-not-at-top
  child = os.fork()
  if child == 0:
    return
  def pass_on(number, _):
    try:
      os.kill(child, number)
    except ProcessLookupError:  # reaped a moment ago: its code is on its way out
      pass
  for name in PASSED_ON_SIGNALS:
    signal.signal(getattr(signal, name), pass_on)
  while True:
    try:
      pid, status = os.wait()
    except ChildProcessError:  # no child left (cannot happen before the child's own exit)
      os._exit(1)
    if pid == child:
      code = os.waitstatus_to_exitcode(status)
      os._exit(code if code >= 0 else 128 - code)


def flags_parser(prog: str, command: str = ""):  # pylint: disable=redefined-outer-name
  """absl prints usage and a traceback-like two lines on a bad flag; tfdp prints one line, which
  points at `command --helpfull` (default: prog, the console script)."""
  globals()["prog"] = prog
  command = command or prog

  def parse(argv: list[str]) -> list[str]:
    try:
      return flags.FLAGS(argv)
    except flags.UnrecognizedFlagError as error:
      said = re.sub(r"\. Did you mean: (.+) \?$",  # absl's "'x'. Did you mean: a, b ?"
                    lambda m: " (did you mean --" + m.group(1).replace(", ", ", --") + "?)",
                    str(error))
      exit_with_error(prog, f"{said}; see {command} --helpfull.")
    except flags.Error as error:
      exit_with_error(prog, f"{error}; see {command} --helpfull.")
  return parse


find_config = paths.find_config  # the apps' name for it


def quiet_tensorflow(level: str | None = None) -> str:
  """Before TensorFlow starts: its log level from --tf_log_level, else TF_CPP_MIN_LOG_LEVEL, else
  'off' (TensorFlow's start-up lines and the CUDA probe's error on a CPU-only machine drown what
  matters; tfdp's own lines and every error that stops a run still show). Returns the level."""
  from tfdp import logs  # pylint: disable=g-import-not-at-top
  level = logs.tf_log_level(level)
  logs.quiet_tensorflow(level)
  return level


def define_tf_log_level_flag() -> None:
  from tfdp import logs  # pylint: disable=g-import-not-at-top
  flags.DEFINE_enum("tf_log_level", None, list(logs.TF_LOG_LEVELS),
                    "TensorFlow's own log lines (C++ start-up, CUDA probe, tf.distribute INFO). "
                    "Default: TF_CPP_MIN_LOG_LEVEL if set, else off.")


class OrphanSafeStream:
  """stdout/stderr of a worker whose launcher died: the pipe has no reader, and a progress line
  written before the SIGTERM handler runs would raise BrokenPipeError in the middle of training,
  skipping the checkpoint that SIGTERM asks for. The first such write points the stream at
  /dev/null instead."""

  def __init__(self, stream):
    self._stream = stream

  def _to_devnull(self) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, self._stream.fileno())
    os.close(devnull)

  def write(self, text):
    try:
      return self._stream.write(text)
    except BrokenPipeError:
      self._to_devnull()
      return len(text)

  def flush(self):
    try:
      self._stream.flush()
    except BrokenPipeError:
      self._to_devnull()
      try:
        self._stream.flush()  # the buffered text now goes to /dev/null
      except OSError:
        pass

  def __getattr__(self, name):
    return getattr(self._stream, name)


def guard_output_pipes() -> None:
  if not isinstance(sys.stdout, OrphanSafeStream):
    sys.stdout = OrphanSafeStream(sys.stdout)
  if not isinstance(sys.stderr, OrphanSafeStream):
    sys.stderr = OrphanSafeStream(sys.stderr)
