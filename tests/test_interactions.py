"""Recommender data: per-worker shard files and their one-line errors, CSV and TFRecord reading,
splitting by user (and the app that writes the shards), planted low-rank data whose best RMSE is
the noise, id mappings every worker builds alike, and exact ranking metrics as sums."""
import gzip
import json
import subprocess
import sys
import warnings

import numpy as np
import pandas as pd
import pytest

import helpers
from tfdp.workloads.recommenders import interactions
from tfdp.errors import DataError

INSTEVAL = helpers.REPO.parent / "shared" / "interactions" / "insteval" / "InstEval.csv"
needs_insteval = pytest.mark.skipif(not INSTEVAL.is_file(),
                                    reason=f"InstEval is not in {INSTEVAL} (see shared/README.md)")
SPLIT_APP = str(helpers.REPO / "apps" / "split_interactions.py")
SPLIT_FIX = "split again with fewer shards or other fractions: apps/split_interactions.py"


def one_line_error(excinfo) -> str:
  message = str(excinfo.value)
  assert "\n" not in message
  return message


def frame_of(users, items, labels=None, weights=None) -> pd.DataFrame:
  count = len(users)
  return pd.DataFrame({
      "user": np.asarray(users, np.int64), "item": np.asarray(items, np.int64),
      "label": np.asarray(labels if labels is not None else [1.0] * count, np.float32),
      "weight": np.asarray(weights if weights is not None else [1.0] * count, np.float32)})


def test_importing_starts_no_tensorflow():
  proc = subprocess.run([sys.executable, "-c", "import sys, tfdp.workloads.recommenders.interactions; "
                         "print('tensorflow' in sys.modules)"], capture_output=True, text=True,
                        timeout=60, env=helpers.env(), cwd=str(helpers.REPO))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "False"


# ---- which file a worker reads ---------------------------------------------------------------


@pytest.mark.parametrize("path, worker, num_workers, expected", [
    ("/data/clicks-{worker}.csv", 2, 3, "/data/clicks-2.csv"),
    ("/data/part-{worker:03d}.csv", 7, 8, "/data/part-007.csv"),
    ("/data/{worker}/clicks-{worker}.csv", 1, 2, "/data/1/clicks-1.csv"),
    ("/data/clicks-{worker}.csv", 0, 1, "/data/clicks-0.csv"),  # explicit on one process
    ("/data/all.csv", 1, 3, "/data/all.csv"),  # every worker reads the one file
    ("/data/all.csv", None, 1, "/data/all.csv"),
    ("/data/{workers}.csv", 1, 3, "/data/{workers}.csv"),  # not the placeholder
])
def test_resolve_shard_path(path, worker, num_workers, expected):
  assert interactions.resolve_shard_path(path, worker, num_workers) == expected


@pytest.mark.parametrize("path, worker, num_workers, expected", [
    ("/d/c-{worker}.csv", None, 1,
     "interactions path '/d/c-{worker}.csv' has a {worker} placeholder, but this is a "
     "single-process run; give the path of one file (e.g. the unsplit data) or an explicit "
     "worker index."),
    ("/d/c-{worker}.csv", None, 0,
     "interactions path '/d/c-{worker}.csv' has a {worker} placeholder, but this is a "
     "single-process run; give the path of one file (e.g. the unsplit data) or an explicit "
     "worker index."),
    ("/d/c-{worker}.csv", None, 3,
     "interactions path '/d/c-{worker}.csv' has a {worker} placeholder, but no worker index was "
     "given for this run of 3 workers; pass the worker's index (its task id)."),
    ("/d/c-{worker}.csv", 3, 3,
     "worker 3 is not one of the 3 worker(s) of this run (0..2), so '/d/c-{worker}.csv' names "
     "no shard of it; pass the worker's task id."),
    ("/d/c-{worker:q}.csv", 1, 2,
     "interactions path '/d/c-{worker:q}.csv' has the placeholder '{worker:q}', which cannot "
     "format a worker index; write {worker} or e.g. {worker:03d}."),
])
def test_resolve_shard_path_errors(path, worker, num_workers, expected):
  with pytest.raises(DataError) as excinfo:
    interactions.resolve_shard_path(path, worker, num_workers)
  assert one_line_error(excinfo) == expected


# ---- reading ---------------------------------------------------------------------------------


def test_read_csv_round_trip(tmp_path):
  path = tmp_path / "ratings.csv"
  path.write_text("uid,extra,iid,rating,w\n"
                  "3,a,10,4.5,1\n"
                  "0,b,7,1,0.25\n"
                  "3,c,0,2,0\n"
                  "12345678901234567,d,2,5,2\n")  # beyond float64's exact integers
  frame = interactions.read_interactions(str(path), "uid", "iid", "rating", "w")
  pd.testing.assert_frame_equal(frame, frame_of(
      [3, 0, 3, 12345678901234567], [10, 7, 0, 2], [4.5, 1, 2, 5], [1, 0.25, 0, 2]))
  implicit = interactions.read_interactions(path, "uid", "iid")
  pd.testing.assert_frame_equal(implicit, frame_of([3, 0, 3, 12345678901234567], [10, 7, 0, 2]))
  quoted = tmp_path / "quoted.csv.gz"  # R's write.csv quotes names; gzip by suffix
  pd.DataFrame({"s": [1, 2], "d": [5, 6], "y": [3, 4]}).to_csv(quoted, index=False, quoting=1)
  pd.testing.assert_frame_equal(interactions.read_interactions(quoted, "s", "d", "y"),
                                frame_of([1, 2], [5, 6], [3, 4]))


