"""What a run leaves in model_dir, and who writes it: only the chief writes model_dir; other
workers write the checkpoints they must take part in to a private temp dir they remove."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import os
import pathlib
import re
import shlex
import shutil
import stat
import tempfile
import time

from absl import logging

from tfdp.core import locks
from tfdp import errors
from tfdp import paths
from tfdp.errors import OutputError

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.csv"
CHECKPOINT_DIR = "checkpoints"
EXPORT_FILE = "model.keras"
WEIGHTS_FILE = "model.weights.h5"  # the export of a model Keras cannot serialize whole


def resolve_model_dir(model_dir: str) -> str:
  """--model_dir as an absolute path (the same folder for every process, whatever its cwd)."""
  if not model_dir:
    raise OutputError(f"{errors.terms().model_dir} is empty; give a folder for checkpoints and "
                      "metrics.")
  resolved = os.path.abspath(os.path.expanduser(model_dir))
  if "[" in resolved:  # TensorFlow finds a checkpoint's files by glob: `[0]` matches "0" only
    raise OutputError(f"{errors.terms().model_dir} '{resolved}' holds '[', which TensorFlow's "
                      "checkpoint reader takes for a glob pattern: a run there saves checkpoints "
                      f"but can never resume or evaluate them; give a {errors.terms().model_dir} "
                      "whose path has no '[' (lr_0.1 for lr[0.1]); a run saved there resumes once "
                      "its folder is renamed.")
  return resolved


def prepare_model_dir(model_dir: str) -> str:
  """Proves a resolved model_dir can be created and written, creating and touching nothing: a
  start that fails a later check leaves the file system as it was (create_model_dir makes it)."""
  if os.path.exists(model_dir) and not os.path.isdir(model_dir):
    raise OutputError(f"{errors.terms().model_dir} '{model_dir}' is a file; give a folder path.")
  if os.path.isdir(model_dir):
    check_model_dir_owner(model_dir)
    locks.check_not_in_use(model_dir)
  existing = paths.nearest_existing(model_dir)
  if not os.path.isdir(existing):
    raise OutputError(f"{errors.terms().model_dir} '{model_dir}' cannot be created: '{existing}' "
                      "is a file; choose a folder path.")
  try:
    tempfile.NamedTemporaryFile(dir=existing, prefix=".tfdp-write-test-").close()  # made, gone
  except OSError as e:
    raise OutputError(f"{errors.terms().model_dir} '{model_dir}' is not writable ({e.strerror} in "
                      f"'{existing}'); choose a folder you can write to.") from None
  return model_dir


def check_model_dir_owner(model_dir: str) -> None:
  """Whoever else can write model_dir can replace the checkpoints a run restores. The folder
  itself only: its parents are the system's (/tmp is world-writable, and sticky)."""
  info = os.stat(model_dir)
  if info.st_uid != os.geteuid():
    raise OutputError(f"{errors.terms().model_dir} '{model_dir}' belongs to another user (uid "
                      f"{info.st_uid}), who could replace its checkpoints; use a folder of your "
                      "own.")
  if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
    raise OutputError(f"{errors.terms().model_dir} '{model_dir}' is writable by every user, who "
                      f"could replace its checkpoints; run chmod o-w '{model_dir}', or use a "
                      "folder of your own.")


_MADE_DIRS: dict[str, str] = {}  # model_dir → the folder above it that was there before


def create_model_dir(model_dir: str) -> None:
  """Makes model_dir (every input is checked) and locks it for this run's life."""
  try:
    if not os.path.isdir(model_dir):
      existing = paths.nearest_existing(model_dir)
      with contextlib.suppress(FileExistsError):  # another start made it meanwhile: its own
        os.makedirs(model_dir)
        _MADE_DIRS[model_dir] = existing
  except OSError as e:
    raise OutputError(f"{errors.terms().model_dir} '{model_dir}' cannot be created ({e.strerror}); "
                      "choose a folder you can write to.") from None
  locks.lock_model_dir(model_dir)
  _remove_dead_writers_temps(model_dir)


