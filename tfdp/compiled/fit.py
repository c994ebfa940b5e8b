"""`tfdp.fit(model, x, y, ...)`: what `model.fit` takes, trained by tfdp's engine.

    import tfdp
    strategy = tfdp.make_strategy()          # first: devices are fixed when TF starts
    with strategy.scope():
      model = build_model()
      model.compile(optimizer=..., loss=..., metrics=[...])
    history = tfdp.fit(model, x, y, batch_size=256, epochs=5, validation_data=(x_val, y_val))

What compile() says is what trains: no learning-rate scaling, warmup, weight decay,
augmentation or normalization is added. `batch_size` is the global batch. The model stays a
Keras model afterwards (`model.evaluate`, `model.predict`, `model.save` in the same process);
`tfdp.evaluate` and `tfdp.predict` are their exact, distributed forms (any worker count).
"""
from __future__ import annotations

import functools
import os
import weakref

from absl import logging

from tfdp import config as config_lib
from tfdp import errors
from tfdp import in_process
from tfdp import logs
from tfdp.compiled import callbacks as callbacks_lib
from tfdp.compiled import inputs as inputs_lib
from tfdp.compiled.copies import check_clone_computes_alike  # noqa: F401 (its callers' name)
from tfdp.core import outputs
from tfdp.core import resume
from tfdp.errors import ConfigError

DEFAULT_RUNS = "tfdp_runs"  # model_dir=None: tfdp_runs/<model name>, a fresh run each time


def strategy_for(model, strategy):
  """The strategy the model's variables live in; a model built outside it is cloned into it
  (Keras can clone functional and Sequential models), with its weights. Returns (strategy,
  model to run, the user's model or None when no copy is needed). Errors are said as the
  function the user called (errors.terms())."""
  caller = errors.terms().caller
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  given = strategy is not None
  strategy = strategy or strategy_lib.last_made()
  if not isinstance(model, keras.Model):
    if not callable(model):
      raise ConfigError(f"{caller}: model is a {type(model).__name__}; pass a compiled "
                        "keras.Model or a function that returns one.")
    if strategy is None:  # as tfdp.make_strategy() with no arguments
      from tfdp.distributed import cluster  # pylint: disable=g-import-not-at-top
      strategy = strategy_lib.make_strategy(config_lib.RuntimeConfig(), cluster.resolve_cluster(),
                                            for_user=True)[0]
    with strategy.scope():
      built = model()
    if not isinstance(built, keras.Model):
      raise ConfigError(f"{caller}: the model function returned a {type(built).__name__}; return "
                        "a compiled keras.Model.")
    return strategy, built, None
  if strategy is None:
    if os.environ.get("TF_CONFIG"):
      raise ConfigError(f"{caller}: TF_CONFIG names a cluster, but no tfdp strategy was made; "
                        "call strategy = tfdp.make_strategy() first and build and compile the "
                        "model under `with strategy.scope():`.")
    strategy = tf.distribute.get_strategy()
  if not model.weights:  # not built yet (a subclassed model): built on the first batch, in scope
    return strategy, model, None
  if all(compat.created_in_scope(strategy, v) for v in model.weights):
    return strategy, model, None
  own = strategy_lib.strategy_of(model.weights) if not given else None
  if own is not None:  # built in the scope of one made before the last (tfdp.train makes one)
    return own, model, None
  # An uncompiled model predicts (Keras's predict needs no compile); evaluate and fit say it.
  compiled = getattr(model, "compiled", False)
  # outside the try: a changed Keras is said as such
  users_objects = _users_objects(model) if compiled else {}
  try:  # the optimizer and metrics hold variables: rebuilt in the scope, the user's by name
    with strategy.scope(), keras.saving.custom_object_scope(users_objects):
      clone = keras.models.clone_model(model)
      clone.set_weights(model.get_weights())
      copy_seed_states(model, clone)
      for layer in _all_layers(clone):  # an adapted Normalization's mean, from its weights,
        if isinstance(layer, keras.layers.Normalization):  # as Keras's loading does (not every
          layer.finalize_state()  # layer's: a Discretization's would rebuild from no summary)
      if compiled:
        arguments, rebuilt = _rebuilt_compile_arguments(model, clone)
  except Exception as e:  # pylint: disable=broad-except  (Keras: subclassed, custom objects)
    if isinstance(e, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError)):
      raise errors.GroupMustRestart(  # the copy's variables are made with every worker (a probe)
          f"{caller}: a peer worker did not join the copy of the model into the strategy's "
          f"scope ({type(e).__name__}): every worker must make the same calls (tfdp.fit, "
          "tfdp.evaluate, tfdp.predict) in the same order; see the peer's error line.") from None
    raise ConfigError(
        f"{caller}: the model was built outside the strategy's scope and Keras cannot clone it "
        f"into it ({type(e).__name__}); build and compile it under `with "
        "tfdp.make_strategy().scope():`, or pass a function that returns the compiled model."
    ) from None
  if compiled:
    for original, copy in rebuilt:  # outside the try: a setting lost is its own line
      _check_rebuilt_alike(original, copy, caller)
    with strategy.scope():
      clone.compile(**arguments)
  return strategy, clone, model


