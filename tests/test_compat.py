"""One test per workaround in tfdp/compat.py: it shows the upstream behaviour and the fix."""
import json
import subprocess
import sys
import textwrap

import helpers

BN_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from tfdp.distributed import compat
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    def build():
      return keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
    with strategy.scope():
      model = build()
    # Replica 0 sees values near 0, replica 1 values near 10.
    data = tf.data.Dataset.from_tensors(tf.concat([tf.zeros((4, 4)), 10 + tf.zeros((4, 4))], 0))
    batch = next(iter(strategy.experimental_distribute_dataset(data)))
    @tf.function
    def step(x):
      strategy.run(lambda b: model(b, training=True), args=(x,))
      if sys.argv[1] == "fixed":
        strategy.run(lambda: compat.average_across_replicas(compat.replica_local_statistics(model)))
    step(batch)
    mean = model.layers[0].moving_mean
    copies = [v.numpy().tolist() for v in mean.value.values]
    print(json.dumps(copies))
"""))


def moving_mean_copies(mode):
  proc = helpers.run_python([sys.executable, "-c", BN_SCRIPT, mode],
                            env=helpers.env(), cwd=None, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_batchnorm_moving_statistics_agree_across_replicas():
  upstream = moving_mean_copies("upstream")
  assert upstream[0] != upstream[1]  # Keras 3 (aggregation "none"): replica copies drift apart
  fixed = moving_mean_copies("fixed")
  assert fixed[0] == fixed[1]
  # momentum 0.99: the mean of both replicas' updates (0.01 * 0 and 0.01 * 10), as MEAN
  # aggregation after every step would give
  assert abs(fixed[0][0] - 0.05) < 1e-6


HEARTBEAT_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import sys
    import tensorflow as tf
    from tfdp import config
    from tfdp.distributed import cluster as cluster_lib
    from tfdp.distributed import compat
    from tfdp.distributed import strategy as strategy_lib
    if sys.argv[1] == "fixed":
      runtime = config.RuntimeConfig(strategy="multi_worker_mirrored", heartbeat_timeout_seconds=45)
      strategy, _ = strategy_lib.make_strategy(runtime, cluster_lib.resolve_cluster())
    else:
      strategy = tf.distribute.MultiWorkerMirroredStrategy()
    total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
    print("heartbeat_ms", compat.coordination_heartbeat_timeout_ms(), "sum", float(total))
"""))


def test_coordination_heartbeat_timeout_is_ours():
  from tfdp.distributed import launch  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  for mode, expected in (("upstream", "heartbeat_ms 0 sum 2.0"), ("fixed", "heartbeat_ms 45000 sum 2.0")):
    output = io.StringIO()
    result = launch.run_group([sys.executable, "-c", HEARTBEAT_SCRIPT, mode], 2,
                              env=helpers.env(), output=output, stop_grace_seconds=5)
    assert result.ok, output.getvalue()[-3000:]
    lines = [l for l in output.getvalue().splitlines() if "heartbeat_ms" in l]
    assert len(lines) == 2 and all(l.endswith(expected) for l in lines), lines


ALL_REDUCE_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from tfdp.distributed import compat
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
      w = keras.Variable(tf.zeros(2))
      opt = keras.optimizers.SGD(1.0)
      opt.build([w])
    if sys.argv[1] == "fixed":
      compat.skip_optimizer_all_reduce(opt)
    @tf.function
    def step():
      def replica_step():
        grad = tf.ones(2)  # each replica's gradient: 1
        grads = compat.all_reduce_gradients([grad])  # tfdp reduces first: 2
        opt.apply_gradients(zip(grads, [w]))
      strategy.run(replica_step)
    step()
    print(json.dumps([c.numpy().tolist() for c in w.value.values]))
