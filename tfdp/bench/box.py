"""Cluster in a box: N hosts on this machine, each a network namespace with its own address on
one bridge, its link optionally rate-shaped, one command per host.

  box = tfdp.bench.box.Box([box.Host(cmd0), box.Host(cmd1, rate="100mbit")])
  result = box.run(timeout=300)      # exit codes, logs, bytes each host sent and received

Faults: `LinkDown`s take a host's link down and up again mid-run; with `restarts` the box
supervises the hosts as one group the way tfdp-launch --max_restarts does (tfdp-launch itself
cannot: it starts every worker on one address), so a failed group is rerun on every host with
TFDP_RESTART_COUNT set.

Everything runs inside `unshare --user --map-root-user --net --mount --pid`: no root needed where
user namespaces are allowed, nothing to clean up (the namespaces and every process in them end
with the box, also when the caller is killed). Hosts get 10.77.0.<k+1>, addresses that exist only
inside the box. Rate shaping is tc's `tbf` on both ends of each host's link; this kernel has no
`netem`, so there is no delay or loss emulation.
Used by tfdp-bench --mode=allreduce --hosts=box, tests/test_cluster_box.py,
tests/scripts/slurm_box.py and benchmarks/cluster_*.py; `python -m tfdp.bench.box --inside SPEC
RESULT` is the part that runs inside the namespaces.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tfdp.distributed.launch import PEER_FAILURE_GRACE_SECONDS
from tfdp.errors import EXIT_PERMANENT

SUBNET = "10.77.0"
PORT = 2222  # every host's own address: one port serves them all
BRIDGE = "box0"
UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork",
           "--kill-child", "--mount-proc"]


@dataclasses.dataclass
class Host:
  command: list[str]
  env: dict = dataclasses.field(default_factory=dict)
  rate: str = ""  # e.g. "100mbit", "1gbit"; empty: unshaped


@dataclasses.dataclass
class LinkDown:
  """Take host `host`'s link down `at` seconds after the start (or after `after_path` exists:
  e.g. a first checkpoint, whenever start-up ends), for `seconds`."""
  host: int
  at: float
  seconds: float
  after_path: str = ""


def address(index: int) -> str:
  return f"{SUBNET}.{index + 1}"


def tf_config(index: int, count: int, port: int = PORT) -> str:
  """TF_CONFIG for worker `index` of `count`, one per box host at its own address."""
  return json.dumps({"cluster": {"worker": [f"{address(k)}:{port}" for k in range(count)]},
                     "task": {"type": "worker", "index": index}})


def unavailable() -> str | None:
  """Why a box cannot be built here, or None."""
  for tool in ("unshare", "ip", "tc"):
    if not shutil.which(tool):
      return f"{tool} is not installed (iproute2, util-linux)"
  probe = subprocess.run(UNSHARE + ["sh", "-c", "ip link add name boxprobe type bridge && ip link del boxprobe"],
                         capture_output=True, text=True, timeout=30)
  if probe.returncode:
    return ("user + network namespaces are not allowed here "
            f"({(probe.stderr.strip().splitlines() or ['?'])[-1]})")
  return None


class Box:

  def __init__(self, hosts: list[Host], link_downs: list[LinkDown] = (), restarts: int = 0,
               marks: dict | None = None):
    """restarts: as tfdp-launch --max_restarts. marks: {name: text}; each run records, per
    host, the time its output first held each text."""
    self.hosts, self.link_downs = list(hosts), list(link_downs)
    self.restarts, self.marks = restarts, dict(marks or {})

  def run(self, timeout: float, workdir: str | None = None) -> dict:
    """Runs every host's command to its end (or `timeout`); returns {"hosts": [{"returncode",
    "log", "tx_bytes", "rx_bytes", "seconds"}...] (the last run; bytes: the whole box), "runs":
    [{"started", "returncodes", "ended", "first_failure", "marks", "logs", "left"}...] (one per
    start of the group; left: processes still alive in the box after it), "links": [{"host",
    "down", "up"}...], "seconds"}; times in seconds since the first start."""
    with tempfile.TemporaryDirectory(prefix="cluster-box-", dir=workdir) as folder:
      spec = os.path.join(folder, "spec.json")
      result = os.path.join(folder, "result.json")
      with open(spec, "w") as f:
        json.dump({"hosts": [dataclasses.asdict(h) for h in self.hosts],
                   "link_downs": [dataclasses.asdict(d) for d in self.link_downs],
                   "timeout": timeout, "folder": folder, "restarts": self.restarts,
                   "marks": self.marks}, f)
      proc = subprocess.run(UNSHARE + [sys.executable, "-m", "tfdp.bench.box", "--inside", spec,
                                       result],
                            capture_output=True, text=True, timeout=timeout + 60)
      if not os.path.exists(result):
        raise RuntimeError(f"the box did not run (exit {proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
      with open(result) as f:
        return json.load(f)


def run_cell_group(spec: dict, num_hosts: int, rate: str, what: str, timeout: float,
                   port: int = PORT) -> dict:
  """tfdp-bench's cell `spec` on `num_hosts` box hosts as one worker group (TF_CONFIG naming the
  hosts' addresses), each link shaped to `rate` ("" unshaped): see run_cells."""
  return run_cells([spec] * num_hosts, rate, what, timeout, port=port)


