"""Workarounds for TensorFlow/Keras behaviour, each with the reason and a test in test_compat.py.

Keep private imports (tensorflow.python…, keras.src…) here and nowhere else.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import threading
import types


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


def all_reduce_gradients(grads, wire_dtype=None, backward_order: bool = False):
  """Call in replica context: SUM-all-reduces the gradients (None stays None) the way Keras'
  optimizer does inside apply_gradients, so that tfdp can act on the *reduced* gradient first:
  clip it by global norm (Keras' clipnorm clips per replica, before the reduction) and let the
  loss-scale optimizer judge it (LossScaleOptimizer._tf_apply reads the first replica's
  gradients only, assuming they are reduced; they are not in Keras 3). Pair with
  `skip_optimizer_all_reduce`. `wire_dtype` (e.g. tf.bfloat16) casts dense float32 gradients
  for the reduction only, halving the bytes between replicas (Horovod's Compression.fp16); the
  variables and the optimizer stay float32. One replica sends nothing and is left exact.
  `backward_order` hands the gradients to the collective last layer first, the order backprop
  finishes them (DDP's buckets): TF launches collectives in program order (an ordering token per
  replica), so with runtime.bytes_per_pack the first pack can start while earlier layers'
  gradients are still being computed, instead of waiting for the first layer's, computed last."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  present = [g for g in grads if g is not None]
  if not present:
    return list(grads)
  context = tf.distribute.get_replica_context()
  compress = wire_dtype is not None and context.num_replicas_in_sync > 1

  def on_wire(g):
    if compress and not isinstance(g, tf.IndexedSlices) and g.dtype == tf.float32:
      return tf.cast(g, wire_dtype)
    return g
  order = list(range(len(present)))[::-1] if backward_order else list(range(len(present)))
  on_the_wire = context.all_reduce(tf.distribute.ReduceOp.SUM, [on_wire(present[i]) for i in order])
  reduced = [None] * len(present)
  for i, r in zip(order, on_the_wire):
    g = present[i]
    reduced[i] = r if isinstance(r, tf.IndexedSlices) or r.dtype == g.dtype else tf.cast(r, g.dtype)
  reduced = iter(reduced)
  return [None if g is None else next(reduced) for g in grads]


def skip_optimizer_all_reduce(optimizer) -> None:
  """Keras 3's TF optimizer all-reduces (SUM) the gradients inside apply_gradients with no
  switch to skip it (keras-team/keras#19308): gradients tfdp already reduced would be summed
  again (x replicas). Replaces the optimizer's private `_all_reduce_sum_gradients` on this
  instance (and on a loss-scale optimizer's inner one) with a pass-through; tested in
  test_compat.py."""
  inner = getattr(optimizer, "inner_optimizer", None)
  for opt in (optimizer, inner) if inner is not None else (optimizer,):
    if not hasattr(opt, "_all_reduce_sum_gradients"):
      raise RuntimeError("keras changed: the optimizer has no _all_reduce_sum_gradients to "
                         "replace; see tfdp/compat.py")
    opt._all_reduce_sum_gradients = list  # pylint: disable=protected-access


def weight_averages(optimizer) -> list:
  """The moving averages of the weights a Keras 3 optimizer built with `use_ema=True` keeps, in
  the order of the variables it was built for, or [] without EMA. Keras has no public accessor
  (`finalize_variable_values` overwrites the weights for good, which evaluation mid-run cannot
  use; keras-team/keras#18949 added only a model.fit callback), so this reads
  `_model_variables_moving_average`; tested in test_compat.py."""
  opt = getattr(optimizer, "inner_optimizer", optimizer)  # under a LossScaleOptimizer
  if not getattr(opt, "use_ema", False):
    return []
  if not hasattr(opt, "_model_variables_moving_average"):
    raise RuntimeError("keras changed: the optimizer has no _model_variables_moving_average; "
                       "see tfdp/compat.py")
  return list(opt._model_variables_moving_average)  # pylint: disable=protected-access


_EXCHANGES = collections.Counter()  # exchange_between_workers's calls, per topic


def exchange_between_workers(rank: int, num_workers: int, value: str,
                             timeout_seconds: float, topic: str = "plan") -> list[str]:
  """Every worker's `value`, in rank order, through the coordination service's key-value store
  (a private TF API). Unlike a collective, this works when workers disagree on their device
  counts, which is exactly what it is used to detect (TF calls unequal counts undefined)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  from tfdp.errors import GroupMustRestart  # pylint: disable=g-import-not-at-top
  ctx, timeout_ms = context.context(), int(timeout_seconds * 1000)
  # A key is written once per service: the n-th exchange of a topic in this process (every
  # worker makes them in one order) has its own, or a second tfdp.fit failed on "already exists".
  _EXCHANGES[topic] += 1
  topic = f"{topic}/{_EXCHANGES[topic]}"
  try:
    ctx.set_config_key_value(f"tfdp/{topic}/{rank}", value)
    values = [ctx.get_config_key_value(f"tfdp/{topic}/{i}", timeout_in_ms=timeout_ms)
              for i in range(num_workers)]
    # Nobody leaves (worker 0 hosts the service) before every worker has read every value.
    ctx.wait_at_barrier(f"tfdp/{topic}/read", timeout_ms)
  except tf.errors.OpError as e:
    raise GroupMustRestart(f"the start-up check between workers failed ({type(e).__name__}: "
                       f"{e.message.splitlines()[0][:200]}); a peer stopped early: see its "
                       "error line, fix it and restart the group.") from None
  # Worker 0 may leave at once (every worker refuses the same difference): the barrier's answer
  # to a peer, still unsent, died with it, and that peer said "a peer stopped early" instead of
  # the difference (5 of 20 pairs here under load). Worker 0 waits until each peer has heard.
  try:
    if rank:
      ctx.set_config_key_value(f"tfdp/{topic}/heard/{rank}", "")
    else:
      for i in range(1, num_workers):  # an answer's way, not a peer's work: seconds at most
        ctx.get_config_key_value(f"tfdp/{topic}/heard/{i}", timeout_in_ms=min(timeout_ms, 10000))
  except tf.errors.OpError:  # every value is read: a peer's own answer lost is no loss here
    pass
  return values


def leave_together(timeout_seconds: float, call: int = 1) -> str:
  """Waits, through the coordination service, until every worker has finished its work, so that
  none leaves while a peer may still pull from it: the last buffers of a collective are fetched
  by the receiving worker (RecvBuf), and a worker that exits as soon as its own result is
  complete closes its sockets under a peer still fetching, which then fails with
  "UnavailableError: Collective ops is aborted by: Socket closed" though the work is done
  (tensorflow/tensorflow#58434; 7 of 12 three-host all-reduce boxes here). Returns "" once all
  are here, else why not (a peer that died, or the timeout): the caller leaves all the same."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  try:
    context.context().wait_at_barrier(f"tfdp/leave/{call}", int(timeout_seconds * 1000))
  except tf.errors.OpError as e:
    return f"{type(e).__name__}: {e.message.splitlines()[0][:200]}"
  return ""


def restore_optimizer_all_reduce(optimizer) -> None:
  """Undoes skip_optimizer_all_reduce, so a user's optimizer works in Keras's own fit again
  after tfdp.fit trained with it."""
  inner = getattr(optimizer, "inner_optimizer", None)
  for opt in (optimizer, inner) if inner is not None else (optimizer,):
    opt.__dict__.pop("_all_reduce_sum_gradients", None)


def compile_arguments(model) -> dict:
  """The objects `model.compile` was given (optimizer, loss, metrics, ...), as Keras 3 keeps them
  (`model._compile_config.config`; public is only their serialized form, which a user's own
  unregistered loss or metric cannot survive). tfdp.fit compiles a clone with them; tested in
  test_compat.py."""
  arguments = getattr(getattr(model, "_compile_config", None), "config", None)
  if not isinstance(arguments, dict) or "loss" not in arguments or "optimizer" not in arguments:
    raise RuntimeError("keras changed: Model._compile_config.config no longer holds compile()'s "
                       "arguments; see tfdp/distributed/compat.py")
  return dict(arguments)


def carry_lost_settings(source, target, source_weights, target_weights) -> None:
  """A metric or optimizer rebuilt from its config (`target`, made in a strategy's scope) gets
  what Keras 3.15's get_config drops: a MeanMetricWrapper's function arguments
  (`metrics.CosineSimilarity(axis=0)` came back with axis -1; the losses' twin of keras-team/keras
  #23286), and an optimizer's exclude_from_weight_decay (its variables by key, mapped from
  `source_weights` to `target_weights`, and its name pattern), which no config holds. Tested in
  test_compat.py."""
  import keras  # pylint: disable=g-import-not-at-top
  if isinstance(source, keras.metrics.MeanMetricWrapper) and hasattr(source, "_fn_kwargs"):
    target._fn_kwargs = dict(source._fn_kwargs)  # pylint: disable=protected-access
  excluded = getattr(source, "_exclude_from_weight_decay", None)
  pattern = getattr(source, "_exclude_from_weight_decay_pattern", None)
  if isinstance(source, keras.optimizers.Optimizer) and (excluded or pattern is not None):
    by_key = {source._var_key(a): b for a, b in zip(source_weights, target_weights)}  # pylint: disable=protected-access
    target.exclude_from_weight_decay(var_list=[by_key[k] for k in excluded or () if k in by_key])
    target._exclude_from_weight_decay_pattern = pattern  # pylint: disable=protected-access


CARRIED_SETTINGS = ("_fn_kwargs", "_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern",
                    "_exclude_from_weight_decay_cache")


_REPLICA_STREAM = threading.local()  # the replica whose step this thread traces, if any


@contextlib.contextmanager
def replica_random_streams():
  """A context for tracing one replica's step, in which Keras's random ops (Dropout, noise,
  random augmentation layers) draw other numbers on each replica. Keras 3 draws their seeds from
  a SeedGenerator whose state is one mirrored variable, so every replica drew the same seed:
  row k of each replica's batch got the same dropout mask (a probe; Keras's own fit under
  MirroredStrategy does the same; no upstream issue found). The drawn seed
  (keras.src.backend.tensorflow.random.draw_seed, private) is offset by the replica's id, per
  thread: MirroredStrategy traces its replicas in threads of their own. Tested in
  test_compat.py."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  _draw_seeds_per_replica()
  context = tf.distribute.get_replica_context()
  several = context is not None and context.num_replicas_in_sync > 1
  _REPLICA_STREAM.replica = context.replica_id_in_sync_group if several else None
  try:
    yield
  finally:
    _REPLICA_STREAM.replica = None


def _draw_seeds_per_replica() -> None:
  """Wraps Keras's draw_seed once; outside replica_random_streams it draws as Keras does."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from keras.src.backend.tensorflow import random as tf_random  # pylint: disable=g-import-not-at-top
  if getattr(tf_random.draw_seed, "tfdp_per_replica", False):
    return
  upstream = tf_random.draw_seed

  def draw_seed(seed):
    drawn = upstream(seed)
    replica = getattr(_REPLICA_STREAM, "replica", None)
    if replica is None:
      return drawn
    offset = tf.cast(replica, drawn.dtype) * tf.constant(1000003, drawn.dtype)
    return drawn + tf.stack([offset, tf.zeros_like(offset)])  # another stream, same counter

  draw_seed.tfdp_per_replica = True
  tf_random.draw_seed = draw_seed


def metrics_in_keras_order(model, logs: dict):
  """What `model.evaluate(return_dict=False)` returns for its `logs`: the one value, or a list in
  model.metrics_names order (a CompileMetrics expanded to its metrics, then the rest sorted):
  Keras 3's private Trainer._flatten_metrics_in_order. tfdp.evaluate's test (test_api.py)
  compares it with model.evaluate."""
  flatten = getattr(model, "_flatten_metrics_in_order", None)
  if flatten is None:
    raise RuntimeError("keras changed: Model._flatten_metrics_in_order is gone; see "
                       "tfdp/distributed/compat.py")
  return flatten(logs)


def _flat(structure) -> list:
  import keras  # pylint: disable=g-import-not-at-top
  return [] if structure is None else [m for m in keras.tree.flatten(structure) if m is not None]


def compiled_loss_and_metrics(model):
  """What `model.compile(loss=..., metrics=..., weighted_metrics=...)` made: Keras 3 keeps them
  as private CompileLoss / CompileMetrics objects (`model._compile_loss`,
  `model._compile_metrics`), built lazily on the first batch; their resolved per-output losses
  (`_flat_losses`: path, Loss, weight, name) and metric lists (`_flat_metrics`,
  `_flat_weighted_metrics`, `_flatten_y`) have no public accessor. tfdp.fit reads them to apply
  Keras's own losses and metrics per example, with the padding weight; tested in test_compat.py."""
  loss = getattr(model, "_compile_loss", None)
  metrics = getattr(model, "_compile_metrics", None)
  if metrics is not None and not any(  # compile(metrics=[]): none, as Keras computes none
      _flat(getattr(metrics, attr, None)) for attr in ("_user_metrics", "_user_weighted_metrics")):
    metrics = None
  for obj, attrs in ((loss, ("build", "_flat_losses")),
                     (metrics, ("build", "_flat_metrics", "_flat_weighted_metrics", "_flatten_y"))):
    if obj is not None and obj.built and not all(hasattr(obj, a) for a in attrs[1:]):
      raise RuntimeError("keras changed: CompileLoss/CompileMetrics lost their resolved losses "
                         "or metrics; see tfdp/distributed/compat.py")
  return loss, metrics


def keras_mask(tensor):
  """The mask Keras attaches to a layer's output (Embedding(mask_zero=True), Masking), or None:
  Keras 3 has no public accessor (keras.src.backend.get_keras_mask); Keras's own losses divide
  a masked loss by the batch's unmasked steps, which tfdp.fit does across replicas. Tested in
  test_compat.py."""
  from keras.src import backend  # pylint: disable=g-import-not-at-top
  return backend.get_keras_mask(tensor)


def with_keras_mask(tensor, mask):
  """`tensor` carrying `mask` as a layer's output would (keras.src.backend.set_keras_mask): a
  task's outputs cast to float32 keep the mask a Keras loss reads. Tested in test_compat.py."""
  from keras.src import backend  # pylint: disable=g-import-not-at-top
  backend.set_keras_mask(tensor, mask)
  return tensor


def created_in_scope(strategy, variable) -> bool:
  """Whether a Keras 3 variable was created under `strategy.scope()` (its TF variable is then
  the strategy's distributed variable)."""
  return strategy.extended.variable_created_in_scope(getattr(variable, "value", variable))


# TensorFlow's global seed where a run's is 0 (see set_random_seed); any other would do.
ZERO_SEED_STAND_IN = 2**31 - 2


def set_random_seed(seed: int) -> None:
  """keras.utils.set_random_seed, except that TensorFlow's global seed is never 0 (modulo
  2**31 - 1): tf.data's get_seed compares (global, op) seeds with (0, 0) as Python values, and
  with an op seed that is a tensor (data.epoch_seed in a flat_map) that fails as "a tensor used
  as a Python bool" (tensorflow/tensorflow#17284): trainer.seed=0, and tfdp.fit after
  keras.utils.set_random_seed(0), broke every shuffled run. Numpy, Python and Keras get `seed`."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(seed)
  if seed % (2**31 - 1) == 0:
    tf.random.set_seed(ZERO_SEED_STAND_IN)


def seed_state() -> tuple:
  """What keras.utils.set_random_seed sets besides numpy's and Python's streams: Keras's global
  seed and SeedGenerator (keras/src/utils/rng_utils.py) and TensorFlow's global seed. None has a
  public getter; no upstream issue found."""
  from keras.src.backend.common import global_state  # pylint: disable=g-import-not-at-top
  from keras.src.random import seed_generator  # pylint: disable=g-import-not-at-top
  from keras.src.utils import rng_utils  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  return (global_state.get_global_attribute(rng_utils.GLOBAL_RANDOM_SEED),
          global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR),
          context.global_seed())


def restore_seed_state(state: tuple) -> None:
  """seed_state() as it was: the generator object goes on from where it was; TensorFlow's
  op-level seeds restart from its global seed (tf.random.set_seed resets their counter)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from keras.src.backend.common import global_state  # pylint: disable=g-import-not-at-top
  from keras.src.random import seed_generator  # pylint: disable=g-import-not-at-top
  from keras.src.utils import rng_utils  # pylint: disable=g-import-not-at-top
  keras_seed, generator, tf_seed = state
  global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, keras_seed)
  global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, generator)
  tf.random.set_seed(tf_seed)


def custom_gradients_dropped(function):
  """`function`, which TensorFlow traces once per input signature, unregistering the gradient
  functions its trace registered. tf.custom_gradient in graph mode registers each call's
  gradient function in TF's global gradient registry for good, and that function holds the
  traced tensors, so every traced training loop (ReplicaContext.all_reduce is a
  custom_gradient) stayed in memory after its run: ~10 MB per tfdp.train in a notebook
  (tensorflow/tensorflow#97697). The registry is read only while a gradient is traced, and the
  loop's gradients are traced inside the loop's own trace."""
  import functools  # pylint: disable=g-import-not-at-top
  from tensorflow.python.framework import ops  # pylint: disable=g-import-not-at-top
  registry = ops._gradient_registry._registry  # pylint: disable=protected-access

  @functools.wraps(function)
  def traced(*args, **kwargs):
    before = set(registry)
    try:
      return function(*args, **kwargs)
    finally:
      for name in [n for n in registry if n not in before and n.startswith("CustomGradient-")]:
        del registry[name]
  return traced


ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"


def onednn_setting(cpu_flags, environ) -> str | None:
  """TF's Linux x86 wheels turn their oneDNN kernels on by default only on CPUs with AVX512_VNNI,
  AVX512_BF16, AMX and the like (TF 2.9 release notes, tensorflow/tensorflow#56039); on an
  AVX2-only CPU (AMD EPYC family 25 model 1 here) TF runs Eigen's kernels and the default job
  trained 2.4x slower (222 against 553 images/s, BENCHMARKS.md). Returns the value to give
  TF_ENABLE_ONEDNN_OPTS before TensorFlow is imported: "1" on an x86 CPU with AVX2 when the user
  has not set it, else None (the user's choice, or TF's default where oneDNN is not x86's)."""
  if ONEDNN_ENV in environ or "avx2" not in cpu_flags:
    return None
  return "1"


def onednn_enabled() -> bool:
  """Whether this process's TensorFlow runs its oneDNN kernels (a private query)."""
  from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
  return bool(_pywrap_util_port.IsMklEnabled())


def onednn_off_warning(enabled: bool, cpu_flags, environ) -> str:
  """One line for a process whose TensorFlow was imported before tfdp could turn oneDNN on, on
  a CPU where it pays; "" where it is on or the user turned it off."""
  if enabled or "avx2" not in cpu_flags or environ.get(ONEDNN_ENV, "1") == "0":
    return ""
  return (f"TensorFlow's oneDNN kernels are off in this process (TensorFlow was imported before "
          f"tfdp): on this AVX2 CPU they train ~2.4x faster; set {ONEDNN_ENV}=1 before importing "
          "TensorFlow, or import tfdp first")


UNUSED_AT_IMPORT = ("matplotlib.pyplot", "IPython")


def defer_unused_imports(names=UNUSED_AT_IMPORT) -> None:
  """Keras imports matplotlib.pyplot (keras/src/visualization/plot_image_gallery.py, for one
  plotting helper) and IPython (keras/src/saving/file_editor.py, to draw KerasFileEditor in a
  notebook) while TensorFlow loads; no upstream issue found. tfdp uses neither (its figures are
  matplotlib.figure.Figure); together they cost ~0.5-0.9 CPU s of every process that starts
  TensorFlow (BENCHMARKS.md, "Test suite time"). Call before TensorFlow is imported: each module
  is put in place unexecuted and runs the first time a name is read from it.
  (importlib.util.LazyLoader would not do: an import statement reads __spec__, which loads its
  modules.)"""
  import importlib.util  # pylint: disable=g-import-not-at-top
  if "tensorflow" in sys.modules:
    return
  for name in names:
    if name in sys.modules:
      continue
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      continue
    if spec is None or spec.loader is None:
      continue
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _DeferredModule
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
      setattr(sys.modules[parent], child, module)  # as an import would


class _DeferredModule(types.ModuleType):
  """A module whose code runs when a name it does not have yet is first read."""

  def __getattr__(self, name):
    self.__class__ = types.ModuleType
    self.__spec__.loader.exec_module(self)
    return getattr(self, name)


def checkpoint_variable_paths(checkpoint_path: str, under: tuple[str, ...]) -> set[str]:
  """The variables a checkpoint holds below the object at `under` (child names from its root),
  as paths of child names, not through an `optimizer` child (its slots). TensorFlow lists a
  checkpoint's values but not which object holds them (a value is stored once, under the first
  path to it), and a partial restore cannot say which values it left unused
  (tensorflow/tensorflow#21156): this reads the checkpoint's object graph proto."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.core.protobuf import trackable_object_graph_pb2  # pylint: disable=g-import-not-at-top
  graph = trackable_object_graph_pb2.TrackableObjectGraph()
  graph.ParseFromString(tf.train.load_checkpoint(checkpoint_path).get_tensor(
      "_CHECKPOINTABLE_OBJECT_GRAPH"))
  node = 0
  for name in under:
    node = next((c.node_id for c in graph.nodes[node].children if c.local_name == name), None)
    if node is None:
      return set()
  paths, seen, queue = set(), {node}, [(node, "")]
  while queue:
    node, path = queue.pop(0)
    if any(attribute.name == "VARIABLE_VALUE" for attribute in graph.nodes[node].attributes):
      paths.add(path)
    for child in graph.nodes[node].children:
      if child.local_name != "optimizer" and child.node_id not in seen:
        seen.add(child.node_id)
        queue.append((child.node_id, f"{path}/{child.local_name}" if path else child.local_name))
  return paths


def autograph_converted_functions() -> list[str]:
  """'file:function' of every function autograph has converted in this process (its transpiler's
  cache): tfdp traces without autograph (tfdp/core/trainer.py), so this lists only what other
  code converted. For tests and benchmarks/suite_processes."""
  # Imports nothing: this may run as a process leaves, in a signal's thread while the main thread
  # is importing TensorFlow, where an import deadlocks (_DeadlockError in the main thread).
  api = sys.modules.get("tensorflow.python.autograph.impl.api")
  cache = getattr(getattr(api, "_TRANSPILER", None), "_cache", None)
  codes = list(getattr(cache, "_cache", {}).keys())
  return sorted(f"{code.co_filename}:{code.co_name}" for code in codes
                if hasattr(code, "co_filename"))