def write_examples(path, rows, compression=None):
  """rows: dicts of feature name → int, float, bytes or a list of ints."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def feature(value):
    if isinstance(value, bytes):
      return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
    if isinstance(value, float):
      return tf.train.Feature(float_list=tf.train.FloatList(value=[value]))
    return tf.train.Feature(int64_list=tf.train.Int64List(
        value=value if isinstance(value, list) else [value]))

  with tf.io.TFRecordWriter(str(path), options=compression) as writer:
    for row in rows:
      features = tf.train.Features(feature={k: feature(v) for k, v in row.items()})
      writer.write(tf.train.Example(features=features).SerializeToString())


def test_read_tfrecord_round_trip(tmp_path):
  rng = np.random.default_rng(3)
  users, items = rng.integers(0, 50, 20000), rng.integers(0, 2**40, 20000)  # > one parse batch
  labels = rng.integers(1, 11, 20000) / 2.0
  rows = [{"user_id": int(u), "item_id": int(i), "rating": float(l), "note": b"x"}
          for u, i, l in zip(users, items, labels)]
  write_examples(tmp_path / "a.tfrecord", rows)
  frame = interactions.read_interactions(tmp_path / "a.tfrecord", "user_id", "item_id", "rating")
  pd.testing.assert_frame_equal(frame, frame_of(users, items, labels))
  implicit = interactions.read_interactions(tmp_path / "a.tfrecord", "user_id", "item_id")
  pd.testing.assert_frame_equal(implicit, frame_of(users, items))
  # int64 ratings and weights, gzip by suffix
  write_examples(tmp_path / "b.tfrecord.gz", [{"u": 1, "i": 2, "y": 5, "w": 0.5},
                                              {"u": 0, "i": 9, "y": 1, "w": 2.0}], "GZIP")
  pd.testing.assert_frame_equal(
      interactions.read_interactions(tmp_path / "b.tfrecord.gz", "u", "i", "y", "w"),
      frame_of([1, 0], [2, 9], [5, 1], [0.5, 2]))
  write_examples(tmp_path / "empty.tfrecord", [])
  assert len(interactions.read_interactions(tmp_path / "empty.tfrecord", "u", "i")) == 0


def test_tfrecord_errors_name_the_record(tmp_path):
  path = tmp_path / "w1.tfrecord"
  good = {"u": 1, "i": 2, "y": 4.0}
  cases = [
      ([good, good, {"u": 1, "i": 2}],
       "record 3: feature 'y' (label) is missing; give every record the same features."),
      ([good, {"u": 1, "i": 2, "y": b"five"}],
       "record 2: feature 'y' (label) holds bytes, not a number; write it as a float_list or "
       "int64_list."),
      ([good, {"u": [1, 2], "i": 2, "y": 4.0}],
       "record 2: feature 'u' (user) holds 2 values, not one; write one per record."),
      ([{"u": 1.0, "i": 2, "y": 4.0}],
       "record 1: feature 'u' (user) holds a float_list, not int64 ids; write ids as an "
       "int64_list."),
      ([good, {"u": -4, "i": 2, "y": 4.0}],
       "column 'u' (user) holds -4 in record 2; ids must be integers >= 0: renumber them from 0."),
      ([good, {"u": 1, "i": 2, "y": float("nan")}],
       "column 'y' (label) has no value in record 2, not a number; fix or remove that row."),
  ]
  for rows, expected in cases:
    write_examples(path, rows)
    with pytest.raises(DataError) as excinfo:
      interactions.read_interactions(path, "u", "i", "y", worker=1)
    assert one_line_error(excinfo) == f"worker 1: interactions file '{path}' {expected}"
  path.write_bytes(b"this is no TFRecord file at all")
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(path, "u", "i", "y")
  assert one_line_error(excinfo).startswith(
      f"interactions file '{path}' cannot be read as TFRecord of tf.train.Example: ")


CSV_ERRORS = [
    # (file content, columns user/item/label/weight, message after "<where> ")
    ("uid,iid,rating\n1,2,3\n", ("user_id", "iid", "rating", ""),
     "has no user column 'user_id'; its columns are 'uid', 'iid', 'rating': set user_column to "
     "one of them."),
    ("uid,iid,rating\n1,2,3\n", ("uid", "iid", "stars", ""),
     "has no label column 'stars'; its columns are 'uid', 'iid', 'rating': set label_column to "
     "one of them."),
    ("uid,iid,rating\n1,2,4\n1,3,five\n", ("uid", "iid", "rating", ""),
     "column 'rating' (label) holds 'five' in row 2 (line 3), not a number; fix or remove that "
     "row."),
    ("uid,iid,rating\n1,2,4\n1,3,4\n1,4,\n", ("uid", "iid", "rating", ""),
     "column 'rating' (label) has no value in row 3 (line 4), not a number; fix or remove that "
     "row."),
    ("uid,iid,rating\n1,2,4\n-3,3,5\n", ("uid", "iid", "rating", ""),
     "column 'uid' (user) holds -3 in row 2 (line 3); ids must be integers >= 0: renumber them "
     "from 0."),
    ("uid,iid\n1,2\n1,2.5\n", ("uid", "iid", "", ""),
     "column 'iid' (item) holds 2.5 in row 2 (line 3), not a whole number; ids must be integers "
     ">= 0: renumber them."),
    ("uid,iid\n1,2\nbob,3\n", ("uid", "iid", "", ""),
     "column 'uid' (user) holds 'bob' in row 2 (line 3), not a number; fix or remove that row."),
    ("uid,iid,w\n1,2,1\n1,3,-0.5\n", ("uid", "iid", "", "w"),
     "column 'w' (weight) holds -0.5 in row 2 (line 3); weights must be >= 0: fix or remove "
     "that row."),
    ("uid,iid\n1,2\n1,2,3\n", ("uid", "iid", "", ""),
     "cannot be read as CSV: Error tokenizing data. C error: Expected 2 fields in line 3, saw 3; "
     "fix that line."),
]


@pytest.mark.parametrize("content, columns, expected", CSV_ERRORS)
def test_csv_one_line_errors(tmp_path, content, columns, expected):
  path = tmp_path / "clicks-2.csv"
  path.write_text(content)
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(str(tmp_path / "clicks-{worker}.csv"), *columns, worker=2)
  assert one_line_error(excinfo) == f"worker 2: interactions file '{path}' {expected}"


def test_string_ids_say_ids_are_integers_and_how_to_map_them(tmp_path):
  # Once "not a number; fix or remove that row": no row of a file of string ids can be fixed.
  path = tmp_path / "ratings.csv"
  path.write_text("customer_id,product,stars\nu_m,movie-12,4\nu_b,movie-4,5\n")
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(path, "customer_id", "product", "stars")
  assert one_line_error(excinfo) == (
      f"interactions file '{path}' column 'customer_id' (user) holds 'u_m' in row 1 (line 2), "
      "and no row holds a number: ids must be integers >= 0, and neither "
      "apps/split_interactions.py nor a vocabulary file maps string ids; replace each distinct "
      "user id by an integer first (e.g. its position in a list of all the ids), the same in "
      "every file, train and eval.")
  # The fix works: integer ids (the same map for both columns' every file) read.
  frame = pd.read_csv(path)
  for column in ("customer_id", "product"):
    frame[column] = pd.factorize(frame[column])[0]
  frame.to_csv(path, index=False)
  read = interactions.read_interactions(path, "customer_id", "product", "stars")
  assert read["user"].tolist() == [0, 1] and read["item"].tolist() == [0, 1]


def write_file(path, content: bytes) -> None:
  """`content` in `path`, gzipped where the name ends in .gz."""
  if path.name.endswith(".gz"):
    with gzip.open(path, "wb") as f:
      f.write(content)
  else:
    path.write_bytes(content)


@pytest.mark.parametrize("compressed", [False, True])
def test_csv_errors_count_physical_lines(tmp_path, compressed):
  # Once "row 2 (line 3)" here: pandas skips blank lines, and the line was counted from rows.
  path = tmp_path / ("r.csv.gz" if compressed else "r.csv")
  write_file(path, "\nuid,iid,rating\n1,2,4\n\n   \n\"1\",3,5\n1,4,\n".encode())
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(path, "uid", "iid", "rating")
  assert one_line_error(excinfo) == (
      f"interactions file '{path}' column 'rating' (label) has no value in row 3 (line 7), not a "
      "number; fix or remove that row.")


@pytest.mark.parametrize("compressed", [False, True])
def test_a_csv_that_is_not_utf8_names_its_line_and_the_fix(tmp_path, compressed):
  """A probe: "can't decode byte 0xe9 in position 0 ...; fix that line", naming no line (pandas's
  position is in a block, not the file). Seen failing with the old message."""
  path = tmp_path / ("r.csv.gz" if compressed else "r.csv")
  write_file(path, "uid,iid,rating\n1,2,4\n3,4,5\n5,6,1 caf\xe9\n".encode("latin1"))
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(path, "uid", "iid", "rating")
  said = one_line_error(excinfo)
  assert said.startswith(f"interactions file '{path}' is not UTF-8 (line 4: byte 0xe9); "), said
  assert said.endswith(f"iconv -f latin1 -t UTF-8 {path} > {path}.tmp && mv {path}.tmp {path}"
                       if not compressed else "convert its text to UTF-8."), said


def test_csv_errors_count_a_quoted_line_break_as_a_line(tmp_path):
  path = tmp_path / "r.csv"
  path.write_text('uid,iid,note,rating\n1,2,"two\nlines",4\n1,3,x,\n')
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(path, "uid", "iid", "rating")
  assert "has no value in row 2 (line 4), not a number" in one_line_error(excinfo)


def test_a_header_with_spaces_after_its_commas_is_named_and_the_fix_works(tmp_path):
  # Once "has no item column 'product'; its columns are customer_id, product, ...": the
  # leading space of ' product' was invisible.
  path = tmp_path / "ratings.csv"
  path.write_text("customer_id, product, stars, timestamp\n12, 12, 4, 1600000000\n1,4,5,1\n")
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(path, "customer_id", "product", "stars")
  assert one_line_error(excinfo) == (
      f"interactions file '{path}' has no item column 'product', but ' product': its columns are "
      "'customer_id', ' product', ' stars', ' timestamp', with spaces next to the commas of its "
      f"header line; remove them: sed -i '1s/ *, */,/g' {path}")
  command = one_line_error(excinfo).split("remove them: ")[1]
  subprocess.run(command, shell=True, check=True)
  read = interactions.read_interactions(path, "customer_id", "product", "stars")
  assert read["item"].tolist() == [12, 4] and read["label"].tolist() == [4.0, 5.0]


def test_a_file_without_a_header_row_is_named_so(tmp_path):
  # Once "its columns are '0', '8', '4': set user_column to one of them" (the first data row).
  path = tmp_path / "ratings.csv"
  path.write_text("0,8,4\n1,2,3.5\n")
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(path, "user", "item", "rating")
  assert "seems to have no header row; add one" in one_line_error(excinfo)


def test_ids_that_differ_only_by_leading_zeros_are_refused_not_merged(tmp_path):
  # A probe: users '007' and '7' became one user, silently.
  path = tmp_path / "ratings.csv"
  path.write_text("user,item,rating\n007,1,4\n7,2,3\n8,1,5\n")
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(path, "user", "item", "rating")
  said = one_line_error(excinfo)
  assert "user ids '007' and '7' (column 'user') both read as 7" in said, said
  path.write_text("user,item,rating\n007,01,4\n008,02,3\n")  # padded alike: one spelling each
  frame = interactions.read_interactions(path, "user", "item", "rating")
  assert frame["user"].tolist() == [7, 8] and frame["item"].tolist() == [1, 2]


@pytest.mark.parametrize("separator", [";", "\t", "; ", " | "])  # 'user; item': spaces too
def test_a_file_of_another_separator_is_named_and_the_fix_works(tmp_path, separator):
  """Once "has no user column 'user'; its columns are 'user;item;rating': set user_column to one
  of them", which no user_column fixes."""
  import pandas  # pylint: disable=g-import-not-at-top
  path = tmp_path / "ratings.csv"
  path.write_text(separator.join(["user", "item", "rating"]) + "\n" +
                  separator.join(["1", "2", "4"]) + "\n")
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(path, "user", "item", "rating")
  message = one_line_error(excinfo)
  assert "-separated, and tfdp reads comma-separated CSV" in message, message
  fix = message.split("(pandas: ")[1][:-2].replace("new_path", repr(str(tmp_path / "fixed.csv")))
  fix = fix.replace("(path,", f"({str(path)!r},")
  eval(fix, {"pd": pandas})  # pylint: disable=eval-used  (the message's own fix, as written)
  read = interactions.read_interactions(tmp_path / "fixed.csv", "user", "item", "rating")
  assert read["item"].tolist() == [2] and read["label"].tolist() == [4.0]
  assert read["user"].tolist() == [1]


