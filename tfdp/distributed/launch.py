"""Local multi-process launcher: N copies of a command, one TF_CONFIG each.

`launch` starts the group, prefixes each worker's output with `[wI] `, stops the whole group as
soon as one worker fails (an all-reduce peer would otherwise block until its gRPC timeout), and
optionally reruns the group; the training app resumes from its own checkpoint, the launcher only
reruns the same command.

GPUs: each worker its own CUDA_VISIBLE_DEVICES (gpus.py), or each would plan NCCL over all.

Network exposure (TensorFlow 2.21): MultiWorkerMirroredStrategy's gRPC server listens on every
interface whatever host TF_CONFIG names (GrpcServer::Init in grpc_server_lib.cc hard-codes
`AddListeningPort("0.0.0.0:" + port)`, opened dual-stack; ServerDef's `port` and the TF_GRPC_*
variables cannot bind it to 127.0.0.1 only). So a local group runs in a private network namespace
(isolation.py: loopback only) wherever the kernel allows it; elsewhere, and with allow_remote, its
ports are reachable while training runs. The launcher writes loopback addresses and refuses other
hosts without allow_remote.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from tfdp import errors
from tfdp.distributed import elastic
from tfdp.distributed import gpus as gpus_lib
from tfdp.distributed import isolation
from tfdp.distributed import slurm
from tfdp.distributed.isolation import is_loopback_host, pick_free_ports  # noqa: F401 (API)
from tfdp.errors import (EXIT_PEER_STOPPED, EXIT_PERMANENT, EXIT_RESTART_GROUP, ClusterError,
                         TfdpError)

TAIL_LINES = 20
NOT_TO_BLAME = (EXIT_RESTART_GROUP, EXIT_PEER_STOPPED)  # lost a peer; stopped with its group
DEFAULT_STOP_GRACE_SECONDS = 30.0  # Room for a worker to finish a checkpoint.
# After a worker died its peers cannot finish a step (the all-reduce lacks a member), so there is
# no checkpoint to wait for; TF may take its heartbeat timeout to notice. Do not wait that long.
PEER_FAILURE_GRACE_SECONDS = 3.0
GRACEFUL_STOP_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT)  # a worker's stop on request
LOST_PEER_WAIT_SECONDS = 1.0  # how long a 203 waits for the failure that caused it
# A worker stopped (SIGSTOP, a debugger, job control) this long counts as failed. The process
# state says "stopped" only then, never for a busy or slow worker, so a short wait is safe.
FROZEN_WORKER_SECONDS = 5.0
_STATE_POLL_SECONDS = 0.5
# More local workers than this per core is a typo, not a job (each is a TensorFlow process).
WORKERS_PER_CORE_LIMIT = 4
_POLL_SECONDS = 0.05
_BIND_RETRIES = 3  # reruns after a worker could not bind its port
_DRAIN_SECONDS = 2.0  # How long to wait for output after every worker exited.
_MAX_PARTIAL_LINE = 64 * 1024  # Emit over-long lines rather than buffer them.


def check_stop_grace_seconds(seconds: float) -> None:
  # nan compares false with every deadline: a stuck worker would never be SIGKILLed.
  if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
    raise TfdpError(f"--stop_grace_seconds must be a finite number of seconds, 0 or more, got "
                    f"{seconds}; e.g. --stop_grace_seconds={DEFAULT_STOP_GRACE_SECONDS:g}.")


def _format_address(host: str, port: int) -> str:
  host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # --host=[::1]
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def worker_tf_configs(num_workers: int, host: str,
                      ports: Sequence[int]) -> list[str]:
  """TF_CONFIG JSON for each worker; worker 0 is the chief by TF's rule."""
  if len(ports) != num_workers:
    raise ValueError(f"need {num_workers} ports, got {len(ports)}")
  addresses = [_format_address(host, port) for port in ports]
  return [
      json.dumps({"cluster": {"worker": addresses},
                  "task": {"type": "worker", "index": index}})
      for index in range(num_workers)
  ]


def describe_returncode(returncode: int | None) -> str:
  """'exited with code 3' / 'was killed by signal SIGKILL' / 'is running'."""
  if returncode is None:
    return "is still running"
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:
      name = str(-returncode)
    return f"was killed by signal {name}"
  return f"exited with code {returncode}"


