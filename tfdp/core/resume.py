"""What a resume may do. The run record (checkpoints/run.json) says what a step of the run in
model_dir means; a resume that would change that meaning is refused, and a resume on another
group splits the kept global batch as the record says."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import time

from tfdp.core.outputs import (CHECKPOINT_DIR, CONFIG_FILE, EXPORT_FILE, METRICS_FILE, RUN_FILES,
                               WEIGHTS_FILE, atomic_write_text, checkpoint_step,
                               latest_checkpoint)
from tfdp import errors
from tfdp.errors import ConfigError, OutputError

RUN_RECORD = "run.json"  # beside the checkpoints: --start_over moves both aside together
# Changing any of these reinterprets the restored step: another data position, another batch,
# another order. (gradient_accumulation_steps is recorded but not compared: the recorded run
# re-solves it for another group, resume_batch_split.)
RESUME_FIELDS = {"global_batch_size": "trainer.global_batch_size",
                 # file shards: an epoch's steps follow the largest worker's files (a review)
                 "steps_per_epoch": "the training data or trainer.global_batch_size; under "
                                    "shard_policy file or off, the worker count too: resume on "
                                    "the run's",
                 "epoch_steps": "trainer.steps_per_epoch (its warmup/decay epochs, metrics rows)",
                 "examples_per_epoch": "task.train_data",
                 "data_order_seed": "trainer.seed",
                 "shard_policy": "task.train_data.shard_policy"}
LENGTH_DEPENDENT_SCHEDULES = ("cosine", "linear", "polynomial")  # decay over the whole run


def run_record_path(model_dir: str) -> str:
  return os.path.join(model_dir, CHECKPOINT_DIR, RUN_RECORD)


def read_run_record(model_dir: str) -> dict | None:
  """The run record of the run in model_dir, or None when it has none (a fresh model_dir, or
  a run from before records were written)."""
  path = run_record_path(model_dir)
  if not os.path.exists(path):
    return None
  try:
    with open(path, "rb") as f:
      record = json.loads(f.read(1 << 20).decode("utf-8"))
    if not isinstance(record, dict):
      raise ValueError("not a JSON object")
  except (OSError, ValueError) as e:
    raise OutputError(f"run record '{path}' cannot be read ({' '.join(str(e).split())[:200]}); "
                      f"restore it (it is JSON), or {errors.terms().start_over}.") from None
  return record


def check_config_decided(prior: "Prior", current: dict, model_dir: str, evaluating: bool) -> None:
  """check_resume of the fields the config alone decides, before TensorFlow starts. A run whose
  run.json is gone (removed by hand, or from before records) is compared with its config.yaml,
  which still holds the config that trained it, so a resume with another global batch is not
  taken silently (a probe: epoch 2's row never written, the run 'finished' 22 steps later)."""
  if prior.record:
    check_resume(prior.record, current, model_dir)
  if prior.record or not prior.checkpoint or evaluating:
    return
  import yaml  # pylint: disable=g-import-not-at-top
  try:
    with open(os.path.join(model_dir, CONFIG_FILE), encoding="utf-8") as f:
      earlier = yaml.safe_load(f)
    trainer, data = earlier["trainer"], earlier["task"]["train_data"]
    recorded = config_decided_fields(trainer["global_batch_size"], trainer["seed"],
                                     data["shard_policy"])
  except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
    return  # nothing to compare with: resumed as it is
  check_resume(recorded, current, model_dir)


@dataclasses.dataclass(frozen=True)
class Prior:
  """The earlier run in model_dir, read once before TensorFlow starts and passed on: the
  checkpoint a resume restores is the one every check looked at. Empty for a fresh model_dir
  (and for --start_over, which moves the earlier run aside)."""
  checkpoint: str | None = None
  record: dict | None = None  # None too for a run from before records were written
  # What the model was built for (the record's model_input: image shape, classes), read for an
  # evaluation too, which compares its data with it; None when not recorded.
  model_input: dict | None = None


def read_prior(model_dir: str, start_over: bool, with_record: bool = True,
               is_chief: bool = True) -> Prior:
  """`with_record` False (an evaluation) leaves the record unread: it changes nothing there, and
  only its model_input is taken (an unreadable record gives none). Only the chief, which writes
  the outputs, asks for their checkpoint: a worker that sees none has no shared model_dir, which
  the workers' comparison after restore names."""
  checkpoint = None if start_over else latest_checkpoint(model_dir)
  if not checkpoint:
    if with_record and not start_over and is_chief:
      _check_no_outputs_without_checkpoint(model_dir)
    return Prior()
  if with_record:
    record = read_run_record(model_dir)
    return Prior(checkpoint, record, (record or {}).get("model_input"))
  try:
    return Prior(checkpoint, None, (read_run_record(model_dir) or {}).get("model_input"))
  except OutputError:
    return Prior(checkpoint)


def _check_no_outputs_without_checkpoint(model_dir: str) -> None:
  """A run's outputs with its checkpoints gone (removed by hand): a fresh run would overwrite its
  exported model and add its rows to the earlier run's metrics.csv, silently. (An epoch's row and
  the export are written after its checkpoint: a start that saved none left none of them.)"""
  found = [name for name in (EXPORT_FILE, WEIGHTS_FILE, "eval.json")
           if os.path.exists(os.path.join(model_dir, name))]
  try:
    with open(os.path.join(model_dir, METRICS_FILE), "rb") as f:
      if len([line for line in f.read().splitlines() if line.strip()]) > 1:  # a header and rows
        found.insert(0, METRICS_FILE)
  except OSError:
    pass
  if found:
    raise OutputError(
        f"{errors.terms().model_dir} '{model_dir}' holds a run's outputs ({', '.join(found)}) "
        f"but no checkpoint to resume it from ({CHECKPOINT_DIR}/ is gone or empty): training "
        f"here would overwrite them; {errors.terms().start_over}, or use a new "
        f"{errors.terms().model_dir}.")


def check_resume(record: dict, current: dict, model_dir: str, checkpoint: str | None = None,
                 max_steps: int = 0) -> None:
  """Refuses a resume whose config gives the restored step another meaning. A longer or shorter
  run is a continuation only when the learning-rate schedule does not decay over its length.
  `current` may hold only some fields (config_decided_fields, before the data is planned);
  `checkpoint`: the one restored, whose step says whether the data order may change. A run that
  trainer.max_steps had finished trains nothing: the data position means nothing (a re-run on
  another worker count of file shards, whose epochs are the largest worker's files)."""
  step = checkpoint_step(checkpoint) if checkpoint else None
  finished = finished_by_max_steps(step, max_steps)
  changed = [f"{field} was {record[field]}, now {current[field]} ({key})"
             for field, key in RESUME_FIELDS.items()
             if field in record and field in current and record[field] != current[field]
             and not (finished and field in ("steps_per_epoch", "epoch_steps"))]
  if not changed and checkpoint and not finished:
    _check_order_kept(record, current, model_dir, step)
  decays = (f"the '{current.get('schedule')}' learning-rate schedule"
            if current.get("schedule") in LENGTH_DEPENDENT_SCHEDULES else
            "trainer.lookahead_every_steps, whose pull" if current.get("lookahead_every_steps")
            else None)  # what decays over the run's length (optim.Lookahead: step / total)
  if (decays and "total_steps" in record and "total_steps" in current
      and record["total_steps"] != current["total_steps"]):
    changed.append(f"total_steps was {record['total_steps']}, now {current['total_steps']} "
                   f"(trainer.epochs / trainer.max_steps, with {decays} that decays over the "
                   "whole run)")
  if changed:
    raise OutputError(
        f"{errors.terms().model_dir} '{model_dir}' holds a run this config cannot resume: "
        f"{'; '.join(changed)}. Its checkpoint's step would mean another batch, data position or "
        "schedule; restore the earlier value (a run trained with a constant schedule from its "
        "start may train longer; switching to one now jumps its learning rate), "
        f"{errors.terms().start_over}, or use a new {errors.terms().model_dir}.")


def finished_by_max_steps(step: int | None, max_steps: int) -> bool:
  """The restored step is the run's last (trainer.max_steps): nothing trains on a re-run, so
  the data position (file shards on another worker count) means nothing."""
  return bool(step) and 0 < max_steps <= step


def data_order(plan, data) -> dict:
  """What decides the order an epoch reads beside the seed (`plan`: the training InputPlan):
  recorded, as a resume in the middle of an epoch that changes it is refused."""
  from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
  buffer = data.shuffle_buffer if plan.policy == "local" else data_lib.shuffle_buffer(plan.source,
                                                                                      data)
  return {"shuffle": data.shuffle, "shuffle_buffer": buffer if data.shuffle else 0}


def _check_order_kept(record: dict, current: dict, model_dir: str, step: int | None) -> None:
  """Another shuffle, buffer (cache: off resolves a smaller one) in the middle of an epoch reads
  the rest of it in another order: some examples twice, others never. From its end it is fine."""
  was, now = record.get("data_order"), current.get("data_order")
  per_epoch = int(record.get("steps_per_epoch") or 0)
  if not (was and now and was != now and per_epoch and step and step % per_epoch):
    return
  changes = ", ".join(f"{key} {was.get(key)} → {now.get(key)}" for key in now
                      if was.get(key) != now.get(key))
  end = (step // per_epoch + 1) * per_epoch
  raise OutputError(
      f"{errors.terms().model_dir} '{model_dir}' holds a run stopped at step {step}, in the "
      f"middle of an epoch, that read its training data in another order ({changes}: "
      f"{errors.terms().data_order}); the rest of the epoch would repeat "
      f"some examples and skip others. Set them back to resume (a change is fine from the "
      f"epoch's end, step {end}), {errors.terms().start_over}, or use a new "
      f"{errors.terms().model_dir}.")


# What the checkpoint holds beside the weights: another optimizer's slots, or a weight average
# where none is kept (or the reverse), cannot be restored; said here, not by TensorFlow's
# "variable ... has shape ..." from deep inside the restore.
STATE_FIELDS = {"optimizer": "trainer.optimizer.name (tfdp.fit: compile()'s optimizer)",
                "weight_average": "trainer.ema_decay", "lookahead": "trainer.lookahead_every_steps"}


def check_state_kept(record: dict | None, current: dict, model_dir: str) -> None:
  def same(a, b) -> bool:  # optimizer names were recorded as Keras's class names at first
    return a.lower() == b.lower() if isinstance(a, str) and isinstance(b, str) else a == b
  changed = [f"{field} was {record[field]}, now {current[field]} ({key})"
             for field, key in STATE_FIELDS.items()
             if record and field in record and not same(record[field], current[field])]
  if changed:
    raise OutputError(
        f"{errors.terms().model_dir} '{model_dir}' holds a run whose checkpoint this config cannot "
        f"restore: {'; '.join(changed)}. Set it back to resume, {errors.terms().start_over}, or "
        f"use a new {errors.terms().model_dir}.")


def config_state_fields(trainer) -> dict:
  """Trainer.state_fields of the optimizer a config makes (optim.make_optimizer and the
  trainer's Lookahead), known before TensorFlow starts."""
  return {"optimizer": trainer.optimizer.name, "weight_average": bool(trainer.ema_decay),
          "lookahead": bool(trainer.lookahead_every_steps)}


def config_decided_fields(global_batch_size: int, seed: int, shard_policy: str) -> dict:
  """The run record's fields the config alone decides, so that a resume changing one is refused
  before TensorFlow starts (the data's sizes, and so the steps, come with the data plan). The
  recorded global batch is the config's under every shard policy: local shards' rows per step
  sum to it (local_shards.split_local_batch)."""
  return {"data_order_seed": seed, "shard_policy": shard_policy,
          "global_batch_size": global_batch_size}


def updated_run_record(old: dict | None, current: dict, from_step: int) -> dict:
  """The record to keep: the current fields, the history of worker counts (a new entry from
  `from_step`, the restored step, whenever the group's size changed) and the history of how
  the global batch was split (per-replica batch x accumulation) on them."""
  history = list(old.get("history", [])) if old else []
  group = {"workers": current["workers"], "replicas": current["replicas"]}
  if not history or {k: history[-1].get(k) for k in group} != group:
    history.append({"from_step": from_step, **group})
  splits = list(old.get("batch_history", [])) if old else []
  split = {k: current[k] for k in ("per_replica_batch", "gradient_accumulation_steps")
           if k in current}
  if split and (not splits or {k: splits[-1].get(k) for k in split} != split):
    splits.append({"from_step": from_step, **split})
  record = {k: v for k, v in current.items() if k not in group}
  return {"version": 1, **record, "history": history,
          **({"batch_history": splits} if splits else {})}


# ---- elastic resume: the recorded run decides how its global batch is split on another group ----

FILE_SHARDED = ("file", "tfds_split")  # shards made of the group's size: not the same per step


@dataclasses.dataclass(frozen=True)
class BatchSplit:
  """How a resumed run splits its (kept) global batch on this group, and how it did before."""
  global_batch: int
  workers: int
  replicas: int
  accumulation: int
  was_workers: int
  was_replicas: int
  was_accumulation: int

  @property
  def per_replica_batch(self) -> int:  # an uneven split pads every replica to the larger share
    return -(-self.global_batch // (self.replicas * self.accumulation))

  @property
  def changed(self) -> bool:
    return (self.workers, self.replicas, self.accumulation) != (
        self.was_workers, self.was_replicas, self.was_accumulation)

  def line(self, step: int, finished: bool = False) -> str:
    """The chief's start-up line for a resume on another group (`finished`: the run had
    reached its last step, so nothing trains)."""
    def group(workers: int, replicas: int, was: bool = False) -> str:
      if self.workers == self.was_workers:
        return str(replicas) if was else f"{replicas} replica{'s' * (replicas != 1)}"
      if self.replicas == self.workers and self.was_replicas == self.was_workers:
        return str(workers) if was else f"{workers} worker{'s' * (workers != 1)}"
      # both changed, and a worker holds several replicas on one side: name both counts
      return (f"{workers} worker{'s' * (workers != 1)}"
              + (f" with {replicas} replicas" if replicas != workers else ""))
    where = (f" on {group(self.workers, self.replicas)} "
             f"(was {group(self.was_workers, self.was_replicas, was=True)})"
             if (self.workers, self.replicas) != (self.was_workers, self.was_replicas) else "")
    if finished:
      return f"the run had finished at step {step}: nothing trains{where}"
    accumulation = (f"accumulation {self.was_accumulation} → {self.accumulation}"
                    if self.accumulation != self.was_accumulation
                    else f"accumulation {self.accumulation} kept")
    slots = self.replicas * self.accumulation
    padding = self.per_replica_batch * slots - self.global_batch
    uneven = (f" ({self.global_batch} over {self.replicas} replica{'s' * (self.replicas != 1)}"
              f"{f' x {self.accumulation} accumulation steps' if self.accumulation > 1 else ''}"
              f": {padding} row{'s' * (padding != 1)} of padding per step)" if padding else "")
    return (f"resumed at step {step}{where}: {accumulation}, per-replica batch "
            f"{self.per_replica_batch}{uneven}, global batch {self.global_batch} kept")


def smallest_accumulation(global_batch: int, replicas: int, per_replica_limit: int,
                          even: bool = False) -> int:
  """The fewest micro-steps over `replicas` whose per-replica share of `global_batch` (padded
  where it does not split evenly) is no larger than `per_replica_limit` (its memory budget). An
  even split was preferred at any count: 106 from 4 replicas resumed on 2 ran 53 micro-steps of
  1 row where 2 of 27 fit (a review); a padded step counts each example once all the same.
  `even`: file shards, which cannot split unevenly, take the fewest even ones where any fits."""
  fewest = next(a for a in range(1, global_batch + 1)  # every count above it fits too
                if -(-global_batch // (replicas * a)) <= per_replica_limit)
  return next((a for a in range(fewest, global_batch + 1) if global_batch % (replicas * a) == 0),
              fewest) if even else fewest


def resume_batch_split(record: dict, model_dir: str, global_batch: int, replicas: int,
                       workers: int, sharding: str | None, step: int | None,
                       max_steps: int = 0) -> BatchSplit | None:
  """On a resume, the recorded run decides the split: its global batch stays, its per-replica
  batch stays (or shrinks to the largest even share, never above any it used), and
  gradient_accumulation_steps makes up the difference. Refuses, in one line, a group that
  cannot take the run's data as it was read: a worker-count change of file shards in the
  middle of an epoch (data each worker reads alone: local_shards.check_resumed_shards), unless
  the run had finished there (`max_steps`: nothing trains). None: an old record."""
  history = record.get("history") or []
  batch = int(record.get("global_batch_size", global_batch))
  if not history or "gradient_accumulation_steps" not in record or batch != global_batch:
    return None  # an old record, or another global batch (check_resume refuses it)
  was_workers, was_replicas = int(history[-1]["workers"]), int(history[-1]["replicas"])
  was_accumulation = int(record["gradient_accumulation_steps"])
  started = (f"{errors.terms().model_dir} '{model_dir}' holds a run trained on {was_workers} "
             "worker(s)")
  if workers != was_workers:
    was_sharding = record.get("sharding", record.get("shard_policy"))
    steps_per_epoch = int(record.get("steps_per_epoch") or 0)
    if (steps_per_epoch and step is not None and step % steps_per_epoch
        and {was_sharding, sharding} & set(FILE_SHARDED)
        and not finished_by_max_steps(step, max_steps)):
      end = (step // steps_per_epoch + 1) * steps_per_epoch
      raise OutputError(
          f"{started} with file shards, stopped at step {step} in the middle of an epoch; its "
          f"files go to {workers} worker(s) differently, so the rest of the epoch would repeat "
          f"some examples and skip others. Resume on {was_workers} "
          f"worker{'s' * (was_workers != 1)} (a change is fine from the epoch's end, step {end}), "
          f"or {errors.terms().start_over}.")
  splits = record.get("batch_history") or []
  limit = max([int(s["per_replica_batch"]) for s in splits if "per_replica_batch" in s]
              or [int(record.get("per_replica_batch")
                      or batch // (was_replicas * was_accumulation))])
  accumulation = (was_accumulation if replicas == was_replicas
                  else smallest_accumulation(batch, replicas, limit, sharding in FILE_SHARDED))
  return BatchSplit(batch, workers, replicas, accumulation, was_workers, was_replicas,
                    was_accumulation)


def write_run_record(model_dir: str, record: dict) -> None:
  os.makedirs(os.path.join(model_dir, CHECKPOINT_DIR), exist_ok=True)
  atomic_write_text(run_record_path(model_dir), json.dumps(record, indent=2) + "\n")


def check_start_over_target(model_dir: str, mode: str = "train") -> None:
  """--start_over moves train/, eval/, ... aside: refuse a folder that holds them but no tfdp run
  (a data folder with train/ and eval/ must not be rearranged), and an evaluation, which trains
  nothing to start over (it was told the trained run 'has none')."""
  if mode == "eval":
    raise ConfigError(f"starting over moves a run aside to train from step 0, and "
                      f"{errors.terms().mode}=eval trains nothing; evaluate without starting over.")
  present = [n for n in RUN_FILES if os.path.exists(os.path.join(model_dir, n))]
  if not present or _holds_tfdp_run(model_dir):
    return
  raise OutputError(f"starting over would move {', '.join(present)} out of "
                    f"{errors.terms().model_dir} '{model_dir}', which holds no tfdp run (no tfdp "
                    "config.yaml, metrics.csv or checkpoint state); point "
                    f"{errors.terms().model_dir} at a tfdp run or at a new folder.")


def _holds_tfdp_run(model_dir: str) -> bool:
  checkpoints = os.path.join(model_dir, CHECKPOINT_DIR)
  if any(os.path.exists(os.path.join(checkpoints, n)) for n in ("checkpoint", RUN_RECORD)):
    return True
  def head(name: str) -> str:
    try:
      with open(os.path.join(model_dir, name), "rb") as f:
        return f.read(1 << 20).decode("utf-8", "replace")
    except OSError:
      return ""
  # A config tfdp wrote (top-level task: and trainer: sections), or its metrics (epoch first).
  config = head(CONFIG_FILE)
  return (all(re.search(rf"^{key}:", config, re.MULTILINE) for key in ("task", "trainer"))
          or head(METRICS_FILE).startswith("epoch,"))


def move_run_aside(model_dir: str, artifacts=()) -> str | None:
  """--start_over: the earlier run goes to model_dir/previous-<time>/, never deleted: its state,
  and with it its config.yaml (and earlier ones) and a copy of the task's `artifacts` (an id
  mapping)."""
  names = [n for n in RUN_FILES if os.path.exists(os.path.join(model_dir, n))]
  if not names:
    return None
  configs = sorted(glob.glob(os.path.join(glob.escape(model_dir), "config.*.yaml")))
  names += [n for n in (CONFIG_FILE, *map(os.path.basename, configs))
            if os.path.isfile(os.path.join(model_dir, n))]
  copied = [n for n in artifacts if os.path.isfile(os.path.join(model_dir, n))]  # copies: the
  # config may read one as an input (task.text.vocab_path=<model_dir>/vocabulary.txt)
  stamp = os.path.join(model_dir, f"previous-{time.strftime('%Y%m%d-%H%M%S')}")
  for attempt in range(1, 1000):  # runs set aside within one second (tfdp.fit in a loop) each
    attic = stamp if attempt == 1 else f"{stamp}-{attempt}"  # get their own: a move into an
    try:  # earlier one's `train/` failed half-way ("Directory not empty")
      os.mkdir(attic)
      break
    except FileExistsError:
      continue
  for name in names:
    os.replace(os.path.join(model_dir, name), os.path.join(attic, name))
  for name in copied:  # the new run writes its own over them
    shutil.copy2(os.path.join(model_dir, name), os.path.join(attic, name))
  return attic


def put_run_back(model_dir: str, attic: str) -> None:
  """A --start_over start that failed after move_run_aside: the earlier run goes back where it
  was (a start that fails leaves model_dir as it found it). Whatever the failed start made in its
  place goes (the attic holds the earlier files, and a copy of each task artifact as it was)."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  try:
    for name in os.listdir(attic):
      target = os.path.join(model_dir, name)
      if os.path.isdir(target) and not os.path.islink(target):
        shutil.rmtree(target)
      elif os.path.lexists(target):
        os.remove(target)
      os.replace(os.path.join(attic, name), target)
    os.rmdir(attic)
  except OSError as e:  # the start's own error is the one to say; this one is logged
    logging.warning("the earlier run could not all be put back (%s); what is left of it is in %s",
                    e, attic)
    return
  logging.warning("this start failed: the earlier run that was moved aside is back in %s",
                  model_dir)


def arrays_digest(arrays) -> str:
  """A digest of numpy arrays' dtypes, shapes and bytes (blake2b: about a second per GB)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  digest = hashlib.blake2b(digest_size=16)
  for array in arrays:
    array = np.ascontiguousarray(array)
    digest.update(f"{array.dtype}{array.shape}".encode())
    digest.update(array.view(np.uint8).reshape(-1) if array.dtype != object else
                  repr(array.tolist()).encode())
  return digest.hexdigest()


def weights_digest(model) -> str:
  """A digest of the model's weights, as this process holds them."""
  return arrays_digest(model.get_weights())


def _restored_state(restored_step: int, prior: Prior, plans: dict, model) -> dict:
  """What this worker restored and planned: every worker must hold the same (a model_dir not
  shared between hosts, or data that differs per host, would otherwise hang or train silently
  on duplicated and missing examples). A fresh start's weights too: a model built outside the
  scope without one seed (or loaded on one worker) trained another model on each, silently."""
  import hashlib  # pylint: disable=g-import-not-at-top
  state = {"restored_step": restored_step, "checkpoint": prior.checkpoint}
  if not restored_step:
    state["initial weights"] = weights_digest(model)
  for name, plan in plans.items():
    if plan is None:
      continue
    source = plan.source
    state[f"{name} steps_per_epoch"] = plan.steps_per_epoch
    state[f"{name} examples"] = plan.counts  # local: exchanged already, the same list everywhere
    if plan.policy == "local":  # each worker reads its own shard: its own size and order
      continue
    state[f"{name} source_examples"] = source.num_examples
    described = {"kind": source.kind, "file_counts": source.file_counts,
                 "num_classes": source.num_classes, "image_shape": list(source.image_shape),
                 "files": source.info.get("files"), "content": source.info.get("content")}
    state[f"{name} data_digest"] = hashlib.sha256(
        json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]
  return state


def check_workers_restored_alike(config, model_dir: str, cluster, restored_step: int,
                                 prior: Prior, plans: dict, model) -> None:
  """After restore and data planning (the start-up exchange runs before both): one line naming
  the first worker and field that differs from worker 0."""
  from tfdp.config.loader import short_repr  # pylint: disable=g-import-not-at-top
  from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  state = _restored_state(restored_step, prior, plans, model)
  if plans.get("train") is not None and plans["train"].policy != "local":
    state["train shuffle_buffer"] = data_lib.shuffle_buffer(plans["train"].source,
                                                            config.task.train_data)
  differs = cluster_lib.compare_workers(cluster, state, config.runtime.heartbeat_timeout_seconds,
                                        topic="restored")
  if differs is None:
    return
  states, rank, key = differs
  if key in ("restored_step", "checkpoint"):
    fix = (f"every worker must see the same {errors.terms().model_dir} '{model_dir}' (a file "
           "system shared by every host); share it, then restart the group")
  elif key == "initial weights":
    fix = ("every worker must start from the same weights: build the model after one "
           "keras.utils.set_random_seed on every worker (or under the strategy's scope), "
           "and load weights on every worker or none")
  else:
    fix = errors.terms().workers_data_fix
  theirs, first = short_repr(states[rank].get(key), 60), short_repr(states[0].get(key), 60)
  raise errors.ClusterError(f"workers disagree after restore and data planning: worker {rank} "
                            f"has {key}={theirs} but worker 0 has {first}; {fix}.")


def describe_restore_error(error: Exception) -> str:
  """TensorFlow's restore errors, as the one fact a user needs: which variable does not fit."""
  text = " ".join((getattr(error, "message", None) or str(error) or type(error).__name__).split())
  keras_shapes = re.search(r"variable\.shape=(\(.*?\)), Received: value\.shape=(\(.*?\))\. "
                           r"Target variable: <Variable path=([^,]+),", text)
  if keras_shapes:
    here, saved, name = keras_shapes.groups()
    return f"variable {name} has shape {here} in this model but {saved} in the checkpoint"
  tf_shapes = re.search(r"incompatible tensor with shape (\S+) when attempting to restore "
                        r"variable with shape (\S+) and name (\S+?)\.?(?: |$)", text)
  if tf_shapes:
    saved, here, name = tf_shapes.groups()
    return f"variable {name} has shape {here} in this model but {saved} in the checkpoint"
  return f"{type(error).__name__}: {text[:300]}"
