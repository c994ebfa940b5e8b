"""Shared test helpers: run the apps in fresh processes, and make tiny datasets."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TRAIN_APP = str(REPO / "apps" / "train.py")
# Resolved once against the directory pytest started in (a relative TFDS_DATA_DIR, as the README
# writes it, must mean the same folder to every test process, whatever its working directory).
CIFAR_DIR = Path(os.environ.get("TFDS_DATA_DIR") or REPO.parent / "shared" / "tensorflow_datasets"
                 ).expanduser().resolve()
HAVE_CIFAR = (CIFAR_DIR / "cifar10").is_dir()
NO_CIFAR_REASON = (f"real CIFAR-10 for TFDS not found in {CIFAR_DIR}/cifar10; set TFDS_DATA_DIR to a "
                   "folder that holds cifar10/3.0.2")


SCRIPTS = REPO / "tests" / "scripts"


def env(**extra) -> dict:
  e = dict(os.environ)
  e["TF_CPP_MIN_LOG_LEVEL"] = "2"
  # tests/scripts holds models and workers made for tests (task.model.module=models_for_tests).
  e["PYTHONPATH"] = os.pathsep.join([str(REPO), str(SCRIPTS), e.get("PYTHONPATH", "")])
  e.pop("TF_CONFIG", None)
  # The tests count CPU replicas and start several workers on one machine: GPUs would replace
  # the CPU replicas and be shared by every worker. Hide them (benchmarks/gpu_smoke.py uses them).
  e["CUDA_VISIBLE_DEVICES"] = ""
  e["TFDP_DEFAULT_CONFIG"] = str(SCRIPTS / "base_job.yaml")  # tests name what they change from it
  e.pop("TFDS_DATA_DIR", None)
  if HAVE_CIFAR:
    e["TFDS_DATA_DIR"] = str(CIFAR_DIR)
  e.update({k: str(v) for k, v in extra.items()})
  return e


def leaving_at_once(script: str) -> str:
  """A test's `python -c` script that, once run to its end, leaves without Python's teardown, as
  tfdp's apps do (cli.exit_now): tearing TensorFlow down cost a small tfdp.fit script 1.2-1.6 CPU
  s and 2.6-2.9 s of wall on the AVX2-only CPU (BENCHMARKS.md)."""
  return script + "\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_sys.stderr.flush()\n_os._exit(0)\n"


def run_python(argv: list, *, env: dict | None, cwd, timeout: float) -> subprocess.CompletedProcess:
  """subprocess.run(argv, capture_output=True, text=True, ...) of `python script.py ...` or
  `python -c ...`; the process is forked from one that has imported TensorFlow where that is the
  same as a fresh interpreter (tests/preloaded.py says when). Not for a test of what a process
  does before or while TensorFlow loads."""
  import preloaded  # pylint: disable=g-import-not-at-top
  return preloaded.run(argv, env=dict(os.environ) if env is None else env,
                       cwd=str(cwd or os.getcwd()), timeout=timeout)


def run_train(*args: str, timeout: float = 600, **extra_env) -> subprocess.CompletedProcess:
  return run_python([sys.executable, TRAIN_APP, *args], timeout=timeout, env=env(**extra_env),
                    cwd=REPO)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
  return [l for l in proc.stderr.splitlines() if l.startswith("tfdp-")]


def id_image(example_id: int, size: int = 8, rng=None) -> np.ndarray:
  """An image whose top-left pixel spells its id (so a pipeline's output names its example)."""
  rng = rng or np.random.default_rng(example_id)
  image = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
  image[0, 0] = [(example_id >> 16) & 255, (example_id >> 8) & 255, example_id & 255]
  return image


def image_ids(images: np.ndarray) -> np.ndarray:
  """Inverse of id_image for a batch normalised with mean 0, std 1."""
  pixel = np.rint(np.asarray(images)[:, 0, 0, :] * 255.0).astype(np.int64)
  return (pixel[:, 0] << 16) | (pixel[:, 1] << 8) | pixel[:, 2]


def encode_png(image: np.ndarray) -> bytes:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.io.encode_png(image).numpy()


def write_tfrecords(folder: Path, counts: list[int], num_classes: int = 4, size: int = 8) -> str:
  """TFRecord files of id images (image: PNG bytes, label: id % num_classes); returns the glob."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  folder.mkdir(parents=True, exist_ok=True)
  next_id = 0
  for f, count in enumerate(counts):
    with tf.io.TFRecordWriter(str(folder / f"part-{f:03d}.tfrecord")) as writer:
      for _ in range(count):
        feature = {
            "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                value=[encode_png(id_image(next_id, size))])),
            "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[next_id % num_classes])),
        }
        writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
        next_id += 1
  return str(folder / "part-*.tfrecord")


def write_image_folder(root: Path, per_class: int = 3, classes=("cat", "dog"), size: int = 8) -> None:
  next_id = 0
  for name in classes:
    (root / name).mkdir(parents=True, exist_ok=True)
    for i in range(per_class):
      (root / name / f"{i}.png").write_bytes(encode_png(id_image(next_id, size)))
      next_id += 1


PROBE = str(SCRIPTS / "probe.py")


def load_probe(out_dir: Path, rank: int = 0) -> dict:
  """What tests/scripts/probe.py wrote for one worker."""
  import json  # pylint: disable=g-import-not-at-top
  ema = out_dir / f"ema-{rank}.npz"
  return {"initial": dict(np.load(out_dir / f"initial-{rank}.npz")),
          "final": dict(np.load(out_dir / f"final-{rank}.npz")),
          "ema": dict(np.load(ema)) if ema.exists() else None,
          "copies": json.loads((out_dir / f"copies-{rank}.json").read_text()),
          "info": json.loads((out_dir / f"info-{rank}.json").read_text())}


# For a test that trains in mixed_bfloat16 (or float16): its processes without an
# ONEDNN_MAX_CPU_ISA cap that imitates an AVX2-only CPU on an AVX-512 one, where tfdp refuses
# bfloat16 (strategy.py, check_bfloat16_under_isa_cap) and float16 aborts in oneDNN ("terminate
# called recursively"); a real AVX2-only CPU runs them, on Eigen's kernels.
UNCAPPED = {"ONEDNN_MAX_CPU_ISA": "ALL"}


def run_probe(tmp_path: Path, name: str, overrides: str, mode: str = "train",
              **extra_env) -> dict:
  """Builds and runs one experiment in a fresh process (logical CPU devices are fixed when
  TensorFlow starts) and returns what tests/scripts/probe.py dumped."""
  out_dir = tmp_path / f"{name}-out"
  out_dir.mkdir(parents=True)
  proc = run_python([sys.executable, PROBE, str(tmp_path / name), overrides, str(out_dir), mode],
                    timeout=600, env=env(**extra_env), cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return load_probe(out_dir)


def max_relative_difference(a: dict, b: dict) -> float:
  """max over variables of max|a - b| / max|b|; the same variable names in both."""
  assert sorted(a) == sorted(b)
  return max(float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-12)) for k in b)
