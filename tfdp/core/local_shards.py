"""Data each worker reads alone (a `{worker}` path, shard policy local): which of the data's
shards each worker reads, and each shard's rows per step, decided from the config, the worker
count and the shard sizes alone (pure functions; data.plan_input and data.make_dataset_fn use
them). The shard count is the data's, not the group's."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tfdp import errors
from tfdp.errors import ConfigError, OutputError

if TYPE_CHECKING:
  from tfdp.config.schema import DataConfig


def map_shards(data: DataConfig, num_workers: int, key: str) -> tuple[tuple[int, ...], ...]:
  """The data's {worker} shards each worker reads, from the config and the worker count alone
  (the same on every worker): shard i for worker i; `shards_per_worker` k: shards i*k..i*k+k-1;
  `worker_shards`: the lists given (config.checks: every shard once)."""
  workers = max(num_workers, 1)
  if data.worker_shards:
    if len(data.worker_shards) != workers:
      raise ConfigError(f"config key '{key}.worker_shards' has {len(data.worker_shards)} list(s) "
                        f"but this group has {workers} worker(s); give one list of shards per "
                        f"worker, or use {key}.shards_per_worker.")
    return tuple(tuple(int(shard) for shard in shards) for shards in data.worker_shards)
  k = data.shards_per_worker
  if not k and num_workers <= 1:
    raise ConfigError(f"config key '{key}.path' '{data.path}' has a {{worker}} placeholder (a "
                      f"shard per worker), but this is a single-process run; set "
                      f"{key}.shards_per_worker to the number of shards to read them all, or "
                      "give the path of one file.")
  return tuple(tuple(range(i * max(k, 1), (i + 1) * max(k, 1))) for i in range(workers))


def split_local_batch(shard_counts: list[int], global_batch: int,
                      key: str) -> tuple[list[int], int]:
  """Each shard's rows per step, summing to the global batch, in proportion to its size so that
  every shard ends its epoch in the same, fewest steps S: the smallest S with
  sum(ceil(count / S)) <= global batch; spare rows go to the largest shards. A function of the
  data's shard counts alone: the same steps hold the same examples under any mapping of shards
  to workers. Returns (rows per step of each shard, S)."""
  nonempty = [j for j, count in sorted(enumerate(shard_counts), key=lambda jc: -jc[1]) if count]
  if len(nonempty) > global_batch:
    raise ConfigError(f"config key '{key}' is {global_batch}, but the data each worker reads "
                      f"alone has {len(nonempty)} non-empty shards and each needs a row per "
                      f"step; use at least {len(nonempty)}.")
  def rows(steps: int) -> int:
    return sum(-(-count // steps) for count in shard_counts)
  low, high = max(-(-sum(shard_counts) // global_batch), 1), max(max(shard_counts, default=1), 1)
  while low < high:  # rows() does not grow with the steps
    middle = (low + high) // 2
    low, high = (low, middle) if rows(middle) <= global_batch else (middle + 1, high)
  batches = [-(-count // low) for count in shard_counts]
  takers = nonempty or list(range(len(shard_counts)))
  each, extra = divmod(global_batch - sum(batches), len(takers))
  for rank, shard in enumerate(takers):
    batches[shard] += each + (rank < extra)
  return batches, low


def number_shards(per_worker) -> tuple[tuple[tuple[int, ...], ...], list[int]]:
  """[(shard indices, counts)] by worker → (each worker's shard indices, every shard's count). A
  worker whose source names no indices holds the next ones in rank order."""
  pipelines, examples, next_index = [], {}, 0
  for indices, counts in per_worker:
    indices = list(indices) or list(range(next_index, next_index + len(counts)))
    next_index = max([next_index, *(i + 1 for i in indices)])
    pipelines.append(tuple(indices))
    examples.update(zip(indices, counts))
  return tuple(pipelines), [examples.get(i, 0) for i in range(next_index)]


def check_resumed_shards(recorded: dict | None, shard_counts: list[int], num_workers: int,
                         key: str, model_dir: str) -> None:
  """A resume reads the run's shards, however they are mapped to this group's workers: then every
  step holds the examples it held (split_local_batch), and every interaction counts once per
  epoch across the change. A record from before shard counts were kept: one shard a worker."""
  if not recorded or recorded.get("sharding") != "local":
    return
  was = recorded.get("shard_counts")
  if was is None:
    was_shards = int((recorded.get("history") or [{}])[-1].get("workers") or len(shard_counts))
    if was_shards == len(shard_counts):
      return
    was = f"{was_shards} shard(s)"
  elif list(was) == list(shard_counts):
    return
  else:
    was = f"{len(was)} shard(s) of {list(was)} examples"
  raise OutputError(
      f"{errors.terms().model_dir} '{model_dir}' holds a run that read {was} of {key} (a "
      f"{{worker}} path), and this group of {num_workers} worker(s) reads {len(shard_counts)} of "
      f"{list(shard_counts)}: the shard count is the data's, not the group's; map the run's shards "
      f"onto this group with {key}.shards_per_worker (worker i reads shards i*k..i*k+k-1) or "
      f"{key}.worker_shards, resume on the run's worker count, or {errors.terms().start_over}.")