def _remove_dead_writers_temps(model_dir: str) -> None:
  """A process killed mid-write leaves its temp file beside the file it was replacing
  (metrics.csv.tmp-<pid>-<8 random>, .tmp-<pid>-metrics.png): removed once that pid is gone
  (this run holds model_dir's lock)."""
  for name in os.listdir(model_dir):
    found = (re.fullmatch(r"[\w.-]+\.tmp-(\d{1,7})-[a-z0-9_]{8}(\.\w+)?", name)
             or re.fullmatch(r"\.tmp-(\d{1,7})-metrics\.png", name))
    if not found or int(found.group(1)) == os.getpid():
      continue
    try:
      os.kill(int(found.group(1)), 0)
    except ProcessLookupError:
      with contextlib.suppress(OSError):
        os.unlink(os.path.join(model_dir, name))
    except PermissionError:  # alive, another user's
      pass


def start_over_hint() -> str:
  return f"fix or remove it, or {errors.terms().start_over}"


def checkpoint_state(model_dir: str) -> str:
  """TensorFlow's state file naming a run's latest checkpoint: a run has trained if it exists."""
  return os.path.join(model_dir, CHECKPOINT_DIR, "checkpoint")


def latest_checkpoint(model_dir: str) -> str | None:
  """The checkpoint a run in (resolved) model_dir resumes from, or None for a fresh model_dir. Reads
  TensorFlow's `checkpoint` state file itself: tf.train.latest_checkpoint takes an unreadable
  state for "no checkpoint", and a resumed run would then start over and overwrite the old one."""
  return named_checkpoint(os.path.join(model_dir, CHECKPOINT_DIR))


def named_checkpoint(directory: str) -> str | None:
  """The checkpoint that `directory`'s state file names (checked whole), or None where the
  folder holds no checkpoint at all."""
  state = os.path.join(directory, "checkpoint")
  if not os.path.exists(state):
    indexes = glob.glob(os.path.join(glob.escape(directory), "*.index"))  # `[` in paths
    if indexes:
      newest = os.path.basename(max(indexes, key=_step))
      raise OutputError(f"'{directory}' holds checkpoints ({newest}) but no 'checkpoint' state "
                        f"file naming the latest; {_resume_fix(state)}.")
    return None
  try:
    with open(state, "rb") as f:
      text = f.read(1 << 20).decode("utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise OutputError(f"checkpoint state '{state}' cannot be read ({e}); "
                      f"{start_over_hint()}.") from None
  match = re.search(r'^model_checkpoint_path:\s*"([^"\n]+)"\s*$', text, re.MULTILINE)
  if not match:
    raise OutputError(f"checkpoint state '{state}' is not a TensorFlow checkpoint state (no "
                      f"model_checkpoint_path line); {start_over_hint()}.")
  prefix = os.path.join(directory, match.group(1))
  missing = (f"{prefix}.index" if not os.path.isfile(f"{prefix}.index")
             else f"{prefix}.data-*" if not _whole(prefix) else None)
  if missing:
    raise OutputError(f"checkpoint state '{state}' names '{match.group(1)}' but "
                      f"'{missing}' is missing; {_resume_fix(state)}.")
  return prefix


def _step(path: str) -> int:
  """ckpt-34.index → 34 (-1 for a name without one): ckpt-100 is newer than ckpt-34."""
  number = os.path.basename(path).split(".", 1)[0].rpartition("-")[2]
  return int(number) if number.isascii() and number.isdigit() else -1


def _whole(prefix: str) -> bool:
  """Its index and every data shard (ckpt-8.data-00000-of-00001) are there; not that they are
  undamaged: only restoring tells."""
  shards = glob.glob(glob.escape(prefix) + ".data-*-of-*")
  total = shards[0].rpartition("-of-")[2] if shards else ""
  return (os.path.isfile(f"{prefix}.index") and total.isdigit()
          and len(shards) == int(total))


def _resume_fix(state: str) -> str:
  """The concrete way on after the state file names a checkpoint that is gone (or is gone
  itself): point it at the newest checkpoint whose files are all there."""
  return _point_state_at(os.path.dirname(state), "the newest checkpoint whose files are all there")


