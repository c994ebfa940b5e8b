"""GPU smoke test: proves tfdp's GPU paths in a few minutes on a machine with GPUs, and shows
the parts that need no GPU on logical CPU devices (CI runs `--cpu`).

  python benchmarks/gpu_smoke.py          # a machine with >= 2 GPUs: every check, < 5 minutes
  python benchmarks/gpu_smoke.py --cpu    # the checks logical CPU devices can show (CI)

One line per check: PASS / FAIL / SKIP, name, what was seen. Exit 1 if any check failed.
Each check runs in a fresh process: devices are fixed when TensorFlow starts.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two replicas in float16 with dynamic loss scaling; only the second replica's batch overflows.
# "upstream": Keras' LossScaleOptimizer alone. "tfdp": as tfdp's trainer does it, the gradients
# all-reduced first (compat.all_reduce_gradients, the optimizer's own all-reduce skipped).
LOSS_SCALE = textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    kind, mode = sys.argv[1], sys.argv[2]
    if kind == "CPU":
      cpu = tf.config.list_physical_devices("CPU")[0]
      tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from tfdp.distributed import compat
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy([f"/{kind.lower()}:0", f"/{kind.lower()}:1"])
    with strategy.scope():
      model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
      opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
      opt.build(model.trainable_variables)
      if mode == "tfdp":
        compat.skip_optimizer_all_reduce(opt)
    data = tf.data.Dataset.from_tensors(tf.constant([[1.0] * 4, [float("inf")] * 4]))
    batch = next(iter(strategy.experimental_distribute_dataset(data)))  # replica 1 gets the inf
    @tf.function
    def step(x):
      def replica_step(x):
        with tf.GradientTape() as tape:
          loss = opt.scale_loss(tf.reduce_sum(tf.cast(model(x), tf.float32)))
        grads = tape.gradient(loss, model.trainable_variables)
        if mode == "tfdp":
          grads = compat.all_reduce_gradients(grads)
        opt.apply_gradients(zip(grads, model.trainable_variables))
      strategy.run(replica_step, args=(x,))
    before = float(opt.dynamic_scale.numpy())
    step(batch)
    kernel = model.layers[0].kernel.value
    print(json.dumps({"weights_finite": bool(all(tf.reduce_all(tf.math.is_finite(c)).numpy()
                                                 for c in kernel.values)),
                      "scale_before": before, "scale_after": float(opt.dynamic_scale.numpy()),
                      "iterations": int(opt.iterations.numpy())}))
""")

# TF's HierarchicalCopyAllReduce over 3 devices, and tfdp's choice for the same request.
HIERARCHICAL = textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    kind = sys.argv[1]
    if kind == "CPU":
      cpu = tf.config.list_physical_devices("CPU")[0]
      tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
    from tfdp import config
    from tfdp.distributed import strategy as strategy_lib
    devices = [f"/{kind.lower()}:{i}" for i in range(3)]
    def total(strategy):
      @tf.function
      def f():
        def step():
          ctx = tf.distribute.get_replica_context()
          return ctx.all_reduce("SUM", tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32))
        return strategy.run(step)
      return [float(v) for v in strategy.experimental_local_results(f())]
    upstream = tf.distribute.MirroredStrategy(devices, tf.distribute.HierarchicalCopyAllReduce())
    ours, plan = strategy_lib.make_strategy(config.RuntimeConfig(
        strategy="mirrored", devices=devices, cross_device_ops="hierarchical_copy"))
    print(json.dumps({"upstream": total(upstream), "tfdp": total(ours),
                      "tfdp_ops": plan.cross_device_ops}))
