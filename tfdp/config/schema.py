"""The experiment config's schema: typed task / trainer / runtime dataclasses and their choices.

Only data here (no loading, no checks, no TensorFlow): every module may import it.
"""
from __future__ import annotations

import dataclasses

DATA_SOURCES = ("tfds", "image_folder", "tfrecord", "synthetic", "text_folder", "text_files",
                "interactions", "keras")  # keras: the arrays or dataset given to tfdp.fit
SHARD_POLICIES = ("auto", "file", "data", "off", "tfds_split", "local")
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker_mirrored")
CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduce_to_one_device")
ALL_REDUCE = ("auto", "ring", "nccl")
OPTIMIZERS = ("sgd", "adagrad", "adam", "adamw", "lamb", "muon")
LR_SCHEDULES = ("constant", "cosine", "step", "linear", "polynomial")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16", "auto")
MODES = ("train", "eval", "train_and_eval")
FLIPS = ("random", "alternating")


@dataclasses.dataclass
class DataConfig:
  """Where examples come from and how they are prepared."""
  source: str = "tfds"  # one of DATA_SOURCES
  name: str = "cifar10"  # TFDS dataset name
  split: str = "train"  # TFDS split, slicing allowed: "train[:5000]"; text: all | train | holdout
  data_dir: str = ""  # TFDS data_dir; empty: $TFDS_DATA_DIR, then ~/tensorflow_datasets
  path: str = ""  # image_folder / text_folder root, or a tfrecord / text file glob
  text_unit: str = "document"  # text: document (a file), speech (plays: one per speaker turn) or
  # passage (plays: a play's speeches in order, cut into sequence_length-token passages)
  holdout: list[str] = dataclasses.field(default_factory=list)  # text: files (no extension) of
  # split holdout and left out of split train, e.g. whole plays held out for evaluation
  user_column: str = "user"  # interactions (CSV columns or TFRecord features)
  item_column: str = "item"
  label_column: str = ""  # a rating; empty: implicit feedback (every row a positive)
  weight_column: str = ""
  holdout_fraction: float = 0.0  # interactions: rows (by a stable hash of user and item) of split
  # holdout, left out of split train; all: every row
  image_key: str = "image"  # tfrecord feature names
  label_key: str = "label"
  image_size: int = 0  # resize to this square size; 0: tfds and tfrecord keep the source size,
  # image_folder resizes every image to its first image's size (which must be square)
  num_classes: int = 0  # 0: read from the source
  num_examples: int = 0  # synthetic only
  augment: bool = False  # random crop (crop_padding-pixel pad) + horizontal flip
  crop_padding: int = 4  # augment: the crop's reflect padding, i.e. the largest shift in pixels
  flip: str = "random"  # augment: random (each example, each epoch) or alternating (airbench: a
  # fixed random half of the images flipped in even epochs, the other half in odd ones)
  shuffle: bool = True  # training: a new order each epoch (seeded); false keeps the source order
  cache: bool = True  # keep decoded images in memory after the first epoch, if they fit
  shuffle_buffer: int = 0  # 0: the whole dataset (exact shuffle) when cached, else 10000
  mean: list[float] = dataclasses.field(default_factory=lambda: [0.5, 0.5, 0.5])
  std: list[float] = dataclasses.field(default_factory=lambda: [0.25, 0.25, 0.25])
  shard_policy: str = "auto"  # one of SHARD_POLICIES, used with several workers; local: each
  # worker reads only its own files (a path with {worker}), never another's
  shards_per_worker: int = 0  # local ({worker} path): worker i reads shards i*k..i*k+k-1 (the
  # shard count is the data's: fewer workers than shards); 0: shard i, one per worker
  worker_shards: list[list[int]] = dataclasses.field(default_factory=list)  # local: the shards
  # each worker reads, e.g. [[0, 1], [2]]; every shard once; empty: shards_per_worker decides
  deterministic: bool = True  # tf.data element order; False may be faster
  threadpool_size: int = 0  # tf.data private thread pool; 0: TF's shared pool


@dataclasses.dataclass
class ModelConfig:
  name: str = "resnet20"  # a name from tfdp.workloads.vision.models.registered_models()
  module: str = ""  # a Python module to import first; it may @tfdp.register_model its own
  kwargs: dict = dataclasses.field(default_factory=dict)  # passed to the builder


