"""Keras callbacks under tfdp's loop: the epoch hooks of core.controller.Controller.

Every worker calls them with the same all-reduced logs (Keras-style names: `loss`, `accuracy`,
`val_loss`, ...), so `EarlyStopping` and `ReduceLROnPlateau` decide alike on every worker and
all stop or change the learning rate together. The callbacks that save or summarize race between
workers in Keras 3, and tfdp does their job already (chief-only), so they are refused in one line.
"""
from __future__ import annotations

from tfdp import errors
from tfdp.errors import ConfigError

# Keras callback → what tfdp does instead.
REFUSED = {
    "ModelCheckpoint": "tfdp checkpoints every epoch into model_dir/checkpoints (the chief only; "
                       "params='trainer.checkpoint_every_steps=N' for more often) and exports "
                       "model_dir/model.keras",
    "BackupAndRestore": "tfdp resumes from model_dir/checkpoints by itself: pass the same "
                        "model_dir again",
    "TensorBoard": "tfdp writes TensorBoard summaries into model_dir/train and model_dir/eval",
}


def check_callbacks(callbacks) -> list:
  import keras  # pylint: disable=g-import-not-at-top
  callbacks = keras.tree.flatten(callbacks) if callbacks else []  # one callback too, as Keras
  for callback in callbacks:
    if not isinstance(callback, keras.callbacks.Callback):
      raise ConfigError(f"callbacks holds a {type(callback).__name__}, not a "
                        "keras.callbacks.Callback; pass Keras callback objects.")
    for name, instead in REFUSED.items():
      if isinstance(callback, getattr(keras.callbacks, name)):
        raise ConfigError(f"keras.callbacks.{name} races between workers in Keras "
                          f"3; {instead}; drop it from callbacks.")
    uncalled = [hook for hook in UNCALLED_HOOKS if hook in vars(callback) or
                getattr(type(callback), hook) is not getattr(keras.callbacks.Callback, hook)]
    if _keras_terminate_on_nan(callback):
      continue  # tfdp's own check acts for it (KerasCallbacks.diverged)
    if uncalled:
      from absl import logging  # pylint: disable=g-import-not-at-top
      logging.warning(errors.as_caller(
          f"callback {type(callback).__name__} has {', '.join(uncalled)}, which tfdp never "
          "calls (its steps run as one compiled call); the train, epoch and test begin/end hooks "
          "are called, as model.fit calls them"))
  return callbacks


# Keras's batch hooks: tfdp's loop runs steps_per_loop steps in one compiled call
UNCALLED_HOOKS = tuple(f"on_{stage}_batch_{when}" for stage in ("train", "test", "predict")
                       for when in ("begin", "end")) + ("on_batch_begin", "on_batch_end")


def terminates_on_nan(callbacks) -> bool:
  """A TerminateOnNaN that stops gracefully (raise_error=False): model.fit then ends on a
  non-finite loss and returns its History, where tfdp would raise TrainingDiverged."""
  return any(_keras_terminate_on_nan(callback) and not getattr(callback, "raise_error", False)
             for callback in callbacks)


def _keras_terminate_on_nan(callback) -> bool:
  import keras  # pylint: disable=g-import-not-at-top
  keras_own = keras.callbacks.TerminateOnNaN
  return isinstance(callback, keras_own) and type(callback).on_batch_end is keras_own.on_batch_end


def keras_logs(row: dict) -> dict:
  """A metrics.csv row → Keras's epoch logs: train_x → x, eval_x → val_x. No learning_rate:
  model.fit logs it only where a callback (ReduceLROnPlateau, LearningRateScheduler) adds it;
  no counts (train_steps, eval_examples)."""
  logs = {}
  for key, value in row.items():
    if key.startswith("train_") and key != "train_steps":
      logs[key[len("train_"):]] = value
    elif key.startswith("eval_") and key != "eval_examples":
      logs["val_" + key[len("eval_"):]] = value
  return logs


