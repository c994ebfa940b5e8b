"""How far from the limit: the model's FLOPs per example, counted once from its Keras layers, and
the peak FLOP/s of the devices it trains on; achieved / peak is the model-FLOPs utilization (MFU),
as torchtitan and MosaicML report it.

Convention: one multiply-add is 2 FLOPs. Counted: convolutions, Dense, EinsumDense and
MultiHeadAttention's two batched matmuls (scores, context). Not counted: BatchNorm, activations,
pooling, additions, softmax (a few FLOPs per activation, beside hundreds per output of a conv).
A training step costs 3x the forward pass (the backward pass computes two matmuls per forward
one: gradients of the inputs and of the weights). Rematerialization and the optimizer's update
are not model FLOPs, so MFU leaves them out by design.

Two counts of the same work: the layer walk (count_flops, from the layers' shapes), and for a
model with layers it does not know (keras_hub's TransformerEncoder, a user's own) the forward
graph traced on one example of the data (traced_forward_flops, from the ops' shapes).
"""
from __future__ import annotations

import dataclasses
import math
import re

from tfdp.distributed.cpus import CpuFacts, cpu_facts

TRAINING_OVER_FORWARD = 3
# Layers whose FLOPs are left out on purpose (see above); any other layer that holds weights
# and is not counted makes the count unknown rather than silently low.
IGNORED = ("BatchNormalization", "LayerNormalization", "GroupNormalization", "Embedding",
           "PositionEmbedding", "Normalization", "Rescaling")


def _size(dims) -> int:
  return math.prod(int(d) for d in dims)


def _shape(tensor) -> tuple:
  return tuple(tensor.shape)


def layer_forward_flops(layer) -> int | None:
  """Forward FLOPs per example of one called layer; None for a weighted layer it cannot count."""
  kind = type(layer).__name__
  if hasattr(layer, "kernel") and "Conv" in kind and "Transpose" not in kind:
    kernel = _shape(layer.kernel)  # (*window, in/groups, out); Depthwise: (*window, in, mult)
    out = _shape(layer.output)
    spatial = out[1:-1] if layer.data_format == "channels_last" else out[2:]
    return 2 * _size(spatial) * _size(kernel)  # per output position: window x in x out MACs
  if kind == "Dense":
    return 2 * _size(_shape(layer.input)[1:-1]) * _size(_shape(layer.kernel))
  if kind == "EinsumDense":
    return 2 * _einsum_macs(layer.equation, _shape(layer.input), _shape(layer.kernel))
  if kind == "MultiHeadAttention":
    return _attention_flops(layer)
  if kind in IGNORED or not layer.weights:
    return 0
  return None


def _einsum_macs(equation: str, input_shape: tuple, kernel_shape: tuple) -> int:
  """One MAC per combination of the equation's indices, the batch (the input's first) left out;
  a leading `...` stands for the input's dims after the batch. A dimension unknown until run
  (None) raises TypeError: the count is unknown."""
  inputs, _ = equation.replace(" ", "").split("->")
  left, right = inputs.split(",")
  if left.startswith("..."):
    left = left[3:]
    extra = _size(input_shape[1:len(input_shape) - len(left)])
    sizes = dict(zip(left, input_shape[len(input_shape) - len(left):]))
  else:
    extra, sizes = 1, dict(zip(left[1:], input_shape[1:]))
  sizes.update(zip(right, kernel_shape))
  return extra * _size(sizes.values())


def _attention_flops(layer) -> int:
  """Q, K, V and output projections plus QK^T and scores x V, per example."""
  query, value = _shape(layer.input[0]), _shape(layer.input[1])
  key = _shape(layer.input[2]) if len(layer.input) > 2 else value
  heads, key_dim, value_dim = layer.num_heads, layer.key_dim, layer.value_dim or layer.key_dim
  tq, tk = _size(query[1:-1]), _size(key[1:-1])
  out_dim = _shape(layer.output if not isinstance(layer.output, (list, tuple)) else
                   layer.output[0])[-1]
  macs = (tq * query[-1] * heads * key_dim + tk * key[-1] * heads * key_dim
          + tk * value[-1] * heads * value_dim + tq * heads * value_dim * out_dim
          + heads * tq * tk * key_dim + heads * tq * tk * value_dim)
  return 2 * macs


