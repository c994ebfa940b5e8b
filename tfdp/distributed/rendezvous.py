"""The workers find each other in Python before TensorFlow's start-up waits for them.

MultiWorkerMirroredStrategy waits for every peer inside C++ that holds the GIL, where no Python
thread runs: an operator's SIGTERM or Ctrl-C to a worker whose peer is late was taken only when
runtime.startup_timeout_seconds ran out (startup.StartupDeadline's watcher process). So each
worker first holds its own port with a listener (a thread of its own) and connects to every
peer's port; only then does TensorFlow start, with every peer up. While waiting here the main
thread is in Python, so controller.StopRequest exits at once on a signal, and a port another
process holds is one line before TensorFlow tries it.

A port that merely answers proved nothing: two workers that both said index 0, or whose cluster
lists differed, passed, then one died in TensorFlow with a traceback and the other waited the
whole start-up timeout; a program of another kind on a peer's port counted as that peer. So each
connection is a handshake: the listener sends a hello (its task, cluster list and a token new in
each process), the connecting worker answers with its own, and each side checks the other's. A
difference stops the worker at once with one line; a port that does not say a hello is something
else, waited past and named when the start-up times out. A worker leaves (and closes its port
for TensorFlow) only once it has reached every peer and every peer has reached it, so no peer
ever needs its listener after it closed."""
from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from absl import logging

from tfdp.distributed import cluster as cluster_lib
from tfdp.errors import ClusterError, ConfigError

POLL_SECONDS = 0.2
SAY_EVERY_SECONDS = 30.0
PROTOCOL = "tfdp-rendezvous/1"
HELLO_SECONDS = 2.0  # a tfdp listener's thread sends its hello at once; silence this long: not one
MAX_HELLO_BYTES = 1 << 20
NOT_A_WORKER = "answers, but not as a tfdp worker"
OTHER_RUN = "answers as a worker of"  # ... another run's (rendezvous._other_run)


def _listen(cluster: cluster_lib.Cluster, hello: dict) -> socket.socket:
  """A listener on this task's port, on every interface as TensorFlow's server binds it."""
  address = cluster.cluster[cluster.task_type][cluster.task_index]
  port = cluster_lib.split_address(address)[1]
  for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
    try:
      listener = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 here
      continue
    try:
      listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      if family == socket.AF_INET6:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
      listener.bind((host, port))
      listener.listen(64)
      listener.settimeout(POLL_SECONDS)  # the thread's accept looks at its stop flag this often
      return listener
    except OSError as e:
      listener.close()
      if e.errno == errno.EADDRINUSE:
        _check_the_holder(cluster, hello, address)
        # the words tfdp-launch reruns with fresh ports on
        raise cluster_lib.port_taken_error(cluster, e.strerror) from None
      if family == socket.AF_INET:  # bound on every interface: the port, not the host
        where = ("TFDP_SLURM_PORT_BASE" if cluster.source == "slurm"
                 else f"TF_CONFIG's cluster.{cluster.task_type}[{cluster.task_index}]")
        fix = (f"ports below 1024 are root's: give it a port of 1024 or more in {where}"
               if e.errno == errno.EACCES else f"give it another port in {where}")
        raise ConfigError(f"{cluster.task_type} {cluster.task_index} cannot listen on {address} "
                          f"({e.strerror}); {fix}.") from None
  raise AssertionError("unreachable")


def _check_the_holder(cluster: cluster_lib.Cluster, hello: dict, address: str) -> None:
  """A worker of this very cluster on this task's port: two tasks given one index or lists in
  another order on one host. Named as such (and the holder stops too, on this hello), not as a
  port taken; a stranger on the port, another job's worker included, is a port taken."""
  theirs = knock(address, hello)
  if isinstance(theirs, dict) and _other_run(hello, theirs):  # same addresses, another srun
    raise cluster_lib.port_taken_error(
        cluster, "Address already in use",
        holder=f"{theirs['run']} holds it (srun steps running at once share their job's ports; "
               "give each its own TFDP_SLURM_PORT_BASE)")
  if isinstance(theirs, dict) and (sorted(sum(theirs["cluster"].values(), [])) ==
                                   sorted(sum(hello["cluster"].values(), []))):
    me = f"{cluster.task_type} {cluster.task_index}"
    problem = _disagreement(cluster, hello, theirs, f"the worker on this port ({address})", me)
    if problem:
      raise ClusterError(problem)


def _training(cluster: cluster_lib.Cluster) -> dict[str, list[str]]:
  return {kind: cluster.cluster[kind] for kind in ("chief", "worker") if kind in cluster.cluster}


