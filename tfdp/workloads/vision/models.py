"""Model registry: name → builder(input_shape, num_classes, **kwargs) → keras.Model (logits).

Importing this module does not import Keras, so configs can be checked before TensorFlow starts.
Builders are called inside `strategy.scope()` by the trainer.
"""
from __future__ import annotations

from typing import Callable

from tfdp.workloads.vision.model_checks import builder_function, builder_module, builder_name

ModelBuilder = Callable[..., "keras.Model"]  # noqa: F821
_REGISTRY: dict[str, ModelBuilder] = {}


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
  """Decorator: `@tfdp.register_model("my_net") def build(input_shape, num_classes, **kw)`."""
  def decorate(builder: ModelBuilder) -> ModelBuilder:
    earlier = _REGISTRY.get(name)
    # Another module's builder under the name; a notebook cell run again re-registers quietly.
    if earlier is not None and builder_module(earlier) != builder_module(builder):
      from absl import logging  # pylint: disable=g-import-not-at-top
      logging.warning("register_model: '%s' now builds with %s, no longer %s", name,
                      builder_name(builder), builder_name(earlier))
    _REGISTRY[name] = builder
    return builder
  return decorate


def registered_models() -> list[str]:
  return sorted(_REGISTRY)


def takes_sample_images(name: str) -> bool:
  """Whether the builder initializes from training images (a `sample_images` argument): the
  image task then passes it some, normalized as the model will see them."""
  import inspect  # pylint: disable=g-import-not-at-top
  return name in _REGISTRY and "sample_images" in inspect.signature(_REGISTRY[name]).parameters


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int, **kwargs):
  from tfdp.errors import ConfigError, TfdpError  # pylint: disable=g-import-not-at-top
  if name not in _REGISTRY:
    raise ConfigError(f"model '{name}' is not registered; use one of {', '.join(registered_models())}.")
  import inspect  # pylint: disable=g-import-not-at-top
  builder = _REGISTRY[name]
  who = f"model '{name}' ({builder_name(builder)})"
  given = {k: v for k, v in kwargs.items() if k != "sample_images"}  # the config's, not data
  signature = inspect.signature(builder)
  try:  # tfdp's own arguments first: a builder of another signature is the builder's to fix
    signature.bind_partial(input_shape, num_classes,
                           **{k: v for k, v in kwargs.items() if k not in given})
  except TypeError as e:
    short = getattr(builder_function(builder), "__name__", "builder")
    raise ConfigError(f"{who} cannot be called as {short}(input_shape, num_classes, "
                      f"**task.model.kwargs) ({e}); give it that signature, e.g. "
                      f"def {short}(input_shape, num_classes, **kwargs).") from None
  try:
    signature.bind(input_shape, num_classes, **kwargs)
  except TypeError as e:  # a name the builder does not take, or one it needs
    raise ConfigError(f"task.model.kwargs {given} do not fit model '{name}' ({e}); fix "
                      "task.model.kwargs.") from None
  try:
    model = builder(input_shape, num_classes, **kwargs)
  except Exception as e:  # pylint: disable=broad-except  (Keras rejects filters=-4 with a ValueError)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    # Not the builder's: a lost peer in the variables' broadcast (run_errors makes it a group
    # restart), memory, tfdp's own one-line errors.
    if isinstance(e, (TfdpError, MemoryError, tf.errors.OpError)):
      raise
    raise ConfigError(_build_failed(who, builder, e, input_shape, num_classes, given)) from None
  # What it returned, before anything trains: a user's builder could return logits of another
  # width, a softmax, an unbuilt model or None (one line each; an unbuilt one is built here).
  from tfdp.workloads.vision import model_checks  # pylint: disable=g-import-not-at-top
  return model_checks.check_classifier(model, name, builder, input_shape, num_classes)


def _build_failed(who: str, builder, error: Exception, input_shape, num_classes: int,
                  given: dict) -> str:
  """What a builder's exception says in one line: the error, the line of the builder's file it
  came through, what the builder was given, and what could be at fault (a user's builder may
  simply have a bug; tfdp's own are fixed by their arguments)."""
  import inspect  # pylint: disable=g-import-not-at-top
  import traceback  # pylint: disable=g-import-not-at-top
  try:
    source = inspect.getsourcefile(builder_function(builder))
  except TypeError:  # a builtin, or a class of a __main__ without a file
    source = None
  lines = [f"{frame.filename}:{frame.lineno}" for frame in traceback.extract_tb(error.__traceback__)
           if source and frame.filename == source]
  message = (str(error).strip().splitlines() or [""])[0][:300]
  said = f"{type(error).__name__}: {message}" + (f", at {lines[-1]}" if lines else "")
  images = (f"{'x'.join(str(d) for d in input_shape)} images" if input_shape
            else "images of unknown shape")
  kwargs = f" and task.model.kwargs {given}" if given else ""
  fixes = (["task.model.kwargs"] if given else []) + ["the image size (task.*_data.image_size)"]
  module = builder_module(builder)
  if not module.startswith("tfdp."):
    fixes.append(f"the builder ({module})")
  return (f"{who} failed to build for {images}, {num_classes} classes{kwargs} ({said}); "
          f"fix {', '.join(fixes[:-1]) + ' or ' if len(fixes) > 1 else ''}{fixes[-1]}.")