@dataclasses.dataclass
class GroupResult:
  """What happened to one run of the worker group.

  Attributes:
    returncodes: Per worker, as Popen reports it (negative = killed by signal).
    pids: Per worker process id (each is also its process group id).
    ports: The ports the workers were given.
    first_failed: Index of the worker blamed: the first seen failing, a real failure before a
      203 (lost a peer) seen with it or just before it; or None.
    last_lines: Per worker, its last TAIL_LINES output lines.
    interrupted_by: Signal number if the launcher itself was told to stop.
    duration_seconds: From starting the workers until the last one exited.
    stop_seconds: From the first failure (or interrupt) to all workers gone.
    gpus: Per worker CUDA_VISIBLE_DEVICES, or None if the workers inherited the launcher's.
  """

  returncodes: list[int | None]
  pids: list[int]
  ports: list[int]
  first_failed: int | None = None
  last_lines: list[list[str]] = dataclasses.field(default_factory=list)
  interrupted_by: int | None = None
  duration_seconds: float = 0.0
  stop_seconds: float | None = None
  gpus: list[str] | None = None
  frozen: int | None = None  # the worker found stopped for FROZEN_WORKER_SECONDS

  @property
  def ok(self) -> bool:
    return self.interrupted_by is None and self.frozen is None and all(
        code == 0 for code in self.returncodes)

  def exit_code(self) -> int:
    """The blamed worker's code (128+N for a signal N; 137 for a frozen one, which the launcher
    killed), so a scheduler tells retryable from permanent; 1 where none is blamed."""
    if self.frozen is not None:
      return 128 + signal.SIGKILL
    code = None if self.first_failed is None else self.returncodes[self.first_failed]
    return 1 if not code else 128 - code if code < 0 else code

  def failure_summary(self) -> str:
    """One line naming the failed worker and how it ended ('' if ok)."""
    if self.interrupted_by is not None:
      return f"launcher got {signal.Signals(self.interrupted_by).name}; stopped all workers"
    if self.first_failed is None:
      return ""
    if self.frozen is not None:
      return f"worker {self.frozen} was frozen (stopped for {FROZEN_WORKER_SECONDS:.0f}s or more)"
    code = self.returncodes[self.first_failed]
    return f"worker {self.first_failed} {describe_returncode(code)}"


class _Worker:
  """One child process plus the bookkeeping for its output."""

  def __init__(self, index: int, popen: subprocess.Popen):
    self.index = index
    self.popen = popen
    self.pgid = popen.pid  # start_new_session=True: pid == its group id.
    self.partial = b""
    self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    self.output_closed = False
    self.returncode: int | None = None
    self.stopped_since: float | None = None


def _signal_group(worker: _Worker, signum: int) -> None:
  try:
    os.killpg(worker.pgid, signum)
  except (ProcessLookupError, PermissionError):
    pass  # The whole group is already gone.


class _StopRequest(errors.StopSignals):
  """Signals that asked the launcher to stop, recorded by the handler."""

  def handler(self, signum, frame) -> None:
    del frame
    self.add(signum, time.monotonic())


def _stopped_workers(workers: list[_Worker], now: float) -> list[_Worker]:
  """Running workers whose process tree has a stopped process (state T), with when it was
  first seen stopped; a worker that runs again is forgiven."""
  import psutil  # pylint: disable=g-import-not-at-top
  stopped = []
  for worker in workers:
    if worker.returncode is not None:
      continue
    try:
      root = psutil.Process(worker.popen.pid)
      tree = [root, *root.children(recursive=True)]
      is_stopped = any(p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
                       for p in tree)
    except psutil.Error:
      is_stopped = False  # exited meanwhile: the exit code will tell
    if not is_stopped:
      worker.stopped_since = None
      continue
    worker.stopped_since = worker.stopped_since or now
    stopped.append(worker)
  return stopped


