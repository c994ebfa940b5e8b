"""Recommenders on user–item interactions, where each worker may hold its own shard.

`task.*_data.source: interactions` reads a CSV or TFRecord file; a path with `{worker}` makes
every worker read only its own file (shard policy `local`), and the workers exchange their
example counts so that all run the same number of steps, the shorter shards padded with
weight-0 rows. Ids become embedding rows the same way on every worker (a vocabulary file with
out-of-vocabulary rows, or hashing: tfdp.workloads.recommenders.interactions.IdMapping), decided by config alone.
"""
from __future__ import annotations

import math
import os

from absl import logging

from tfdp import paths
from tfdp.workloads.recommenders import interactions
from tfdp.core import task as tasks
from tfdp.core import warm_start
from tfdp.config.schema import DataConfig, TaskConfig
from tfdp.errors import ConfigError, DataError


def check_buckets(config: TaskConfig, role: str) -> None:
  """Without a vocabulary file, `role` (user, item) ids are hashed into that many rows."""
  rec = config.recommender
  buckets = getattr(rec, f"{role}_buckets")
  if not getattr(rec, f"{role}_vocab_path") and (
      isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1):
    raise ConfigError(f"config key 'task.recommender.{role}_buckets' is {buckets!r}, but "
                      f"without task.recommender.{role}_vocab_path {role} ids are hashed into "
                      "that many rows; give at least 1 (e.g. 4096), or a vocabulary file.")


def id_mappings(config: TaskConfig) -> tuple[interactions.IdMapping, interactions.IdMapping]:
  rec = config.recommender

  def mapping(role, vocab_path, buckets):
    if vocab_path:
      return interactions.IdMapping.from_vocabulary_file(vocab_path, oov_buckets=rec.oov_buckets,
                                                         role=role)
    check_buckets(config, role)
    return interactions.IdMapping.hashed(buckets)

  return (mapping("user", rec.user_vocab_path, rec.user_buckets),
          mapping("item", rec.item_vocab_path, rec.item_buckets))


ID_MAPPING_FILE = "id_mapping.json"


def _mapping_change(saved, now: dict) -> str:
  """What differs between two IdMapping.to_dict()s, in words ('' when they map ids alike; the
  vocabulary file's path may differ)."""
  if not isinstance(saved, dict):
    return "the saved mapping has no entry for it"
  if saved.get("kind") != now["kind"]:
    return f"kind was {saved.get('kind')}, now {now['kind']}"
  for key in ("num_buckets", "oov_buckets", "seed"):
    if key in now and saved.get(key) != now[key]:
      return f"{key} was {saved.get(key)}, now {now[key]}"
  if now["kind"] == "vocabulary":
    old, new = list(saved.get("vocabulary") or []), now["vocabulary"]
    if old != new:
      if len(old) != len(new):
        return f"vocabulary of {len(old)} ids, now {len(new)}"
      i = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
      return f"row {i} was id {old[i]}, now id {new[i]}"
  return ""


def holdout_split(frame, data: DataConfig):
  """Split `train` / `holdout` / `all` of the rows, by a stable hash of (user, item): the same
  rows on every worker and in every run, without a second file."""
  if data.split == "all" or (data.split == "train" and not data.holdout_fraction):
    return frame
  keys = interactions.stable_hash(frame["user"].to_numpy() * 1000003 + frame["item"].to_numpy(),
                                  seed=7)
  held = keys < data.holdout_fraction * 2.0**64
  return frame[held if data.split == "holdout" else ~held]


UNKNOWN_IDS_WARNING_SHARE = 0.1  # new users or items beyond this: likely the wrong vocabulary


def _warn_of_unknown_ids(where: str, frame, users, items) -> None:
  """One warning line when many rows' ids fall in the OOV rows: swapped or stale vocabulary
  files train without an error, most ids sharing a few rows."""
  found = []
  for role, mapping in (("user", users), ("item", items)):
    share = mapping.unknown_share(frame[role].to_numpy())
    if share > UNKNOWN_IDS_WARNING_SHARE:
      found.append(f"{share:.0%} of the rows' {role}s are not in the {role} vocabulary "
                   f"'{mapping.source}' (task.recommender.{role}_vocab_path) and share its "
                   f"{mapping.oov_buckets} OOV row(s)")
  if found:
    logging.warning("%s: %s; give the vocabularies written from this data (user and item files "
                    "swapped?).", where, "; ".join(found))


