"""The rendezvous is a handshake: workers that disagree on who is who or on the cluster stop at
once with one line, and a port that answers but is no tfdp worker is waited past and named.

Most tests run the workers as threads of this process (rendezvous.wait_for_peers on real
loopback sockets); three run tfdp-train itself, one of them on two hosts of a box (network
namespaces). Before the handshake a port that took a connection
counted as the peer: two workers that both said index 0, or whose lists differed, passed, and one
died in TensorFlow with a traceback while the other waited runtime.startup_timeout_seconds and
blamed a stuck start-up; so did a worker whose peer's port another program held."""
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import helpers
from tfdp.bench import box
from tfdp.distributed import cluster as cluster_lib
from tfdp.distributed import launch as launcher
from tfdp.distributed import rendezvous
from tfdp.errors import ClusterError

TINY = ("task.train_data.source=synthetic,task.train_data.num_examples=64,"
        "task.train_data.image_size=8,task.train_data.num_classes=2,"
        "task.eval_data.source=synthetic,task.eval_data.num_examples=32,"
        "task.eval_data.image_size=8,task.eval_data.num_classes=2,trainer.global_batch_size=16,"
        "task.model.name=small_cnn,task.model.kwargs={},task.eval_flip=false,trainer.epochs=1")
INDEX_FIX = ("give each machine its own TF_CONFIG task.index, its address's position in "
             "cluster.worker")
LIST_FIX = "give every worker the same TF_CONFIG cluster, the same addresses in the same order."


def tf_config(addresses, index):
  return json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}})


def worker(addresses, index):
  return cluster_lib.parse_tf_config(tf_config(addresses, index))


class Worker(threading.Thread):
  """wait_for_peers in a thread: `.result` is its seconds or the error it raised, `.said` what it
  told the start-up watcher."""

  def __init__(self, addresses, index=None):
    """addresses and index: a TF_CONFIG worker's; or a Cluster."""
    super().__init__(daemon=True)
    self.cluster = addresses if index is None else worker(addresses, index)
    self.result, self.said = None, []
    self.start()

  def run(self):
    try:
      self.result = rendezvous.wait_for_peers(self.cluster, self.said.append)
    except ClusterError as error:
      self.result = error

  def outcome(self, seconds=10.0):
    self.join(seconds)
    assert not self.is_alive(), f"still waiting after {seconds} s: {self.said[-1:]}"
    return self.result


def addresses(count):
  return [f"127.0.0.1:{port}" for port in launcher.pick_free_ports(count)]


def test_workers_given_the_list_in_opposite_orders_both_stop_at_once_naming_the_difference():
  a, b = addresses(2)
  first, second = Worker([a, b], 0), Worker([b, a], 0)
  # each names the other as it meets it first: through its own call or the other's (a clean
  # clone under load met it through the other's, as the test below already allows)
  assert str(first.outcome()) in (
      f"worker 0: worker 1 at {b} lists cluster.worker[0] as {b}, this one as {a}; {LIST_FIX}",
      f"worker 0: a worker connecting from 127.0.0.1 lists cluster.worker[0] as {b}, this one "
      f"as {a}; {LIST_FIX}")
  assert str(second.outcome()) in (
      f"worker 0: worker 1 at {a} lists cluster.worker[0] as {a}, this one as {b}; {LIST_FIX}",
      f"worker 0: a worker connecting from 127.0.0.1 lists cluster.worker[0] as {a}, this one "
      f"as {b}; {LIST_FIX}")


def test_cluster_lists_of_different_lengths_stop_both_workers_within_seconds():
  a, b, c = addresses(3)
  started = time.monotonic()
  two, three = Worker([a, b], 0), Worker([a, b, c], 1)
  # each names the other as it meets it first: through its own call or the other's
  assert str(two.outcome()) in (
      f"worker 0: worker 1 at {b} has 3 addresses in cluster.worker, this one 2; {LIST_FIX}",
      f"worker 0: worker 1 (connecting from 127.0.0.1) has 3 addresses in cluster.worker, this "
      f"one 2; {LIST_FIX}")
  assert str(three.outcome()) in (
      f"worker 1: worker 0 at {a} has 2 addresses in cluster.worker, this one 3; {LIST_FIX}",
      f"worker 1: worker 0 (connecting from 127.0.0.1) has 2 addresses in cluster.worker, this "
      f"one 3; {LIST_FIX}")
  assert time.monotonic() - started < 5


