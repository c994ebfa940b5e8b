"""Data as `keras.Model.fit` takes it → tfdp Sources of unbatched example dicts.

Arrays (or dicts / lists of arrays) `x, y`, or a `tf.data.Dataset` of `x`, `(x, y)` or
`(x, y, sample_weight)`, batched or not. Every example becomes `{"x", "y", "sample_weight"}`;
tfdp then shuffles (seeded: every worker draws the same order), shards, batches and pads it as
it does any source, so the user's own pipeline (a `TextVectorization` inside `.map`) runs as
written, once per example.
"""
from __future__ import annotations

import dataclasses

from absl import logging
import numpy as np

from tfdp.core import data as data_lib
from tfdp import errors
from tfdp.errors import DataError

DEFAULT_BATCH_SIZE = 32  # keras.Model.fit's


def fail(argument: str, problem: str, fix: str) -> DataError:
  return DataError(f"{argument} {problem}; {fix}.")


@dataclasses.dataclass
class KerasData:
  """What tfdp.fit decided about the user's data, once."""
  train: data_lib.Source
  validation: data_lib.Source | None
  global_batch: int
  from_arrays: bool  # arrays shuffle as Keras shuffles them; a dataset keeps its order unless asked
  validation_batch: int = 0  # validation_batch_size; 0: global_batch

  def describe(self) -> dict:
    described = {"train_examples": self.train.num_examples, "global_batch_size": self.global_batch,
                 "element_spec": self.train.info["element_spec"],
                 "given_as": "arrays" if self.from_arrays else "tf.data.Dataset"}
    if self.validation is not None:
      described["validation_examples"] = self.validation.num_examples
    return described


def _tf():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf


def is_dataset(value) -> bool:
  return isinstance(value, _tf().data.Dataset)


def input_ranks(model) -> list[int]:
  """The ranks of the model's symbolic inputs (batch dimension included), or [] for a model
  without them (subclassed): how a dataset is told batched or not."""
  try:
    return [len(t.shape) for t in model.inputs]
  except (AttributeError, ValueError):
    return []


def _check_kind(value, argument: str) -> None:
  """Keras's generator and PyDataset inputs have no length or order tfdp can shard by."""
  import inspect  # pylint: disable=g-import-not-at-top
  from collections.abc import Iterator  # pylint: disable=g-import-not-at-top
  kind = type(value).__name__
  if any(c.__name__ == "PyDataset" for c in type(value).__mro__):
    kind = f"keras.utils.PyDataset ({kind})"
  if inspect.isgenerator(value) or isinstance(value, Iterator) or "PyDataset" in kind:
    raise fail(argument, f"is a {kind}, which tfdp cannot split between replicas and workers",
               "pass arrays or a tf.data.Dataset (tf.data.Dataset.from_generator wraps a "
               "generator)")


def _length(value, argument: str) -> int:
  _check_kind(value, argument)
  leaves = _tf().nest.flatten(value)
  if any(isinstance(leaf, _tf().SparseTensor) for leaf in leaves):
    raise fail(argument, "holds a tf.SparseTensor, which tfdp cannot split into rows",
               "pass tf.sparse.to_dense(...) of it, or a tf.data.Dataset that makes dense rows")
  if not all(hasattr(leaf, "__len__") and not isinstance(leaf, (str, bytes)) for leaf in leaves):
    raise fail(argument, "holds a value without rows (a scalar, a string or an object)",
               "pass arrays, a dict or list of arrays, a DataFrame or a tf.data.Dataset")
  lengths = {len(leaf) for leaf in leaves}
  if len(lengths) != 1:
    raise fail(argument, f"holds arrays of different lengths {sorted(lengths)}",
               "give every array one row per example")
  return lengths.pop()


def _as_arrays(value):
  if isinstance(value, list):  # Keras's list of inputs; tf.data would stack a list into one
    value = tuple(value)
  return _tf().nest.map_structure(np.asarray, value)