def _check_holdouts_agree(train: DataConfig, evaluation: DataConfig) -> None:
  """The held-out rows are a hash of (user, item) below holdout_fraction: training must leave out
  exactly the rows evaluation takes, also when it reads shards of the file evaluation reads."""
  if evaluation.split != "holdout":
    return
  same_rows = (os.path.realpath(train.path) == os.path.realpath(evaluation.path)
               or "{worker" in train.path or "{worker" in evaluation.path)  # shards of one file
  if (train.split == "train" and same_rows
      and train.holdout_fraction != evaluation.holdout_fraction):
    seen, held = train.holdout_fraction, evaluation.holdout_fraction
    effect = (f"about {(held - seen) / held:.0%} of the evaluated rows are trained on"
              if held > seen else "rows left out of training are never evaluated")
    raise ConfigError(f"config keys 'task.train_data.holdout_fraction' ({seen:g}) and "
                      f"'task.eval_data.holdout_fraction' ({held:g}) differ, so {effect}; they "
                      "must be equal: set both to the same value.")
  # split all: refused where the rows are surely the same (one file however spelled, or the same
  # {worker} shards); shards against one file may or may not have been split from it: said.
  if train.split == "all" and (os.path.realpath(train.path) == os.path.realpath(evaluation.path)):
    raise ConfigError(f"config key 'task.train_data.split' is all, so training reads the rows of "
                      f"'{train.path}' that task.eval_data (split holdout) evaluates; set "
                      "task.train_data.split to train.")
  if train.split == "all" and same_rows:
    logging.warning("task.train_data.split is all over '%s' while task.eval_data evaluates the "
                    "holdout of '%s': if the shards were split from that file, training reads the "
                    "evaluated rows; set task.train_data.split to train", train.path,
                    evaluation.path)


def _check_shard_count(data: DataConfig, total: int, worker: int, shards, key: str) -> None:
  """The run must read every shard file there is, and only those (a glob of this machine's files:
  shards held on other machines are checked there); a mapping given (worker_shards,
  shards_per_worker) may leave shards out on purpose."""
  from tfdp.workloads.recommenders.interactions import shards as shard_files  # pylint: disable=g-import-not-at-top
  path = data.path
  fix = f"map them all onto the workers with {key}.worker_shards or shards_per_worker"
  beyond = (shard_files.shard_files_beyond(path, total)
            if not (data.worker_shards or data.shards_per_worker) else [])
  if beyond:
    raise DataError(f"{key}.path '{path}' has shard files beyond the {total} this run reads "
                    f"('{beyond[0]}'): the data was split into more shards than workers, and "
                    f"their rows would never be read; {fix}, or resplit into {total} shards.")
  here = [os.path.exists(interactions.resolve_shard_path(path, i, total)) for i in range(total)]
  have = here.index(False) if False in here else total
  if have and not any(here[have:]) and max(shards) >= have:  # fewer shards than the run reads
    raise DataError(f"worker {worker}: {key}.path '{path}' has {have} shard(s) (0..{have - 1}), "
                    f"but this run reads {total}, so shard {max(shards)} does not exist; run on "
                    f"at most {have} worker(s) and {fix} (each worker at least one), or resplit "
                    f"into {total} shards.")


def _a_recommender(name: str) -> bool:
  """Whether task `name` trains these models (a user's task not registered here: unknown, so
  assumed so; its restore names any mismatch)."""
  try:
    return issubclass(tasks.task_class(name), MatrixFactorizationTask)
  except ConfigError:
    return True


