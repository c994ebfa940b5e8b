"""Test worker: train one config through tfdp and save this worker's final weights.

  python tests/scripts/train_and_dump.py MODEL_DIR OVERRIDES OUT_DIR
writes OUT_DIR/weights-<rank>.npz (every worker, not only the chief, for comparisons).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # pylint: disable=g-import-not-at-top

from tfdp import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
from tfdp import config as config_lib  # pylint: disable=g-import-not-at-top
from tfdp import experiment  # pylint: disable=g-import-not-at-top

model_dir, overrides, out_dir = sys.argv[1:4]
result = experiment.run(config_lib.load_config([], [overrides]), model_dir, "train")
rank = cluster_lib.resolve_cluster().rank
weights = [np.asarray(w) for w in result["trainer"].model.get_weights()]
np.savez(os.path.join(out_dir, f"weights-{rank}.npz"), *weights)
print(f"worker {rank}: step {result['step']}", flush=True)
