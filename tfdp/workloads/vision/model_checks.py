"""What a registered builder returned, checked before anything trains or is written.

The image task trains `builder(input_shape, num_classes)` as a classifier: one input, the
images, and (batch, num_classes) logits (its loss is cross-entropy from logits). A builder that
got this wrong trained silently (10 outputs for 3 classes, a softmax read as logits) or failed
mid-run with Keras's traceback (an unbuilt model at apply_gradients, a fixed Input of another
size at the first batch, None at the trainer). Here each is one line naming the fix, raised
inside the trainer's model build, so a refused start leaves model_dir as it found it.
"""
from __future__ import annotations

from tfdp.errors import ConfigError

_PROBABILITIES = ("softmax", "sigmoid")  # outputs in [0, 1]: not logits


def builder_function(builder):
  """A registered builder's own function: a functools.partial's, else itself."""
  return getattr(builder, "func", builder)


def builder_module(builder) -> str:
  """The module of a registered builder's function."""
  return getattr(builder_function(builder), "__module__", None) or "?"


def builder_name(builder) -> str:
  """module.qualname of a registered builder's function."""
  target = builder_function(builder)
  return (f"{builder_module(builder)}."
          f"{getattr(target, '__qualname__', None) or type(target).__name__}")


def check_classifier(model, name: str, builder, input_shape, num_classes: int):
  """Returns `model`, built on the data's images if it was not (as Keras's fit builds it on the
  first batch); raises ConfigError for what cannot train as the image task's classifier."""
  import keras  # pylint: disable=g-import-not-at-top
  who = f"model '{name}' (task.model.name, {builder_name(builder)})"
  if not isinstance(model, keras.Model):
    got = "None" if model is None else f"a {type(model).__name__}"
    raise ConfigError(f"{who} returned {got}, not a keras.Model; return the model from the "
                      "builder (`return keras.Model(inputs, logits)`).")
  if getattr(model, "compiled", False):
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.warning("%s is compiled, but tfdp-train does not use its compile() settings: it "
                    "trains with the config's trainer.optimizer / trainer.learning_rate and the "
                    "task's loss (tfdp.fit is the API that trains a compiled model as compiled)",
                    who)
  if not input_shape:  # a source of unknown image shape: nothing to check the model against
    return model
  shape = (None, *tuple(input_shape))
  dims = lambda s: "x".join(str(d) for d in s[1:])  # noqa: E731
  inputs = getattr(model, "inputs", None) if model.built else None
  if inputs is not None and len(inputs) != 1:
    raise ConfigError(f"{who} takes {len(inputs)} inputs, but the image task gives it one, the "
                      f"images ({dims(shape)}); build it on one keras.Input(input_shape).")
  if inputs and (len(inputs[0].shape) != len(shape) or any(
      m is not None and m != d for m, d in zip(inputs[0].shape[1:], shape[1:]))):
    raise ConfigError(
        f"{who} takes inputs of shape {dims(inputs[0].shape)}, but the data's images are "
        f"{dims(shape)}; build it on the input_shape its builder is given "
        f"(keras.Input(input_shape)), or resize the data (task.train_data.image_size).")
  spec = keras.KerasTensor(shape, dtype="float32")
  try:
    # Unbuilt (a Sequential without an Input, a subclassed model): a symbolic call builds its
    # variables, here inside strategy.scope(), as Keras's fit would on the first batch.
    output = model(spec) if not model.built else model.compute_output_spec(spec)
  except Exception as e:  # pylint: disable=broad-except  (the model's own code: one line)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    raise ConfigError(f"{who} fails on the data's images ({dims(shape)}): {type(e).__name__}: "
                      f"{first}; fix the builder so its model takes a batch of input_shape "
                      "images.") from None
  if not isinstance(output, keras.KerasTensor):  # a list, a dict: not one logits tensor
    raise ConfigError(f"{who} returns {type(output).__name__} of outputs; an image classifier "
                      "returns one tensor, the logits (batch, num_classes).")
  if len(output.shape) != 2 or (num_classes and output.shape[-1] != num_classes):
    got = (f"{output.shape[-1]} values per example" if len(output.shape) == 2
           else f"shape {dims(output.shape)} per example")
    raise ConfigError(
        f"{who} outputs {got}, but the data has {num_classes} classes (task.train_data."
        f"num_classes, or the class folders of an image folder); end it in one Dense("
        "num_classes) with the num_classes its builder is given.")
  if not keras.backend.is_float_dtype(output.dtype):  # else Keras's bare 'not enough values'
    raise ConfigError(f"{who} outputs {output.dtype}, not float logits; end it in one Dense("
                      "num_classes), without a cast to integers.")
  activation = _final_activation(model)
  if activation:
    raise ConfigError(f"{who} ends in a {activation}, but the image task's loss is "
                      "cross-entropy from logits; return logits (drop the "
                      f"{activation}): tfdp applies the softmax in its loss and accuracy.")
  return model


def _final_activation(model) -> str | None:
  """'softmax' or 'sigmoid' where the layer (or op) making a functional or Sequential model's
  output applies it; None otherwise (a subclassed model's call is not inspected)."""
  outputs = getattr(model, "outputs", None)
  history = getattr(outputs[0], "_keras_history", None) if outputs else None
  operation = getattr(history, "operation", None)
  if operation is None:
    return None
  kind = type(operation).__name__.lower()  # keras.layers.Softmax, keras.ops.softmax's op
  if kind in _PROBABILITIES:
    return kind
  activation = getattr(operation, "activation", None)  # Dense(..., activation=), Activation
  activation = getattr(activation, "__name__", None)
  return activation if activation in _PROBABILITIES else None
