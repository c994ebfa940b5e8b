"""Workarounds for TensorFlow/Keras behaviour, each with the reason and a test in test_compat.py.

Keep private imports (tensorflow.python…, keras.src…) here and nowhere else.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def mean_aggregated_moving_statistics():
  """Keras 3 creates BatchNormalization moving_mean/moving_variance with aggregation "none"
  (tf.keras 2 used MEAN). Under MirroredStrategy each replica then keeps its own copy, updated from
  its own sub-batch only, and the copies drift apart: evaluation and export read whichever copy
  sits on the device. (Measured here with Keras 3.15; no upstream issue found.) Inside this scope
  non-trainable float variables are created with MEAN aggregation, so the update is averaged over
  replicas and every copy stays equal, as in tf.keras 2."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def creator(next_creator, **kwargs):
    aggregation = kwargs.get("aggregation")
    dtype = kwargs.get("dtype")
    if (not kwargs.get("trainable", True)
        and aggregation in (None, tf.VariableAggregation.NONE)
        and dtype is not None and tf.as_dtype(dtype).is_floating):
      kwargs["aggregation"] = tf.VariableAggregation.MEAN
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    yield


def configure_coordination_service(cluster_spec: dict, task_type: str,
                                   heartbeat_timeout_seconds: float) -> None:
  """MultiWorkerMirroredStrategy starts TF's coordination service with a 10 s heartbeat timeout
  and no way to change it; a worker starved of CPU for longer (several workers on a loaded
  machine, a long graph build) is then declared dead and the job fails although nothing crashed.
  MWMS keeps a service that is already configured (collective_all_reduce_strategy.py:
  `if context.context().coordination_service is None`), so configure the same service first,
  with our timeout. The price: a frozen (not crashed) worker is noticed after this timeout;
  a crashed one is still noticed at once, by its broken connections."""
  from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  if task_type not in ("chief", "worker") or context.context().coordination_service is not None:
    return
  jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(cluster_spec[job]))
          for job in ("chief", "worker") if job in cluster_spec]
  leader = "/job:chief/replica:0/task:0" if "chief" in cluster_spec else "/job:worker/replica:0/task:0"
  context.context().configure_coordination_service(
      service_type="standalone", service_leader=leader, coordinated_jobs=jobs,
      heartbeat_timeout_in_ms=int(heartbeat_timeout_seconds * 1000))


def coordination_heartbeat_timeout_ms() -> int:
  """The heartbeat timeout the coordination service of this process uses (0: TF's default)."""
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  return context.context().config.experimental.coordination_config.heartbeat_timeout_in_ms
