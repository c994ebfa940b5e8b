"""Uneven splits: a global batch no replica count divides (16 over 3) runs with every replica's
batch padded to the larger share (weight 0), each optimizer step on the same examples as an even
split, and the loss divided by the real global batch: the same training as on 1 or 2 replicas."""
from __future__ import annotations

import collections

import pytest

import helpers
from test_data import data_config, pipeline_epoch
from test_elastic import ELASTIC
from tfdp.core import data as data_lib
from tfdp.core import outputs
from tfdp.core import resume
from tfdp.errors import ConfigError


@pytest.fixture(scope="module")
def id_data(tmp_path_factory):
  data = data_config(source="tfrecord", shard_policy="data", cache=False,
                     path=helpers.write_tfrecords(tmp_path_factory.mktemp("rec"), [40, 30, 50]))
  return data, data_lib.make_source(data)  # 120 id images: 8 steps of 16, the last 8 real


def steps_of(plan, data, start_step=0) -> dict[int, list[int]]:
  """Global step -> the real example ids all pipelines give it, and checks each per-replica
  batch: the plan's padded shape, real rows first."""
  steps = collections.defaultdict(list)
  for pipeline in range(plan.num_pipelines):
    ids, masks = pipeline_epoch(plan, data, pipeline, start_step=start_step)
    for offset in range(0, len(ids), plan.step_batch):
      rows = slice(offset, offset + plan.step_batch)
      steps[start_step + offset // plan.step_batch].extend(ids[rows][masks[rows] > 0].tolist())
  return steps


@pytest.mark.parametrize("replicas,pipelines,accumulation", [(3, 1, 1), (3, 3, 1), (3, 3, 2),
                                                             (6, 2, 1)])
def test_an_uneven_split_reads_every_example_once_in_the_even_splits_steps(
    id_data, replicas, pipelines, accumulation):
  data, source = id_data
  even = data_lib.plan_input(source, data, 16, 1, 1)
  plan = data_lib.plan_input(source, data, 16, replicas, pipelines,
                             accumulation_steps=accumulation)
  slots = replicas * accumulation
  assert plan.per_replica_batch == -(-16 // slots) and plan.per_replica_batch * slots > 16
  assert (plan.global_batch, plan.steps_per_epoch) == (16, even.steps_per_epoch) == (16, 8)
  expected, got = steps_of(even, data), steps_of(plan, data)
  epoch = [i for step in got.values() for i in step]
  assert sorted(collections.Counter(epoch).items()) == [(i, 1) for i in range(120)]
  assert sorted(got) == list(range(8))
  for step in range(8):
    assert sorted(got[step]) == sorted(expected[step]), step
  # Resumed mid-epoch (and past the last real step of a pipeline): the same steps from there on.
  for start in (5, 7):
    resumed = steps_of(plan, data, start_step=start)
    assert {s: sorted(v) for s, v in resumed.items()} == {
        s: sorted(expected[s]) for s in range(start, 8)}, start


def test_each_replica_gets_its_share_and_weight_zero_copies_of_it(id_data):
  data, source = id_data
  plan = data_lib.plan_input(source, data, 16, 3, 3)
  for pipeline, share in enumerate((6, 5, 5)):  # 16 over 3: 6, 5, 5 real rows, padded to 6
    assert plan.block_share(pipeline)[1] == share
    ids, masks = pipeline_epoch(plan, data, pipeline)
    first_step_ids, first_step_masks = ids[:6], masks[:6]
    assert first_step_masks.tolist() == [1.0] * share + [0.0] * (6 - share)
    assert set(first_step_ids[share:]) <= set(first_step_ids[:share])  # copies of real rows
  # Evaluation (no shuffle) with an uneven batch: every example counts once.
  seen = []
  for pipeline in range(3):
    ids, masks = pipeline_epoch(plan, data, pipeline, training=False)
    seen.extend(ids[masks > 0].tolist())
  assert sorted(seen) == list(range(120))


def test_file_shards_refuse_an_uneven_split_in_one_line(tmp_path):
  data = data_config(source="tfrecord", shard_policy="file", cache=False,
                     path=helpers.write_tfrecords(tmp_path, [40, 30, 50]))
  with pytest.raises(ConfigError, match=r"16, which does not split evenly over 3 .*shard_policy "
                     r"file cannot split it unevenly.*such as 15, or shard_policy data"):
    data_lib.plan_input(data_lib.make_source(data), data, 16, 3, 3)


def test_a_resume_on_three_replicas_splits_unevenly_within_the_recorded_per_replica_batch():
  kept = resume.updated_run_record(None, {
      "global_batch_size": 16, "steps_per_epoch": 8, "sharding": "data", "per_replica_batch": 4,
      "gradient_accumulation_steps": 1, "workers": 4, "replicas": 4}, 0)
  split = resume.resume_batch_split(kept, "run", 16, 3, 3, "data", 6)
  assert (split.accumulation, split.per_replica_batch) == (2, 3)  # 6 each would exceed 4
  assert split.line(6) == ("resumed at step 6 on 3 workers (was 4): accumulation 1 → 2, "
                           "per-replica batch 3 (16 over 3 replicas x 2 accumulation steps: 2 "
                           "rows of padding per step), global batch 16 kept")


def test_global_batch_16_on_three_replicas_trains_as_on_one_and_two(tmp_path):
  job = f"{ELASTIC},trainer.max_steps=10"  # past the epoch's short last step (8 real of 16)
  one = helpers.run_probe(tmp_path, "r1", f"{job},runtime.cpu_replicas=1")
  assert one["info"]["step"] == 10
  assert helpers.max_relative_difference(one["final"], one["initial"]) > 0.05  # it trained
  for replicas in (2, 3):
    run = helpers.run_probe(tmp_path, f"r{replicas}", f"{job},runtime.cpu_replicas={replicas}")
    assert run["info"]["step"] == 10
    assert helpers.max_relative_difference(run["final"], one["final"]) <= 1e-5, replicas
