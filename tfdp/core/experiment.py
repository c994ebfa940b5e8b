"""The whole flow, in order: config → cluster → strategy → data → task/model → trainer →
outputs."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from absl import logging

from tfdp.distributed import cluster as cluster_lib
from tfdp import config as config_lib
from tfdp import errors
from tfdp import logs
from tfdp.core import data as data_lib
from tfdp.core import local_shards
from tfdp.core import outputs
from tfdp.core import resume
from tfdp.core import run_errors
from tfdp.distributed import strategy as strategy_lib
from tfdp.core import task as tasks
from tfdp.core import warm_start
from tfdp.config import ExperimentConfig
from tfdp.config.schema import TaskConfig
from tfdp.errors import ClusterError, ConfigError, DataError, OutputError

def preflight(config: ExperimentConfig, model_dir: str, mode: str,
              cluster: cluster_lib.Cluster, check_data: bool = True,
              start_over: bool = False,
              task=None) -> tuple[str, resume.Prior, str | None]:
  """Every check that needs no TensorFlow: a bad input fails here, in a second, touching nothing.
  Returns the resolved model_dir, the earlier run in it (read once) and a fresh run's warm start.
  `task`: the task build was given, if any (its optimizer may be its own)."""
  config_lib.validate(config)
  if mode not in config_lib.MODES:
    raise ConfigError(f"{errors.terms().mode} '{mode}' is unknown; use one of "
                      f"{', '.join(config_lib.MODES)}.")
  if cluster.task_type == "evaluator":
    raise ClusterError("TF_CONFIG makes this task an evaluator, but tfdp has no side-car "
                       "evaluator; drop the evaluator task from TF_CONFIG and evaluate with "
                       "tfdp-train --mode=eval --model_dir=<the run> (it reads the latest checkpoint).")
  model_dir = outputs.resolve_model_dir(model_dir)
  if start_over and cluster.is_chief:
    resume.check_start_over_target(model_dir, mode)
  prior = resume.read_prior(model_dir, start_over, mode != "eval", cluster.is_chief)
  if mode == "eval" and prior.checkpoint is None:
    raise OutputError(f"{errors.terms().mode}=eval needs a trained checkpoint, and "
                      f"'{model_dir}' has none; train first, or point {errors.terms().model_dir} "
                      "at a trained run.")
  task_class = tasks.task_class(config.task.name)
  for key, read in (("train_data", mode != "eval"), ("eval_data", mode != "train")):
    if check_data and read:
      task_class.check_source(getattr(config.task, key), f"task.{key}")
  # Only a fresh run warm starts: a resume or an evaluation needs no init checkpoint (it may be
  # gone since), as build restores none.
  init = (warm_start.find_init_checkpoint(config.task.init_checkpoint)
          if config.task.init_checkpoint and prior.checkpoint is None else None)
  _check_saved_artifacts(task_class, config.task, model_dir, mode, prior.checkpoint, init)
  resume.check_config_decided(prior, resume.config_decided_fields(  # the rest once data is planned
      config.trainer.global_batch_size, config.trainer.seed, config.task.train_data.shard_policy),
      model_dir, evaluating=mode == "eval")
  classes = [task_class] + ([type(task)] if task is not None else [])
  if all(c.make_optimizer is tasks.Task.make_optimizer for c in classes):
    # The config's optimizer (not a compiled model's): Trainer checks the same once it is built.
    resume.check_state_kept(prior.record, resume.config_state_fields(config.trainer), model_dir)
  replicas = strategy_lib.expected_replicas(config.runtime, cluster.num_workers)
  if replicas:  # a resume splits the batch as its run record says (_batch_split)
    policy = config.task.train_data.shard_policy  # auto is resolved once the data is planned
    split = _batch_split(config, model_dir, prior, replicas, cluster,
                         policy if policy in resume.FILE_SHARDED else None, say=False)
    data_lib.check_batch_divides(_with_accumulation(config, split), replicas)
  return (outputs.prepare_model_dir(model_dir) if cluster.is_chief else model_dir), prior, init


@dataclasses.dataclass
class Experiment:
  """One experiment, built: every decided object, for `run` and for whoever else consumes it
  (tests, benchmarks). Building trains nothing; the model holds its initial (or restored)
  weights."""
  config: ExperimentConfig
  model_dir: str
  mode: str
  cluster: cluster_lib.Cluster
  strategy: Any
  strategy_plan: strategy_lib.StrategyPlan
  write_plan: outputs.WritePlan
  task: Any
  train_plan: data_lib.InputPlan | None
  eval_plan: data_lib.InputPlan | None
  eval_dataset: Any
  trainer: Any
  hooks: Any = None  # controller.Controller's extras (tfdp.fit's Keras callbacks)

  @property
  def replicas(self) -> int:
    return self.strategy.num_replicas_in_sync

  def train_dataset_fn(self, start_step: int = 0, epochs: int | None = None):
    """The per-pipeline training dataset function from `start_step` on (a resumed run sees
    exactly the batches it would have seen), for `epochs` passes over the data (default: as
    many as the run's steps take; more than trainer.epochs when trainer.steps_per_epoch is
    longer than a pass)."""
    passes = -(-self.trainer.total_steps // self.train_plan.steps_per_epoch)
    return data_lib.make_dataset_fn(self.train_plan, self.config.task.train_data, self.task,
                                    training=True, seed=self.config.trainer.seed,
                                    epochs=epochs or passes, start_step=start_step)

  def train_dataset(self, start_step: int, epochs: int | None = None):
    return self.strategy.distribute_datasets_from_function(
        self.train_dataset_fn(start_step, epochs))

  def evaluate(self):
    with self.trainer.evaluation_weights():
      return self.trainer.evaluate(self.eval_dataset, self.eval_plan.steps_per_epoch)

  def run(self) -> dict:
    """Trains and/or evaluates as `mode` says; returns the final metrics (and the trainer)."""
    trainer, cluster = self.trainer, self.cluster
    result: dict = {"model_dir": self.model_dir, "replicas": self.replicas,
                    "strategy": self.strategy_plan.kind}
    try:
      from tfdp.core import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
      with trainer_lib.tensor_conditions_named(), run_errors.peer_loss_restarts_the_group(
          cluster.is_multi_worker):  # the first steps are traced here
        if self.mode == "eval":
          evaluated = self.evaluate()
          result.update(step=trainer.global_step, eval_examples=int(evaluated.examples),
                        **{f"eval_{name}": value for name, value in evaluated.values().items()})
          if cluster.is_chief:  # with what it evaluated (a probe: another split's overwrote it)
            data = dataclasses.asdict(self.config.task.eval_data)
            where = ("name", "data_dir") if data["source"] == "tfds" else ("path",)
            evaluated_data = {k: data[k] for k in ("source", *where, "split", "holdout_fraction")
                              if data[k]}
            outputs.atomic_write_text(self.write_plan.path("eval.json"), json.dumps(
                {**result, "eval_data": evaluated_data}, indent=2))
        else:
          from tfdp.core import controller  # pylint: disable=g-import-not-at-top  (imports TF)
          start = trainer.global_step
          if start >= trainer.total_steps:  # replicas= is this group's: it trained nothing
            result["trained"] = f"nothing (finished at step {start}; {errors.terms().evaluate_it})"
          result.update(controller.Controller(
              trainer, self.train_dataset, self.eval_dataset,
              self.eval_plan.steps_per_epoch if self.eval_plan else 0, hooks=self.hooks).run())
          result["step"] = trainer.global_step
          kept = (outputs.kept_export(self.write_plan, trainer.manager.latest_checkpoint)
                  if trainer.global_step == start else None)
          if self.config.trainer.export_model and kept:  # a finished run's, of these weights
            result["exported"] = kept
          elif self.config.trainer.export_model:
            with trainer.evaluation_weights():
              result["exported"] = outputs.export_model(self.write_plan, trainer.model)
    except run_errors.data_errors() as e:
      raise run_errors.bad_data(e, self._find_unreadable()) from None
    finally:
      self.write_plan.cleanup()
    cluster_lib.leave_together(cluster, self.config.runtime.heartbeat_timeout_seconds)
    result["trainer"] = trainer
    return result

  def _find_unreadable(self) -> str | None:
    """tf.data's decode errors name no file: ask the sources which one fails on its own."""
    for plan in (self.train_plan, self.eval_plan):
      if plan is not None and plan.source.find_unreadable is not None:
        culprit = plan.source.find_unreadable()
        if culprit:
          return culprit
    return None