def _rebuilt_compile_arguments(model, clone):
  """compile()'s arguments for the clone: the user's own losses as given (a loss holds no
  variables; rebuilt from its config, Huber(delta=0.3) came back with delta 1.0), a fresh
  optimizer and metrics from their configs (they hold variables, which must be the scope's),
  each with what its config drops carried (compat.carry_lost_settings). Returns (arguments,
  [(the user's object, its rebuilt copy)])."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  arguments, rebuilt = compat.compile_arguments(model), []

  def rebuild(leaf):  # as compile_from_config does (optimizers.deserialize made Lamb a str)
    if not isinstance(leaf, (keras.metrics.Metric, keras.optimizers.Optimizer)):
      return leaf  # a name or a function: compile() makes it in the scope
    copy = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(leaf))
    compat.carry_lost_settings(leaf, copy, model.weights, clone.weights)
    rebuilt.append((leaf, copy))
    return copy

  arguments["optimizer"] = rebuild(arguments["optimizer"])
  for key in ("metrics", "weighted_metrics"):
    if arguments.get(key) is not None:
      arguments[key] = keras.tree.map_structure(rebuild, arguments[key])
  return arguments, rebuilt


def copy_seed_states(source, target) -> None:
  """Random layers' seed states (Dropout's SeedGenerator), which get_weights leaves out: a copy
  made in the scope drew new ones, so one seed trained another Dropout sequence there than in
  a model built in the scope (a probe), and the user's model did not go on from training's."""
  from tfdp.core import model_walk  # pylint: disable=g-import-not-at-top
  mine, theirs = model_walk.seed_states(source), model_walk.seed_states(target)
  if len(mine) == len(theirs):
    for state, copy in zip(mine, theirs):
      copy.assign(state.value)


def _all_layers(model):
  for layer in model.layers:
    yield layer
    if hasattr(layer, "layers"):  # a nested model
      yield from _all_layers(layer)


_SETTINGS = (int, float, str, bool, type(None))


def _check_rebuilt_alike(original, copy, caller: str) -> None:
  """The clone's optimizer and metrics are rebuilt by from_config(get_config()), which drops
  what a class's get_config does not return (BoostedSGD(boost=10) trained as boost 1.0,
  silently); refused, naming the setting."""
  import keras  # pylint: disable=g-import-not-at-top
  keras_own = _keras_own_attributes(isinstance(original, keras.optimizers.Optimizer))
  rebuilt = getattr(copy, "__dict__", {})
  for name, value in getattr(original, "__dict__", {}).items():
    if name in keras_own or not _is_setting(value) or value in ([], (), {}, set()):  # state
      continue
    if name not in rebuilt or rebuilt[name] != value:
      raise ConfigError(
          f"{caller}: the model was built outside the strategy's scope, and the copy made in it "
          f"would rebuild {type(original).__name__} from its get_config(), which loses "
          f"{name}={value!r}; return it from get_config(), or build and compile the model "
          "under `with tfdp.make_strategy().scope():`.")


@functools.cache
def _keras_own_attributes(optimizer: bool) -> frozenset:
  """What Keras's base Optimizer or Metric keeps on every instance (no setting of the user's),
  and what carry_lost_settings carries; found once (a base optimizer makes variables)."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  base = keras.optimizers.Optimizer(learning_rate=0.01) if optimizer else keras.metrics.Metric()
  return frozenset({k for k in vars(base) if k.startswith("_")} | {"name", "built"} |
                   set(compat.CARRIED_SETTINGS))