def older_checkpoint_fix(latest: str) -> str:
  """The way on when `latest` is damaged: the newest whole checkpoint before it."""
  return _point_state_at(os.path.dirname(latest), "the newest whole checkpoint before it",
                         before=_step(latest + ".index"))


def _point_state_at(directory: str, which: str, before: int | None = None) -> str:
  """The command that points the state file at the newest whole checkpoint (before step
  `before`), or --start_over. Never done for the user: which checkpoint to resume from is theirs."""
  prefixes = [p[:-len(".index")] for p in glob.glob(os.path.join(glob.escape(directory), "*.index"))]
  whole = [p for p in prefixes if 0 <= _step(p) < (before if before is not None else float("inf"))
           and _whole(p)]
  if not whole:
    return start_over_hint()
  name = os.path.basename(max(whole, key=_step))
  return (f"to resume from {name}, {which}, run: echo 'model_checkpoint_path: \"{name}\"' > "
          f"{shlex.quote(os.path.join(directory, 'checkpoint'))} (older checkpoints stay); or "
          f"{errors.terms().start_over}")


# What only a tfdp run writes into model_dir: --start_over moves these aside, and refuses a folder
# that holds some of them but no tfdp run.
RUN_FILES = (CHECKPOINT_DIR, METRICS_FILE, "train", "eval", "eval.json", EXPORT_FILE, WEIGHTS_FILE,
             "metrics.png")


@dataclasses.dataclass
class WritePlan:
  """Where this process writes. `model_dir` is shared; `write_dir` is model_dir on the chief."""
  model_dir: str
  write_dir: str
  is_chief: bool

  @property
  def checkpoint_dir(self) -> str:
    return os.path.join(self.write_dir, CHECKPOINT_DIR)

  @property
  def restore_dir(self) -> str:
    return os.path.join(self.model_dir, CHECKPOINT_DIR)

  def path(self, name: str) -> str:
    return os.path.join(self.model_dir, name)

  def discard_worker_checkpoints(self) -> None:
    """A non-chief's checkpoints are never read (every worker restores the chief's): after each
    save its copy goes, so the temp dir holds at most the one being written, not
    max_checkpoints full copies for the run's life."""
    if self.is_chief or not os.path.isdir(self.checkpoint_dir):
      return
    for name in os.listdir(self.checkpoint_dir):
      path = os.path.join(self.checkpoint_dir, name)
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        with contextlib.suppress(FileNotFoundError):
          os.unlink(path)

  def cleanup(self) -> None:
    if not self.is_chief:
      shutil.rmtree(self.write_dir, ignore_errors=True)
      locks.release_worker_dir(self.write_dir)
    else:
      locks.release_model_dir(self.model_dir)
      kept, folder = _MADE_DIRS.pop(self.model_dir, None), self.model_dir
      with contextlib.suppress(OSError):  # a failed start leaves none of the empty folders it made
        while kept and folder != kept:
          os.rmdir(folder)  # only if empty: a run that wrote anything keeps it
          folder = os.path.dirname(folder)


def write_plan(model_dir: str, is_chief: bool, rank: int) -> WritePlan:
  if is_chief:
    return WritePlan(model_dir, model_dir, True)
  locks.remove_stale_worker_dirs()
  return WritePlan(model_dir, locks.make_worker_dir(rank), False)


def _fsync_dir(directory: str) -> None:
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:  # some file systems cannot sync a folder
    pass
  finally:
    os.close(fd)


def _replace_synced(tmp: str, path: str) -> None:
  """Renames tmp over path once its bytes are on disk: a crash leaves the old file or the new."""
  with open(tmp, "rb") as f:
    os.fsync(f.fileno())
  os.replace(tmp, path)
  _fsync_dir(os.path.dirname(path))


def _temp_beside(path: str, suffix: str = "") -> tuple[int, str]:
  """A temp file created exclusively beside path (O_EXCL: never a planted file or symlink),
  with the mode a plain open() would give it."""
  directory, name = os.path.split(path)
  fd, tmp = tempfile.mkstemp(prefix=f"{name}.tmp-{os.getpid()}-", suffix=suffix, dir=directory)
  mask = os.umask(0)
  os.umask(mask)
  os.fchmod(fd, 0o666 & ~mask)
  return fd, tmp