def _cifar_resnet(input_shape, num_classes, depth=20, width=16, l2=0.0):
  """ResNet v1 for 32×32 images (He et al. 2016, §4.2): depth = 6n + 2, widths w, 2w, 4w."""
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  if (depth - 2) % 6:
    raise TypeError(f"depth must be 6n+2 (8, 14, 20, 32, 56), got {depth}")
  blocks = (depth - 2) // 6
  reg = keras.regularizers.L2(l2) if l2 else None

  def conv(x, filters, stride=1, kernel=3):
    return layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False,
                         kernel_initializer="he_normal", kernel_regularizer=reg)(x)

  def bn(x):
    return layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)

  inputs = keras.Input(input_shape)
  x = layers.ReLU()(bn(conv(inputs, width)))
  for stage in range(3):
    filters = width * 2**stage
    for block in range(blocks):
      stride = 2 if stage > 0 and block == 0 else 1
      shortcut = x
      y = layers.ReLU()(bn(conv(x, filters, stride)))
      y = bn(conv(y, filters))
      if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = bn(conv(shortcut, filters, stride, kernel=1))
      x = layers.ReLU()(layers.Add()([shortcut, y]))
  x = layers.GlobalAveragePooling2D()(x)
  outputs = layers.Dense(num_classes, kernel_regularizer=reg)(x)
  return keras.Model(inputs, outputs, name=f"resnet{depth}")


@register_model("resnet8")
def resnet8(input_shape, num_classes, **kwargs):
  return _cifar_resnet(input_shape, num_classes, **{"depth": 8, **kwargs})


@register_model("resnet20")
def resnet20(input_shape, num_classes, **kwargs):
  return _cifar_resnet(input_shape, num_classes, **{"depth": 20, **kwargs})


@register_model("resnet56")
def resnet56(input_shape, num_classes, **kwargs):
  return _cifar_resnet(input_shape, num_classes, **{"depth": 56, **kwargs})


@register_model("small_cnn")
def small_cnn(input_shape, num_classes, filters=32, batch_norm=True, dropout=0.0, l2=0.0):
  """Two conv blocks and a dense head. batch_norm=False gives a model whose training does not
  depend on how the batch is split over replicas (used by the equivalence tests)."""
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  reg = keras.regularizers.L2(l2) if l2 else None
  inputs = keras.Input(input_shape)
  x = inputs
  for i in range(2):
    x = layers.Conv2D(filters * 2**i, 3, padding="same", use_bias=not batch_norm,
                      kernel_regularizer=reg)(x)
    if batch_norm:
      x = layers.BatchNormalization()(x)
    x = layers.ReLU()(x)
    x = layers.MaxPooling2D()(x)
  x = layers.GlobalAveragePooling2D()(x)
  if dropout:
    x = layers.Dropout(dropout)(x)
  return keras.Model(inputs, layers.Dense(num_classes, kernel_regularizer=reg)(x), name="small_cnn")


# `sample_images=RESTORED`: a builder that initializes from data builds the same variables
# without reading any, because a checkpoint is restored over them (a resume, --mode=eval).
RESTORED = object()