"""))


def test_optimizer_all_reduce_is_skipped_after_tfdp_reduced():
  """keras-team/keras#19308: Keras 3's optimizer all-reduces inside apply_gradients, so
  gradients tfdp already reduced are summed a second time unless its all-reduce is skipped."""
  def weights(mode):
    proc = helpers.run_python([sys.executable, "-c", ALL_REDUCE_SCRIPT, mode],
                              env=helpers.env(), cwd=None, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
  assert weights("upstream") == [[-4.0, -4.0]] * 2  # reduced twice: 2 replicas x 2
  assert weights("fixed") == [[-2.0, -2.0]] * 2  # the sum of the two replicas' gradients, once


EMA_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import json
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from tfdp.distributed import compat
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
      model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False,
                                                                     kernel_initializer="ones")])
      optimizer = keras.optimizers.SGD(0.5, use_ema=True, ema_momentum=0.5)
      optimizer.build(model.trainable_variables)
    assert compat.weight_averages(keras.optimizers.SGD(0.1)) == []
    @tf.function
    def step():  # in replica context, as tfdp's loop applies gradients
      strategy.run(lambda: optimizer.apply_gradients(
          [(tf.ones((2, 1)), v) for v in model.trainable_variables]))
    seen = []
    for _ in range(3):
      step()
      seen.append(float(model.trainable_variables[0].numpy()[0, 0]))
    average = compat.weight_averages(optimizer)[0]
    copies = [float(np.asarray(c)[0, 0]) for c in average.value.values]
    print(json.dumps({"weights": seen, "average_copies": copies}))
"""))