@tasks.register_task("matrix_factorization")
class MatrixFactorizationTask(tasks.Task):
  """Explicit ratings: rating ≈ mean + b_user + b_item + p_user · q_item, squared error.
  Reports RMSE and MAE over every real rating (sums over workers, divided once)."""

  metric_names = ("loss", "rmse", "mae")
  KWARGS = ("embedding_dim", "l2", "global_mean")
  ignored_keys = (*tasks.IMAGE_DATA_KEYS, *tasks.TEXT_DATA_KEYS, "label_smoothing", "text")

  NEEDS_LABELS = True  # explicit ratings

  @classmethod
  def check_source(cls, data: DataConfig, key: str) -> None:
    import os  # pylint: disable=g-import-not-at-top
    if "{worker" not in data.path and not os.path.isfile(data.path):  # {worker}: checked on read
      raise DataError(f"{key}.path '{data.path}' is not a file{paths.looked_in(data.path)}; "
                      "give a CSV/TFRecord file, or a path with {worker} for per-worker shards.")

  @classmethod
  def validate(cls, config: TaskConfig) -> None:
    for key, data in (("task.train_data", config.train_data), ("task.eval_data", config.eval_data)):
      if data.source != "interactions":
        raise ConfigError(f"config key '{key}.source' is '{data.source}', but task "
                          f"'{config.name}' reads interactions: set it to interactions.")
      if data.split not in ("all", "train", "holdout"):
        raise ConfigError(f"config key '{key}.split' is '{data.split}'; interactions take all, "
                          "train or holdout (with holdout_fraction).")
      if cls.NEEDS_LABELS and not data.label_column:
        raise ConfigError(f"config key '{key}.label_column' is empty; {config.name} needs "
                          "explicit ratings (the rating column's name).")
      if not cls.NEEDS_LABELS and data.label_column:  # a probe: 1-star rows were positives
        raise ConfigError(f"config key '{key}.label_column' is '{data.label_column}', but "
                          f"{config.name} learns from implicit feedback (every row a positive) "
                          "and would ignore the ratings; clear it (label_column: '') and keep "
                          "only the rows you count as positives in the file (e.g. rating >= 4).")
      if data.split == "holdout" and not data.holdout_fraction:
        raise ConfigError(f"config key '{key}.split' is holdout, but '{key}.holdout_fraction' is "
                          f"0, so it holds no rows out; set {key}.holdout_fraction, e.g. 0.1, or "
                          "use split all.")
    _check_holdouts_agree(config.train_data, config.eval_data)
    for role in ("user", "item"):  # before TensorFlow starts
      check_buckets(config, role)
    oov = config.recommender.oov_buckets
    if isinstance(oov, bool) or not isinstance(oov, int) or oov < 0:
      raise ConfigError(f"config key 'task.recommender.oov_buckets' is {oov!r}; give 0 or more "
                        "rows for ids a vocabulary lacks (0: such an id is refused), e.g. 8.")
    unknown = sorted(set(config.model.kwargs) - set(cls.KWARGS))
    if unknown:
      raise ConfigError(f"task.model.kwargs {unknown} are not {config.name} settings; use "
                        f"{', '.join(cls.KWARGS)} (task.model.kwargs={{}} in a "
                        "--params_override of its own drops a file's).")
    for name, smallest, example in (("embedding_dim", 1, 32), ("l2", 0, 1e-5),
                                    ("temperature", 1e-9, 0.1), ("global_mean", None, 3.5)):
      value = config.model.kwargs.get(name)
      if value is None:
        continue
      if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
          or (name == "embedding_dim" and not isinstance(value, int))
          or (smallest is not None and value < smallest)):
        bound = "" if smallest is None else f" >= {smallest}" if smallest != 1e-9 else " > 0"
        raise ConfigError(f"config key 'task.model.kwargs.{name}' is {value!r}; it must be a "
                          f"finite number{bound}, e.g. {example}.")

  def build_source(self, data: DataConfig):
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
    columns, shards, users, items = self.read_rows(data)
    counts = [count for _, count in shards] if shards else [len(columns["user"])]
    starts = np.cumsum([0, *counts])

    def read(files):  # a file is a shard: its rows in file order
      rows = np.concatenate([np.arange(starts[f], starts[f + 1]) for f in files] or [[]])
      return tf.data.Dataset.from_tensor_slices({k: v[rows.astype(np.int64)]
                                                 for k, v in columns.items()})

    return data_lib.Source(counts, read, "local" if shards else "interactions",
                           shards=tuple(shard for shard, _ in shards or ()),
                           info={"users": users.num_rows, "items": items.num_rows,
                                 "mappings": {"user": users.to_dict(), "item": items.to_dict()}})

  def read_rows(self, data: DataConfig):
    """This worker's rows of one split as numpy columns (ids mapped to rows), its shards'
    (index, rows) when the path names a shard per worker ({worker}: in the order
    local_shards.map_shards gives them; None for one file), and the two id mappings."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    import pandas as pd  # pylint: disable=g-import-not-at-top
    from tfdp.core import local_shards  # pylint: disable=g-import-not-at-top
    shards = None
    key = "task.train_data" if data is self.config.train_data else "task.eval_data"
    if "{worker" in data.path:  # one process without a mapping is refused: a shard of many
      mapping = local_shards.map_shards(data, self.num_workers, key)
      shards = mapping[self.worker]
      total = max(max(s) for s in mapping) + 1
      _check_shard_count(data, total, self.worker, shards, key)
    frames, rows = [], {"user": [], "item": []}
    users, items = id_mappings(self.config)
    for shard in shards or [None]:
      path = interactions.resolve_shard_path(data.path, shard, total if shards else 0)
      read = interactions.read_interactions(
          path, data.user_column, data.item_column, data.label_column, data.weight_column,
          worker=self.worker if shards else None)
      frames.append(holdout_split(read, data))
      if not shards and len(read) and not len(frames[-1]):  # the file has rows; the split none
        raise DataError(
            f"split '{data.split}' of interactions file '{path}' holds none of its {len(read)} "
            f"rows (holdout_fraction {data.holdout_fraction}); use more rows, or another "
            "task.*_data.holdout_fraction or split.")
      for role, mapping in (("user", users), ("item", items)):  # mapped per file: named there
        try:
          rows[role].append(mapping.lookup(frames[-1][role].to_numpy()))
        except DataError as e:  # oov_buckets 0: an id outside the vocabulary has no row
          raise DataError(f"interactions file '{path}': {role} {str(e).rstrip('.')} "
                          f"(task.recommender.{role}_vocab_path, "
                          "task.recommender.oov_buckets).") from None
    if not shards:
      interactions.check_not_empty(frames[0], data.path)
    frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    columns = {"user": np.concatenate(rows["user"]).astype(np.int64),
               "item": np.concatenate(rows["item"]).astype(np.int64),
               "label": frame["label"].to_numpy(np.float32),
               "weight": frame["weight"].to_numpy(np.float32)}
    _warn_of_unknown_ids(f"worker {self.worker}: {key}" if shards else key, frame, users, items)
    return (columns, shards and list(zip(shards, map(len, frames))), users, items)

  def preprocess(self, example, data, training, seed):
    del data, training, seed
    return {k: example[k] for k in ("user", "item", "label")}  # label 1.0 for implicit data

  def warm_start(self, checkpoint_path: str) -> None:
    """Every weight from a pre-trained run of the same id mapping (the same vocabularies and
    OOV rows, or hash buckets): ids first seen now land in the OOV rows, which start as the
    pre-training left them (fresh when no OOV id was seen there)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    warm_start.restore_into(checkpoint_path, tf.train.Checkpoint(model=self.model), "this model",
                            under=("model",))

  def artifacts(self, source):
    import json  # pylint: disable=g-import-not-at-top
    return {ID_MAPPING_FILE: json.dumps(source.info["mappings"], indent=1)}

  @classmethod
  def check_saved_artifacts(cls, config, folder, context):
    """A changed vocabulary (or bucket count) would give every id another embedding row without
    a word: compare with the id mapping the run saved when it first started (the mappings come
    from the config alone: no data is read, TensorFlow is not started)."""
    import json  # pylint: disable=g-import-not-at-top
    trained = context.warm_start and warm_start.trained_task(folder)
    if trained and trained != config.name and (
        {trained, config.name} <= {"matrix_factorization", "retrieval"}
        or not _a_recommender(trained)):
      # the other built-in recommender, or not a recommender: no id mapping makes its model fit
      raise ConfigError(f"{context.action}: that run trained task '{trained}', and this one is "
                        f"'{config.name}'; point task.init_checkpoint at a {config.name} run, "
                        f"or {context.fix}.")
    path = os.path.join(folder, ID_MAPPING_FILE)
    if not os.path.exists(path):  # a run from before id mappings were saved
      return
    try:
      with open(path, "rb") as f:
        saved = json.loads(f.read().decode("utf-8"))
      if not isinstance(saved, dict):
        raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
      raise DataError(f"{context.action}: the saved id mapping '{path}' cannot be read ({e}); "
                      f"restore it, or {context.fix}.") from None
    now = dict(zip(("user", "item"), (m.to_dict() for m in id_mappings(config))))
    for name in ("user", "item"):
      change = _mapping_change(saved.get(name), now[name])
      if change:
        action, fix = context.action, context.fix
        raise ConfigError(
            f"{action}: the {name} id mapping differs from the run's '{path}' ({change}), so "
            f"{name}s would silently take other embedding rows; use the {name} vocabulary "
            f"(task.recommender.{name}_vocab_path, {name}_buckets, oov_buckets) that run used, "
            f"or {fix}.")

  def build_model(self, source):
    import keras  # pylint: disable=g-import-not-at-top
    kwargs = {"embedding_dim": 32, "l2": 0.0, "global_mean": 0.0, **self.config.model.kwargs}
    reg = keras.regularizers.L2(kwargs["l2"]) if kwargs["l2"] else None
    dim = int(kwargs["embedding_dim"])
    user, item = (keras.Input((), dtype="int64", name=k) for k in ("user", "item"))
    init = keras.initializers.RandomNormal(stddev=1.0 / math.sqrt(dim))

    def table(rows, width, name, initializer):
      return keras.layers.Embedding(rows, width, embeddings_initializer=initializer,
                                    embeddings_regularizer=reg, name=name)

    p = table(source.info["users"], dim, "user_factors", init)(user)
    q = table(source.info["items"], dim, "item_factors", init)(item)
    b_user = table(source.info["users"], 1, "user_bias", "zeros")(user)[:, 0]
    b_item = table(source.info["items"], 1, "item_bias", "zeros")(item)[:, 0]
    dot = keras.ops.sum(p * q, axis=-1)
    rating = keras.layers.Rescaling(1.0, offset=float(kwargs["global_mean"]))(dot + b_user + b_item)
    self.model = keras.Model({"user": user, "item": item}, rating, name="matrix_factorization")
    return self.model

  def model_inputs(self, batch):
    return {"user": batch["user"], "item": batch["item"]}

  def per_example_loss(self, batch, outputs):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.square(tf.cast(outputs, tf.float32) - batch["label"])

  def metric_sums(self, batch, outputs, per_example_loss):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    weight = batch["weight"]
    count = tf.reduce_sum(weight)
    absolute = tf.abs(tf.cast(outputs, tf.float32) - batch["label"])
    squared = tf.reduce_sum(per_example_loss * weight)
    return {"loss": (squared, count), "rmse": (squared, count),
            "mae": (tf.reduce_sum(absolute * weight), count)}

  def finalize_metric(self, name, value):
    return math.sqrt(max(value, 0.0)) if name == "rmse" else value


