"""The one place that knows where the repository is: its root, configs/ and shipped files.

Everything else asks here, so moving a module never silently breaks a path.
"""
from __future__ import annotations

import os
import shlex

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this file: tfdp/paths.py
CONFIGS = os.path.join(REPO_ROOT, "configs")
SHIPPED_VOCAB = os.path.join(CONFIGS, "vocab", "shakespeare_wordpiece.txt")
BENCHMARKS = os.path.join(REPO_ROOT, "benchmarks")
# The job tfdp-train and tfdp-bench run with no --config_file; TFDP_DEFAULT_CONFIG may name
# another (a site default, the tests').
DEFAULT_JOB = "configs/cifar10_quick.yaml"
# The neutral base a new job starts from; the default job layers airbench's recipe on it.
BASE_JOB = "configs/base.yaml"


def default_job(env=None) -> str:
  env = os.environ if env is None else env
  return env.get("TFDP_DEFAULT_CONFIG") or DEFAULT_JOB


def find_config(path: str) -> str:
  """A config path as given, or else relative to the repository's configs/ folder."""
  if os.path.exists(path):
    return path
  candidate = os.path.join(CONFIGS, os.path.relpath(path, "configs")
                           if path.startswith("configs") else path)
  return candidate if os.path.exists(candidate) else path


def nearest_existing(path: str) -> str:
  """`path`, or its nearest folder above that exists: where a file to be written there meets
  the file system (a file in that place means none can be made below it)."""
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return path


def utf8_conversion(path: str) -> str:
  """The command that converts a file to UTF-8, for an error line. iconv needs the source
  encoding (-f): without it, "illegal input sequence"; latin1 decodes any bytes, so it never
  fails."""
  q = shlex.quote(path)
  return (f"(latin1 is a guess: put its real encoding after -f): iconv -f latin1 -t UTF-8 {q} > "
          f"{q}.tmp && mv {q}.tmp {q}")


def looked_in(path: str) -> str:
  """' (looked in /abs/path)' for a relative path, which is taken from the folder the run
  starts in (the shipped configs' from the repository's root): said where it is not found."""
  return "" if os.path.isabs(os.path.expanduser(path)) else f" (looked in {os.path.abspath(path)})"