def _is_setting(value) -> bool:
  """A plain value (a number, a string, None) or a list, tuple, set or dict of them."""
  if isinstance(value, _SETTINGS):
    return True
  if isinstance(value, (list, tuple, set, frozenset)):
    return all(_is_setting(v) for v in value)
  if isinstance(value, dict):
    return all(_is_setting(k) and _is_setting(v) for k, v in value.items())
  return False


def _strategy_and_clone(model, strategy):
  """strategy_for, and a clone trains on from the user's optimizer state (a second fit)."""
  strategy, trained, users_model = strategy_for(model, strategy)
  if users_model is not None:
    _check_optimizer_builds(users_model)  # its state comes back into it after training
    with strategy.scope():
      copy_optimizer_state(users_model.optimizer, trained.optimizer, trained.trainable_variables)
    logging.warning("tfdp.fit: the model was built outside the strategy's scope: training a "
                    "clone made inside it; its weights and optimizer state are copied back into "
                    "your model afterwards")
  return strategy, trained, users_model


def _check_optimizer_builds(model) -> None:
  """The user's optimizer must hold state for their model's weights, as model.fit builds it
  first: one compiled in a strategy's scope but built for weights made outside it cannot (seen:
  a traceback once the whole run had trained, when its state was copied back)."""
  optimizer = getattr(model, "optimizer", None)
  if optimizer is None or optimizer.built:
    return
  try:
    optimizer.build(model.trainable_variables)
  except (RuntimeError, ValueError):
    raise ConfigError(
        "the model's optimizer cannot hold state for its weights: they were made "
        "outside the strategy's scope it was compiled in (model.fit refuses it too); build and "
        "compile the model in one place, e.g. both under tfdp.make_strategy().scope().") from None


def copy_optimizer_state(source, target, variables) -> None:
  """`source`'s state (iterations, slots, weight averages, a changed learning rate) into
  `target`, built for `variables` first: a clone trains on from where the user's optimizer was,
  and the user's goes on from the clone's, as one model.fit after another would."""
  if source is None or target is None or not source.built:
    return
  if not target.built:
    target.build(variables)
  pairs = list(zip(source.variables, target.variables))
  if len(source.variables) != len(target.variables) or any(
      tuple(a.shape) != tuple(b.shape) for a, b in pairs):
    logging.warning("tfdp.fit: the optimizer of the clone and of your model hold different "
                    "variables; its state was not copied (only the weights)")
    return
  for a, b in pairs:
    b.assign(a.numpy())


def compiled_outside(model, strategy) -> bool:
  """An unbuilt model compiled outside the strategy's scope: its optimizer cannot build in it
  ("Mixing different tf.distribute.Strategy objects")."""
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  variables = getattr(getattr(model, "optimizer", None), "variables", None)
  return bool(variables) and not compat.created_in_scope(strategy, variables[0])


def _users_objects(model) -> dict:
  """The user's own loss and metric functions and classes that compile() was given, under the
  names Keras's compile config looks them up by (unregistered, they would not deserialize)."""
  import inspect  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  objects = {}
  for leaf in keras.tree.flatten(compat.compile_arguments(model)):
    if inspect.isfunction(leaf):
      objects[leaf.__name__] = leaf
    elif (isinstance(leaf, (keras.losses.Loss, keras.metrics.Metric, keras.optimizers.Optimizer))
          and not type(leaf).__module__.startswith("keras.")):
      objects[type(leaf).__name__] = type(leaf)
  return objects


