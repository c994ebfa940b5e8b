"""Tests for tfdp.distributed.gpus: which GPUs each local worker gets (no TensorFlow)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

from tfdp.distributed import gpus
from tfdp.errors import ClusterError

UNSET = None  # CUDA_VISIBLE_DEVICES not in the launcher's env.


def _env(cuda_visible_devices):
  if cuda_visible_devices is UNSET:
    return {"PATH": "/usr/bin"}
  return {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": cuda_visible_devices}


# (workers, gpus_per_worker, CUDA_VISIBLE_DEVICES, /dev/nvidiaN count,
#  expected per-worker values (None: env left as it is), expected idle GPUs).
PLANS = {
    "auto_cpu_machine": (2, "auto", UNSET, 0, None, []),
    "auto_empty_list_stays": (2, "auto", "", 4, None, []),
    "auto_minus_one_stays": (2, -1, "-1", 4, None, []),
    "auto_even": (2, "auto", "0,1,2,3", 0, ["0,1", "2,3"], []),
    "auto_one_each": (4, "auto", "0,1,2,3", 0, ["0", "1", "2", "3"], []),
    "auto_odd_leaves_idle": (2, -1, "0,1,2", 0, ["0", "1"], ["2"]),
    "auto_ids_kept_as_given": (2, "auto", "4, 6,5,7", 0, ["4,6", "5,7"], []),
    "auto_uuids": (2, "auto", "GPU-aa11,GPU-bb22", 0, ["GPU-aa11", "GPU-bb22"],
                   []),
    "auto_stops_at_invalid": (1, "auto", "3,2,-1,0", 0, ["3,2"], []),
    "auto_device_files": (2, "auto", UNSET, 4, ["0,1", "2,3"], []),
    "auto_single_worker_gets_all": (1, "auto", UNSET, 3, ["0,1,2"], []),
    "zero_is_cpu": (2, 0, "0,1", 0, ["", ""], ["0", "1"]),
    "zero_on_cpu_machine": (3, "0", UNSET, 0, ["", "", ""], []),
    "explicit_fits": (2, 1, "0,1,2,3", 0, ["0", "1"], ["2", "3"]),
    "explicit_exact": (2, "2", UNSET, 4, ["0,1", "2,3"], []),
}


@pytest.mark.parametrize("case", sorted(PLANS))
def test_plan_worker_gpus(case):
  workers, per_worker, visible, device_files, devices, idle = PLANS[case]
  plan = gpus.plan_worker_gpus(workers, per_worker, _env(visible),
                               device_files)
  assert plan.devices == devices
  assert plan.idle == idle


# (workers, gpus_per_worker, CUDA_VISIBLE_DEVICES, /dev/nvidiaN count,
#  words the one-line message must contain).
TOO_FEW = {
    "auto_fewer_gpus_than_workers": (
        4, "auto", "0,1", 0,
        ["4 workers", "only 2 GPUs", "CUDA_VISIBLE_DEVICES='0,1'",
         "--num_workers 2", "--gpus_per_worker=0"]),
    "auto_one_device_file": (
        2, "auto", UNSET, 1,
        ["only 1 GPU", "1 /dev/nvidiaN device file", "--num_workers 1",
         "--gpus_per_worker=0"]),
    "explicit_lower_per_worker": (
        2, 2, "0,1,2", 0,
        ["--gpus_per_worker=2 with 2 workers needs 4 GPUs", "3 are visible",
         "--gpus_per_worker=1", "--gpus_per_worker=0"]),
    "explicit_fewer_workers": (
        3, 2, "0,1", 0,
        ["needs 6 GPUs", "2 are visible", "--num_workers 1",
         "--gpus_per_worker=0"]),
    "explicit_no_gpu": (
        2, 1, UNSET, 0,
        ["needs 2 GPUs but 0 are visible", "0 /dev/nvidiaN device files",
         "--gpus_per_worker=0 to train on CPU"]),
    "explicit_hidden_gpus": (
        1, 1, "", 4,
        ["needs 1 GPU but 0 are visible", "CUDA_VISIBLE_DEVICES=''",
         "--gpus_per_worker=0"]),
}


@pytest.mark.parametrize("case", sorted(TOO_FEW))
def test_too_few_gpus_is_one_line_naming_the_fix(case):
  workers, per_worker, visible, device_files, words = TOO_FEW[case]
  with pytest.raises(ClusterError) as raised:
    gpus.plan_worker_gpus(workers, per_worker, _env(visible), device_files)
  message = str(raised.value)
  assert "\n" not in message
  for word in words:
    assert word in message, message


@pytest.mark.parametrize("value, expected", [
    ("auto", gpus.AUTO), ("AUTO", gpus.AUTO), ("-1", gpus.AUTO),
    (-1, gpus.AUTO), ("0", 0), (0, 0), ("2", 2), (3, 3),
])
def test_parse_gpus_per_worker(value, expected):
  assert gpus.parse_gpus_per_worker(value) == expected


@pytest.mark.parametrize("value", ["two", "-2", -3, "1.5", ""])
def test_bad_gpus_per_worker_is_one_line(value):
  with pytest.raises(ClusterError) as raised:
    gpus.parse_gpus_per_worker(value)
  message = str(raised.value)
  assert "\n" not in message and "--gpus_per_worker must be auto" in message


@pytest.mark.parametrize("text, ids", [
    ("0,1,2", ["0", "1", "2"]),
    ("3, 1", ["3", "1"]),
    ("", []),
    ("-1", []),
    ("NoDevFiles", []),
    ("1,-1,2", ["1"]),
    ("GPU-8932f937,MIG-1b2c", ["GPU-8932f937", "MIG-1b2c"]),
])
def test_parse_visible_devices(text, ids):
  assert gpus.parse_visible_devices(text) == ids


def test_count_nvidia_device_files(tmp_path):
  for name in ("nvidia0", "nvidia1", "nvidia12", "nvidiactl", "nvidia-uvm",
               "nvidia-modeset", "nvidia0x", "null"):
    (tmp_path / name).write_text("")
  assert gpus.count_nvidia_device_files(str(tmp_path)) == 3
  assert gpus.count_nvidia_device_files(str(tmp_path / "missing")) == 0


def test_describe_lines():
  even = gpus.plan_worker_gpus(2, "auto", _env("0,1,2,3"), 0)
  assert even.describe() == (
      "GPUs per worker (CUDA_VISIBLE_DEVICES): w0=0,1 w1=2,3")
  odd = gpus.plan_worker_gpus(2, "auto", _env("0,1,2"), 0)
  assert odd.describe() == (
      "GPUs per worker (CUDA_VISIBLE_DEVICES): w0=0 w1=1; 1 GPU left idle: 2.")
  cpu = gpus.plan_worker_gpus(2, 0, _env("0,1"), 0)
  assert cpu.describe() == ("workers run on CPU (CUDA_VISIBLE_DEVICES=''); "
                            "2 visible GPUs left idle.")
  # Nothing to say when no GPU is involved.
  assert gpus.plan_worker_gpus(2, "auto", _env(UNSET), 0).describe() == ""
  assert gpus.plan_worker_gpus(2, 0, _env(UNSET), 0).describe() == ""


def test_gpus_module_does_not_import_tensorflow():
  code = ("import sys, tfdp.distributed.gpus; "
          "sys.exit(1 if 'tensorflow' in sys.modules else 0)")
  subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
