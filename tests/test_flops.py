"""Model FLOPs and MFU (tfdp.core.flops): the layer count against hand counts, the traced
graph's count against the layer count and hand counts, the CPU peak formula on given
/proc/cpuinfo facts, the GPU table, and where the numbers are shown (the training log's line,
tfdp-bench's throughput table). No training."""
import io
import math

import pytest

from tfdp import logs
from tfdp.bench import modes, report
from tfdp.core import flops
from tfdp.distributed import cpus


def tiny_cnn():
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top
  inputs = keras.Input((8, 8, 3))
  x = layers.Conv2D(4, 3, padding="same")(inputs)
  x = layers.ReLU()(layers.BatchNormalization()(x))
  x = layers.Conv2D(2, 1, strides=2, use_bias=False)(x)
  x = layers.GlobalAveragePooling2D()(x)
  return keras.Model(inputs, layers.Dense(5)(x))


# Multiply-adds by hand; 2 FLOPs each.
TINY_CNN_MACS = {"conv": 8 * 8 * 4 * (3 * 3 * 3),  # every output position x window x in
                 "1x1 stride 2": 4 * 4 * 2 * 4,
                 "dense": 2 * 5}


def test_a_tiny_cnn_counts_as_by_hand():
  count = flops.count_flops(tiny_cnn())
  assert count.forward_per_example == 2 * sum(TINY_CNN_MACS.values())
  assert count.training_per_example == 3 * 2 * sum(TINY_CNN_MACS.values())
  assert sorted(count.per_layer.values()) == sorted(2 * m for m in TINY_CNN_MACS.values())
  assert count.uncounted == []  # BatchNormalization is left out on purpose, not unknown


def test_a_nested_model_is_walked():
  import keras  # pylint: disable=g-import-not-at-top
  inner = tiny_cnn()
  inputs = keras.Input((8, 8, 3))
  outer = keras.Model(inputs, keras.layers.Dense(3)(inner(inputs)))
  assert (flops.count_flops(outer).forward_per_example
          == 2 * (sum(TINY_CNN_MACS.values()) + 5 * 3))


def test_a_functional_model_of_its_own_class_is_walked():
  """keras_hub's BertBackbone is a Functional subclass: it was taken for one uncounted layer."""
  import keras  # pylint: disable=g-import-not-at-top

  class Backbone(keras.Model):
    def __init__(self):
      inner = tiny_cnn()
      inputs = keras.Input((8, 8, 3))
      super().__init__(inputs, inner(inputs))

  inputs = keras.Input((8, 8, 3))
  count = flops.count_flops(keras.Model(inputs, keras.layers.Dense(3)(Backbone()(inputs))))
  assert count.uncounted == []
  assert count.forward_per_example == 2 * (sum(TINY_CNN_MACS.values()) + 5 * 3)


def test_attention_and_einsum_dense_count_as_by_hand():
  import keras  # pylint: disable=g-import-not-at-top
  tokens, width, heads, key_dim = 16, 8, 2, 4
  x = keras.Input((tokens, width))
  y = keras.layers.MultiHeadAttention(heads, key_dim)(x, x)
  y = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 5))(y)
  projections = 4 * tokens * width * heads * key_dim  # q, k, v in; back out to width
  scores_and_context = 2 * heads * tokens * tokens * key_dim
  assert flops.count_flops(keras.Model(x, y)).per_layer == {
      "multi_head_attention": 2 * (projections + scores_and_context),
      "einsum_dense": 2 * tokens * width * 5}


def with_a_layer_of_its_own():
  """Dense(2) after a weighted layer of a kind no count knows, named "s"."""
  import keras  # pylint: disable=g-import-not-at-top

  class Scale(keras.layers.Layer):
    def build(self, input_shape):
      self.w = self.add_weight(shape=(input_shape[-1],))

    def call(self, x):
      return x * self.w

  inputs = keras.Input((4,))
  return keras.Model(inputs, keras.layers.Dense(2)(Scale(name="s")(inputs)))


