"""The README's test command runs `-n 2 --dist loadgroup`: every test of one xdist_group on one
worker (tests/xdist_groups.py; pytest 9.2 had silently broken it, pytest-dev/pytest-xdist#1386)."""
import subprocess
import sys

import helpers

TESTS = '''
import os
import pytest

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
  with open(os.path.join(os.environ["RAN_DIR"], f"ran-{i}"), "w") as f:
    f.write(os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.parametrize("i", range(6))
def test_free(i):
  pass
'''


def test_the_tests_of_one_xdist_group_run_on_one_worker(tmp_path):
  (tmp_path / "tests").mkdir()
  (tmp_path / "tests" / "test_grouped.py").write_text(TESTS)
  ran = tmp_path / "ran"
  ran.mkdir()
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "xdist_groups", "-n", "2", "--dist", "loadgroup",
       "-p", "no:cacheprovider", "tests"], cwd=str(tmp_path),
      capture_output=True, text=True, timeout=120,
      env={**helpers.env(), "PYTHONPATH": str(helpers.REPO / "tests"), "RAN_DIR": str(ran)})
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  workers = [path.read_text() for path in ran.glob("ran-*")]
  assert len(workers) == 6 and len(set(workers)) == 1, workers
