"""Reading one worker's interactions file: which file a worker reads (`resolve_shard_path`), CSV
or TFRecord into a frame of user, item, label, weight, with every fixable problem one DataError
line naming the file, column and row. TensorFlow is imported only by the TFRecord reader.
"""
from __future__ import annotations

import bz2
import csv
import gzip
import io
import lzma
import os
import re
import shlex
import zipfile

import numpy as np
import pandas as pd

from tfdp import paths
from tfdp.errors import DataError

COLUMNS = ("user", "item", "label", "weight")
CSV_SUFFIXES = (".csv", ".csv.gz", ".csv.bz2", ".csv.xz", ".csv.zip")
TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords", ".tfrec", ".tfrecord.gz", ".tfrecords.gz",
                     ".tfrec.gz")
SPLIT_COMMAND = "apps/split_interactions.py"
MAX_ID = 2**63 - 1  # ids are int64
_WORKER = re.compile(r"\{worker(?::([^{}]*))?\}")  # {worker} or {worker:03d}
# An integer format spec whose width is bounded: `{worker:>100000000000}` would allocate gigabytes.
_SPEC = re.compile(r"(?:.?[<>=^])?[+\- ]?#?0?(\d*)[,_]?[bdoxXn]?")
_MAX_WIDTH = 64


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
    spec = match.group(1) or ""
    shape = _SPEC.fullmatch(spec)
    try:
      if not shape or int(shape.group(1) or 0) > _MAX_WIDTH:
        raise ValueError(spec)
      return format(worker, spec)
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
                      weight_column: str = "", worker: int | None = None,
                      path_option: str = "") -> pd.DataFrame:
  """One file of interactions (CSV with a header line, or TFRecord of tf.train.Example with int64
  ids and a float or int64 label) → a frame of user, item, label, weight in file order.

  label 1.0 when label_column is empty (implicit data: every row is a positive); weight 1.0 when
  weight_column is empty. `worker` names the worker in errors (and fills a `{worker}` placeholder).
  `path_option`: the flag that gave `path` (the splitter's '--input'), named if it is missing.
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
  for role, name in (("label", label_column), ("weight", weight_column), ("item", item_column)):
    other = ("user" if name == user_column
             else "item" if role != "item" and name == item_column else "")
    if name and other:  # the ids read as ratings (or as the other id): a silent wrong model
      raise DataError(f"{prefix}{role}_column and {other}_column both name column '{name}' of "
                      f"'{path}'; give each its own column.")
  if not os.path.exists(path):
    if worker is not None:  # a worker's shard, which the splitter writes
      fix = f"copy this worker's shard there ({SPLIT_COMMAND} writes one per worker) or fix the path"
    elif path_option:
      fix = f"pass {path_option}=<your CSV or TFRecord file of interactions>"
    else:  # not a shard (a single-process run's file, the splitter's input)
      fix = "fix the path to your CSV or TFRecord file of interactions"
    raise DataError(f"{where} does not exist; {fix}.")
  if os.path.isdir(path):
    raise DataError(f"{where} is a folder; give the path of one CSV or TFRecord file.")
  columns = {role: name for role, name in zip(COLUMNS, (user_column, item_column, label_column,
                                                         weight_column)) if name}
  lower = path.lower()
  if lower.endswith(CSV_SUFFIXES):
    raw, row_name = _read_csv(path, columns, where), _csv_rows(path)
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
  if len(frame) == 0 and worker is None:  # one file for all: no split makes rows
    raise DataError(f"interactions file '{path}' holds no interactions (a header at most); give "
                    "it the interactions, one row each.")
  if len(frame) == 0:
    raise DataError(f"{_prefix(worker)}interactions file '{path}' holds no interactions; give "
                    f"every worker a non-empty shard (split again with fewer shards or other "
                    f"fractions: {SPLIT_COMMAND}).")
  return frame


def _csv_rows(path: str):
  """Names a data row with its physical line, found only for an error: pandas skips blank lines
  and a quoted field may span lines, so the line is not the row + 2."""
  def row_name(index: int) -> str:
    line = _csv_line(path, index)
    return f"row {index + 1}" + (f" (line {line})" if line else "")
  return row_name


def _open_bytes(path: str):
  lower = path.lower()
  if lower.endswith(".zip"):  # pandas reads the one file in it
    archive = zipfile.ZipFile(path)
    return archive.open(archive.namelist()[0])
  opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(os.path.splitext(lower)[1],
                                                                      open)
  return opener(path, "rb")


def _open_text(path: str):
  return io.TextIOWrapper(_open_bytes(path), encoding="utf-8", newline="")


def _csv_line(path: str, index: int) -> int | None:
  """The physical line where data row `index` starts, skipping the lines pandas skips (blank or
  only spaces and tabs, also before the header); None if the file cannot be scanned."""
  try:
    with _open_text(path) as f:
      reader, end, rows = csv.reader(f), 0, -2  # the header is row -1
      for record in reader:
        start, end = end + 1, reader.line_num
        if start == end and not "".join(record).strip(" \t") and len(record) <= 1:
          continue
        rows += 1
        if rows == index:
          return start
  except (OSError, ValueError, csv.Error, zipfile.BadZipFile, EOFError):
    pass
  return None


def _record_row(index: int) -> str:
  return f"record {index + 1}"


def _check_columns(available: list, columns: dict, where: str, path: str = "") -> None:
  for role, name in columns.items():
    if name not in available:
      # Quoted, so that a name's leading or trailing space shows.
      listed = ", ".join(repr(str(a)) for a in available) or "(none)"
      spaced = [a for a in available if isinstance(a, str) and a != name and a.strip() == name]
      if path and spaced:  # "uid, iid" names ' iid': a header with spaces after its commas
        fix = (f"sed -i '1s/ *, */,/g' {shlex.quote(path)}" if path.lower().endswith(".csv")
               else "write its header line again without them")
        raise DataError(f"{where} has no {role} column '{name}', but {spaced[0]!r}: its columns "
                        f"are {listed}, with spaces next to the commas of its header line; "
                        f"remove them: {fix}")
      separator = next((c for c in (";", "\t", "|") if len(available) == 1 and c in
                        str(available[0]) and name in map(str.strip, str(available[0]).split(c))),
                       None)
      if path and separator:  # one column named 'user;item;rating': another separator
        shown = {"\t": "tab"}.get(separator, repr(separator))
        # 'user; item': the spaces too (the python engine reads a separator pattern)
        sep = (f"sep={separator!r}" if all(part == part.strip()
                                           for part in str(available[0]).split(separator))
               else f"sep=r'\\s*{re.escape(separator)}\\s*', engine='python'")
        raise DataError(f"{where} has one column, {listed}: its header is {shown}-separated, and "
                        "tfdp reads comma-separated CSV; write it with commas (pandas: "
                        f"pd.read_csv(path, {sep}).to_csv(new_path, index=False)).")
      if path and available and all(re.fullmatch(r"\s*[-+.\deE]+\s*", str(a)) for a in available):
        raise DataError(f"{where} has no {role} column '{name}': its first line {listed} looks "
                        "like data, so the file seems to have no header row; add one naming "
                        f"the columns (e.g. user,item,label) and set {role}_column to its name.")
      raise DataError(f"{where} has no {role} column '{name}'; its columns are {listed}: set "
                      f"{role}_column to one of them.")


def _not_utf8(path: str, where: str) -> str:
  with _open_bytes(path) as f:
    raw = f.read()
  try:
    raw.decode("utf-8")
    return f"{where} is not UTF-8; convert its text to UTF-8."
  except UnicodeDecodeError as e:
    line = raw.count(b"\n", 0, e.start) + 1
    said = f"{where} is not UTF-8 (line {line}: byte 0x{raw[e.start]:02x})"
  if not path.lower().endswith(".csv"):
    return f"{said}; convert its text to UTF-8."
  return f"{said}; convert it {paths.utf8_conversion(path)}"


def _read_csv(path: str, columns: dict, where: str) -> dict | None:
  try:
    header = list(pd.read_csv(path, nrows=0).columns)
    _check_columns(header, columns, where, path)
    # Every column, not usecols: with usecols pandas accepts a row with too many fields (an
    # unquoted comma shifting the columns) without a word.
    frame = pd.read_csv(path, low_memory=False)
  except pd.errors.EmptyDataError:
    return None  # a zero-byte file
  except UnicodeDecodeError:  # pandas names neither line nor fix (a probe)
    raise DataError(_not_utf8(path, where)) from None
  except pd.errors.ParserError as e:
    raise DataError(f"{where} cannot be read as CSV: {str(e).strip().splitlines()[0]}; fix that "
                    "line.") from None
  except OSError as e:
    raise DataError(f"{where} cannot be read ({e.strerror or e}); fix its permissions.") from None
  if frame.empty:
    return None
  ids = [columns[role] for role in ("user", "item")
         if not pd.api.types.is_float_dtype(frame[columns[role]].dtype)]  # floats: _ids refuses
  if ids:  # one more read, of the id columns as written
    text = pd.read_csv(path, usecols=ids, dtype=str, keep_default_na=False)
    for role in ("user", "item"):
      if columns[role] in ids:
        _check_ids_not_merged(text[columns[role]].str.strip(), role, columns[role], where)
  return {role: frame[name] for role, name in columns.items()}


def _check_ids_not_merged(text: pd.Series, role: str, name: str, where: str) -> None:
  """Ids are numbers: '007' and '7' read as one id, silently merging two users (or items)."""
  if not text.str.match(r"[+]?0\d").any():  # no leading zero: one spelling per number
    return
  spelled = pd.DataFrame({"text": text, "id": pd.to_numeric(text, errors="coerce")})
  spelled = spelled.dropna().drop_duplicates("text")
  merged = spelled[spelled.duplicated("id", keep=False)]
  if len(merged):
    first = merged[merged["id"] == merged["id"].iloc[0]]["text"].tolist()
    raise DataError(f"{where}: {role} ids '{first[0]}' and '{first[1]}' (column '{name}') both "
                    f"read as {int(merged['id'].iloc[0])}: ids are numbers, so leading zeros "
                    f"drop; renumber them if they are two {role}s, or write them alike.")


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
    for batch in records.batch(8192).map(tf.autograph.experimental.do_not_convert(
        lambda r: tf.io.parse_example(r, spec))):
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
  if bad.size and role in ("user", "item") and bad.size == len(values) and isinstance(
      raw.iloc[bad[0]], str):  # string ids (u_m, movie-12): no row can be fixed alone
    raise DataError(f"{_value_problem(where, role, name, raw, bad[0], row_name)}, and no row holds "
                    f"a number: ids must be integers >= 0, and neither {SPLIT_COMMAND} nor a "
                    f"vocabulary file maps string ids; replace each distinct {role} id by an "
                    "integer first (e.g. its position in a list of all the ids), the same in every "
                    "file, train and eval.")
  if bad.size:
    raise DataError(f"{_value_problem(where, role, name, raw, bad[0], row_name)}, not a number; "
                    "fix or remove that row.")
  return values


def _ids(raw: pd.Series, role: str, name: str, where: str, row_name) -> np.ndarray:
  if pd.api.types.is_integer_dtype(raw.dtype):
    values = raw.to_numpy()  # exact: large ids never pass through float64 (uint64 above 2**63)
  else:
    values = _numbers(raw, role, name, where, row_name)
    fractional = np.flatnonzero(values != np.floor(values))
    if fractional.size:
      raise DataError(f"{_value_problem(where, role, name, raw, fractional[0], row_name)}, not a "
                      "whole number; ids must be integers >= 0: renumber them.")
  # Checked before the cast to int64, which would wrap them (with a numpy RuntimeWarning).
  too_large = np.flatnonzero(values > MAX_ID if values.dtype.kind in "iu" else values >= 2.0**63)
  if too_large.size:
    raise DataError(f"{_value_problem(where, role, name, raw, too_large[0], row_name)}, larger "
                    f"than the largest id {MAX_ID}; renumber the ids from 0.")
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