def _config(config_files, params, inputs, epochs: int, shuffle: bool, precision: str):
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  config = config_lib.load_config(list(config_files), in_process.overrides(params))
  config.task.name = "keras_model"
  config.task.model = config_lib.ModelConfig(name="keras_model")
  for data in (config.task.train_data, config.task.eval_data):
    data.source, data.augment, data.cache = "keras", False, False
  # Keras shuffles arrays, never a dataset (its order is the pipeline's): so does tfdp, seeded.
  config.task.train_data.shuffle = bool(shuffle) and inputs.from_arrays
  if shuffle == "batch" and inputs.from_arrays:  # Keras's HDF5 chunks: none here (a probe)
    logging.warning(errors.as_caller("shuffle='batch' shuffles every example here, as "
                                     "shuffle=True does (tfdp has no batch-chunk shuffle)"))
  if inputs.from_arrays and not config.task.train_data.shuffle_buffer:
    config.task.train_data.shuffle_buffer = inputs.train.num_examples  # Keras shuffles it all
  config.task.eval_flip, config.task.eval_translate, config.task.label_smoothing = False, 0, 0.0
  trainer = config.trainer
  users_seed = compat.seed_state()[0]  # keras.utils.set_random_seed's, as model.fit shuffles by
  if users_seed is not None and trainer.seed == config_lib.TrainerConfig().seed:  # not in params
    trainer.seed = int(users_seed)
  trainer.epochs, trainer.global_batch_size = epochs, inputs.global_batch
  trainer.eval_batch_size = inputs.validation_batch or inputs.global_batch
  # The compiled optimizer is the recipe: none of the config's schedule, decay, clip or EMA.
  trainer.learning_rate = config_lib.LearningRateConfig(schedule="constant")
  trainer.gradient_clip_norm, trainer.ema_decay, trainer.precise_bn_batches = 0.0, 0.0, 0
  trainer.lookahead_every_steps, trainer.optimizer.norm_bias_lr_multiplier = 0, 1.0
  config.runtime.mixed_precision = precision
  config_lib.validate(config)
  return config


def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1, *, model_dir=None, strategy=None,
        params="", config_files=()):
  """Trains a compiled Keras model as `model.fit` would, data-parallel; returns a
  `keras.callbacks.History` (its `.final` holds the last metrics, `.model_dir` the run).

  `model_dir`: checkpoints, metrics.csv, config.yaml and the exported model; the same
  model_dir again resumes (a finished run returns its history at once). None: tfdp_runs/<model
  name>, and each call starts a fresh run there (the earlier one is moved to
  tfdp_runs/<name>/previous-<time>/), as `model.fit` would train again; a restarted worker
  group (tfdp-launch --max_restarts) still resumes it."""
  whole = in_process.whole_number
  epochs = whole("epochs", epochs, minimum=0)  # 0: nothing trains, as in model.fit
  validation_freq = (tuple(whole("validation_freq's epochs", epoch) for epoch in validation_freq)
                     if isinstance(validation_freq, (list, tuple))  # Keras: an int or a list
                     else whole("validation_freq", validation_freq))
  if steps_per_epoch is not None:
    steps_per_epoch = whole("steps_per_epoch", steps_per_epoch)
  if initial_epoch:
    raise ConfigError("tfdp.fit: initial_epoch is decided by tfdp from model_dir's checkpoint; "
                      "drop it (pass the same model_dir to resume).")
  logs.start_tensorflow()
  # in tfdp.fit's words; the dtype policy and random streams are the user's again afterwards
  with errors.speaking_as(terms(fresh=model_dir is None)), in_process.users_state_kept():
    return _fit(model, x, y, batch_size, epochs, verbose, callbacks, validation_split,
                validation_data, shuffle, class_weight, sample_weight, steps_per_epoch,
                validation_steps, validation_batch_size, validation_freq, model_dir, strategy,
                params, config_files)


