"""Set for the pytest process itself what helpers.env() sets for the processes tests start."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import helpers  # pylint: disable=wrong-import-position
# pylint: disable-next=wrong-import-position,unused-import
from xdist_groups import pytest_collection_modifyitems  # noqa: E402,F401  (pytest-xdist#1386)

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # tests that import TensorFlow here count CPU devices
if helpers.HAVE_CIFAR:
  os.environ["TFDS_DATA_DIR"] = str(helpers.CIFAR_DIR)