@pytest.mark.parametrize("text", ["100000000000000000000", "1e300", "10000000000000000000",
                                  "9223372036854775808"])
def test_an_id_beyond_int64_is_one_line_without_a_numpy_warning(tmp_path, text):
  # Once a RuntimeWarning (invalid value encountered in cast) came first, and then the error
  # said the id was negative: the cast had wrapped it.
  (tmp_path / "big.csv").write_text(f"uid,iid\n1,2\n{text},3\n")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(DataError) as excinfo:
      interactions.read_interactions(tmp_path / "big.csv", "uid", "iid")
  assert one_line_error(excinfo).endswith(
      "in row 2 (line 3), larger than the largest id 9223372036854775807; renumber the ids "
      "from 0.")
  (tmp_path / "big.csv").write_text("uid,iid\n1,2\n9223372036854775807,3\n")
  largest = interactions.read_interactions(tmp_path / "big.csv", "uid", "iid")["user"].max()
  assert largest == 2**63 - 1


def test_missing_and_misnamed_files(tmp_path):
  (tmp_path / "clicks-0.csv").write_text("u,i\n1,2\n")
  pattern = str(tmp_path / "clicks-{worker}.csv")
  assert len(interactions.read_interactions(pattern, "u", "i", worker=0)) == 1
  with pytest.raises(DataError) as excinfo:  # the shard of worker 1 was never copied there
    interactions.read_interactions(interactions.resolve_shard_path(pattern, 1, 2), "u", "i",
                                   worker=1)
  assert one_line_error(excinfo) == (
      f"worker 1: interactions file '{tmp_path}/clicks-1.csv' does not exist; copy this worker's "
      "shard there (apps/split_interactions.py writes one per worker) or fix the path.")
  with pytest.raises(DataError) as excinfo:  # a single file, no worker's shard
    interactions.read_interactions(tmp_path / "all.csv", "u", "i")
  assert one_line_error(excinfo) == (f"interactions file '{tmp_path}/all.csv' does not exist; fix "
                                     "the path to your CSV or TFRecord file of interactions.")
  with pytest.raises(DataError) as excinfo:  # the splitter's input
    interactions.read_interactions(tmp_path / "all.csv", "u", "i", path_option="--input")
  assert one_line_error(excinfo) == (f"interactions file '{tmp_path}/all.csv' does not exist; pass "
                                     "--input=<your CSV or TFRecord file of interactions>.")
  with pytest.raises(DataError) as excinfo:  # a {worker} path on a single-process run
    interactions.read_interactions(pattern, "u", "i")
  assert one_line_error(excinfo) == (
      f"interactions path '{pattern}' has a {{worker}} placeholder, but this is a single-process "
      "run; give the path of one file (e.g. the unsplit data) or an explicit worker index.")
  (tmp_path / "clicks.parquet").write_bytes(b"PAR1")
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(tmp_path / "clicks.parquet", "u", "i")
  assert one_line_error(excinfo) == (
      f"interactions file '{tmp_path}/clicks.parquet' is neither CSV (.csv, .csv.gz, .csv.bz2, "
      ".csv.xz, .csv.zip) nor TFRecord (.tfrecord, .tfrecords, .tfrec, .tfrecord.gz, "
      ".tfrecords.gz, .tfrec.gz); name it by its format.")
  with pytest.raises(DataError) as excinfo:
    interactions.read_interactions(tmp_path / "clicks-0.csv", "", "i", worker=0)
  assert one_line_error(excinfo) == (
      f"worker 0: no user column is named for '{tmp_path}/clicks-0.csv'; set user_column to the "
      "column that holds the user ids.")