def _serve_once(listener, hello):
  """A peer's side of one handshake, speaking `hello`; returns the hello it was sent back."""
  connection, _ = listener.accept()
  with connection:
    connection.sendall(json.dumps(hello).encode() + b"\n")
    return json.loads(connection.makefile().readline())


def test_a_worker_whose_peer_also_says_it_is_worker_0_stops_at_once():
  """The README's two-machine recipe with index 0 left on both: the first machine reaches the
  second's port, where a worker 0 of the same cluster answers."""
  a, b = addresses(2)
  with socket.create_server(cluster_lib.split_address(b)) as other_machine:
    other_machine.settimeout(10)
    first = Worker([a, b], 0)
    sent_back = _serve_once(other_machine, rendezvous._hello(worker([a, b], 0), "elsewhere"))
    assert str(first.outcome()) == (
        f"worker 0: worker 1 at {b} also says it is worker 0; {INDEX_FIX} (0 and 1).")
  assert (sent_back["type"], sent_back["index"]) == ("worker", 0)  # so that one can say it too


def test_under_slurm_a_second_worker_0_is_told_to_start_the_workers_with_one_srun():
  for _ in range(20):  # a port base whose next port is free: the other task's
    base = launcher.pick_free_ports(1)[0]
    try:
      other_task = socket.create_server(("127.0.0.1", base + 1))
      break
    except OSError:
      continue
  env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost",
         "SLURM_STEP_TASKS_PER_NODE": "2", "TFDP_SLURM_PORT_BASE": str(base)}
  with other_task:  # a task of another srun step, which also got SLURM_PROCID 0
    other_task.settimeout(10)
    first = Worker(cluster_lib.from_slurm(env))
    _serve_once(other_task, rendezvous._hello(cluster_lib.from_slurm(env), "other step"))
    assert str(first.outcome()) == (
        f"worker 0: worker 1 at localhost:{base + 1} also says it is worker 0; start the workers "
        "with one srun, which gives each task its own SLURM_PROCID.")


def test_a_concurrent_srun_step_of_the_same_job_is_a_port_taken_and_the_holder_goes_on(
    monkeypatch):
  """A review: two srun steps of one job running at once get the same ports; the second step's
  worker 0 was told to 'start the workers with one srun' (each step was one) and the first
  step's worker 0 died of that hello too. Now the second is told its port is taken by the other
  step, with the port base fix, and the first step meets its own peer."""
  for _ in range(20):  # a port base whose next port is free too
    base = launcher.pick_free_ports(1)[0]
    try:
      socket.create_server(("127.0.0.1", base + 1)).close()
      break
    except OSError:
      continue
  env = {"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost",
         "SLURM_STEP_TASKS_PER_NODE": "2", "TFDP_SLURM_PORT_BASE": str(base)}

  def step(step_id, rank):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_ID", str(step_id))  # read when the worker says its hello
    return Worker(cluster_lib.from_slurm(dict(env, SLURM_STEP_ID=str(step_id),
                                              SLURM_PROCID=str(rank))))
  first = step(0, 0)
  deadline = time.monotonic() + 10
  while isinstance(connection := cluster_lib.reach(f"localhost:{base}", 1.0), str):
    assert time.monotonic() < deadline, connection
  connection.close()
  line = str(step(1, 0).outcome())
  assert f"cannot listen on localhost:{base}" in line and "Address already in use" in line, line
  assert "Slurm job 7 step 0 holds it (srun steps running at once share their job's ports" in line
  assert "TFDP_SLURM_PORT_BASE=" in line and "one srun" not in line, line
  assert first.is_alive() and not isinstance(first.result, ClusterError)
  assert isinstance(step(0, 1).outcome(), float)  # the first step's own peer: both go on
  assert isinstance(first.outcome(), float)


def test_a_port_below_1024_names_the_port_not_the_host(monkeypatch):
  """A review: EACCES said 'give it an address of this host in TF_CONFIG'; the bind is on every
  interface, so only the port can fix it (and a Slurm cluster has no TF_CONFIG)."""
  import errno  # pylint: disable=g-import-not-at-top
  def refused(self, address):
    raise PermissionError(errno.EACCES, "Permission denied")
  monkeypatch.setattr(socket.socket, "bind", refused)
  with pytest.raises(Exception) as raised:
    rendezvous._listen(worker(["127.0.0.1:80", "127.0.0.1:81"], 0), {})
  assert str(raised.value) == (
      "worker 0 cannot listen on 127.0.0.1:80 (Permission denied); ports below 1024 are "
      "root's: give it a port of 1024 or more in TF_CONFIG's cluster.worker[0].")