def build(config: ExperimentConfig, model_dir: str, mode: str = "train_and_eval", *,
          cluster: cluster_lib.Cluster | None = None, train_source: data_lib.Source | None = None,
          eval_source: data_lib.Source | None = None, model_fn=None, strategy=None,
          task=None, verbose: bool = True, start_over: bool = False) -> Experiment:
  """config → cluster → strategy → data → task/model → trainer, in order. Sources, model_fn,
  strategy and the task itself may be given directly (the library API); otherwise the config's
  task builds them.
  `start_over` moves an earlier run in model_dir aside (model_dir/previous-<time>/) instead of
  resuming it. Messages say their fixes in the caller's terms (errors.terms()). Nothing in
  model_dir changes until every check has passed."""
  cluster = cluster or cluster_lib.resolve_cluster()
  model_dir, prior, init = preflight(config, model_dir, mode, cluster,
                                     check_data=train_source is None, start_over=start_over,
                                     task=task)
  if verbose:  # only now: a start refused above makes no folder
    logging.info("outputs: %s (%s)", model_dir, "eval.json" if mode == "eval" else
                 "metrics.csv, metrics.png, checkpoints/, TensorBoard: tensorboard --logdir "
                 + model_dir)
  logs.start_tensorflow()  # only now: a bad input above was answered in a second, not in four
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # Sources, tokenizers and model stems map datasets while building: traced without autograph
  # too (see tfdp/core/trainer.py).
  from tfdp.core import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  with trainer_lib.tensor_conditions_named(), run_errors.peer_loss_restarts_the_group(
      cluster.is_multi_worker):
    built = tf.autograph.experimental.do_not_convert(_build_checked)(
        config, model_dir, mode, cluster, prior, init=init, train_source=train_source,
        eval_source=eval_source, model_fn=model_fn, strategy=strategy, task=task, verbose=verbose,
        start_over=start_over)
  return built


