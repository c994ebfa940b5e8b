"""tfdp-vocab: learn a WordPiece vocabulary from a corpus once, and ship the file.

  tfdp-vocab --input=corpus/ --vocab_size=8000 --output=vocab.txt       # every *.txt|*.md below
  tfdp-vocab --input='corpus/*.txt' --vocab_size=8000 --output=vocab.txt
  tfdp-vocab --input=../shared/text/shakespeare --plays --output=configs/vocab/shakespeare_wordpiece.txt

The file holds one token per line, [PAD] [UNK] [CLS] [SEP] [MASK] first ([PAD] is id 0); read it
with tfdp.workloads.text.inputs.load_tokenizer. --vocab_size is an upper bound: keras_hub's learner keeps the
word pieces seen at least K times, searching for a K (10 or more) that gives 95-100% of it (the 38
plays give 6291 tokens of 8000, at K = 10, learned in about 75 s).
"""
import os
import sys
import time

if not __package__:  # run as a script: make the repo root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags

import apps
from tfdp import cli
from tfdp.workloads.text import inputs as text
from tfdp.errors import DataError, TfdpError

PROG = "tfdp-vocab"
LEARNER_SLACK, LEARNER_MIN_COUNT = 0.05, 10  # keras_hub's word-piece learner's, fixed there

flags.DEFINE_string("input", None, "A folder (every *.txt and *.md beneath it) or a glob.")
flags.DEFINE_integer("vocab_size", 8000, "Largest vocabulary to learn, reserved tokens included.")
flags.DEFINE_string("output", None, "Vocabulary file to write, one token per line.")
flags.DEFINE_bool("lowercase", True, "Lowercase text first; load the file with the same setting.")
flags.DEFINE_bool("plays", False, "Read files as plays in Markdown (**NAME** speaker lines, _..._ "
                  "stage directions) and learn from the speeches only, as the Shakespeare "
                  "workloads read them.")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    cli.exit_with_error(PROG, f"unexpected arguments {argv[1:]}; pass options as --flag=value.")
  for name in ("input", "output"):
    if not getattr(FLAGS, name):
      cli.exit_with_error(PROG, f"--{name} is required; see {PROG} --help.")
  start = time.time()
  try:
    text.check_vocab_size(FLAGS.vocab_size)  # before a large corpus is read
    found = text.find_text_files(FLAGS.input)
    paths = text.without_output(found, FLAGS.output)
    if len(paths) < len(found):
      print(f"{PROG}: note: left out {FLAGS.output}, the vocabulary an earlier run wrote there",
            flush=True)
    texts = text.read_text_files(paths)
    if FLAGS.plays:
      texts = [speech for play in texts for speech in text.split_speeches(play)]
      if not texts:  # plain text: learn_vocabulary would call the files empty
        raise DataError(f"--plays reads **NAME** speaker lines, and '{FLAGS.input}' has none; "
                        "drop --plays for plain text.")
    cli.quiet_tensorflow()
    vocab = text.learn_vocabulary(texts, FLAGS.vocab_size, FLAGS.output, lowercase=FLAGS.lowercase)
  except TfdpError as error:
    cli.exit_with_error(PROG, error)
  except KeyboardInterrupt:
    cli.exit_with_error(PROG, "interrupted; no vocabulary written", 130)
  print(f"{PROG}: wrote {len(vocab)} tokens to {FLAGS.output} from {len(paths)} file(s) "
        f"({sum(len(t.split()) for t in texts)} words) in {time.time() - start:.0f} s", flush=True)
  note = shortfall_note(len(vocab), FLAGS.vocab_size)
  if note:
    print(f"{PROG}: note: {note}", flush=True)
  cli.exit_now(0)


def shortfall_note(learned: int, asked: int) -> str | None:
  """Why the vocabulary is smaller than --vocab_size. The learner (tensorflow_text's, slack_ratio
  0.05, lower_thresh 10) binary-searches a minimum count K >= 10 for word pieces and stops at the
  first K whose vocabulary is 95-100% of the target; short of that, no K fits."""
  if learned >= asked:
    return None
  if learned >= asked * (1 - LEARNER_SLACK):
    return (f"{learned} tokens, not --vocab_size={asked}: the learner stops once it is within "
            f"{LEARNER_SLACK:.0%} below the target")
  return (f"{learned} tokens, fewer than --vocab_size={asked}: the learner keeps the word pieces "
          f"seen at least K times, and no K of {LEARNER_MIN_COUNT} or more gives within "
          f"{LEARNER_SLACK:.0%} of the target; more text gives more tokens")


def run():
  apps.lend_help_to_console_script(__name__)
  app.run(main, flags_parser=cli.flags_parser(PROG))


if __name__ == "__main__":
  run()