def test_a_worker_that_is_told_it_is_worker_0_on_worker_1s_machine_reaches_itself():
  """The second machine of that recipe: worker 1's address is its own port."""
  a = addresses(1)[0]
  port = cluster_lib.split_address(a)[1]
  alone = Worker([a, f"localhost:{port}"], 0)
  assert str(alone.outcome()) == (f"worker 0: worker 1 at localhost:{port} is this worker itself "
                                  f"(worker 0); {INDEX_FIX} (0 and 1).")


def test_a_connecting_worker_that_also_says_it_is_worker_0_is_named_by_the_listener():
  a, b = addresses(2)
  first = Worker([a, b], 0)
  deadline = time.monotonic() + 10
  while not isinstance(answer := rendezvous.knock(a, rendezvous._hello(worker([a, b], 0), "twin")),
                       dict):
    assert time.monotonic() < deadline, answer
  assert str(first.outcome()) == (
      f"worker 0: a worker connecting from 127.0.0.1 also says it is worker 0; {INDEX_FIX} "
      "(0 and 1).")


def test_a_port_held_by_another_program_is_waited_past_and_named_then_the_real_peer_is_met():
  a, b = addresses(2)
  port = cluster_lib.split_address(b)[1]
  with socket.create_server(("127.0.0.1", port)) as foreign:  # takes connections, says nothing
    first = Worker([a, b], 0)
    time.sleep(5.0)  # past a hello's wait (rendezvous.HELLO_SECONDS) twice over
    assert first.is_alive(), first.result
    assert first.said[-1] == (
        f"worker 1 at {b} answers, but not as a tfdp worker: something else holds port {port} "
        f"there (`ss -ltnp 'sport = :{port}'` on that host names it)")
  second = Worker([a, b], 1)
  assert isinstance(first.outcome(), float) and isinstance(second.outcome(), float)
  assert first.said[-1] == ""  # the watcher is told the rendezvous is over


def test_late_and_restarted_peers_are_answered_and_every_port_is_free_when_all_have_met():
  a, b, c = addresses(3)
  first = Worker([a, b, c], 0)
  time.sleep(1.0)
  # worker 1 meets worker 0 and dies (its hello is the last it says); a new worker 1 comes later
  deadline = time.monotonic() + 10
  while not isinstance(
      answer := rendezvous.knock(a, rendezvous._hello(worker([a, b, c], 1), "first life")), dict):
    assert time.monotonic() < deadline, answer
  assert (answer["type"], answer["index"]) == ("worker", 0)
  assert answer["cluster"] == {"worker": [a, b, c]}
  time.sleep(1.0)
  second = Worker([a, b, c], 1)
  time.sleep(1.0)
  third = Worker([a, b, c], 2)
  for each in (first, second, third):
    assert isinstance(each.outcome(), float), each.result
  for address in (a, b, c):  # TensorFlow's server can bind every port now
    with socket.create_server(cluster_lib.split_address(address)):
      pass


def _start(model_dir, config, timeout_seconds):
  return subprocess.Popen(
      [sys.executable, helpers.TRAIN_APP, f"--model_dir={model_dir}", "--mode=train",
       f"--params_override={TINY},runtime.startup_timeout_seconds={timeout_seconds}"],
      env=helpers.env(TF_CONFIG=config), cwd=str(helpers.REPO), stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout):
  try:
    return proc.communicate(timeout=timeout)[1]
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()


def test_tfdp_train_workers_with_lists_in_opposite_orders_both_exit_2_with_one_line(tmp_path):
  """Seen before the handshake: one worker died in TensorFlow with a traceback ('unexpectedly tried
  to connect with a different incarnation'), the other waited the start-up timeout."""
  a, b = addresses(2)
  procs = [_start(tmp_path / "one", tf_config([a, b], 0), 300),
           _start(tmp_path / "two", tf_config([b, a], 0), 300)]
  stderrs = [_finish(proc, 120) for proc in procs]
  for proc, stderr, (mine, other) in zip(procs, stderrs, ((a, b), (b, a))):
    lines = [l for l in stderr.splitlines() if l.startswith("tfdp-")]
    assert proc.returncode == 2 and lines == [
        f"tfdp-train: error: worker 0: worker 1 at {other} lists cluster.worker[0] as {other}, "
        f"this one as {mine}; {LIST_FIX}"], stderr[-3000:]


