"""A 3-node Slurm in a box (tfdp/bench/box.py): slurmctld on box host 0 (10.77.0.1),
`slurmd -D -N nodeK` on hosts 1..3 (10.77.0.2-4, names node1..3 in each host's /etc/hosts),
each with its own spool, pid and log file, all under one SLURM_CONF in a folder of the caller's.
The machine's munged is shared through its socket (a filesystem socket crosses network
namespaces). The machine's own Slurm is not touched: its daemons listen in another network
namespace, and no file of the box is one of its files.

  result = slurm_box.run(folder, scenario, env)

Host 0 runs `python slurm_box.py --controller FOLDER`: slurmctld, then the scenario
(requeue_on_fewer_nodes) with sbatch/scontrol, then `scontrol shutdown`, so that every host's
command ends and the box with it; what it saw goes to FOLDER/events.json, daemon logs to
FOLDER/log.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from tfdp.bench import box as cluster_box

REPO = Path(__file__).resolve().parents[2]

NODES = 3
SETTINGS = Path(__file__).with_name("slurm_settings.conf")  # shared with start_slurm.sh
# cluster_box.UNSHARE without its user namespace: there --map-root-user denies setgroups(2),
# and slurmctld exits at start ("fatal: Failed to drop supplementary groups, setgroups:
# Operation not permitted"), slurmstepd too. As root, the network, mount and pid namespaces
# alone keep the box apart from the machine and end with it all the same.
ROOT_UNSHARE = [a for a in cluster_box.UNSHARE if a not in ("--user", "--map-root-user")]
MUNGE_SOCKET = "/run/munge/munge.socket.2"
# slurmstepd listens on SlurmdSpoolDir/<node>_<job>.<step>; a Unix socket path holds at most
# 107 bytes, and a longer one fails the job's launch ("launch failed requeued held"), as a
# pytest-xdist tmp_path did. The spools live in a short folder of their own.
SOCKET_PATH_MAX = 107
LONGEST_STEP_SOCKET = f"node{NODES}_67043328.{2**32 - 5}"  # MaxJobId, the batch step's id


def unavailable() -> str | None:
  """Why a Slurm box cannot run here, or None."""
  for tool in ("slurmctld", "slurmd", "sbatch", "scontrol"):
    if not shutil.which(tool):
      return f"{tool} is not installed (apt-get install slurm-wlm munge)"
  if not os.path.exists(MUNGE_SOCKET):
    return f"munged is not running ({MUNGE_SOCKET} missing; tests/scripts/start_slurm.sh starts it)"
  if os.geteuid() != 0:
    return "the Slurm box needs root (slurmctld cannot run in a user namespace, see run())"
  for tool in ("unshare", "ip"):
    if not shutil.which(tool):
      return f"{tool} is not installed (iproute2, util-linux)"
  probe = subprocess.run(ROOT_UNSHARE + ["ip", "link", "add", "name", "boxprobe", "type", "bridge"],
                         capture_output=True, text=True, timeout=30)
  if probe.returncode:
    return f"network namespaces are not allowed here ({probe.stderr.strip()[-200:]})"
  return None


def node_address(k: int) -> str:
  """Node k (1..NODES) is box host k."""
  return cluster_box.address(k)


def short_folder() -> Path:
  """A new folder short enough for the spools (SOCKET_PATH_MAX), e.g. /tmp/tfdpbox-k2x8a1."""
  return Path(tempfile.mkdtemp(prefix="tfdpbox-", dir="/tmp" if os.path.isdir("/tmp") else None))


def write_conf(folder: Path, spool: Path) -> Path:
  """slurm.conf for the box (SETTINGS, as tests/scripts/start_slurm.sh's), node names for /etc/hosts;
  slurmd's spool folders under `spool` (see SOCKET_PATH_MAX)."""
  longest = f"{spool}/node{NODES}/{LONGEST_STEP_SOCKET}"
  if len(longest) > SOCKET_PATH_MAX:
    raise ValueError(f"slurm_box: spool folder {spool} is too deep for slurmstepd's sockets "
                     f"({len(longest)} > {SOCKET_PATH_MAX} bytes); pass a shorter one")
  for sub in ["state", "log"]:
    (folder / sub).mkdir(parents=True, exist_ok=True)
  for k in range(1, NODES + 1):
    (spool / f"node{k}").mkdir(parents=True, exist_ok=True)
  hosts = folder / "hosts"
  hosts.write_text(Path("/etc/hosts").read_text() + f"{cluster_box.address(0)} ctl\n" + "".join(
      f"{node_address(k)} node{k}\n" for k in range(1, NODES + 1)))
  conf = folder / "slurm.conf"
  # slurmctld only runs where SlurmctldHost names this machine; the address says where it is.
  conf.write_text(f"""ClusterName=tfdpbox
SlurmctldHost={socket.gethostname().split('.')[0]}({cluster_box.address(0)})
{SETTINGS.read_text().strip()}
StateSaveLocation={folder}/state
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd-%n.log
NodeName=node[1-{NODES}] NodeAddr={cluster_box.SUBNET}.[2-{NODES + 1}] CPUs=2 State=UNKNOWN
PartitionName=box Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
  return conf


def host_command(folder: Path, script: list[str]) -> list[str]:
  """A box host's command: node names resolve in it, then `script` runs. `ip netns exec` mounts
  a fresh /sys without /sys/fs/cgroup, and slurmd's cgroup/v1 init will not start without a
  cgroup filesystem at /sys/fs/cgroup/systemd ("can't stat", then "Unexpected fs type"): a
  named hierarchy of the box's own, no controller, leaves the machine's cgroups alone."""
  mounts = (f"mount --bind {folder}/hosts /etc/hosts && mount -t tmpfs cgroup /sys/fs/cgroup"
            " && mkdir /sys/fs/cgroup/systemd"
            " && mount -t cgroup -o none,name=tfdpbox cgroup /sys/fs/cgroup/systemd")
  return ["sh", "-c", mounts + ' && exec "$@"', "sh", *script]


def slurmd_host(folder: Path, k: int) -> cluster_box.Host:
  wait = f"while [ ! -e {folder}/ready ]; do sleep 0.2; done; exec slurmd -D -N node{k}"
  return cluster_box.Host(host_command(folder, ["sh", "-c", wait]),
                          env={"SLURM_CONF": str(folder / "slurm.conf")})


def _box(folder: Path, spool: Path, scenario: dict, env: dict) -> cluster_box.Box:
  """Host 0: slurmctld and `scenario` (see controller); hosts 1..NODES: slurmd."""
  write_conf(folder, spool)
  (folder / "scenario.json").write_text(json.dumps(scenario))
  controller = cluster_box.Host(
      host_command(folder, [sys.executable, os.path.abspath(__file__), "--controller",
                            str(folder)]),
      env={**env, "SLURM_CONF": str(folder / "slurm.conf")})
  return cluster_box.Box([controller] + [slurmd_host(folder, k) for k in range(1, NODES + 1)])


def run(folder: Path, scenario: dict, env: dict) -> dict:
  """Runs `scenario` (requeue_on_fewer_nodes' keys; "timeout": seconds for all of it) on a box
  Slurm under `folder` with `env` for sbatch; cluster_box.Box.run's result. The box runs in
  root-owned namespaces (ROOT_UNSHARE) and kills every host (SIGKILL) at its own timeout: a
  minute after the scenario's, for the controller to cancel the job, shut Slurm down and write
  events.json."""
  spool = short_folder()
  try:
    with mock.patch.object(cluster_box, "UNSHARE", ROOT_UNSHARE):
      return _box(folder, spool, scenario, env).run(scenario["timeout"] + 60)
  finally:
    shutil.rmtree(spool, ignore_errors=True)


# ---- on box host 0 --------------------------------------------------------------------------


def _run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
  return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def _wait(what: str, ready, timeout: float, deadline: float = float("inf")) -> None:
  """Until ready(), at most `timeout` s and not past `deadline` (time.monotonic())."""
  until = min(time.monotonic() + timeout, deadline)
  while not ready():
    if time.monotonic() > until:
      raise TimeoutError(f"not {what} in time")
    time.sleep(0.5)


def node_states() -> dict:
  out = _run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split()
  return dict(zip(out[::2], out[1::2]))


def _job(job_id: str) -> tuple[str, str]:
  """(state, nodes) of a job in squeue; ("", "") once it is gone."""
  out = _run("squeue", "-h", "-j", job_id, "-o", "%T %N").stdout.split()
  return (out + ["", ""])[0], (out + ["", ""])[1]


def requeue_on_fewer_nodes(scenario: dict, events: dict, deadline: float) -> None:
  """sbatch the job; after its first checkpoint drain `drain` and requeue it (Slurm stops its
  steps with SIGTERM); start it again at once on the nodes left and wait for its end, all
  before `deadline`. The nodes and states seen go to `events`."""
  env = {k: v for k, v in os.environ.items() if k != "TFDP_RESTART_COUNT"}  # the box's, not ours
  submitted = subprocess.run(["sbatch", "--parsable", "--open-mode=append",
                              f"--output={scenario['output']}", scenario["script"],
                              *scenario["args"]], capture_output=True, text=True, timeout=60,
                             env=env, cwd=str(REPO))
  events["sbatch"] = submitted.stdout + submitted.stderr
  if submitted.returncode:
    raise RuntimeError(f"sbatch failed: {submitted.stderr}")
  job_id = events["job"] = submitted.stdout.strip().split(";")[0]
  checkpoints = Path(scenario["model_dir"]) / "checkpoints"
  # A clean-clone CI run once saw the job stay PENDING for its whole wait on idle nodes: say
  # why (squeue's reason) if it does, and ask the scheduler again once.
  try:
    _wait("the job running", lambda: _job(job_id)[0] != "PENDING", 15, deadline)
  except TimeoutError:
    events["pending_reason"] = _run("squeue", "-h", "-j", job_id, "-o", "%r").stdout.strip()
    _run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
  _wait("a first checkpoint", lambda: list(checkpoints.glob("ckpt-*.index"))
        or not _job(job_id)[0], math.inf, deadline)
  events["first_run"] = _job(job_id)
  if events["first_run"][0] != "RUNNING":
    raise RuntimeError(f"the job ended before its requeue: {events['first_run']}")
  for name, command in [("drain", ["update", f"NodeName={scenario['drain']}", "State=DRAIN",
                                   "Reason=slurm_box"]),
                        ("requeue", ["requeue", job_id])]:
    done = _run("scontrol", *command)
    if done.returncode:
      raise RuntimeError(f"scontrol {name} failed: {done.stderr}")
  _wait("the requeued job pending", lambda: _job(job_id)[0] in ("PENDING", ""), 120, deadline)
  # Slurm holds a requeued job back for 2 minutes; a real preemption waits for nodes anyway.
  # Not in the same second as the requeue: slurmd refuses a credential made in the second it
  # revoked the job's last one ("Job credential revoked", seen once in test_slurm's CI run).
  time.sleep(1.1)
  done = _run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
  if done.returncode:
    raise RuntimeError(f"scontrol update StartTime failed: {done.stderr}")
  _wait("the requeued job running", lambda: _job(job_id)[0] in ("RUNNING", ""), 60, deadline)
  events["second_run"] = _job(job_id)
  _wait("the requeued job's end", lambda: not _job(job_id)[0], math.inf, deadline)
  events["nodes_after"] = node_states()


def _stop(signum, frame) -> None:
  raise SystemExit(f"controller: signal {signum}")  # the box stops the hosts: shut Slurm down


def controller(folder: Path) -> None:
  """Host 0's command: slurmctld, the scenario, then every daemon shut down. Writes
  events.json (what it saw) whatever happens."""
  signal.signal(signal.SIGTERM, _stop)
  scenario = json.loads((folder / "scenario.json").read_text())
  deadline = time.monotonic() + scenario["timeout"]
  events = {}
  ctld = subprocess.Popen(["slurmctld", "-D"], stdout=open(folder / "log" / "slurmctld.out", "w"),
                          stderr=subprocess.STDOUT)
  try:
    _wait("slurmctld up", lambda: "UP" in _run("scontrol", "ping").stdout, 60, deadline)
    (folder / "ready").touch()
    _wait(f"{NODES} nodes idle", lambda: list(node_states().values()) == ["idle"] * NODES, 60,
          deadline)
    events["nodes_before"] = node_states()
    requeue_on_fewer_nodes(scenario, events, deadline)
  except Exception as e:  # pylint: disable=broad-except
    events["error"] = f"{type(e).__name__}: {e}"
    raise
  finally:
    events["jobs_left"] = _run("squeue", "-h", "-o", "%i %T").stdout.split("\n")[:-1]
    if events["jobs_left"]:  # slurmstepd outlives slurmd: end the jobs first
      _run("scancel", "--full", *[line.split()[0] for line in events["jobs_left"]])
      try:
        _wait("cancelled jobs gone", lambda: not _run("squeue", "-h").stdout.strip(), 30)
      except TimeoutError:
        pass
    (folder / "events.json").write_text(json.dumps(events))
    _run("scontrol", "shutdown")  # slurmctld and every slurmd: the hosts' commands end
    try:
      ctld.wait(timeout=30)
    except subprocess.TimeoutExpired:
      ctld.kill()


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--controller":
    controller(Path(sys.argv[2]))
  else:
    sys.exit("usage: python slurm_box.py --controller FOLDER (slurm_box.box runs this)")