class KerasCallbacks:
  """The controller's hooks around a keras CallbackList and a History."""

  def __init__(self, callbacks, model, epochs: int, steps_per_epoch: int, verbose="auto",
               finalize=None, validation_freq: int | tuple = 1):
    import keras  # pylint: disable=g-import-not-at-top
    self.model, self.steps_per_epoch = model, steps_per_epoch
    # A History among the callbacks is the one fit returns (the last, as Keras's CallbackList)
    given = [c for c in callbacks if isinstance(c, keras.callbacks.History)]
    self.history = given[-1] if given else keras.callbacks.History()
    self.callbacks = keras.callbacks.CallbackList(  # Keras's params, as model.fit sets them
        [*callbacks, *([] if given else [self.history])], add_history=False, add_progbar=False,
        model=model, verbose=verbose, epochs=epochs, steps=steps_per_epoch)
    self.started = False
    self.finalize = finalize  # model.fit's optimizer.finalize_variable_values, before train_end
    self.terminate_on_nan = terminates_on_nan(callbacks)
    self.validation_freq = validation_freq

  def validation_due(self, epoch: int) -> bool:
    """model.fit's rule (Trainer._should_eval): every n-th epoch, or the (1-based) listed ones."""
    if isinstance(self.validation_freq, int):
      return (epoch + 1) % self.validation_freq == 0
    return epoch + 1 in self.validation_freq

  def train_begin(self) -> None:
    """on_train_begin, once: the controller calls it before the training loop is traced, so
    what a callback changes there (a layer's `trainable`) is in the traced step, as in
    model.fit (a review: a layer frozen there trained all the same)."""
    if not self.started:
      self.started = True
      self.model.stop_training = False
      self.callbacks.on_train_begin()

  def epoch_begin(self, epoch: int) -> None:
    self.train_begin()
    self.callbacks.on_epoch_begin(epoch)

  def evaluation_begin(self) -> None:  # model.fit's validation: SwapEMAWeights swaps here
    self.callbacks.on_test_begin()

  def evaluation_end(self, values: dict) -> None:
    self.callbacks.on_test_end(dict(values))

  def _state(self) -> tuple:
    """The model's weights and its optimizer's learning rate, as a digest."""
    from tfdp.core import resume  # pylint: disable=g-import-not-at-top
    rate = getattr(getattr(self.model, "optimizer", None), "learning_rate", None)
    return resume.weights_digest(self.model), repr(getattr(rate, "numpy", lambda: rate)())

  def changed_since_save(self) -> bool:
    """Whether callbacks changed the model since the epoch's checkpoint (the controller saves
    at an epoch's end, then calls epoch_end; and train_end after the last)."""
    return self._saved_state is not None and self._state() != self._saved_state

  _saved_state = None

  def epoch_end(self, epoch: int, row: dict) -> bool:
    self._saved_state = self._state()  # as saved, before the callbacks
    self.callbacks.on_epoch_end(epoch, keras_logs(row))
    return bool(getattr(self.model, "stop_training", False))

  def train_end(self, row: dict) -> None:
    if self.finalize is not None:
      self.finalize()
    if self.started:
      self.callbacks.on_train_end(keras_logs(row))

  def diverged(self, error) -> dict | None:
    """A non-finite loss (tfdp's TrainingDiverged) under TerminateOnNaN ends training as in
    model.fit: the epoch ends with its logs so far (loss nan), then training, and fit returns
    its History. Returns that last row; None without TerminateOnNaN (the error stands)."""
    if not self.terminate_on_nan:
      return None
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning(errors.as_caller(
        f"TerminateOnNaN: {error}; training ends here and fit returns its History, as "
        "model.fit does (the model keeps the weights it diverged with)"))
    self.train_begin()
    self.model.stop_training = True
    row = {}
    if error.epoch is not None:
      row = {"epoch": error.epoch + 1, "step": error.step, **error.row}
      self.epoch_end(error.epoch, row)
    self.train_end(row)
    return row


def no_epochs(model, callbacks, x, batch_size, steps_per_epoch, verbose, validation_freq):
  """model.fit(epochs=0): its callbacks' train begin and end, and an empty History with Keras's
  params (steps: ceil(examples / batch), or a dataset's known cardinality). No run is made."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfdp.compiled import inputs as inputs_lib  # pylint: disable=g-import-not-at-top
  steps = steps_per_epoch
  if steps is None and hasattr(x, "cardinality"):  # a tf.data.Dataset
    steps = int(x.cardinality()) if int(x.cardinality()) >= 0 else None
  elif steps is None and x is not None:
    first = keras.tree.flatten(x)[0]
    steps = (-(-len(first) // (batch_size or inputs_lib.DEFAULT_BATCH_SIZE))
             if hasattr(first, "__len__") else None)
  hooks = KerasCallbacks(callbacks, model, 0, steps, verbose, None, validation_freq)
  hooks.train_begin()
  hooks.train_end({})
  history = hooks.history
  history.set_model(model)
  model.history = history
  history.params = {"verbose": verbose, "epochs": 0, "steps": steps}
  history.final, history.model_dir = {}, None
  return history