def _build_checked(config: ExperimentConfig, model_dir: str, mode: str,
                   cluster: cluster_lib.Cluster, prior: resume.Prior, *, init: str | None,
                   train_source, eval_source, model_fn, strategy, task, verbose: bool,
                   start_over: bool) -> Experiment:
  """`build` after preflight, with TensorFlow started. `init`: the warm start's checkpoint that
  preflight found and checked. `start_over`: move the earlier run aside instead of resuming it."""
  if strategy is None:
    strategy, plan = strategy_lib.make_strategy(config.runtime, cluster)
  else:  # the library API: the user made it first, before loading data started TensorFlow
    precision, why = strategy_lib.resolve_precision(config.runtime.mixed_precision)
    made = strategy_lib.plan_of(strategy)  # tfdp.make_strategy's: what it reduces with
    plan = dataclasses.replace(made or strategy_lib.StrategyPlan(kind=type(strategy).__name__),
                               kind=type(strategy).__name__, precision=precision,
                               precision_reason=why)
    config = dataclasses.replace(config, runtime=strategy_lib.runtime_of(strategy,
                                                                          config.runtime))
  replicas = strategy.num_replicas_in_sync
  strategy_lib.check_jit_compile(config.runtime, replicas)
  if cluster.is_multi_worker:
    _check_workers_agree(config, model_dir, cluster, strategy, plan)
  if verbose:  # one line per process: under the launcher every worker's is prefixed
    print(cluster_lib.summary_line(cluster, replicas,
                                   plan.all_reduce or plan.cross_device_ops or "none"), flush=True)

  if task is None:
    task = tasks.make_task(config.task, max(cluster.rank, 0), max(cluster.num_workers, 1))
  else:
    task.worker, task.num_workers = max(cluster.rank, 0), max(cluster.num_workers, 1)
  data_cfg, trainer_cfg = config.task, config.trainer
  num_pipelines = max(cluster.num_workers, 1)
  train_plan = eval_plan = eval_dataset = split = None
  if mode != "eval":
    train_source = train_source or tasks.built_source(task, data_cfg.train_data)
    sharding = data_lib.resolve_shard_policy(  # a resume reads as its run did, on any count
        data_cfg.train_data.shard_policy, train_source, num_pipelines,
        (prior.record or {}).get("sharding"), cluster.may_resize and prior.checkpoint is None)
    if prior.record:  # before the plan: on a resume the recorded run decides the accumulation
      split = _batch_split(config, model_dir, prior, replicas, cluster, sharding)
      config = _with_accumulation(config, split)  # config.yaml records what trains
    train_plan = data_lib.plan_input(train_source, data_cfg.train_data,
                                     trainer_cfg.global_batch_size, replicas, num_pipelines,
                                     accumulation_steps=(split.accumulation if split else
                                                         trainer_cfg.gradient_accumulation_steps),
                                     local_counts=_local_counts(train_source, cluster, config,
                                                                "train_counts"), policy=sharding)
    data_lib.log_plan("train", train_plan)
    if train_plan.policy == "local":  # a resume reads the run's shards, however mapped
      local_shards.check_resumed_shards(prior.record,
                                        train_plan.shard_counts, num_pipelines,
                                        "task.train_data", model_dir)
  if mode != "train":
    eval_source = (eval_source if eval_source is not None
                   else tasks.built_source(task, data_cfg.eval_data))
    if train_plan is not None:
      check_eval_fits_model(model_input(train_plan.source), eval_source, "task.train_data's")
    elif prior.model_input:  # an evaluation: the checkpoint's model was built for these
      check_eval_fits_model(prior.model_input, eval_source, "the trained run's")
    eval_plan = data_lib.plan_input(eval_source, data_cfg.eval_data,
                                    trainer_cfg.eval_batch_size or trainer_cfg.global_batch_size,
                                    replicas, num_pipelines, batch_key="trainer.eval_batch_size",
                                    local_counts=_local_counts(eval_source, cluster, config,
                                                               "eval_counts"))
    data_lib.log_plan("eval", eval_plan)
    eval_dataset = strategy.distribute_datasets_from_function(data_lib.make_dataset_fn(
        eval_plan, data_cfg.eval_data, task, training=False, seed=trainer_cfg.seed))

  run_record = (_run_record(config, train_plan, cluster, replicas, plan.precision)
                if train_plan else None)
  if run_record and prior.record:  # no record: a run from before records, resumed as it is
    # before anything is written: a refused resume leaves model_dir as it was
    resume.check_resume(prior.record, run_record, model_dir, prior.checkpoint,
                        trainer_cfg.max_steps)
    _check_precision_kept(prior.record, run_record, plan, model_dir)
  write_plan = outputs.write_plan(model_dir, cluster.is_chief, cluster.rank)
  if cluster.is_chief:  # every input is checked: the run's folder may now exist
    outputs.create_model_dir(model_dir)
  moved = None  # a start that fails from here (a model Keras rejects, workers that disagree)
  try:  # releases its lock and leaves the folder as it found it, a moved-aside run put back
    if start_over and cluster.is_chief:  # before the checkpoint manager reads the directory
      moved = resume.move_run_aside(
          model_dir, task.artifacts(train_plan.source) if train_plan else ())
      if moved:
        logging.warning(errors.terms().moved_aside, model_dir, moved)
    from tfdp.core import trainer as trainer_lib  # pylint: disable=g-import-not-at-top  (imports TF)
    from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
    compat.set_random_seed(trainer_cfg.seed)
    batch_plan = train_plan or eval_plan  # the model is built for its source
    task.restoring = prior.checkpoint is not None
    trainer = trainer_lib.Trainer(config, strategy, write_plan,
                                  model_fn or (lambda: task.build_model(batch_plan.source)), task,
                                  global_batch=batch_plan.global_batch,
                                  steps_per_epoch=epoch_steps(config, train_plan) if train_plan else 1,
                                  accumulation_steps=batch_plan.accumulation_steps,
                                  precision=plan.precision, verbose=verbose)
    resume.check_state_kept(prior.record, trainer.state_fields(), model_dir)
    restored_step = trainer.restore(prior.checkpoint, to_evaluate=mode == "eval")
    if cluster.is_multi_worker:  # before anything is written and before the first training step
      resume.check_workers_restored_alike(config, model_dir, cluster, restored_step, prior,
                                          {"train": train_plan, "eval": eval_plan}, trainer.model)
    trainer.run_record = run_record and {**run_record, **trainer.state_fields()}
    trainer.run_record_from_step = restored_step
    trainer.prior_record = prior.record
    finished = mode != "eval" and restored_step >= trainer.total_steps  # nothing will train
    if split and restored_step and split.changed:
      line = split.line(restored_step, finished)
      if verbose and cluster.is_chief:  # beside the summary line: what the new group changed
        print(line, flush=True)
      else:
        logging.info("%s", line)
    if init and not restored_step:  # a fresh run: warm start
      task.warm_start(init)
      logging.info("warm start: restored from %s (task.init_checkpoint)", init)
      warm_start.say_raw_weights(init)
    config_text = config_lib.dump_yaml(config, task.recorded_config)
    if finished:
      outputs.keep_config(write_plan, config_text)
    elif mode != "eval":  # every check passed: now the run may write (an evaluation leaves
      outputs.write_config(write_plan, config_text, resuming=bool(restored_step))
      if cluster.is_chief:
        for name, text in task.artifacts(train_plan.source).items():
          outputs.atomic_write_text(write_plan.path(name), text)
    return Experiment(config, model_dir, mode, cluster, strategy, plan, write_plan, task,
                      train_plan, eval_plan, eval_dataset, trainer)
  except BaseException:
    try:
      if moved:
        resume.put_run_back(model_dir, moved)
    finally:
      write_plan.cleanup()
    raise


