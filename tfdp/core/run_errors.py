"""What a TensorFlow error that stops a run means to the user, in one line: a lost peer worker,
an example that cannot be decoded, or a batch the model or its loss rejects."""
from __future__ import annotations

import contextlib
import re

from tfdp.errors import DataError, GroupMustRestart

# What TF's decoders and parsers say; any other InvalidArgumentError comes from the model or
# its loss (a label outside the classes, a shape the model does not take).
_DECODING = re.compile(r"decod|image|png|jpe?g|gif|bmp|pars|feature|record|utf-?8|corrupt|"
                       r"truncat|compress", re.IGNORECASE)


def peer_errors() -> tuple:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError,
          tf.errors.AbortedError, tf.errors.InternalError)


def data_errors() -> tuple:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return (tf.errors.InvalidArgumentError, tf.errors.DataLossError)


def op_error_line(message: str) -> str:
  """The op's own words in a graph error: not its "Graph execution error:" header, the Python
  stack of where the op was defined, or the node names."""
  for line in message.splitlines():
    line = re.sub(r"^\(\d+\) [A-Z_]+:\s*", "", line.strip())  # "(0) INVALID_ARGUMENT: ..."
    # tf.data's prefix names the iterator chain, which pushed the op's words past 200 characters
    line = re.sub(r"^Error in user-defined function passed to \S+ transformation with "
                  r"iterator: \S+: ", "", line)
    if line and not line.startswith(("Graph execution error", "Detected at node", "File \"",
                                     "[[", "<stack traces")) and not re.match(r"\d+ root error",
                                                                              line):
      return line[:200]
  return message.strip().splitlines()[0][:200] if message.strip() else ""


@contextlib.contextmanager
def peer_loss_restarts_the_group(is_multi_worker: bool):
  """A multi-worker group's TF errors that mean a peer is gone, whether building (the initial
  variables' broadcast, a restore) or training (a collective): one line and the code a
  scheduler retries (203), never a traceback and exit 1, which Kubeflow takes as final."""
  try:
    yield
  except peer_errors() as e:
    if not is_multi_worker:
      raise
    raise lost_peer(e) from None


def lost_peer(error) -> GroupMustRestart:
  return GroupMustRestart(
      f"lost a peer worker ({type(error).__name__}: {error.message.splitlines()[0][:200]}); the "
      "group must restart: tfdp-launch --max_restarts does, or re-run every worker to resume "
      "from the last checkpoint.")


def bad_data(error, culprit: str | None) -> DataError:
  """`culprit`: the file a source found unreadable on its own (tf.data's errors name none)."""
  said = f"{type(error).__name__}: {op_error_line(error.message)}"
  sizes = re.search(r"DecodeImage (\[\d+,\d+,\d+\]) is not compatible with expected shape "
                    r"(\[(\d+),\d+,\d+\])", said)
  if sizes:  # a probe: TFRecords of two image sizes were told to fix the data and re-run
    return DataError(f"the data holds images of other sizes: one is {sizes.group(1)} where the "
                     f"first was {sizes.group(2)}; set task.*_data.image_size to resize every "
                     f"image to one size (e.g. {sizes.group(3)}), then re-run.")
  if culprit or _DECODING.search(said) or type(error).__name__ == "DataLossError":
    return DataError(f"an input example could not be decoded: {culprit or said}; replace or "
                     "remove it, then re-run (it resumes from the last checkpoint, if any).")
  return DataError(f"a batch was rejected by the model or its loss ({said}); check the data "
                   "against the model (labels within its classes, input shapes), then re-run "
                   "(it resumes from the last checkpoint, if any).")