def _write_into_place(path: str, write, suffix: str = "") -> None:
  """write(fd, tmp) fills an exclusive temp file beside path, which then replaces path. A write
  that fails (a full disk) leaves path as it was and is one line naming it."""
  with disk_errors(path, f"'{path}' was not written; the file as it was and every checkpoint "
                         "are kept"):
    fd, tmp = _temp_beside(path, suffix)
    try:
      write(fd, tmp)
      _replace_synced(tmp, path)
    except BaseException:
      if os.path.lexists(tmp):
        os.unlink(tmp)
      raise


# ---- a full disk ------------------------------------------------------------------------------

_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "File too large")


def _disk_failure(error: BaseException) -> str | None:
  """Why a write failed, if it is the disk's fault (full, quota, read-only, gone), else None.
  TensorFlow's own writes report a full disk as ResourceExhaustedError with the OS's text."""
  if isinstance(error, OSError) and not isinstance(error, (FileNotFoundError, IsADirectoryError)):
    return error.strerror or str(error)
  message = getattr(error, "message", None)
  if isinstance(message, str) and type(error).__module__.startswith("tensorflow"):
    found = [text for text in _DISK_FULL_TEXT if text in message]
    return found[0] if found else None
  return None


@contextlib.contextmanager
def disk_errors(path: str, consequence: str):
  """A full disk (or quota, or a read-only mount) while writing `path` becomes one OutputError
  naming it and what is kept, instead of a traceback from the middle of the write."""
  try:
    yield
  except Exception as error:  # pylint: disable=broad-except
    why = _disk_failure(error)
    if why is None:
      raise
    full = (not isinstance(error, OSError)
            or error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG))
    hint = (f" free space (or choose a {errors.terms().model_dir} with room) and re-run to "
            "resume." if full
            else " fix it and re-run to resume.")
    raise OutputError(f"cannot write '{path}' ({why}); {consequence};{hint}") from None


@contextlib.contextmanager
def checkpoint_save_errors(plan: WritePlan, step: int, last_saved: int | None):
  """A save that fails leaves the state file naming the last good checkpoint (TensorFlow writes
  it last); the failed save's partial files are removed, so the space they took is free."""
  kept = errors.checkpoint_kept(last_saved, intact=True)
  try:
    with disk_errors(plan.checkpoint_dir, f"checkpoint step {step} was not saved; {kept}"):
      yield
  except OutputError:
    _remove_partial_checkpoint(plan.checkpoint_dir, step)
    raise


def _remove_partial_checkpoint(directory: str, step: int) -> None:
  try:
    named = latest_checkpoint(os.path.dirname(directory))
  except OutputError:
    named = None
  prefix = os.path.join(directory, f"ckpt-{step}")
  if named == prefix:
    return  # the save got as far as naming it: it is whole
  for path in glob.glob(glob.escape(prefix) + "_temp*") + glob.glob(glob.escape(prefix) + ".*"):
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      with contextlib.suppress(OSError):
        os.unlink(path)


def atomic_write_text(path: str, text: str) -> None:
  def write(fd: int, tmp: str) -> None:
    del tmp
    with os.fdopen(fd, "w") as f:
      f.write(text)
  _write_into_place(path, write)


def _copy_aside(path: str, stem: str, suffix: str = "") -> str:
  """Copies `path` to a new file `stem`+suffix (stem-2, -3, ... where taken: restarts within
  one second each keep theirs), created exclusively, never over another file."""
  for attempt in range(1, 1000):
    aside = f"{stem}{suffix}" if attempt == 1 else f"{stem}-{attempt}{suffix}"
    try:
      with open(path, "rb") as source, open(aside, "xb") as copy:
        shutil.copyfileobj(source, copy)
      return aside
    except FileExistsError:
      continue
  raise OutputError(f"{path} could not be kept aside: {stem}-1..999{suffix} all exist; "
                    "remove some.")


