"""tfdp-bench: what data-parallel training costs here, and where the time goes (modes.py says
what each of the five modes measures).

The parent process never imports TensorFlow: it checks every config first (options.py, jobs.py),
then runs each measurement in a fresh process (processes.py → `python -m tfdp.bench CELL_JSON` →
cells.py), and writes tables, CSVs and pictures (report.py). run.py ties them together.
"""
from tfdp.bench.cells import MAX_BLOCK_BYTES, ops_per_block
from tfdp.bench.jobs import allreduce_sizes
from tfdp.bench.modes import loopback_tcp_seconds
from tfdp.bench.options import (DATA_CHOICES, HOSTS_CHOICES, MODES, PROG, BenchError,
                                BenchOptions, parse_float_list, parse_int_list, parse_name_list)
from tfdp.bench.report import VIEWS, figure, targets_table, time_to_target
from tfdp.bench.run import run_mode

__all__ = ["DATA_CHOICES", "HOSTS_CHOICES", "MAX_BLOCK_BYTES", "MODES", "PROG", "VIEWS",
           "BenchError", "BenchOptions", "allreduce_sizes", "figure", "loopback_tcp_seconds",
           "ops_per_block", "parse_float_list", "parse_int_list", "parse_name_list", "run_mode",
           "targets_table", "time_to_target"]