@dataclasses.dataclass
class FlopCount:
  forward_per_example: int
  per_layer: dict[str, int]
  uncounted: list[str]  # weighted layers of a kind this module does not know: count unknown

  @property
  def training_per_example(self) -> float:
    """NaN when some layer could not be counted: an MFU from part of the model would mislead."""
    if self.uncounted:
      return math.nan
    return float(TRAINING_OVER_FORWARD * self.forward_per_example)


def count_flops(model) -> FlopCount:
  """The forward FLOPs per example of a built functional/Sequential Keras model (nested models
  are walked); each layer is counted at its first call."""
  per_layer, uncounted = {}, []

  def walk(container, prefix):
    for layer in container.layers:
      name = prefix + layer.name
      # A functional model of its own class (keras_hub's BertBackbone) is one too: Keras puts
      # Functional among its bases when it is built from inputs and outputs.
      if hasattr(layer, "layers") and {"Functional", "Sequential"} & {
          c.__name__ for c in type(layer).__mro__}:
        walk(layer, name + "/")
        continue
      try:
        flops = layer_forward_flops(layer)
      # Never called symbolically (no shapes), or a dimension unknown until run (None).
      except (AttributeError, ValueError, TypeError):
        flops = None
      if flops is None:
        uncounted.append(f"{name} ({type(layer).__name__})")
      elif flops:
        per_layer[name] = flops

  walk(model, "")
  return FlopCount(sum(per_layer.values()), per_layer, uncounted)


# ---- the traced count: a model of layers the walk does not know ---------------------------------

# Ops whose multiply-adds are counted from their shapes; the same work the layer walk counts
# (a Dense on 3-D inputs is a MatMul, attention's einsums become BatchMatMulV2, a Conv1D a Conv2D).
_CONTRACTIONS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D",
                 "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
                 "Conv3DBackpropInputV2")
# Ops whose bodies are other graphs (an RNN's loop, a nested tf.function): not walked, so a graph
# holding one has an unknown count.
_BODIES = ("While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
           "PartitionedCall", "StatefulPartitionedCall")


