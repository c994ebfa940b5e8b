"""Is the default job's RSS creep after epoch 2 a leak or the allocator? (BENCHMARKS.md, Memory)

Runs the default job's model and recipe on a small slice of CIFAR-10 for many epochs, once per
allocator setting, each as its own `tfdp-train` process (apps/train.py's main, run in a child
of this script so it can also read the allocator's own books), then writes
benchmarks/results/rss/rss.csv and rss.png: RSS per epoch, one line per run.

  python benchmarks/rss_creep.py                       # all runs below, ~5 min each on 2 cores
  python benchmarks/rss_creep.py --runs=glibc,jemalloc --epochs=10
  python benchmarks/rss_creep.py --plot_only           # redraw from the committed rss.csv

Each epoch's end (after its evaluation and checkpoint) the child also records glibc's
mallinfo2(): bytes in use by the program (`heap_in_use_mb`, a leak grows it) against bytes the
allocator holds free (`heap_free_mb`, fragmentation grows it), plus the count of objects the
Python gc tracks (live and not yet collected). `glibc_gc_each_epoch` runs a full gc.collect()
there; `glibc_trace` turns tracemalloc on after epoch 1 and writes trace_top.txt: what each
full collection found unreachable, by type and by where it was allocated.
"""
import argparse
import csv
import ctypes
import gc
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = "/usr/lib/x86_64-linux-gnu"
# name -> (environment added, tfdp-train overrides added, trace Python allocations)
RUNS = {
    "glibc": ({}, "", False),  # as shipped
    "glibc_arena2": ({"MALLOC_ARENA_MAX": "2"}, "", False),
    # A fixed mmap threshold: every block of >= 128 KiB (tensors) is its own mapping, returned
    # to the kernel when freed, instead of glibc's threshold rising to 32 MiB after the first
    # free and the big blocks then being carved from (and fragmenting) the heap arenas.
    "glibc_mmap128k": ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "", False),
    "jemalloc": ({"LD_PRELOAD": f"{LIB}/libjemalloc.so.2"}, "", False),
    "tcmalloc": ({"LD_PRELOAD": f"{LIB}/libtcmalloc_minimal.so.4"}, "", False),
    "glibc_noeval": ({}, "trainer.eval_every_epochs=1000", False),
    "glibc_trace": ({}, "", True),
    "glibc_gc_each_epoch": ({}, "", False),  # the probe first runs a full gc.collect()
}
PROBE_FIELDS = ["epoch", "rss_end_mb", "heap_in_use_mb", "heap_free_mb", "heap_mmap_mb",
                "py_objects", "traced_mb"]
CSV_FIELDS = ["run", "env", "epoch", "rss_mb", "peak_rss_mb", "epoch_seconds", "eval_accuracy",
              *PROBE_FIELDS[1:]]


class _Mallinfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
      "fordblks", "keepcost")]


def _mallinfo2():
  """glibc's books over all arenas, or None (another allocator, or an older glibc)."""
  try:
    fn = ctypes.CDLL(None).mallinfo2
  except AttributeError:
    return None
  fn.restype = _Mallinfo2
  return fn()


def child(argv):
  """Runs tfdp-train's main in this process; after each epoch's metrics row, one probe row."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--probe_csv", required=True)
  parser.add_argument("--trace_out", default="")
  parser.add_argument("--trace_from_epoch", type=int, default=2)
  parser.add_argument("--collect", action="store_true", help="gc.collect() at each epoch's end")
  args, train_argv = parser.parse_known_args(argv)
  import psutil  # pylint: disable=g-import-not-at-top
  import tracemalloc  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, ROOT)
  from tfdp.core import outputs  # pylint: disable=g-import-not-at-top
  from apps import train  # pylint: disable=g-import-not-at-top
  append_metrics = outputs.append_metrics
  first = {}  # at trace_from_epoch: tracemalloc snapshot and live objects by type

  def by_type():
    counts = {}
    for obj in gc.get_objects():
      counts[type(obj).__qualname__] = counts.get(type(obj).__qualname__, 0) + 1
    return counts

  def probed(plan, row):
    append_metrics(plan, row)
    if args.collect:
      gc.collect()
    info = _mallinfo2()
    mb = lambda n: n / 2**20
    probe = {"epoch": row["epoch"], "rss_end_mb": mb(psutil.Process().memory_info().rss),
             "heap_in_use_mb": mb(info.uordblks) if info else "",
             "heap_free_mb": mb(info.fordblks) if info else "",
             "heap_mmap_mb": mb(info.hblkhd) if info else "",
             "py_objects": len(gc.get_objects()), "traced_mb": ""}
    if args.trace_out and row["epoch"] == args.trace_from_epoch - 1:
      tracemalloc.start(8)  # from here only: under it, TensorFlow's imports take many minutes
    if args.trace_out and tracemalloc.is_tracing():
      probe["traced_mb"] = mb(tracemalloc.get_traced_memory()[0])
      if row["epoch"] == args.trace_from_epoch:
        gc.collect()  # from here on, what a collection frees is kept in gc.garbage to be read
        first.update(snapshot=tracemalloc.take_snapshot(), types=by_type(), epoch=row["epoch"])
        gc.set_debug(gc.DEBUG_SAVEALL)
      elif first:
        snapshot, types = tracemalloc.take_snapshot(), by_type()
        gc.collect()
        _write_trace(args.trace_out, first["epoch"], row["epoch"], first, snapshot,
                     types, gc.garbage)
        gc.garbage.clear()
        gc.set_debug(0)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        first.update(snapshot=tracemalloc.take_snapshot(), types=by_type(), epoch=row["epoch"])
    new = not os.path.exists(args.probe_csv)
    with open(args.probe_csv, "a", newline="") as f:
      writer = csv.DictWriter(f, PROBE_FIELDS)
      if new:
        writer.writeheader()
      writer.writerow(probe)

  outputs.append_metrics = probed
  sys.argv = ["tfdp-train", *train_argv]
  train.run()


def _where(frames):
  """A traceback's first frames, paths short (the repo's relative, packages' from the package)."""
  def short(name):
    if name.startswith(ROOT):
      return os.path.relpath(name, ROOT)
    return name.split("site-packages/")[-1]
  return " <- ".join(f"{short(fr.filename)}:{fr.lineno}" for fr in list(frames)[:4])


