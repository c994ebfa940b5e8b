import sys, time
import tensorflow as tf
from tfdp import config as config_lib
from tfdp.core import experiment
over = sys.argv[1:]
config = config_lib.load_config(["configs/cifar10_quick.yaml"], over)
exp = experiment.build(config, "/tmp/thr/evalprobe_dir2", "train_and_eval", verbose=False)
for i in range(2):
  t = time.time(); n = 0
  for b in exp.eval_dataset:
    n += 1
  print("input only", i, round(time.time() - t, 2), n, flush=True)
model = exp.trainer.model
x = tf.random.normal([1000, 32, 32, 3])
f = tf.function(lambda x: model(x, training=False))
f(x)
t = time.time()
for _ in range(10): f(x).numpy()
print("forward 10x1000 one device", round(time.time() - t, 2))
for i in range(2):
  t = time.time(); r = exp.evaluate(); print("eval", i, round(time.time() - t, 2), int(r.examples), flush=True)
