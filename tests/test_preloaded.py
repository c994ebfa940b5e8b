"""tests/preloaded.py: a process forked from the preloaded server answers as a fresh interpreter
would, and only requests that a fresh interpreter would answer the same way go there."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import helpers
import preloaded

REPORT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import tfdp.logs
    first_time = not hasattr(tfdp.logs, "touched_by_test")
    tfdp.logs.touched_by_test = True  # a fresh tfdp in every process: the next one has none
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(),
                      "path0": sys.path[0], "main": __name__, "first_tfdp": first_time,
                      "asked": os.environ.get("ASKED"),
                      "draw": float(np.random.random())}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[-1]))
""")


@pytest.fixture(autouse=True)
def preloading_on(monkeypatch):
  """These tests are of the server: on even where the suite runs with it off."""
  monkeypatch.delenv(preloaded.FRESH_VARIABLE, raising=False)


def run_both(argv, env, cwd):
  fresh = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
  forked = helpers.run_python(argv, env=env, cwd=cwd, timeout=120)
  return fresh, forked


@pytest.fixture(scope="module")
def script(tmp_path_factory):
  path = tmp_path_factory.mktemp("preloaded") / "report.py"
  path.write_text(REPORT)
  return path


@pytest.mark.parametrize("form", ["script", "-c"])
def test_a_forked_process_answers_as_a_fresh_interpreter(script, tmp_path, form):
  """Seen failing with each of these lines of preloaded._become left out in turn: the working
  folder, the request's environment, argv, sys.path[0], numpy's reseeding (two children drew
  the same)."""
  env = helpers.env(ASKED="yes")
  argv = ([sys.executable, str(script), "a b", "3"] if form == "script"
          else [sys.executable, "-c", REPORT, "a b", "3"])
  fresh, forked = run_both(argv, env, tmp_path)
  again = helpers.run_python(argv, env=env, cwd=tmp_path, timeout=120)
  assert (fresh.returncode, forked.returncode) == (3, 3), forked.stderr[-2000:]
  said_fresh, said_forked, said_again = (json.loads(p.stdout) for p in (fresh, forked, again))
  assert said_forked["pid"] != os.getpid() and said_forked["pid"] != said_again["pid"]
  assert said_forked["first_tfdp"] and said_again["first_tfdp"]
  assert said_forked["draw"] != said_again["draw"]  # numpy's global generator reseeded
  for said in (said_forked, said_fresh):
    del said["pid"], said["draw"]
  assert said_forked == said_fresh
  assert said_forked["argv"][1:] == ["a b", "3"] and said_forked["cwd"] == str(tmp_path)
  assert said_forked["asked"] == "yes"
  assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "to stderr"


def test_the_environment_a_server_started_with_is_not_a_later_childs(tmp_path, monkeypatch):
  """A server keeps the environment of the request that started it; each child gets only its
  own request's. Seen failing without os.environ.clear() in preloaded._become (an earlier
  version of the test above set the variable where no server saw it, and could not fail)."""
  monkeypatch.setattr(preloaded, "_server", {})  # a server of this test's own
  code = "import os, sys; print(os.environ.get('REMOVED'), 'tensorflow' in sys.modules)"
  env = helpers.env()
  try:
    first, later = (helpers.run_python([sys.executable, "-c", code], env=e, cwd=tmp_path,
                                       timeout=120)
                    for e in ({**env, "REMOVED": "yes"}, env))
    said = (first.stdout.strip(), later.stdout.strip())
  finally:
    preloaded._stop_server()  # pylint: disable=protected-access
  assert said == ("yes True", "None True"), said  # both forked: TensorFlow was in each


@pytest.mark.parametrize("code, returncode", [
    ("raise ValueError('told')", 1), ("import os; os._exit(5)", 5),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
    ("import sys; sys.exit('a message')", 1)])
def test_how_a_forked_process_ends_is_how_a_fresh_one_ends(tmp_path, code, returncode):
  fresh, forked = run_both([sys.executable, "-c", code], helpers.env(), tmp_path)
  assert fresh.returncode == forked.returncode == returncode
  assert fresh.stderr.splitlines()[-1:] == forked.stderr.splitlines()[-1:]


def test_a_timeout_kills_the_forked_process_and_what_it_started(tmp_path):
  code = ("import subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(60)\n")
  started = time.time()
  with pytest.raises(subprocess.TimeoutExpired) as raised:
    helpers.run_python([sys.executable, "-c", code], env=helpers.env(), cwd=tmp_path, timeout=5)
  assert time.time() - started < 30
  grandchild = int(raised.value.stdout.split()[0])
  time.sleep(0.5)
  try:
    with open(f"/proc/{grandchild}/stat", encoding="utf-8") as stat:
      state = stat.read().rsplit(")", 1)[1].split()[0]
  except FileNotFoundError:
    state = "gone"
  assert state in ("Z", "gone"), state  # killed: gone, or a zombie until init reaps it


@pytest.mark.parametrize("change", [{"TF_CPP_MIN_LOG_LEVEL": "0"}, {"PYTHONPATH": "/nowhere"},
                                    {preloaded.FRESH_VARIABLE: "1"}])
def test_a_request_a_fresh_interpreter_would_answer_otherwise_is_not_forked(tmp_path, change):
  """Seen failing with preloaded._eligible answering True (the TFDP_TESTS_FRESH_PROCESSES case)
  and with _key ignoring the environment (the other two)."""
  code = "import sys; print('tensorflow' in sys.modules)"
  env = helpers.env()
  assert helpers.run_python([sys.executable, "-c", code], env=env, cwd=tmp_path,
                            timeout=120).stdout.strip() == "True"  # forked: the server's import
  changed = {**env, **change}
  if change.get("PYTHONPATH"):
    changed["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], "/nowhere"])
  assert helpers.run_python([sys.executable, "-c", code], env=changed, cwd=tmp_path,
                            timeout=120).stdout.strip() == "False"


def test_an_apps_refusal_before_tensorflow_reads_the_same_forked(tmp_path):
  """Seen failing without preloaded's clearing of absl's init callbacks: TensorFlow's import had
  queued a CUDA probe that app.run ran before main, and its line came first in stderr."""
  argv = [sys.executable, helpers.TRAIN_APP, "--params_override=trainer.no_such_key=1"]
  fresh, forked = run_both(argv, helpers.env(), tmp_path)
  assert fresh.returncode == forked.returncode != 0
  assert forked.stderr == fresh.stderr and fresh.stderr.strip(), forked.stderr
