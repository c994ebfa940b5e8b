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
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np
import pandas as pd

from tfdp.errors import DataError

COLUMNS = ("user", "item", "label", "weight")
CSV_SUFFIXES = (".csv", ".csv.gz", ".csv.bz2", ".csv.xz", ".csv.zip")
TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords", ".tfrec", ".tfrecord.gz", ".tfrecords.gz",
                     ".tfrec.gz")
SPLIT_COMMAND = "apps/split_interactions.py"
_WORKER = re.compile(r"\{worker(?::([^{}]*))?\}")  # {worker} or {worker:03d}
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SPLIT_SALT = 0x5EED5  # users' shards and hashed rows use different hashes: no shared pattern


# ---- which file a worker reads ---------------------------------------------------------------


def resolve_shard_path(path: str, worker: int | None, num_workers: int) -> str:
  """This worker's file: `{worker}` (or a formatted `{worker:03d}`) becomes its index; a plain
  path is one file every process reads, returned as is. A `{worker}` path on a single-process
  run (num_workers <= 1) needs an explicit worker index: reading shard 0 alone by default would
  silently train on a part of the data."""
  path = os.fspath(path)
  if not _WORKER.search(path):
    return path
  if worker is None:
    if num_workers <= 1:
      raise DataError(f"interactions path '{path}' has a {{worker}} placeholder, but this is a "
                      "single-process run; give the path of one file (e.g. the unsplit data) or "
                      "an explicit worker index.")
    raise DataError(f"interactions path '{path}' has a {{worker}} placeholder, but no worker "
                    f"index was given for this run of {num_workers} workers; pass the worker's "
                    "index (its task id).")
  if worker < 0 or (num_workers > 1 and worker >= num_workers):
    raise DataError(f"worker {worker} is not one of the {max(num_workers, 1)} worker(s) of this "
                    f"run (0..{max(num_workers, 1) - 1}), so '{path}' names no shard of it; pass "
                    "the worker's task id.")

  def substitute(match):
    try:
      return format(worker, match.group(1) or "")
    except ValueError:
      raise DataError(f"interactions path '{path}' has the placeholder '{match.group(0)}', which "
                      "cannot format a worker index; write {worker} or e.g. {worker:03d}."
                      ) from None
  return _WORKER.sub(substitute, path)


# ---- reading ---------------------------------------------------------------------------------


def _empty_frame() -> pd.DataFrame:
  return pd.DataFrame({"user": np.zeros(0, np.int64), "item": np.zeros(0, np.int64),
                       "label": np.zeros(0, np.float32), "weight": np.zeros(0, np.float32)})


def _prefix(worker: int | None) -> str:
  return "" if worker is None else f"worker {worker}: "


def read_interactions(path: str, user_column: str, item_column: str, label_column: str = "",
                      weight_column: str = "", worker: int | None = None) -> pd.DataFrame:
  """One file of interactions (CSV with a header line, or TFRecord of tf.train.Example with int64
  ids and a float or int64 label) → a frame of user, item, label, weight in file order.

  label 1.0 when label_column is empty (implicit data: every row is a positive); weight 1.0 when
  weight_column is empty. `worker` names the worker in errors (and fills a `{worker}` placeholder).
  An empty file gives an empty frame: the caller decides (`check_not_empty`) whether that is
  an error. Every problem a user can fix is one DataError line that names the file and column.
  """
  path = os.fspath(path)
  if _WORKER.search(path):
    path = resolve_shard_path(path, worker, num_workers=0)  # an explicit index, or an error
  prefix = _prefix(worker)
  where = f"{prefix}interactions file '{path}'"
  for role, name in (("user", user_column), ("item", item_column)):
    if not name:
      raise DataError(f"{prefix}no {role} column is named for '{path}'; set {role}_column to the "
                      f"column that holds the {role} ids.")
  if not os.path.exists(path):
    raise DataError(f"{where} does not exist; copy this worker's shard there ({SPLIT_COMMAND} "
                    "writes one per worker) or fix the path.")
  if os.path.isdir(path):
    raise DataError(f"{where} is a folder; give the path of one CSV or TFRecord file.")
  columns = {role: name for role, name in zip(COLUMNS, (user_column, item_column, label_column,
                                                         weight_column)) if name}
  lower = path.lower()
  if lower.endswith(CSV_SUFFIXES):
    raw, row_name = _read_csv(path, columns, where), _csv_row
  elif lower.endswith(TFRECORD_SUFFIXES):
    raw, row_name = _read_tfrecord(path, columns, where), _record_row
  else:
    raise DataError(f"{where} is neither CSV ({', '.join(CSV_SUFFIXES)}) nor TFRecord "
                    f"({', '.join(TFRECORD_SUFFIXES)}); name it by its format.")
  if raw is None:
    return _empty_frame()
  return _to_frame(raw, columns, where, row_name)