@tasks.register_task("retrieval")
class RetrievalTask(MatrixFactorizationTask):
  """Implicit feedback, two towers: user and item embeddings scored by their dot product,
  trained with an in-batch softmax (the other items of the replica's batch are the negatives;
  padding rows and other rows of the same item never are). Evaluated exactly over every item
  but the user's training items (read in --mode=eval too; with per-worker shards each worker
  ranks its own shards' users): recall@10 and NDCG@10 of each held-out (user, item) pair,
  summed over workers, divided once."""

  metric_names = ("loss", "recall_at_10", "ndcg_at_10")
  KWARGS = ("embedding_dim", "l2", "temperature")
  NEEDS_LABELS = False  # implicit feedback: every row is a positive
  seen = None  # [users, items] bool: this worker's training pairs, left out of every ranking

  def read_rows(self, data: DataConfig):
    import numpy as np  # pylint: disable=g-import-not-at-top
    train = self.config.train_data
    if data is not train:
      self._check_eval_sees_its_users(data)
      if self.seen is None:  # --mode=eval: exclude what training's evaluation excluded
        self.read_rows(train)
    columns, shards, users, items = super().read_rows(data)
    if data is train:
      self.seen = np.zeros((users.num_rows, items.num_rows), bool)
      self.seen[columns["user"], columns["item"]] = True
    return columns, shards, users, items

  def _check_eval_sees_its_users(self, data: DataConfig) -> None:
    """A worker knows only its own training shards' items: it may rank only their users, so the
    evaluation must read the same shards per worker (rows split by row would go elsewhere)."""
    from tfdp.core import local_shards  # pylint: disable=g-import-not-at-top
    train = self.config.train_data
    if self.num_workers <= 1 or "{worker" not in train.path:
      return
    mapped = local_shards.map_shards
    if ("{worker" not in data.path or mapped(data, self.num_workers, "task.eval_data")
        != mapped(train, self.num_workers, "task.train_data")):
      raise ConfigError(
          f"task.train_data.path '{train.path}' gives each worker its own users, but "
          f"task.eval_data ('{data.path}') does not give each worker the same shards, so a worker "
          "would rank users whose training items it never read (a silently low recall); set "
          "task.eval_data.path to the same {worker} path (split holdout) with the same "
          "shards_per_worker / worker_shards, or evaluate on one process.")

  def build_model(self, source):
    kwargs = {"embedding_dim": 32, "l2": 0.0, **self.config.model.kwargs}
    self.model = _two_tower_class()(source.info["users"], source.info["items"],
                                    int(kwargs["embedding_dim"]), float(kwargs["l2"]))
    return self.model

  def per_example_loss(self, batch, outputs):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    temperature = float(self.config.model.kwargs.get("temperature", 0.1))
    user, item = (tf.cast(outputs[k], tf.float32) for k in ("user", "item"))
    logits = tf.matmul(user, item, transpose_b=True) / temperature
    # A padding row (weight 0) is nobody's negative: its column is masked out of every softmax.
    # The mask is 0 or 1 whatever a weight column holds: a weight of 2 added +1e9 (a review).
    # Nor is another row of the row's own item (an accidental hit, as TFRS's
    # remove_accidental_hits): that column scores exactly the positive, which capped its
    # probability at 1/2 and taught popular items less.
    labels = tf.range(tf.shape(logits)[0])
    same_item = tf.equal(batch["item"][:, None], batch["item"][None, :])
    accidental = tf.logical_and(same_item, tf.not_equal(labels[:, None], labels[None, :]))
    masked = tf.logical_or(accidental, (batch["weight"] <= 0.0)[None, :])
    logits += tf.cast(masked, tf.float32) * -1e9
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)

  def metric_sums(self, batch, outputs, per_example_loss):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    weight = batch["weight"]
    scores = tf.matmul(tf.cast(outputs["user"], tf.float32),
                       tf.cast(outputs["all_items"], tf.float32), transpose_b=True)
    own = tf.one_hot(batch["item"], tf.shape(scores)[1])
    positives = own * weight[:, None]
    # Rank each pair's item among the items its user did not train on (the usual protocol:
    # a model that fits its training pairs would otherwise rank them first).
    exclude = None
    if self.seen is not None:
      exclude = tf.logical_and(tf.gather(tf.constant(self.seen), batch["user"]), own < 0.5)
    # loss: the in-batch softmax of the replica's eval batch, so it varies with the layout
    return {"loss": (tf.reduce_sum(per_example_loss * weight), tf.reduce_sum(weight)),
            **interactions.ranking_sums_tf(scores, positives, exclude, k=10)}

  def finalize_metric(self, name, value):
    return value