def test_the_optimizer_weight_average_is_read_and_kept_on_every_replica():
  """keras-team/keras#18949: Keras 3 keeps the EMA of the weights inside the optimizer with no
  public accessor; compat.weight_averages reads it, and under MirroredStrategy (updated in
  replica context) every replica's copy follows avg = 0.5 avg + 0.5 w, from avg = w after step 1."""
  proc = helpers.run_python([sys.executable, "-c", EMA_SCRIPT],
                            env=helpers.env(), cwd=None, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  weights = result["weights"]
  assert weights[0] != weights[1] != weights[2]  # they trained (2 replicas' gradients summed)
  expected = weights[0]
  for w in weights[1:]:
    expected = 0.5 * expected + 0.5 * w
  assert result["average_copies"] == [expected, expected]


COMPILED_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import json
    import numpy as np, tensorflow as tf, keras
    from tfdp.distributed import compat
    inputs = keras.Input((3,), name="x")
    model = keras.Model(inputs, {"a": keras.layers.Dense(2, name="a")(inputs),
                                 "b": keras.layers.Dense(1, name="b")(inputs)})
    model.compile("sgd", loss={"a": "sparse_categorical_crossentropy", "b": "mse"},
                  loss_weights={"a": 1.0, "b": 0.5}, metrics={"a": ["accuracy"]},
                  weighted_metrics={"b": ["mae"]})
    x = np.ones((4, 3), np.float32)
    y = {"a": np.zeros(4, np.int64), "b": np.zeros((4, 1), np.float32)}
    loss, metrics = compat.compiled_loss_and_metrics(model)
    pred = model(x)
    loss.build(y, pred); metrics.build(y, pred)
    before = model.optimizer._all_reduce_sum_gradients
    compat.skip_optimizer_all_reduce(model.optimizer)
    skipped = model.optimizer._all_reduce_sum_gradients is list
    compat.restore_optimizer_all_reduce(model.optimizer)
    print(json.dumps({
        "losses": [[list(map(str, path)), type(fn).__name__, weight]
                   for path, fn, weight, _ in loss._flat_losses],
        "metrics": [bool(m) for m in metrics._flat_metrics],
        "weighted": [bool(m) for m in metrics._flat_weighted_metrics],
        "skipped": skipped,
        "restored": model.optimizer._all_reduce_sum_gradients == before,
        "empty": [compat.compiled_loss_and_metrics(model)[1] is None
                  for kw in ({"metrics": []}, {"weighted_metrics": {"b": []}}, {"metrics": ["mae"]})
                  if model.compile("sgd", "mse", **kw) is None]}))
"""))


def test_compiled_losses_and_metrics_are_read_from_keras_private_objects():
  """compat.compiled_loss_and_metrics: Keras 3 keeps compile()'s resolved losses and metrics in
  private CompileLoss/CompileMetrics objects (keras/src/trainers/compile_utils.py; no public
  accessor, see keras-team/keras#19308 for the optimizer side of the same loop): tfdp.fit reads
  their per-output losses and weights, and which outputs have plain and weighted metrics; and the
  optimizer's own all-reduce, skipped while tfdp trains, is given back afterwards."""
  proc = helpers.run_python([sys.executable, "-c", COMPILED_SCRIPT],
                            env=helpers.env(), cwd=None, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  found = json.loads(proc.stdout.strip().splitlines()[-1])
  assert [(path, weight) for path, _, weight in found["losses"]] == [(["a"], 1.0), (["b"], 0.5)]
  assert found["metrics"] == [True, False] and found["weighted"] == [False, True]
  assert found["skipped"] and found["restored"]
  assert found["empty"] == [True, True, False]  # compile(metrics=[]) has none to build


MASK_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import json
    import keras, numpy as np, tensorflow as tf
    from tfdp.distributed import compat
    inputs = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(5, 2, mask_zero=True)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    tokens = np.array([[1, 2, 0], [3, 0, 0]])
    eager = compat.keras_mask(model(tokens))
    traced = tf.function(lambda t: tf.cast(compat.keras_mask(model(t)), tf.int32))(tokens)
    plain = compat.keras_mask(keras.layers.Dense(2)(tf.ones((2, 3))))
    # a task's bfloat16 outputs cast to float32 keep their mask (Task.loss_outputs)
    from tfdp.core.task import Task
    Task.float32_outputs = True
    cast = Task.loss_outputs(Task, compat.with_keras_mask(tf.cast(model(tokens), tf.bfloat16),
                                                          eager))
    print(json.dumps({"eager": np.asarray(eager).tolist(), "traced": np.asarray(traced).tolist(),
                      "plain": plain is None, "cast_dtype": cast.dtype.name,
                      "cast_mask": np.asarray(compat.keras_mask(cast)).tolist()}))
"""))


def test_the_keras_mask_of_an_output_is_read_eagerly_and_traced():
  """compat.keras_mask: Keras 3 keeps a layer output's mask (Embedding(mask_zero=True)) in a
  private attribute read by keras.src.backend.get_keras_mask (no public accessor; Keras's own
  losses divide by the unmasked steps, keras/src/losses/loss.py apply_mask): tfdp.fit reads it to
  divide a masked loss as Keras does, eagerly and inside its traced step."""
  proc = helpers.run_python([sys.executable, "-c", MASK_SCRIPT],
                            env=helpers.env(), cwd=None, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  found = json.loads(proc.stdout.strip().splitlines()[-1])
  assert found["eager"] == [[True, True, False], [True, False, False]]
  assert found["traced"] == [[1, 1, 0], [1, 0, 0]] and found["plain"]
  # compat.with_keras_mask: the cast outputs keep it (seen failing: None, a plain tf.cast)
  assert found["cast_dtype"] == "float32" and found["cast_mask"] == found["eager"]


# TensorFlow's default: oneDNN on only where the CPU has one of these (TF 2.9 release notes).
TF_ONEDNN_DEFAULT_FLAGS = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16")
ONEDNN_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import json, os, sys
    if sys.argv[1] == "fixed":
      import tfdp
    import tensorflow as tf
    from tensorflow.python.util import _pywrap_util_port
    print(json.dumps([os.environ.get("TF_ENABLE_ONEDNN_OPTS"), _pywrap_util_port.IsMklEnabled()]))
"""))


def onednn_in_a_new_process(mode, **extra_env):
  environ = helpers.env(**extra_env)
  if "TF_ENABLE_ONEDNN_OPTS" not in extra_env:
    environ.pop("TF_ENABLE_ONEDNN_OPTS", None)  # this pytest process imported tfdp: it set it
  proc = subprocess.run([sys.executable, "-c", ONEDNN_SCRIPT, mode], capture_output=True,
                        text=True, env=environ, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_onednn_is_turned_on_where_tensorflow_would_leave_it_off():
  from tfdp.distributed import compat, cpus  # pylint: disable=g-import-not-at-top
  assert compat.onednn_setting(["fma", "avx2"], {}) == "1"
  assert compat.onednn_setting(["fma", "avx2"], {"TF_ENABLE_ONEDNN_OPTS": "0"}) is None
  assert compat.onednn_setting(["asimd", "sve"], {}) is None  # ARM: TF's own choice
  flags = cpus.cpu_flags(environ={})
  # Upstream: TF's Linux x86 wheel turns oneDNN on only on CPUs with VNNI/BF16/AMX. On the
  # AVX2-only EPYC (family 25 model 1) this prints [null, false] and the job runs Eigen's kernels.
  assert onednn_in_a_new_process("upstream") == [None, any(f in flags for f in TF_ONEDNN_DEFAULT_FLAGS)]
  if "avx2" in flags:
    assert onednn_in_a_new_process("fixed") == ["1", True]
    # The user's own choice stands.
    assert onednn_in_a_new_process("fixed", TF_ENABLE_ONEDNN_OPTS="0") == ["0", False]


def test_onednn_off_after_an_early_tensorflow_import_is_said_in_one_line():
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  line = compat.onednn_off_warning(False, ["avx2"], {})
  assert "TF_ENABLE_ONEDNN_OPTS=1 before importing TensorFlow" in line and "\n" not in line
  assert compat.onednn_off_warning(True, ["avx2"], {}) == ""
  assert compat.onednn_off_warning(False, ["avx2"], {"TF_ENABLE_ONEDNN_OPTS": "0"}) == ""
  assert compat.onednn_off_warning(False, ["asimd"], {}) == ""
  script = ("import tensorflow, tfdp; from tfdp.distributed import compat; "
            "tfdp.make_strategy(cpu_replicas=1); print(compat.onednn_enabled())")
  environ = helpers.env()
  environ.pop("TF_ENABLE_ONEDNN_OPTS", None)
  proc = subprocess.run([sys.executable, "-c", helpers.leaving_at_once(script)],
                        capture_output=True, text=True, env=environ, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  enabled = proc.stdout.strip().splitlines()[-1] == "True"
  warned = [l for l in proc.stderr.splitlines() if "oneDNN kernels are off" in l]
  from tfdp.distributed import cpus  # pylint: disable=g-import-not-at-top
  assert len(warned) == (0 if enabled or "avx2" not in cpus.cpu_flags(environ={}) else 1), proc.stderr[-2000:]


LEAVE_SCRIPT = helpers.leaving_at_once("""
import json, sys, time
import tfdp
import tensorflow as tf
from tfdp import config as config_lib
from tfdp.distributed import cluster as cluster_lib, strategy as strategy_lib
cluster = cluster_lib.resolve_cluster()
strategy, plan = strategy_lib.make_strategy(config_lib.load_config([], []).runtime, cluster)
total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
if cluster.rank == 1:
  time.sleep(3)  # worker 1 finishes 3 s after worker 0
arrived = time.time()
cluster_lib.leave_together(cluster)
print(json.dumps({"rank": cluster.rank, "kind": plan.kind, "sum": float(total),
                  "arrived": arrived, "left": time.time()}))
""")


def test_a_worker_that_is_done_waits_for_its_peers_before_it_leaves():
  """tensorflow/tensorflow#58434: a worker that exits once its own result is complete closes its
  sockets under a peer still fetching the collective's last buffers (RecvBuf), which then fails
  with 'Socket closed' though all the work is done. Two real workers on loopback: worker 0 must
  not leave before worker 1, 3 s later, has arrived."""
  import json  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import launch as launcher  # pylint: disable=g-import-not-at-top
  configs = launcher.worker_tf_configs(2, "127.0.0.1", launcher.pick_free_ports(2))
  procs = [subprocess.Popen([sys.executable, "-c", LEAVE_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=helpers.env(TF_CONFIG=config),
                            cwd=str(helpers.REPO)) for config in configs]
  outs = [proc.communicate(timeout=180) for proc in procs]
  for proc, (out, err) in zip(procs, outs):
    assert proc.returncode == 0, err[-3000:]
  first, second = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
  assert (first["kind"], first["sum"], second["sum"]) == ("multi_worker_mirrored", 2.0, 2.0)
  assert first["left"] >= second["arrived"], (first, second)  # it waited for worker 1


EXCHANGE_SCRIPT = """
import json, os
import tensorflow as tf
from tfdp.distributed import cluster as cluster_lib
cluster = cluster_lib.resolve_cluster()
tf.distribute.MultiWorkerMirroredStrategy(cluster_lib.make_cluster_resolver(cluster))
try:
  said = cluster_lib.exchange(cluster, {"rank": cluster.rank}, 30.0, topic="test")
except Exception as e:
  said = f"{type(e).__name__}: {e}"
print(json.dumps(said), flush=True)
os._exit(0)  # as a worker that refuses what every worker refuses: at once, no teardown
"""


def test_worker_0_leaving_right_after_a_start_up_exchange_leaves_every_peer_the_values():
  """The start-up exchange goes through the coordination service (a private TF API), which
  worker 0 hosts. When every worker refuses the same difference, worker 0 leaves at once; the
  barrier's answer to worker 1, not yet sent, died with it, and worker 1 said "a peer stopped
  early" instead of the difference (a CI run: test_keras_fit; 3 of 12 pairs here, 3 at a time).
  Three pairs of real workers at once on 2 cores: worker 1 gets both values in each. A race, so
  this only can fail (it did with worker 0's wait for its peers' word removed, in 1 of 2 runs of
  six pairs); the next test checks the wait itself without one."""
  from tfdp.distributed import launch as launcher  # pylint: disable=g-import-not-at-top
  procs, ports = [], launcher.pick_free_ports(6)  # at once: a pair started holds none yet
  for pair in range(3):  # load of their own: the lost answer needs a busy machine
    configs = launcher.worker_tf_configs(2, "127.0.0.1", ports[2 * pair:2 * pair + 2])
    procs += [subprocess.Popen([sys.executable, "-c", EXCHANGE_SCRIPT], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=str(helpers.REPO),
                               env=helpers.env(TF_CONFIG=config)) for config in configs]
  said = []
  for proc in procs:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    said.append(json.loads(out.strip().splitlines()[-1]))
  assert said == [[{"rank": 0}, {"rank": 1}]] * 6, said


def test_worker_0_returns_from_an_exchange_only_once_each_peer_has_its_answer(monkeypatch):
  """The wait above, without its race: worker 0 reads each peer's word after the barrier, and a
  peer whose word is lost (worker 0 gone with the answer) still has every value. Seen failing
  with worker 0's wait removed."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top

  class Service:  # a coordination service's key-value store and barrier, as one worker sees it
    def __init__(self, rank):
      self.rank, self.calls = rank, []

    def set_config_key_value(self, key, value):
      self.calls.append(("set", key))
      if "/heard/" in key:  # worker 0 left once it read this: the answer is lost
        raise tf.errors.UnavailableError(None, None, "Failed to send RPC to coordination service")

    def get_config_key_value(self, key, timeout_in_ms):
      self.calls.append(("get", key))
      return key.rsplit("/", 1)[1] if "/heard/" not in key else ""

    def wait_at_barrier(self, key, timeout_in_ms):
      self.calls.append(("barrier", key))

  for rank in (0, 1):
    service = Service(rank)
    monkeypatch.setattr(context, "context", lambda: service)
    assert compat.exchange_between_workers(rank, 3, str(rank), 1.0, topic="word") == ["0", "1", "2"]
    topic = service.calls[0][1].rsplit("/", 1)[0]
    after = service.calls[service.calls.index(("barrier", f"{topic}/read")) + 1:]
    assert after == ([("get", f"{topic}/heard/1"), ("get", f"{topic}/heard/2")] if rank == 0
                     else [("set", f"{topic}/heard/1")]), service.calls


PYPLOT_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import json, sys
    if sys.argv[1] == "fixed":
      from tfdp import logs
      logs.import_tensorflow()
    else:
      import tensorflow
    from keras.src.visualization import plot_image_gallery
    from keras.src.saving import file_editor
    pyplot = sys.modules["matplotlib.pyplot"]
    loaded_with_tensorflow = ["figure" in vars(pyplot), "version_info" in vars(file_editor.ipython)]
    import matplotlib.pyplot as plt
    figure = plt.figure()  # the first read loads it
    from IPython import get_ipython
    print(json.dumps([loaded_with_tensorflow, plot_image_gallery.plt is plt is pyplot,
                      type(figure).__name__, plt.get_fignums(), get_ipython() is None,
                      file_editor.ipython is sys.modules["IPython"]]))
"""))


def test_pyplot_and_ipython_are_loaded_on_first_use_not_with_tensorflow():
  """Keras imports matplotlib.pyplot and IPython while TensorFlow loads (plot_image_gallery.py,
  file_editor.py); tfdp's import of TensorFlow defers both, and each still works, for Keras's
  helpers too, once it is used."""
  def run(mode):
    proc = subprocess.run([sys.executable, "-c", PYPLOT_SCRIPT, mode], capture_output=True,
                          text=True, env=helpers.env(MPLBACKEND="Agg"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
  assert run("upstream") == [[True, True], True, "Figure", [1], True, True]
  assert run("fixed") == [[False, False], True, "Figure", [1], True, True]


SEED_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import json, random
    import keras
    import tensorflow as tf
    from tfdp.distributed import compat
    def draws():
      return [float(keras.random.uniform(())), float(tf.random.uniform(()))]
    keras.utils.set_random_seed(3)
    state = compat.seed_state()
    first = draws()
    keras.utils.set_random_seed(3)
    state, python_state = compat.seed_state(), random.getstate()
    keras.utils.set_random_seed(9)  # what a run in this process does
    moved = draws()
    random.setstate(python_state)  # a new SeedGenerator draws its seed from Python's stream
    compat.restore_seed_state(state)
    print(json.dumps({"seeds": [state[0], state[2]], "first": first, "moved": moved,
                      "again": draws()}))
"""))


def test_the_global_seeds_a_run_sets_are_read_and_given_back():
  """compat.seed_state: keras.utils.set_random_seed sets Keras's global seed and SeedGenerator
  and TensorFlow's global seed, none of which has a public getter (no upstream issue found);
  tfdp.train and tfdp.fit give a notebook's streams back after their run (in_process)."""
  proc = helpers.run_python([sys.executable, "-c", SEED_SCRIPT],
                            env=helpers.env(), cwd=None, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  found = json.loads(proc.stdout.strip().splitlines()[-1])
  assert found["seeds"] == [3, 3]
  assert found["moved"] != found["first"]  # upstream: the run's seed moves both streams
  assert found["again"] == found["first"]  # the fix: they go on as the user's seed set them


CUSTOM_GRADIENT_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import gc, json, sys
    import tensorflow as tf
    from tfdp.distributed import compat
    @tf.custom_gradient
    def doubled(x):
      return 2 * x, lambda dy: 2 * dy
    def loop(x):
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = doubled(x)
      return tape.gradient(y, x)
    alive = []
    for _ in range(3):  # three runs, each with its own traced loop, then dropped
      fn = loop if sys.argv[1] == "upstream" else compat.custom_gradients_dropped(loop)
      step = tf.function(fn, autograph=False)
      grad = float(step(tf.constant(1.0)))
      del step
      gc.collect()
      alive.append(sum(type(o).__name__ == "FuncGraph" for o in gc.get_objects()))
    print(json.dumps({"grad": grad, "alive": alive}))
"""))


def test_a_traced_custom_gradient_does_not_keep_its_graph():
  """compat.custom_gradients_dropped: tf.custom_gradient in graph mode registers its gradient
  function in TF's global registry for good, holding the traced graph
  (tensorflow/tensorflow#97697); the trainer's loop uses it (ReplicaContext.all_reduce). Upstream
  one more graph stays alive per trace; with the fix none, and the gradient is still right."""
  found = {}
  for mode in ("upstream", "fixed"):
    proc = helpers.run_python([sys.executable, "-c", CUSTOM_GRADIENT_SCRIPT, mode],
                              env=helpers.env(), cwd=None, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
  assert found["upstream"]["alive"] == [1, 2, 3]
  assert found["fixed"]["alive"] == [0, 0, 0] and found["fixed"]["grad"] == 2.0


def test_a_checkpoints_variables_are_listed_by_the_object_that_holds_them(tmp_path):
  """tensorflow/tensorflow#21156: no public API says which checkpoint values a partial restore
  left unused. compat reads the object graph: each variable under the object asked for, once,
  without the optimizer's slots, however the checkpoint stored the value."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
  model.compile(keras.optimizers.Adam(), "mse")  # the model holds its optimizer: a child
  model.optimizer.build(model.trainable_variables)  # with 2 slots per variable
  path = tf.train.Checkpoint(model=tf.train.Checkpoint(backbone=model)).write(
      str(tmp_path / "ckpt"))
  paths = compat.checkpoint_variable_paths(path, ("model", "backbone"))
  assert len(paths) == len(model.variables) == 4, paths
  assert all("optimizer" not in p for p in paths)
  assert compat.checkpoint_variable_paths(path, ("model", "nothing")) == set()


def test_a_warm_start_from_a_run_without_the_part_is_said_to_be_another_tasks(tmp_path):
  """A text classifier warm-started from another classifier's run (no model/backbone there) was
  told to 'use the same task.model.kwargs (and id mapping)'."""
  import keras  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.core import warm_start  # pylint: disable=g-import-not-at-top
  from tfdp.errors import ConfigError  # pylint: disable=g-import-not-at-top
  dense = lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])  # noqa: E731
  path = tf.train.Checkpoint(model=tf.train.Checkpoint(classifier=dense())).write(
      str(tmp_path / "other"))
  into = tf.train.Checkpoint(model=tf.train.Checkpoint(backbone=dense()))
  with pytest.raises(ConfigError, match="holds nothing for this model's encoder .*point it at a "
                                        "masked_lm run"):
    warm_start.restore_into(path, into, "this model's encoder", under=("model", "backbone"),
                            trained_by="a masked_lm run")
  same = tf.train.Checkpoint(model=tf.train.Checkpoint(backbone=dense())).write(
      str(tmp_path / "same"))
  warm_start.restore_into(same, into, "this model's encoder", under=("model", "backbone"))


CARRY_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import json
    import keras
    from tfdp.distributed import compat
    def round_trip(obj):
      return keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(obj))
    metric = keras.metrics.CosineSimilarity(axis=0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    clone = keras.models.clone_model(model)
    adamw = keras.optimizers.AdamW(weight_decay=0.1)
    adamw.exclude_from_weight_decay(var_list=[model.weights[0]], var_names=["bias"])
    metric_copy, adamw_copy = round_trip(metric), round_trip(adamw)
    found = {"upstream_axis": metric_copy._fn_kwargs.get("axis"),
             "upstream_excluded": [adamw_copy._use_weight_decay(v) for v in clone.weights]}
    compat.carry_lost_settings(metric, metric_copy, [], [])
    compat.carry_lost_settings(adamw, adamw_copy, model.weights, clone.weights)
    found["axis"] = metric_copy._fn_kwargs.get("axis")
    found["excluded"] = [adamw_copy._use_weight_decay(v) for v in clone.weights]
    found["users"] = [adamw._use_weight_decay(v) for v in model.weights]
    print(json.dumps(found))
"""))


def test_settings_a_config_drops_are_carried_into_the_rebuilt_metric_and_optimizer():
  """compat.carry_lost_settings: Keras 3.15's MeanMetricWrapper metrics drop their function's
  arguments from get_config (CosineSimilarity(axis=0) comes back with axis -1; the metrics' twin
  of the losses' keras-team/keras#23286), and no optimizer config holds exclude_from_weight_decay.
  tfdp.fit rebuilds both in the strategy's scope for a model built outside it."""
  proc = helpers.run_python([sys.executable, "-c", CARRY_SCRIPT],
                            env=helpers.env(), cwd=None, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  found = json.loads(proc.stdout.strip().splitlines()[-1])
  assert found["upstream_axis"] == -1 and found["upstream_excluded"] == [True, True]  # upstream
  assert found["axis"] == 0  # the fix
  assert found["excluded"] == found["users"] == [False, False]  # the kernel by id, bias by name


REPLICA_STREAMS_SCRIPT = helpers.leaving_at_once(textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from tfdp.distributed import compat
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
      drop = keras.layers.Dropout(0.5, seed=7)
    def masks():
      if sys.argv[1] == "fixed":
        with compat.replica_random_streams():
          return drop(tf.ones((4, 64)), training=True)
      return drop(tf.ones((4, 64)), training=True)
    step = tf.function(lambda: strategy.run(masks), autograph=False)
    first, second = (r.numpy() for r in strategy.experimental_local_results(step()))
    again = strategy.experimental_local_results(step())[0].numpy()
    outside = drop(tf.ones((4, 64)), training=True).numpy()  # no replica: as Keras draws
    print(json.dumps({"same": bool((first == second).all()), "next_step_differs": bool(
        (again != first).any()), "kept": float(first.mean()), "outside_kept": float(outside.mean())}))
"""))


def test_each_replica_draws_its_own_dropout_mask():
  """compat.replica_random_streams: Keras 3's Dropout draws its seed from a SeedGenerator whose
  state is one mirrored variable, so both replicas drew the same mask (row k of each replica's
  batch dropped alike; no upstream issue found). The trainer traces each replica's step in it."""
  found = {}
  for mode in ("upstream", "fixed"):
    proc = helpers.run_python([sys.executable, "-c", REPLICA_STREAMS_SCRIPT, mode],
                              env=helpers.env(), cwd=None, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
  assert found["upstream"]["same"]  # upstream: one mask on every replica
  assert not found["fixed"]["same"] and found["fixed"]["next_step_differs"]  # the fix
  for mode in found:  # still dropout at 0.5 (kept values are scaled by 2)
    assert 0.6 < found[mode]["kept"] < 1.4 and 0.6 < found[mode]["outside_kept"] < 1.4


def test_seed_0_shuffles_every_epoch_under_tensorflows_global_seed():
  """tensorflow/tensorflow#17284: with TensorFlow's global seed 0, tf.data's get_seed compares
  (0, op_seed) with (0, 0) as Python values; tfdp's per-epoch shuffle seed is a tensor in a
  flat_map, so its second epoch failed ("uses a tensor as a Python bool", a probe: every
  shuffled tfdp.fit after keras.utils.set_random_seed(0)). compat.set_random_seed stands in
  another global seed for 0. Seen failing with keras.utils.set_random_seed in its place."""
  code = textwrap.dedent("""
      import tensorflow as tf
      from tfdp.distributed import compat
      def second_epoch():
        ds = tf.data.Dataset.range(2).flat_map(
            lambda epoch: tf.data.Dataset.range(4).shuffle(4, seed=epoch * 7 + 1))
        return sorted(int(x) for x in ds)
      tf.random.set_seed(0)
      try:
        second_epoch()
        print("upstream fixed")
      except TypeError:
        print("upstream fails")
      compat.set_random_seed(0)
      assert second_epoch() == [0, 0, 1, 1, 2, 2, 3, 3]
      compat.set_random_seed(5)  # any other seed is TensorFlow's as given
      from tensorflow.python.eager import context
      print(context.global_seed())
      """)
  proc = helpers.run_python([sys.executable, "-c", helpers.leaving_at_once(code)],
                            env=helpers.env(), cwd=None, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.splitlines() == ["upstream fails", "5"], proc.stdout
