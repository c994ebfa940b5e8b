"""A user's builders with the mistakes tfdp-train must name (task.model.module=user_builders);
tests/test_model_checks.py. Each takes the task's (input_shape, num_classes)."""
import functools

import tfdp


def _head(input_shape, units, activation=None, fixed_shape=None):
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  inputs = keras.Input(fixed_shape or input_shape)
  x = layers.GlobalAveragePooling2D()(layers.Conv2D(4, 3, activation="relu")(inputs))
  return keras.Model(inputs, layers.Dense(units, activation=activation)(x))


@tfdp.register_model("user_fine")
def user_fine(input_shape, num_classes):
  return _head(input_shape, num_classes)


@tfdp.register_model("user_wrong_size")
def user_wrong_size(input_shape, num_classes):
  del num_classes
  return _head(input_shape, 10)


@tfdp.register_model("user_softmax")
def user_softmax(input_shape, num_classes):
  return _head(input_shape, num_classes, activation="softmax")


@tfdp.register_model("user_softmax_layer")
def user_softmax_layer(input_shape, num_classes):
  import keras  # pylint: disable=g-import-not-at-top
  model = _head(input_shape, num_classes)
  return keras.Model(model.inputs, keras.layers.Softmax()(model.outputs[0]))


@tfdp.register_model("user_fixed_shape")
def user_fixed_shape(input_shape, num_classes):
  del input_shape
  return _head(None, num_classes, fixed_shape=(64, 64, 3))


@tfdp.register_model("user_returns_none")
def user_returns_none(input_shape, num_classes):
  _head(input_shape, num_classes)  # forgot to return it


@tfdp.register_model("user_compiled")
def user_compiled(input_shape, num_classes):
  import keras  # pylint: disable=g-import-not-at-top
  model = _head(input_shape, num_classes)
  model.compile(keras.optimizers.Adam(1e-3),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


@tfdp.register_model("user_sequential_unbuilt")
def user_sequential_unbuilt(input_shape, num_classes):
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  del input_shape
  return keras.Sequential([layers.Conv2D(4, 3, activation="relu"),
                           layers.GlobalAveragePooling2D(), layers.Dense(num_classes)])


@tfdp.register_model("user_subclassed")
def user_subclassed(input_shape, num_classes):
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  del input_shape

  class Net(keras.Model):
    def __init__(self):
      super().__init__()
      self.conv = layers.Conv2D(4, 3, activation="relu")
      self.pool = layers.GlobalAveragePooling2D()
      self.dense = layers.Dense(num_classes)

    def call(self, x):
      return self.dense(self.pool(self.conv(x)))
  return Net()


@tfdp.register_model("user_call_fails")
def user_call_fails(input_shape, num_classes):
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  del input_shape
  return keras.Sequential([layers.Reshape((7, 7)), layers.Flatten(), layers.Dense(num_classes)])


@tfdp.register_model("user_needs_width")
def user_needs_width(input_shape, num_classes, width):
  """A keyword the config must give (task.model.kwargs.width): no default."""
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  return keras.Sequential([keras.Input(input_shape), layers.Conv2D(width, 3),
                           layers.GlobalAveragePooling2D(), layers.Dense(num_classes)])


# A builder registered as a functools.partial of another (its name is its function's).
tfdp.register_model("user_partial")(functools.partial(user_needs_width, width=2))


@tfdp.register_model("user_int_outputs")
def user_int_outputs(input_shape, num_classes):
  """Class ids, not logits: Keras's apply_gradients said 'not enough values to unpack'."""
  import keras  # pylint: disable=g-import-not-at-top
  model = _head(input_shape, num_classes)
  return keras.Model(model.inputs, keras.ops.cast(model.outputs[0], "int32"))


@tfdp.register_model("user_spatial")
def user_spatial(input_shape, num_classes):
  """Per-pixel logits: its message said 'outputs outputs of shape'."""
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  inputs = keras.Input(input_shape)
  return keras.Model(inputs, layers.Conv2D(num_classes, 1)(inputs))
