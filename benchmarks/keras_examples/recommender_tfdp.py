"""keras.io "Collaborative Filtering for Movie Recommendations" (Siddhartha Banerjee), on
InstEval instead of MovieLens (no network here): students rate lecturers 1-5. The same
subclassed RecommenderNet, loss, optimizer and fit call; 3 epochs on 40,000 ratings. The data
(GPL) is read where it lies, never copied."""
import os
import time

import keras
import numpy as np
import pandas as pd
from keras import layers
from keras import ops
import tfdp
strategy = tfdp.make_strategy(**({} if "TF_CONFIG" in os.environ else {"cpu_replicas": 2}))

df = pd.read_csv(os.environ.get("INSTEVAL_CSV", "/work/shared/interactions/insteval/InstEval.csv"))
df = df.sample(frac=1, random_state=42).head(44444)
user_ids, item_ids = df["s"].unique().tolist(), df["d"].unique().tolist()
user2user_encoded = {x: i for i, x in enumerate(user_ids)}
item2item_encoded = {x: i for i, x in enumerate(item_ids)}
df["user"], df["item"] = df["s"].map(user2user_encoded), df["d"].map(item2item_encoded)
num_users, num_items = len(user2user_encoded), len(item2item_encoded)
min_rating, max_rating = df["y"].min(), df["y"].max()
x = df[["user", "item"]].values
y = df["y"].apply(lambda r: (r - min_rating) / (max_rating - min_rating)).values.astype("float32")
train_indices = int(0.9 * df.shape[0])
x_train, x_val, y_train, y_val = x[:train_indices], x[train_indices:], y[:train_indices], y[train_indices:]
EMBEDDING_SIZE = 50


class RecommenderNet(keras.Model):
  def __init__(self, num_users, num_items, embedding_size, **kwargs):
    super().__init__(**kwargs)
    self.user_embedding = layers.Embedding(
        num_users, embedding_size, embeddings_initializer="he_normal",
        embeddings_regularizer=keras.regularizers.l2(1e-6))
    self.user_bias = layers.Embedding(num_users, 1)
    self.item_embedding = layers.Embedding(
        num_items, embedding_size, embeddings_initializer="he_normal",
        embeddings_regularizer=keras.regularizers.l2(1e-6))
    self.item_bias = layers.Embedding(num_items, 1)

  def call(self, inputs):
    user_vector = self.user_embedding(inputs[:, 0])
    user_bias = self.user_bias(inputs[:, 0])
    item_vector = self.item_embedding(inputs[:, 1])
    item_bias = self.item_bias(inputs[:, 1])
    # keras.io has ops.tensordot(user_vector, item_vector, 2): one scalar summed over the whole
    # batch, so the model would depend on the batch split; the per-example dot product instead.
    dot_user_item = ops.sum(user_vector * item_vector, axis=1, keepdims=True)
    x = dot_user_item + user_bias + item_bias
    return ops.nn.sigmoid(x)


keras.utils.set_random_seed(0)
with strategy.scope():
  model = RecommenderNet(num_users, num_items, EMBEDDING_SIZE)
  model(x_train[:1])  # tfdp.fit refuses a model without weights; Keras's fit builds it itself
  model.compile(loss=keras.losses.BinaryCrossentropy(), optimizer=keras.optimizers.Adam(learning_rate=0.001))
batch_size, epochs = 64, 3
start = time.perf_counter()
tfdp.fit(model, x=x_train, y=y_train, batch_size=batch_size, epochs=epochs, validation_data=(x_val, y_val))
seconds = time.perf_counter() - start
predicted = model.predict(x_val, verbose=0)[:, 0] * (max_rating - min_rating) + min_rating
rmse = np.sqrt(np.mean((predicted - (y_val * (max_rating - min_rating) + min_rating)) ** 2))
print(f"RESULT recommender val_rmse={rmse:.4f} fit_seconds={seconds:.1f} "
      f"examples_per_s={len(x_train) * epochs / seconds:.0f}")