def test_a_layer_it_cannot_count_makes_the_count_unknown():
  count = flops.count_flops(with_a_layer_of_its_own())
  assert count.uncounted == ["s (Scale)"]
  assert math.isnan(count.training_per_example)


def test_resnet20_is_the_published_41_million_multiply_adds():
  from tfdp.workloads.vision import models  # pylint: disable=g-import-not-at-top
  count = flops.count_flops(models.build_model("resnet20", (32, 32, 3), 10))
  stem = 32 * 32 * 16 * 27
  stage1 = 6 * 32 * 32 * 16 * (9 * 16)
  stage2 = 16 * 16 * 32 * (9 * 16) + 5 * 16 * 16 * 32 * (9 * 32) + 16 * 16 * 32 * 16  # + 1x1
  stage3 = 8 * 8 * 64 * (9 * 32) + 5 * 8 * 8 * 64 * (9 * 64) + 8 * 8 * 64 * 32
  macs = stem + stage1 + stage2 + stage3 + 64 * 10
  assert count.forward_per_example == 2 * macs
  assert macs == pytest.approx(41e6, rel=0.02)  # He et al.'s "41M FLOPs" are multiply-adds


def write_cpuinfo(tmp_path, vendor, family, flags, siblings, cores, mhz):
  path = tmp_path / "cpuinfo"
  entry = (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
           f"model name\t: test cpu\ncpu MHz\t\t: {mhz}\nsiblings\t: {siblings}\n"
           f"cpu cores\t: {cores}\nflags\t\t: {flags}\n\n")
  path.write_text(entry + entry.replace("processor\t: 0", "processor\t: 1"))
  return str(path)


@pytest.fixture(autouse=True)
def no_onednn_isa_cap(monkeypatch):
  """The peaks below are the CPU's own, not those of a capped oneDNN (test_strategy has that)."""
  monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
  monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)


def test_zen4_peak_uses_256_bit_pipes_and_doubles_for_bfloat16(tmp_path):
  info = write_cpuinfo(tmp_path, "AuthenticAMD", 25, "fpu sse avx avx2 fma avx512f avx512_bf16",
                       2, 2, "2600.000")
  facts = cpus.cpu_facts(info, str(tmp_path / "no_cpufreq"), usable_cpus=2)
  assert (facts.cores, facts.mhz, flops.vector_bits(facts)) == (2, 2600.0, 256)
  fp32, how = flops.cpu_peak_flops(facts, "float32")
  assert fp32 == pytest.approx(2 * 2 * 8 * 2 * 2.6e9)
  assert "2 FMA units x 8 fp32 lanes" in how
  assert flops.cpu_peak_flops(facts, "mixed_bfloat16")[0] == pytest.approx(2 * fp32)


def test_intel_avx512_peak_counts_physical_cores_at_the_rated_clock(tmp_path):
  info = write_cpuinfo(tmp_path, "GenuineIntel", 6, "fpu avx avx2 fma avx512f", 16, 8, "1200.0")
  max_freq = tmp_path / "cpuinfo_max_freq"
  max_freq.write_text("3000000\n")  # kHz: the rated 3.0 GHz, not the idle 1.2
  facts = cpus.cpu_facts(info, str(max_freq), usable_cpus=4)  # 4 hyperthreads = 2 cores
  assert facts.cores == 2
  assert flops.cpu_peak_flops(facts)[0] == pytest.approx(2 * 2 * 16 * 2 * 3.0e9)
  # No native bfloat16: converted and computed in float32, at the float32 peak.
  assert flops.cpu_peak_flops(facts, "mixed_bfloat16")[0] == flops.cpu_peak_flops(facts)[0]


def test_without_fma_a_lane_does_one_flop_per_pipe(tmp_path):
  info = write_cpuinfo(tmp_path, "GenuineIntel", 6, "fpu sse avx", 1, 1, "2000.0")
  facts = cpus.cpu_facts(info, str(tmp_path / "none"), usable_cpus=1)
  assert flops.cpu_peak_flops(facts)[0] == pytest.approx(1 * 2 * 8 * 1 * 2.0e9)