def check_not_empty(frame: pd.DataFrame, path: str, worker: int | None = None) -> pd.DataFrame:
  """A worker with no interactions would train on padding only; say so before training."""
  if len(frame) == 0:
    raise DataError(f"{_prefix(worker)}interactions file '{path}' holds no interactions; give "
                    f"every worker a non-empty shard (split again with fewer shards or other "
                    f"fractions: {SPLIT_COMMAND}).")
  return frame


def _csv_row(index: int) -> str:
  return f"row {index + 1} (line {index + 2})"  # line 1 is the header


def _record_row(index: int) -> str:
  return f"record {index + 1}"


def _check_columns(available: list, columns: dict, where: str) -> None:
  for role, name in columns.items():
    if name not in available:
      listed = ", ".join(map(str, available)) or "(none)"
      raise DataError(f"{where} has no {role} column '{name}'; its columns are {listed}: set "
                      f"{role}_column to one of them.")


def _read_csv(path: str, columns: dict, where: str) -> dict | None:
  try:
    header = list(pd.read_csv(path, nrows=0).columns)
    _check_columns(header, columns, where)
    # Every column, not usecols: with usecols pandas accepts a row with too many fields (an
    # unquoted comma shifting the columns) without a word.
    frame = pd.read_csv(path, low_memory=False)
  except pd.errors.EmptyDataError:
    return None  # a zero-byte file
  except (pd.errors.ParserError, UnicodeDecodeError) as e:
    raise DataError(f"{where} cannot be read as CSV: {str(e).strip().splitlines()[0]}; fix that "
                    "line.") from None
  except OSError as e:
    raise DataError(f"{where} cannot be read ({e.strerror or e}); fix its permissions.") from None
  if frame.empty:
    return None
  return {role: frame[name] for role, name in columns.items()}


def _read_tfrecord(path: str, columns: dict, where: str) -> dict | None:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from google.protobuf import message  # pylint: disable=g-import-not-at-top
  compression = "GZIP" if path.lower().endswith(".gz") else ""
  records = tf.data.TFRecordDataset(path, compression_type=compression)
  damaged = f"{where} cannot be read as TFRecord of tf.train.Example"
  try:
    first = next(iter(records.take(1)), None)
    if first is None:
      return None
    features = tf.train.Example.FromString(first.numpy()).features.feature
  except (tf.errors.OpError, message.DecodeError) as e:
    reason = e.message if isinstance(e, tf.errors.OpError) else str(e)
    raise DataError(f"{damaged}: {reason.strip().splitlines()[0]}; write it again.") from None
  _check_columns(sorted(features), columns, where)
  kinds, spec = {}, {}
  for role, name in columns.items():
    kinds[name] = features[name].WhichOneof("kind")
    problem = _feature_problem(role, name, kinds[name], kinds[name])
    if problem:
      raise DataError(f"{where} {_record_row(0)}: {problem}")
    dtype = tf.float32 if kinds[name] == "float_list" else tf.int64
    spec[name] = tf.io.FixedLenFeature([], dtype)
  parts = {name: [] for name in spec}
  try:
    for batch in records.batch(8192).map(lambda r: tf.io.parse_example(r, spec)):
      for name in spec:
        parts[name].append(batch[name].numpy())
  except tf.errors.InvalidArgumentError as e:  # a record unlike the first: find and name it
    raise _bad_record(path, compression, columns, kinds, where, e.message) from None
  except tf.errors.OpError as e:
    raise DataError(f"{damaged}: {e.message.strip().splitlines()[0]}; write it again.") from None
  return {role: pd.Series(np.concatenate(parts[name])) for role, name in columns.items()}


