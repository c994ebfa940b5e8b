"""The architecture as the imports say it: folders per concern, one direction, no circle.

config → cluster → strategy → data → task/model → trainer → outputs stays visible in the tree
only while these hold (counting imports inside functions too; `if TYPE_CHECKING:` blocks, which
never run, are left out).
"""
import ast
import subprocess
import sys
from pathlib import Path

import helpers

PACKAGE = helpers.REPO / "tfdp"


def module_name(path: Path) -> str:
  parts = path.relative_to(helpers.REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking_block(node: ast.AST) -> bool:
  return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_names(tree: ast.AST, modules):
  """Every module an import statement loads, at any depth, outside TYPE_CHECKING blocks:
  `from tfdp.core import data` loads tfdp.core.data; `from tfdp.core.data import Source` loads
  tfdp.core.data (Source is no module)."""
  stack = [tree]
  while stack:
    node = stack.pop()
    if is_type_checking_block(node):
      stack.extend(node.orelse)
      continue
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for alias in node.names:
        child = f"{node.module}.{alias.name}"
        yield child if child in modules else node.module
    stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
  modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
  graph = {}
  for name, path in modules.items():
    targets = set()
    for imported in imported_names(ast.parse(path.read_text()), modules):
      if imported in modules and imported != name:
        targets.add(imported)
    graph[name] = targets
  return graph


GRAPH = import_graph()


def edges_from(prefix: str):
  return [(a, b) for a, targets in GRAPH.items() if a == prefix or a.startswith(prefix + ".")
          for b in targets]


def under(name: str, prefix: str) -> bool:
  return name == prefix or name.startswith(prefix + ".")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state, path = {}, []

  def visit(node):
    state[node] = "open"
    path.append(node)
    for target in sorted(graph.get(node, ())):
      if state.get(target) == "open":
        return path[path.index(target):] + [target]
      if target not in state:
        found = visit(target)
        if found:
          return found
    path.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_the_graph_sees_the_imports_it_must_judge():
  # A walker that found nothing would pass every rule below.
  assert "tfdp.core.task" in GRAPH["tfdp.config.checks"]
  assert "tfdp.core.data" in GRAPH["tfdp.workloads.vision.image_classification"]  # inside a def too
  assert "tfdp.core.data" in GRAPH["tfdp.core.task"]  # imported inside a method
  assert "tfdp.config.schema" not in GRAPH["tfdp.core.task"]  # under TYPE_CHECKING only


def test_no_import_cycle():
  assert find_cycle(GRAPH) is None, " → ".join(find_cycle(GRAPH))


def test_find_cycle_finds_one():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_imports_no_workload_and_no_bench():
  bad = [(a, b) for a, b in edges_from("tfdp.core")
         if under(b, "tfdp.workloads") or under(b, "tfdp.bench")]
  assert not bad


def test_compiled_is_a_face_of_core_not_a_workload():
  """tfdp.fit's package uses core and distributed; core reaches it only by name (its task is in
  the registry's table), and it knows no workload or bench."""
  assert "tfdp.compiled.task" in GRAPH["tfdp.compiled.fit"]
  bad = [(a, b) for a, b in edges_from("tfdp.compiled")
         if under(b, "tfdp.workloads") or under(b, "tfdp.bench")]
  bad += [(a, b) for a, b in edges_from("tfdp.core") if under(b, "tfdp.compiled")]
  assert not bad


def test_distributed_knows_no_task_workload_or_bench():
  bad = [(a, b) for a, b in edges_from("tfdp.distributed")
         if under(b, "tfdp.core") or under(b, "tfdp.workloads") or under(b, "tfdp.bench")]
  assert not bad


def test_no_workload_imports_another():
  workloads = {name.split(".")[2] for name in GRAPH if name.count(".") >= 2
               and under(name, "tfdp.workloads")}
  assert {"vision", "text", "recommenders"} <= workloads
  bad = [(a, b) for a, b in edges_from("tfdp.workloads")
         if under(b, "tfdp.workloads") and b.split(".")[2:3] != a.split(".")[2:3]]
  assert not bad


def test_config_imports_only_errors_and_the_task_contract():
  allowed = ("tfdp.config", "tfdp.errors", "tfdp.core.task")
  bad = [(a, b) for a, b in edges_from("tfdp.config") if not any(under(b, p) for p in allowed)]
  assert not bad


def test_nothing_in_the_library_imports_the_apps_or_the_benchmarks_scripts():
  bad = [(a, b) for a, b in edges_from("tfdp") if b.startswith(("apps", "benchmarks"))]
  assert not bad
  assert not any(under(b, "tfdp.bench") for a, b in edges_from("tfdp")
                 if not under(a, "tfdp.bench") and a != "tfdp")


def test_import_tfdp_starts_neither_tensorflow_nor_pandas():
  code = ("import sys, tfdp; tfdp.register_task, tfdp.Task, tfdp.register_model; "
          "print(sorted(m for m in ('tensorflow', 'pandas', 'keras') if m in sys.modules))")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120, env=helpers.env(), cwd=str(helpers.REPO))
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == "[]"


def test_no_library_file_is_a_thousand_line_grab_bag():
  sizes = {str(p.relative_to(helpers.REPO)): len(p.read_text().splitlines())
           for p in PACKAGE.rglob("*.py")}
  assert not {p: n for p, n in sizes.items() if n > 560}