def terms(fresh: bool = False, caller: str = "tfdp.fit") -> errors.Terms:
  """The words of tfdp.fit (and of tfdp.evaluate, tfdp.predict) for the library's fixes: their
  arguments, not tfdp-train's flags."""
  return errors.Terms(
      caller, "model_dir", "pass model_dir=None to train a fresh run", "params", "config_files",
      "tfdp.fit: model_dir=None trains a fresh run, as model.fit trains again: the earlier run "
      "in %s was moved to %s (pass model_dir to resume a run instead)",
      "checkpoint saved in {model_dir}; to resume from it, pass model_dir='{model_dir}' to "
      "tfdp.fit" + (" (without it, tfdp.fit trains afresh)" if fresh else ""),
      "Check x and y for NaN or infinite values, or lower the learning rate given to compile(); "
      "params='trainer.stop_on_nan=false' trains on regardless",
      "pad every example to one length in x (keras.utils.pad_sequences(..., maxlen=n), or a "
      "dataset's padded_batch(..., padded_shapes=...) with fixed sizes); if they have one "
      "length that TensorFlow cannot see (from_generator, parsed text), say it: "
      "dataset.map(lambda x, y: (tf.ensure_shape(x, [n]), y))",
      evaluate_it="tfdp.evaluate evaluates it",
      data_order="fit's shuffle= and the kind of x (arrays or a dataset)",
      workers_seed_fix="set one keras.utils.set_random_seed on every worker: tfdp.fit shuffles "
      "arrays by it, and each worker must read its own share of one order",
      workers_config_fix="give every worker the same data (x, y, validation_data), arguments "
      "and {} to " + caller,
      workers_data_fix=f"every worker must pass the same data (x, y, validation_data) to {caller}")


