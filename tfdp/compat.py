"""Workarounds for TensorFlow/Keras behaviour, each with the reason and a test in test_compat.py.

Keep private imports (tensorflow.python…, keras.src…) here and nowhere else.
"""
from __future__ import annotations


def replica_local_statistics(model) -> list:
  """The variables Keras 3 updates on each replica separately: BatchNormalization's
  moving_mean/moving_variance are created with aggregation "none" (tf.keras 2 used MEAN), so under
  MirroredStrategy/MultiWorkerMirroredStrategy every replica updates its own copy from its own
  sub-batch and the copies drift apart; evaluation and export then read whichever copy sits on
  the device. (Measured here with Keras 3.15; no upstream issue found.) Returns the non-trainable
  float variables, to be averaged by `average_across_replicas`."""
  return [v for v in model.non_trainable_variables if "float" in str(v.dtype)]


def average_across_replicas(variables) -> None:
  """Call in replica context (inside strategy.run): sets every replica's copy to the mean of
  all copies, in one batched all-reduce. The moving averages are linear in their updates, so
  averaging after k local steps gives exactly what MEAN aggregation gives after every step,
  for one collective per k steps instead of one per variable per step (tf.keras 2's cost: under
  MultiWorkerMirroredStrategy each of those is a network round trip)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not variables:
    return
  context = tf.distribute.get_replica_context()
  means = context.all_reduce(tf.distribute.ReduceOp.MEAN, [tf.identity(v.value) for v in variables])
  for variable, mean in zip(variables, means):
    variable.assign(mean)


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


def agree_on_finite_gradients(grads):
  """Call in replica context, before `LossScaleOptimizer.apply_gradients`.

  Keras 3's LossScaleOptimizer (TF backend, `_tf_apply`) decides "gradients finite?" from the
  *first local replica's* gradients, before they are all-reduced (its comment assumes they
  already were, as tf.keras 2's were). A NaN on another replica is then applied to every
  replica's weights, and under MultiWorkerMirroredStrategy workers can disagree on skipping a
  step, after which the next all-reduce waits forever. Here every replica's verdict is summed
  in one scalar all-reduce; when any replica saw a non-finite value, every replica's gradients
  are made NaN, so every first replica skips the step and lowers the loss scale alike.
  Shown in tests/test_compat.py."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  local_bad = tf.cast(tf.logical_not(tf.reduce_all(
      [tf.reduce_all(tf.math.is_finite(_values(g))) for g in grads if g is not None])), tf.float32)
  bad = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, local_bad)
  poison = tf.where(bad > 0, float("nan"), 0.0)
  return [None if g is None else _add_to_values(g, poison) for g in grads]


def _values(grad):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _add_to_values(grad, scalar):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(grad.values + tf.cast(scalar, grad.values.dtype), grad.indices,
                            grad.dense_shape)
  return grad + tf.cast(scalar, grad.dtype)


def exchange_between_workers(rank: int, num_workers: int, value: str,
                             timeout_seconds: float) -> list[str]:
  """Every worker's `value`, in rank order, through the coordination service's key-value store
  (a private TF API). Unlike a collective, this works when workers disagree on their device
  counts, which is exactly what it is used to detect (TF calls unequal counts undefined)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  from tfdp.errors import ClusterError  # pylint: disable=g-import-not-at-top
  ctx, timeout_ms = context.context(), int(timeout_seconds * 1000)
  try:
    ctx.set_config_key_value(f"tfdp/plan/{rank}", value)
    values = [ctx.get_config_key_value(f"tfdp/plan/{i}", timeout_in_ms=timeout_ms)
              for i in range(num_workers)]
    # Nobody leaves (worker 0 hosts the service) before every worker has read every value.
    ctx.wait_at_barrier("tfdp/plan/read", timeout_ms)
  except tf.errors.OpError as e:
    raise ClusterError(f"the start-up check between workers failed ({type(e).__name__}: "
                       f"{e.message.splitlines()[0][:200]}); a peer stopped early: see its "
                       "error line, fix it and restart the group.") from None
  return values
