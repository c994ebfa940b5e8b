"""One exception type for every mistake a user can fix: apps print it as one line.

Exit codes are what a scheduler (Kubeflow's `restartPolicy: ExitCode`, Slurm) and tfdp-launch
act on. The training operator retries a pod whose code is 128 or more and fails the job on 1-127
(kubeflow/training-operator pkg/util/train/train_util.go, IsRetryableExitCode), so:
  2    a bad config, input or model_dir: permanent, a restart would fail the same way.
  143  stopped by SIGTERM after saving a checkpoint (128 + signal, see Preempted): retryable.
  203  the group must restart (a peer was lost): retryable. Above every 128 + signal code, so it
       never reads as a signal (128 + EX_TEMPFAIL, 75).
  204  stopped with its group after a checkpoint, on a peer's SIGTERM: retryable, and not the
       worker that was asked (tfdp-launch blames the 143, not this one).
"""

import contextlib
import dataclasses
import re
import signal

EXIT_PERMANENT = 2
EXIT_RESTART_GROUP = 203
EXIT_PEER_STOPPED = 204


def is_permanent_failure(code: int, last_lines) -> bool:
  """A worker that will fail the same way after a restart: exit 2, or a script's uncaught
  TfdpError of a permanent kind, which Python exits with 1 (a probe: a tfdp.fit script refused
  for its seeds was restarted --max_restarts times into the same error)."""
  return code == EXIT_PERMANENT or code == 1 and _uncaught_permanent(last_lines) is not None


def _uncaught_permanent(last_lines) -> str | None:
  """The traceback's last line naming a permanent TfdpError (`tfdp.errors.ConfigError: ...`)."""
  kinds = [kind.__name__ for kind in _subclasses(TfdpError) if kind.exit_code == EXIT_PERMANENT]
  return next((line for line in reversed(list(last_lines)) if re.match(
      rf"\s*(?:\[w\d+\] )?tfdp\.errors\.(?:{'|'.join(kinds)}): ", line)), None)


def _subclasses(kind) -> list:
  return [kind] + [sub for child in kind.__subclasses__() for sub in _subclasses(child)]


def permanent_failure_line(worker: int, code: int, tail) -> str:
  said = next((line for line in reversed(list(tail)) if ": error: " in line),
              None) or _uncaught_permanent(tail)
  how = (f"exited with code {EXIT_PERMANENT}" if code == EXIT_PERMANENT else
         "raised a tfdp error (exit 1)")
  return (f"error: worker {worker} {how} (a bad config, input or model_dir; a restart would "
          "fail the same way), so the group is not restarted"
          + (f": {' '.join(said.split())}" if said else "."))


def is_retryable_exit_code(code: int) -> bool:
  """The training operator's rule, which tfdp-launch follows too (a signal's death, Popen's
  negative code, is retryable like 128 + signal)."""
  return code < 0 or code >= 128


class StopSignals:
  """The signals that asked a process to stop, in order. The same signal again within
  ONE_DELIVERY seconds is one request delivered twice (GNU timeout signals its child and then
  the group), not "asked twice", which would skip the stop checkpoint."""

  ONE_DELIVERY = 1.0

  def __init__(self):
    self.signals: list[int] = []
    self._last = 0.0

  def add(self, signum: int, now: float) -> bool:
    """Records `signum`; False when it repeats the last one within ONE_DELIVERY seconds."""
    if self.signals and self.signals[-1] == signum and now - self._last < self.ONE_DELIVERY:
      return False
    self.signals.append(signum)
    self._last = now
    return True


@dataclasses.dataclass(frozen=True)
class Terms:
  """A fix said in the words of whoever asked: tfdp-train's flags (CLI), or the arguments of
  tfdp.train or tfdp.fit, which set theirs for their run (`speaking_as`). The library's
  messages read `terms()`."""
  caller: str  # what the user called: the start of a library function's one-line errors
  model_dir: str
  start_over: str  # the way to train from step 0 instead of resuming, a whole clause
  overrides: str
  config_files: str
  moved_aside: str  # % (model_dir, where): said when a fresh run moved the earlier one aside
  preempted: str  # where a stop's checkpoint is and how to resume; {model_dir} filled in
  # after a loss or weights turned non-finite: the recipe's knobs, which tfdp.fit's compile() owns
  diverged_fix: str = ("Lower trainer.learning_rate.base_lr (or raise warmup_epochs), or set "
                       "trainer.stop_on_nan=false to train on regardless")
  # examples of varying shapes: where they get one (the task's preprocess, or the user's data)
  fixed_shapes_fix: str = "pad or truncate them in the task's preprocess"
  mode: str = "--mode"  # what chooses train, eval or train_and_eval
  evaluate_it: str = "--mode=eval evaluates it"  # a finished run's evaluation
  data_order: str = "task.train_data.shuffle, shuffle_buffer or cache"  # what orders the data
  # workers whose trainer.seed differs where it is not a config file's (tfdp.fit: Keras's seed)
  workers_seed_fix: str = ""
  # workers whose config (of which the data's sizes) or data differ: what each must be given
  workers_config_fix: str = "start every worker with the same config files, overrides and {}"
  workers_data_fix: str = ("every worker must read the same data: make the task.*_data paths "
                           "name the same files on every host, then restart the group")