def _class_weights(y, class_weight: dict):
  """Each example's class weight, as Keras's fit maps it (data_adapter_utils.
  class_weight_to_sample_weights): one-hot labels by their argmax, others rounded (a soft 0.7 is
  class 1), and a class that class_weight does not name weighs 1.0."""
  tf = _tf()
  if tf.nest.is_nested(y):
    raise fail("class_weight", "works with a single output only",
               "use sample_weight for a model with several outputs")
  size = max(max(int(k) for k in class_weight) + 1, 1)
  table = np.ones(size, np.float32)
  for label, weight in class_weight.items():
    if int(label) >= 0:
      table[int(label)] = float(weight)
  y = tf.convert_to_tensor(y)
  one_hot = y.shape.rank and y.shape[-1] > 1
  label = tf.cast(tf.argmax(y, -1) if one_hot else
                  tf.round(tf.cast(tf.reshape(y, [-1])[0], tf.float64)), tf.int64)
  named = tf.logical_and(label >= 0, label < size)
  return tf.where(named, tf.gather(tf.constant(table), tf.clip_by_value(label, 0, size - 1)), 1.0)


def _examples(dataset, class_weight):
  """(x, y[, sample_weight]) or x → {"x", "y", "sample_weight"} per example."""
  tf = _tf()
  spec = dataset.element_spec
  if isinstance(spec, tuple) and len(spec) > 2 and not isinstance(spec[2], tf.TensorSpec):
    raise fail("the dataset", "holds one sample weight per output (its elements' third part)",
               "give one weight per example (it weighs every output's loss), or weigh the "
               "outputs with compile(loss_weights=...)")
  if isinstance(spec, tuple) and len(spec) > 2 and (spec[2].shape.rank or 0) > 0 and (
      spec[2].shape.num_elements() != 1):
    raise fail("the dataset", f"holds a sample weight of shape {list(spec[2].shape)} per example "
               "(its elements' third part: per timestep?)", PER_STEP_FIX)

  def to_example(*element):  # tf.data unpacks a tuple element: (x,), (x, y) or (x, y, weight)
    x = element[0]
    y = element[1] if len(element) > 1 else tf.zeros([], tf.float32)
    weight = tf.cast(element[2], tf.float32) if len(element) > 2 else tf.constant(1.0)
    if class_weight:
      weight = weight * _class_weights(y, class_weight)
    return {"x": x, "y": y, "sample_weight": tf.reshape(weight, [])}

  return dataset.map(tf.autograph.experimental.do_not_convert(to_example))  # as tfdp's own maps


def _spec_text(spec) -> object:
  tf = _tf()
  return tf.nest.map_structure(lambda s: f"{s.dtype.name}{list(s.shape)}", spec)


def _source(dataset, count: int, class_weight, name: str, content: str | None = None
            ) -> data_lib.Source:
  examples = _examples(dataset, class_weight)
  element_spec = {k: _spec_text(v) for k, v in examples.element_spec.items() if k != "sample_weight"}

  def read(file_indices):
    del file_indices  # one stream
    return examples

  return data_lib.Source([count], read, "keras", info={"element_spec": element_spec, "name": name,
                                                      "content": content})


PER_STEP_FIX = ("tfdp weighs each example as a whole: give one weight per example, or leave steps "
                "out of the loss with a mask (Embedding(mask_zero=True), keras.layers.Masking)")