@pytest.mark.parametrize("content", ["u,i,y\n", ""])  # header only; zero bytes
def test_empty_shard_reads_empty_and_check_not_empty_fails(tmp_path, content):
  path = tmp_path / "clicks-2.csv"
  path.write_text(content)
  frame = interactions.read_interactions(path, "u", "i", "y", worker=2)
  pd.testing.assert_frame_equal(frame, frame_of([], []))
  with pytest.raises(DataError) as excinfo:
    interactions.check_not_empty(frame, str(path), worker=2)
  assert one_line_error(excinfo) == (
      f"worker 2: interactions file '{path}' holds no interactions; give every worker a "
      f"non-empty shard ({SPLIT_FIX}).")
  full = frame_of([1], [2])
  assert interactions.check_not_empty(full, str(path), worker=2) is full
  # One file for every worker (training, or the splitter's input): once told to split again
  # with fewer shards, which no split of no rows gives.
  split = subprocess.run([sys.executable, str(helpers.REPO / "apps" / "split_interactions.py"),
                          f"--input={path}", f"--output={tmp_path}/part-{{worker}}.csv",
                          "--num_shards=2", "--user_column=u", "--item_column=i"],
                         capture_output=True, text=True, timeout=60)
  assert split.returncode != 0 and split.stderr.strip().splitlines() == [
      f"split_interactions.py: error: interactions file '{path}' holds no interactions (a header "
      "at most); give it the interactions, one row each."], split.stderr


# ---- splitting by user -----------------------------------------------------------------------


def random_interactions(num_rows=3000, num_users=257, seed=0) -> pd.DataFrame:
  rng = np.random.default_rng(seed)
  return frame_of(rng.integers(0, 10**9, num_users)[rng.integers(0, num_users, num_rows)],
                  rng.integers(0, 500, num_rows), rng.integers(1, 6, num_rows))


def assert_partition(frame, shards):
  """Every row in exactly one shard (by index), no user in two shards, rows in file order."""
  indices = np.concatenate([s.index.to_numpy() for s in shards])
  assert sorted(indices) == list(range(len(frame)))
  for shard in shards:
    assert list(shard.index) == sorted(shard.index)
    pd.testing.assert_frame_equal(shard, frame.loc[shard.index])
  user_sets = [set(s["user"]) for s in shards]
  assert sum(len(u) for u in user_sets) == len(set().union(*user_sets)) == frame["user"].nunique()


def test_user_shards_are_a_fixed_hash_of_the_id():
  assert interactions.user_shards(np.arange(12), 3).tolist() == [2, 0, 2, 1, 0, 2, 1, 1, 1, 0, 2, 0]
  assert interactions.stable_hash([0, 1]).tolist() == [0xE220A8397B1DCDAF, 0x910A2DEC89025CC1]
  assert interactions.stable_hash([0], seed=1).tolist() != interactions.stable_hash([0]).tolist()


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_split_by_user_hash(num_shards):
  frame = random_interactions()
  shards = interactions.split_by_user(frame, num_shards)
  assert len(shards) == num_shards
  assert_partition(frame, shards)
  again = interactions.split_by_user(frame.copy(), num_shards)
  for a, b in zip(shards, again):
    pd.testing.assert_frame_equal(a, b)
  # A user's shard depends on its id alone: the same in any other (here: reversed, halved) data.
  shard_of = {u: s for s, part in enumerate(shards) for u in part["user"]}
  other = frame.iloc[::-2]
  for s, part in enumerate(interactions.split_by_user(other, num_shards)):
    assert {shard_of[u] for u in part["user"]} <= {s}
  if num_shards > 1:  # another seed, another split
    reseeded = interactions.split_by_user(frame, num_shards, seed=1)
    assert any(set(a["user"]) != set(b["user"]) for a, b in zip(shards, reseeded))


@pytest.mark.parametrize("num_users, fractions, expected_users", [
    (101, [0.5, 0.3, 0.2], [50, 31, 20]),
    (10, [0.7, 0.3], [7, 3]),
    (7, [0.25, 0.25, 0.25, 0.25], [2, 2, 1, 2]),
    (5, [1.0], [5]),
])
def test_split_by_user_fractions(num_users, fractions, expected_users):
  rng = np.random.default_rng(num_users)
  users = rng.permutation(10 * num_users)[:num_users]
  frame = frame_of(np.repeat(users, 3), np.arange(3 * num_users))
  shards = interactions.split_by_user(frame, len(fractions), fractions)
  assert_partition(frame, shards)
  counts = [s["user"].nunique() for s in shards]
  assert counts == expected_users
  assert all(abs(c - f * num_users) < 1 for c, f in zip(counts, fractions))
  shuffled = frame.sample(frac=1, random_state=1)
  again = interactions.split_by_user(shuffled, len(fractions), fractions)
  assert [set(s["user"]) for s in again] == [set(s["user"]) for s in shards]


@pytest.mark.parametrize("num_shards, fractions, expected", [
    (3, [0.5, 0.5], "fractions 0.5,0.5 give 2 shard(s), but num_shards is 3; give one fraction "
                    "per shard."),
    (2, [0.5, 0.4], "fractions 0.5,0.4 sum to 0.9, not 1; give the share of the users of each "
                    "shard, e.g. 0.5,0.3,0.2."),
    (2, [1.2, -0.2], "fractions 1.2,-0.2 must all be > 0; every shard needs users."),
    (0, None, "num_shards is 0; give at least 1 (one shard per worker)."),
])
def test_split_by_user_errors(num_shards, fractions, expected):
  with pytest.raises(DataError) as excinfo:
    interactions.split_by_user(random_interactions(), num_shards, fractions)
  assert one_line_error(excinfo) == expected


