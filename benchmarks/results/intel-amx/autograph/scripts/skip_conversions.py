import sys, os, runpy
from tensorflow.python.autograph.impl import conversion
orig = conversion.is_allowlisted
KEEP = ("train_loop", "eval_loop")
def wrapped(o, *a, **k):
    if os.environ.get("AGOFF") and getattr(o, "__name__", "") not in KEEP and callable(o):
        return True
    return orig(o, *a, **k)
conversion.is_allowlisted = wrapped
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
