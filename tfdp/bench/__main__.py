"""`python -m tfdp.bench CELL_JSON`: how tfdp-bench runs each measurement in a fresh process."""
import sys

from tfdp.bench.cells import cell_main

if __name__ == "__main__":
  cell_main(sys.argv)
