"""Keras 3 ``model.fit`` driven from a ``ClusterCoordinator`` (TF2 parameter-server training):
every step scheduled onto a worker task, variables on a ps task; a worker killed during fit."""

import os

os.environ["KERAS_BACKEND"] = "jax"  # the worker tasks started here inherit it

import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover
    pytest.skip("keras runs on another backend", allow_module_level=True)

from coordinator_util import (  # noqa: E402
    coordinator_for,
    restart,
    start_cluster,
    strategy_for,
    wait_until,
)

from jaxdist._src.keras import api as jk  # noqa: E402

pytestmark = pytest.mark.slow

X = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
Y = (X @ np.arange(1, 6, dtype="float32")[:, None] / 5).astype("float32")
_names = iter(range(100))


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(workers=2, ps=1)
    yield c
    c.stop()


@pytest.fixture
def coordinator(cluster):
    for name in ("worker:0", "worker:1"):
        if not cluster.tasks[name].running():
            restart(cluster, name)
    strategy = strategy_for(cluster)
    coord = coordinator_for(strategy)
    wait_until(lambda: all(w.up.is_set() for w in coord.worker_states()), 30, "workers up")
    yield coord
    coord.shutdown()


def _model():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
              steps_per_execution=2)
    return m


def _versions(training):
    return sorted(training.variables.versions.values())


def test_fit_from_the_coordinator_runs_every_step_on_the_workers(coordinator):
    m = _model()
    training = jk.attach(m, coordinator.strategy, name=f"keras{next(_names)}")
    before = coordinator.functions_run()
    h = m.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0).history
    ran = [a - b for a, b in zip(coordinator.functions_run(), before)]
    assert training.steps == 24 and sum(ran) == 24, ran
    assert all(r > 0 for r in ran), ran                # both workers took steps
    assert _versions(training) == [24] * 6             # every step pushed exactly once
    assert h["loss"][-1] < 0.5 * h["loss"][0], h["loss"]
    # the coordinator's model holds the ps's values; its metric sums every step's
    for v, x in zip(m.trainable_variables, training.variables.pull()):
        np.testing.assert_array_equal(np.asarray(v.value), x)
    assert 0 < h["mae"][-1] < h["mae"][0]
    # BatchNorm statistics: the coordinator keeps those of the latest finished step
    bn = m.get_layer("bn")
    assert np.abs(np.asarray(bn.moving_mean.value)).max() > 0.01


def test_fit_survives_a_worker_killed_mid_training(coordinator, cluster):
    m = _model()
    training = jk.attach(m, coordinator.strategy, name=f"keras{next(_names)}")

    killed = []

    def kill(batch, logs):  # steps_per_execution=2: batch ends 1, 3, 5, ...
        if batch >= 3 and not killed:
            wait_until(lambda: coordinator.functions_run()[1] > 0, 60, "a step on worker:1")
            killed.append(coordinator.functions_run()[1])
            cluster.kill("worker:1")

    h = m.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=kill)]).history
    assert killed and not cluster.tasks["worker:1"].running()
    assert killed[0] > 0   # worker:1 had been taking steps (and had more in flight)
    assert training.steps == 24
    assert all(v >= 24 for v in _versions(training))   # at least once: a lost step reran
    assert h["loss"][-1] < 0.5 * h["loss"][0], h["loss"]


def test_sparse_embedding_fit_from_the_coordinator(coordinator):
    ids = np.random.default_rng(1).integers(0, 50, size=(64, 3)).astype("int32")
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((3,), dtype="int32"),
                          keras.layers.Embedding(50, 4, name="emb"), keras.layers.Flatten(),
                          keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="mse", steps_per_execution=2)
    training = jk.attach(m, coordinator.strategy, name=f"keras{next(_names)}",
                         sparse_embeddings=["emb"])
    table = training.tables[0].table
    before = table.read_value()
    h = m.fit(ids, Y, batch_size=8, epochs=3, shuffle=False, verbose=0).history
    assert h["loss"][-1] < h["loss"][0], h["loss"]
    after = table.read_value()
    touched = np.unique(ids)
    untouched = np.setdiff1d(np.arange(50), touched)
    assert not np.allclose(after[touched], before[touched])      # rows trained on the ps
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert sum(training._ps.variables.versions.values()) == 24 * 2  # dense kernel + bias
    # the coordinator evaluates through the rows too
    assert np.isfinite(m.evaluate(ids, Y, verbose=0))