def model_input(source: data_lib.Source) -> dict:
  """What the model is built for, from its training source: recorded in the run record, so that
  an evaluation of the run (no training source) can check its data against it."""
  return {key: value for key, value in (
      ("image_shape", list(source.image_shape) if source.image_shape else None),
      ("num_classes", source.num_classes)) if value}


def check_eval_fits_model(built_for: dict, evaluation: data_lib.Source, whose: str) -> None:
  """The model is built for the training source (`built_for`: model_input): evaluation images
  of another shape, or labels past its classes, would stop the first evaluation with a Keras
  shape error or an out-of-range label, after a whole epoch of training, or (a model that pools
  any size, restored for --mode=eval) score images it never saw at that size, silently."""
  image_shape, num_classes = built_for.get("image_shape"), built_for.get("num_classes")
  if image_shape and evaluation.image_shape and (
      tuple(image_shape) != tuple(evaluation.image_shape)):
    shape = lambda s: "x".join(str(d) for d in s)
    height, width, channels = tuple(image_shape)[-3:]
    if channels != evaluation.image_shape[-1]:  # no resize changes channels
      fix = f"evaluate on images of {channels} channel(s), as the model was built for"
    elif height == width:
      fix = f"set task.eval_data.image_size={height}"
    else:
      fix = "give both images of one shape (task.*_data.image_size resizes both)"
    raise DataError(f"task.eval_data gives {shape(evaluation.image_shape)} images, but the model "
                    f"is built for {whose} {shape(image_shape)}; {fix}.")
  if num_classes and evaluation.num_classes > num_classes:
    raise DataError(f"task.eval_data has {evaluation.num_classes} classes, but the model is "
                    f"built for {whose} {num_classes}; evaluate on data of the "
                    "training classes.")