def _fit(model, x, y, batch_size, epochs, verbose, callbacks, validation_split, validation_data,
         shuffle, class_weight, sample_weight, steps_per_epoch, validation_steps,
         validation_batch_size, validation_freq, model_dir, given_strategy, params, config_files):
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.compiled import task as task_lib  # pylint: disable=g-import-not-at-top
  from tfdp.core import optim  # pylint: disable=g-import-not-at-top
  if isinstance(model, keras.Model):  # before any clone: what cannot run is said first
    task_lib.check_compiled(model)
    optim.check_compiled_optimizer(getattr(model, "optimizer", None))
    _check_unchanged_since_its_run(model, model_dir)
  strategy, trained, users_model = _strategy_and_clone(model, given_strategy)
  optim.check_compiled_optimizer(getattr(trained, "optimizer", None))
  callbacks = callbacks_lib.check_callbacks(callbacks)
  if epochs == 0:  # refused before (a review): model.fit trains nothing and returns its History
    if not hasattr(x, "cardinality"):  # arrays checked as model.fit's data adapter checks them
      inputs_lib.make_inputs(x, y, batch_size=batch_size, sample_weight=sample_weight,
                             class_weight=class_weight, steps_per_epoch=steps_per_epoch,
                             model_input_ranks=inputs_lib.input_ranks(trained),
                             labels=task_lib.needs_labels(trained))
    return callbacks_lib.no_epochs(users_model or trained, callbacks, x, batch_size,
                                   steps_per_epoch, verbose, validation_freq)
  inputs = inputs_lib.make_inputs(
      x, y, batch_size=batch_size, sample_weight=sample_weight, class_weight=class_weight,
      validation_data=validation_data, validation_split=validation_split,
      steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
      validation_batch_size=validation_batch_size, epochs=epochs,
      model_input_ranks=inputs_lib.input_ranks(trained), labels=task_lib.needs_labels(trained))
  if not trained.weights:  # as keras.Model.fit builds it: on a batch, where it lives
    first = inputs_lib.first_examples(inputs.train, 1)
    if compiled_outside(trained, strategy):  # built outside, then cloned as any model built so
      trained(first["x"])
      strategy, trained, users_model = _strategy_and_clone(model, given_strategy)
    else:
      with strategy.scope():
        trained(first["x"])
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  if (strategy_lib.last_made() is None and not tf.distribute.has_strategy()
      and strategy is tf.distribute.get_strategy()):  # make_strategy() may give the default too
    logging.warning("tfdp.fit: no strategy was made, so this trains on one device; call "
                    "strategy = tfdp.make_strategy() first and build the model under `with "
                    "strategy.scope():` to train data-parallel")
  if users_model is not None:
    check_clone_computes_alike(users_model, trained,
                               inputs_lib.first_examples(inputs.train)["x"], errors.terms().caller)
  policy = keras.config.dtype_policy().name
  precision = policy if policy in ("float32", "mixed_bfloat16", "mixed_float16") else "float32"
  config = _config(config_files, params, inputs, epochs, shuffle, precision)
  config.trainer.eval_every_epochs = validation_freq if isinstance(validation_freq, int) else 1
  config.trainer.eval_at_end = False  # model.fit validates on validation_freq's epochs only
  config.trainer.steps_per_epoch = steps_per_epoch or 0  # 0: one pass over the data
  task = task_lib.CompiledModelTask(config.task).attach(trained, inputs)
  if getattr(trained, "run_eagerly", False):
    check_traces(trained, task.sample["x"])
  from tfdp.distributed import cluster  # pylint: disable=g-import-not-at-top
  start_over = model_dir is None and cluster.group_restart() is None
  model_dir = model_dir or os.path.join(DEFAULT_RUNS, trained.name)
  from tfdp.core import experiment  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top
  quiet = verbose == 0
  compiled_rate = _learning_rate(trained.optimizer)
  built = experiment.build(
      config, model_dir, "train" if inputs.validation is None else "train_and_eval",
      train_source=inputs.train, eval_source=inputs.validation, model_fn=lambda: trained,
      strategy=strategy, task=task, verbose=not quiet, start_over=start_over)
  restored_rate = _learning_rate(trained.optimizer)
  if compiled_rate != restored_rate:  # a resume restores the optimizer's state, its rate too
    logging.warning("tfdp.fit: resuming the run in %s with its optimizer's state: learning rate "
                    "%.6g (its checkpoint's), not compile()'s %.6g; to train with compile()'s, "
                    "pass another model_dir (or none: a fresh run)", built.model_dir,
                    restored_rate, compiled_rate)
  # As Keras's fit with a use_ema optimizer: validation sees the raw weights, and the weights
  # become their moving average when training ends (also the export and the user's model).
  built.trainer.raw_weights_evaluated = True
  finalized = []

  def finalize():
    if not finalized:
      finalized.append(True)
      with strategy.scope():  # cross-replica: every copy of a mirrored weight
        trained.optimizer.finalize_variable_values(trained.trainable_variables)
  # The callbacks act on the model that trains (a learning-rate change, restored best weights),
  # as in model.fit; a clone's weights go back to the user's model afterwards.
  hooks = callbacks_lib.KerasCallbacks(callbacks, trained, epochs, built.trainer.steps_per_epoch,
                                       verbose, finalize, validation_freq)
  built.hooks = hooks
  if hooks.terminate_on_nan and not config.trainer.stop_on_nan:
    logging.warning("tfdp.fit: TerminateOnNaN does nothing with trainer.stop_on_nan=false: "
                    "tfdp checks no loss, and non-finite epochs train on")
  try:
    try:
      result = built.run()
    except errors.TrainingDiverged as diverged:
      result = hooks.diverged(diverged)  # a TerminateOnNaN's graceful end; else raised
      if result is None:
        raise
    finalize()  # a finished run, trained before: its weights as its fit left them
  finally:
    compat.restore_optimizer_all_reduce(trained.optimizer)
    if users_model is not None:
      users_model.set_weights(trained.get_weights())
      copy_seed_states(trained, users_model)
      copy_optimizer_state(trained.optimizer, users_model.optimizer,
                           users_model.trainable_variables)
      users_model.stop_training = trained.stop_training  # an EarlyStopping's stop, as Keras's
    _HANDED_BACK[users_model or trained] = (os.path.realpath(built.model_dir),
                                            resume.weights_digest(users_model or trained))
  from tfdp.core import controller  # pylint: disable=g-import-not-at-top
  if "trainer" in result:  # not after a TerminateOnNaN's end
    controller.release_in_background(result.pop("trainer"))
  return _history(hooks, result, built.model_dir, users_model or trained, epochs, inputs, verbose)


