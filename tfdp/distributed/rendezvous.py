"""The workers find each other in Python before TensorFlow's start-up waits for them.

MultiWorkerMirroredStrategy waits for every peer inside C++ that holds the GIL, where no Python
thread runs: an operator's SIGTERM or Ctrl-C to a worker whose peer is late was taken only when
runtime.startup_timeout_seconds ran out (cluster.StartupDeadline's watcher process). So each
worker first holds its own port open with a plain listener (it accepts and closes, it runs
nothing) and connects to every peer's port until each has answered once, a peer's listener or
its TensorFlow server alike; only then does TensorFlow start, with every peer up. While waiting
here the main thread is in Python, so controller.StopRequest exits at once on a signal, and a
port another process holds is one line before TensorFlow tries it."""
from __future__ import annotations

import errno
import socket
import time

from absl import logging

from tfdp.distributed import cluster as cluster_lib
from tfdp.errors import ConfigError

POLL_SECONDS = 0.2
SAY_EVERY_SECONDS = 30.0


def _listen(cluster: cluster_lib.Cluster) -> socket.socket:
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
      listener.setblocking(False)
      return listener
    except OSError as e:
      listener.close()
      if e.errno == errno.EADDRINUSE:  # the words tfdp-launch reruns with fresh ports on
        raise cluster_lib.port_taken_error(cluster, e.strerror) from None
      if family == socket.AF_INET:
        raise ConfigError(f"{cluster.task_type} {cluster.task_index} cannot listen on {address} "
                          f"({e.strerror}); give it an address of this host in TF_CONFIG.") from None
  raise AssertionError("unreachable")


def _answers(address: str) -> bool:
  try:
    socket.create_connection(cluster_lib.split_address(address), timeout=1.0).close()
    return True
  except (OSError, ValueError):
    return False


def _drain(listener: socket.socket) -> None:
  """Accept and close what peers opened, so that the backlog never fills."""
  while True:
    try:
      connection, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
      return
    connection.close()


def wait_for_peers(cluster: cluster_lib.Cluster) -> float:
  """Returns once every other training task's port has answered; the seconds it took. The
  caller bounds it (cluster.StartupDeadline)."""
  if not cluster.is_multi_worker or cluster.task_type not in ("chief", "worker"):
    return 0.0
  where = f"{cluster.task_type} {cluster.task_index}"
  listener = _listen(cluster)
  started = said = time.monotonic()
  waiting = dict(cluster_lib.peers(cluster))
  try:
    while waiting:
      for name, address in list(waiting.items()):
        if _answers(address):
          del waiting[name]
      _drain(listener)
      if waiting:
        if time.monotonic() - said >= SAY_EVERY_SECONDS:
          said = time.monotonic()
          logging.info("cluster: %s waits for %s (%.0f s; SIGTERM or Ctrl-C stop it at once)",
                       where, ", ".join(f"{n} at {a}" for n, a in waiting.items()),
                       said - started)
        time.sleep(POLL_SECONDS)
  finally:
    listener.close()
  return time.monotonic() - started
