"""Multi-worker training from a notebook: `launch_notebook(train_fn, num_workers=2)` runs
train_fn in N fresh worker processes (one TF_CONFIG each, started by tfdp's launcher) and
returns what each returned, as Hugging Face Accelerate's `notebook_launcher` does for PyTorch.

The workers are new interpreters, not forks: TensorFlow in the notebook may already run, and a
forked TensorFlow is unsafe. train_fn travels by value (cloudpickle), so a function defined in a
cell works; it must import what it uses inside its body or from installed modules, and return
something picklable (metrics, a DataFrame: not the trainer or the model).
"""
from __future__ import annotations

import json
import os
import pickle
import stat
import sys
import tempfile
import traceback

from tfdp.distributed import launch as launch_lib
from tfdp import paths
from tfdp.errors import Preempted, TfdpError

PAYLOAD = "payload.pkl"
SYS_PATH = "sys_path.json"  # the kernel's import path: a sys.path.append there reaches workers


def _result_path(folder: str, index: int) -> str:
  return os.path.join(folder, f"result-{index}.pkl")


def check_private_folder(folder: str) -> None:
  """Refuses a folder others could write: its pickles run code when loaded, and its name is on
  the workers' command line for any local user to see."""
  try:
    st = os.lstat(folder)
  except OSError as error:
    raise TfdpError(f"launch_notebook: cannot read folder {folder}: "
                    f"{error.strerror or error}.") from None
  if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
    raise TfdpError(f"launch_notebook: folder {folder} is not private (a directory of this user "
                    f"with mode 0700, found {stat.filemode(st.st_mode)} of uid {st.st_uid}); "
                    "refusing to load pickles from it.")


def said_tail(lines: list[str], worker: int, budget: int = 700) -> str:
  """A worker's last lines within the error's length, the last first kept: it says where the
  worker stopped ('checkpoint saved at step ...'), which long progress lines before it had cut
  off the error's end. Each line is cut to 200 characters."""
  kept: list[str] = []
  for line in reversed(lines[-10:]):
    line = line if len(line) <= 200 else line[:197] + "..."
    if kept and sum(len(k) + 8 for k in kept) + len(line) > budget:
      break
    kept.insert(0, f"\n  [w{worker}] {line}")
  return "".join(kept)


def launch_notebook(train_fn, num_workers: int = 2, args: tuple = (), kwargs: dict | None = None,
                    env: dict | None = None, output=None, allow_remote: bool = False) -> list:
  """Runs train_fn(*args, **kwargs) on num_workers local worker processes under
  MultiWorkerMirroredStrategy (each gets TF_CONFIG; `tfdp.fit` and `tfdp.make_strategy()` pick
  the multi-worker strategy from it). Their output is printed as `[wI] line`. Returns the list
  of the workers' return values, worker 0 (the chief) first. A failed worker raises TfdpError
  naming it, with its last lines. The workers run in a private network namespace (loopback
  only) where the kernel allows it; allow_remote=True runs them on the shared network."""
  import cloudpickle  # pylint: disable=g-import-not-at-top
  from tfdp import in_process  # pylint: disable=g-import-not-at-top
  num_workers = in_process.whole_number("num_workers", num_workers, caller="launch_notebook")
  if not callable(train_fn):  # before workers start and import TensorFlow (a probe)
    raise TfdpError(f"launch_notebook: train_fn is not a function ({type(train_fn).__name__} "
                    f"{train_fn!r:.40}); "
                    "pass the function itself, e.g. launch_notebook(train_fn), not train_fn().")
  if not isinstance(args, (tuple, list)) or not isinstance(kwargs, (dict, type(None))):
    raise TfdpError(  # args=5 said "'int' object is not iterable"; args="ab" ran train_fn("a", "b")
        f"launch_notebook: args must be a tuple and kwargs a dict, got args={args!r:.60} and "
        f"kwargs={kwargs!r:.60}; e.g. args=(5,) for train_fn(5).")
  try:
    payload = cloudpickle.dumps((train_fn, tuple(args), dict(kwargs or {})))
  except Exception as error:  # pylint: disable=broad-except
    raise TfdpError(f"launch_notebook: train_fn or its arguments cannot be sent to the workers "
                    f"({type(error).__name__}: {error}); pass plain values and build datasets "
                    "and models inside train_fn.") from None
  worker_env = dict(os.environ if env is None else env)
  # The workers import the same tfdp as this kernel, whatever their working directory.
  package_root = paths.REPO_ROOT
  worker_env["PYTHONPATH"] = os.pathsep.join(
      p for p in (package_root, os.getcwd(), worker_env.get("PYTHONPATH", "")) if p)
  worker_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  # mkdtemp: created here, mode 0700, so no other user can plant a result for us to unpickle.
  with tempfile.TemporaryDirectory(prefix="tfdp-notebook-") as folder:
    check_private_folder(folder)
    with open(os.path.join(folder, PAYLOAD), "wb") as f:
      f.write(payload)
    with open(os.path.join(folder, SYS_PATH), "w", encoding="utf-8") as f:
      json.dump([p for p in sys.path if isinstance(p, str)], f)  # as import reads it
    command = [sys.executable, "-m", "tfdp.notebook", folder]
    result = launch_lib.run_group(command, num_workers, env=worker_env, output=output,
                                  private_network=not allow_remote)
    if not result.ok:
      failed = result.first_failed if result.first_failed is not None else 0
      tail = said_tail(result.last_lines[failed], failed)
      raise TfdpError(f"launch_notebook: {result.failure_summary() or 'the workers stopped'}; "
                      f"its last lines:{tail}")
    check_private_folder(folder)  # still ours and still private before we unpickle from it
    returned = []
    for index in range(num_workers):
      try:
        with open(_result_path(folder, index), "rb") as f:
          returned.append(pickle.load(f))
      except FileNotFoundError:  # it said "cannot be read back (FileNotFoundError ...)" (a probe)
        raise TfdpError(f"launch_notebook: worker {index} exited with code 0 before train_fn "
                        "returned (an os._exit in it?); return from train_fn instead.") from None
      except Exception as error:  # pylint: disable=broad-except  (unpickling runs any code)
        raise TfdpError(
            f"launch_notebook: worker {index}'s return value cannot be read back here "
            f"({type(error).__name__}: {' '.join(str(error).split())[:200]}); return plain "
            "values (numbers, dicts, a DataFrame) whose classes this kernel can import.") from None
  return returned