def _start_workers(command: Sequence[str], tf_configs: Sequence[str],
                   base_env: Mapping[str, str], gpus: Sequence[str] | None,
                   network: isolation.PrivateNetwork | None = None,
                   slots: Sequence[int] | None = None) -> list[_Worker]:
  workers: list[_Worker] = []
  lifeline_fd, lifeline = isolation.lifeline()
  base_env = dict(base_env, **{isolation.LIFELINE_VAR: lifeline})
  base_env.setdefault("PYTHONUNBUFFERED", "1")  # a pipe is block-buffered: lines come promptly
  try:
    for index, tf_config in enumerate(tf_configs):
      worker_env = dict(base_env, TF_CONFIG=tf_config, TFDP_WORKER_INDEX=str(index),
                        TFDP_NUM_WORKERS=str(len(tf_configs)),
                        TFDP_WORKER_SLOT=str(index if slots is None else slots[index]))
      if gpus is not None:
        worker_env.update({"CUDA_VISIBLE_DEVICES": gpus[index],
                           gpus_lib.ASSIGNED_BY_VAR: "tfdp-launch"})
      popen = subprocess.Popen(  # the shim joins `network` and sets PDEATHSIG, then execs
          isolation.worker_command(command, network), env=worker_env, stdin=subprocess.DEVNULL,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(lifeline_fd,),
          start_new_session=True)  # Own group: we can kill its children too.
      workers.append(_Worker(index, popen))
  except OSError as error:
    for worker in workers:
      _signal_group(worker, signal.SIGKILL)
      worker.popen.wait()
      worker.popen.stdout.close()
    raise TfdpError(f"cannot start worker command {command[0]!r}: "
                    f"{error.strerror or error}") from None
  return workers


def _emit_lines(worker: _Worker, data: bytes, output: TextIO, final: bool = False) -> None:
  worker.partial += data
  *lines, worker.partial = worker.partial.split(b"\n")
  if (final and worker.partial) or len(worker.partial) > _MAX_PARTIAL_LINE:
    lines, worker.partial = lines + [worker.partial], b""
  for raw in lines:
    line = raw.decode("utf-8", errors="replace").rstrip("\r")
    worker.tail.append(line)
    try:
      output.write(f"[w{worker.index}] {line}\n")
    except (OSError, ValueError):
      pass  # Our own stdout went away; keep supervising the workers.


def _flush(output: TextIO) -> None:
  try:
    output.flush()
  except (OSError, ValueError):
    pass  # Same as above: a closed stdout must not abandon the workers.


def run_group(command: Sequence[str], num_workers: int,
              host: str = "127.0.0.1", env: Mapping[str, str] | None = None,
              stop_grace_seconds: float = DEFAULT_STOP_GRACE_SECONDS,
              output: TextIO | None = None, gpus_per_worker: int | str = gpus_lib.AUTO,
              private_network: bool = True, slots: Sequence[int] | None = None) -> GroupResult:
  """Runs `num_workers` copies of `command` until all exit or one fails.

  Each worker gets TF_CONFIG (worker type, its own index, fresh free ports on `host`),
  TFDP_WORKER_INDEX, TFDP_NUM_WORKERS, TFDP_WORKER_SLOT, its own GPUs in CUDA_VISIBLE_DEVICES
  (gpus.plan_worker_gpus; one stderr line says which), and runs in its own process group. Its
  merged stdout/stderr is printed line by line as `[wI] line`.

  When a worker exits non-zero or dies by a signal (an exit 203, lost a peer, waits up to
  LOST_PEER_WAIT_SECONDS for the failure that caused it, which is then `first_failed`), or this
  process gets SIGINT/SIGTERM, every other worker group gets SIGTERM, then SIGKILL after
  `stop_grace_seconds` (a second SIGINT/SIGTERM skips the wait). Before returning, every
  worker's process group is SIGKILLed so that nothing the workers spawned outlives the launcher.

  Args:
    command: The worker command, e.g. [sys.executable, "apps/train.py", ...].
    num_workers: How many workers to start (>= 1).
    host: Address written into TF_CONFIG (see module docstring on exposure).
    env: Base environment for the workers; defaults to os.environ.
    stop_grace_seconds: Time between SIGTERM and SIGKILL when stopping.
    output: Where prefixed lines go; defaults to sys.stdout at call time.
    gpus_per_worker: 'auto'/-1 (split the visible GPUs evenly; without GPUs the env is left
      as it is), 0 (CPU only) or N GPUs per worker.
    private_network: run the group in a private network namespace, loopback only
      (isolation.py), where the kernel allows it; else one warning line.
    slots: per worker, its index in the full group (TFDP_WORKER_SLOT), default the index.

  Returns:
    A GroupResult; `.ok` is True only if every worker exited 0.

  Raises:
    TfdpError: bad arguments, too few GPUs for the workers (ClusterError), or a command that
      cannot be started.
  """
  if num_workers < 1:
    raise TfdpError(f"num_workers must be at least 1, got {num_workers}.")
  if not command:
    raise TfdpError("no worker command given.")
  check_stop_grace_seconds(stop_grace_seconds)
  output = output or sys.stdout
  base_env = os.environ if env is None else env
  gpu_plan = gpus_lib.plan_worker_gpus(num_workers, gpus_per_worker, base_env,
                                       gpus_lib.count_nvidia_device_files())
  if gpu_plan.describe():
    _log(gpu_plan.describe())
  _check_command(command, base_env)
  ports = pick_free_ports(num_workers, host)
  network = isolation.open_network(num_workers, ports, private_network)
  stop_request = _StopRequest()
  # Handlers can only be installed from the main thread; elsewhere the caller owns signals.
  in_main_thread = threading.current_thread() is threading.main_thread()
  previous_handlers = {}
  if in_main_thread:
    for signum in (signal.SIGINT, signal.SIGTERM):
      previous_handlers[signum] = signal.signal(signum, stop_request.handler)
  started = time.monotonic()
  workers = []
  try:
    workers = _start_workers(command, worker_tf_configs(num_workers, host, ports), base_env,
                             gpu_plan.devices, network, slots)
    result = _supervise(workers, ports, stop_request, stop_grace_seconds,
                        output, started)
    result.gpus = gpu_plan.devices
    return result
  finally:
    for worker in workers:  # Also covers an exception inside _supervise.
      _signal_group(worker, signal.SIGKILL)
      if worker.popen.poll() is None:
        worker.popen.wait()
      worker.popen.stdout.close()
    if network is not None:
      network.close()
    for signum, handler in previous_handlers.items():
      signal.signal(signum, handler)


