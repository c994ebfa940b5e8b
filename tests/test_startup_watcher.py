"""The start-up watcher's line (cluster.watch_startup) is whole on stderr, newline included,
before it SIGKILLs the worker: the shell's "Killed" or a launcher's next line starts a new line."""
import json
import subprocess
import sys

import pytest

import helpers


def _watch(tmp_path, said: bytes = b"", seconds: float = 0.2) -> bytes:
  """Runs a watcher over a sleeping 'worker' that writes `said` to it (StartupDeadline.say);
  returns what the watcher had written to stderr when it killed the worker."""
  worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    spec = json.dumps({"pid": worker.pid, "seconds": seconds, "prog": "tfdp-train", "tf_config": {
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0}}})
    stderr = tmp_path / "stderr"
    with open(stderr, "wb") as out:
      watcher = subprocess.Popen(
          [sys.executable, "-c", "import sys; from tfdp.distributed import cluster; "
           "cluster.watch_startup(sys.argv[1])", spec],
          stdin=subprocess.PIPE, stderr=out, env=helpers.env(), cwd=str(helpers.REPO))
      watcher.stdin.write(said)
      watcher.stdin.flush()
      assert worker.wait(timeout=60) == -9  # killed by the watcher
      text = stderr.read_bytes()  # what was on stderr when the worker died
      watcher.stdin.close()
      watcher.wait(timeout=60)
  finally:
    worker.kill()
    worker.wait()
  return text


def test_the_watchers_line_ends_with_a_newline_before_the_worker_is_killed(tmp_path):
  text = _watch(tmp_path)
  assert text.endswith(b"so that the group restarts\n"), text
  assert text.count(b"tfdp-train: error: worker 0: the cluster did not assemble in 0s") == 1, text


@pytest.mark.parametrize("said, named", [
    (b"worker 1 at 127.0.0.1:2 answers, but not as a tfdp worker: something else holds port 2\n",
     b"(runtime.startup_timeout_seconds): worker 1 at 127.0.0.1:2 answers, but not as a tfdp "
     b"worker: something else holds port 2; stopping"),
    # the rendezvous is over (""): a peer's port is its TensorFlow server, probed as before
    (b"worker 1 at 127.0.0.1:2 answers, but...\n\n",
     b"(runtime.startup_timeout_seconds): no answer from worker 1 at 127.0.0.1:2 (connection "
     b"refused); stopping")])
def test_the_watcher_names_what_the_rendezvous_said_it_waits_for(tmp_path, said, named):
  """Seen failing before the rendezvous told the watcher: a line written to its stdin ended the
  watcher, and the worker was never stopped."""
  assert named in _watch(tmp_path, said, seconds=2.0)