def _hello(cluster: cluster_lib.Cluster, token: str) -> dict:
  """Who this worker is and the cluster it was given: what TensorFlow needs every worker to agree
  on. The token tells a worker that reached its own port from a restarted or a second worker;
  `run` a Slurm step from another step of its job, which computes the same addresses."""
  env = os.environ
  run = (f"Slurm job {env['SLURM_JOB_ID']} step {env.get('SLURM_STEP_ID', '?')}"
         if cluster.source == "slurm" and env.get("SLURM_JOB_ID") else None)
  return {"protocol": PROTOCOL, "type": cluster.task_type, "index": cluster.task_index,
          "cluster": _training(cluster), "token": token, "run": run}


def _other_run(mine: dict, theirs: dict) -> str | None:
  """The other run a hello comes from (a concurrent srun step of this job): not a peer."""
  run = theirs.get("run")
  return run if run and mine.get("run") and run != mine["run"] else None


def _read_hello(connection: socket.socket) -> dict | None:
  """The peer's hello line, or None if it sends none within HELLO_SECONDS."""
  data, deadline = b"", time.monotonic() + HELLO_SECONDS
  while b"\n" not in data and len(data) < MAX_HELLO_BYTES:
    left = deadline - time.monotonic()
    if left <= 0:
      return None
    connection.settimeout(left)
    chunk = connection.recv(65536)
    if not chunk:
      return None
    data += chunk
  try:
    hello = json.loads(data.partition(b"\n")[0])
  except ValueError:
    return None
  fields = ("type", "index", "cluster", "token")
  ours = isinstance(hello, dict) and hello.get("protocol") == PROTOCOL
  return hello if ours and all(field in hello for field in fields) else None


def _send(connection: socket.socket, hello: dict) -> None:
  connection.sendall(json.dumps(hello).encode() + b"\n")


def _disagreement(cluster: cluster_lib.Cluster, mine: dict, theirs: dict, who: str,
                  expected: str | None) -> str | None:
  """One line naming what differs between this worker and the peer `who` (expected: the task
  whose address this worker connected to; None for a peer that connected here), and the fix."""
  me = f"{cluster.task_type} {cluster.task_index}"
  slurm = cluster.source == "slurm"
  for kind in ("chief", "worker"):
    ours, others = mine["cluster"].get(kind, []), theirs["cluster"].get(kind, [])
    if ours == others:
      continue
    if len(ours) != len(others):
      what = (f"has {len(others)} address{'' if len(others) == 1 else 'es'} in cluster.{kind}, "
              f"this one {len(ours)}")
    else:
      at = next(i for i, (a, b) in enumerate(zip(ours, others)) if a != b)
      what = f"lists cluster.{kind}[{at}] as {others[at]}, this one as {ours[at]}"
    fix = ("start every task with one srun (and one TFDP_SLURM_PORT_BASE): they then compute the "
           "same list" if slurm else
           "give every worker the same TF_CONFIG cluster, the same addresses in the same order")
    return f"{me}: {who} {what}; {fix}."
  theirs_is = f"{theirs['type']} {theirs['index']}"
  if theirs["token"] == mine["token"]:
    said = f"is this worker itself ({me})"
  elif theirs_is == me:
    said = f"also says it is {me}"
  elif expected is not None and theirs_is != expected:
    said = f"says it is {theirs_is}"
  else:
    return None
  count = len(mine["cluster"].get(cluster.task_type, []))
  fix = ("start the workers with one srun, which gives each task its own SLURM_PROCID" if slurm else
         f"give each machine its own TF_CONFIG task.index, its address's position in "
         f"cluster.{cluster.task_type} ({'0 and 1' if count == 2 else f'0..{count - 1}'})"
         if count > 1 else "give each machine its own TF_CONFIG task, the type and index of its "
         "address in the cluster")
  return f"{me}: {who} {said}; {fix}."


def knock(address: str, hello: dict | None = None) -> dict | str:
  """The hello of the worker at `address` (after sending it `hello`, if given), or why there is
  none: `connection refused`, NOT_A_WORKER..."""
  connection = cluster_lib.reach(address, 1.0)
  if isinstance(connection, str):
    return connection
  with connection:
    try:
      theirs = _read_hello(connection)
      if theirs is not None and hello is not None:
        _send(connection, hello)  # even if it differs: the peer then names the difference too
    except OSError:
      theirs = None
  return theirs if theirs is not None else NOT_A_WORKER