def _top(counts, n=15):
  return [f"{k:8d}  {v}" for k, v in sorted(((k, v) for v, k in counts.items()), reverse=True)[:n]]


def _write_trace(path, epoch_a, epoch_b, first, snapshot, types, garbage):
  """Python-traced memory and live objects by type, epoch_a -> epoch_b (before a full
  collection), and what that collection then found unreachable (cyclic garbage)."""
  import tracemalloc  # pylint: disable=g-import-not-at-top
  lines = [f"cyclic garbage a full collection found after epoch {epoch_b} (made since "
           f"epoch {epoch_a}): {len(garbage)} objects"]
  kinds, sites = {}, {}
  for obj in garbage:
    kinds[type(obj).__qualname__] = kinds.get(type(obj).__qualname__, 0) + 1
    tb = tracemalloc.get_object_traceback(obj)
    if tb is not None:
      key = _where(tb)
      sites[key] = sites.get(key, 0) + 1
  lines += _top(kinds)
  lines.append("allocated at (most recent frame first):")
  lines += _top(sites)
  lines.append(f"tracemalloc: top growth, epoch {epoch_a} -> {epoch_b}, before the collection")
  for stat in snapshot.compare_to(first["snapshot"], "traceback")[:12]:
    lines.append(f"{stat.size_diff / 1024:+10.1f} KiB {stat.count_diff:+7d} blocks  "
                 + _where(stat.traceback))
  total = sum(s.size_diff for s in snapshot.compare_to(first["snapshot"], "filename"))
  lines.append(f"total traced growth: {total / 2**20:+.2f} MiB")
  lines.append(f"live objects by type: top growth, epoch {epoch_a} -> {epoch_b}")
  growth = sorted(((n - first["types"].get(t, 0), t) for t, n in types.items()), reverse=True)
  lines += [f"{d:+8d}  {t}" for d, t in growth[:12] if d]
  with open(path, "a") as f:
    f.write("\n".join(lines) + "\n\n")


def run_one(name, args):
  env_add, override, trace = RUNS[name]
  run_dir = os.path.join(args.work_dir, name)
  os.makedirs(run_dir, exist_ok=True)
  probe_csv = os.path.join(run_dir, "probe.csv")
  if os.path.exists(probe_csv):
    os.remove(probe_csv)
  overrides = (f"task.train_data.split={args.train_split},task.eval_data.split={args.eval_split},"
               f"trainer.epochs={args.epochs}" + (f",{override}" if override else ""))
  cmd = ["nice", "-n", str(args.nice), sys.executable, os.path.abspath(__file__), "--child",
         f"--probe_csv={probe_csv}",
         *([f"--trace_out={os.path.join(args.out_dir, 'trace_top.txt')}"] if trace else []),
         *(["--collect"] if name == "glibc_gc_each_epoch" else []),
         f"--config_file={os.path.join(ROOT, 'configs/cifar10_quick.yaml')}",
         f"--params_override={overrides}", f"--model_dir={os.path.join(run_dir, 'model')}",
         "--start_over"]
  env = {**os.environ, **env_add, "PYTHONPATH": ROOT}
  start = time.time()
  with open(os.path.join(run_dir, "log.txt"), "w") as log:
    code = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
  print(f"{name}: exit {code} in {time.time() - start:.0f} s ({run_dir}/log.txt)", flush=True)
  return name, run_dir, code


