"""A plain TensorFlow reference for tfdp's training step, outside tfdp's input pipeline,
trainer and optimizer set-up: the same model and real examples (no padding, no mask), the
documented loss (sum over real examples / global batch + L2), the learning rate written out
(linear scaling, warmup, cosine) and SGD with Nesterov momentum and decoupled weight decay
written out. tfdp trains the same config over OVERRIDES' replicas; both end weights are saved.

  python tests/scripts/reference.py MODEL_DIR OVERRIDES OUT_DIR
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # pylint: disable=g-import-not-at-top

from tfdp import config as config_lib  # pylint: disable=g-import-not-at-top
from tfdp.core import data as data_lib  # pylint: disable=g-import-not-at-top
from tfdp.core import experiment  # pylint: disable=g-import-not-at-top


def reference_learning_rate(step, cfg, steps_per_epoch, total_steps):
  lr = cfg.trainer.learning_rate
  peak = lr.base_lr * cfg.trainer.global_batch_size / lr.base_batch_size
  warmup = round(lr.warmup_epochs * steps_per_epoch)
  if step < warmup:
    return peak * (step + 1) / warmup
  progress = min(max((step - warmup) / max(total_steps - warmup, 1), 0.0), 1.0)
  return peak * 0.5 * (1 + math.cos(math.pi * progress))


def main():
  model_dir, overrides, out_dir = sys.argv[1:4]
  cfg = config_lib.load_config([], [overrides])
  assert not cfg.task.train_data.shuffle and not cfg.task.train_data.augment
  assert cfg.trainer.optimizer.name == "sgd" and cfg.trainer.optimizer.nesterov
  exp = experiment.build(cfg, model_dir, "train")
  initial = [np.asarray(v) for v in exp.trainer.model.trainable_variables]
  exp.run()
  tfdp_final = {v.path: np.asarray(v) for v in exp.trainer.model.trainable_variables}

  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  data = cfg.task.train_data
  source = data_lib.make_source(data)
  images, labels = zip(*[(ex["image"].numpy(), ex["label"].numpy())
                         for ex in source.read(list(range(len(source.file_counts))))])
  images = (np.stack(images).astype(np.float32) / 255.0 - data.mean) / data.std
  labels = np.array(labels)
  model = keras.models.clone_model(exp.trainer.model)  # same architecture, outside any strategy
  for variable, value in zip(model.trainable_variables, initial):
    variable.assign(value)
  batch = cfg.trainer.global_batch_size
  steps_per_epoch = math.ceil(len(labels) / batch)
  total = steps_per_epoch * cfg.trainer.epochs
  opt = cfg.trainer.optimizer
  velocity = [np.zeros_like(v) for v in initial]
  step = 0
  for _ in range(cfg.trainer.epochs):
    for start in range(0, len(labels), batch):  # the last batch holds only the real remainder
      x, y = images[start:start + batch], labels[start:start + batch]
      with tf.GradientTape() as tape:
        logits = model(x, training=True)
        per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        loss = tf.reduce_sum(per_example) / batch + tf.add_n(model.losses)
      grads = tape.gradient(loss, model.trainable_variables)
      lr = reference_learning_rate(step, cfg, steps_per_epoch, total)
      for i, (variable, grad) in enumerate(zip(model.trainable_variables, grads)):
        w, g = np.asarray(variable), grad.numpy()
        if len(w.shape) > 1:  # decoupled weight decay skips biases and normalization
          w = w - w * opt.weight_decay * lr
        velocity[i] = opt.momentum * velocity[i] - lr * g
        variable.assign(w + opt.momentum * velocity[i] - lr * g)
      step += 1
  assert step == exp.trainer.global_step, (step, exp.trainer.global_step)
  reference = {v.path: np.asarray(v) for v in model.trainable_variables}
  np.savez(os.path.join(out_dir, "tfdp.npz"), **tfdp_final)
  np.savez(os.path.join(out_dir, "reference.npz"), **reference)
  np.savez(os.path.join(out_dir, "initial.npz"),
           **{v.path: w for v, w in zip(model.trainable_variables, initial)})


if __name__ == "__main__":
  main()