def write_config(plan: WritePlan, text: str, resuming: bool) -> None:
  """config.yaml is the config of the latest run; an earlier, different one is kept beside it.
  `resuming`: a checkpoint was restored, so other settings change a run that already trained."""
  if not plan.is_chief:
    return
  locks.record_lock_holder(plan.model_dir)  # every check passed: the run's first write
  path = plan.path(CONFIG_FILE)
  if os.path.exists(path):
    old = pathlib.Path(path).read_text()
    if old != text:  # a copy, then the new one over it: config.yaml is never missing
      kept = _copy_aside(path, plan.path(f"config.{time.strftime('%Y%m%d-%H%M%S')}"), ".yaml")
      changed = changed_settings(old, text)
      if changed and resuming:  # other settings from here on, said once
        logging.warning("config.yaml: settings differ from the earlier run's (kept as %s) and "
                        "apply from now on: %s", os.path.basename(kept), changed)
      elif changed:  # an earlier start stopped before its first checkpoint: nothing trained
        logging.info("config.yaml: an earlier start that saved no checkpoint left another "
                     "config.yaml (kept as %s); this run starts afresh", os.path.basename(kept))
  atomic_write_text(path, text)


def changed_settings(old_text: str, new_text: str, shown: int = 6, skip=()) -> str:
  """`trainer.learning_rate.schedule linear → cosine, ...` between two configs (not `skip`)."""
  import yaml  # pylint: disable=g-import-not-at-top
  from tfdp.config import loader  # pylint: disable=g-import-not-at-top
  try:
    old, new = yaml.safe_load(old_text) or {}, yaml.safe_load(new_text) or {}
  except yaml.YAMLError:
    return ""
  if not isinstance(old, dict) or not isinstance(new, dict):
    return ""
  paths = list(dict.fromkeys(loader.leaf_paths(new) + loader.leaf_paths(old)))
  changes = [f"{'.'.join(p)} {loader.get_path(old, p)!r} → {loader.get_path(new, p)!r}"
             for p in paths
             if loader.get_path(old, p) != loader.get_path(new, p) and tuple(p) not in skip]
  more = f" (and {len(changes) - shown} more)" if len(changes) > shown else ""
  return ", ".join(changes[:shown]) + more


def is_fit_record(config_path: str) -> bool:
  """A tfdp.fit run's config.yaml: a record of the Keras model (its `keras:` section), which
  tfdp-train cannot load as a job config."""
  with open(config_path, encoding="utf-8", errors="replace") as f:
    return re.search(r"^keras:", f.read(), re.MULTILINE) is not None


def keep_config(plan: WritePlan, text: str) -> None:
  """A finished run run again trains nothing: config.yaml stays, and another is said unused."""
  if not plan.is_chief:
    return
  locks.record_lock_holder(plan.model_dir)
  path = plan.path(CONFIG_FILE)
  if not os.path.exists(path):
    return atomic_write_text(path, text)
  old = pathlib.Path(path).read_text()
  changed = changed_settings(old, text, skip=(("trainer", "export_model"),))
  # export_model alone is no reason: a finished run exports where it has no export of its own
  if old != text and (changed or not changed_settings(old, text)):
    logging.warning("%s holds a finished run: nothing trains, and config.yaml keeps the "
                    "settings it trained with; this command's differ and were not used%s (to "
                    "train with them, %s)", plan.model_dir, f": {changed}" if changed else "",
                    errors.terms().start_over)


def append_metrics(plan: WritePlan, row: dict, last: bool = True) -> None:
  """One row per epoch; a re-run of an epoch (after a restart) replaces that epoch's row."""
  if not plan.is_chief:
    return
  import pandas as pd  # pylint: disable=g-import-not-at-top
  path = plan.path(METRICS_FILE)
  frame = pd.DataFrame([row])
  old = read_metrics(path) if os.path.exists(path) else None
  if old is not None:
    old = old[old["epoch"] != row["epoch"]]
    frame = pd.concat([old, frame], ignore_index=True)
  frame = frame[sorted(frame.columns, key=lambda c: c == "wall_time")]  # one order: eval_* first
  atomic_write_text(path, frame.to_csv(index=False))
  write_metrics_png(plan, last, row.get("epoch_seconds", 0.0))


