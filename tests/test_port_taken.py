"""TensorFlow's bare 'Could not start gRPC server' (a port taken between rendezvous.py's check and
TensorFlow's own bind) leaves make_strategy's start-up block as one line naming the port."""
import json
import socket

import pytest

from tfdp.distributed import cluster as cluster_lib
from tfdp.distributed import isolation
from tfdp.distributed import startup as startup_lib
from tfdp.errors import ClusterError


def test_tensorflows_could_not_start_grpc_server_is_one_line_naming_the_port_and_the_fix():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with socket.socket() as holder:
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    cluster = cluster_lib.parse_tf_config(json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]},
        "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ClusterError) as raised:
      with startup_lib.StartupDeadline(cluster, 0):  # 0: no watcher process
        raise tf.errors.UnknownError(None, None, "Could not start gRPC server")
  line = str(raised.value)
  assert line == (
      f"worker 0 cannot listen on 127.0.0.1:{port} (port {port}: Address already in use; "
      "TensorFlow: Could not start gRPC server); give it another free port in TF_CONFIG's "
      f"cluster.worker[0], or stop what holds port {port} (`ss -ltnp 'sport = :{port}'` names it).")
  assert raised.value.exit_code == 2 and raised.value.__cause__ is None
  assert isolation.bind_failure([[line]], 0)  # tfdp-launch reruns the group with fresh ports


def test_other_errors_leave_the_start_up_block_as_they_are():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cluster = cluster_lib.parse_tf_config(json.dumps({
      "cluster": {"worker": ["127.0.0.1:2", "127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}))
  with pytest.raises(tf.errors.UnknownError, match="something else"):
    with startup_lib.StartupDeadline(cluster, 0):
      raise tf.errors.UnknownError(None, None, "something else")