def _feature_problem(role: str, name: str, kind: str | None, first_kind: str,
                     count: int = 1) -> str:
  """What is wrong with one record's feature, or ''."""
  if kind is None:
    return f"feature '{name}' ({role}) is missing; give every record the same features."
  if role in ("user", "item") and kind != "int64_list":
    return (f"feature '{name}' ({role}) holds a {kind}, not int64 ids; write ids as an "
            "int64_list.")
  if kind == "bytes_list":
    return (f"feature '{name}' ({role}) holds bytes, not a number; write it as a float_list or "
            "int64_list.")
  if kind != first_kind:
    return (f"feature '{name}' ({role}) holds a {kind}, but the first record a {first_kind}; "
            "write one type in every record.")
  if count != 1:
    return f"feature '{name}' ({role}) holds {count} values, not one; write one per record."
  return ""


def _bad_record(path: str, compression: str, columns: dict, kinds: dict, where: str,
                tf_message: str) -> DataError:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  dataset = tf.data.TFRecordDataset(path, compression_type=compression)
  for index, record in enumerate(dataset.as_numpy_iterator()):
    features = tf.train.Example.FromString(record).features.feature
    for role, name in columns.items():
      kind = features[name].WhichOneof("kind") if name in features else None
      count = len(getattr(features[name], kind).value) if kind else 0
      problem = _feature_problem(role, name, kind, kinds[name], count)
      if problem:
        return DataError(f"{where} {_record_row(index)}: {problem}")
  return DataError(f"{where} cannot be parsed: {tf_message.strip().splitlines()[0]}")


def _value_problem(where: str, role: str, name: str, raw: pd.Series, index: int, row_name) -> str:
  value = raw.iloc[index]
  if pd.isna(value):
    shown = "has no value"
  else:
    shown = f"holds {value.item() if isinstance(value, np.generic) else value!r}"
  return f"{where} column '{name}' ({role}) {shown} in {row_name(index)}"


def _numbers(raw: pd.Series, role: str, name: str, where: str, row_name) -> np.ndarray:
  """float64 values; the first that is not a finite number is named with its row."""
  values = pd.to_numeric(raw, errors="coerce").to_numpy(np.float64, na_value=np.nan)
  bad = np.flatnonzero(~np.isfinite(values))
  if bad.size:
    raise DataError(f"{_value_problem(where, role, name, raw, bad[0], row_name)}, not a number; "
                    "fix or remove that row.")
  return values


def _ids(raw: pd.Series, role: str, name: str, where: str, row_name) -> np.ndarray:
  if pd.api.types.is_integer_dtype(raw.dtype):
    ids = raw.to_numpy(np.int64)  # exact: large ids never pass through float64
  else:
    values = _numbers(raw, role, name, where, row_name)
    fractional = np.flatnonzero(values != np.floor(values))
    if fractional.size:
      raise DataError(f"{_value_problem(where, role, name, raw, fractional[0], row_name)}, not a "
                      "whole number; ids must be integers >= 0: renumber them.")
    ids = values.astype(np.int64)
  negative = np.flatnonzero(ids < 0)
  if negative.size:
    raise DataError(f"{_value_problem(where, role, name, raw, negative[0], row_name)}; ids must "
                    "be integers >= 0: renumber them from 0.")
  return ids


def _to_frame(raw: dict, columns: dict, where: str, row_name) -> pd.DataFrame:
  count = len(raw["user"])
  frame = {"user": _ids(raw["user"], "user", columns["user"], where, row_name),
           "item": _ids(raw["item"], "item", columns["item"], where, row_name)}
  for role in ("label", "weight"):
    if role not in columns:
      frame[role] = np.ones(count, np.float32)
      continue
    values = _numbers(raw[role], role, columns[role], where, row_name)
    negative = np.flatnonzero(values < 0)
    if role == "weight" and negative.size:
      problem = _value_problem(where, role, columns[role], raw[role], negative[0], row_name)
      raise DataError(f"{problem}; weights must be >= 0: fix or remove that row.")
    frame[role] = values.astype(np.float32)
  return pd.DataFrame(frame)


# ---- splitting by user -----------------------------------------------------------------------


def stable_hash(ids, seed: int = 0) -> np.ndarray:
  """SplitMix64 of (id + seed·φ): the same uint64 on every machine, process and Python run
  (Python's hash() is salted per process, so two workers would disagree). Vectorised numpy."""
  ids = np.asarray(ids).astype(np.int64).view(np.uint64)
  with np.errstate(over="ignore"):
    z = ids + np.uint64(seed % 2**64) * _GOLDEN + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


