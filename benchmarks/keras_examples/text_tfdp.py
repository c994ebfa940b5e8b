"""keras.io "Text classification from scratch" (Mark Omernick, fchollet), on Shakespeare instead
of IMDB (no network here): which genre (comedy, history, tragedy) a 60-word passage comes from,
with the last play of each genre (sorted by name) held out for testing. The same model, with
`TextVectorization` applied in the tf.data pipeline, smaller (vocabulary, length, 3 epochs)."""
import os
import pathlib
import re
import string
import time

import keras
import numpy as np
import tensorflow as tf
import tfdp
tfdp.make_strategy(**({} if "TF_CONFIG" in os.environ else {"cpu_replicas": 2}))

PLAYS = pathlib.Path(os.environ.get("SHAKESPEARE_DIR", "/work/shared/text/shakespeare"))
GENRES = ["comedies", "histories", "tragedies"]
WORDS = 60


def passages(play: pathlib.Path) -> list[str]:
  """The spoken words of a play (no titles, speaker names or stage directions) in WORDS chunks."""
  lines = play.read_text().splitlines()
  words = " ".join(l for l in lines if l.strip() and not l.startswith(("#", "**", "_"))).split()
  return [" ".join(words[i:i + WORDS]) for i in range(0, len(words) - WORDS + 1, WORDS)]


def split(held_out: bool):
  texts, labels = [], []
  for label, genre in enumerate(GENRES):
    plays = sorted((PLAYS / genre).glob("*.md"))
    for play in plays[-1:] if held_out else plays[:-1]:
      chunks = passages(play)
      texts += chunks
      labels += [label] * len(chunks)
  return np.array(texts), np.array(labels, "int32")


batch_size = 32
(train_texts, train_labels), (test_texts, test_labels) = split(False), split(True)
raw_train_ds = tf.data.Dataset.from_tensor_slices((train_texts, train_labels)).shuffle(
    len(train_texts), seed=1337, reshuffle_each_iteration=False)
num_val = len(train_texts) // 5
raw_val_ds = raw_train_ds.take(num_val).batch(batch_size)
raw_train_ds = raw_train_ds.skip(num_val).batch(batch_size)
raw_test_ds = tf.data.Dataset.from_tensor_slices((test_texts, test_labels)).batch(batch_size)


def custom_standardization(input_data):
  lowercase = tf.strings.lower(input_data)
  return tf.strings.regex_replace(lowercase, f"[{re.escape(string.punctuation)}]", "")


max_features, embedding_dim, sequence_length = 10000, 64, WORDS
vectorize_layer = keras.layers.TextVectorization(
    standardize=custom_standardization, max_tokens=max_features, output_mode="int",
    output_sequence_length=sequence_length)
vectorize_layer.adapt(raw_train_ds.map(lambda x, y: x))


def vectorize_text(text, label):
  text = tf.expand_dims(text, -1)
  return vectorize_layer(text), label


train_ds = raw_train_ds.map(vectorize_text).cache().prefetch(buffer_size=10)
val_ds = raw_val_ds.map(vectorize_text).cache().prefetch(buffer_size=10)
test_ds = raw_test_ds.map(vectorize_text).cache().prefetch(buffer_size=10)

keras.utils.set_random_seed(0)
inputs = keras.Input(shape=(None,), dtype="int64")
x = keras.layers.Embedding(max_features, embedding_dim)(inputs)
x = keras.layers.Dropout(0.5)(x)
x = keras.layers.Conv1D(64, 7, padding="valid", activation="relu", strides=3)(x)
x = keras.layers.Conv1D(64, 7, padding="valid", activation="relu", strides=3)(x)
x = keras.layers.GlobalMaxPooling1D()(x)
x = keras.layers.Dense(64, activation="relu")(x)
x = keras.layers.Dropout(0.5)(x)
predictions = keras.layers.Dense(len(GENRES), activation="softmax", name="predictions")(x)
model = keras.Model(inputs, predictions)
model.compile(loss="sparse_categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
epochs = 3
start = time.perf_counter()
tfdp.fit(model, train_ds, validation_data=val_ds, epochs=epochs)
seconds = time.perf_counter() - start
score = model.evaluate(test_ds, verbose=0)
print(f"RESULT text test_accuracy={score[1]:.4f} fit_seconds={seconds:.1f} "
      f"examples_per_s={(len(train_texts) - num_val) * epochs / seconds:.0f} "
      f"train={len(train_texts) - num_val} test={len(test_texts)}")