def run(config: ExperimentConfig, model_dir: str, mode: str = "train_and_eval", **kwargs) -> dict:
  """Builds the experiment and runs it: see `build` for the arguments."""
  return build(config, model_dir, mode, **kwargs).run()


def epoch_steps(config: ExperimentConfig, plan: data_lib.InputPlan) -> int:
  """An epoch's steps (its evaluation, checkpoint and metrics row): trainer.steps_per_epoch, or
  one pass over the training data. The data streams on across passes either way: step k reads
  the k-th global batch of the passes' orders."""
  return config.trainer.steps_per_epoch or plan.steps_per_epoch


def _run_record(config: ExperimentConfig, plan: data_lib.InputPlan, cluster: cluster_lib.Cluster,
                replicas: int, precision: str) -> dict:
  """What a step of this run means (resume.check_resume compares it), and the group taking it."""
  trainer_cfg = config.trainer
  total_steps = trainer_cfg.epochs * epoch_steps(config, plan)  # as the Trainer counts them
  if trainer_cfg.max_steps:
    total_steps = min(total_steps, trainer_cfg.max_steps)
  # the fields preflight compares before the data is planned, under the same names
  decided = resume.config_decided_fields(plan.global_batch, trainer_cfg.seed,
                                         config.task.train_data.shard_policy)
  stream, train = plan.source.info.get("stream_epoch_examples"), config.task.train_data
  return {**decided, "steps_per_epoch": epoch_steps(config, plan) if stream else plan.steps_per_epoch,
          "examples_per_epoch": stream or (sum(plan.counts) if plan.policy == "local"  # own
                                           else plan.source.num_examples),
          "epoch_steps": epoch_steps(config, plan),
          "gradient_accumulation_steps": plan.accumulation_steps,
          "per_replica_batch": plan.per_replica_batch, "sharding": plan.policy,
          **({"shard_counts": list(plan.shard_counts)} if plan.policy == "local" else {}),
          "schedule": trainer_cfg.learning_rate.schedule, "epochs": trainer_cfg.epochs,
          "lookahead_every_steps": trainer_cfg.lookahead_every_steps,
          "total_steps": total_steps, "workers": max(cluster.num_workers, 1), "replicas": replicas,
          "precision": precision, "all_reduce_dtype": config.runtime.all_reduce_dtype,
          "model_input": model_input(plan.source), "data_order": resume.data_order(plan, train)}


