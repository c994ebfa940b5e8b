"""The private network a local worker group runs in, and how each worker is started.

TensorFlow's gRPC servers listen on every interface with no authentication (see launch.py), so
anyone who reaches a worker's port can make it read and write files as the training user. A
local group needs loopback only: `PrivateNetwork` starts a small holder process in a new user +
network namespace (unprivileged: CLONE_NEWUSER makes the caller root of that namespace only)
whose loopback is up and nothing else, and every worker joins it before it execs the command.
No process outside the group can then reach the ports, whatever address TF binds. Only the
network is private: the workers keep the same files, pids, environment and user.

Each worker starts through `WORKER_SHIM` (a fresh, single-threaded `python -c`), never through
Popen's preexec_fn: code run between fork and exec in a threaded parent (a Jupyter kernel) can
deadlock on a lock another thread held at fork time. The shim joins the namespace (setns needs a
single-threaded caller), asks for SIGTERM when the launcher dies (PR_SET_PDEATHSIG, set after
setns, which would clear it) and execs the worker command, so the launcher's child pid is the
worker itself.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import select
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

from tfdp.errors import ClusterError

_READY_SECONDS = 10.0

# argv: parent pid, holder "pid:net-ns-inode" (0: no namespace), then the command. Errors: one
# line, exit 126/127. The inode guards against a reused pid: only the holder's namespace is joined.
WORKER_SHIM = r"""
import ctypes, errno, os, signal, sys
parent, holder, command = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
libc = ctypes.CDLL(None, use_errno=True)
if holder != "0":
  pid, inode = holder.split(":")
  for name, flag in (("user", 0x10000000), ("net", 0x40000000)):
    try:
      fd = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY)
      if name == "user" and os.stat(f"/proc/{pid}/ns/net").st_ino != int(inode):
        raise OSError(errno.ESRCH, "the namespace holder is gone")
      ok = libc.setns(fd, flag) == 0
      why = os.strerror(ctypes.get_errno())
      os.close(fd)
    except OSError as error:
      ok, why = False, error.strerror or str(error)
    if not ok:
      print(f"tfdp-launch: error: cannot join the group's private {name} namespace ({why}).",
            file=sys.stderr, flush=True)
      os._exit(126)
if sys.platform.startswith("linux"):
  libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
  if os.getppid() != parent:  # the launcher died before prctl took effect
    os._exit(128 + signal.SIGTERM)
try:
  os.execvp(command[0], command)
except OSError as error:
  print(f"tfdp-launch: error: cannot start worker command {command[0]!r}: "
        f"{error.strerror or error}", file=sys.stderr, flush=True)
  os._exit(127)
"""

# Runs as its own process: a new user + network namespace with loopback up, held until stdin
# closes (the launcher is done with it, or died). It forks away first, so that the launcher's
# children stay exactly its workers (tools and tests find the workers that way).
_HOLDER = r"""
import ctypes, fcntl, os, socket, struct, sys
if os.fork():
  os._exit(0)
uid, gid = os.getuid(), os.getgid()
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000 | 0x40000000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET
  print("unshare: " + os.strerror(ctypes.get_errno()), flush=True)
  sys.exit(1)
