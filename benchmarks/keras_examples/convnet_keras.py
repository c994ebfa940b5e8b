"""keras.io "Simple MNIST convnet" (fchollet), on a CIFAR-10 subset instead of MNIST (no network
here): the same model, loss, optimizer and fit call; 3 epochs on 10,000 images."""
import time

import keras
import numpy as np
import tensorflow_datasets as tfds

num_classes, input_shape = 10, (32, 32, 3)
(x_train, y_train), (x_test, y_test) = tfds.as_numpy(tfds.load(
    "cifar10", split=["train[:10000]", "test[:2000]"], batch_size=-1, as_supervised=True))
x_train = x_train.astype("float32") / 255
x_test = x_test.astype("float32") / 255
y_train = keras.utils.to_categorical(y_train, num_classes)
y_test = keras.utils.to_categorical(y_test, num_classes)

keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input(shape=input_shape),
    keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Flatten(),
    keras.layers.Dropout(0.5),
    keras.layers.Dense(num_classes, activation="softmax"),
])
batch_size, epochs = 128, 3
model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
start = time.perf_counter()
model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, validation_split=0.1)
seconds = time.perf_counter() - start
score = model.evaluate(x_test, y_test, verbose=0)
print(f"RESULT convnet test_accuracy={score[1]:.4f} fit_seconds={seconds:.1f} "
      f"examples_per_s={0.9 * len(x_train) * epochs / seconds:.0f}")
