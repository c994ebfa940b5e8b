"""Cluster in a box: N hosts on this machine, each a network namespace with its own address on
one bridge, its link optionally rate-shaped, one command per host.

  box = cluster_box.Box([cluster_box.Host(cmd0), cluster_box.Host(cmd1, rate="100mbit")])
  result = box.run(timeout=300)      # exit codes, logs, bytes each host sent and received

Everything runs inside `unshare --user --map-root-user --net --mount --pid`: no root needed where
user namespaces are allowed, nothing to clean up (the namespaces and every process in them end
with the box, also when the caller is killed). Hosts get 10.77.0.<k+1>, addresses that exist only
inside the box. Rate shaping is tc's `tbf` on both ends of each host's link; this kernel has no
`netem`, so there is no delay or loss emulation.
Used by tests/test_cluster_box.py; `python benchmarks/cluster_box.py --inside SPEC RESULT` is the
part that runs inside the namespaces.
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

SUBNET = "10.77.0"
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
  """Take host `host`'s link down `at` seconds after the start, for `seconds`."""
  host: int
  at: float
  seconds: float


def address(index: int) -> str:
  return f"{SUBNET}.{index + 1}"


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

  def __init__(self, hosts: list[Host], link_downs: list[LinkDown] = ()):
    self.hosts, self.link_downs = list(hosts), list(link_downs)

  def run(self, timeout: float, workdir: str | None = None) -> dict:
    """Runs every host's command to its end (or `timeout`); returns {"hosts": [{"returncode",
    "log", "tx_bytes", "rx_bytes", "seconds"}...], "seconds"}."""
    with tempfile.TemporaryDirectory(prefix="cluster-box-", dir=workdir) as folder:
      spec = os.path.join(folder, "spec.json")
      result = os.path.join(folder, "result.json")
      with open(spec, "w") as f:
        json.dump({"hosts": [dataclasses.asdict(h) for h in self.hosts],
                   "link_downs": [dataclasses.asdict(d) for d in self.link_downs],
                   "timeout": timeout, "folder": folder}, f)
      proc = subprocess.run(UNSHARE + [sys.executable, os.path.abspath(__file__), "--inside",
                                       spec, result],
                            capture_output=True, text=True, timeout=timeout + 60)
      if not os.path.exists(result):
        raise RuntimeError(f"the box did not run (exit {proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
      with open(result) as f:
        return json.load(f)


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


def inside(spec_path: str, result_path: str) -> None:
  with open(spec_path) as f:
    spec = json.load(f)
  hosts, folder = spec["hosts"], spec["folder"]
  build(hosts)
  before = [_counters(k) for k in range(len(hosts))]
  procs, logs, ended = [], [], {}
  start = time.monotonic()
  for k, host in enumerate(hosts):
    log = open(os.path.join(folder, f"host{k}.log"), "w")
    logs.append(log)
    procs.append(subprocess.Popen(["ip", "netns", "exec", f"h{k}", *host["command"]],
                                  env={**os.environ, **host["env"]}, stdout=log,
                                  stderr=subprocess.STDOUT))
  pending = sorted(spec["link_downs"], key=lambda d: d["at"])
  downs = []  # (up at, host)
  while len(ended) < len(procs) and time.monotonic() - start < spec["timeout"]:
    now = time.monotonic() - start
    while pending and pending[0]["at"] <= now:
      down = pending.pop(0)
      _sh("ip", "link", "set", f"b{down['host']}", "down")
      downs.append((now + down["seconds"], down["host"]))
    for up_at, k in [d for d in downs if d[0] <= now]:
      _sh("ip", "link", "set", f"b{k}", "up")
      downs.remove((up_at, k))
    for k, proc in enumerate(procs):
      if k not in ended and proc.poll() is not None:
        ended[k] = time.monotonic() - start
    time.sleep(0.05)
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
  after = [_counters(k) for k in range(len(hosts))]
  results = []
  for k, (proc, log) in enumerate(zip(procs, logs)):
    log.close()
    with open(log.name) as f:
      text = f.read()
    results.append({"returncode": proc.wait(), "log": text[-20000:],
                    "tx_bytes": after[k][0] - before[k][0], "rx_bytes": after[k][1] - before[k][1],
                    "seconds": ended.get(k)})
  with open(result_path, "w") as f:
    json.dump({"hosts": results, "seconds": time.monotonic() - start}, f)


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "--inside":
    inside(sys.argv[2], sys.argv[3])
  else:
    sys.exit("usage: python benchmarks/cluster_box.py --inside SPEC RESULT (Box.run runs this)")