# The run record's numerics fields, and the config key that sets each.
PRECISION_FIELDS = {"precision": "runtime.mixed_precision",
                    "all_reduce_dtype": "runtime.all_reduce_dtype"}


def _check_precision_kept(record: dict, current: dict, plan: strategy_lib.StrategyPlan,
                          model_dir: str) -> None:
  """A resume computes in the precision the run trained in. A step would still mean the same
  examples in another one, but the run would no longer train as if never stopped, and the
  change is easy to make unasked: a resume command without the first one's override, or
  `auto` deciding anew on a host without native bfloat16. Refused, naming the key to set."""
  changed = [(field, key) for field, key in PRECISION_FIELDS.items()
             if field in record and record[field] != current[field]]
  if not changed:
    return
  why = f" ({plan.precision_reason})" if plan.precision_reason else ""
  said = "; ".join(f"{key} was {record[field]}, now {current[field]}"
                   f"{why if field == 'precision' else ''}" for field, key in changed)
  fix = " and ".join(f"{key}={record[field]}" for field, key in changed)
  raise OutputError(f"{errors.terms().model_dir} '{model_dir}' holds a run this config would "
                    f"resume in another precision: {said}. A resume keeps the run's numerics; set "
                    f"{fix} to go on as it trained, or {errors.terms().start_over}.")