def test_write_shards_read_back(tmp_path):
  frame = random_interactions()
  frame["weight"] = np.float32(0.1)  # a float32 that must survive CSV exactly
  written = interactions.write_shards(frame, str(tmp_path / "out" / "c-{worker}.csv"), 3,
                                      [0.5, 0.3, 0.2], column_names={"user": "s", "item": "d"})
  expected = interactions.split_by_user(frame, 3, [0.5, 0.3, 0.2])
  assert [(w.path, w.num_users, w.num_interactions) for w in written] == [
      (str(tmp_path / "out" / f"c-{i}.csv"), e["user"].nunique(), len(e))
      for i, e in enumerate(expected)]
  assert (tmp_path / "out" / "c-0.csv").read_text().splitlines()[0] == "s,d,label,weight"
  for worker, part in enumerate(expected):
    back = interactions.read_interactions(str(tmp_path / "out" / "c-{worker}.csv"), "s", "d",
                                          "label", "weight", worker=worker)
    pd.testing.assert_frame_equal(back, part.reset_index(drop=True))
  implicit = interactions.write_shards(frame, tmp_path / "i-{worker}.csv", 2,
                                       column_names={"label": "", "weight": ""})
  assert (tmp_path / "i-1.csv").read_text().splitlines()[0] == "user,item"
  assert sum(w.num_interactions for w in implicit) == len(frame)


@pytest.mark.parametrize("path, num_shards, expected", [
    ("all.csv", 2, "output path '{tmp}/all.csv' has no {worker} placeholder; write e.g. "
                   "/data/clicks-{worker}.csv so every worker gets its own file."),
    ("c-{worker}.parquet", 2, "output path '{tmp}/c-{worker}.parquet' does not end in .csv; "
                              "shards are written as CSV."),
    ("c-{worker}.csv", 4, "shard 1 of 4 would hold no users (2 user(s) in all); use fewer "
                          "shards."),
])
def test_write_shards_errors_write_nothing(tmp_path, path, num_shards, expected):
  frame = frame_of([0, 1, 1], [5, 6, 7])  # users 0 and 1 hash to shards 3 and 0 of 4
  with pytest.raises(DataError) as excinfo:
    interactions.write_shards(frame, str(tmp_path / path), num_shards)
  assert one_line_error(excinfo) == expected.replace("{tmp}", str(tmp_path))
  assert list(tmp_path.iterdir()) == []


def test_a_split_into_fewer_shards_refuses_to_leave_the_earlier_splits_extra_files(tmp_path):
  # Splitting again into 2 shards once left c-2.csv of a 3-shard split: a run on 3 workers then
  # trained on it as if it were this data.
  frame = random_interactions()
  interactions.write_shards(frame, str(tmp_path / "c-{worker}.csv"), 4)
  interactions.write_shards(frame, str(tmp_path / "d-{worker:02d}.csv"), 3)
  before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
  for pattern, expected in (("c-{worker}.csv", "c-2.csv, {tmp}/c-3.csv"),
                            ("d-{worker:02d}.csv", "d-02.csv")):
    with pytest.raises(DataError) as excinfo:
      interactions.write_shards(frame, str(tmp_path / pattern), 2)
    assert one_line_error(excinfo) == (
        f"output path '{tmp_path / pattern}' already holds shard files beyond the 2 now written "
        f"({tmp_path}/{expected.replace('{tmp}', str(tmp_path))}), left by a split into more "
        "shards: a run on more workers would read them as this data; remove them, or choose "
        "another output path.")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written
  (tmp_path / "c-3.csv").unlink()
  (tmp_path / "c-2.csv").rename(tmp_path / "c-2.csv.old")  # not a shard file: kept, and allowed
  assert len(interactions.write_shards(frame, str(tmp_path / "c-{worker}.csv"), 2)) == 2
  assert len(interactions.write_shards(frame, str(tmp_path / "c-{worker}.csv"), 3)) == 3  # more


# ---- the app ---------------------------------------------------------------------------------


def run_split(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, SPLIT_APP, *args], capture_output=True, text=True,
                        timeout=120, env=helpers.env(), cwd=str(helpers.REPO))