def read_metrics(path: str):
  """metrics.csv, or None when it cannot be read: it is set aside (never deleted), and losing a
  table of past epochs must not stop a run."""
  import pandas as pd  # pylint: disable=g-import-not-at-top
  try:
    frame = pd.read_csv(path)
    if "epoch" not in frame.columns:
      raise ValueError("it has no 'epoch' column")
    return frame
  except ValueError as error:  # pandas' EmptyDataError and ParserError, UnicodeDecodeError
    aside = _copy_aside(path, f"{path}.bad-{time.strftime('%Y%m%d-%H%M%S')}")
    os.unlink(path)
    logging.warning("%s could not be read (%s); set aside as %s, a fresh one started", path,
                    " ".join(str(error).split()) or type(error).__name__, os.path.basename(aside))
    return None


def last_metrics_row(plan: WritePlan) -> dict:
  """The last epoch's row of the chief's metrics.csv without its empty cells (an epoch not
  evaluated), or {} when there is none: what a run that is already trained reports again."""
  import pandas as pd  # pylint: disable=g-import-not-at-top
  path = plan.path(METRICS_FILE)
  try:
    frame = pd.read_csv(path)
  except (OSError, ValueError):  # none yet, or unreadable: the next append sets it aside
    return {}
  if frame.empty or "epoch" not in frame.columns:
    return {}
  row = frame.iloc[-1].dropna().to_dict()
  counts = ("epoch", "step", "train_steps", "eval_examples")
  return {k: int(v) if k in counts else v for k, v in row.items()}


def write_metrics_png(plan: WritePlan, last: bool = True, epoch_seconds: float = 0.0) -> None:
  """metrics.png beside metrics.csv (plots.redraw_metrics_png says when). A picture that fails to
  draw is a warning: training and its checkpoints matter more."""
  from tfdp import plots  # pylint: disable=g-import-not-at-top
  try:
    plots.redraw_metrics_png(plan.model_dir, last, epoch_seconds)
  except Exception as error:  # pylint: disable=broad-except
    logging.warning("could not draw %s: %s", plots.METRICS_PNG, error)


def kept_export(plan: WritePlan, checkpoint: str | None) -> str | None:
  """The export a finished run already wrote of `checkpoint`'s weights (it is newer), if any:
  a run killed between its last checkpoint and its export has an older one, or none."""
  if not plan.is_chief or not checkpoint or not os.path.exists(checkpoint + ".index"):
    return None
  for name in (EXPORT_FILE, WEIGHTS_FILE):
    path = plan.path(name)
    if os.path.exists(path) and os.path.getmtime(path) >= os.path.getmtime(checkpoint + ".index"):
      return path
  return None


def export_model(plan: WritePlan, model) -> str | None:
  if not plan.is_chief:
    return None
  path = plan.path(EXPORT_FILE)
  def write(fd: int, tmp: str) -> None:
    os.close(fd)
    model.save(tmp)
  try:
    _write_into_place(path, write, suffix=".keras")  # Keras saves only to a name ending .keras
    return path
  except (NotImplementedError, TypeError, ValueError) as e:
    # A subclassed model without get_config, a custom object Keras cannot serialize: a finished
    # run must not crash on its export, and its weights load into the user's own class.
    reason = " ".join(str(e).split())[:160] or type(e).__name__
  path = plan.path(WEIGHTS_FILE)
  def write_weights(fd: int, tmp: str) -> None:
    os.close(fd)
    model.save_weights(tmp)
  _write_into_place(path, write_weights, suffix=".weights.h5")
  logging.warning("export: Keras cannot save this model whole (%s: %s); saved its weights to %s "
                  "(model.load_weights on a model built by your code reads them)",
                  type(model).__name__, reason, path)
  return path


def checkpoint_step(prefix: str | None) -> int | None:
  """The step a checkpoint prefix names (the trainer numbers them by step: ckpt-<step>)."""
  match = re.search(r"-(\d+)$", prefix or "")
  return int(match.group(1)) if match else None