class _Door:
  """This worker's port while it waits, served by a thread of its own (and one per connection):
  a peer is answered at once, whatever the main thread is doing, however often it comes back (a
  late or restarted peer alike), until close()."""

  def __init__(self, cluster: cluster_lib.Cluster, hello: dict):
    self.cluster, self.hello = cluster, hello
    self.me = f"{cluster.task_type} {cluster.task_index}"
    self.reached_by: set[str] = set()  # the peers whose hello agreed here
    self.problem = ""  # the first disagreement a connecting peer showed
    self._listener = _listen(cluster, hello)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._serve, name="tfdp-rendezvous", daemon=True)
    self._thread.start()

  def _serve(self) -> None:
    while not self._stop.is_set():
      try:
        connection, (host, *_) = self._listener.accept()
      except TimeoutError:
        continue
      except OSError:
        return
      threading.Thread(target=self._greet, args=(connection, host), daemon=True).start()

  def _greet(self, connection: socket.socket, host: str) -> None:
    with connection:
      try:
        connection.settimeout(HELLO_SECONDS)
        _send(connection, self.hello)
        theirs = _read_hello(connection)
      except OSError:
        return
    if (theirs is None or theirs["token"] == self.hello["token"]
        or _other_run(self.hello, theirs)):  # its own port taken: said on that side
      return  # not a tfdp worker (a port scan, a health check), or this worker reaching itself
    host, theirs_is = host.removeprefix("::ffff:"), f"{theirs['type']} {theirs['index']}"
    who = (f"a worker connecting from {host}" if theirs_is == self.me else
           f"{theirs_is} (connecting from {host})")
    problem = _disagreement(self.cluster, self.hello, theirs, who, None)
    if problem:
      self.problem = self.problem or problem
    else:
      self.reached_by.add(theirs_is)

  def close(self) -> None:
    """Stops serving and frees the port for TensorFlow's server."""
    self._stop.set()
    self._thread.join()
    self._listener.close()


def _waiting(cluster: cluster_lib.Cluster, why: dict[str, str]) -> str:
  """What this worker waits for, for its log and the start-up watcher's line."""
  addresses = dict(cluster_lib.peers(cluster))
  port = cluster_lib.split_address(cluster.cluster[cluster.task_type][cluster.task_index])[1]
  silent = [f"{name} at {addresses[name]} ({reason})" for name, reason in why.items()
            if reason not in (NOT_A_WORKER, "") and not reason.startswith(OTHER_RUN)]
  parts = ["no answer from " + ", ".join(silent)] if silent else []
  for name, reason in why.items():
    theirs = cluster_lib.split_address(addresses[name])[1]
    if reason == NOT_A_WORKER:
      parts.append(f"{name} at {addresses[name]} {NOT_A_WORKER}: something else holds port "
                   f"{theirs} there (`ss -ltnp 'sport = :{theirs}'` on that host names it)")
    elif reason.startswith(OTHER_RUN):
      parts.append(f"{name} at {addresses[name]} {reason}, which holds port {theirs} there")
    elif not reason:
      parts.append(f"{name} at {addresses[name]} answers but has not reached this worker's port "
                   f"{port} yet (check that it can reach this host's port {port})")
  return "; ".join(parts)


def wait_for_peers(cluster: cluster_lib.Cluster, say: Callable[[str], None] = lambda who: None
                   ) -> float:
  """Returns once this worker has reached every other training task's port and each has reached
  this one's, all agreeing on the cluster; the seconds it took. The caller bounds it
  (startup.StartupDeadline, whose watcher `say` tells what this worker waits for; "" at the end).

  Raises:
    ClusterError: a peer disagrees (one line naming it, what differs and the fix).
  """
  if not cluster.is_multi_worker or cluster.task_type not in ("chief", "worker"):
    return 0.0
  where = f"{cluster.task_type} {cluster.task_index}"
  hello = _hello(cluster, secrets.token_hex(8))
  door = _Door(cluster, hello)
  started = said = time.monotonic()
  reached: set[str] = set()  # the peers this worker reached, and that agreed
  why: dict[str, str] = {}  # why a peer is not reached yet
  told = None
  try:
    while True:
      for name, address in cluster_lib.peers(cluster):
        if name in reached:
          continue
        theirs = knock(address, hello)
        if isinstance(theirs, dict) and _other_run(hello, theirs):
          theirs = f"{OTHER_RUN} {theirs['run']}"
        if isinstance(theirs, str):
          why[name] = theirs
          continue
        problem = _disagreement(cluster, hello, theirs, f"{name} at {address}", name)
        if problem:
          raise ClusterError(problem)
        reached.add(name)
      if door.problem:
        raise ClusterError(door.problem)
      waiting = {name: "" if name in reached else why[name]
                 for name, _ in cluster_lib.peers(cluster)
                 if name not in reached or name not in door.reached_by}
      if not waiting:
        break
      who = _waiting(cluster, waiting)
      if who != told:
        told = who
        say(who)
      if time.monotonic() - said >= SAY_EVERY_SECONDS:
        said = time.monotonic()
        logging.info("cluster: %s waits (%.0f s; SIGTERM or Ctrl-C stop it at once): %s", where,
                     said - started, who)
      time.sleep(POLL_SECONDS)
  finally:
    door.close()
  say("")  # over: a start-up timeout from here on is TensorFlow's own
  return time.monotonic() - started
