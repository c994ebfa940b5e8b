"""Splitting interactions by user into per-worker shards: a stable hash of ids (the same on
every machine), each user's shard, the split frames and the CSV shard files.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re

import numpy as np
import pandas as pd

from tfdp import paths
from tfdp.errors import DataError
from tfdp.workloads.recommenders.interactions.io import (_WORKER, COLUMNS, CSV_SUFFIXES,
                                                         resolve_shard_path)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SPLIT_SALT = 0x5EED5  # users' shards and hashed rows use different hashes: no shared pattern


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


def shard_files_beyond(path: str, num_shards: int) -> list[str]:
  """Existing files that `path` names for a shard index >= num_shards, by index."""
  parts = _WORKER.split(path)  # literal, spec, literal, spec, ..., literal
  literals = parts[::2]
  pattern = "*".join(glob.escape(literal) for literal in literals)
  index_text = "(.+?)"  # the first placeholder's text; the others must repeat it
  shape = re.compile(index_text.join(re.escape(literal) for literal in literals[:2]) +
                     "".join(".+?" + re.escape(literal) for literal in literals[2:]))
  found = {}
  for candidate in glob.glob(pattern):
    match = shape.fullmatch(candidate)
    digits = re.sub(r"\D", "", match.group(1)) if match else ""
    if not digits or int(digits) < num_shards:
      continue
    try:  # exactly the name this index takes: not another file the wildcard matched
      if resolve_shard_path(path, int(digits), 0) == candidate:
        found[int(digits)] = candidate
    except DataError:
      continue
  return [found[index] for index in sorted(found)]


@dataclasses.dataclass
class ShardFile:
  path: str
  num_users: int
  num_interactions: int


def check_outputs(path: str, num_shards: int, read_from: str = "",
                  others: dict[str, str] | None = None) -> None:
  """Before anything is written: every shard `path` names, and each of `others` (what: path, e.g.
  the vocabularies), can be written, and none replaces the input (`read_from`, a path or glob)
  or another output. A vocabulary on the input's path replaced the data, exit 0; a folder where
  a later file should go failed midway, the earlier files written (a probe)."""
  if not _WORKER.search(path):
    raise DataError(f"output path '{path}' has no {{worker}} placeholder; write e.g. "
                    "/data/clicks-{worker}.csv so every worker gets its own file.")
  if not path.lower().endswith(CSV_SUFFIXES):
    raise DataError(f"output path '{path}' does not end in .csv; shards are written as CSV.")
  inputs = ({os.path.realpath(p) for p in glob.glob(read_from)} | {os.path.realpath(read_from)}
            if read_from else set())  # (a name with [ ] is no glob of itself)
  targets = [(f"shard {shard}", resolve_shard_path(path, shard, num_shards))
             for shard in range(num_shards)]
  seen = {}
  for what, target in targets + [(w, t) for w, t in (others or {}).items() if t]:
    real = os.path.realpath(target)
    if real in inputs:
      raise DataError(
          f"output path '{path}' names the input '{target}' as a shard, which writing would "
          "replace (the rows of the other shards lost); choose an output path beside it, e.g. "
          "another folder." if what.startswith("shard ") else
          f"{what} '{target}' is the input, which writing would replace; choose another path.")
    if real in seen:
      raise DataError(f"{seen[real]} and {what} both name '{target}', which the second would "
                      "replace; give each its own path.")
    seen[real] = what
    if os.path.isdir(target):
      raise DataError(f"{what} '{target}' is a folder; give the path of a file.")
    above = paths.nearest_existing(os.path.dirname(os.path.abspath(target)))
    if not os.path.isdir(above):
      raise DataError(f"{what} '{target}' lies under '{above}', which is a file, not a folder; "
                      "choose another path.")


def write_shards(frame: pd.DataFrame, path: str, num_shards: int, fractions=None, seed: int = 0,
                 column_names: dict | None = None, read_from: str = "") -> list[ShardFile]:
  """Writes one CSV per worker (`path` has a `{worker}` placeholder), split by user.

  column_names renames the frame's columns (e.g. {"user": "s", "item": "d", "label": "y",
  "weight": ""}) so the shards read back with the same *_column settings as the input; a column
  named "" is left out. Nothing is written when a shard would be empty: that worker could not
  train, nor over `read_from` (the input's path or glob), which a shard would replace.
  """
  path = os.fspath(path)
  check_outputs(path, num_shards, read_from)
  parts = split_by_user(frame, num_shards, fractions, seed)
  empty = [shard for shard, part in enumerate(parts) if part.empty]
  if empty:
    other_fractions = " or other fractions" if fractions else ""
    raise DataError(f"shard {empty[0]} of {num_shards} would hold no users "
                    f"({frame['user'].nunique()} user(s) in all); use fewer shards"
                    f"{other_fractions}.")
  stale = shard_files_beyond(path, num_shards)
  if stale:
    shown = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
    raise DataError(f"output path '{path}' already holds shard files beyond the {num_shards} "
                    f"now written ({shown}), left by a split into more shards: a run on more "
                    "workers would read them as this data; remove them, or choose another "
                    "output path.")
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