""")

# A tiny model on inputs scaled up 1000x: its first float16 steps overflow and are skipped.
OVERFLOW_JOB = ",".join([
    "task.model.name=small_cnn", "task.model.kwargs={batch_norm: false, filters: 4}",
    "task.train_data.source=synthetic", "task.train_data.num_examples=256",
    "task.train_data.image_size=8", "task.train_data.num_classes=4",
    "task.train_data.std=[0.0003, 0.0003, 0.0003]", "task.eval_data.source=synthetic",
    "task.eval_data.num_examples=64", "task.eval_data.image_size=8",
    "task.eval_data.num_classes=4", "trainer.global_batch_size=32", "trainer.epochs=1",
    "trainer.steps_per_loop=4", "trainer.export_model=false",
    "runtime.mixed_precision=mixed_float16", "runtime.strategy=mirrored",
])

DEVICES = textwrap.dedent("""
    import json, os
    import tensorflow as tf
    from tfdp import config
    from tfdp.distributed import strategy as strategy_lib
    tf.constant(1.0)  # TensorFlow has started: memory growth can no longer be set
    strategy_lib.configure_devices(config.RuntimeConfig())
    strategy, plan = strategy_lib.make_strategy(config.RuntimeConfig(cpu_replicas=2))
    print(json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                      "gpus": len(tf.config.list_physical_devices("GPU")),
                      "replicas": strategy.num_replicas_in_sync, "reason": plan.reason}))
