"""Ids → embedding rows: a shared vocabulary file (written once from all the data, read by
every worker) or a fixed hash, so every worker maps ids alike without the others' data.
"""
from __future__ import annotations

import os
import re

import numpy as np

from tfdp.errors import DataError
from tfdp.workloads.recommenders.interactions.io import MAX_ID, SPLIT_COMMAND
from tfdp.workloads.recommenders.interactions.shards import stable_hash


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


def read_id_vocabulary(path: str, role: str = "") -> np.ndarray:
  """The ids of a vocabulary file, in file order (row i is the i-th id); blank lines skipped.
  role ('user' or 'item', '' for either) names the splitter's flag that writes it."""
  path = os.fspath(path)
  flag = f"--{role}_vocabulary" if role else "--user_vocabulary or --item_vocabulary"
  build = ("write it once from all the data with tfdp.workloads.recommenders.interactions.build_vocabulary "
           f"(python {SPLIT_COMMAND} {flag})")
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
    if value > MAX_ID:
      raise DataError(f"vocabulary file '{path}' line {number} holds id {value}, larger than the "
                      f"largest id {MAX_ID}; renumber the ids from 0 and {build}.")
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
  def from_vocabulary_file(cls, path: str, oov_buckets: int = 1, seed: int = 0,
                           role: str = "") -> "IdMapping":
    return cls(read_id_vocabulary(path, role), oov_buckets=oov_buckets, seed=seed,
               source=os.fspath(path))

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
    position, known = self._find(ids)
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

  def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each id's position in the sorted vocabulary, and whether it is there."""
    position = np.clip(np.searchsorted(self._sorted, ids), 0, len(self._sorted) - 1)
    return position, self._sorted[position] == ids

  def unknown_share(self, ids) -> float:
    """The share of `ids` not in the vocabulary, which land in the OOV rows (0 when hashed)."""
    ids = np.asarray(ids, np.int64)
    if self.vocabulary is None or not ids.size:
      return 0.0
    return float(np.mean(~self._find(ids)[1]))

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