def test_gpu_peaks_come_from_the_table_by_name():
  assert flops.gpu_peak_flops("NVIDIA H200", "mixed_bfloat16") == 989e12
  assert flops.gpu_peak_flops("NVIDIA A100-SXM4-80GB", "float32") == 156e12  # not the A10
  assert math.isnan(flops.gpu_peak_flops("Some New GPU"))


def test_progress_line_shows_flops_and_mfu():
  out = io.StringIO()
  progress = logs.Progress(10, 5, ["loss"], stream=out, flops_per_example=1e8, peak_flops=1e11)
  progress.start_epoch(0)
  progress.loop_done(2, 2, seconds=2.0, metrics={"loss": 1.5}, examples_per_sec=200.0, lr=0.1)
  assert out.getvalue().splitlines() == [
      "epoch 1/2 step 2/10 loss 1.5000 ex/s 200.0 GFLOP/s 20.0 MFU 20.0% lr 0.1 ETA 0:08"]
  unknown = logs.Progress(10, 5, ["loss"], stream=io.StringIO())
  assert unknown.flops_text(200.0) == ""


def test_throughput_report_carries_mfu(tmp_path, capsys):
  res = {"train_flops_per_example": 3e8, "examples_per_sec": 100.0, "peak_flops": 2e11,
         "precision": "float32", "peak_how": "2 cores"}
  used = modes.utilization(res)
  assert used["gflops_per_sec"] == pytest.approx(30.0)
  assert used["mfu"] == pytest.approx(0.15)
  row = {"model": "m", "strategy": "default", "replicas": 1, "global_batch": 8,
         "examples_per_sec": 100.0, "step_ms": 80.0, "input_wait_fraction": 0.1,
         "vs_keras_fit": 1.0, "peak_rss_mb": 500.0, **used, "cpu": "test", "nproc": 2,
         "tf_version": "2", "date": "today"}
  frame = report.write("throughput", [row], str(tmp_path), [])
  assert frame["mfu"].tolist() == [pytest.approx(0.15)]
  table = capsys.readouterr().out
  assert "mfu" in table.splitlines()[0] and "0.15" in table


def test_the_interactive_bar_shows_mfu(capsys):
  class Terminal(io.StringIO):
    def isatty(self):
      return True

  progress = logs.Progress(10, 5, ["loss"], stream=Terminal(), flops_per_example=1e8,
                           peak_flops=1e11)
  progress.start_epoch(0)
  progress.loop_done(5, 5, seconds=2.0, metrics={"loss": 1.5}, examples_per_sec=200.0, lr=0.1)
  assert "MFU: 0.2000" in capsys.readouterr().out


def test_a_sequence_of_unknown_length_is_unknown_not_an_error():
  import keras  # pylint: disable=g-import-not-at-top
  inputs = keras.Input((None, 4))
  x = keras.layers.Dense(2, name="d")(inputs)
  x = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 3), name="e")(x)
  count = flops.count_flops(keras.Model(inputs, x))
  assert count.uncounted == ["d (Dense)", "e (EinsumDense)"]
  assert math.isnan(count.training_per_example)


def test_einsum_dense_with_an_ellipsis_counts_the_dims_it_stands_for():
  import keras  # pylint: disable=g-import-not-at-top
  inputs = keras.Input((3, 4, 6))
  layer = keras.layers.EinsumDense("...c,cd->...d", output_shape=5, name="e")
  count = flops.count_flops(keras.Model(inputs, layer(inputs)))
  assert count.per_layer == {"e": 2 * 3 * 4 * 6 * 5}


def test_an_avx2_isa_cap_drops_the_bfloat16_doubling(tmp_path, monkeypatch):
  info = write_cpuinfo(tmp_path, "AuthenticAMD", 25, "fpu sse avx avx2 fma avx512f avx512_bf16",
                       2, 2, "2600.000")
  monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
  facts = cpus.cpu_facts(info, str(tmp_path / "no_cpufreq"), usable_cpus=2)
  assert flops.cpu_peak_flops(facts, "mixed_bfloat16")[0] == flops.cpu_peak_flops(facts)[0]