def patch_whitening_kernel(images, patch_size: int = 2, eps: float = 5e-4):
  """airbench's whitened first layer: a conv kernel [k, k, channels, 2 * k * k * channels] whose
  filters are the eigenvectors of the (uncentred) covariance of all k x k patches of `images`
  (NHWC), scaled by 1 / sqrt(eigenvalue + eps), each also negated: the layer maps a patch to its
  decorrelated, unit-variance coordinates (and their negatives, for the GELU after it)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  images = np.asarray(images, np.float64)
  n, height, width, channels = images.shape
  patches = np.stack([images[:, i:height - patch_size + 1 + i, j:width - patch_size + 1 + j, :]
                      for i in range(patch_size) for j in range(patch_size)], axis=3)
  patches = patches.reshape(-1, patch_size * patch_size * channels)  # (row, column, channel)
  covariance = patches.T @ patches / len(patches)
  eigenvalues, eigenvectors = np.linalg.eigh(covariance)  # ascending
  order = np.argsort(eigenvalues)[::-1]
  scaled = eigenvectors[:, order] / np.sqrt(eigenvalues[order] + eps)
  kernel = np.concatenate([scaled, -scaled], axis=1)
  return kernel.reshape(patch_size, patch_size, channels, -1).astype(np.float32)


def dirac_kernel(kernel):
  """A conv kernel [k, k, in, out] whose first min(in, out) filters pass their own input channel
  through unchanged (a 1 at the centre) and see no other; the rest as given (PyTorch's dirac_
  on airbench's w[:in_channels])."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  kernel = np.array(kernel)
  size, channels = kernel.shape[0], min(kernel.shape[2], kernel.shape[3])
  kernel[:, :, :, :channels] = 0.0
  kernel[size // 2, size // 2, np.arange(channels), np.arange(channels)] = 1.0
  return kernel


@register_model("airbench")
def airbench(input_shape, num_classes, widths=(64, 256, 256), batchnorm_momentum=0.4,
             logit_scale=1 / 9, whiten=True, dirac_init=False, batchnorm_scale=True,
             torch_default_init=False, head_init_std=0.0, sample_images=None):
  """The fast CIFAR-10 net of airbench (Keller Jordan 2024): a 2x2 stem, three groups of
  conv-pool-BN-GELU-conv-BN-GELU, max-pool, a linear head scaled by 1/9. The stem is fixed to
  whiten 2x2 patches of `sample_images` (patch_whitening_kernel; its bias still learns) when
  `whiten` and images are given, else learned. `dirac_init`: each 3x3 conv's first filters (one
  per input channel) start as the identity, as airbench's do. `batchnorm_scale`: BatchNorm learns
  a scale (False: fixed at 1, as airbench's). `torch_default_init`: the convs and the head start
  as PyTorch's default, uniform within +-1/sqrt(fan_in), as airbench's do (else Keras's
  Glorot-uniform, up to 1.7x wider here: under BatchNorm a larger weight learns more slowly
  until weight decay shrinks it). `head_init_std` > 0: the head starts uniform at that standard
  deviation (airbench94_muon: 1, with logit_scale 1/256). `batchnorm_momentum`: Keras's, the
  share of the old moving statistics kept; airbench keeps 0.6 (PyTorch's momentum=0.4), tfdp's
  default 0.4 (no gain from 0.6 on the default job, BENCHMARKS.md). Lookahead and the
  BatchNorm-bias learning-rate multiplier are the trainer's (trainer.lookahead_every_steps,
  trainer.optimizer.norm_bias_lr_multiplier)."""
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  if len(widths) != 3:
    raise TypeError(f"widths must be 3 numbers (one per group), got {widths}")
  if head_init_std < 0:
    raise ValueError(f"head_init_std must be >= 0 (0: the head starts as the convs do), got "
                     f"{head_init_std}")

  def bn(x):
    return layers.BatchNormalization(momentum=batchnorm_momentum, epsilon=1e-12,
                                     scale=batchnorm_scale)(x)

  def init():  # a new one per layer: one unseeded initializer reused draws the same values
    # PyTorch's kaiming_uniform_(a=sqrt(5)) for Conv2d and Linear: variance 1 / (3 fan_in)
    return (keras.initializers.VarianceScaling(1 / 3, "fan_in", "uniform")
            if torch_default_init else "glorot_uniform")

  def conv(x, filters):
    layer = layers.Conv2D(filters, 3, padding="same", use_bias=False, kernel_initializer=init())
    y = layer(x)
    if dirac_init:
      layer.kernel.assign(dirac_kernel(layer.kernel.numpy()))  # np.array(variable) warns in NumPy 2
    return y

  stem_width = 2 * 2 * 2 * input_shape[-1]  # every 2x2 patch direction, and its negative
  stem = layers.Conv2D(stem_width, 2, padding="valid")
  inputs = keras.Input(input_shape)
  x = layers.Activation("gelu")(stem(inputs))
  if whiten and sample_images is not None:
    if sample_images is not RESTORED:  # else a checkpoint's fixed stem is restored over it
      stem.kernel.assign(patch_whitening_kernel(sample_images))
    stem.kernel.trainable = False
  for width in widths:
    x = layers.Activation("gelu")(bn(layers.MaxPooling2D()(conv(x, width))))
    x = layers.Activation("gelu")(bn(conv(x, width)))
  x = layers.Flatten()(layers.GlobalMaxPooling2D(keepdims=True)(x))
  half_width = 3 ** 0.5 * head_init_std  # a uniform's std is half its width over sqrt(3)
  head_init = (keras.initializers.RandomUniform(-half_width, half_width)
               if head_init_std > 0 else init())
  logits = layers.Dense(num_classes, use_bias=False, kernel_initializer=head_init)(x)
  return keras.Model(inputs, layers.Rescaling(logit_scale)(logits), name="airbench")


def _keras_application(constructor_name: str):
  def build(input_shape, num_classes, **kwargs):
    import keras  # pylint: disable=g-import-not-at-top
    constructor = getattr(keras.applications, constructor_name)
    return constructor(weights=None, input_shape=tuple(input_shape), classes=num_classes,
                       classifier_activation=None, **kwargs)
  build.__name__ = constructor_name
  return build


for _name, _constructor in (("resnet50", "ResNet50"), ("mobilenet_v2", "MobileNetV2"),
                            ("efficientnet_b0", "EfficientNetB0")):
  register_model(_name)(_keras_application(_constructor))