def _batch_split(config: ExperimentConfig, model_dir: str, prior: resume.Prior, replicas: int,
                 cluster: cluster_lib.Cluster, sharding: str | None,
                 say: bool = True) -> resume.BatchSplit | None:
  """How a resume splits the recorded run's global batch on this group (None: no record);
  `say`: log the accumulation it takes (the build does; the checks before TF run it too).

  Why another worker count trains on the same examples in every step: under shard_policy
  data (or off, one pipeline) every pipeline shuffles the same source with the same seed, and
  pipeline p of n takes elements p, p+n, ... of that order (data.make_dataset_fn), a step's
  worth (step_batch = global batch / n) at a time. Global step k therefore covers elements
  [k * global_batch, (k+1) * global_batch) of the epoch's order, whatever n, replicas per
  pipeline or accumulation; a resume skips the first start_step * global_batch of them. The
  examples are only assigned to other replicas and micro-steps, and the gradient is their sum
  over the global batch: the same step, up to float summation order. Each example's
  augmentation seed is its position in that order, not its pipeline's. Steps per epoch are
  ceil(examples / global_batch) for every n. A global batch no replica count divides is split
  unevenly: pipelines read unequal shares of the same block, and every replica's batch is
  padded to the larger share with weight-0 rows. File shards (and TFDS splits) are made per
  group instead: resume.resume_batch_split refuses those mid-epoch, and this an uneven split
  of them."""
  if not prior.record:
    return None
  config_accumulation = config.trainer.gradient_accumulation_steps
  split = resume.resume_batch_split(prior.record, model_dir, config.trainer.global_batch_size,
                                     replicas, max(cluster.num_workers, 1), sharding,
                                     outputs.checkpoint_step(prior.checkpoint),
                                     config.trainer.max_steps)
  if (split and sharding and sharding not in data_lib.UNEVEN_POLICIES
      and split.global_batch % (split.replicas * split.accumulation)):
    raise OutputError(
        f"{errors.terms().model_dir} '{model_dir}' holds a run with global batch "
        f"{split.global_batch}, which does not split evenly over {replicas} replicas, and its "
        f"shard policy {sharding} cannot split it unevenly (each worker reads its own shard, not "
        f"its share of one order); resume on a replica count that divides {split.global_batch}, or "
        f"{errors.terms().start_over}.")
  if say and split and split.accumulation != config_accumulation:
    logging.info("resume: gradient_accumulation_steps %d (the recorded run's split on %d "
                 "replicas), not the config's %d, which is for a fresh run", split.accumulation,
                 replicas, config_accumulation)
  return split


def _with_accumulation(config: ExperimentConfig,
                       split: resume.BatchSplit | None) -> ExperimentConfig:
  if split is None:
    return config
  return dataclasses.replace(config, trainer=dataclasses.replace(
      config.trainer, gradient_accumulation_steps=split.accumulation))


def _check_saved_artifacts(task_class, task_config: TaskConfig, model_dir: str, mode: str,
                           resume_from: str | None, init: str | None) -> None:
  """A resume, an evaluation or a warm start must read its data as the run it continues did (a
  recommender's id mapping): the task compares, before TensorFlow starts and anything is
  written."""
  if resume_from:
    context = (tasks.SavedRunUse("--mode=eval", "evaluate with the files it was trained with")
               if mode == "eval" else tasks.SavedRunUse(
                   "resume", f"{errors.terms().start_over}, or use a new "
                   f"{errors.terms().model_dir}"))
    task_class.check_saved_artifacts(task_config, model_dir, context)
  elif init:  # a fresh run: warm start from another run's weights (found by preflight)
    task_class.check_saved_artifacts(task_config, warm_start.run_folder(init), tasks.SavedRunUse(
        f"warm start from task.init_checkpoint '{init}'",
        "drop task.init_checkpoint to train from scratch", warm_start=True))


def _local_counts(source: data_lib.Source, cluster: cluster_lib.Cluster, config: ExperimentConfig,
                  topic: str) -> list | None:
  """Every worker's (shard indices, examples per shard) of a source each reads alone, in rank
  order."""
  if source.kind != "local" or not cluster.is_multi_worker:
    return None
  counts = cluster_lib.exchange(cluster, [list(source.shards), source.file_counts],
                                config.runtime.heartbeat_timeout_seconds, topic)
  logging.info("data: (shards, examples) per worker %s (%s)", counts, topic)
  return counts


def _check_workers_agree(config: ExperimentConfig, model_dir: str, cluster: cluster_lib.Cluster,
                         strategy, plan: strategy_lib.StrategyPlan) -> None:
  """Before the first collective: every worker has the same device count, all-reduce and config
  (one small exchange through the coordination service)."""
  fields = strategy_lib.config_fields(config_lib.config_to_json(config), model_dir)
  mine = strategy_lib.worker_plan(plan, len(strategy.extended.worker_devices), fields)
  strategy_lib.check_workers_agree(cluster_lib.exchange(
      cluster, mine, config.runtime.heartbeat_timeout_seconds, topic="plan"))