class _Spec:
  def __init__(self, workers):
    self.workers = workers

  def as_dict(self):
    return {"worker": self.workers}


class _MultiWorker:
  """What job_peak_flops reads of a MultiWorkerMirroredStrategy: one CPU device per worker."""

  def __init__(self, workers):
    self.num_replicas_in_sync = len(workers)
    self.extended = type("Extended", (), {"worker_devices": ["/job:worker/cpu:0"]})()
    self.cluster_resolver = type("Resolver", (), {"cluster_spec": lambda _: _Spec(workers)})()


def test_workers_on_one_host_share_its_cores_in_the_peak():
  """tfdp-launch's two workers on one 2-core machine were given a peak of '2 workers x 2 cores'
  (a cluster probe): MFU was halved. The peak counts hosts. Seen failing on the old flops.py."""
  one, how = flops.job_peak_flops(_MultiWorker(["127.0.0.1:1", "127.0.0.1:2"]), "float32")
  two, how_two = flops.job_peak_flops(_MultiWorker(["node1:2222", "node2:2222"]), "float32")
  assert two == pytest.approx(2 * one) and "2 hosts x" in how_two and "hosts" not in how


# ---- the traced count (a model the layer walk cannot count) --------------------------------------

def _spec(**shapes):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return {name: tf.TensorSpec(shape, dtype) for name, (shape, dtype) in shapes.items()}


