"""The README's test command runs `-n 2 --dist loadgroup`: every test of one xdist_group on one
worker (tests/xdist_groups.py; pytest 9.2 had silently broken it, pytest-dev/pytest-xdist#1386)."""
import ast
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


def _is_module_fixture(decorator) -> bool:
  return (isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.fixture"
          and any(k.arg == "scope" and ast.unparse(k.value) == "'module'"
                  for k in decorator.keywords))


def _grouped(decorators, marks: set) -> bool:
  return any("xdist_group" in ast.unparse(d) or ast.unparse(d) in marks for d in decorators)


def _calls(function) -> set:
  return {ast.unparse(node.func) for node in ast.walk(function) if isinstance(node, ast.Call)}


def _starters(functions, known: set, prefix: str = "") -> set:
  """The names (with `prefix`) of `functions` that start a process: they call subprocess,
  tests/preloaded.py's run or a name in `known`, or, through each other, one that does."""
  found = set(known)
  while True:
    more = {prefix + f.name for f in functions if prefix + f.name not in found and any(
        call.startswith("subprocess.") or call == "preloaded.run" or call in found
        or prefix + call in found for call in _calls(f))}
    if not more:
      return found
    found |= more


def test_module_fixtures_that_start_processes_are_built_once():
  """`--dist loadgroup` spreads a module's ungrouped tests over both workers, and each worker
  builds the module fixtures its tests use: test_keras_fit_losses' one process of cases (46 s
  on the AVX2-only CPU) ran on both (stop 52's CI: its setup charged to the third case). A
  module fixture that starts a process (itself, through the module's functions or through
  helpers.py's) needs its users in one xdist_group (a `pytestmark` or each user's mark). Seen
  failing before the marks on test_keras_fit_losses and test_api's notebook_session, and with
  test_keras_fit's `pytestmark` removed (its fixtures start theirs through run_case)."""
  helper_tree = ast.parse((helpers.REPO / "tests" / "helpers.py").read_text(encoding="utf-8"))
  from_helpers = _starters([n for n in helper_tree.body if isinstance(n, ast.FunctionDef)],
                           set(), prefix="helpers.")
  assert {"helpers.run_train", "helpers.run_probe", "helpers.run_python"} <= from_helpers, \
      from_helpers  # it can see
  loose = []
  for path in sorted(helpers.REPO.glob("tests/test_*.py")):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    marks = {ast.unparse(node.targets[0]) for node in tree.body  # a group's mark by a name
             if isinstance(node, ast.Assign) and "xdist_group" in ast.unparse(node.value)}
    if "pytestmark" in marks:
      continue
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    starts = _starters(functions, from_helpers)
    starting = {f.name for f in functions if f.name in starts
                and any(_is_module_fixture(d) for d in f.decorator_list)}
    loose += [f"{path.name}::{f.name} ({name})" for f in functions for name in starting
              if name in {a.arg for a in f.args.args} and not _grouped(f.decorator_list, marks)]
  assert not loose, loose