def _check_command(command: Sequence[str], env: Mapping[str, str]) -> None:
  # The shim execs the command, so a missing one would surface as a worker exit; say it first.
  if shutil.which(command[0], path=env.get("PATH", os.defpath)) is None:
    raise TfdpError(f"cannot start worker command {command[0]!r}: not found or not "
                    "executable.")


def _supervise(workers: list[_Worker], ports: list[int],
               stop_request: _StopRequest, stop_grace_seconds: float,
               output: TextIO, started: float) -> GroupResult:
  """The event loop behind run_group: relay output, watch exits, stop."""
  result = GroupResult(returncodes=[None] * len(workers),
                       pids=[worker.popen.pid for worker in workers],
                       ports=list(ports))
  selector = selectors.DefaultSelector()
  for worker in workers:
    os.set_blocking(worker.popen.stdout.fileno(), False)
    selector.register(worker.popen.stdout, selectors.EVENT_READ, worker)
  stop_started: float | None = None
  kill_at: float | None = None
  all_exited_at: float | None = None
  killed = False  # SIGKILL was sent after the grace period (or a 2nd signal).
  lost_peer_until: float | None = None
  next_state_check = time.monotonic() + _STATE_POLL_SECONDS

  def begin_stop(now: float, grace_seconds: float) -> None:
    nonlocal stop_started, kill_at
    if stop_started is None:
      stop_started, kill_at = now, now + grace_seconds
      for worker in workers:
        if worker.returncode is None:
          _signal_group(worker, signal.SIGTERM)
          _signal_group(worker, signal.SIGCONT)  # a frozen (SIGSTOPped) worker must see it too

  with selector:
    while True:
      for key, _ in selector.select(timeout=_POLL_SECONDS):
        worker = key.data
        try:
          data = os.read(key.fileobj.fileno(), 65536)
        except BlockingIOError:
          continue
        if data:
          _emit_lines(worker, data, output)
        else:
          _emit_lines(worker, b"", output, final=True)
          selector.unregister(key.fileobj)
          worker.output_closed = True
      _flush(output)
      now = time.monotonic()
      if stop_request.signals:
        if result.interrupted_by is None:  # said at once: a worker may take the grace to save
          result.interrupted_by = stop_request.signals[0]
          if stop_started is None:  # (a stop begun for a failure has its own, shorter, grace)
            _log(f"got {signal.Signals(result.interrupted_by).name}: stopping the workers "
                 f"(SIGKILL after {stop_grace_seconds:g}s, at once on a second signal)")
        begin_stop(now, stop_grace_seconds)
        if len(stop_request.signals) > 1 and not killed:
          kill_at = now  # Asked twice: do not wait for the grace period.
      failed = []
      for worker in workers:
        if worker.returncode is None:
          worker.returncode = result.returncodes[worker.index] = worker.popen.poll()
          failed += [worker.index] * (worker.returncode not in (None, 0))
      # A peer's 203 (lost a peer) can come in the same poll as, or just before, the exit that
      # caused it: a real failure within LOST_PEER_WAIT_SECONDS of the first 203 is to blame.
      real = [i for i in failed if result.returncodes[i] not in NOT_TO_BLAME]
      if stop_started is None and (real or failed and lost_peer_until is None):
        result.first_failed = (real or failed)[0]
        lost_peer_until = now if real else now + LOST_PEER_WAIT_SECONDS
      if stop_started is None and lost_peer_until is not None and now >= lost_peer_until:
        # Stopped on request, a worker saved first and its stop flag has the others saving too.
        begin_stop(now, stop_grace_seconds if result.returncodes[result.first_failed]
                   in GRACEFUL_STOP_CODES else min(stop_grace_seconds, PEER_FAILURE_GRACE_SECONDS))
      if stop_started is None and now >= next_state_check:
        next_state_check = now + _STATE_POLL_SECONDS
        for worker in _stopped_workers(workers, now):
          if now - worker.stopped_since >= FROZEN_WORKER_SECONDS:
            _log(f"worker {worker.index} has been stopped (frozen, e.g. by SIGSTOP) for "
                 f"{now - worker.stopped_since:.0f}s; stopping the group.")
            result.first_failed = result.frozen = worker.index
            begin_stop(now, min(stop_grace_seconds, PEER_FAILURE_GRACE_SECONDS))
            break
      if kill_at is not None and now >= kill_at and not killed:
        for worker in workers:
          if worker.returncode is None:
            _signal_group(worker, signal.SIGKILL)
        killed = True
      if all(worker.returncode is not None for worker in workers):
        if all_exited_at is None:
          all_exited_at = now
          # Leftover grandchildren could hold the pipes open (and run on).
          for worker in workers:
            _signal_group(worker, signal.SIGKILL)
        drained = all(worker.output_closed for worker in workers)
        if drained or now - all_exited_at > _DRAIN_SECONDS:
          break
  for worker in workers:
    if not worker.output_closed:
      _emit_lines(worker, b"", output, final=True)
  _flush(output)
  result.last_lines = [list(worker.tail) for worker in workers]
  result.duration_seconds = all_exited_at - started
  if stop_started is not None:
    result.stop_seconds = all_exited_at - stop_started
  return result


