"""The start-up watcher's line (cluster.watch_startup) is whole on stderr, newline included,
before it SIGKILLs the worker: the shell's "Killed" or a launcher's next line starts a new line."""
import json
import subprocess
import sys

import helpers


def test_the_watchers_line_ends_with_a_newline_before_the_worker_is_killed(tmp_path):
  worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    spec = json.dumps({"pid": worker.pid, "seconds": 0.2, "prog": "tfdp-train", "tf_config": {
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0}}})
    stderr = tmp_path / "stderr"
    with open(stderr, "wb") as out:
      watcher = subprocess.Popen(
          [sys.executable, "-c", "import sys; from tfdp.distributed import cluster; "
           "cluster.watch_startup(sys.argv[1])", spec],
          stdin=subprocess.PIPE, stderr=out, env=helpers.env(), cwd=str(helpers.REPO))
      assert worker.wait(timeout=60) == -9  # killed by the watcher
      text = stderr.read_bytes()  # what was on stderr when the worker died
      watcher.stdin.close()
      watcher.wait(timeout=60)
  finally:
    worker.kill()
    worker.wait()
  assert text.endswith(b"so that the group restarts\n"), text
  assert text.count(b"tfdp-train: error: worker 0: the cluster did not assemble in 0s") == 1, text