def _two_tower_class():
  """Defined on first use: Keras is imported only once TensorFlow may start."""
  import keras  # pylint: disable=g-import-not-at-top
  global _TWO_TOWER
  if _TWO_TOWER is not None:
    return _TWO_TOWER

  @keras.saving.register_keras_serializable(package="tfdp")
  class TwoTower(keras.Model):
    """Outputs the batch's user and item embeddings and the whole item table (for exact
    ranking over every item)."""

    def __init__(self, num_users, num_items, dim, l2=0.0, **kwargs):
      super().__init__(**{"name": "two_tower", **kwargs})
      self.num_users, self.num_items, self.dim, self.l2 = num_users, num_items, dim, l2
      reg = keras.regularizers.L2(l2) if l2 else None
      init = keras.initializers.RandomNormal(stddev=1.0 / math.sqrt(dim))
      self.user_tower = keras.layers.Embedding(num_users, dim, embeddings_initializer=init,
                                               embeddings_regularizer=reg, name="user_tower")
      self.item_tower = keras.layers.Embedding(num_items, dim, embeddings_initializer=init,
                                               embeddings_regularizer=reg, name="item_tower")
      self.user_tower.build((None,))
      self.item_tower.build((None,))

    def call(self, inputs):
      return {"user": self.user_tower(inputs["user"]), "item": self.item_tower(inputs["item"]),
              "all_items": keras.ops.convert_to_tensor(self.item_tower.embeddings)}

    def get_config(self):
      return {"num_users": self.num_users, "num_items": self.num_items, "dim": self.dim,
              "l2": self.l2, "name": self.name}

  _TWO_TOWER = TwoTower
  return TwoTower


_TWO_TOWER = None
