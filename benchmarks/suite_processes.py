"""Where the test suite's CPU goes: runs pytest (the README's test command unless given other
arguments) with every Python process it starts logging its CPU time, then summarises.

  python benchmarks/suite_processes.py                      # the whole suite, as CI runs it
  python benchmarks/suite_processes.py tests/test_equivalence.py -n 2 --dist loadgroup

Prints: processes, those that imported TensorFlow and their CPU seconds, CPU by test module, the
functions autograph converted (and in how many processes), and module-scoped fixtures (tmp
folders not named after a test) built on more than one xdist worker.
The log stays in --log (JSON lines) for other questions.
"""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOOK = Path(__file__).resolve().parent / "suite_processes"
README_TEST_ARGS = ["-q", "-n", "2", "--dist", "loadgroup", "--durations=20", "tests"]


def summary(lines: list[dict]) -> str:
  out = []
  tf = sorted(line["cpu"] for line in lines if line["tensorflow"])
  total = sum(line["cpu"] for line in lines)
  out.append(f"{len(lines)} Python processes, {total:.0f} CPU s; {len(tf)} imported TensorFlow, "
             f"{sum(tf):.0f} CPU s")
  forked = [line for line in lines if line.get("forked")]
  out.append(f"{len(forked)} of them forked from a preloaded server (tests/preloaded.py), "
             f"{sum(line['cpu'] for line in forked):.0f} CPU s, each without its import")
  if tf:
    quantiles = ", ".join(f"{q:.0%} {tf[int(q * (len(tf) - 1))]:.1f}"
                          for q in (0.1, 0.25, 0.5, 0.75, 0.9))
    out.append(f"CPU s of one TensorFlow process: {quantiles}, most {tf[-1]:.1f}")
  by_module = collections.defaultdict(lambda: [0, 0, 0.0])
  for line in lines:
    module = (line["test"] or "(no test: pytest itself, xdist workers)").split("::")[0]
    entry = by_module[module]
    entry[0] += 1
    entry[1] += line["tensorflow"]
    entry[2] += line["cpu"]
  out.append("CPU s by module (processes, with TensorFlow):")
  for module, (count, with_tf, cpu) in sorted(by_module.items(), key=lambda kv: -kv[1][2])[:15]:
    out.append(f"  {cpu:7.0f}  {module} ({count}, {with_tf})")
  converted = collections.Counter(name for line in lines for name in line.get("autograph") or [])
  with_autograph = sum(bool(line.get("autograph")) for line in lines)
  out.append(f"processes in which autograph converted a function: {with_autograph}"
             + "".join(f"\n  {count:5d}  {name}" for name, count in converted.most_common(10)))
  fixtures = collections.defaultdict(set)
  for line in lines:
    for arg in line["argv"]:
      match = re.search(r"/(popen-gw\d+)/([^/]+)/", str(arg))
      if match and not match.group(2).startswith("test_"):
        fixtures[match.group(2)].add(match.group(1))
  twice = {name: sorted(workers) for name, workers in fixtures.items() if len(workers) > 1}
  out.append(f"module fixtures built on more than one worker: {twice or 'none'}")
  return "\n".join(out)


def main(argv: list[str]) -> int:
  log = None
  if argv[:1] and argv[0].startswith("--log="):
    log, argv = argv[0].split("=", 1)[1], argv[1:]
  if not log:
    descriptor, log = tempfile.mkstemp(prefix="tfdp-proclog-", suffix=".jsonl")
    os.close(descriptor)
  log = Path(log)
  log.write_text("")
  env = dict(os.environ, TFDP_PROCLOG=str(log),
             PYTHONPATH=os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")])))
  code = subprocess.call([sys.executable, "-m", "pytest", *(argv or README_TEST_ARGS)],
                         cwd=str(REPO), env=env)
  lines = [json.loads(text) for text in log.read_text().splitlines() if text.strip()]
  print(summary(lines))
  print(f"log: {log}")
  return code


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
