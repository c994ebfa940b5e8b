"""Models made for tests, registered as tfdp models (task.model.module=models_for_tests)."""
import tfdp


@tfdp.register_model("input_bn")
def input_bn(input_shape, num_classes):
  """BatchNorm straight on the input: its moving mean depends on the data alone, so after any
  number of steps it must equal the one-replica run's (the mean of equal sub-batch means)."""
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  inputs = keras.Input(input_shape)
  x = layers.BatchNormalization(momentum=0.9)(inputs)
  x = layers.GlobalAveragePooling2D()(x)
  return keras.Model(inputs, layers.Dense(num_classes)(x), name="input_bn")


@tfdp.register_model("always_class_0")
def always_class_0(input_shape, num_classes):
  """Predicts class 0 for every input with fixed logits: its accuracy on a known set is exact."""
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  inputs = keras.Input(input_shape)
  x = layers.GlobalAveragePooling2D()(inputs)
  bias = [2.0] + [0.0] * (num_classes - 1)
  logits = layers.Dense(num_classes, kernel_initializer="zeros",
                        bias_initializer=keras.initializers.Constant(bias))(x)
  return keras.Model(inputs, logits, name="always_class_0")
