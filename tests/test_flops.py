"""Model FLOPs and MFU (tfdp.core.flops): the layer count against hand counts, the CPU peak
formula on given /proc/cpuinfo facts, the GPU table, and where the numbers are shown (the
training log's line, tfdp-bench's throughput table). No training."""
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


def test_a_layer_it_cannot_count_makes_the_count_unknown():
  import keras  # pylint: disable=g-import-not-at-top

  class Scale(keras.layers.Layer):
    def build(self, input_shape):
      self.w = self.add_weight(shape=(input_shape[-1],))

    def call(self, x):
      return x * self.w

  inputs = keras.Input((4,))
  count = flops.count_flops(keras.Model(inputs, keras.layers.Dense(2)(Scale(name="s")(inputs))))
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