try:
  # Mapped to themselves: the workers keep their user (mapped to 0 they ran as root, and read
  # root's ~/.ssh); the holder, the namespace's creator, keeps its capabilities in it anyway.
  for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                     ("gid_map", f"{gid} {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
      f.write(text)
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # ip link set lo up
    request = struct.pack("16sH", b"lo", 0)
    flags = struct.unpack("16sH", fcntl.ioctl(sock, 0x8913, request)[:18])[1]  # SIOCGIFFLAGS
    fcntl.ioctl(sock, 0x8914, struct.pack("16sH", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP
except OSError as error:
  print(f"loopback: {error.strerror or error}", flush=True)
  sys.exit(1)
print("ready", os.getpid(), flush=True)
sys.stdin.read()
"""


class PrivateNetwork:
  """A held user + network namespace with only loopback; `pid` is the holder's (None: none)."""

  def __init__(self):
    self.pid: int | None = None
    self.inode = 0  # of its network namespace
    self.failure = ""  # why there is none, for the warning line
    self._holder: subprocess.Popen | None = None

  def start(self) -> bool:
    if not sys.platform.startswith("linux"):
      self.failure = "network namespaces are Linux only"
      return False
    try:
      holder = subprocess.Popen(
          [sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, start_new_session=True)  # a Ctrl-C is the launcher's to handle
    except OSError as error:
      self.failure = error.strerror or str(error)
      return False
    self._holder = holder
    ready, _, _ = select.select([holder.stdout], [], [], _READY_SECONDS)
    line = holder.stdout.readline().decode(errors="replace").split() if ready else []
    if len(line) != 2 or line[0] != "ready":
      self.failure = " ".join(line) or "the namespace holder did not start"
      self.close()
      return False
    self.pid = int(line[1])
    try:
      self.inode = os.stat(f"/proc/{self.pid}/ns/net").st_ino
    except OSError as error:
      self.failure = error.strerror or str(error)
      self.close()
      return False
    holder.wait()  # the forking parent, gone already; the holder itself ends when stdin closes
    # Joining can be refused where creating was not (a seccomp filter on setns): try it once.
    try:
      probe = subprocess.run(worker_command([sys.executable, "-c", ""], self),
                             capture_output=True, text=True, timeout=_READY_SECONDS)
      failure = "" if probe.returncode == 0 else probe.stderr.strip() or "cannot join it"
    except (OSError, subprocess.TimeoutExpired) as error:
      failure = str(error)
    if failure:
      self.failure = failure.splitlines()[-1].removeprefix("tfdp-launch: error: ")
      self.close()
      return False
    return True

  def close(self) -> None:
    """Ends the holder (its stdin closes); the namespace goes when its last worker does."""
    holder, self._holder, self.pid = self._holder, None, None
    if holder is None:
      return
    for stream in (holder.stdin, holder.stdout):
      try:
        stream.close()
      except OSError:
        pass
    if holder.poll() is None:  # it never said ready
      holder.kill()
      holder.wait()


def worker_command(command: Sequence[str], network: PrivateNetwork | None) -> list[str]:
  """The argv that starts one worker through WORKER_SHIM (in `network` if it has a namespace)."""
  holder = (f"{network.pid}:{network.inode}" if network is not None and network.pid else "0")
  return [sys.executable, "-c", WORKER_SHIM, str(os.getpid()), holder, *command]


# PR_SET_PDEATHSIG reaches the launcher's own children only: a worker command that is a wrapper
# script (a shell that does not exec) leaves the real worker a grandchild, which would train on,
# unseen and holding model_dir's lock, after the launcher is killed. So every worker also
# inherits the read end of a pipe the launcher alone holds open and never writes: when the
# launcher ends, however, the read sees end-of-file and the worker stops as on SIGTERM.
LIFELINE_VAR = "TFDP_LAUNCHER_LIFELINE"  # "fd:inode" of that read end, in the workers' env
_lifeline: tuple[int, int] | None = None  # the launcher's (read, write) ends, made once
_watching = False


def lifeline() -> tuple[int, str]:
  """The launcher's side: the read end to pass to every worker, and its LIFELINE_VAR value. Both
  ends are kept open as long as the launcher lives (the kernel closes them when it ends)."""
  global _lifeline
  if _lifeline is None:
    _lifeline = os.pipe()  # not inheritable: only the workers get the read end (pass_fds)
  read = _lifeline[0]
  return read, f"{read}:{os.fstat(read).st_ino}"


def lifeline_fd() -> int | None:
  """The read end of the launcher's lifeline pipe, or None outside tfdp-launch or where the
  variable came without its pipe (a process the worker started with its fds closed): a
  descriptor must be that pipe to be read."""
  try:
    fd, inode = (int(part) for part in os.environ.get(LIFELINE_VAR, "").split(":"))
    status = os.fstat(fd)
  except (ValueError, OSError):
    return None
  return fd if stat.S_ISFIFO(status.st_mode) and status.st_ino == inode else None


def watch_lifeline(on_gone: Callable[[], None]) -> bool:
  """A worker's side: calls `on_gone` (in a daemon thread) once the launcher has ended. False,
  watching nothing, where there is no lifeline (lifeline_fd)."""
  global _watching
  fd = lifeline_fd()
  if _watching or fd is None:
    return _watching
  _watching = True

  def wait() -> None:
    try:
      while os.read(fd, 1):
        pass
    except OSError:
      return
    on_gone()
  threading.Thread(target=wait, name="tfdp-launcher-lifeline", daemon=True).start()
  return True


def is_loopback_host(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False  # A host name other than localhost: assume it is remote.


def _bind_as_tf(sock_list: list, port: int) -> socket.socket:
  """A socket bound where TF's server will listen: [::] dual-stack (0.0.0.0 without IPv6)."""
  try:
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
  except OSError:  # no IPv6 here: TF falls back to 0.0.0.0 as well
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  sock_list.append(sock)
  if sock.family == socket.AF_INET6:
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(("::", port))
  else:
    sock.bind(("0.0.0.0", port))
  return sock


def pick_free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
  """Returns n distinct ports that are free as TF binds them (every interface, both families).

  A port probed on 127.0.0.1 only can be held on another address ([::1], a v6-only [::], a
  NIC's address) and still look free; TF's [::] bind then fails. All sockets stay open until
  every port is picked, so the OS cannot hand out the same port twice. The ports are free only
  at this moment: a port taken before a worker binds it is retried by `launch` (bind failure).
  """
  sockets: list = []
  try:
    if not is_loopback_host(host):  # it must at least be an address of this machine
      with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host.strip("[]"), 0))
    ports: list[int] = []
    for _ in range(n + 8):  # a few spare tries: port 0 can race another process's bind
      if len(ports) == n:
        break
      try:
        ports.append(_bind_as_tf(sockets, 0).getsockname()[1])  # port 0: the OS picks
      except OSError as error:
        if error.errno != errno.EADDRINUSE:
          raise
    if len(ports) < n:
      raise OSError(errno.EADDRINUSE, "no free ports")
    return ports
  except OSError as error:  # socket.gaierror for an unknown name, EADDRNOTAVAIL for another's
    raise ClusterError(
        f"cannot open ports on host {host!r} ({error.strerror or error}); --host must be an "
        "address of this machine, e.g. 127.0.0.1 or this machine's IP.") from None
  finally:
    for sock in sockets:
      sock.close()


def open_network(num_workers: int, ports: Sequence[int],
                 private: bool) -> PrivateNetwork | None:
  """The group's private network namespace, or None (shared network) with one warning line."""
  where = f"{num_workers} worker{'s' if num_workers != 1 else ''} on ports " + ",".join(
      map(str, ports))
  if not private:
    _log(f"{where}; network: every interface (--allow_remote, or allow_remote=True in "
         "launch_notebook: reachable from the network).")
    return None
  network = PrivateNetwork()
  if network.start():
    _log(f"{where}; network: private namespace (loopback only).")
    return network
  _log(f"warning: no private network namespace here ({network.failure}); the workers' "
       "TensorFlow ports listen on every interface without authentication: any local user or "
       "host that reaches them can read and write files as you. Firewall them, or pass "
       "--allow_remote (allow_remote=True in launch_notebook) to accept this.")
  _log(f"{where}; network: every interface (not isolated).")
  return None


def _log(message: str) -> None:
  print(f"tfdp-launch: {message}", file=sys.stderr, flush=True)


# What a worker prints when its TF server cannot bind its port (taken after it was picked):
# TensorFlow's own line, or tfdp's (cluster.port_taken_error) with the bind's reason. Another
# "Address already in use" (a profiler's or TensorBoard's port) is the job's failure, never
# rerun for free (a review: any failure that printed it ran again, as a fresh start).
BIND_FAILURE_MARKERS = (("Could not start gRPC server",),
                        ("cannot listen on", "Address already in use"))


def bind_failure(last_lines: Sequence[Sequence[str]], first_failed: int | None) -> bool:
  """True if the worker that failed first could not bind its port."""
  if first_failed is None or first_failed >= len(last_lines):
    return False
  return any(all(part in line for part in marker) for line in last_lines[first_failed]
             for marker in BIND_FAILURE_MARKERS)
