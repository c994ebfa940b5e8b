"""What the test scripts record of a call that should be refused: its one-line message."""
import tfdp


def one_line(fn) -> str:
  """The TfdpError message `fn()` raises, or "no error"."""
  try:
    fn()
  except tfdp.TfdpError as e:
    return str(e)
  return "no error"