def _from_arrays(x, y, sample_weight, argument: str):
  tf = _tf()
  n = _length(x, argument)
  parts = [_as_arrays(x)]
  if y is not None:
    if _length(y, "y") != n:
      raise fail("x and y", f"have different lengths ({n} and {_length(y, 'y')})",
                 "give one label per example")
    parts.append(_as_arrays(y))
  if sample_weight is not None:
    if y is None:
      raise fail("sample_weight", "was given without y", "pass y too")
    if isinstance(sample_weight, dict) or (isinstance(sample_weight, (list, tuple)) and any(
        np.ndim(w) > 0 for w in sample_weight)):
      raise fail("sample_weight", "holds one weight array per output",
                 "pass one weight per example (it weighs every output's loss), or weigh the "
                 "outputs with compile(loss_weights=...)")
    weights = np.asarray(sample_weight, np.float32)
    if weights.ndim > 1 and weights.shape[0] == n and weights[0].size != 1:
      raise fail("sample_weight", f"has shape {weights.shape}: weights per timestep", PER_STEP_FIX)
    weights = weights.reshape(-1)
    if len(weights) != n:
      raise fail("sample_weight", f"has {len(weights)} entries for {n} examples",
                 "give one weight per example")
    parts.append(weights)
  return tf.data.Dataset.from_tensor_slices(tuple(parts)), n, _content_digest(parts)


def _content_digest(parts) -> str | None:
  """The arrays' digest, compared between workers: ones of one shape but other contents trained
  each worker's share of its own, silently (a probe). One process compares nothing: none."""
  from tfdp.core import resume  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  if not cluster_lib.resolve_cluster().is_multi_worker:
    return None
  return resume.arrays_digest(_tf().nest.flatten(parts))


def _unbatched(dataset, model_input_ranks, argument: str = "x", steps: int = 0):
  """A dataset Keras would take batched (its leading dimension unknown, or matching the model's
  input rank) is unbatched here: tfdp batches with the global batch. Returns (dataset, its batch
  size or 0, its examples where finding the batch size counted them, else None, the sizes of
  its first `steps` batches where finding the batch size read them, else None)."""
  tf = _tf()
  specs = [s for s in tf.nest.flatten(dataset.element_spec) if hasattr(s, "shape")]
  if not specs:
    return dataset, 0, None, None
  leading = [s.shape[0] if s.shape.rank else -1 for s in specs]
  batched = all(d is None for d in leading)
  if not batched and len(set(leading)) == 1 and leading[0] not in (None, -1):  # drop_remainder?
    spec = dataset.element_spec
    x_ranks = sorted(s.shape.rank if s.shape.rank is not None else -1 for s in tf.nest.flatten(
        spec[0] if isinstance(spec, tuple) else spec) if hasattr(s, "shape"))
    if model_input_ranks and len(x_ranks) == len(model_input_ranks):
      batched = x_ranks == sorted(model_input_ranks)  # x's ranks as the inputs', batch included
    else:  # no symbolic inputs to tell by (subclassed, no keras.Input): Keras's rule
      batched = True
      logging.info(errors.as_caller(
          f"the dataset's parts all lead with {leading[0]} and the model has no keras.Input to "
          f"tell by: taken as batches of {leading[0]}, as Keras takes a dataset (unbatched "
          "examples: give the model a keras.Input, or .batch() the dataset yourself)"))
  if not batched:
    return dataset, 0, None, None
  batch = leading[0] if leading[0] not in (None, -1) else 0
  count = first_sizes = None
  if not batch and int(dataset.cardinality()) == tf.data.INFINITE_CARDINALITY:
    # .batch(n) without drop_remainder: the first batch says n; the first `steps` batches are
    # read in the same pass (each pass of a reshuffling dataset is another order)
    first_sizes = _batch_sizes(dataset, max(steps, 1))
    batch = first_sizes[0]
  elif not batch:  # its examples and its first batch in one pass: each pass is another order
    count, batch, batches, shortest, _ = _batch_summary(dataset)
    if batches > 1 and shortest < batch:  # a short batch before the last (a probe)
      logging.warning(errors.as_caller(
          f"{argument}'s batches are uneven within the data (a batch of {shortest} before its "
          f"last): tfdp batches its examples by {batch}, {-(-count // batch)} steps where "
          f"model.fit takes {batches}; batch after .repeat() or .concatenate() to keep its "
          "steps"))
  return dataset.unbatch(), batch, count, first_sizes