def _log(message: str) -> None:
  print(f"tfdp-launch: {message}", file=sys.stderr, flush=True)


def launch(command: Sequence[str], num_workers: int, max_restarts: int = 0,
           host: str = "127.0.0.1", allow_remote: bool = False, env: Mapping[str, str] | None = None,
           stop_grace_seconds: float = DEFAULT_STOP_GRACE_SECONDS,
           output: TextIO | None = None,
           gpus_per_worker: int | str = gpus_lib.AUTO,
           allow_many_workers: bool = False, min_workers: int | None = None,
           slots_file: str | None = None) -> int:
  """Runs the worker group, rerunning it up to `max_restarts` times, each rerun with fresh ports
  (the old may linger in TIME_WAIT); the workers resume from their checkpoint by themselves.
  Each worker gets `gpus_per_worker` GPUs (see run_group). With `min_workers`, a rerun may have
  fewer workers, down to min_workers (elastic.py's rules; `slots_file` lists those that may start).

  Returns:
    0 if a run succeeded; 128 + signal number if the launcher was interrupted; 2
    (tfdp.errors.EXIT_PERMANENT) at once, without a restart, if a worker exited 2; the blamed
    worker's code (GroupResult.exit_code) if the run failed without max_restarts; 1 if the last
    allowed restart failed or < min_workers can start.

  Raises:
    TfdpError: bad arguments, a non-loopback host without allow_remote, too few GPUs for the
      workers, or a command that cannot be started.
  """
  if num_workers < 1:
    raise TfdpError(f"--num_workers must be at least 1, got {num_workers}.")
  slurm.check_one_launcher(os.environ if env is None else env)
  cores = os.cpu_count() or 1
  if num_workers > WORKERS_PER_CORE_LIMIT * cores and not allow_many_workers:
    raise TfdpError(
        f"--num_workers {num_workers} would start {num_workers} TensorFlow processes on "
        f"{cores} CPU cores (each takes hundreds of MB and needs a core to keep up with the "
        f"all-reduce); use at most {WORKERS_PER_CORE_LIMIT * cores}, or pass "
        "--allow_many_workers if you mean it.")
  if max_restarts < 0:
    raise TfdpError(f"--max_restarts must be 0 or more, got {max_restarts}.")
  check_stop_grace_seconds(stop_grace_seconds)
  gpus_lib.parse_gpus_per_worker(gpus_per_worker)  # A typo fails first.
  if not command:
    raise TfdpError("no worker command given; put it after '--', e.g. "
                    "tfdp-launch --num_workers 2 -- python apps/train.py.")
  if not is_loopback_host(host) and not allow_remote:
    raise ClusterError(
        f"host {host!r} is not a loopback address and the TensorFlow gRPC "
        "servers have no authentication; use 127.0.0.1, or pass "
        "--allow_remote (allow_remote=True) if the network is trusted.")
  if slots_file is not None and min_workers is None:
    raise TfdpError(f"--slots_file needs --min_workers, e.g. --min_workers {num_workers}.")
  members = None if min_workers is None else elastic.Membership(num_workers, min_workers,
                                                                 slots_file)
  restarts = bind_retries = 0
  while True:
    slots = members.slots if members else tuple(range(num_workers))
    # A restarted group resumes: tfdp-train ignores --start_over when this is above 0.
    group_env = dict(os.environ if env is None else env, TFDP_RESTART_COUNT=str(restarts),
                     **(members.env() if members else {}))
    result = run_group(command, len(slots), host=host, env=group_env,
                       stop_grace_seconds=stop_grace_seconds, output=output,
                       gpus_per_worker=gpus_per_worker, private_network=not allow_remote,
                       slots=slots)
    if (not result.ok and result.interrupted_by is None and bind_retries < _BIND_RETRIES
        and isolation.bind_failure(result.last_lines, result.first_failed)):
      # A port taken between picking and binding is not the job's failure: not a restart.
      bind_retries += 1
      _log(f"worker {result.first_failed} could not bind its port; rerunning the group with "
           f"fresh ports (not counted as a restart).")
      continue
    if result.ok:
      if restarts:
        _log(f"all {elastic.workers(len(slots))} finished after {restarts} "
             f"restart{'s' if restarts != 1 else ''}.")
      return 0
    if result.interrupted_by is not None:
      _log(f"{result.failure_summary()} in {result.stop_seconds or 0:.1f}s.")
      return 128 + result.interrupted_by
    permanent = [i for i, code in enumerate(result.returncodes)
                 if errors.is_permanent_failure(code, result.last_lines[i])]
    if permanent:  # a bad config or input: every restart would retrain into the same error
      _log(errors.permanent_failure_line(permanent[0], result.returncodes[permanent[0]],
                                         result.last_lines[permanent[0]]))
      return EXIT_PERMANENT
    if restarts < max_restarts and members:
      restarts += 1
      rank = result.first_failed  # not None: the group failed, and not by an interrupt
      how = "was frozen" if result.frozen is not None else describe_returncode(
          result.returncodes[rank])
      lost_peer = result.frozen is None and result.returncodes[rank] in NOT_TO_BLAME
      try:
        changes = members.after_failure(slots[rank], how, blame=not lost_peer)
      except TfdpError as error:
        _log(f"error: {error}")
        return 1
      _log(f"restart {restarts} of {max_restarts}: {elastic.workers(len(members.slots))} "
           f"({changes}).")
      continue
    if restarts < max_restarts:
      restarts += 1
      _log(f"{result.failure_summary()}; restarting all {num_workers} workers "
           f"with fresh ports (restart {restarts} of {max_restarts}).")
      continue
    failed = result.first_failed
    tail = result.last_lines[failed] if failed is not None else []
    after = (f" after {restarts} restart{'s' if restarts != 1 else ''}"
             if restarts else "")
    said = (f"Last {len(tail)} lines of worker {failed}:" if tail
            else f"Worker {failed} printed nothing.")
    _log(f"{result.failure_summary()}{after}; stopped the other workers in "
         f"{result.stop_seconds or 0:.1f}s. {said}" +
         "".join(f"\n  [w{failed}] {line}" for line in tail))
    # Restarts spent: 1 (a retryable code, restarted for ever); else the scheduler decides.
    return 1 if max_restarts else result.exit_code()