def worker_main(folder: str) -> None:
  """One worker: runs the payload, writes its return value, and leaves without destructors (as
  the apps do: a finished tf.data iterator can stall its destructor; see tfdp.api.fit)."""
  from tfdp import cli, logs  # pylint: disable=g-import-not-at-top
  cli.guard_output_pipes()  # the notebook (the launcher) may go away before this worker does
  index = int(os.environ.get("TFDP_WORKER_INDEX", "0"))
  try:
    check_private_folder(folder)  # before anything is unpickled from it
  except TfdpError as error:
    cli.exit_with_error("launch_notebook worker", error, code=1)
  logs.start_tensorflow()
  try:
    with open(os.path.join(folder, SYS_PATH), encoding="utf-8") as f:
      kernel_path = json.load(f)  # before unpickling: train_fn may come from a module there
    sys.path[:] = kernel_path + [p for p in sys.path if p not in kernel_path]
    with open(os.path.join(folder, PAYLOAD), "rb") as f:
      train_fn, args, kwargs = pickle.load(f)
    try:
      value = train_fn(*args, **kwargs)
    except SystemExit as stop:  # a script's sys.exit(): 0 ends it, another code is its failure
      if stop.code not in (None, 0):  # (it was a traceback, and sys.exit(3) said code 1)
        code = stop.code if isinstance(stop.code, int) and 0 < stop.code < 256 else 1
        cli.exit_with_error("launch_notebook worker", f"train_fn called sys.exit({stop.code!r})",
                            code=code)
      value = None
    import cloudpickle  # pylint: disable=g-import-not-at-top
    try:  # by value, as train_fn came: a class defined in the notebook comes back (a probe)
      data = cloudpickle.dumps(value)
    except Exception as error:  # pylint: disable=broad-except
      raise TfdpError(f"train_fn returned a value that cannot be sent back "
                      f"({type(error).__name__}: {error}); return plain values such as the "
                      "metrics or a DataFrame (not the trainer or the model).") from None
    tmp = _result_path(folder, index) + ".tmp"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, _result_path(folder, index))
  except TfdpError as error:  # its own code: a GroupMustRestart's 203 is not the failure to blame
    cli.exit_with_error("launch_notebook worker", error)
  except Preempted as stop:  # the group was stopped (Ctrl-C in the notebook): saved, one line
    cli.exit_with_error("launch_notebook worker", stop, code=stop.exit_code)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()  # the user's own code failed: its traceback is what they need
    cli.exit_now(1)
  cli.exit_now(0)


if __name__ == "__main__":
  worker_main(sys.argv[1])
