"""One exception type for every mistake a user can fix: apps print it as one line."""


class TfdpError(Exception):
  """A user-fixable problem. str(error) is one line that names the fix."""

  def __init__(self, message: str):
    super().__init__(" ".join(str(message).split()))


class ConfigError(TfdpError):
  """A config key, type or value is wrong."""


class ClusterError(TfdpError):
  """TF_CONFIG / Slurm cluster description is wrong."""


class DataError(TfdpError):
  """A dataset is missing, unreadable or malformed."""


class OutputError(TfdpError):
  """model_dir cannot be written or holds an incompatible run."""


class Preempted(Exception):
  """Training stopped on SIGTERM/SIGINT after saving a checkpoint; a re-run resumes."""

  def __init__(self, step: int, signum: int):
    super().__init__(f"stopped at step {step} on request (signal {signum}); checkpoint saved, "
                     "re-run the same command to resume")
    self.step = step
    self.exit_code = 128 + signum
