r"""split_interactions.py: split one file of user–item interactions into one shard per worker.

  python apps/split_interactions.py --input=ratings.csv --output='/data/clicks-{worker}.csv' \
      --num_shards=3 --user_column=s --item_column=d --label_column=y
  ... --fractions=0.5,0.3,0.2                   # uneven: half the users on worker 0, ...
  ... --item_vocabulary=/data/items.vocab       # every item id, for IdMapping on every worker

Every user's interactions land in one shard (a fixed hash of the user id, or fixed fractions of
the users), so worker i reads clicks-i.csv and never another's. Shards keep only the columns
training reads, under the input's names, so the same *_column settings read them. The
vocabularies list the ids of ALL the data, most frequent first: a worker cannot see the others'
ids, so the shared file is what makes its id → row mapping the same as theirs.
"""
import os
import sys

if not __package__:  # run as a script: make the repo root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags

from tfdp import cli
from tfdp.workloads.recommenders import interactions
from tfdp.errors import TfdpError

PROG = "split_interactions.py"  # no console script: run as python apps/split_interactions.py
COMMAND = f"python {interactions.SPLIT_COMMAND}"

flags.DEFINE_string("input", None, "Interactions to split: a CSV file with a header line, or a "
                    "TFRecord file of tf.train.Example.")
flags.DEFINE_string("output", None, "Shard path with a {worker} placeholder, e.g. "
                    "/data/clicks-{worker}.csv; one CSV per shard.")
flags.DEFINE_integer("num_shards", None, "Shards to write, one per worker (default: the number of "
                     "--fractions).", lower_bound=1)
flags.DEFINE_string("fractions", "", "Share of the users of each shard, e.g. 0.5,0.3,0.2; "
                    "default: users by a fixed hash of their id (about even).")
flags.DEFINE_integer("seed", 0, "Seed of the user hash: another seed, another split.")
flags.DEFINE_string("user_column", None, "Column of the user ids (integers >= 0).")
flags.DEFINE_string("item_column", None, "Column of the item ids (integers >= 0).")
flags.DEFINE_string("label_column", "", "Column of the ratings; empty: implicit data (no label "
                    "column written).")
flags.DEFINE_string("weight_column", "", "Column of the example weights; empty: none.")
flags.DEFINE_string("user_vocabulary", "", "Also write every user id, one per line, here.")
flags.DEFINE_string("item_vocabulary", "", "Also write every item id, one per line, here.")
FLAGS = flags.FLAGS


def parse_fractions(text: str) -> list[float] | None:
  if not text:
    return None
  try:
    return [float(part) for part in text.split(",")]
  except ValueError:
    cli.exit_with_error(PROG, f"--fractions '{text}' must be numbers separated by commas, e.g. "
                        "0.5,0.3,0.2.")


def main(argv):
  if len(argv) > 1:
    cli.exit_with_error(PROG, f"unexpected arguments {argv[1:]}; pass options as --flag=value.")
  for name in ("input", "output", "user_column", "item_column"):
    if not getattr(FLAGS, name):
      cli.exit_with_error(PROG, f"--{name} is required; see {COMMAND} --help.")
  if FLAGS.weight_column and FLAGS.weight_column == FLAGS.label_column:  # (training may read one
    cli.exit_with_error(PROG, f"--weight_column and --label_column both name column "  # twice)
                        f"'{FLAGS.label_column}'; a shard holds each column once: give each its "
                        "own column, or leave --weight_column out.")
  fractions = parse_fractions(FLAGS.fractions)
  num_shards = FLAGS.num_shards or (len(fractions) if fractions else None)
  if num_shards is None:
    cli.exit_with_error(PROG, f"--num_shards is required (one shard per worker); see {COMMAND} "
                        "--help.")
  cli.quiet_tensorflow()  # a TFRecord input starts TensorFlow
  try:
    interactions.check_outputs(FLAGS.output, num_shards, FLAGS.input,  # before the input is read
                               {"--user_vocabulary": FLAGS.user_vocabulary,
                                "--item_vocabulary": FLAGS.item_vocabulary})
    frame = interactions.read_interactions(FLAGS.input, FLAGS.user_column, FLAGS.item_column,
                                           FLAGS.label_column, FLAGS.weight_column,
                                           path_option="--input")
    interactions.check_not_empty(frame, FLAGS.input)
    names = {"user": FLAGS.user_column, "item": FLAGS.item_column,
             "label": FLAGS.label_column, "weight": FLAGS.weight_column}
    shards = interactions.write_shards(frame, FLAGS.output, num_shards, fractions, FLAGS.seed,
                                       column_names=names, read_from=FLAGS.input)
    vocabularies = []
    for role, path in (("user", FLAGS.user_vocabulary), ("item", FLAGS.item_vocabulary)):
      if path:
        count = interactions.build_vocabulary(frame[role].to_numpy(), path)
        vocabularies.append(f"{count} {role} ids to {path}")
  except TfdpError as error:
    cli.exit_with_error(PROG, error)
  except KeyboardInterrupt:
    cli.exit_with_error(PROG, "interrupted; the shards written so far are incomplete", 130)
  print(f"{PROG}: wrote {len(shards)} shard(s) of {frame['user'].nunique()} users and {len(frame)} "
        "interactions: " + "; ".join(f"{s.path} ({s.num_users} users, {s.num_interactions} "
                                      "interactions)" for s in shards), flush=True)
  if vocabularies:
    print(f"{PROG}: wrote " + "; ".join(vocabularies), flush=True)
  cli.exit_now(0)


def run():  # the help command named is one that exists (this app has no console script)
  app.run(main, flags_parser=cli.flags_parser(PROG, COMMAND))


if __name__ == "__main__":
  run()