START_OVER_DOES = "to move the earlier run aside (nothing is deleted) and train from step 0"
CLI = Terms("tfdp-train", "--model_dir", f"pass --start_over {START_OVER_DOES}",
            "--params_override", "--config_file",
            "--start_over: the earlier run in %s was moved to %s",
            "checkpoint saved, re-run the same command to resume")
_terms = CLI


def checkpoint_kept(step: int | None, intact: bool = False) -> str:
  """What a failure leaves of the run: its last good checkpoint (`intact`: said where the
  failure could have touched it), or that none was saved yet."""
  if step is not None:
    return f"the last good checkpoint (step {step}) {'is intact' if intact else 'is kept'}"
  return "no checkpoint had been saved yet" if intact else "no checkpoint was saved"


def terms() -> Terms:
  return _terms


def as_caller(text: str) -> str:
  """`text` said by the function the user called: "tfdp.fit: ...", "tfdp.evaluate: ..."."""
  return f"{_terms.caller}: {text}"


@contextlib.contextmanager
def speaking_as(caller_terms: Terms):
  """The library's messages in `caller_terms` while a run in this process lasts; an error that
  reaches the caller starts with what they called ("tfdp.fit: ..."), as tfdp-train's start
  with "tfdp-train: error:"."""
  global _terms
  before, _terms = _terms, caller_terms
  try:
    yield
  except TfdpError as error:
    said = str(error)
    if not re.match(r"tfdp[.-]\w+:", said):  # not already said as a tfdp function or app
      error.args = (as_caller(said),)
    raise
  finally:
    _terms = before


class TfdpError(Exception):
  """A user-fixable problem. str(error) is one line that names the fix."""

  exit_code = EXIT_PERMANENT
  MAX_LENGTH = 1000  # an error line stays readable whatever value it quotes

  def __init__(self, message: str):
    line = " ".join(str(message).split())
    if len(line) > self.MAX_LENGTH:
      line = line[:self.MAX_LENGTH - 25] + " ... (message shortened)"
    super().__init__(line)


class ConfigError(TfdpError):
  """A config key, type or value is wrong."""


class ClusterError(TfdpError):
  """TF_CONFIG / Slurm cluster description is wrong."""


class GroupMustRestart(ClusterError):
  """A peer worker was lost: this worker cannot go on alone, a restarted group resumes."""

  exit_code = EXIT_RESTART_GROUP


class DataError(TfdpError):
  """A dataset is missing, unreadable or malformed."""


class OutputError(TfdpError):
  """model_dir cannot be written or holds an incompatible run."""


class TrainingDiverged(TfdpError):
  """The loss became non-finite; nothing was saved after the last good checkpoint. Where a
  loss or metric did, `epoch` (0-based), `step` and `row` (the epoch's train_* values so far)."""

  epoch: int | None = None
  step: int | None = None
  row: dict = {}


class Preempted(Exception):
  """Training stopped on SIGTERM/SIGINT after saving a checkpoint; a re-run resumes. `said`:
  where the checkpoint is and how to resume from it, in the caller's terms (Terms.preempted)."""

  def __init__(self, step: int, signum: int, said: str = CLI.preempted, why: str = "",
               by_peer: bool = False):
    """`why`: what asked (e.g. "a peer's SIGTERM"); by default the signal's name. `by_peer`:
    stopped with its group, not asked itself (exit 204, which tfdp-launch does not blame)."""
    super().__init__(f"stopped at step {step} on {why or signal.Signals(signum).name}; {said}")
    self.step = step
    self.exit_code = EXIT_PEER_STOPPED if by_peer else 128 + signum