@dataclasses.dataclass
class TextConfig:
  """Tokenization and masking for the text tasks."""
  vocab_path: str = ""  # WordPiece vocabulary; empty: configs/vocab/shakespeare_wordpiece.txt
  lowercase: bool = True
  sequence_length: int = 128
  mask_rate: float = 0.15  # masked_lm: tokens chosen per sequence (80% [MASK], 10% random, 10% kept)
  max_predictions: int = 0  # masked_lm: prediction slots; 0: ceil(mask_rate * sequence_length)


@dataclasses.dataclass
class RecommenderConfig:
  """How user and item ids become embedding rows, the same on every worker."""
  user_vocab_path: str = ""  # one id per line (apps/split_interactions.py writes them); empty:
  item_vocab_path: str = ""  # hash ids into *_buckets rows instead
  user_buckets: int = 4096
  item_buckets: int = 4096
  oov_buckets: int = 8  # with a vocabulary: rows for ids first seen while fine-tuning


@dataclasses.dataclass
class TaskConfig:
  """What is learned: the workload (a registered task), its model, data and loss."""
  name: str = "image_classification"  # one of tfdp.core.task.registered_tasks()
  module: str = ""  # a Python module to import first; it may @tfdp.register_task its own
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  train_data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(augment=True))
  eval_data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(split="test"))
  label_smoothing: float = 0.0
  eval_flip: bool = False  # image classification: evaluate on the mean logits of each image and
  # its mirror image (test-time augmentation)
  eval_translate: int = 0  # >0: image classification also evaluates each image shifted this many
  # pixels up-left and down-right (reflect-padded); logits = 1/2 the unshifted views' + 1/4 each
  # shifted one's (airbench's tta_level 2 with eval_flip and 1); 0: off
  text: TextConfig = dataclasses.field(default_factory=TextConfig)
  recommender: RecommenderConfig = dataclasses.field(default_factory=RecommenderConfig)
  init_checkpoint: str = ""  # warm start: a run's model_dir (or checkpoint prefix) to take the
  # encoder from; the task's new head starts fresh


@dataclasses.dataclass
class OptimizerConfig:
  name: str = "sgd"
  momentum: float = 0.9
  nesterov: bool = True
  weight_decay: float = 5e-4  # decoupled, applied by the optimizer on every replica alike
  beta_1: float = 0.9
  beta_2: float = 0.999
  epsilon: float = 1e-7  # adam/adamw/lamb (BERT uses 1e-6)
  norm_bias_lr_multiplier: float = 1.0  # sgd: BatchNormalization's beta learns at this multiple
  # of the learning rate (airbench: 64); its gradient is scaled before the update, exact for
  # SGD's momentum and Nesterov; the decoupled weight decay (which skips biases) is unchanged
  # muon (airbench94_muon's, tfdp/core/muon.py): conv kernels take Muon's orthogonalized step at
  # filter_lr with filter_momentum; the rest SGD at head_lr (matrices) or bias_lr (vectors) with
  # `momentum` (Nesterov always), in airbench's units (a loss summed over the global batch;
  # weight_decay is the coupled decay per step); the schedule gives the fraction of each lr
  # (learning_rate.base_lr, not scaled with the batch under muon)
  filter_lr: float = 0.24
  filter_momentum: float = 0.6
  head_lr: float = 0.67
  bias_lr: float = 0.053


@dataclasses.dataclass
class LearningRateConfig:
  """lr = base_lr * global_batch_size / base_batch_size (linear scaling), warmup, then decay."""
  base_lr: float = 0.1
  base_batch_size: int = 128
  schedule: str = "cosine"
  warmup_epochs: float = 0.0
  decay_epochs: list[float] = dataclasses.field(default_factory=list)  # "step" boundaries
  decay_rate: float = 0.1  # "step" factor
  final_lr_fraction: float = 0.0  # "cosine"/"linear"/"polynomial" end, as a fraction of the peak
  power: float = 1.0  # "polynomial": (1 - progress) ** power; 1 is linear