def run_cells(specs: list[dict], rate: str, what: str, timeout: float, *, group: bool = True,
              port: int = PORT, workdir: str | None = None) -> dict:
  """The tfdp-bench cell specs[k] on box host k, each link shaped to `rate` ("" unshaped); as one
  worker group (TF_CONFIG naming the hosts' addresses), or with `group` off each cell alone (to
  measure compute without communication): {"cells": each host's result, "tx", "rx": bytes each
  host sent and received, "wall_s"}."""
  from tfdp.bench import processes  # pylint: disable=g-import-not-at-top
  env = {**processes.child_env(), "CUDA_VISIBLE_DEVICES": ""}
  hosts = [Host(processes.cell_command(spec), rate=rate,
                env={**env, **({"TF_CONFIG": tf_config(k, len(specs), port)} if group else {})})
           for k, spec in enumerate(specs)]
  start = time.perf_counter()
  result = Box(hosts).run(timeout=timeout, workdir=workdir)
  wall = time.perf_counter() - start
  return {"cells": cell_results(result, what), "tx": [h["tx_bytes"] for h in result["hosts"]],
          "rx": [h["rx_bytes"] for h in result["hosts"]], "wall_s": wall}


def cell_results(result: dict, what: str) -> list[dict]:
  """Each host's tfdp-bench cell result (`python -m tfdp.bench CELL_JSON` as a host's command:
  its last result line); RuntimeError naming the first host that failed or printed none."""
  from tfdp.bench.processes import last_result  # pylint: disable=g-import-not-at-top
  outs = []
  for k, host in enumerate(result["hosts"]):
    out = last_result(host["log"])
    if host["returncode"] != 0 or out is None:
      raise RuntimeError(f"{what}: host {k} failed (exit {host['returncode']}): "
                         f"{host['log'][-2000:]}")
    outs.append(out)
  return outs


# ---- inside the namespaces ------------------------------------------------------------------


def _sh(*args: str) -> None:
  subprocess.run(args, check=True, capture_output=True, text=True)


def _counters(index: int) -> tuple[int, int]:
  out = subprocess.run(["ip", "-n", f"h{index}", "-s", "-j", "link", "show", "dev", "eth0"],
                       check=True, capture_output=True, text=True).stdout
  stats = json.loads(out)[0]["stats64"]
  return stats["tx"]["bytes"], stats["rx"]["bytes"]


def _shape(device: str, rate: str, namespace: str | None = None) -> None:
  where = ["ip", "netns", "exec", namespace] if namespace else []
  # burst: at least rate/HZ; 1 ms worth of bytes (min 32 KiB) keeps tbf exact at 1 Gbit/s.
  _sh(*where, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", "256kb",
      "latency", "100ms")


