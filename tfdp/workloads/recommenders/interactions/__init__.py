"""User–item interactions for recommenders: per-worker shard files, splitting by user, planted
low-rank data, id → row mappings and exact ranking metrics.

Each worker of a recommender run reads its OWN shard (`clicks-{worker}.csv`) and never another's,
so nothing here depends on data a worker does not hold: users go to shards by a fixed hash (or
fixed fractions of the users), ids become embedding rows through a shared vocabulary file or a
fixed integer hash, and ranking metrics come back as (numerator, denominator) sums that the
trainer adds up over replicas and workers before dividing (the form of `Task.metric_sums`).

Every frame here has the columns user (int64, >= 0), item (int64, >= 0), label (float32: the
rating, or 1.0 for implicit data) and weight (float32, >= 0). No TensorFlow at import time: the
TFRecord reader and `ranking_sums_tf` import it when called.

Modules: io (reading a worker's file), shards (splitting by user), ids (ids → rows), ranking
(metrics), planted (synthetic data). This package re-exports their public names.
"""
from tfdp.workloads.recommenders.interactions.io import (COLUMNS, CSV_SUFFIXES, SPLIT_COMMAND,
                                                         TFRECORD_SUFFIXES, check_not_empty,
                                                         read_interactions, resolve_shard_path)
from tfdp.workloads.recommenders.interactions.shards import (ShardFile, check_outputs,
                                                             split_by_user, stable_hash,
                                                             user_shards, write_shards)
from tfdp.workloads.recommenders.interactions.ids import (IdMapping, build_vocabulary,
                                                          read_id_vocabulary)
from tfdp.workloads.recommenders.interactions.ranking import (ranking_sums, ranking_sums_tf,
                                                              top_k_items)
from tfdp.workloads.recommenders.interactions.planted import PlantedModel, planted_interactions

__all__ = [
    "COLUMNS", "CSV_SUFFIXES", "SPLIT_COMMAND", "TFRECORD_SUFFIXES", "check_not_empty",
    "read_interactions", "resolve_shard_path",
    "ShardFile", "check_outputs", "split_by_user", "stable_hash", "user_shards", "write_shards",
    "IdMapping", "build_vocabulary", "read_id_vocabulary",
    "ranking_sums", "ranking_sums_tf", "top_k_items",
    "PlantedModel", "planted_interactions",
]
