"""The smoke runs the Slurm scripts suggest in their comments load and validate as the job's
config with the suggested files layered on (slurm_shakespeare_mlm.sbatch suggested the image
runlocal.yaml, which a text task refuses: "task.train_data.split is 'train[:1024]'")."""
import re
import shlex

import pytest

import helpers
from tfdp import cli
from tfdp import config as config_lib

CLUSTER_DIR = helpers.REPO / "configs" / "cluster"
SCRIPTS = sorted(CLUSTER_DIR.glob("*.sbatch"))


def flag_values(args, name):
  return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_the_suggested_smoke_run_is_a_valid_config_for_the_job(script):
  text = script.read_text()
  srun = next(line for line in text.splitlines() if line.startswith("srun "))
  job = shlex.split(srun.replace("$HOME", "/home/u").split(" 2>&1 ")[0])  # up to srun's redirections
  suggested = [shlex.split(line.lstrip("# "))[2:] for line in text.splitlines()
               if re.match(rf"#\s+sbatch configs/cluster/{re.escape(script.name)} --", line)]
  assert suggested, "no smoke run suggested"
  for extra in suggested:
    files = flag_values(job, "config_file") + flag_values(extra, "config_file")
    config = config_lib.load_config([cli.find_config(f) for f in files],
                                    flag_values(job, "params_override"))
    config_lib.validate(config)