def test_app_writes_shards_and_vocabularies(tmp_path):
  frame = random_interactions(num_rows=600, num_users=40)
  raw = pd.DataFrame({"s": frame["user"], "d": frame["item"], "dept": 3, "y": frame["label"]})
  raw.to_csv(tmp_path / "in.csv", index=False)
  proc = run_split(f"--input={tmp_path / 'in.csv'}", f"--output={tmp_path}/clicks-{{worker}}.csv",
                   "--fractions=0.5,0.3,0.2", "--user_column=s", "--item_column=d",
                   "--label_column=y", f"--item_vocabulary={tmp_path / 'items.vocab'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  expected = interactions.split_by_user(frame, 3, [0.5, 0.3, 0.2])
  assert [p["user"].nunique() for p in expected] == [20, 12, 8]
  assert proc.stdout.splitlines() == [
      "split_interactions.py: wrote 3 shard(s) of 40 users and 600 interactions: " + "; ".join(
          f"{tmp_path}/clicks-{i}.csv ({p['user'].nunique()} users, {len(p)} interactions)"
          for i, p in enumerate(expected)),
      f"split_interactions.py: wrote {frame['item'].nunique()} item ids to "
      f"{tmp_path / 'items.vocab'}"]
  for worker, part in enumerate(expected):
    assert (tmp_path / f"clicks-{worker}.csv").read_text().splitlines()[0] == "s,d,y"
    back = interactions.read_interactions(tmp_path / f"clicks-{worker}.csv", "s", "d", "y")
    pd.testing.assert_frame_equal(back, part.reset_index(drop=True))
  mapping = interactions.IdMapping.from_vocabulary_file(tmp_path / "items.vocab", oov_buckets=0)
  assert sorted(mapping.lookup(frame["item"].unique())) == list(range(frame["item"].nunique()))


@pytest.mark.parametrize("label, item", [("s", "d"), ("d", "d"), ("y", "s")])
def test_the_splitter_refuses_one_column_for_two_roles(tmp_path, label, item):
  # --label_column=s (the user column) split the users' ids in as their ratings.
  pd.DataFrame({"s": [1, 2], "d": [3, 4], "y": [5.0, 4.0]}).to_csv(tmp_path / "in.csv", index=False)
  proc = run_split(f"--input={tmp_path / 'in.csv'}", f"--output={tmp_path}/c-{{worker}}.csv",
                   "--num_shards=1", "--user_column=s", f"--item_column={item}",
                   f"--label_column={label}")
  assert proc.returncode != 0 and not list(tmp_path.glob("c-*.csv"))
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "both name column" in lines[0], proc.stderr


@pytest.mark.parametrize("args, expected", [
    (["--item_column=dd"], "interactions file '{tmp}/in.csv' has no item column 'dd'; its columns "
                           "are 's', 'd', 'y': set item_column to one of them."),
    (["--fractions=0.5,x"], "--fractions '0.5,x' must be numbers separated by commas, e.g. "
                            "0.5,0.3,0.2."),
    (["--output={tmp}/all.csv"], "output path '{tmp}/all.csv' has no {worker} placeholder; write "
                                 "e.g. /data/clicks-{worker}.csv so every worker gets its own "
                                 "file."),
    (["--input={tmp}/nope.csv"], "interactions file '{tmp}/nope.csv' does not exist; pass "
                                 "--input=<your CSV or TFRecord file of interactions>."),
    # The help named a console script that is not installed.
    (["--num_shards=0"], "flag --num_shards=0: 0 is not a positive integer; see "
                         "python apps/split_interactions.py --helpfull."),
    (["--user_column="], "--user_column is required; see python apps/split_interactions.py "
                         "--help."),
    # absl's own words, unlike every other app's (a probe)
    (["--user_colum=s"], "Unknown command line flag 'user_colum' (did you mean --user_column?); "
                         "see python apps/split_interactions.py --helpfull."),
    # A probe: each of these wrote over the input or another output with exit 0, or failed
    # after the shards were written; now refused before anything is (seen failing: the old code).
    (["--user_vocabulary={tmp}/in.csv"], "--user_vocabulary '{tmp}/in.csv' is the input, which "
                                         "writing would replace; choose another path."),
    (["--item_vocabulary={tmp}/c-0.csv"], "shard 0 and --item_vocabulary both name "
                                          "'{tmp}/c-0.csv', which the second would replace; give "
                                          "each its own path."),
    (["--user_vocabulary={tmp}/v.txt", "--item_vocabulary={tmp}/v.txt"],
     "--user_vocabulary and --item_vocabulary both name '{tmp}/v.txt', which the second would "
     "replace; give each its own path."),
    (["--item_vocabulary={tmp}"], "--item_vocabulary '{tmp}' is a folder; give the path of a file."),
    (["--user_vocabulary={tmp}/in.csv/u.txt"], "--user_vocabulary '{tmp}/in.csv/u.txt' lies under "
                                               "'{tmp}/in.csv', which is a file, not a folder; "
                                               "choose another path."),
    (["--weight_column=y"], "--weight_column and --label_column both name column 'y'; a shard "
                            "holds each column once: give each its own column, or leave "
                            "--weight_column out."),
])
def test_app_errors_in_one_line(tmp_path, args, expected):
  (tmp_path / "in.csv").write_text("s,d,y\n1,2,3\n4,5,1\n")
  defaults = {"input": f"{tmp_path}/in.csv", "output": f"{tmp_path}/c-{{worker}}.csv",
              "num_shards": "2", "user_column": "s", "item_column": "d", "label_column": "y"}
  given = dict(a[2:].split("=", 1) for a in args)
  proc = run_split(*[f"--{k}={v.replace('{tmp}', str(tmp_path))}"
                     for k, v in {**defaults, **given}.items()])
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert proc.stderr.splitlines() == [
      "split_interactions.py: error: " + expected.replace("{tmp}", str(tmp_path))]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["in.csv"]


@pytest.mark.parametrize("stem", ["c", "c[0]"])  # [0]: a glob that does not match itself
def test_app_refuses_to_write_a_shard_over_its_input(tmp_path, stem):
  """--input=g-0.csv --output=g-{worker}.csv replaced the input with shard 0: the other shards'
  rows were gone from it, without a word."""
  text = "s,d,y\n1,2,3\n4,5,1\n6,7,2\n"
  (tmp_path / f"{stem}-0.csv").write_text(text)
  proc = run_split(f"--input={tmp_path}/{stem}-0.csv", f"--output={tmp_path}/{stem}-{{worker}}.csv",
                   "--num_shards=2", "--user_column=s", "--item_column=d", "--label_column=y")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.splitlines() == [
      f"split_interactions.py: error: output path '{tmp_path}/{stem}-{{worker}}.csv' names the "
      f"input '{tmp_path}/{stem}-0.csv' as a shard, which writing would replace (the rows of the "
      "other shards lost); choose an output path beside it, e.g. another folder."]
  assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}-0.csv"]
  assert (tmp_path / f"{stem}-0.csv").read_text() == text


# ---- planted data ----------------------------------------------------------------------------


def rmse(a, b) -> float:
  return float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


@pytest.mark.parametrize("rank, sigma", [(4, 0.25), (16, 0.5)])
def test_planted_ratings_noise_floor(rank, sigma):
  frame, truth = interactions.planted_interactions(600, 300, rank, sigma, 40, seed=rank)
  assert len(frame) == 24000
  assert list(frame.columns) == ["user", "item", "label", "weight"]
  per_user = frame.groupby("user")["item"]
  assert (per_user.nunique() == 40).all() and (per_user.size() == 40).all()
  assert frame["weight"].eq(1.0).all()
  assert truth.user_factors.shape == (600, rank) and truth.item_factors.shape == (300, rank)
  # Factor entries have variance 1/sqrt(rank): p·q has variance 1 whatever the rank.
  assert abs(np.var(truth.user_factors) * np.sqrt(rank) - 1) < 0.1
  best = rmse(truth.predict(frame["user"], frame["item"]), frame["label"])
  assert abs(best / sigma - 1) < 0.03, best
  global_mean = rmse(frame["label"].mean(), frame["label"])
  assert global_mean > 2 * best and global_mean > 1.1, global_mean
  again, _ = interactions.planted_interactions(600, 300, rank, sigma, 40, seed=rank)
  pd.testing.assert_frame_equal(frame, again)
  other, _ = interactions.planted_interactions(600, 300, rank, sigma, 40, seed=rank + 1)
  assert not frame["item"].equals(other["item"])


def test_planted_implicit_positives_follow_the_true_score():
  frame, truth = interactions.planted_interactions(300, 200, 8, 0.5, 10, seed=5, implicit=True)
  assert len(frame) == 3000 and frame["label"].eq(1.0).all()
  assert (frame.groupby("user")["item"].nunique() == 10).all()
  positives = np.zeros((300, 200), bool)
  positives[frame["user"], frame["item"]] = True
  true_scores = truth.scores(np.arange(300))
  ideal = interactions.ranking_sums(true_scores, positives, k=10)["recall_at_10"]
  chance = interactions.ranking_sums(np.random.default_rng(0).random((300, 200)), positives,
                                     k=10)["recall_at_10"]
  assert ideal[1] == chance[1] == 300
  assert ideal[0] / 300 > 0.5 and chance[0] / 300 < 0.1, (ideal, chance)


