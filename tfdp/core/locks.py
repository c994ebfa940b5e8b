"""Who may write where: one run per model_dir (the chief's flock on model_dir/.lock), and the
temp dirs non-chief workers save into, each locked by its worker while it lives."""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import tempfile
import time

from absl import logging

from tfdp import errors
from tfdp.errors import OutputError

LOCK_FILE = ".lock"  # flock'ed by the process that writes the folder; the file outlives it
WORKER_DIR_PATTERN = re.compile(r"tfdp-worker\d+-pid(\d+)-")
MAKING = ".making-"  # a worker dir's name until it is locked


# ---- one run per model_dir ----------------------------------------------------------------------
# Two runs in one model_dir (an orphaned group and its relaunch, or a typo) would overwrite each
# other's checkpoints and metrics. The chief holds an exclusive flock on model_dir/.lock until the
# run ends: the kernel drops it when the process dies, however it dies, so a crash never blocks
# a restart and there is no stale lock to break. (flock works on NFSv4 and Lustre as a POSIX
# lock; a file system without locks at all cannot protect the folder.)

_HELD_LOCKS: dict[str, int] = {}  # model_dir -> this process's locked fd (tfdp.fit runs again)
_LOCK_RETRY_SECONDS = 1.0  # another start's check_not_in_use holds a shared lock for microseconds


def _in_use_error(model_dir: str, fd: int) -> OutputError:
  try:
    holder = os.pread(fd, 512, 0).decode("utf-8", "replace").split()
  except OSError:
    holder = []
  fields = dict(item.split("=", 1) for item in holder if "=" in item)
  pid, host = fields.get("pid", ""), fields.get("host", "")
  stale = host == socket.gethostname() and pid.isdigit() and not _pid_alive(int(pid))
  who = ("a run that is starting: its pid and host are written once its checks pass"
         if not pid or stale else f"pid {pid} on host {host}, started {fields.get('since', '?')}")
  return OutputError(f"{errors.terms().model_dir} '{model_dir}' is in use by another tfdp run "
                     f"({who}); two runs in one folder overwrite each other's checkpoints and "
                     "metrics: wait for it to end or stop it, or choose another "
                     f"{errors.terms().model_dir}.")


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:
    return True  # another user's process
  return True


def check_not_in_use(model_dir: str) -> None:
  """Refuses a model_dir another live run holds, creating nothing (a preflight check)."""
  path = os.path.join(model_dir, LOCK_FILE)
  if model_dir in _HELD_LOCKS or not os.path.isfile(path):
    return
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
  except OSError:
    return  # unreadable or gone: lock_model_dir decides
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
      raise _in_use_error(model_dir, fd) from None
    fcntl.flock(fd, fcntl.LOCK_UN)
  finally:
    os.close(fd)


def lock_model_dir(model_dir: str) -> None:
  """Takes model_dir/.lock for this process (kept until release_model_dir or exit) and writes
  who holds it; refuses in one line naming the holder's pid and host."""
  if model_dir in _HELD_LOCKS:
    return
  path = os.path.join(model_dir, LOCK_FILE)
  try:
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
      _CREATED.add(model_dir)  # a start that fails removes it again: the folder as it was
    except FileExistsError:
      fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
  except OSError as e:
    raise OutputError(f"cannot open the run lock '{path}' ({e.strerror}); "
                      f"{errors.terms().model_dir} must be a folder you can write to.") from None
  deadline = time.monotonic() + _LOCK_RETRY_SECONDS
  while True:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      break
    except BlockingIOError:
      if time.monotonic() >= deadline:
        error = _in_use_error(model_dir, fd)
        os.close(fd)
        raise error from None
      time.sleep(0.05)
    except OSError as e:  # a file system without locks (some FUSE mounts): say so, train on
      os.close(fd)
      logging.warning("%s cannot be locked (%s): nothing stops a second run from writing "
                      "this model_dir at the same time", path, e.strerror)
      return
  _HELD_LOCKS[model_dir] = fd


