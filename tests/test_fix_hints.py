"""The fix a message or a config comment names is the one that works: iconv with a source
encoding, the watchdog's real exit code, what image_size 0 does, and an unknown model name
with a close match still told about task.model.module."""
import inspect
import re
import subprocess

import pytest

from tfdp import config as config_lib
from tfdp import errors
from tfdp.config import schema
from tfdp.errors import ConfigError, DataError
from tfdp.workloads.text import inputs


def test_a_latin1_text_file_is_told_an_iconv_command_that_converts_it(tmp_path):
  # Once "`iconv -t UTF-8`", which without -f fails: "iconv: illegal input sequence".
  path = tmp_path / "old.md"
  path.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
  with pytest.raises(DataError) as excinfo:
    inputs.read_text_file(str(path))
  message = str(excinfo.value)
  assert "latin1 is a guess" in message
  command = message[message.index("iconv -f latin1 -t UTF-8 "):]
  subprocess.run(command, shell=True, check=True)
  assert inputs.read_text_file(str(path)) == "caf\u00e9 cr\u00e8me"


def _comment_of(field: str) -> str:
  """The comment on `field`'s line in schema.py and the comment lines right after it."""
  lines = inspect.getsource(schema).splitlines()
  start = next(i for i, line in enumerate(lines) if re.match(rf"\s+{field}: ", line))
  comment = [lines[start].split("#", 1)[1]]
  for line in lines[start + 1:]:
    if not line.strip().startswith("#"):
      break
    comment.append(line.strip()[1:])
  return " ".join(comment)


def test_the_watchdog_comment_names_its_exit_code():
  # Once "exits with code 75": the watchdog exits with errors.EXIT_RESTART_GROUP (203).
  comment = _comment_of("watchdog_seconds")
  codes = re.findall(r"code (\d+)", comment)
  assert codes == [str(errors.EXIT_RESTART_GROUP)], comment


def test_the_image_size_comment_says_what_0_does_for_an_image_folder():
  # Once "0 keeps the source size": an image folder is resized to its first image's size.
  comment = _comment_of("image_size")
  assert "image_folder" in comment and "first image" in comment, comment


def test_an_unknown_model_with_a_close_match_is_also_told_about_task_model_module():
  # Once only "Did you mean 'small_cnn'?": a model of one's own was not mentioned.
  with pytest.raises(ConfigError) as excinfo:
    config_lib.load_config([], ["task.model.name=my_cnn"])
  message = str(excinfo.value)
  assert "Did you mean 'small_cnn'?" in message
  assert "name its module in task.model.module" in message