def test_planted_errors():
  with pytest.raises(DataError) as excinfo:
    interactions.planted_interactions(10, 5, 2, 0.1, 6, seed=0)
  assert one_line_error(excinfo) == ("interactions_per_user 6 is more than the 5 items; a user "
                                     "interacts with each item at most once.")


# ---- ids → rows ------------------------------------------------------------------------------


def test_build_vocabulary_most_frequent_first(tmp_path):
  path = tmp_path / "v" / "items.vocab"
  assert interactions.build_vocabulary(np.array([5, 3, 5, 9, 3, 5, 12]), str(path)) == 4
  assert path.read_text() == "5\n3\n9\n12\n"
  assert interactions.build_vocabulary([5, 3, 5, 9, 3, 5, 12], str(path), min_count=2) == 2
  assert path.read_text() == "5\n3\n"


def test_vocabulary_mapping_agrees_across_workers(tmp_path):
  frame = random_interactions()
  # Two "workers" write the vocabulary from differently ordered copies of all the data.
  interactions.build_vocabulary(frame["item"], tmp_path / "a.vocab")
  interactions.build_vocabulary(frame["item"].sample(frac=1, random_state=2), tmp_path / "b.vocab")
  assert (tmp_path / "a.vocab").read_bytes() == (tmp_path / "b.vocab").read_bytes()
  first = interactions.IdMapping.from_vocabulary_file(tmp_path / "a.vocab", oov_buckets=3)
  second = interactions.IdMapping.from_vocabulary_file(tmp_path / "b.vocab", oov_buckets=3)
  vocabulary = [int(line) for line in (tmp_path / "a.vocab").read_text().split()]
  size = len(vocabulary)
  assert first.num_rows == second.num_rows == size + 3
  assert first.lookup(vocabulary).tolist() == list(range(size))
  ids = np.concatenate([frame["item"], [10**6, 10**6 + 1, 2**40, 501]])
  np.testing.assert_array_equal(first.lookup(ids), second.lookup(ids))
  oov = first.lookup([10**6, 10**6 + 1, 2**40, 501]).tolist()
  assert oov == [size + 0, size + 2, size + 0, size + 0]  # fixed: the same in every process
  hashes = interactions.stable_hash([10**6, 10**6 + 1, 2**40, 501])
  assert oov == [size + int(h % 3) for h in hashes]
  assert first.lookup(np.array([[vocabulary[2], 10**6]])).tolist() == [[2, size]]
  saved = json.loads(json.dumps(first.to_dict()))
  restored = interactions.IdMapping.from_dict(saved)
  assert restored.to_dict() == first.to_dict() and restored.num_rows == size + 3
  np.testing.assert_array_equal(restored.lookup(ids), first.lookup(ids))


def test_hashed_mapping_agrees_across_instances():
  ids = np.array([0, 1, 2, 3, 2**40, 10**12])
  first, second = interactions.IdMapping.hashed(1000), interactions.IdMapping.hashed(1000)
  assert first.num_rows == 1000
  assert first.lookup(ids).tolist() == second.lookup(ids).tolist() == [
      int(h % 1000) for h in interactions.stable_hash(ids)]
  assert first.lookup([0]).tolist() == [0xE220A8397B1DCDAF % 1000]
  reseeded = interactions.IdMapping.hashed(1000, seed=7)
  assert reseeded.lookup(ids).tolist() != first.lookup(ids).tolist()
  restored = interactions.IdMapping.from_dict(json.loads(json.dumps(first.to_dict())))
  assert restored.to_dict() == {"kind": "hash", "num_buckets": 1000, "seed": 0}
  np.testing.assert_array_equal(restored.lookup(ids), first.lookup(ids))


def test_id_mapping_errors(tmp_path):
  cases = [
      ("1\n2\nx7\n", "line 3 holds 'x7', not an id (an integer >= 0); write one id per line: "),
      ("1\n-2\n", "line 2 holds '-2', not an id (an integer >= 0); write one id per line: "),
      ("4\n\n9\n4\n", "lists id 4 twice (lines 1 and 4), so it would map to two rows; remove one."),
      ("\n\n", "holds no ids; "),
  ]
  for content, expected in cases:
    (tmp_path / "v.vocab").write_text(content)
    with pytest.raises(DataError) as excinfo:
      interactions.IdMapping.from_vocabulary_file(tmp_path / "v.vocab")
    assert one_line_error(excinfo).startswith(f"vocabulary file '{tmp_path}/v.vocab' {expected}")
  with pytest.raises(DataError) as excinfo:
    interactions.IdMapping.from_vocabulary_file(tmp_path / "none.vocab")
  assert one_line_error(excinfo) == (
      f"vocabulary file '{tmp_path}/none.vocab' does not exist; write it once from all the data "
      "with tfdp.workloads.recommenders.interactions.build_vocabulary (python "
      "apps/split_interactions.py --user_vocabulary or --item_vocabulary), and give every worker "
      "the same file.")
  # A missing user vocabulary named --item_vocabulary as the fix.
  with pytest.raises(DataError, match=r"\(python apps/split_interactions.py --user_vocabulary\)"):
    interactions.IdMapping.from_vocabulary_file(tmp_path / "none.vocab", role="user")
  (tmp_path / "v.vocab").write_text("4\n99999999999999999999\n")  # beyond int64: no OverflowError
  with pytest.raises(DataError) as excinfo:
    interactions.IdMapping.from_vocabulary_file(tmp_path / "v.vocab", role="item")
  assert one_line_error(excinfo).startswith(
      f"vocabulary file '{tmp_path}/v.vocab' line 2 holds id 99999999999999999999, larger than "
      "the largest id 9223372036854775807; renumber the ids from 0 and write it once")
  (tmp_path / "v.vocab").write_text("4\n9\n")
  exact = interactions.IdMapping.from_vocabulary_file(tmp_path / "v.vocab", oov_buckets=0)
  assert exact.lookup([9, 4]).tolist() == [1, 0]
  with pytest.raises(DataError) as excinfo:
    exact.lookup([9, 5])
  assert one_line_error(excinfo) == (
      f"id 5 is not in the vocabulary '{tmp_path}/v.vocab' and oov_buckets is 0; rebuild the "
      "vocabulary from all the data, or allow oov_buckets >= 1.")
  with pytest.raises(DataError) as excinfo:
    interactions.IdMapping.from_dict({"kind": "lookup"})
  assert one_line_error(excinfo) == ("a saved id mapping has kind 'lookup'; expected 'hash' or "
                                     "'vocabulary' (written by IdMapping.to_dict).")


# ---- ranking metrics -------------------------------------------------------------------------