def collect(name, run_dir):
  env_add, override, _ = RUNS[name]
  env_text = " ".join(f"{k}={os.path.basename(v)}" for k, v in env_add.items()) or "-"
  if override:
    env_text += f" ({override})"
  with open(os.path.join(run_dir, "model", "metrics.csv")) as f:
    metrics = {int(r["epoch"]): r for r in csv.DictReader(f)}
  probe = {}
  if os.path.exists(os.path.join(run_dir, "probe.csv")):
    with open(os.path.join(run_dir, "probe.csv")) as f:
      probe = {int(r["epoch"]): r for r in csv.DictReader(f)}
  rows = []
  for epoch, m in sorted(metrics.items()):
    p = probe.get(epoch, {})
    rows.append({"run": name, "env": env_text, "epoch": epoch,
                 **{k: m.get(k, "") for k in ("rss_mb", "peak_rss_mb", "epoch_seconds",
                                              "eval_accuracy")},
                 **{k: p.get(k, "") for k in PROBE_FIELDS[1:]}})
  return rows


def plot(csv_path, png_path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  with open(csv_path) as f:
    rows = list(csv.DictReader(f))
  runs = list(dict.fromkeys(r["run"] for r in rows))
  fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(18, 6))
  for i, run in enumerate(runs):
    color = f"C{i}"  # one colour per run in every panel
    mine = [r for r in rows if r["run"] == run]
    objects = [r for r in mine if r["py_objects"]]
    cx.plot([int(r["epoch"]) for r in objects], [int(r["py_objects"]) / 1000 for r in objects],
            marker=".", color=color,
            label=run + (" (gc.collect() each epoch from 2)" if "trace" in run else ""))
    if "trace" in run:  # tracemalloc's own memory is in its RSS
      continue
    ax.plot([int(r["epoch"]) for r in mine], [float(r["rss_mb"]) for r in mine], marker=".",
            color=color, label=f"{run} ({mine[0]['env']})")
    heap = [r for r in mine if r["heap_in_use_mb"] and float(r["heap_in_use_mb"]) > 1]
    if heap:
      bx.plot([int(r["epoch"]) for r in heap], [float(r["heap_in_use_mb"]) for r in heap],
              marker=".", color=color, label=f"{run}: in use")
      bx.plot([int(r["epoch"]) for r in heap], [float(r["heap_free_mb"]) for r in heap],
              ls="--", color=color, label=f"{run}: held free")
      bx.plot([int(r["epoch"]) for r in heap], [float(r["heap_mmap_mb"]) - 1000 for r in heap],
              ls=":", color=color, label=f"{run}: mmapped blocks - 1000")
  ax.set(xlabel="epoch", ylabel="RSS at the epoch's end (MB, metrics.csv)",
         title="RSS per epoch, one line per allocator")
  bx.set(xlabel="epoch", ylabel="MB", title="glibc malloc's books (mallinfo2), after eval+save")
  cx.set(xlabel="epoch", ylabel="thousands", title="Python objects tracked by gc (live + garbage)")
  for a in (ax, bx, cx):
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
    a.xaxis.get_major_locator().set_params(integer=True)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)


def main():
  if sys.argv[1:2] == ["--child"]:
    return child(sys.argv[2:])
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--runs", default=",".join(RUNS), help=f"of {', '.join(RUNS)}")
  parser.add_argument("--epochs", type=int, default=20)
  parser.add_argument("--train_split", default="train[:5000]")  # 5 steps of 1000
  parser.add_argument("--eval_split", default="test[:1000]")
  parser.add_argument("--parallel", type=int, default=1, help="runs at a time")
  parser.add_argument("--nice", type=int, default=5)
  parser.add_argument("--work_dir", default="/tmp/rss_creep")
  parser.add_argument("--out_dir", default=os.path.join(ROOT, "benchmarks/results/rss"))
  parser.add_argument("--plot_only", action="store_true")
  parser.add_argument("--collect_only", action="store_true", help="read finished runs' files")
  args = parser.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  csv_path = os.path.join(args.out_dir, "rss.csv")
  if not args.plot_only:
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
      parser.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    from concurrent.futures import ThreadPoolExecutor  # pylint: disable=g-import-not-at-top
    if args.collect_only:
      done = [(n, os.path.join(args.work_dir, n), 0) for n in names]
    else:
      with ThreadPoolExecutor(args.parallel) as pool:
        done = list(pool.map(lambda n: run_one(n, args), names))
    rows = [row for name, run_dir, code in done if code == 0 for row in collect(name, run_dir)]
    if os.path.exists(csv_path):  # other runs' rows, from an earlier invocation, stay
      with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["run"] not in names] + rows
    with open(csv_path, "w", newline="") as f:
      writer = csv.DictWriter(f, CSV_FIELDS)
      writer.writeheader()
      writer.writerows(rows)
  plot(csv_path, os.path.join(args.out_dir, "rss.png"))
  print(f"wrote {csv_path} and rss.png")


if __name__ == "__main__":
  main()