@dataclasses.dataclass
class TrainerConfig:
  """How it is learned: batch, epochs, schedule, checkpoints."""
  global_batch_size: int = 128  # examples per optimizer step, over all replicas and micro-steps
  eval_batch_size: int = 0  # 0: global_batch_size
  gradient_accumulation_steps: int = 1  # micro-batches per optimizer step: the same global batch
  # (and trajectory) on fewer replicas, as NVIDIA's BERT recipes keep it fixed
  gradient_clip_norm: float = 0.0  # >0: clip the all-reduced gradient to this global norm
  epochs: int = 1
  max_steps: int = 0  # >0 stops after this many steps in all (smoke runs)
  steps_per_epoch: int = 0  # >0: an epoch (evaluation, checkpoint, metrics row) is this many
  # steps, the data streaming on across its passes (Keras's steps_per_epoch); 0: one pass
  steps_per_loop: int = 50  # steps per compiled call (tf.function with a tf.range loop)
  eval_every_epochs: int = 1
  eval_at_end: bool = True  # also after the last epoch when eval_every_epochs skips it
  # (tfdp.fit: off, as model.fit's validation_freq)
  checkpoint_every_steps: int = 0  # 0: at the end of every epoch only
  max_checkpoints: int = 3
  export_model: bool = True
  precise_bn_batches: int = 0  # >0: before each evaluation (and at the end), BatchNorm's moving
  # statistics are recomputed as the average over this many training batches with the weights
  # frozen, across replicas and workers (PreciseBN); 0 keeps the moving averages
  ema_decay: float = 0.0  # >0: evaluate and export an exponential moving average of the weights
  # (Keras's optimizer EMA; the checkpoint carries it); 0: the weights themselves
  lookahead_every_steps: int = 0  # >0: lookahead (Zhang et al. 2019; airbench: 5): every k steps
  # slow += (1 - d) * (weights - slow), then weights = slow, with d = lookahead_decay ** k *
  # (step / total_steps) ** 3; after the last step the weights are the slow ones. 0: off
  lookahead_decay: float = 0.95  # per step; see lookahead_every_steps
  stop_on_nan: bool = True  # a non-finite loss or metric stops the run, keeping the last good
  # checkpoint (no weights are saved after it)
  seed: int = 42
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  learning_rate: LearningRateConfig = dataclasses.field(default_factory=LearningRateConfig)


@dataclasses.dataclass
class RuntimeConfig:
  """Where it runs: strategy, devices, collectives, precision, threads."""
  strategy: str = "auto"
  devices: list[str] = dataclasses.field(default_factory=list)  # mirrored: e.g. ["/gpu:0", "/gpu:1"]
  cpu_replicas: int = 0  # >0: split the CPU into this many logical devices (one replica each)
  cross_device_ops: str = "auto"  # mirrored all-reduce
  num_packs: int = 1  # mirrored nccl/hierarchical_copy: gradients packed into this many chunks
  all_reduce: str = "auto"  # multi_worker_mirrored collective implementation
  bytes_per_pack: int = 0  # 0: TF's default gradient packing
  all_reduce_order: str = "variables"  # backward: gradients go to the all-reduce last layer
  # first, as backprop finishes them, so a pack (bytes_per_pack) can start before the backward
  # pass ends (DDP's buckets); variables: the model's variable order
  collective_timeout_seconds: float = 0.0  # >0: a collective waiting longer fails the step (the
  # group restarts); 0: none. Not on by default: TF 2.21 gives every collective a detached thread
  # that sleeps the whole timeout (Env::SchedClosureAfter), and a run with many collectives per
  # second ran out of threads here (std::system_error EAGAIN); runtime.watchdog_seconds bounds a
  # stuck training loop instead
  heartbeat_timeout_seconds: float = 30.0  # multi-worker: a silent worker counts as dead after this
  startup_timeout_seconds: float = 600.0  # multi-worker: every worker must have joined within
  # this while the strategy is made, else this one names who did not and exits 203 (restart);
  # 0: wait for ever (TF's own behaviour)
  dense_embedding_gradients: bool = False  # all-reduce embedding gradients dense (TF all-gathers
  # sparse IndexedSlices instead: their cost grows with the workers; dense costs the table size)
  mixed_precision: str = "float32"  # auto: mixed_float16 on GPUs with tensor cores,
  # mixed_bfloat16 on CPUs with native bfloat16 (AVX512-BF16/AMX), else float32
  all_reduce_dtype: str = "float32"  # bfloat16: gradients cross replicas and workers in half
  # the bytes (cast before the sum, back after); variables and optimizer stay float32
  jit_compile: bool = False
  intra_op_threads: int = 0  # 0: TensorFlow's default
  inter_op_threads: int = 0
  checkpoint_on_preemption: bool = True  # SIGTERM: save a checkpoint and exit
  watchdog_seconds: float = 120.0  # a training loop running longer than max(10 x the median
  # loop time, this) (the first loop: 5 x this) dumps the worker's Python stacks and exits with
  # code 203 (errors.EXIT_RESTART_GROUP), so that tfdp-launch --max_restarts restarts the group;
  # 0: no watchdog
  profile_steps: int = 0  # >0: profiler trace of this many steps (from the 2nd loop) in model_dir/train


@dataclasses.dataclass
class ExperimentConfig:
  task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
  trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
  runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