def brute_force_ranking(scores, positives, excluded, k):
  """Per user: sort every item by (excluded last, score descending, index), count by hand."""
  recall_sum = ndcg_sum = users = 0.0
  for row_scores, row_positives, row_excluded in zip(scores, positives, excluded):
    relevant = {j for j in range(len(row_scores)) if row_positives[j] and not row_excluded[j]}
    if not relevant:
      continue
    ranking = sorted(range(len(row_scores)),
                     key=lambda j: (bool(row_excluded[j]), -row_scores[j], j))[:k]
    hits = [j in relevant for j in ranking]
    recall_sum += sum(hits) / min(k, len(relevant))
    dcg = sum(1 / np.log2(rank + 2) for rank, hit in enumerate(hits) if hit)
    ideal = sum(1 / np.log2(rank + 2) for rank in range(min(k, len(relevant))))
    ndcg_sum += dcg / ideal
    users += 1
  return {f"recall_at_{k}": (recall_sum, users), f"ndcg_at_{k}": (ndcg_sum, users)}


def test_ranking_sums_by_hand():
  scores = np.array([[0.9, 0.1, 0.8, 0.3, 0.2],
                     [0.5, 0.5, 0.5, 0.5, 0.5],  # all tied: the lowest indices win
                     [0.1, 0.2, 0.3, 0.4, 0.5]])  # no positives: not counted
  positives = np.array([[1, 0, 0, 1, 0], [0, 1, 0, 0, 1], [0, 0, 0, 0, 0]], bool)
  sums = interactions.ranking_sums(scores, positives, k=2)
  # user 0: top 2 = items 0, 2: one hit of min(2, 2), DCG 1 of ideal 1 + 1/log2(3)
  # user 1: top 2 = items 0, 1: one hit at rank 2, DCG 1/log2(3)
  ideal = 1 + 1 / np.log2(3)
  assert sums["recall_at_2"] == (1.0, 2.0)
  assert sums["ndcg_at_2"][1] == 2.0
  assert sums["ndcg_at_2"][0] == pytest.approx(1 / ideal + (1 / np.log2(3)) / ideal, rel=1e-12)
  # Excluding item 0 of user 0 (a training item) drops it from the ranking and the positives.
  excluded = np.zeros_like(positives)
  excluded[0, 0] = True
  sums = interactions.ranking_sums(scores, positives, excluded, k=2)
  assert sums["recall_at_2"] == (1.0 + 0.5, 2.0)  # user 0: top 2 = items 2, 3: 1 hit of 1


def random_ranking_case(seed, num_users, num_items, tied):
  rng = np.random.default_rng(seed)
  if tied:  # few distinct scores: ties at the cut
    scores = rng.integers(0, 4, (num_users, num_items)).astype(np.float32)
  else:
    scores = rng.normal(size=(num_users, num_items)).astype(np.float32)
  positives = rng.random((num_users, num_items)) < rng.uniform(0, 0.4, (num_users, 1))
  positives[0] = False  # a user with nothing held out (or a padding row)
  excluded = rng.random((num_users, num_items)) < 0.2
  return scores, positives, excluded


RANKING_CASES = [(seed, users, items, k, tied) for seed, (users, items, k, tied) in enumerate([
    (8, 12, 5, False), (8, 12, 5, True), (16, 30, 10, True), (5, 7, 10, False),
    (5, 7, 10, True), (20, 50, 1, True), (3, 4, 4, True)])]


@pytest.mark.parametrize("seed, num_users, num_items, k, tied", RANKING_CASES)
def test_ranking_sums_match_brute_force(seed, num_users, num_items, k, tied):
  scores, positives, excluded = random_ranking_case(seed, num_users, num_items, tied)
  for exclude in (None, excluded):
    expected = brute_force_ranking(scores, positives,
                                   excluded if exclude is not None else np.zeros_like(positives), k)
    got = interactions.ranking_sums(scores, positives, exclude, k=k)
    assert sorted(got) == sorted(expected)
    for name, (numerator, denominator) in expected.items():
      assert got[name][1] == denominator
      assert got[name][0] == pytest.approx(numerator, rel=1e-12, abs=1e-12)
  # Sums over batches of users add up to the sums over all of them.
  halves = [interactions.ranking_sums(scores[part], positives[part], excluded[part], k=k)
            for part in (slice(0, num_users // 2), slice(num_users // 2, None))]
  whole = interactions.ranking_sums(scores, positives, excluded, k=k)
  for name in whole:
    assert halves[0][name][1] + halves[1][name][1] == whole[name][1]
    assert halves[0][name][0] + halves[1][name][0] == pytest.approx(whole[name][0], rel=1e-12)


def test_ranking_sums_tf_matches_numpy():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @tf.function(autograph=False)  # as the trainer traces a task's metric sums
  def in_graph(scores, positives, excluded, k):
    return interactions.ranking_sums_tf(scores, positives, excluded, k=k)

  for seed, num_users, num_items, k, tied in RANKING_CASES:
    scores, positives, excluded = random_ranking_case(seed, num_users, num_items, tied)
    expected = interactions.ranking_sums(scores, positives, excluded, k=k)
    for got in (interactions.ranking_sums_tf(scores, positives, excluded, k=k),
                in_graph(tf.constant(scores), tf.constant(positives), tf.constant(excluded), k)):
      for name, (numerator, denominator) in expected.items():
        assert float(got[name][1]) == denominator
        assert float(got[name][0]) == pytest.approx(numerator, rel=1e-5)
    no_exclusion = interactions.ranking_sums_tf(scores, positives.astype(np.float32), k=k)
    assert float(no_exclusion[f"ndcg_at_{k}"][0]) == pytest.approx(
        interactions.ranking_sums(scores, positives, k=k)[f"ndcg_at_{k}"][0], rel=1e-5)


def test_ranking_sums_rejects_bad_scores():
  with pytest.raises(ValueError, match="NaN or inf"):
    interactions.ranking_sums(np.array([[0.1, np.nan]]), np.array([[True, False]]))
  with pytest.raises(ValueError, match=r"\[users, items\]"):
    interactions.ranking_sums(np.zeros(3), np.zeros(3, bool))


# ---- InstEval --------------------------------------------------------------------------------


@needs_insteval
def test_insteval_reads_and_splits_by_user():
  frame = interactions.read_interactions(INSTEVAL, "s", "d", "y")
  assert len(frame) == 73421
  assert frame["user"].nunique() == 2972 and frame["item"].nunique() == 1128
  assert frame["item"].max() == 2160
  assert sorted(frame["label"].unique()) == [1.0, 2.0, 3.0, 4.0, 5.0]
  assert round(rmse(frame["label"].mean(), frame["label"]), 3) == 1.333  # shared/README: ≈ 1.33
  shards = interactions.split_by_user(frame, 3)
  assert_partition(frame, shards)
  assert [len(s) for s in shards] == [25596, 23657, 24168]
  uneven = interactions.split_by_user(frame, 3, [0.5, 0.3, 0.2])
  assert_partition(frame, uneven)
  assert [s["user"].nunique() for s in uneven] == [1486, 892, 594]