def test_tfdp_train_names_a_peer_port_held_by_another_program_when_start_up_times_out(tmp_path):
  """Seen before the handshake: '... every other worker's port answers, so one of them is stuck in
  its own start-up'."""
  a, b = addresses(2)
  port = cluster_lib.split_address(b)[1]
  with socket.create_server(("127.0.0.1", port)):
    proc = _start(tmp_path / "run", tf_config([a, b], 0), 5)
    stderr = _finish(proc, 120)
  lines = [l for l in stderr.splitlines() if l.startswith("tfdp-") and " has waited " not in l]
  assert proc.returncode == -signal.SIGKILL and len(lines) == 1, stderr[-3000:]  # the note apart
  assert lines[0].startswith("tfdp-train: error: worker 0: the cluster did not assemble in 5s "
                             "(runtime.startup_timeout_seconds): "), lines[0]
  assert (f"worker 1 at {b} answers, but not as a tfdp worker: something else holds port {port} "
          f"there (`ss -ltnp 'sport = :{port}'` on that host names it); stopping this worker "
          "(SIGKILL)") in lines[0]


@pytest.mark.skipif(box.unavailable() is not None, reason=str(box.unavailable()))
@pytest.mark.xdist_group("many_processes")  # `pytest -n 2 --dist loadgroup`: a box at a time
def test_two_machines_both_left_at_index_0_each_exit_2_at_once_with_one_line(tmp_path):
  """The README's two-machine recipe with `"index": 0` on both, on two hosts of a box (network
  namespaces, each its own address, port 2222 on both). Seen before the handshake: host 0 died
  in TensorFlow with a traceback (a different incarnation), host 1 waited the start-up timeout."""
  command = [sys.executable, helpers.TRAIN_APP, "--mode=train",
             f"--params_override={TINY},runtime.startup_timeout_seconds=300"]
  hosts = [box.Host(command + [f"--model_dir={tmp_path / str(k)}"],
                    env={**helpers.env(), "TF_CONFIG": box.tf_config(0, 2)}) for k in range(2)]
  result = box.Box(hosts).run(timeout=150)
  second = f"{box.address(1)}:{box.PORT}"
  fix = f"{INDEX_FIX} (0 and 1)."
  expected = [  # each says it as it meets the other first: through its own call or the other's
      (f"worker 0: worker 1 at {second} also says it is worker 0; {fix}",
       f"worker 0: a worker connecting from {box.address(1)} also says it is worker 0; {fix}"),
      (f"worker 0: worker 1 at {second} is this worker itself (worker 0); {fix}",
       f"worker 0: a worker connecting from {box.address(0)} also says it is worker 0; {fix}")]
  codes = [host["returncode"] for host in result["hosts"]]
  assert 2 in codes, result["hosts"]
  for host, lines in zip(result["hosts"], expected):
    assert host["seconds"] < 90, host["log"][-3000:]  # the start-up timeout is 300 s
    said = [l for l in host["log"].splitlines() if l.startswith("tfdp-")]
    if host["returncode"] == 143:  # the box stops the group when its first host fails, as
      continue  # tfdp-launch does, so one host may be stopped before it says its own line
    assert host["returncode"] == 2 and len(said) == 1, host["log"][-3000:]
    assert said[0].removeprefix("tfdp-train: error: ") in lines, said[0]


@pytest.mark.parametrize("second_list, second_index, words", [
    ("same", 0, "also says it is worker 0; " + INDEX_FIX + " (0 and 1)."),
    ("reversed", 1, "lists cluster.worker[0] as {a}, this one as {b}; " + LIST_FIX),
])
def test_a_second_worker_on_one_host_given_the_same_port_names_the_mistake_and_both_stop(
    second_list, second_index, words):
  """Two processes of one host given one index (or the lists in opposite orders, so both get the
  same address): the second was told its port was taken, and the first waited the start-up
  timeout for a peer that had already gone."""
  a, b = addresses(2)
  first = Worker([a, b], 0)
  deadline = time.monotonic() + 10
  while isinstance(connection := cluster_lib.reach(a, 1.0), str):  # the first one listens
    assert time.monotonic() < deadline, connection
  connection.close()
  second = Worker([a, b] if second_list == "same" else [b, a], second_index)
  me = f"worker {second_index}"
  assert str(second.outcome()) == (
      f"{me}: the worker on this port ({a}) " + words.format(a=a, b=b))
  assert "connecting from 127.0.0.1" in str(first.outcome())  # at once, not after a timeout