def build(hosts: list[dict]) -> None:
  os.makedirs("/run/netns", exist_ok=True)
  _sh("mount", "-t", "tmpfs", "box", "/run/netns")
  _sh("ip", "link", "set", "lo", "up")
  _sh("ip", "link", "add", BRIDGE, "type", "bridge")
  _sh("ip", "link", "set", BRIDGE, "up")
  for k, host in enumerate(hosts):
    ns = f"h{k}"
    _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", f"b{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
    _sh("ip", "link", "set", f"b{k}", "master", BRIDGE)
    _sh("ip", "link", "set", f"b{k}", "up")
    _sh("ip", "-n", ns, "addr", "add", f"{address(k)}/24", "dev", "eth0")
    _sh("ip", "-n", ns, "link", "set", "eth0", "up")
    _sh("ip", "-n", ns, "link", "set", "lo", "up")
    if host["rate"]:
      _shape("eth0", host["rate"], ns)  # what the host sends
      _shape(f"b{k}", host["rate"])  # what it receives


class _Links:
  """Takes links down and up again as the LinkDowns say; records when it did."""

  def __init__(self, link_downs: list[dict]):
    self.pending = [dict(d, due=None if d["after_path"] else d["at"]) for d in link_downs]
    self.down = []  # (up at, event)
    self.events = []  # {"host", "down", "up"}: seconds since the box's start

  def tick(self, now: float) -> None:
    for d in self.pending:
      if d["due"] is None and os.path.exists(d["after_path"]):
        d["due"] = now + d["at"]
    for d in [d for d in self.pending if d["due"] is not None and d["due"] <= now]:
      self.pending.remove(d)
      _sh("ip", "link", "set", f"b{d['host']}", "down")
      event = {"host": d["host"], "down": now, "up": None}
      self.events.append(event)
      self.down.append((now + d["seconds"], event))
    for up_at, event in [u for u in self.down if u[0] <= now]:
      _sh("ip", "link", "set", f"b{event['host']}", "up")
      event["up"] = now
      self.down.remove((up_at, event))


class _Tail:
  """The lines a host's log gained since the last look: when each mark first showed."""

  def __init__(self, path: str, marks: dict):
    self.path, self.marks, self.offset, self.partial, self.seen = path, marks, 0, b"", {}

  def look(self, now: float) -> None:
    with open(self.path, "rb") as f:
      f.seek(self.offset)
      data = f.read()
    self.offset += len(data)
    *lines, self.partial = (self.partial + data).split(b"\n")
    for line in lines:
      for name, text in self.marks.items():
        if name not in self.seen and text.encode() in line:
          self.seen[name] = now


def _others_alive() -> list[str]:
  """Every process in the box's pid namespace but this one (pid 1), zombies aside."""
  import psutil  # pylint: disable=import-outside-toplevel
  alive = []
  for proc in psutil.process_iter(["pid", "status", "cmdline"]):
    if proc.info["pid"] != os.getpid() and proc.info["status"] != psutil.STATUS_ZOMBIE:
      alive.append(" ".join(proc.info["cmdline"] or [])[:200])
  return alive


def _run_group(hosts: list[dict], spec: dict, restart: int, links: _Links, clock) -> dict:
  """One start of every host's command, supervised as tfdp-launch supervises a group: the first
  host to fail gets the others SIGTERM, then SIGKILL after PEER_FAILURE_GRACE_SECONDS."""
  procs, logs, tails, ended = [], [], [], {}
  started = clock()
  for k, host in enumerate(hosts):
    path = os.path.join(spec["folder"], f"host{k}-run{restart}.log")
    logs.append(open(path, "w"))
    tails.append(_Tail(path, spec["marks"]))
    procs.append(subprocess.Popen(
        ["ip", "netns", "exec", f"h{k}", *host["command"]], stdout=logs[-1],
        stderr=subprocess.STDOUT, env={**os.environ, **host["env"],
                                       "TFDP_RESTART_COUNT": str(restart)}))
  first_failure = kill_at = None
  while len(ended) < len(procs):
    now = clock()
    links.tick(now)
    for k, proc in enumerate(procs):
      if k not in ended and proc.poll() is not None:
        ended[k] = now
        if proc.returncode and first_failure is None:
          first_failure, kill_at = now, now + PEER_FAILURE_GRACE_SECONDS
          for other in procs:
            if other.poll() is None:
              other.terminate()
    if now > spec["timeout"] or (kill_at is not None and now > kill_at):
      for proc in procs:
        if proc.poll() is None:
          proc.kill()
    for tail in tails:
      tail.look(now)
    time.sleep(0.05)
  left = _others_alive()
  texts = []
  for log in logs:
    log.close()
    with open(log.name) as f:
      texts.append(f.read()[-20000:])
  return {"started": started, "returncodes": [p.returncode for p in procs],
          "ended": [ended[k] for k in range(len(procs))], "first_failure": first_failure,
          "marks": [t.seen for t in tails], "logs": texts, "left": left}


def inside(spec_path: str, result_path: str) -> None:
  with open(spec_path) as f:
    spec = json.load(f)
  hosts = spec["hosts"]
  build(hosts)
  before = [_counters(k) for k in range(len(hosts))]
  start = time.monotonic()
  clock = lambda: time.monotonic() - start
  links, runs = _Links(spec["link_downs"]), []
  while True:
    run = _run_group(hosts, spec, len(runs), links, clock)
    runs.append(run)
    codes = run["returncodes"]
    if (not any(codes) or EXIT_PERMANENT in codes or len(runs) > spec["restarts"]
        or clock() > spec["timeout"]):
      break
  after = [_counters(k) for k in range(len(hosts))]
  last = runs[-1]
  results = [{"returncode": last["returncodes"][k], "log": last["logs"][k],
              "tx_bytes": after[k][0] - before[k][0], "rx_bytes": after[k][1] - before[k][1],
              "seconds": last["ended"][k]} for k in range(len(hosts))]
  with open(result_path, "w") as f:
    json.dump({"hosts": results, "runs": runs, "links": links.events, "seconds": clock()}, f)


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "--inside":
    inside(sys.argv[2], sys.argv[3])
  else:
    sys.exit("usage: python -m tfdp.bench.box --inside SPEC RESULT (Box.run runs this)")