def traced_forward_flops(forward, element_spec) -> int | None:
  """Forward FLOPs per example of `forward(batch)` (the model on a task's batch), from its graph
  traced on one example of zeros shaped as `element_spec` (the training data's; a distributed
  iterator's per-replica spec, its first replica's). Counts the multiply-adds of the matmuls,
  einsums and convolutions, as the layer walk does; None where the count is unknown: a shape
  known only at run time, a loop or nested function in the graph, a model that fails on zeros."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.distributed import compat  # pylint: disable=g-import-not-at-top

  def one_example(spec):
    spec = tf.nest.flatten(spec, expand_composites=True)[0]  # a PerReplicaSpec: one replica's
    if not isinstance(spec, tf.TensorSpec) or None in spec.shape[1:]:
      raise TypeError("not a dense tensor of known shape")
    shape = [1, *spec.shape[1:]] if spec.shape.rank else []
    return tf.fill(shape, "") if spec.dtype == tf.string else tf.zeros(shape, spec.dtype)

  try:
    # A tf.custom_gradient in the model would keep this throwaway graph alive for good.
    trace = compat.custom_gradients_dropped(
        lambda: forward(tf.nest.map_structure(one_example, element_spec)))
    graph = tf.function(trace, autograph=False).get_concrete_function().graph
    macs = 0
    for op in graph.get_operations():
      if op.type in _BODIES:
        return None
      if op.type in _CONTRACTIONS:
        macs += _op_macs(op)
    return 2 * macs
  except Exception:  # pylint: disable=broad-except  (an MFU is never worth a failed run)
    return None


def _op_macs(op) -> int:
  dims = lambda tensor: [int(d) for d in tensor.shape]  # TypeError on an unknown dimension
  out = _size(dims(op.outputs[0]))
  kind = op.type
  if kind == "MatMul":
    a = dims(op.inputs[0])
    return out * (a[0] if op.get_attr("transpose_a") else a[1])
  if kind.startswith("BatchMatMul"):
    a = dims(op.inputs[0])
    return out * (a[-2] if op.get_attr("adj_x") else a[-1])
  if kind == "Einsum":
    return out * _size(_einsum_contracted(op.get_attr("equation").decode(),
                                          [dims(t) for t in op.inputs]).values())
  if kind in ("Conv2D", "Conv3D"):  # filter (*window, in/groups, out)
    return out * _size(dims(op.inputs[1])[:-1])
  if kind == "DepthwiseConv2dNative":  # filter (h, w, in, multiplier): one input channel each
    return out * _size(dims(op.inputs[1])[:2])
  # Conv2DBackpropInput / Conv3DBackpropInputV2 (a transposed convolution's forward pass): every
  # input position meets the whole filter (*window, out, in).
  return _size(dims(op.inputs[2])[:-1]) * _size(dims(op.inputs[1]))


def _einsum_contracted(equation: str, shapes: list) -> dict:
  """{letter: size} of the letters summed over (in an input, not in the output)."""
  inputs, output = equation.replace(" ", "").split("->")
  sizes = {}
  for letters, shape in zip(inputs.split(","), shapes):
    letters = letters.replace("...", "")  # broadcast dims are kept in the output: not contracted
    sizes.update(zip(letters, shape[len(shape) - len(letters):]))
  return {letter: size for letter, size in sizes.items() if letter not in output}


# ---- peaks ---------------------------------------------------------------------------------------

# Two FMA pipes per core on every x86 core since Haswell / Zen 2 (Intel Xeon Bronze and some
# Silver have one 512-bit FMA unit: their peak is half this).
FMA_UNITS_PER_CORE = 2


def vector_bits(facts: CpuFacts) -> int:
  """The width the FMA pipes compute in one cycle. Zen 4 (AMD family 25) runs AVX-512 as two
  256-bit halves; Zen 5 (family 26) and Intel's AVX-512 cores have full 512-bit pipes."""
  if "avx512f" in facts.flags and not (facts.vendor == "AuthenticAMD" and facts.family < 26):
    return 512
  if "avx2" in facts.flags or "avx" in facts.flags:
    return 256
  return 128


def cpu_peak_flops(facts: CpuFacts, precision: str = "float32") -> tuple[float, str]:
  """(peak FLOP/s, how): cores x FMA pipes x float32 lanes x 2 (an FMA is 2 FLOPs) x clock.
  bfloat16 (mixed_bfloat16) with AVX512-BF16: VDPBF16PS multiplies two bfloat16 pairs per float32
  lane and adds both into it, 2x the float32 rate in the same pipes; with AMX-BF16 a core's tile
  unit does 1024 bfloat16 FMAs per cycle. Without either, bfloat16 is converted and computed in
  float32: the float32 peak."""
  lanes = vector_bits(facts) // 32
  per_fma = 2 if "fma" in facts.flags else 1  # no FMA: separate multiply and add pipes
  ghz = facts.mhz / 1000.0 or math.nan  # no clock reported: no peak
  how = (f"{facts.cores} cores x {FMA_UNITS_PER_CORE} FMA units x {lanes} fp32 lanes x "
         f"{per_fma} x {ghz:.2f} GHz")
  per_cycle = FMA_UNITS_PER_CORE * lanes * per_fma
  if "bfloat16" in precision:
    if "amx_bf16" in facts.flags:
      per_cycle, how = 2048, f"{facts.cores} cores x AMX 1024 bf16 FMA x 2 x {ghz:.2f} GHz"
    elif "avx512_bf16" in facts.flags:
      per_cycle, how = 2 * per_cycle, how + " x 2 (AVX512-BF16: 2 bf16 pairs per fp32 lane)"
  return facts.cores * per_cycle * ghz * 1e9, how