def _check_fractions(num_shards: int, fractions) -> np.ndarray | None:
  if num_shards < 1:
    raise DataError(f"num_shards is {num_shards}; give at least 1 (one shard per worker).")
  if fractions is None:
    return None
  fractions = np.asarray(list(fractions), np.float64)
  shown = ",".join(f"{f:g}" for f in fractions)
  if len(fractions) != num_shards:
    raise DataError(f"fractions {shown} give {len(fractions)} shard(s), but num_shards is "
                    f"{num_shards}; give one fraction per shard.")
  if not np.all(np.isfinite(fractions) & (fractions > 0)):
    raise DataError(f"fractions {shown} must all be > 0; every shard needs users.")
  if abs(fractions.sum() - 1) > 1e-3:
    raise DataError(f"fractions {shown} sum to {fractions.sum():g}, not 1; give the share of the "
                    "users of each shard, e.g. 0.5,0.3,0.2.")
  return fractions / fractions.sum()


def user_shards(users, num_shards: int, fractions=None, seed: int = 0) -> np.ndarray:
  """The shard (0..num_shards-1) of each entry of `users`.

  Without fractions: a fixed hash of the user id, so a user lands on the same shard whatever
  else is in the data. With fractions (e.g. [0.5, 0.3, 0.2]): the distinct users, in a fixed
  hash order, are cut into runs of round(fraction · users) — uneven shards, deterministic for the
  same set of users (each shard's user count is within one of its fraction).
  """
  fractions = _check_fractions(num_shards, fractions)
  users = np.asarray(users, np.int64)
  if fractions is None:
    return (stable_hash(users, seed + _SPLIT_SALT) % np.uint64(num_shards)).astype(np.int64)
  distinct = np.unique(users)
  order = np.lexsort((distinct, stable_hash(distinct, seed + _SPLIT_SALT)))  # by hash, then id
  bounds = np.rint(np.cumsum(fractions) * len(distinct)).astype(np.int64)
  bounds[-1] = len(distinct)
  shard_by_rank = np.searchsorted(bounds, np.arange(len(distinct)), side="right")
  shard_of_distinct = np.empty(len(distinct), np.int64)
  shard_of_distinct[order] = shard_by_rank
  return shard_of_distinct[np.searchsorted(distinct, users)]


def split_by_user(frame: pd.DataFrame, num_shards: int, fractions=None, seed: int = 0
                  ) -> list[pd.DataFrame]:
  """The rows of each shard (see `user_shards`), in their original order and with their original
  index: every interaction is in exactly one shard, and no user is split across shards."""
  shards = user_shards(frame["user"].to_numpy(), num_shards, fractions, seed)
  return [frame[shards == shard] for shard in range(num_shards)]


@dataclasses.dataclass
class ShardFile:
  path: str
  num_users: int
  num_interactions: int


def write_shards(frame: pd.DataFrame, path: str, num_shards: int, fractions=None, seed: int = 0,
                 column_names: dict | None = None) -> list[ShardFile]:
  """Writes one CSV per worker (`path` has a `{worker}` placeholder), split by user.

  column_names renames the frame's columns (e.g. {"user": "s", "item": "d", "label": "y",
  "weight": ""}) so the shards read back with the same *_column settings as the input; a column
  named "" is left out. Nothing is written when a shard would be empty: that worker could not
  train.
  """
  path = os.fspath(path)
  if not _WORKER.search(path):
    raise DataError(f"output path '{path}' has no {{worker}} placeholder; write e.g. "
                    "/data/clicks-{worker}.csv so every worker gets its own file.")
  if not path.lower().endswith(CSV_SUFFIXES):
    raise DataError(f"output path '{path}' does not end in .csv; shards are written as CSV.")
  parts = split_by_user(frame, num_shards, fractions, seed)
  empty = [shard for shard, part in enumerate(parts) if part.empty]
  if empty:
    other_fractions = " or other fractions" if fractions else ""
    raise DataError(f"shard {empty[0]} of {num_shards} would hold no users "
                    f"({frame['user'].nunique()} user(s) in all); use fewer shards"
                    f"{other_fractions}.")
  names = {**{c: c for c in COLUMNS}, **(column_names or {})}
  kept = [c for c in COLUMNS if names[c]]
  written = []
  for shard, part in enumerate(parts):
    target = resolve_shard_path(path, shard, num_shards)
    try:
      os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
      part[kept].rename(columns=names).to_csv(target, index=False, float_format="%.9g")
    except OSError as e:
      raise DataError(f"shard file '{target}' cannot be written ({e.strerror or e}); choose "
                      "another output path.") from None
    written.append(ShardFile(target, int(part["user"].nunique()), len(part)))
  return written


