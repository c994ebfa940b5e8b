"""Data each worker reads alone ({worker} shards): the shard count is the data's, so shards map
onto any worker count (task.train_data.shards_per_worker / worker_shards), and uneven shards
train at full speed: each shard gives its own share of every step's global batch, so every
worker ends its shard in the same steps. Real worker processes where training is compared."""
import subprocess
import sys

import pandas as pd
import pytest

import helpers
from tfdp import config as config_lib
from tfdp.core import data as data_lib
from tfdp.core import local_shards
from tfdp.core import task as tasks
from tfdp.errors import ConfigError, OutputError
from tfdp.workloads.recommenders import interactions

LAUNCH_APP = str(helpers.REPO / "apps" / "launch.py")


# ---- the decisions, pure --------------------------------------------------------------------


def test_each_shard_gets_rows_in_proportion_and_all_end_in_the_fewest_steps():
  # 60/30/10% of 3000 over a global batch of 100: 30 steps, as one process takes.
  assert local_shards.split_local_batch([1800, 900, 300], 100, "k") == ([60, 30, 10], 30)
  for counts, batch in (([165, 84, 24], 20), ([7, 0, 5, 1], 6), ([10, 10, 11], 10),
                        ([1000, 1], 2), ([3, 3], 50)):
    rows, steps = local_shards.split_local_batch(counts, batch, "k")
    assert sum(rows) == batch and all(r > 0 for r, c in zip(rows, counts) if c)
    assert max(-(-c // r) for r, c in zip(rows, counts) if c) == steps  # all done by then
    # and no fewer steps could hold every shard with a whole row count each
    assert steps == 1 or sum(-(-c // (steps - 1)) for c in counts) > batch
    assert steps >= -(-sum(counts) // batch)
  with pytest.raises(ConfigError, match="'trainer.global_batch_size' is 2.*3 non-empty shards"):
    local_shards.split_local_batch([5, 5, 5], 2, "trainer.global_batch_size")


def shard_config(**kwargs):
  return config_lib.schema.DataConfig(source="interactions", path="/d/x-{worker}.csv", **kwargs)


def test_shards_map_onto_workers_from_the_config_and_the_worker_count_alone():
  assert local_shards.map_shards(shard_config(), 3, "k") == ((0,), (1,), (2,))
  assert local_shards.map_shards(shard_config(shards_per_worker=2), 2, "k") == ((0, 1), (2, 3))
  assert local_shards.map_shards(shard_config(shards_per_worker=2), 1, "k") == ((0, 1),)
  lists = shard_config(worker_shards=[[2, 0], [1]])
  assert local_shards.map_shards(lists, 2, "k") == ((2, 0), (1,))
  with pytest.raises(ConfigError, match="'k.worker_shards' has 2 list.*group has 3 worker"):
    local_shards.map_shards(lists, 3, "k")
  with pytest.raises(ConfigError, match="single-process run; set k.shards_per_worker"):
    local_shards.map_shards(shard_config(), 1, "k")  # one shard of several, silently


@pytest.mark.parametrize("value, words", [
    ([[0, 1], [1, 3]], "missing [2], twice [1]"), ([[0], [2]], "missing [1]"),
    ([[0, 1], [1]], "missing [], twice [1]"),
    ([[0], []], "non-empty list"), ([[0, -1]], "integers >= 0")])
def test_a_mapping_that_reads_a_shard_twice_or_never_is_refused_before_tensorflow(value, words):
  config = config_lib.ExperimentConfig()
  config.task.train_data = shard_config(worker_shards=value)
  with pytest.raises(ConfigError, match="task.train_data.worker_shards") as error:
    config_lib.checks._validate_data("task.train_data.", config.task.train_data)
  assert words in str(error.value)
  both = shard_config(worker_shards=[[0]], shards_per_worker=1)
  with pytest.raises(ConfigError, match="both set"):
    config_lib.checks._validate_data("task.train_data.", both)
  plain = config_lib.schema.DataConfig(source="interactions", path="/d/x.csv", shards_per_worker=2)
  with pytest.raises(ConfigError, match="no {worker} placeholder"):
    config_lib.checks._validate_data("task.train_data.", plain)


def test_a_resume_reads_the_runs_shards_however_mapped():
  record = {"sharding": "local", "shard_counts": [120, 60], "history": [{"workers": 2}]}
  local_shards.check_resumed_shards(record, [120, 60], 1, "task.train_data", "run")  # mapped
  with pytest.raises(OutputError, match=r"read 2 shard\(s\) of \[120, 60\].*reads 1 of \[120\]"
                     r".*task.train_data.shards_per_worker.*--start_over"):
    local_shards.check_resumed_shards(record, [120], 1, "task.train_data", "run")
  old = {"sharding": "local", "history": [{"workers": 3}]}  # before shard counts were recorded
  local_shards.check_resumed_shards(old, [5, 5, 5], 3, "task.train_data", "run")
  with pytest.raises(OutputError, match=r"read 3 shard\(s\)"):
    local_shards.check_resumed_shards(old, [5, 5], 2, "task.train_data", "run")


# ---- tiny planted data, shards of 60 / 30 / 10% of the users --------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
  root = tmp_path_factory.mktemp("shards")
  frame, _ = interactions.planted_interactions(30, 30, 2, 0.3, 10, seed=0)
  frame.to_csv(root / "all.csv", index=False)
  interactions.write_shards(frame, str(root / "part-{worker}.csv"), 3, fractions=[0.6, 0.3, 0.1])
  for column, vocab in (("user", "users.txt"), ("item", "items.txt")):
    interactions.build_vocabulary(frame[column].to_numpy(), str(root / vocab))
  return root


def job(root, path, extra=""):
  data = "source=interactions,user_column=user,item_column=item,label_column=label"
  return ",".join([
      "task.name=matrix_factorization", "task.model.kwargs={embedding_dim: 2, global_mean: 3.5}",
      f"task.recommender.user_vocab_path={root / 'users.txt'}",
      f"task.recommender.item_vocab_path={root / 'items.txt'}",
      *[f"task.train_data.{kv}" for kv in data.split(",")], f"task.train_data.path={path}",
      *[f"task.eval_data.{kv}" for kv in data.split(",")],
      f"task.eval_data.path={root / 'all.csv'}",
      "trainer.global_batch_size=20", "trainer.epochs=2", "trainer.steps_per_loop=7",
      "trainer.export_model=false", "trainer.optimizer.name=adam",
      "trainer.optimizer.weight_decay=0", "trainer.learning_rate.base_lr=0.05",
      "trainer.learning_rate.base_batch_size=20", "trainer.learning_rate.schedule=constant",
      "runtime.strategy=auto", "runtime.cpu_replicas=0", "runtime.intra_op_threads=1",
      "runtime.inter_op_threads=1"]) + extra


def probe(model_dir, overrides, out_dir, workers=0, mode="train"):
  """tests/scripts/probe.py in one process, or on `workers` processes: every rank's dump."""
  out_dir.mkdir(parents=True, exist_ok=True)
  command = [sys.executable, helpers.PROBE, str(model_dir), overrides, str(out_dir), mode]
  if workers:
    command = [sys.executable, LAUNCH_APP, f"--num_workers={workers}", "--", *command]
  proc = subprocess.run(command, env=helpers.env(), cwd=str(helpers.REPO), capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  return [helpers.load_probe(out_dir, rank) for rank in range(max(workers, 1))]


def plans(root, overrides, workers):
  """Every worker's task and plan, built in this process (counts exchanged by hand)."""
  config = config_lib.load_config([], [overrides])
  built = [tasks.make_task(config.task, w, workers) for w in range(workers)]
  sources = [t.build_source(config.task.train_data) for t in built]
  exchanged = [(list(s.shards), s.file_counts) for s in sources]
  return config, [(t, data_lib.plan_input(s, config.task.train_data, 20, workers, workers,
                                          local_counts=exchanged)) for t, s in zip(built, sources)]


def step_ids(config, task_and_plan, pipeline, start_step=0):
  """Step -> the (user, item) pairs a pipeline gives it in epoch 0 from `start_step` on."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  task, plan = task_and_plan
  ctx = tf.distribute.InputContext(plan.num_pipelines, pipeline, plan.num_pipelines)
  fn = data_lib.make_dataset_fn(plan, config.task.train_data, task, training=True, seed=3,
                                epochs=1, start_step=start_step)
  steps = {}
  for step, batch in enumerate(fn(ctx), start=start_step):
    real = batch["weight"].numpy() > 0
    steps[step] = sorted(zip(batch["user"].numpy()[real], batch["item"].numpy()[real]))
  return steps


def test_mapped_shards_take_the_same_examples_in_every_step_so_a_remap_counts_each_once(shards):
  # 2 workers reading shard 0 and 1 stop at step 4; 1 worker reading both resumes there.
  two_config, two = plans(shards, job(shards, shards / "part-{worker}.csv",
                                      ",task.train_data.worker_shards=[[0], [1]]"), 2)
  one_config, one = plans(shards, job(shards, shards / "part-{worker}.csv",
                                      ",task.train_data.shards_per_worker=2"), 1)
  assert two[0][1].steps_per_epoch == one[0][1].steps_per_epoch
  before = [step_ids(two_config, two[w], w) for w in range(2)]
  after = step_ids(one_config, one[0], 0, start_step=4)
  for step, pairs in after.items():
    assert pairs == sorted(before[0][step] + before[1][step]), step  # the same step, remapped
  seen = [p for w in range(2) for s in range(4) for p in before[w][s]]
  seen += [p for pairs in after.values() for p in pairs]
  expected = sum(one[0][1].shard_counts)
  assert len(seen) == len(set(seen)) == expected == sum(len(interactions.read_interactions(
      str(shards / f"part-{i}.csv"), "user", "item")) for i in range(2))


def test_uneven_shards_end_together_in_the_steps_one_process_takes(shards):
  _, built = plans(shards, job(shards, shards / "part-{worker}.csv"), 3)
  plan = built[0][1]
  counts, rows, steps = plan.shard_counts, plan.shard_batches, plan.steps_per_epoch
  assert counts[0] > 3 * counts[2] and sum(rows) == 20  # 60 / 30 / 10%, one global batch
  assert [-(-c // r) for c, r in zip(counts, rows)] == [steps] * 3 == [-(-sum(counts) // 20)] * 3
  assert [plan.pipeline_replica_batch(w) for w in range(3)] == list(rows)  # its own batch


def test_two_uneven_shards_train_as_one_process_and_resume_on_one_worker(shards, tmp_path):
  # Shards 0 and 1 (60% and 30% of the users) on 2 workers, each with its own batch.
  path, two = shards / "part-{worker}.csv", ",task.train_data.shards_per_worker=1"
  config, built = plans(shards, job(shards, path, two), 2)
  plan = built[0][1]
  counts, rows, steps = plan.shard_counts, plan.shard_batches, plan.steps_per_epoch
  assert counts[0] > 1.5 * counts[1] and rows[0] > rows[1] and sum(rows) == 20
  # whole rows: one shard may end a step early (its last step padded), never a step late
  ends = [-(-c // r) for c, r in zip(counts, rows)]
  assert max(ends) == steps == -(-sum(counts) // 20) and min(ends) >= steps - 1
  one = ",task.train_data.shards_per_worker=2"  # one process reads both shards
  reference = probe(tmp_path / "ref", job(shards, path, one), tmp_path / "ref-out",
                    mode="train_and_eval")[0]
  # 2 workers stop 3 steps into the second epoch; one worker reading both shards resumes there
  model_dir = tmp_path / "run"
  workers = probe(model_dir, job(shards, path, f"{two},trainer.max_steps={steps + 3}"),
                  tmp_path / "mw-out", 2, "train_and_eval")
  assert {w["info"]["step"] for w in workers} == {steps + 3}  # every worker: the same steps
  evaluated = [pd.read_csv(d / "metrics.csv").iloc[0] for d in (model_dir, tmp_path / "ref")]
  assert evaluated[0]["eval_examples"] == evaluated[1]["eval_examples"] == 300  # exact sums
  rmse = [e["eval_rmse"] for e in evaluated]
  assert abs(rmse[0] - rmse[1]) <= 1e-5 * rmse[1]
  resumed = probe(model_dir, job(shards, path, one), tmp_path / "resumed-out")[0]
  assert resumed["info"]["step"] == reference["info"]["step"] == 2 * steps
  assert helpers.max_relative_difference(reference["final"], reference["initial"]) > 0.05
  assert helpers.max_relative_difference(resumed["final"], reference["final"]) <= 1e-5
