"""One exception type for every mistake a user can fix: apps print it as one line."""


class TfdpError(Exception):
  """A user-fixable problem. str(error) is one line that names the fix."""

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


class DataError(TfdpError):
  """A dataset is missing, unreadable or malformed."""


class OutputError(TfdpError):
  """model_dir cannot be written or holds an incompatible run."""


class TrainingDiverged(TfdpError):
  """The loss became non-finite; nothing was saved after the last good checkpoint."""


class Preempted(Exception):
  """Training stopped on SIGTERM/SIGINT after saving a checkpoint; a re-run resumes."""

  def __init__(self, step: int, signum: int):
    super().__init__(f"stopped at step {step} on request (signal {signum}); checkpoint saved, "
                     "re-run the same command to resume")
    self.step = step
    self.exit_code = 128 + signum