# A model's weights as tfdp.fit left them, with its run's model_dir: that model_dir resumes
# the run from its checkpoint, which would replace weights trained (or loaded) since.
_HANDED_BACK = weakref.WeakKeyDictionary()


def _check_unchanged_since_its_run(model, model_dir) -> None:
  """The same model_dir again resumes its run, restoring the checkpoint over the model: after a
  model.fit (or a load_weights) since tfdp.fit handed it back, those weights were lost, silently
  (a probe: accuracy 0.929 → 0.221)."""
  handed = _HANDED_BACK.get(model)
  if model_dir is None or handed is None or handed[0] != os.path.realpath(model_dir):
    return
  if resume.weights_digest(model) != handed[1]:
    raise ConfigError(
        f"tfdp.fit: the model's weights changed since its run in {model_dir} handed them back "
        "(trained or loaded since), and that model_dir resumes the run from its checkpoint, "
        "which would replace them; pass another model_dir (or none: a fresh run) to train on "
        "from these weights.")


def _learning_rate(optimizer) -> float | None:
  """The optimizer's learning rate as a number; None for a schedule (a function of the step)."""
  rate = optimizer.get_config().get("learning_rate") if optimizer is not None else None
  return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None


def check_traces(model, x) -> None:
  """compile(run_eagerly=True): tfdp traces its steps all the same; a call() that needs eager
  execution is said in one line before anything runs, not deep in the traced loop."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.compiled import task as task_lib  # pylint: disable=g-import-not-at-top
  logging.warning("%s: the model is compiled with run_eagerly=True; tfdp runs it compiled "
                  "(its steps traced, as Keras does without run_eagerly)", errors.terms().caller)
  try:
    tf.function(lambda x: model(x, training=True), autograph=False).get_concrete_function(x)
  except Exception as e:  # pylint: disable=broad-except  (whatever call() does eagerly only)
    said = task_lib.keras_error_line(e) if str(e).strip() else ""
    raise ConfigError(
        f"the model is compiled with run_eagerly=True and its call() fails when traced "
        f"({type(e).__name__}: {said[:200]}); tfdp runs it compiled: make call() "
        "graph-friendly (keras.ops or tf.cond, no Python on tensor values), or debug it eagerly "
        "with model.fit.") from None


def _history(hooks, result: dict, model_dir: str, model, epochs: int, inputs, verbose):
  """Keras's History: from this call's epochs, or for a run that had finished already (nothing
  trained now) from its metrics.csv, so a re-run returns its epochs, never nothing. `result`
  holds the last row either way (the controller reads a finished run's, its counts as ints)."""
  history = hooks.history
  if not history.history:
    rows = _read_rows(model_dir)
    history.epoch = [int(r["epoch"]) - 1 for r in rows]
    for row in rows:
      for key, value in callbacks_lib.keras_logs(row).items():
        history.history.setdefault(key, []).append(value)
  history.set_model(model)
  model.history = history  # as model.fit leaves it (a clone's was its own)
  # Keras's params; batch_size is tfdp's own (the global batch it decided)
  history.params = {"verbose": verbose, "epochs": epochs, "steps": hooks.steps_per_epoch,
                    "batch_size": inputs.global_batch}
  history.final = {k: v for k, v in result.items() if k != "trainer"}
  history.model_dir = model_dir
  return history


def _read_rows(model_dir: str) -> list[dict]:
  import csv  # pylint: disable=g-import-not-at-top
  path = os.path.join(model_dir, outputs.METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  def number(value):
    try:
      return float(value)
    except (TypeError, ValueError):
      return value
  return [{k: number(v) for k, v in row.items() if v not in ("", None)} for row in rows]

