"""The start-up of a multi-worker strategy, bounded from outside: TF's MultiWorkerMirroredStrategy
waits for every worker inside C++ that holds the GIL, where no Python thread of the worker can
act, so a watcher *process* (StartupDeadline, watch_startup) ends a start-up that takes too long,
or that its group was asked to stop."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from tfdp.distributed import isolation
from tfdp.distributed.cluster import Cluster, parse_tf_config, port_taken_error, unanswered_peers


class StartupDeadline:
  """Bounds the wait for the other workers while the strategy is made. TF's
  MultiWorkerMirroredStrategy waits for every worker for ever, inside C++ that holds the GIL
  (Context.ensure_initialized): a restarted group whose host never came back hung there for over
  10 minutes, and no Python thread, signal handler or the coordination service's register timeout
  could act. So a small watcher *process* waits instead: past runtime.startup_timeout_seconds it
  names, in one line, the workers whose ports take no connection, and kills this worker
  (SIGKILL: a retryable death for tfdp-launch --max_restarts/--min_workers and Kubeflow alike).
  Leaving the block (or this process dying) ends the watcher; TF's 'Could not start gRPC server'
  leaves it as one line (port_taken_error)."""

  def __init__(self, cluster: Cluster, seconds: float):
    self.cluster, self.seconds = cluster, seconds
    self._watcher = None

  def __enter__(self) -> "StartupDeadline":
    if self.seconds > 0 and self.cluster.is_multi_worker:
      from tfdp import cli  # pylint: disable=g-import-not-at-top
      if os.getpid() == 1:  # tfdp-train forks off PID 1 (cli.stay_off_pid_1); a script cannot
        from absl import logging  # pylint: disable=g-import-not-at-top
        logging.warning("this worker is PID 1 of its container, which no SIGKILL from inside "
                        "reaches: runtime.startup_timeout_seconds cannot stop it; start it under "
                        "an init (docker run --init, tini, or a pod with shareProcessNamespace: "
                        "true)")
      spec = json.dumps({"pid": os.getpid(), "seconds": self.seconds, "prog": cli.prog,
                         "tf_config": self.cluster.as_tf_config()})
      lifeline = isolation.lifeline_fd()  # the watcher sees the launcher end too
      self._watcher = subprocess.Popen(  # its stderr is this worker's: the line lands in its log
          [sys.executable, "-c", "import sys; from tfdp.distributed import startup; "
           "startup.watch_startup(sys.argv[1])", spec],
          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
          pass_fds=() if lifeline is None else (lifeline,))
    return self

  def say(self, who: str) -> None:
    """What the rendezvous waits for, in words (rendezvous.wait_for_peers; "" once it is over):
    the watcher's line names it, where a probe of the ports could not tell a tfdp worker's port
    from another program's."""
    if self._watcher is not None:
      try:
        self._watcher.stdin.write(" ".join(who.split()).encode() + b"\n")
        self._watcher.stdin.flush()
      except OSError:  # the watcher is gone: it has nothing left to say
        pass

  def __exit__(self, kind, error, traceback) -> None:
    if self._watcher is not None:
      self._watcher.stdin.close()  # end of input: the watcher leaves
      self._watcher.wait()
    # TF's bare UnknownError when this task's port cannot be bound (it names neither port nor why)
    if (kind is not None and kind.__name__ == "UnknownError" and self.cluster.is_multi_worker
        and "Could not start gRPC server" in str(error)):
      raise port_taken_error(self.cluster, said="; TensorFlow: Could not start gRPC server") from None


class _Stopped(Exception):
  """The watcher's group got SIGTERM/SIGINT, or the launcher ended: said in its message."""


def _raise_stopped(signum, frame) -> None:
  del frame
  raise _Stopped(f"{signal.Signals(signum).name} during start-up")


def watch_startup(spec_json: str) -> None:
  """The watcher process of StartupDeadline: waits for the worker to close its stdin, keeping the
  last line the worker wrote there (StartupDeadline.say). TF's start-up holds the worker's GIL,
  so neither its signal thread nor its lifeline thread can act there: a SIGTERM/SIGINT to the
  group (the launcher's stop, a Ctrl-C) or the launcher's end stops it from here (SIGKILL: nothing
  is trained yet), after STOP_GRACE_SECONDS for a worker that can still leave by itself."""
  import select  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  spec = json.loads(spec_json)
  started = time.monotonic()
  end, said, unread = started + spec["seconds"], "", b""
  note_at = started + min(FIRST_NOTE_SECONDS, spec["seconds"] / 2)
  cluster = parse_tf_config(json.dumps(spec["tf_config"]))
  lifeline = [fd for fd in [isolation.lifeline_fd()] if fd is not None]
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, _raise_stopped)
  try:
    while (left := end - time.monotonic()) > 0:
      ready = select.select([sys.stdin, *lifeline], [], [],
                            max(min(left, note_at - time.monotonic()), 0))[0]
      if lifeline and lifeline[0] in ready and not os.read(lifeline[0], 1):
        raise _Stopped("the launcher ended during start-up")
      if sys.stdin in ready:
        chunk = os.read(sys.stdin.fileno(), 65536)
        if not chunk:
          return  # the strategy was made (or the worker died): nothing to do
        *lines, unread = (unread + chunk).split(b"\n")
        said = lines[-1].decode() if lines else said
      elif time.monotonic() >= note_at:  # silence for minutes read as a hang (a probe: a
        note_at = time.monotonic() + NOTE_EVERY_SECONDS  # notebook's 600 s of nothing)
        if end - time.monotonic() > min(NOTE_EVERY_SECONDS, spec["seconds"]) / 4:  # not beside
          _write_line(f"{spec['prog']}: worker {cluster.rank} has waited "  # the error's line
                      f"{time.monotonic() - started:.0f}s for the cluster to assemble "
                      f"(runtime.startup_timeout_seconds: {spec['seconds']:g}): "
                      f"{_waiting_for(cluster, said)}")
  except _Stopped as stopped:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if select.select([sys.stdin], [], [], STOP_GRACE_SECONDS)[0]:
      return  # the worker left (or got past its start-up) by itself
    _stop_worker(spec, f"worker {cluster.rank}: {stopped}, which TensorFlow's start-up holds; "
                 "stopping this worker (SIGKILL): nothing is trained yet")
    return
  _stop_worker(spec, f"worker {cluster.rank}: the cluster did not assemble in "
               f"{spec['seconds']:.0f}s (runtime.startup_timeout_seconds): "
               f"{_waiting_for(cluster, said)}; stopping this worker (SIGKILL) so that the group "
               "restarts")


STOP_GRACE_SECONDS = 2.0
FIRST_NOTE_SECONDS, NOTE_EVERY_SECONDS = 60.0, 60.0  # "still waiting" lines (half a short wait)


def _waiting_for(cluster: Cluster, said: str) -> str:
  """What the start-up waits for: the rendezvous's words, else the peers whose ports are shut."""
  silent = [] if said else unanswered_peers(cluster)
  return said or ("no answer from " + ", ".join(silent) if silent else
                  "every other worker's port answers, so one of them is stuck in its own start-up")


def _write_line(line: str) -> None:
  try:  # one unbuffered write, newline included, done before a kill: the shell's "Killed"
    os.write(sys.stderr.fileno(), (line + "\n").encode())  # (or a launcher's next line) starts
  except (OSError, ValueError):  # a line
    pass  # no stderr to say it on: a kill still restarts the group


def _stop_worker(spec: dict, said: str) -> None:
  _write_line(f"{spec['prog']}: error: {said}")
  os.kill(spec["pid"], signal.SIGKILL)
