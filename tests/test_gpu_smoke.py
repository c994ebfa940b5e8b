"""benchmarks/gpu_smoke.py --cpu: the GPU-path fixes that logical CPU devices can show, each
against the upstream behaviour it works around (the script runs both)."""
import subprocess
import sys

import pytest

import helpers

SMOKE = str(helpers.REPO / "benchmarks" / "gpu_smoke.py")


@pytest.mark.parametrize("check", [
    # Keras 3 LossScaleOptimizer._tf_apply takes "finite?" from the first replica before the
    # all-reduce (keras-team/keras#18691); tfdp all-reduces first (compat.all_reduce_gradients).
    "loss_scale_agreement",
    # optimizer.iterations stops on skipped float16 steps (keras-team/keras#20878); tfdp counts
    # its own global step.
    "step_counter",
    # TF's HierarchicalCopyAllReduce drops a device's value for odd device counts
    # (cross_device_utils.aggregate_gradients_using_hierarchical_copy); tfdp falls back.
    "hierarchical_copy_odd",
])
def test_cpu_runnable_gpu_path_checks_pass(check):
  proc = subprocess.run([sys.executable, SMOKE, "--cpu", f"--only={check}"], capture_output=True,
                        text=True, timeout=600, env=helpers.env(**helpers.UNCAPPED),
                        cwd=str(helpers.REPO))  # float16 on CPU: no cap that imitates AVX2
  lines = [l for l in proc.stdout.splitlines() if l.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
  assert lines == [l for l in lines if l.startswith(f"PASS {check}:")] and len(lines) == 1, \
      proc.stdout + proc.stderr[-2000:]
  assert proc.returncode == 0


def test_gpu_only_checks_are_skipped_on_cpu_not_passed():
  proc = subprocess.run([sys.executable, SMOKE, "--cpu", "--only=gpus_per_worker"],
                        capture_output=True, text=True, timeout=120, env=helpers.env(),
                        cwd=str(helpers.REPO))
  assert proc.stdout.strip() == "SKIP gpus_per_worker: needs GPUs"


def test_without_two_gpus_it_says_so_at_once():
  """A probe ran it on this CPU-only machine without --cpu: no line for minutes (its first check
  waited on GPUs that are not there). helpers.env hides GPUs, as a CPU machine has none. Seen
  failing on the old script (timed out with no output)."""
  proc = subprocess.run([sys.executable, SMOKE, "--only=devices_and_memory_growth"],
                        capture_output=True, text=True, timeout=120, env=helpers.env(),
                        cwd=str(helpers.REPO))
  assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
  assert "TensorFlow sees 0 GPU(s) here and the checks need 2 or more" in proc.stdout
  assert "--cpu" in proc.stdout