# ---- planted data ----------------------------------------------------------------------------


@dataclasses.dataclass
class PlantedModel:
  """The true parameters of `planted_interactions`: the best any model can do on its data."""
  mean: float
  user_bias: np.ndarray  # [num_users]
  item_bias: np.ndarray  # [num_items]
  user_factors: np.ndarray  # [num_users, rank]
  item_factors: np.ndarray  # [num_items, rank]
  noise_sigma: float

  def predict(self, users, items) -> np.ndarray:
    """The noise-free rating of each (user, item) pair."""
    users, items = np.asarray(users), np.asarray(items)
    return (self.mean + self.user_bias[users] + self.item_bias[items]
            + np.sum(self.user_factors[users] * self.item_factors[items], axis=-1))

  def scores(self, users) -> np.ndarray:
    """[len(users), num_items] noise-free ratings of every item: the ideal ranking scores."""
    users = np.asarray(users)
    return (self.mean + self.user_bias[users, None] + self.item_bias[None, :]
            + self.user_factors[users] @ self.item_factors.T)


def planted_interactions(num_users: int, num_items: int, rank: int, noise_sigma: float,
                         interactions_per_user: int, seed: int, implicit: bool = False, *,
                         mean: float = 3.5, bias_sigma: float = 0.5
                         ) -> tuple[pd.DataFrame, PlantedModel]:
  """Synthetic interactions with a known low-rank truth, so a test knows the best achievable
  error: RMSE σ (the noise) for ratings.

  Factors have entries ~ N(0, variance 1/sqrt(rank)), so p_u·q_i has variance 1 for any rank;
  biases ~ N(0, bias_sigma²). Explicit: each user rates interactions_per_user distinct items
  drawn uniformly, rating = mean + b_u + b_i + p_u·q_i + N(0, σ²) (continuous: not rounded or
  clipped, which would move the floor). Implicit: each user's positives are the items with the
  top b_i + p_u·q_i + N(0, σ²) (likelier the higher the true score), label 1.0.
  Rows are sorted by user, then item.
  """
  if min(num_users, num_items, rank, interactions_per_user) < 1 or noise_sigma < 0:
    raise DataError("planted_interactions needs num_users, num_items, rank and "
                    "interactions_per_user >= 1 and noise_sigma >= 0.")
  if interactions_per_user > num_items:
    raise DataError(f"interactions_per_user {interactions_per_user} is more than the "
                    f"{num_items} items; a user interacts with each item at most once.")
  rng = np.random.default_rng(seed)
  factor_std = rank ** -0.25
  truth = PlantedModel(
      mean=float(mean),
      user_bias=rng.normal(0, bias_sigma, num_users),
      item_bias=rng.normal(0, bias_sigma, num_items),
      user_factors=rng.normal(0, factor_std, (num_users, rank)),
      item_factors=rng.normal(0, factor_std, (num_items, rank)),
      noise_sigma=float(noise_sigma))
  chunk = max(1, 2**22 // num_items)  # users per block: bounded memory for large catalogues
  kth = interactions_per_user - 1
  items = []
  for start in range(0, num_users, chunk):
    users = np.arange(start, min(start + chunk, num_users))
    if implicit:
      noisy = (truth.item_bias[None, :] + truth.user_factors[users] @ truth.item_factors.T
               + rng.normal(0, noise_sigma, (len(users), num_items)))
      keys = -noisy  # the smallest keys are the top scores
    else:
      keys = rng.random((len(users), num_items))
    items.append(np.sort(np.argpartition(keys, kth, axis=1)[:, :interactions_per_user], axis=1))
  item = np.concatenate(items).reshape(-1).astype(np.int64)
  user = np.repeat(np.arange(num_users, dtype=np.int64), interactions_per_user)
  if implicit:
    label = np.ones(len(user), np.float32)
  else:
    label = (truth.predict(user, item) + rng.normal(0, noise_sigma, len(user))).astype(np.float32)
  frame = pd.DataFrame({"user": user, "item": item, "label": label,
                        "weight": np.ones(len(user), np.float32)})
  return frame, truth


# ---- ids → rows --------------------------------------------------------------------------------


def build_vocabulary(ids, path: str, min_count: int = 1) -> int:
  """Writes the distinct ids of `ids` (e.g. frame["item"] of ALL the data, once), most frequent
  first (ties by id), one per line; every worker then maps ids alike from this file. Returns the
  number of ids written."""
  values, counts = np.unique(np.asarray(ids, np.int64), return_counts=True)
  keep = counts >= min_count
  values, counts = values[keep], counts[keep]
  if not len(values):
    raise DataError(f"no ids seen at least {min_count} time(s) to write to vocabulary file "
                    f"'{path}'; give the id column of the whole data set.")
  ordered = values[np.lexsort((values, -counts))]
  try:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      f.write("\n".join(map(str, ordered.tolist())) + "\n")
  except OSError as e:
    raise DataError(f"vocabulary file '{path}' cannot be written ({e.strerror or e}); choose "
                    "another path.") from None
  return len(ordered)


def read_id_vocabulary(path: str) -> np.ndarray:
  """The ids of a vocabulary file, in file order (row i is the i-th id); blank lines skipped."""
  path = os.fspath(path)
  build = ("write it once from all the data with tfdp.workloads.recommenders.interactions.build_vocabulary "
           f"({SPLIT_COMMAND} --item_vocabulary)")
  if not os.path.isfile(path):
    raise DataError(f"vocabulary file '{path}' does not exist; {build}, and give every worker "
                    "the same file.")
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise DataError(f"vocabulary file '{path}' cannot be read ({getattr(e, 'strerror', None) or e})"
                    f"; {build}.") from None
  ids, first_line = [], {}
  for number, line in enumerate(lines, start=1):
    text = line.strip()
    if not text:
      continue
    if not re.fullmatch(r"\d+", text):
      raise DataError(f"vocabulary file '{path}' line {number} holds {text!r}, not an id (an "
                      f"integer >= 0); write one id per line: {build}.")
    value = int(text)
    if value in first_line:
      raise DataError(f"vocabulary file '{path}' lists id {value} twice (lines "
                      f"{first_line[value]} and {number}), so it would map to two rows; remove "
                      "one.")
    first_line[value] = number
    ids.append(value)
  if not ids:
    raise DataError(f"vocabulary file '{path}' holds no ids; {build}.")
  return np.asarray(ids, np.int64)


class IdMapping:
  """Ids → embedding rows, the same on every worker without seeing the others' data.

  vocabulary: the ids of a shared vocabulary file take rows 0..V-1 in file order; an id not in it
      takes one of `oov_buckets` rows after them (V + stable hash % oov_buckets); with
      oov_buckets 0 an unknown id is an error (exact catalogues, e.g. ranking over all items).
  hashed: row = stable hash of the id % num_buckets (collisions share a row; no file needed).
  """

  def __init__(self, vocabulary=None, oov_buckets: int = 1, num_buckets: int = 0, seed: int = 0,
               source: str = ""):
    self.seed = int(seed)
    self.source = source  # where the vocabulary came from: for messages and to_dict
    if vocabulary is None:
      if num_buckets < 1:
        raise DataError(f"a hashed id mapping needs num_buckets >= 1, not {num_buckets}.")
      self.vocabulary = None
      self.oov_buckets = 0
      self.num_buckets = int(num_buckets)
      return
    if oov_buckets < 0:
      raise DataError(f"oov_buckets is {oov_buckets}; give 0 (unknown ids are errors) or more.")
    self.vocabulary = np.asarray(vocabulary, np.int64).reshape(-1)
    if not len(self.vocabulary):
      raise DataError("an id vocabulary needs at least one id; build it with build_vocabulary.")
    self.oov_buckets = int(oov_buckets)
    self.num_buckets = 0
    self._order = np.argsort(self.vocabulary, kind="stable")
    self._sorted = self.vocabulary[self._order]
    repeated = self._sorted[1:][self._sorted[1:] == self._sorted[:-1]]
    if repeated.size:
      raise DataError(f"the vocabulary{f' {source!r}' if source else ''} lists id {repeated[0]} "
                      "more than once; every id needs one row.")

  @classmethod
  def from_vocabulary_file(cls, path: str, oov_buckets: int = 1, seed: int = 0) -> "IdMapping":
    return cls(read_id_vocabulary(path), oov_buckets=oov_buckets, seed=seed, source=os.fspath(path))

  @classmethod
  def hashed(cls, num_buckets: int, seed: int = 0) -> "IdMapping":
    return cls(num_buckets=num_buckets, seed=seed)

  @property
  def num_rows(self) -> int:
    """Rows of the embedding table this mapping indexes."""
    if self.vocabulary is None:
      return self.num_buckets
    return len(self.vocabulary) + self.oov_buckets

  def lookup(self, ids) -> np.ndarray:
    """int64 rows, shaped like `ids`."""
    ids = np.asarray(ids, np.int64)
    if self.vocabulary is None:
      return (stable_hash(ids, self.seed) % np.uint64(self.num_buckets)).astype(np.int64)
    position = np.clip(np.searchsorted(self._sorted, ids), 0, len(self._sorted) - 1)
    known = self._sorted[position] == ids
    if self.oov_buckets == 0:
      if not known.all():
        unknown = ids[~known].reshape(-1)[0]
        named = f" {self.source!r}" if self.source else ""
        raise DataError(f"id {unknown} is not in the vocabulary{named} "
                        "and oov_buckets is 0; rebuild the vocabulary from all the data, or "
                        "allow oov_buckets >= 1.")
      return self._order[position]
    oov = len(self.vocabulary) + (stable_hash(ids, self.seed) % np.uint64(self.oov_buckets)
                                  ).astype(np.int64)
    return np.where(known, self._order[position], oov)

  def to_dict(self) -> dict:
    """JSON-ready, self-contained (the vocabulary inline): saved with the model, it maps ids the
    same way when the file is gone."""
    if self.vocabulary is None:
      return {"kind": "hash", "num_buckets": self.num_buckets, "seed": self.seed}
    return {"kind": "vocabulary", "vocabulary": self.vocabulary.tolist(),
            "oov_buckets": self.oov_buckets, "seed": self.seed, "source": self.source}

  @classmethod
  def from_dict(cls, value: dict) -> "IdMapping":
    kind = value.get("kind") if isinstance(value, dict) else None
    if kind == "hash":
      return cls(num_buckets=value["num_buckets"], seed=value.get("seed", 0))
    if kind == "vocabulary":
      return cls(value["vocabulary"], oov_buckets=value["oov_buckets"], seed=value.get("seed", 0),
                 source=value.get("source", ""))
    raise DataError(f"a saved id mapping has kind {kind!r}; expected 'hash' or 'vocabulary' "
                    "(written by IdMapping.to_dict).")

  def __repr__(self) -> str:
    if self.vocabulary is None:
      return f"IdMapping(hashed, num_buckets={self.num_buckets}, seed={self.seed})"
    named = f" from {self.source!r}" if self.source else ""
    return f"IdMapping({len(self.vocabulary)} ids{named}, oov_buckets={self.oov_buckets})"


# ---- ranking metrics ---------------------------------------------------------------------------


def _ranking_inputs(scores, positives_mask, exclude_mask, k):
  scores = np.asarray(scores, np.float64)
  positives = np.asarray(positives_mask, bool)
  if scores.ndim != 2 or positives.shape != scores.shape:
    raise ValueError(f"scores and positives_mask must both be [users, items]; got {scores.shape} "
                     f"and {positives.shape}.")
  if k < 1:
    raise ValueError(f"k is {k}; give k >= 1.")
  if not np.all(np.isfinite(scores)):
    raise ValueError("scores hold NaN or inf; a model whose scores are not finite cannot be "
                     "ranked (did training diverge?).")
  if exclude_mask is not None:
    excluded = np.asarray(exclude_mask, bool)
    if excluded.shape != scores.shape:
      raise ValueError(f"exclude_mask is {excluded.shape}, scores {scores.shape}; give one shape.")
    scores = np.where(excluded, -np.inf, scores)
    positives = positives & ~excluded
  return scores, positives


def top_k_items(scores: np.ndarray, k: int) -> np.ndarray:
  """[users, min(k, items)] item indices by score, highest first; ties go to the lower index
  (as tf.math.top_k), so the numpy and TF metrics agree exactly. O(items) per user plus a sort
  of k: no full sort of the catalogue."""
  scores = np.asarray(scores)
  num_users, num_items = scores.shape
  top = min(k, num_items)
  if top == num_items:
    candidates = np.broadcast_to(np.arange(num_items), scores.shape)
  else:
    kth = -np.partition(-scores, top - 1, axis=1)[:, top - 1:top]  # the top-th largest score
    above, equal = scores > kth, scores == kth
    room = top - above.sum(axis=1, keepdims=True)  # ties at the cut: the lowest indices fill it
    chosen = above | (equal & (np.cumsum(equal, axis=1) <= room))
    candidates = np.nonzero(chosen)[1].reshape(num_users, top)  # ascending index in each row
  order = np.argsort(-np.take_along_axis(scores, candidates, axis=1), axis=1, kind="stable")
  return np.take_along_axis(candidates, order, axis=1)


def ranking_sums(scores, positives_mask, exclude_mask=None, k: int = 10) -> dict:
  """Exact recall@k and NDCG@k over ALL items for a batch of users, as sums to add across
  batches and workers: {"recall_at_k": (numerator, denominator), "ndcg_at_k": (...)}.

  scores [users, items] (finite); positives_mask [users, items]: the held-out items each user
  interacted with; exclude_mask: items not to rank (e.g. the user's training items), placed
  below every other item and never counted as positives.
  recall@k = hits in the top k / min(k, number of positives) (the capped recall of Liang et al.
  2018, so a user with more than k positives can reach 1); NDCG@k = DCG@k / ideal DCG@k with
  binary gains and discount 1/log2(rank + 1). Numerators sum per-user values; the denominator of
  both is the number of users with at least one positive, so padding users (all-zero rows) and
  users with nothing held out count for nothing. Ties go to the lower item index.
  """
  scores, positives = _ranking_inputs(scores, positives_mask, exclude_mask, k)
  top = top_k_items(scores, k)
  hits = np.take_along_axis(positives, top, axis=1)
  num_positives = positives.sum(axis=1)
  discounts = 1.0 / np.log2(np.arange(2, top.shape[1] + 2))
  ideal = np.concatenate([[0.0], np.cumsum(discounts)])[np.minimum(num_positives, top.shape[1])]
  has_positive = num_positives > 0
  recall = hits.sum(axis=1) / np.maximum(np.minimum(num_positives, k), 1)
  ndcg = (hits @ discounts) / np.where(has_positive, ideal, 1.0)
  users = float(has_positive.sum())
  return {f"recall_at_{k}": (float(recall[has_positive].sum()), users),
          f"ndcg_at_{k}": (float(ndcg[has_positive].sum()), users)}


def ranking_sums_tf(scores, positives_mask, exclude_mask=None, k: int = 10) -> dict:
  """`ranking_sums` in TensorFlow (float32), for a task's metric_sums inside a tf.function:
  the same definitions and tie rule (tf.math.top_k puts the lower index first). Scores must be
  finite; this is not checked here."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  scores = tf.cast(scores, tf.float32)
  positives = tf.cast(positives_mask, tf.bool)
  if exclude_mask is not None:
    excluded = tf.cast(exclude_mask, tf.bool)
    scores = tf.where(excluded, tf.constant(-np.inf, tf.float32), scores)
    positives = tf.logical_and(positives, tf.logical_not(excluded))
  num_items = scores.shape[-1]
  top = min(k, num_items) if num_items is not None else tf.minimum(k, tf.shape(scores)[-1])
  _, indices = tf.math.top_k(scores, k=top, sorted=True)
  hits = tf.cast(tf.gather(positives, indices, batch_dims=1), tf.float32)
  num_positives = tf.reduce_sum(tf.cast(positives, tf.int32), axis=1)
  ranks = tf.cast(tf.range(2, top + 2), tf.float32)
  discounts = math.log(2.0) / tf.math.log(ranks)
  ideal_by_count = tf.concat([[0.0], tf.cumsum(discounts)], axis=0)
  ideal = tf.gather(ideal_by_count, tf.minimum(num_positives, top))
  has_positive = num_positives > 0
  recall = tf.reduce_sum(hits, axis=1) / tf.cast(tf.maximum(tf.minimum(num_positives, k), 1),
                                                 tf.float32)
  ndcg = tf.reduce_sum(hits * discounts, axis=1) / tf.where(has_positive, ideal, 1.0)
  zeros = tf.zeros_like(recall)
  users = tf.reduce_sum(tf.cast(has_positive, tf.float32))
  return {f"recall_at_{k}": (tf.reduce_sum(tf.where(has_positive, recall, zeros)), users),
          f"ndcg_at_{k}": (tf.reduce_sum(tf.where(has_positive, ndcg, zeros)), users)}