""")


def env() -> dict:
  e = dict(os.environ)
  e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
  e.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  e.pop("TF_CONFIG", None)
  return e


def run_json(args: list[str], **extra) -> dict:
  proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                        env={**env(), **extra}, cwd=REPO)
  if proc.returncode:
    raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def check_loss_scale_agreement(kind: str) -> tuple[bool, str]:
  upstream = run_json(["-c", LOSS_SCALE, kind, "upstream"])
  ours = run_json(["-c", LOSS_SCALE, kind, "tfdp"])
  ok = (not upstream["weights_finite"] and ours["weights_finite"]
        and ours["scale_after"] == ours["scale_before"] / 2)
  return ok, (f"Keras alone applied replica 1's inf (weights finite: {upstream['weights_finite']}); "
              f"with tfdp every replica skipped (weights finite: {ours['weights_finite']}, loss "
              f"scale {ours['scale_before']:g} -> {ours['scale_after']:g})")


def check_step_counter(kind: str) -> tuple[bool, str]:
  with tempfile.TemporaryDirectory() as tmp:
    job = OVERFLOW_JOB + (",runtime.cpu_replicas=2" if kind == "CPU" else "")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "scripts", "probe.py"),
                           os.path.join(tmp, "run"), job, tmp], capture_output=True, text=True,
                          timeout=300, env=env(), cwd=REPO)
    if proc.returncode:
      return False, proc.stderr.strip().splitlines()[-1]
    with open(os.path.join(tmp, "info-0.json")) as f:
      info = json.load(f)
  ok = info["step"] == 8 and info["iterations"] < info["step"]
  return ok, (f"global step {info['step']} of 8 planned; optimizer.iterations {info['iterations']} "
              "(float16 overflow steps skipped, keras-team/keras#20878)")


def check_hierarchical_copy_odd(kind: str) -> tuple[bool, str]:
  seen = run_json(["-c", HIERARCHICAL, kind])
  ok = seen["upstream"][0] != 6.0 and seen["tfdp"] == [6.0] * 3
  return ok, (f"1+2+3 over 3 devices: TF's HierarchicalCopyAllReduce gives {seen['upstream'][0]:g}, "
              f"tfdp ({seen['tfdp_ops']}) gives {seen['tfdp'][0]:g}")


def check_devices(kind: str) -> tuple[bool, str]:
  seen = run_json(["-c", DEVICES])
  ok = seen["gpus"] >= 1 and seen["replicas"] == seen["gpus"] and "ignored" in seen["reason"]
  return ok, (f"memory growth after start: no error; cpu_replicas=2 with {seen['gpus']} GPU(s) -> "
              f"{seen['replicas']} replica(s): {seen['reason']}")


def check_gpus_per_worker(kind: str) -> tuple[bool, str]:
  code = ("import os, tensorflow as tf; print('GPUS', os.environ.get('CUDA_VISIBLE_DEVICES'), "
          "len(tf.config.list_physical_devices('GPU')))")
  proc = subprocess.run([sys.executable, os.path.join(REPO, "apps", "launch.py"),
                         "--num_workers=2", "--", sys.executable, "-c", code],
                        capture_output=True, text=True, timeout=300, env=env(), cwd=REPO)
  lines = sorted(l.split("GPUS", 1)[1].strip() for l in proc.stdout.splitlines() if "GPUS" in l)
  ok = proc.returncode == 0 and len(lines) == 2 and lines[0].split()[0] != lines[1].split()[0]
  return ok, f"worker CUDA_VISIBLE_DEVICES and GPU count: {lines}"


def check_workers_agree(kind: str) -> tuple[bool, str]:
  # Worker 1 sees one GPU fewer: tfdp must refuse in one line before the first collective.
  script = ("import os, subprocess, sys; ids = os.environ.get('CUDA_VISIBLE_DEVICES', '0,1');"
            "os.environ['CUDA_VISIBLE_DEVICES'] = ids if os.environ['TFDP_WORKER_INDEX'] == '0' "
            "else ids.split(',')[0]; sys.exit(subprocess.call(sys.argv[1:]))")
  with tempfile.TemporaryDirectory() as tmp:
    job = OVERFLOW_JOB.replace("runtime.mixed_precision=mixed_float16,", "").replace(
        "runtime.strategy=mirrored", "runtime.strategy=multi_worker_mirrored")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "apps", "launch.py"),
                           "--num_workers=2", "--gpus_per_worker=2", "--", sys.executable, "-c",
                           script, sys.executable, os.path.join(REPO, "apps", "train.py"),
                           f"--model_dir={tmp}/run", f"--params_override={job}"],
                          capture_output=True, text=True, timeout=300, env=env(), cwd=REPO)
  out = proc.stdout + proc.stderr
  ok = proc.returncode != 0 and "workers disagree" in out and "local_replicas" in out
  line = next((l for l in out.splitlines() if "workers disagree" in l), out[-300:])
  return ok, line.strip()


CHECKS = [  # (name, runs on logical CPUs, function)
    ("loss_scale_agreement", True, check_loss_scale_agreement),
    ("step_counter", True, check_step_counter),
    ("hierarchical_copy_odd", True, check_hierarchical_copy_odd),
    ("devices_and_memory_growth", False, check_devices),
    ("gpus_per_worker", False, check_gpus_per_worker),
    ("workers_agree_on_devices", False, check_workers_agree),
]


def visible_gpus() -> int:
  """The GPUs TensorFlow sees, counted in a process of its own (devices are fixed at start)."""
  try:
    proc = subprocess.run([sys.executable, "-c", "import tensorflow as tf; print(len("
                           "tf.config.list_physical_devices('GPU')))"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
  except subprocess.TimeoutExpired:
    return 0
  lines = proc.stdout.strip().splitlines()
  return int(lines[-1]) if proc.returncode == 0 and lines and lines[-1].isdigit() else 0


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cpu", action="store_true", help="run the CPU-runnable checks on CPUs")
  parser.add_argument("--only", default="", help="comma-separated check names")
  args = parser.parse_args()
  kind = "CPU" if args.cpu else "GPU"
  if args.cpu:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
  else:  # without 2 GPUs the first check waited minutes on devices that are not there, silently
    gpus = visible_gpus()
    if gpus < 2:
      print(f"gpu_smoke: TensorFlow sees {gpus} GPU(s) here and the checks need 2 or more; run "
            "it on a machine with GPUs, or pass --cpu for the checks CPUs can show.", flush=True)
      return 2
  failed = 0
  for name, cpu_ok, check in CHECKS:
    if args.only and name not in args.only.split(","):
      continue
    if args.cpu and not cpu_ok:
      print(f"SKIP {name}: needs GPUs", flush=True)
      continue
    try:
      ok, detail = check(kind)
    except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
      ok, detail = False, f"{type(e).__name__}: {e}"
    failed += not ok
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