def _batch_summary(dataset) -> tuple[int, ...]:
  """(examples, first batch's size, batches, the shortest before the last, the last's size) of
  a batched dataset, in one pass in the graph (a Python loop per batch is slow on big data)."""
  tf = _tf()
  big = tf.constant(2**62, tf.int64)

  def add(state, size):
    count, first, batches, shortest, last = state
    shortest = tf.where(batches > 0, tf.minimum(shortest, last), shortest)  # `last` is not now
    return (count + size, tf.where(batches > 0, first, size), batches + 1, shortest, size)

  zero = tf.constant(0, tf.int64)
  return tuple(int(v) for v in _sizes(dataset).reduce((zero, zero, zero, big, zero),
                                                      _do_not_convert(add)))


def _batch_sizes(dataset, limit: int | None = None) -> list[int]:
  """The sizes of a batched dataset's batches (its first `limit`), in one pass."""
  if limit is not None:
    dataset = dataset.take(limit)
  return [int(size) for size in _sizes(dataset).as_numpy_iterator()]


def _sizes(dataset):
  """Each batch's size (its first part's leading dimension)."""
  tf = _tf()
  return dataset.map(_do_not_convert(lambda *e: tf.shape(tf.nest.flatten(e)[0], tf.int64)[0]))


def _do_not_convert(fn):
  return _tf().autograph.experimental.do_not_convert(fn)


def _count(dataset, steps: int, global_batch: int, argument: str, steps_name: str,
           counted: int | None = None):
  """Examples in one pass: known (`counted`: by _unbatched), counted in one pass, or `steps`
  batches of a dataset that repeats for ever (a training run's whole stream: epochs ×
  steps_per_epoch)."""
  tf = _tf()
  if counted is not None:
    return dataset, counted
  cardinality = int(dataset.cardinality())
  if cardinality == tf.data.INFINITE_CARDINALITY:
    if not steps:
      raise fail(argument, "repeats for ever", f"pass {steps_name} (or drop the .repeat())")
    return dataset.take(steps * global_batch), steps * global_batch
  if cardinality >= 0:
    return dataset, cardinality
  ones = dataset.map(_do_not_convert(lambda *_: tf.constant(1, tf.int64)))
  return dataset, int(ones.reduce(tf.constant(0, tf.int64), _do_not_convert(
      lambda count, one: count + one)))


FIRST_EXAMPLES = 8


def first_examples(source: data_lib.Source, count: int = FIRST_EXAMPLES) -> dict:
  """A batch of the source's first `count` examples (x, y, ...): what Keras's fit builds on and
  tfdp's checks run the model on. Read once per source: each read of a dataset is another pass
  (a seeded shuffle's next order, a shuffle buffer filled again)."""
  tf = _tf()
  first = getattr(source, "_first_examples", None)
  if first is None:
    examples = source.read([0])
    for spec in tf.nest.flatten(examples.element_spec):  # TF's own error otherwise (a probe)
      if not spec.shape.is_fully_defined():
        raise DataError(f"examples must have fixed shapes to be batched, got {spec}; "
                        f"{errors.terms().fixed_shapes_fix}.")
    try:
      first = next(iter(examples.take(FIRST_EXAMPLES).batch(FIRST_EXAMPLES)))
    except StopIteration:  # counted, then empty: a one-shot source (a generator over an iterator)
      raise fail("x", "gave no examples when read again (tfdp reads data once to count it, then "
                 "once per epoch)", "make it re-readable, e.g. Dataset.from_generator(make) "
                 "where make() returns a new generator each call") from None
    source._first_examples = first  # pylint: disable=protected-access
  return tf.nest.map_structure(lambda t: t[:count], first)


def check_batch_size(name: str, value) -> int | None:
  """The batch size as an int (a numpy integer too, as Keras takes it), or None."""
  from tfdp import in_process  # pylint: disable=g-import-not-at-top
  return None if value is None else in_process.whole_number(f"{name} (the global batch)", value,
                                                            caller=errors.terms().caller)


