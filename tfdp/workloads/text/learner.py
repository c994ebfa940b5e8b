"""What keras_hub's WordPiece learner (tensorflow_text's) takes from a text: its characters,
counted as the learner splits and folds them, so tfdp-vocab can say before minutes of learning
that a vocabulary size cannot hold them (inputs.check_vocab_holds_characters)."""
from __future__ import annotations

import re
import unicodedata

# keras_hub's learner (tensorflow_text's): words longer than this are dropped, and only this many
# of the most common characters are kept (wordpiece_tokenizer_learner_lib.learn's defaults)
LEARNER_MAX_WORD, LEARNER_MAX_CHARACTERS = 50, 1000
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def learner_characters(texts: list[str], lowercase: bool) -> int:
  """How many characters keras_hub's learner takes from `texts`, split as its pretokenize
  splits them (ASCII whitespace and the Cc/Cf characters apart; punctuation and CJK characters
  words of their own; then case folding), in words of up to LEARNER_MAX_WORD characters, at
  most LEARNER_MAX_CHARACTERS: a BOM or a soft hyphen is no character of a word, a no-break
  space is (a review). Text by text, keeping distinct words only (a joined corpus took 17x its
  size in memory)."""
  distinct = set().union(*map(set, texts))
  apart = {c for c in distinct if c in " \t\n\f\r" or unicodedata.category(c) in ("Cc", "Cf")}
  alone = {c for c in distinct - apart
           if (c.isascii() and not c.isalnum()) or unicodedata.category(c).startswith("P")
           or any(low <= ord(c) <= high for low, high in _CJK)}
  def of(characters):
    return "".join(re.escape(c) for c in sorted(characters))
  apart_pattern = re.compile(f"[{of(apart)}]") if apart else None
  alone_pattern = re.compile(f"([{of(alone)}])") if alone else None
  words = set()
  for text in texts:  # one regex pass each (a split per word took 5 s for the 38 plays)
    if apart_pattern:
      text = apart_pattern.sub("\0", text)  # NUL: no text file holds one
    if alone_pattern:
      text = alone_pattern.sub("\0\\1\0", text)
    words.update(text.split("\0"))
  if lowercase:  # ICU's NFKC case folding (tensorflow_text's case_fold_utf8), word by word: it
    words = {_nfkc_casefold(w) for w in words}  # recomposes, and drops what is ignorable
  characters = set()
  for word in words:
    if len(word) <= LEARNER_MAX_WORD:
      characters.update(word)
  return min(len(characters), LEARNER_MAX_CHARACTERS)


# Default_Ignorable_Code_Point characters that are not Cc/Cf (NFKC_Casefold maps them to nothing)
_IGNORABLE = ((0x034F, 0x034F), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F),
              (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFFA0, 0xFFA0), (0xE0100, 0xE01EF))


def _nfkc_casefold(word: str) -> str:
  folded = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", word).casefold())
  return "".join(c for c in folded
                 if not any(low <= ord(c) <= high for low, high in _IGNORABLE))
