"""Start-up is counted from the process's creation, so Python's and TensorFlow's imports count."""
import subprocess
import sys


def test_process_age_counts_from_the_process_start_not_from_the_import():
  code = ("import time; time.sleep(1.5); t = time.time(); from tfdp import logs; "
          "print(logs.process_age_seconds(), time.time() - t)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       timeout=60).stdout.split()
  age, since_import = float(out[0]), float(out[1])
  assert 1.5 <= age - since_import < 5.0  # the 1.5 s before the import are in it
