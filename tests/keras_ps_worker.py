"""A worker of the Keras parameter-server tests (a subprocess with TF_CONFIG): trains a small
Keras model with ``model.fit`` between-graph on its share of the data; prints one JSON line.

Args: epochs optimizer(sgd|adam)
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import keras_seed  # noqa: E402  (tests/: the script's directory)
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402
import jaxdist.keras as jk  # noqa: E402

X = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
Y = (X @ np.arange(1, 6, dtype="float32")[:, None] / 5).astype("float32")


def model(optimizer: str) -> keras.Model:
    keras_seed.set_random_seed(0)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05) if optimizer == "sgd" else keras.optimizers.Adam(0.01)
    m.compile(optimizer=opt, loss="mse", metrics=["mae"])
    return m


def main() -> None:
    epochs, optimizer = int(sys.argv[1]), sys.argv[2]
    strategy = jaxdist.ParameterServerStrategy(timeout=60.0)
    m = model(optimizer)
    training = jk.attach(m, strategy)
    ext = strategy.extended
    n, i = max(1, ext.task_info.num_workers), ext.worker_index
    hist = m.fit(X[i::n], Y[i::n], batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    print(json.dumps({"loss": hist.history["loss"], "mae": hist.history["mae"],
                      "weights": [w.tolist() for w in m.get_weights()],
                      "steps": training.steps, "worker": i,
                      "devices": len(ext.worker_devices)}))


if __name__ == "__main__":
    main()
