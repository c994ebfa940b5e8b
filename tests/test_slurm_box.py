"""tfdp under a 3-node Slurm in a box (tests/scripts/slurm_box.py): a job submitted for 2-3
nodes runs on 3, is requeued while one node is drained and comes back on 2, where it resumes by
the elastic rules (issue #21: the requeued job that comes back with another node count)."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

import helpers

sys.path.insert(0, str(helpers.SCRIPTS))
import slurm_box  # noqa: E402  pylint: disable=wrong-import-position
from test_slurm import SYNTHETIC, shipped_template  # noqa: E402  pylint: disable=wrong-import-position

UNAVAILABLE = slurm_box.unavailable()


def test_the_box_refuses_a_spool_too_deep_for_slurmstepds_socket(tmp_path):
  """A pytest-xdist tmp_path as spool made the batch step's socket path 109 bytes: the job's
  launch failed and Slurm held it ("launch failed requeued held"). The box's own spool fits."""
  deep = Path("/tmp/pytest-of-root/pytest-12/popen-gw1/test_a_requeued_job_that_comes0/slurm")
  with pytest.raises(ValueError, match="too deep for slurmstepd's sockets"):
    slurm_box.write_conf(tmp_path, deep / "spool")
  spool = slurm_box.short_folder()  # as slurm_box.run's
  try:
    conf = slurm_box.write_conf(tmp_path, spool).read_text()
  finally:
    shutil.rmtree(spool)
  assert f"SlurmdSpoolDir={spool}/%n" in conf


def _logs(folder: Path) -> str:
  return "".join(f"\n--- {log.name}\n" + log.read_text()[-1500:]
                 for log in sorted((folder / "log").glob("slurm*.log")))


@pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
@pytest.mark.xdist_group("many_processes")  # under `pytest -n 2 --dist loadgroup`
def test_a_requeued_job_that_comes_back_on_fewer_nodes_resumes_with_the_elastic_rules(tmp_path):
  """The shipped template with `--nodes=2-3`, one task per node: 3 workers on node[1-3]. After
  its first checkpoint node3 is drained and the job requeued; it comes back on node[1-2] and its
  2 workers resume the 3-worker run: global batch 12 kept, accumulation 1 -> 2, the final step
  exact, each epoch once, no job or process left."""
  run, folder = tmp_path / "run", tmp_path / "slurm"
  steps_per_epoch, epochs = 30, 2
  script = tmp_path / "job.sbatch"
  script.write_text(shipped_template("#SBATCH --nodes=2-3\n"))
  out = tmp_path / "job.out"  # both runs, the first and the requeued one
  env = helpers.env()
  env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
  scenario = {"script": str(script), "output": str(out), "model_dir": str(run), "drain": "node3",
              "timeout": 200, "args": [
                  f"--model_dir={run}", "--mode=train",
                  f"--params_override={SYNTHETIC},"
                  f"task.train_data.num_examples={steps_per_epoch * 12},"
                  f"trainer.global_batch_size=12,trainer.epochs={epochs},"
                  "trainer.steps_per_loop=2,trainer.checkpoint_every_steps=10,"
                  "trainer.export_model=false"]}
  result = slurm_box.run(folder, scenario, env)
  events = json.loads((folder / "events.json").read_text())
  text = out.read_text() if out.exists() else ""
  shown = (json.dumps(events) + "\n" + text[-3000:] + "\n" + result["hosts"][0]["log"][-2000:]
           + _logs(folder))
  assert [h["returncode"] for h in result["hosts"]] == [0] * 4, shown
  assert events["first_run"] == ["RUNNING", "node[1-3]"], shown
  assert events["second_run"] == ["RUNNING", "node[1-2]"], shown
  assert events["nodes_after"] == {"node1": "idle", "node2": "idle", "node3": "drained"}, shown
  assert "worker 2 of 3 (slurm)" in text and "worker 1 of 2 (slurm)" in text, shown
  # the chief's start-up line (every worker also logs it, prefixed)
  lines = re.findall(r"^resumed at step (\d+) on 2 workers \(was 3\): (.*)$", text, re.MULTILINE)
  assert len(lines) == 1 and int(lines[0][0]) >= 10, shown
  assert lines[0][1] == "accumulation 1 → 2, per-replica batch 3, global batch 12 kept", shown
  history = json.loads((run / "checkpoints" / "run.json").read_text())["history"]
  assert history == [{"from_step": 0, "workers": 3, "replicas": 3},
                     {"from_step": int(lines[0][0]), "workers": 2, "replicas": 2}], shown
  metrics = pd.read_csv(run / "metrics.csv")
  assert metrics["epoch"].tolist() == list(range(1, epochs + 1)), metrics
  assert metrics["step"].iloc[-1] == steps_per_epoch * epochs
  # nothing left: no job in the queue, no process in the box once Slurm was shut down
  assert events["jobs_left"] == [] and result["runs"][-1]["left"] == [], shown
