"""The outer loop (Orbit's controller): when to train, evaluate, checkpoint and summarize.
The compiled inner loops, checkpoints and the model are the Trainer's; this knows no workload."""
from __future__ import annotations

import math
import signal
import time

from absl import logging
import tensorflow as tf

from tfdp import logs
from tfdp.core import outputs
from tfdp.errors import Preempted, TrainingDiverged


def memory_mb() -> dict:
  """This process's memory now and at its peak: a leak shows as growth from epoch to epoch."""
  import resource  # pylint: disable=g-import-not-at-top
  import psutil  # pylint: disable=g-import-not-at-top
  return {"rss_mb": psutil.Process().memory_info().rss / 2**20,
          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class StopRequest:
  """SIGTERM (preemption, `kill`, the launcher stopping a group) or a first Ctrl-C asks for a
  checkpoint and a clean exit at the next loop boundary; every worker agrees on that boundary
  through the loop's all-reduce. A second Ctrl-C interrupts at once."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, enabled: bool):
    self.signum = 0
    self._previous = {}
    if enabled:
      for signum in self.SIGNALS:
        try:
          self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread (e.g. some notebook runners)
          pass

  @property
  def requested(self) -> bool:
    return bool(self.signum)

  def _handle(self, signum, frame):
    del frame
    if signum == signal.SIGINT and self.signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signum = self.signum or signum

  def restore(self):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)


def check_finite(sums, first_step: int, last_step: int, saved_step: int | None) -> None:
  """Every worker sees the same all-reduced sums, so all stop together, before any save."""
  bad = {name: value for name, value in sums.values().items() if not math.isfinite(value)}
  if bad:
    kept = (f"the last good checkpoint (step {saved_step}) is kept" if saved_step is not None
            else "no checkpoint was saved")
    shown = ", ".join(f"{name} {value}" for name, value in bad.items())
    steps = (f"step {last_step}" if last_step == first_step + 1
             else f"steps {first_step + 1}-{last_step}")
    raise TrainingDiverged(
        f"training diverged: {shown} in {steps}; stopped without "
        f"saving, {kept}. Lower trainer.learning_rate.base_lr (or raise warmup_epochs), or set "
        "trainer.stop_on_nan=false to train on regardless.")


class ProfileWindow:
  """runtime.profile_steps: a TensorFlow profiler trace of that many steps (whole loops), from the
  second loop of the run on (the first also traces the graph), written by the chief into
  model_dir/train for TensorBoard's profile tab."""

  def __init__(self, steps: int, logdir: str, enabled: bool):
    self.steps = steps if enabled else 0
    self.logdir = logdir
    self.started_at = None

  def before_loop(self, step: int, first_step: int) -> None:
    if self.steps and self.started_at is None and step > first_step:
      tf.profiler.experimental.start(self.logdir)
      self.started_at = step

  def after_loop(self, step: int) -> None:
    if self.started_at is not None and self.steps and step - self.started_at >= self.steps:
      self.stop(step)

  def stop(self, step: int) -> None:
    if self.started_at is not None and self.steps:
      tf.profiler.experimental.stop()
      logging.info("profile: steps %d-%d traced into %s/plugins/profile", self.started_at + 1,
                   step, self.logdir)
      self.steps = 0


class Controller:
  """Runs a Trainer from its restored step to its last: loops of `steps_per_loop` compiled steps,
  cut at checkpoint boundaries; after each epoch a metrics row, an evaluation when due and a
  checkpoint; a stop request saves at the boundary every worker agreed on."""

  def __init__(self, trainer, train_dataset_fn, eval_dataset=None, eval_steps: int = 0):
    self.trainer = trainer
    self.cfg = trainer.config.trainer
    self.train_dataset_fn = train_dataset_fn
    self.eval_dataset = eval_dataset
    self.eval_steps = eval_steps
    plan = trainer.write_plan
    self.writer = (tf.summary.create_file_writer(plan.path("train")) if plan.is_chief
                   else tf.summary.create_noop_writer())
    self.eval_writer = (tf.summary.create_file_writer(plan.path("eval"))
                        if plan.is_chief and eval_dataset is not None
                        else tf.summary.create_noop_writer())

  def _next_loop_size(self, step: int, epoch_end: int) -> int:
    n = min(self.cfg.steps_per_loop, epoch_end - step)
    every = self.cfg.checkpoint_every_steps
    return min(n, (step // every + 1) * every - step) if every else n

  def _summarize(self, writer, step: int, sums, extra: dict) -> None:
    with writer.as_default(step=step):
      for name, value in {**sums.values(), **extra}.items():
        tf.summary.scalar(name, value)

  def _eval_due(self, epoch: int, step: int) -> bool:
    is_last = step >= self.trainer.total_steps
    return self.eval_dataset is not None and ((epoch + 1) % self.cfg.eval_every_epochs == 0
                                              or is_last)

  def _precise_batchnorm_if_due(self, epoch: int, step: int) -> None:
    """Before an evaluation, and at the end (the checkpoint and export carry them)."""
    is_last = step >= self.trainer.total_steps
    if self.cfg.precise_bn_batches and (self._eval_due(epoch, step) or is_last):
      # Never the epoch's last batch: it may be padded with weight-0 examples.
      batches = min(self.cfg.precise_bn_batches, max(1, self.trainer.steps_per_epoch - 1))
      used = self.trainer.precise_batchnorm(self.train_dataset_fn(0), batches)
      if used:
        logging.info("precise BatchNorm: statistics of %d training batches", used)

  def _evaluate_if_due(self, epoch: int, step: int, row: dict) -> None:
    if not self._eval_due(epoch, step):
      return
    result = self.trainer.evaluate(self.eval_dataset, self.eval_steps)
    row.update({f"eval_{name}": value for name, value in result.values().items()},
               eval_examples=int(result.examples))
    self._summarize(self.eval_writer, step, result, {})
    if self.trainer.verbose:
      shown = " ".join(f"{name} {value:.4f}" for name, value in result.values().items())
      print(f"eval: {shown} ({int(result.examples)} examples)", flush=True)

  def run(self) -> dict:
    """Trains from the restored step to total_steps. Returns the last epoch's metrics row."""
    trainer, cfg = self.trainer, self.cfg
    steps_per_epoch, total = trainer.steps_per_epoch, trainer.total_steps
    start = trainer.global_step
    if start >= total:
      logging.info("already trained: step %d of %d", start, total)
      return {}
    iterator = iter(self.train_dataset_fn(start))
    # Kept alive on purpose: destroying it after a long run stalled TF 2.21 here for about a
    # minute (end of CIFAR-10 runs: ~RootDataset::Iterator waiting on tf.data's autotune thread),
    # before the model was exported. The apps leave with os._exit once every output is written.
    trainer._train_iterator = iterator  # pylint: disable=protected-access
    stop = StopRequest(trainer.config.runtime.checkpoint_on_preemption)
    step, last_row = start, {}
    progress = logs.Progress(total, steps_per_epoch, trainer.task.metric_names,
                             enabled=trainer.verbose)
    profile = ProfileWindow(trainer.config.runtime.profile_steps,
                            trainer.write_plan.path("train"), trainer.write_plan.is_chief)
    try:
      while step < total:
        epoch = step // steps_per_epoch
        epoch_end = min((epoch + 1) * steps_per_epoch, total)
        epoch_sums, epoch_start_time, epoch_examples = None, time.time(), 0
        progress.start_epoch(epoch)
        while step < epoch_end:
          n = self._next_loop_size(step, epoch_end)
          profile.before_loop(step, start)
          t0 = time.time()
          loop, stop_agreed = trainer.run_steps(iterator, n, stop.requested)
          seconds = time.time() - t0
          if cfg.stop_on_nan:
            check_finite(loop, step, step + n, trainer.last_saved_step)
          step += n
          profile.after_loop(step)
          if epoch_sums is None:
            epoch_sums = loop
          else:
            epoch_sums.add(loop)
          epoch_examples += n * trainer.global_batch
          examples_per_sec = n * trainer.global_batch / max(seconds, 1e-9)
          lr = float(trainer.schedule(step - 1))
          progress.loop_done(step, n, seconds, loop.values(), examples_per_sec, lr)
          self._summarize(self.writer, step, loop,
                          {"learning_rate": lr, "examples_per_sec": examples_per_sec})
          if stop_agreed:  # some worker was asked to stop: all save at this same step
            trainer.save()
            name = signal.Signals(stop.signum).name if stop.signum else "a peer's SIGTERM"
            logging.warning("stop requested (%s): saved checkpoint at step %d", name, step)
            raise Preempted(step, stop.signum or signal.SIGTERM)
          if cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0:
            trainer.save()
        epoch_seconds = time.time() - epoch_start_time
        row = {"epoch": epoch + 1, "step": step,
               **{f"train_{name}": value for name, value in epoch_sums.values().items()},
               "learning_rate": float(trainer.schedule(step - 1)),
               "examples_per_sec": epoch_examples / max(epoch_seconds, 1e-9),
               "epoch_seconds": epoch_seconds, **memory_mb()}
        with trainer.evaluation_weights():  # the weights' moving average, if kept
          self._precise_batchnorm_if_due(epoch, step)
          self._evaluate_if_due(epoch, step, row)
        # The checkpoint first: a metrics.csv that fails to write must not cost the epoch.
        if not cfg.checkpoint_every_steps or step % cfg.checkpoint_every_steps:
          trainer.save()
        row["wall_time"] = time.time()
        outputs.append_metrics(trainer.write_plan, row)
        last_row = row
    finally:
      profile.stop(step)
      stop.restore()
      self.writer.flush()
      self.eval_writer.flush()
    return last_row