def test_the_traced_graph_counts_what_the_layer_walk_counts():
  """Two independent counts of the same work: the layers' shapes, and the ops TensorFlow runs
  (a strided and a 1x1 conv, a depthwise conv, Dense on tokens, attention, ResNet-20)."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.workloads.vision import models  # pylint: disable=g-import-not-at-top
  tokens = keras.Input((16, 8))
  attention = keras.layers.MultiHeadAttention(2, 4)(tokens, tokens)
  text = keras.Model(tokens, keras.layers.Dense(3)(attention))
  depthwise_in = keras.Input((8, 8, 3))
  depthwise = keras.Model(depthwise_in, keras.layers.DepthwiseConv2D(3, depth_multiplier=2)(
      depthwise_in))
  for model, shape in ((tiny_cnn(), (None, 8, 8, 3)), (text, (None, 16, 8)),
                       (depthwise, (None, 8, 8, 3)),
                       (models.build_model("resnet20", (32, 32, 3), 10), (None, 32, 32, 3))):
    walked = flops.count_flops(model)
    assert not walked.uncounted and walked.forward_per_example > 0
    traced = flops.traced_forward_flops(lambda batch, m=model: m(batch["x"], training=False),
                                        _spec(x=(shape, tf.float32)))
    assert traced == walked.forward_per_example, model.name


def test_a_bert_masked_lm_is_counted_from_its_traced_graph_as_by_hand():
  """keras_hub's TransformerEncoder and the masked-LM head are layers the walk does not know:
  the masked-LM jobs had no MFU. The sequence length is the data's (the backbone's is None)."""
  import keras_hub  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  seq, hidden, heads, ffn, vocab, masks, layers = 32, 64, 4, 128, 1000, 5, 2
  backbone = keras_hub.models.BertBackbone(vocab, layers, heads, hidden, ffn,
                                           max_sequence_length=seq)
  model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
  assert flops.count_flops(model).uncounted  # the walk alone: unknown
  spec = _spec(token_ids=((None, seq), tf.int32), padding_mask=((None, seq), tf.bool),
               segment_ids=((None, seq), tf.int32), mask_positions=((None, masks), tf.int32),
               mask_labels=((None, masks), tf.int32))  # in the batch, not a model input
  inputs = lambda batch: {k: batch[k] for k in ("token_ids", "padding_mask", "segment_ids",
                                                "mask_positions")}
  encoder_layer = (4 * seq * hidden * hidden  # q, k, v, output projections
                   + 2 * seq * seq * hidden  # scores and context, over every head
                   + 2 * seq * hidden * ffn)  # the feed-forward block
  head = masks * (hidden * hidden + hidden * vocab)  # at the masked positions: dense, logits
  pooled = hidden * hidden  # the backbone's pooled [CLS] output, computed whether used or not
  assert flops.traced_forward_flops(lambda batch: model(inputs(batch), training=False), spec) == (
      2 * (layers * encoder_layer + head + pooled))


def test_a_loop_or_a_shape_known_only_at_run_time_leaves_the_traced_count_unknown():
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  inputs = keras.Input((6, 4))
  rnn = keras.Model(inputs, keras.layers.SimpleRNN(3)(inputs))  # its matmuls are in a loop body
  forward = lambda batch, m=rnn: m(batch["x"], training=False)
  assert flops.traced_forward_flops(forward, _spec(x=((None, 6, 4), tf.float32))) is None
  dense = keras.Sequential([keras.layers.Dense(2)])
  forward = lambda batch: dense(batch["x"])
  assert flops.traced_forward_flops(forward, _spec(x=((None, None, 4), tf.float32))) is None


def test_the_traced_count_is_asked_only_when_the_walk_cannot_count():
  asked = []

  def traced():
    asked.append(True)
    return 1000

  strategy = _MultiWorker(["h:1"])
  per_example, _, how = flops.training_flops_and_peak(tiny_cnn(), strategy, "float32", traced)
  assert per_example == 3 * 2 * sum(TINY_CNN_MACS.values()) and not asked
  unknown = with_a_layer_of_its_own()
  per_example, _, how = flops.training_flops_and_peak(unknown, strategy, "float32", traced)
  assert per_example == 3000 and asked and "traced forward graph" in how
  per_example, _, how = flops.training_flops_and_peak(unknown, strategy, "float32", lambda: None)
  assert math.isnan(per_example) and "FLOPs not counted: s (Scale)" in how


def test_transposed_matmuls_and_einsums_count_their_inner_dimension():
  """A layer of your own may call tf.matmul with adjoints or tf.einsum directly (an Einsum op;
  Keras's own einsums reach the graph as BatchMatMulV2)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def forward(batch):
    x = batch["x"]  # (1, 5, 3) traced
    return [tf.matmul(x, x, adjoint_a=True),  # (3, 5) x (5, 3): 3*3 outputs x 5
            tf.matmul(tf.reshape(x, (5, 3)), tf.ones((5, 2)), transpose_a=True),  # 3*2 x 5
            tf.einsum("...ij,...jk->...ik", x, tf.ones((1, 3, 2))),  # 5*2 outputs x 3
            tf.einsum("bij,bik->bjk", x, x)]  # 3*3 outputs x 5
  spec = _spec(x=((None, 5, 3), tf.float32))
  assert flops.traced_forward_flops(forward, spec) == 2 * (9 * 5 + 6 * 5 + 10 * 3 + 9 * 5)


def test_tracing_a_model_with_a_custom_gradient_leaves_no_graph_alive():
  """tf.custom_gradient registers each traced call's gradient function globally, holding its
  graph (tensorflow/tensorflow#97697): the throwaway trace must not stay in memory for good."""
  import gc  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @tf.custom_gradient
  def doubled(x):
    return x * 2, lambda dy: dy * 2

  inputs = keras.Input((4,))
  model = keras.Model(inputs, keras.layers.Lambda(doubled)(keras.layers.Dense(3)(inputs)))
  graphs = lambda: (gc.collect(), sum(type(o).__name__ == "FuncGraph" for o in gc.get_objects()))[1]
  before = graphs()
  spec = _spec(x=((None, 4), tf.float32))
  assert flops.traced_forward_flops(lambda batch: model(batch["x"]), spec) == 2 * 4 * 3
  assert graphs() == before