def _check_has_labels(dataset, argument: str) -> None:
  """Keras refuses to train without labels; tfdp would train on zeros."""
  spec = dataset.element_spec
  if not (isinstance(spec, tuple) and len(spec) >= 2):
    raise fail(argument, "holds no labels (its elements are x alone)",
               "give it (x, y) or (x, y, sample_weight) elements")


def make_inputs(x, y=None, *, batch_size=None, sample_weight=None, class_weight=None,
                validation_data=None, validation_split=0.0, steps_per_epoch=None,
                validation_steps=None, validation_batch_size=None, epochs=1,
                model_input_ranks=(), steps_name="steps_per_epoch", labels=True) -> KerasData:
  """Keras's fit arguments → KerasData; one line (DataError) for what Keras would reject later
  or silently misread. `labels`: False for a model compiled without a loss (x alone trains it)."""
  if x is None:
    raise fail("x", "is None", "pass the training data")
  batch_size = check_batch_size("batch_size", batch_size)
  validation_batch_size = check_batch_size("validation_batch_size", validation_batch_size)
  if not 0.0 <= float(validation_split) < 1.0:
    raise fail("validation_split", f"is {validation_split}", "use a fraction in [0, 1)")
  class_weight = dict(class_weight or {})
  weighed = sample_weight is not None or (
      is_dataset(x) and isinstance(x.element_spec, tuple) and len(x.element_spec) == 3)
  if class_weight and weighed:  # model.fit refuses the pair; said, never silently different
    logging.warning(errors.as_caller("class_weight and sample_weight are both given; model.fit "
                                     "refuses the pair, tfdp weighs each example by their "
                                     "product"))
  repeats, content = False, None  # a dataset's contents are read, not digested
  if is_dataset(x):
    if y is not None or sample_weight is not None:
      raise fail("y/sample_weight", "were given with a dataset",
                 "put them in the dataset's elements: (x, y) or (x, y, sample_weight)")
    if validation_split:
      raise fail("validation_split", "works with arrays only",
                 "pass validation_data=<a dataset> instead")
    if labels:
      _check_has_labels(x, "x")
    dataset, dataset_batch, counted, first_sizes = _unbatched(x, model_input_ranks,
                                                              steps=steps_per_epoch or 0)
    if batch_size and dataset_batch and batch_size != dataset_batch:  # Keras ignores it too
      logging.warning(errors.as_caller(f"batch_size={batch_size} is not used: x is a dataset "
                                       f"batched by {dataset_batch}, whose batches decide, as "
                                       "in model.fit"))
    global_batch = dataset_batch or batch_size or DEFAULT_BATCH_SIZE
    # One stream for the whole run, as Keras's one iterator: epoch 2 goes on where epoch 1 ended.
    repeats = int(dataset.cardinality()) == _tf().data.INFINITE_CARDINALITY
    if repeats and steps_per_epoch and first_sizes:
      _check_even_stream(first_sizes, steps_per_epoch, dataset_batch)
    dataset, count = _count(dataset, (steps_per_epoch or 0) * epochs, global_batch, "x",
                            steps_name, counted)
    from_arrays, validation = False, None
  else:
    if y is None and labels:
      _check_kind(x, "x")
      raise fail("y", "is None, so there are no labels",
                 "pass y, or a tf.data.Dataset of (x, y) as x")
    dataset, count, content = _from_arrays(x, y, sample_weight, "x")
    global_batch = batch_size or DEFAULT_BATCH_SIZE
    from_arrays = True
    validation = None
    if validation_split:  # Keras's rule: the last fraction, before any shuffling
      keep = int(count * (1.0 - validation_split))
      if keep == 0 or keep == count:
        raise fail("validation_split", f"{validation_split} of {count} examples leaves one side empty",
                   "use more data or another fraction")
      validation = _source(dataset.skip(keep), count - keep, {}, "validation_split", content)
      dataset, count = dataset.take(keep), keep
  if not count:
    raise fail("x", "is empty", "pass at least one example")
  train = _source(dataset, count, class_weight, "train", content)
  if repeats:  # its epoch, not the run-long pass, is what a resume compares
    train.info["stream_epoch_examples"] = steps_per_epoch * global_batch
  if validation_data is not None:
    if validation is not None:
      raise fail("validation_data", "was given with validation_split", "pass one of them")
    validation = _validation_source(validation_data, validation_steps,
                                    validation_batch_size or global_batch, model_input_ranks, labels)
  return KerasData(train, validation, global_batch, from_arrays, validation_batch_size or 0)