_RECORDED: set[str] = set()  # model_dirs whose lock file names this process
_CREATED: set[str] = set()  # model_dirs whose lock file this process created


def record_lock_holder(model_dir: str) -> None:
  """Writes this process's pid and host into the held lock, once every check has passed (a
  start that fails leaves the file's bytes as they were)."""
  fd = _HELD_LOCKS.get(model_dir)
  if fd is None or model_dir in _RECORDED:
    return
  holder = (f"pid={os.getpid()} host={socket.gethostname()} "
            f"since={time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n").encode()
  os.ftruncate(fd, 0)
  os.pwrite(fd, holder, 0)
  _RECORDED.add(model_dir)


def release_model_dir(model_dir: str) -> None:
  fd = _HELD_LOCKS.pop(model_dir, None)
  if fd is None:
    return
  if model_dir in _RECORDED:
    _RECORDED.discard(model_dir)
    with contextlib.suppress(OSError):
      os.ftruncate(fd, 0)  # nobody holds it now
  elif model_dir in _CREATED:  # a start that failed its checks: leave the folder as it was
    with contextlib.suppress(OSError):
      os.unlink(os.path.join(model_dir, LOCK_FILE))
  _CREATED.discard(model_dir)
  os.close(fd)  # a used lock file stays: unlinking it would let two runs lock two files


# A worker's temp dir is live while its .lock is flock'ed (held until the worker exits): a pid
# alone cannot say so, for a live group in another pid namespace (a container sharing /tmp) has
# pids this one cannot see, and a dead worker's pid may be reused by an unrelated process.
_WORKER_DIR_LOCKS: dict[str, int] = {}


def make_worker_dir(rank: int) -> str:
  """Made and locked under a name the sweep ignores, then renamed: no other worker ever sees
  it unlocked."""
  name = f"tfdp-worker{rank}-pid{os.getpid()}-"
  making = tempfile.mkdtemp(prefix=f"{MAKING}{name}")
  fd = os.open(os.path.join(making, LOCK_FILE),
               os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
  fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh file: nobody else holds it
  write_dir = os.path.join(os.path.dirname(making), os.path.basename(making)[len(MAKING):])
  os.rename(making, write_dir)
  _WORKER_DIR_LOCKS[write_dir] = fd
  return write_dir


def release_worker_dir(write_dir: str) -> None:
  fd = _WORKER_DIR_LOCKS.pop(write_dir, None)
  if fd is not None:
    os.close(fd)


def remove_stale_worker_dirs() -> None:
  """A killed worker cannot remove its temp dir; the next worker on this machine does, if no
  live process holds the dir's lock."""
  import psutil  # pylint: disable=g-import-not-at-top
  root = tempfile.gettempdir()
  for name in os.listdir(root):
    making = name.startswith(MAKING)  # a worker killed before its rename left it so
    match = WORKER_DIR_PATTERN.match(name[len(MAKING):] if making else name)
    path = os.path.join(root, name)
    if not match or path in _WORKER_DIR_LOCKS:
      continue
    if making:  # made, locked and renamed within microseconds (its lock is taken after the file
      # is made, so it is no sign): one still here after a minute was left by a kill
      if _older_than(path, 60):
        shutil.rmtree(path, ignore_errors=True)
      continue
    try:
      fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:  # an older tfdp's dir (no lock): judged by its pid
      if not psutil.pid_exists(int(match.group(1))):
        shutil.rmtree(path, ignore_errors=True)
      continue
    except OSError:
      continue  # not ours to judge (another user's, not a folder)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)  # a live worker's, in whatever pid namespace
      continue
    try:
      shutil.rmtree(path, ignore_errors=True)
    finally:
      os.close(fd)


def _older_than(path: str, seconds: float) -> bool:
  try:
    return time.time() - os.stat(path).st_mtime > seconds
  except OSError:
    return False
