"""Which workers tfdp-launch starts at each group attempt when it may shrink (--min_workers).

A *slot* is a worker's index in the full --num_workers group (TFDP_WORKER_SLOT); it stays the
same while the group shrinks, whereas the TF_CONFIG index (TFDP_WORKER_INDEX, the `[wI]`
prefix) is the worker's rank in the group that runs now.

The rules (README, "Multi-worker"):
  - In a failed attempt only the first worker to fail is to blame: the launcher stopped the
    others (or they lost their peer, exit 203), so a 203 blames nobody.
  - A slot blamed in STRIKES_TO_DROP attempts in a row (attempts it took part in; one in which
    another slot was blamed breaks the row) is dropped: the next attempt runs without it.
  - The available slots are all of them, or those listed in the slots file, read at every
    restart. The launcher rewrites that file without a slot it drops; a dropped slot rejoins at
    the first restart after someone lists it again. Without a file a dropped slot stays out.
  - Fewer than --min_workers available: the launcher stops, one line naming the missing slots.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence

from tfdp.errors import TfdpError

STRIKES_TO_DROP = 2


def next_group(num_workers: int, ran: Sequence[int], blamed: int | None,
               streaks: Mapping[int, int], available: Iterable[int]
               ) -> tuple[tuple[int, ...], dict[int, int], tuple[int, ...]]:
  """Pure decision after a failed attempt: (next slots, new streaks, slots dropped now).

  `ran`: the slots of the failed attempt; `blamed`: the slot that failed first (None: nobody);
  `streaks`: per slot, the attempts in a row it was blamed; `available`: slots allowed to start.
  """
  streaks = dict(streaks)
  for slot in ran:
    streaks[slot] = streaks.get(slot, 0) + 1 if slot == blamed else 0
  dropped = tuple(slot for slot in ran if streaks[slot] >= STRIKES_TO_DROP)
  allowed = set(available)
  slots = tuple(slot for slot in range(num_workers) if slot in allowed and slot not in dropped)
  return slots, streaks, dropped


def workers(count: int) -> str:
  return f"{count} worker{'s' if count != 1 else ''}"


def parse_slots(text: str, num_workers: int, where: str) -> set[int]:
  """Slot numbers separated by commas, spaces or lines; '#' starts a comment."""
  slots = set()
  for line in text.splitlines():
    for word in line.split("#", 1)[0].replace(",", " ").split():
      if not (word.isascii() and word.isdigit()) or int(word) >= num_workers:
        raise TfdpError(f"{where}: {word!r} is not a worker slot; list numbers from 0 to "
                        f"{num_workers - 1} (one per line), e.g. '0'.")
      slots.add(int(word))
  return slots


def _write_slots(path: str, slots: Iterable[int]) -> None:
  temporary = f"{path}.tmp-{os.getpid()}"
  with open(temporary, "w", encoding="utf-8") as file:
    file.write("".join(f"{slot}\n" for slot in sorted(slots)))
  os.replace(temporary, path)  # a reader never sees half a file


@dataclasses.dataclass
class Membership:
  """The launcher's state across attempts: who runs, who is out and why."""

  num_workers: int
  min_workers: int
  slots_file: str | None = None
  slots: tuple[int, ...] = ()
  streaks: dict[int, int] = dataclasses.field(default_factory=dict)
  why_out: dict[int, str] = dataclasses.field(default_factory=dict)
  available: set[int] = dataclasses.field(default_factory=set)

  def __post_init__(self):
    if not 1 <= self.min_workers <= self.num_workers:
      raise TfdpError(f"--min_workers must be from 1 to --num_workers ({self.num_workers}), got "
                      f"{self.min_workers}.")
    self.available = set(range(self.num_workers))
    if self.slots_file is not None:
      if os.path.exists(self.slots_file):
        self.available = self._read_file()
      else:
        try:
          _write_slots(self.slots_file, self.available)
        except OSError as error:
          raise TfdpError(f"cannot write --slots_file {self.slots_file}: "
                          f"{error.strerror or error}; pass a writable path.") from None
    self.slots = tuple(sorted(self.available))
    self._note_unlisted()
    if len(self.slots) < self.min_workers:
      raise TfdpError(self.too_few_line(restarting=False))

  def env(self) -> dict[str, str]:
    """What a worker is told of the group's bounds: it may run on another count after a restart
    (cluster.group_may_resize), which `auto` file shards could not resume on mid-epoch."""
    return {"TFDP_MIN_WORKERS": str(self.min_workers), "TFDP_MAX_WORKERS": str(self.num_workers)}

  def _read_file(self) -> set[int]:
    try:
      with open(self.slots_file, encoding="utf-8") as file:
        text = file.read()
    except OSError as error:
      raise TfdpError(f"cannot read --slots_file {self.slots_file}: "
                      f"{error.strerror or error}.") from None
    return parse_slots(text, self.num_workers, f"--slots_file {self.slots_file}")

  def _note_unlisted(self) -> None:
    for slot in range(self.num_workers):
      if slot not in self.available:
        self.why_out.setdefault(slot, f"is not listed in --slots_file {self.slots_file}")

  def too_few_line(self, restarting: bool) -> str:
    missing = "; ".join(f"worker slot {slot} {why}" for slot, why in sorted(self.why_out.items()))
    return (f"only {len(self.slots)} of {workers(self.num_workers)} can start, fewer than "
            f"--min_workers {self.min_workers}, so the group is not "
            f"{'restarted' if restarting else 'started'}: {missing}.")

  def after_failure(self, failed: int, how: str, blame: bool = True) -> str:
    """Plans the next attempt after slot `failed` failed first (`how`: 'exited with code 1'; not
    to `blame` when it lost a peer); returns what changed, for the restart line. Raises TfdpError
    (one line naming the missing slots) when fewer than min_workers can start."""
    blamed = failed if blame else None
    problem = None
    if self.slots_file is not None:
      try:
        self.available = self._read_file()
      except TfdpError as error:  # a half-edited file must not end the job: keep the last set
        problem = f"{error}; keeping workers {sorted(self.available)}"
    previous = self.slots
    self.slots, self.streaks, dropped = next_group(
        self.num_workers, previous, blamed, self.streaks, self.available)
    for slot in dropped:
      self.why_out[slot] = f"failed first in {self.streaks[slot]} attempts in a row ({how})"
      self.available.discard(slot)
    if dropped and self.slots_file is not None:
      try:
        _write_slots(self.slots_file, self.available)
      except OSError as error:
        problem = f"cannot rewrite --slots_file {self.slots_file}: {error.strerror or error}"
    back = [slot for slot in self.slots if slot not in previous]
    for slot in back:
      self.why_out.pop(slot, None)
    self._note_unlisted()
    if len(self.slots) < self.min_workers:
      raise TfdpError(self.too_few_line(restarting=True))
    changes = [f"was {len(previous)}"] if len(previous) != len(self.slots) else []
    changes += [f"worker slot {slot} {self.why_out[slot]}" for slot in dropped]
    changes += [f"worker slot {slot} is back" for slot in back]
    gone = [slot for slot in previous if slot not in self.slots and slot not in dropped]
    changes += [f"worker slot {slot} {self.why_out[slot]}" for slot in gone]
    if failed not in dropped:
      changes.append(f"worker slot {failed} {how}" + ("" if blame else " (lost a peer: no strike)"))
    return "; ".join(changes + [problem] * bool(problem))