def _check_even_stream(sizes: list[int], steps_per_epoch: int, batch: int) -> None:
  """A repeating dataset batched before its repeat (a short batch each pass; `sizes`: its first
  steps_per_epoch batches'): tfdp cuts its stream into steps of `batch` examples, so an epoch
  holds other examples than model.fit's (a probe), said in one warning."""
  if any(size != batch for size in sizes):
    logging.warning(errors.as_caller(
        f"x's batches are uneven within the stream (a batch of {min(sizes)} among the first "
        f"{steps_per_epoch}): tfdp batches its examples by {batch}, so an epoch takes "
        f"{steps_per_epoch * batch} examples where model.fit's takes {sum(sizes)}; batch after "
        ".repeat() (dataset.repeat().batch(n)) to keep its epochs"))


def _validation_source(validation_data, validation_steps, batch_size, model_input_ranks,
                       labels=True):
  """validation_steps counts the validation data's own batches, as Keras does: a batched
  dataset's, else batch_size (validation_batch_size or the training batch)."""
  content = None  # a dataset's contents are read, not digested
  if is_dataset(validation_data):
    if labels:
      _check_has_labels(validation_data, "validation_data")
    dataset, dataset_batch, counted, first_sizes = _unbatched(
        validation_data, model_input_ranks, "validation_data", validation_steps or 0)
    batch = dataset_batch or batch_size
    dataset, count = _count(dataset, validation_steps or 0, batch, "validation_data",
                            "validation_steps", counted)
    if validation_steps:  # Keras evaluates the first validation_steps batches: their examples
      if dataset_batch:  # their own sizes (a probe: a short one's gap was refilled)
        first_sizes = first_sizes or _batch_sizes(validation_data, validation_steps)
      count = min(count, sum(first_sizes) if dataset_batch else validation_steps * batch)
      dataset = dataset.take(count)
  elif isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):  # as Keras
    dataset, count, content = _from_arrays(
        validation_data[0], validation_data[1],
        validation_data[2] if len(validation_data) == 3 else None, "validation_data")
    if validation_steps:  # Keras evaluates the first validation_steps batches of the arrays
      count = min(count, validation_steps * batch_size)
      dataset = dataset.take(count)
  else:
    _check_kind(validation_data, "validation_data")  # a generator's own line (a probe)
    raise fail("validation_data", f"is a {type(validation_data).__name__}",
               "pass (x_val, y_val), (x_val, y_val, sample_weight) or a tf.data.Dataset")
  if not count:
    raise fail("validation_data", "is empty", "pass at least one example")
  return _source(dataset, count, {}, "validation", content)


def predict_source(x, model_input_ranks=()) -> data_lib.Source:
  """Inputs only, for tfdp.predict: arrays or a dataset (its labels kept if present)."""
  if x is None:
    raise fail("x", "is None", "pass the inputs to predict")
  content = None  # a dataset's contents are read, not digested
  if is_dataset(x):
    dataset, _, counted, _ = _unbatched(x, model_input_ranks)
    dataset, count = _count(dataset, 0, 1, "x", "steps", counted)
  else:
    dataset, count, content = _from_arrays(x, None, None, "x")
  if not count:
    raise fail("x", "is empty", "pass at least one example")
  return _source(dataset, count, {}, "predict", content)
