"""The outer loop (Orbit's controller): when to train, evaluate, checkpoint and summarize.
The compiled inner loops, checkpoints and the model are the Trainer's; this knows no workload."""
from __future__ import annotations

import collections
import contextlib
import faulthandler
import math
import os
import signal
import statistics
import sys
import threading
import time

from absl import logging

from tfdp import logs
from tfdp.core import flops
from tfdp.core import outputs
from tfdp.distributed import isolation
from tfdp import errors
from tfdp.errors import Preempted, TrainingDiverged


def memory_mb() -> dict:
  """This process's memory now and at its peak: a leak shows as growth from epoch to epoch."""
  import resource  # pylint: disable=g-import-not-at-top
  import psutil  # pylint: disable=g-import-not-at-top
  rss = psutil.Process().memory_info().rss / 2**20
  # At a new high, ru_maxrss once read 0.08 MB under the rss read just before it (a clean-clone
  # test run); a peak is never below now.
  return {"rss_mb": rss,
          "peak_rss_mb": max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def _stop_when_the_launcher_ends() -> None:
  """Under tfdp-launch, the launcher's end (even by SIGKILL, even past a wrapper script) is a
  SIGTERM to this process (isolation.watch_lifeline): a checkpoint and exit where StopRequest
  takes it, else what SIGTERM does by default (a library run started off the main thread)."""
  isolation.watch_lifeline(lambda: os.kill(os.getpid(), signal.SIGTERM))


AFTER_TRAINING_SECONDS = 2.0  # a signal after training waits this long for the run's own end


class StopRequest:
  """SIGTERM (preemption, `kill`, the launcher stopping a group) or a first Ctrl-C asks for a
  checkpoint and a clean exit within a step: the signal sets the trainer's stop flag, read by
  every compiled step and agreed through its all-reduce (Trainer.request_stop). A second Ctrl-C
  interrupts at once.

  The apps call `install()` first thing: both signals are then blocked in every thread (each
  thread TensorFlow starts later inherits the mask) and taken by one thread with sigwait. So
  neither TF's own SIGTERM handler (std::signal, installed when MultiWorkerMirroredStrategy
  starts) nor a main thread busy in a long compiled loop can hold a signal back: before training
  the process exits at once (nothing to save), during training the flag is set at once. Without
  `install()` (the library API, a notebook), a run installs Python handlers for its training
  only, which act when the main thread next runs Python."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)
  _process = None  # the one install() made
  prog = "tfdp"  # the app, for its one-line messages

  def __init__(self):
    self.signum = 0  # the first signal
    self._asked = errors.StopSignals()
    self._trainer = None  # set while training: the stop flag to raise
    self._trained = False  # a run's training ended: the process is on its way out
    self._save = True  # runtime.checkpoint_on_preemption
    self._lock = threading.Lock()
    self._previous = {}

  @classmethod
  def install(cls, prog: str) -> "StopRequest":
    cls.prog = prog
    if cls._process is None:
      signal.pthread_sigmask(signal.SIG_BLOCK, cls.SIGNALS)
      cls._process = cls()
      threading.Thread(target=cls._process._wait_for_signals, name="tfdp-signals",
                       daemon=True).start()
      _stop_when_the_launcher_ends()
    return cls._process

  @classmethod
  def for_run(cls, trainer, save: bool) -> "StopRequest":
    """The process's (install) or, without it, Python handlers for this run's training."""
    stop = cls._process
    if stop is None:
      stop = cls()
      for signum in cls.SIGNALS if save else ():  # off: the signals do what they did before
        try:
          stop._previous[signum] = signal.signal(signum, lambda n, f: stop.on_signal(n))
        except ValueError:  # not the main thread (e.g. some notebook runners)
          pass
    stop.start_training(trainer, save)
    _stop_when_the_launcher_ends()
    return stop

  @property
  def requested(self) -> bool:
    return bool(self.signum)

  def _wait_for_signals(self) -> None:
    while True:
      self.on_signal(signal.sigwait(self.SIGNALS))

  def on_signal(self, signum: int) -> None:
    with self._lock:
      if not self._asked.add(signum, time.monotonic()):
        return  # one signal delivered twice
      twice = signum == signal.SIGINT and self.signum == signal.SIGINT
      self.signum = self.signum or signum
      trainer = self._trainer
    if twice and self._previous:  # Python's handler, in the main thread
      raise KeyboardInterrupt
    if twice or trainer is None or not self._save:
      if self._previous:  # a run without install(): what the signal did before
        previous = self._previous.get(signum)
        if callable(previous):
          previous(signum, None)
        return
      # Not training (start-up, export): nothing to save, so leave now, even while the main
      # thread waits inside TensorFlow. After training, the main thread first gets a moment to
      # say its own end: a worker stopped by its peer's stop flag lost its line ("stopped at
      # step 48 on a peer's SIGTERM") to the launcher's SIGTERM, sent as the peer exited. A
      # timer waits, not this thread: a second Ctrl-C still exits at once (a review).
      if self._trained and not twice:
        threading.Timer(AFTER_TRAINING_SECONDS, self._exit_now, (signum, False, None)).start()
        return
      self._exit_now(signum, twice, trainer)
    trainer.request_stop()

  def _exit_now(self, signum: int, twice: bool, trainer) -> None:
    phase = "interrupted" if twice else ("not training" if trainer is None
                                         else "checkpoint_on_preemption is off")
    kept = ("nothing is lost: re-run to start, or to resume the run's last checkpoint"
            if trainer is None else "the last checkpoint is kept, re-run to resume")
    # through logs: while TensorFlow imports, fd 2 is a capture that os._exit would lose
    logs.write_stderr_line(f"{self.prog}: error: {signal.Signals(signum).name} ({phase}): "
                           f"exiting now; {kept}")
    os._exit(128 + signum)  # pylint: disable=protected-access

  def start_training(self, trainer, save: bool) -> None:
    with self._lock:
      self._trainer, self._save = trainer, save
      trainer.request_stop(bool(self.signum))

  def end_training(self) -> None:
    with self._lock:
      self._trainer, self._trained = None, True
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}


class Watchdog:
  """A worker alive but stuck (a deadlock, a read that never returns) would hang its group for
  ever: its heartbeat beats and the launcher sees neither an exit nor a stopped process. A thread
  times the training loops: one running longer than max(LOOPS × the median loop time,
  runtime.watchdog_seconds) — FIRST_LOOP × watchdog_seconds for a run's first loop, which traces
  and fills the input pipeline, and is left out of the median; LOOPS × the first loop's time for
  the second (a slow CPU's loop may be longer than the floor: the default job's 50 steps take
  ~230 s on the slowest CPU seen) — dumps every Python thread's
  stack to the log and exits with EXIT_CODE, a failure tfdp-launch --max_restarts restarts from
  the last checkpoint. Only the loops are timed: evaluation, checkpoints and export wait on
  runtime.collective_timeout_seconds when it is set (off by default: see its comment)."""

  LOOPS = 10
  FIRST_LOOP = 5
  EXIT_CODE = errors.EXIT_RESTART_GROUP  # retryable for tfdp-launch and Kubeflow alike

  def __init__(self, seconds: float):
    self.seconds = seconds
    self.loop_seconds = collections.deque(maxlen=50)
    self.first_loop_seconds = 0.0
    self.loops = 0
    self._deadline = None
    self._done = threading.Event()
    if seconds > 0:
      threading.Thread(target=self._watch, name="tfdp-watchdog", daemon=True).start()

  def limit(self) -> float:
    if not self.loops:
      return self.FIRST_LOOP * self.seconds
    if not self.loop_seconds:  # only the first loop so far: its time (with tracing) is the scale
      return max(self.LOOPS * self.first_loop_seconds, self.seconds)
    return max(self.LOOPS * statistics.median(self.loop_seconds), self.seconds)

  def loop_started(self) -> None:
    self._deadline = time.monotonic() + self.limit()

  def loop_ended(self, seconds: float) -> None:
    self._deadline = None
    if self.loops:
      self.loop_seconds.append(seconds)
    else:
      self.first_loop_seconds = seconds
    self.loops += 1

  def close(self) -> None:
    self._done.set()

  def _watch(self) -> None:
    while not self._done.wait(min(1.0, self.seconds / 4)):
      deadline = self._deadline
      if deadline is not None and time.monotonic() > deadline:
        sys.stderr.write(f"{StopRequest.prog}: watchdog: no training loop finished in "
                         f"{self.limit():.0f}s; this worker or a peer is stuck. Its threads:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.write(f"{StopRequest.prog}: error: watchdog: no training loop finished in "
                         f"{self.limit():.0f}s (runtime.watchdog_seconds), stack dump above; "
                         f"exiting with code {self.EXIT_CODE} so that the group restarts from "
                         "the last checkpoint\n")
        sys.stderr.flush()
        os._exit(self.EXIT_CODE)  # pylint: disable=protected-access


def _hang_if_asked(step: int) -> None:
  """Tests only: TFDP_TEST_HANG=<worker>:<step>:<marker> makes that worker sleep for ever
  before the loop at `step` (once: the marker file says it did)."""
  spec = os.environ.get("TFDP_TEST_HANG")
  if not spec:
    return
  worker, at, marker = spec.split(":", 2)
  if (os.environ.get("TFDP_WORKER_INDEX", "0") == worker and step >= int(at)
      and not os.path.exists(marker)):
    open(marker, "w").close()
    while True:
      time.sleep(3600)


def check_finite(sums, first_step: int, last_step: int, saved_step: int | None,
                 epoch: int = 0, epoch_sums=None) -> None:
  """Every worker sees the same all-reduced sums, so all stop together, before any save. The
  error carries the epoch and its train_* values so far (tfdp.fit's TerminateOnNaN logs them)."""
  bad = {name: value for name, value in sums.values().items() if not math.isfinite(value)}
  if bad:
    kept = errors.checkpoint_kept(saved_step)
    shown = ", ".join(f"{name} {value}" for name, value in bad.items())
    steps = (f"step {last_step}" if last_step == first_step + 1
             else f"steps {first_step + 1}-{last_step}")
    diverged = TrainingDiverged(
        f"training diverged: {shown} in {steps}; stopped without "
        f"saving, {kept}. {errors.terms().diverged_fix}.")
    diverged.epoch, diverged.step = epoch, last_step
    diverged.row = {f"train_{name}": value
                    for name, value in (epoch_sums or sums).values().items()}
    raise diverged


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
      import tensorflow as tf  # pylint: disable=g-import-not-at-top  (apps import this first)
      tf.profiler.experimental.start(self.logdir)
      self.started_at = step

  def after_loop(self, step: int) -> None:
    if self.started_at is not None and self.steps and step - self.started_at >= self.steps:
      self.stop(step)

  def stop(self, step: int) -> None:
    if self.started_at is not None and self.steps:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      tf.profiler.experimental.stop()
      logging.info("profile: steps %d-%d traced into %s/plugins/profile", self.started_at + 1,
                   step, self.logdir)
      self.steps = 0


class Controller:
  """Runs a Trainer from its restored step to its last: loops of `steps_per_loop` compiled steps,
  cut at checkpoint boundaries; after each epoch a metrics row, an evaluation when due and a
  checkpoint; a stop request saves at the boundary every worker agreed on."""

  def __init__(self, trainer, train_dataset_fn, eval_dataset=None, eval_steps: int = 0,
               hooks=None):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top  (apps import this first)
    self.trainer = trainer
    # Extras as callables (Orbit): hooks.epoch_begin(epoch), hooks.epoch_end(epoch, row) -> stop,
    # hooks.train_end(row), and if it has them hooks.train_begin(), hooks.evaluation_begin(),
    # hooks.evaluation_end(values) and hooks.validation_due(epoch); every worker calls them with
    # the same all-reduced row, so a stop decided from it is the same everywhere (tfdp.fit's
    # Keras callbacks).
    self.hooks = hooks
    self.cfg = trainer.config.trainer
    self.train_dataset_fn = train_dataset_fn
    self.eval_dataset = eval_dataset
    self.eval_steps = eval_steps
    plan = trainer.write_plan
    writes = plan.is_chief and trainer.global_step < trainer.total_steps  # a finished run: none
    self.writer = (tf.summary.create_file_writer(plan.path("train")) if writes
                   else tf.summary.create_noop_writer())
    self.eval_writer = (tf.summary.create_file_writer(plan.path("eval"))
                        if writes and eval_dataset is not None
                        else tf.summary.create_noop_writer())

  def _next_loop_size(self, step: int, epoch_end: int) -> int:
    n = min(self.cfg.steps_per_loop, epoch_end - step)
    every = self.cfg.checkpoint_every_steps
    return min(n, (step // every + 1) * every - step) if every else n

  def _summarize(self, writer, step: int, sums, extra: dict) -> None:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    # A full disk often hits the event files first: one line, the checkpoints as they are.
    kept = errors.checkpoint_kept(self.trainer.last_saved_step, intact=True)
    with outputs.disk_errors(self.trainer.write_plan.path("train" if writer is self.writer
                                                          else "eval"),
                             f"TensorBoard events were not written; {kept}"):
      with writer.as_default(step=step):
        for name, value in {**sums.values(), **extra}.items():
          tf.summary.scalar(name, value)

  def _eval_due(self, epoch: int, step: int) -> bool:
    is_last = step >= self.trainer.total_steps
    due = getattr(self.hooks, "validation_due", None)  # tfdp.fit's validation_freq, a list too
    every = due(epoch) if due else (epoch + 1) % self.cfg.eval_every_epochs == 0
    return self.eval_dataset is not None and (every or is_last and self.cfg.eval_at_end)

  def _precise_batchnorm_if_due(self, epoch: int, step: int) -> None:
    """Before an evaluation, and at the end (the checkpoint and export carry them), with the
    weights' moving average if one is kept."""
    is_last = step >= self.trainer.total_steps
    if self.cfg.precise_bn_batches and (self._eval_due(epoch, step) or is_last):
      # Never the epoch's last batch: it may be padded with weight-0 examples.
      batches = min(self.cfg.precise_bn_batches, max(1, self.trainer.steps_per_epoch - 1))
      with self.trainer.evaluation_weights():
        used = self.trainer.precise_batchnorm(self.train_dataset_fn(0), batches)
      if used:
        logging.info("precise BatchNorm: statistics of %d training batches", used)

  def _preempted(self, stop: StopRequest, step: int, asked_here: bool) -> Preempted:
    """`asked_here`: this worker's flag fed the agreed stop. A signal of its own that landed
    after the agreement (the launcher stopping the group once the asked worker left) does not
    make it the asked one."""
    signum = (stop.signum or signal.SIGTERM) if asked_here else signal.SIGTERM
    name = ((signal.Signals(stop.signum).name if stop.signum else "a stop request")
            if asked_here else "a peer's SIGTERM")  # a request from code: no signal
    logging.warning("stop requested (%s): saved checkpoint at step %d", name, step)
    said = errors.terms().preempted.format(model_dir=self.trainer.write_plan.model_dir)
    return Preempted(step, signum, said, why=name, by_peer=not asked_here)

  def _evaluate_if_due(self, epoch: int, step: int, row: dict) -> None:
    if not self._eval_due(epoch, step):
      return
    started = time.time()
    begin, end = (getattr(self.hooks, name, None) for name in ("evaluation_begin",
                                                               "evaluation_end"))
    if begin is not None:
      begin()
    with self.trainer.evaluation_weights():  # the weights' moving average, if kept
      result = self.trainer.evaluate(self.eval_dataset, self.eval_steps)
    if end is not None:
      end(result.values())
    row.update({f"eval_{name}": value for name, value in result.values().items()},
               eval_examples=int(result.examples), evaluation_seconds=time.time() - started)
    self._summarize(self.eval_writer, step, result, {})
    if self.trainer.verbose:
      shown = " ".join(f"{name} {value:.4f}" for name, value in result.values().items())
      print(f"eval: {shown} ({int(result.examples)} examples)", flush=True)

  def _write_a_lost_row(self, step: int) -> None:
    """A process killed between an epoch's checkpoint and its metrics row (a second Ctrl-C,
    SIGKILL during the evaluation) resumes after that epoch, whose row would be missing for
    good: it is written now, with its evaluation (the checkpoint holds the epoch's weights) and
    without train_* values, which died with the process. Every worker reads the chief's file."""
    steps_per_epoch, total = self.trainer.steps_per_epoch, self.trainer.total_steps
    if not step or step % steps_per_epoch and step != total:
      return  # a fresh run, or a stop inside an epoch: its row comes when the epoch ends (a
      # shortened run's too: its checkpoint is past the new end, an epoch never completed)
    epoch = -(-step // steps_per_epoch) - 1  # the epoch that ended at `step`
    last = outputs.last_metrics_row(self.trainer.write_plan)
    if int(last.get("epoch", 0)) != epoch or int(last.get("step", -1)) == step:
      return  # the row is there (or more than one is missing: not a lost last row); by its step
      # too: a finished run re-run on another count of file shards has other epochs (a review)
    logging.warning("metrics.csv has no row for epoch %d, whose checkpoint (step %d) was saved "
                    "before the process ended: writing it now, evaluated on that checkpoint, "
                    "without train_* values", epoch + 1, step)
    row = {"epoch": epoch + 1, "step": step, "train_steps": 0,
           "learning_rate": float(self.trainer.schedule(step - 1)), **memory_mb()}
    plan = self.trainer.write_plan
    if step >= total and plan.is_chief and self.eval_dataset is not None:  # a finished run has
      import tensorflow as tf  # pylint: disable=g-import-not-at-top  (no writers): this one's
      self.eval_writer = tf.summary.create_file_writer(plan.path("eval"))  # evaluation to TB too
    self._evaluate_if_due(epoch, step, row)
    row["wall_time"] = time.time()
    outputs.append_metrics(self.trainer.write_plan, row, last=step >= total)

  def run(self) -> dict:
    """Trains from the restored step to total_steps. Returns the last epoch's metrics row."""
    trainer, cfg = self.trainer, self.cfg
    steps_per_epoch, total = trainer.steps_per_epoch, trainer.total_steps
    start = trainer.global_step
    self._write_a_lost_row(start)
    if start >= total:  # re-run of a finished (or at its last step stopped) run: its result again
      logging.info("already trained: step %d of %d; the result is metrics.csv's last row", start,
                   total)
      return outputs.last_metrics_row(trainer.write_plan)
    iterator = iter(self.train_dataset_fn(start))
    # Kept alive on purpose: destroying it after a long run stalled TF 2.21 here for about a
    # minute (end of CIFAR-10 runs: ~RootDataset::Iterator waiting on tf.data's autotune thread),
    # before the model was exported. The apps leave with os._exit once every output is written.
    trainer._train_iterator = iterator  # pylint: disable=protected-access
    watchdog = Watchdog(trainer.config.runtime.watchdog_seconds)
    step, last_row, profile = start, {}, None
    # From here every exit gives the signals back: a failure while tracing (a task's one-line
    # error) left tfdp's handler in place, swallowing the user's next Ctrl-C.
    stop = StopRequest.for_run(trainer, trainer.config.runtime.checkpoint_on_preemption)
    try:
      logging.info("training: steps %d-%d in loops of up to %d", start + 1, total,
                   cfg.steps_per_loop)
      flops_per_example, peak_flops, peak_how = flops.trainer_flops_and_peak(
          trainer, lambda: iterator.element_spec)
      logging.info("MFU against a peak of %.4g FLOP/s (%s)", peak_flops, peak_how)
      progress = logs.Progress(total, steps_per_epoch, trainer.task.reported_metric_names(),
                               enabled=trainer.verbose, flops_per_example=flops_per_example,
                               peak_flops=peak_flops)
      profile = ProfileWindow(trainer.config.runtime.profile_steps,
                              trainer.write_plan.path("train"), trainer.write_plan.is_chief)
      if StopRequest._process is not None:  # a command (its first line installed it), no notebook
        logging.info("start-up: %.1f s from process start to the first training step (imports, "
                     "cluster, data plan, model build, restore; the loop is traced next)",
                     logs.process_age_seconds())
      if self.hooks is not None and hasattr(self.hooks, "train_begin"):
        self.hooks.train_begin()  # before the trace: what it changes is in the traced step
      if step < total:
        logging.info("traced the training loop in %.1f s", trainer.trace_train_loop(iterator))
      while step < total:
        epoch = step // steps_per_epoch
        epoch_end = min((epoch + 1) * steps_per_epoch, total)
        epoch_sums, epoch_start_time, epoch_steps = None, time.time(), 0
        progress.start_epoch(epoch)
        if self.hooks is not None:
          self.hooks.epoch_begin(epoch)
        while step < epoch_end:
          n = self._next_loop_size(step, epoch_end)
          profile.before_loop(step, start)
          t0 = time.time()
          watchdog.loop_started()
          _hang_if_asked(step)
          loop, stop_agreed, asked_here, n = trainer.run_steps(iterator, n)  # n: fewer if stopped
          seconds = time.time() - t0
          watchdog.loop_ended(seconds)
          if epoch_sums is None:
            epoch_sums = loop
          else:
            epoch_sums.add(loop)
          if cfg.stop_on_nan:
            check_finite(loop, step, step + n, trainer.last_saved_step, epoch, epoch_sums)
          step += n
          profile.after_loop(step)
          epoch_steps += n
          examples_per_sec = n * trainer.global_batch / max(seconds, 1e-9)
          lr = float(trainer.schedule(step - 1))
          progress.loop_done(step, n, seconds, loop.values(), examples_per_sec, lr)
          self._summarize(self.writer, step, loop,
                          {"learning_rate": lr, "examples_per_sec": examples_per_sec})
          if stop_agreed and step < epoch_end:  # a worker was asked to stop: all save here
            trainer.save()
            raise self._preempted(stop, step, asked_here)
          if (cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0
              and step < epoch_end):  # an epoch's end saves below, after precise BN
            trainer.save()
        epoch_seconds = time.time() - epoch_start_time
        row = {"epoch": epoch + 1, "step": step,
               **{f"train_{name}": value for name, value in epoch_sums.values().items()},
               # the steps train_* cover: fewer than the epoch's where it was resumed mid-way
               "train_steps": epoch_steps,
               "learning_rate": float(trainer.schedule(step - 1)),
               "examples_per_sec": epoch_steps * trainer.global_batch / max(epoch_seconds, 1e-9),
               "epoch_seconds": epoch_seconds, **memory_mb()}
        row["mfu"] = flops.mfu(flops_per_example, row["examples_per_sec"], peak_flops)
        self._precise_batchnorm_if_due(epoch, step)
        # The checkpoint before the evaluation and metrics.csv: neither a failing evaluation nor
        # a disk too full for the row, nor a stop's grace period running out, costs the epoch.
        trainer.save()
        self._evaluate_if_due(epoch, step, row)
        row["wall_time"] = time.time()
        outputs.append_metrics(trainer.write_plan, row, last=step >= total)
        last_row = row
        stopped_by_hook = self.hooks is not None and self.hooks.epoch_end(epoch, row)
        if stop_agreed and step < total:  # with the epoch's last step (the last loop's flag):
          # ended as any other epoch (its checkpoint, evaluation and row), the resume starts
          # with the next; on the run's last step the run finishes (its export, train_end)
          raise self._preempted(stop, step, asked_here)
        if stop_agreed:
          logging.info("a stop was asked on the run's last step (%d): finishing the run", step)
        if stopped_by_hook and step < total:
          logging.info("training stopped by a callback after epoch %d (step %d)", epoch + 1, step)
          if trainer.write_plan.is_chief:
            outputs.write_metrics_png(trainer.write_plan)
          break
      if self.hooks is not None:
        self.hooks.train_end(last_row)
        # Callbacks act after the last save (EarlyStopping's restored best weights, a learning
        # rate, use_ema's average): saved again, the same model_dir goes on from the model as
        # it was handed back, as model.fit goes on from the model (a review).
        if getattr(self.hooks, "changed_since_save", lambda: False)():
          trainer.save()
    finally:
      if profile is not None:
        profile.stop(step)
      stop.end_training()
      watchdog.close()
      with contextlib.suppress(Exception):  # a full disk was said once, above
        self.writer.flush()
        self.eval_writer.flush()
    return last_row


def drop_in_background(holder: list, name: str) -> None:
  """Drops what `holder` holds on a thread of its own: destroying a tf.data iterator can block
  for up to a minute in TF 2.21 (tf.data's autotune thread, whose wait between optimizations
  grows to 60 s: kOptimizationPeriodMaxMs in tensorflow/core/framework/model.h); one airbench
  evaluation spent 12.6 s in it (BENCHMARKS.md, "The evaluation stall"). Not a daemon thread: one killed
  at exit inside TensorFlow's C++ code aborted the process ("FATAL: exception not rethrown")."""
  threading.Thread(target=holder.clear, name=name).start()


def release_in_background(trainer) -> None:
  """Destroys the finished run's training iterator in the background (drop_in_background),
  so fit returns at once: measured here after four ~80 s runs, 61.9 s, 9.8 s, 1.2 s, 0.3 s, while
  the main thread kept running (its 50 ms sleeps took at most 0.8 s); the apps avoid the
  destructor altogether by leaving with os._exit. The interpreter waits for that thread, so a
  script's exit can take as long as the destructor."""
  holder = [trainer.__dict__.pop("_train_iterator", None)]
  if holder[0] is None:
    return
  drop_in_background(holder, "tfdp-release-train-iterator")