# Dense peaks per GPU, TFLOP/s: (float32 as TensorFlow runs it: TF32 tensor cores from Ampere on,
# which TensorFlow enables by default; 16-bit tensor cores). From NVIDIA's data sheets (SXM parts).
GPU_PEAK_TFLOPS = {"H200": (494.0, 989.0), "H100": (494.0, 989.0), "A100": (156.0, 312.0),
                   "A10": (62.5, 125.0), "L40S": (183.0, 362.0), "L4": (60.0, 121.0),
                   "V100": (15.7, 125.0), "T4": (8.1, 65.0)}


def gpu_peak_flops(device_name: str, precision: str = "float32") -> float:
  """NaN for a GPU not in the table."""
  for name, (fp32, half) in GPU_PEAK_TFLOPS.items():
    if re.search(rf"\b{name}\b", device_name):
      return (half if precision.startswith("mixed") else fp32) * 1e12
  return math.nan


def _machines(strategy, workers: int) -> int:
  """Distinct hosts among a multi-worker strategy's workers (tfdp-launch's share one machine's
  cores); `workers` where the strategy names none."""
  try:
    spec = strategy.cluster_resolver.cluster_spec().as_dict()
  except (AttributeError, ValueError):  # single-process strategies have no resolver
    return workers
  hosts = {address.rpartition(":")[0] for job in ("chief", "worker")
           for address in spec.get(job, [])}
  return len(hosts) or workers


def job_peak_flops(strategy, precision: str) -> tuple[float, str]:
  """The peak of every device the strategy trains on: its GPUs' table peaks, or the CPU cores
  (logical CPU replicas, and workers on one host, share them) of each host."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    devices = list(strategy.extended.worker_devices)
  except RuntimeError:  # the default strategy: one device, where TensorFlow places ops
    devices = ["/gpu:0" if tf.config.list_logical_devices("GPU") else "/cpu:0"]
  workers = max(1, strategy.num_replicas_in_sync // max(1, len(devices)))
  gpus = tf.config.list_physical_devices("GPU")
  if any("GPU" in d.upper() for d in devices) and gpus:
    name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
    used = sum("GPU" in d.upper() for d in devices)
    return used * workers * gpu_peak_flops(name, precision), f"{workers * used} x {name}"
  peak, how = cpu_peak_flops(cpu_facts(), precision)
  hosts = _machines(strategy, workers)
  return hosts * peak, (f"{hosts} hosts x " if hosts > 1 else "") + how


def mfu(flops_per_example: float, examples_per_sec: float, peak: float) -> float:
  return flops_per_example * examples_per_sec / peak if peak else math.nan


def training_flops_and_peak(model, strategy, precision: str,
                            traced_forward=None) -> tuple[float, float, str]:
  """(training FLOPs per example, the job's peak FLOP/s, how the peak was made); NaN for what is
  unknown (a layer no count knows, a GPU not in the table). `traced_forward`: a callable giving
  traced_forward_flops for the job's data, asked only when the layer walk leaves layers
  uncounted (keras_hub's TransformerEncoder; a layer of your own)."""
  count = count_flops(model)
  per_example = count.training_per_example
  peak, how = job_peak_flops(strategy, precision)
  if count.uncounted:
    traced = traced_forward() if traced_forward else None
    if traced:
      per_example = float(TRAINING_OVER_FORWARD * traced)
      how += "; FLOPs counted in the traced forward graph"
    else:
      how += f"; FLOPs not counted: {', '.join(count.uncounted[:3])}"
  return per_example, peak, how


def trainer_flops_and_peak(trainer, data_spec) -> tuple[float, float, str]:
  """training_flops_and_peak for a trainer; `data_spec()` gives its training data's element
  spec, asked only when the layer walk cannot count the model."""
  forward = lambda batch: trainer.model(trainer.task.model_inputs(batch), training=False)
  return training_flops_and_peak(trainer.model, trainer.strategy, trainer.precision,
                                 lambda: traced_forward_flops(forward, data_spec()))
