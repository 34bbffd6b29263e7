"""Input pipelines in Keras ``fit`` under jaxdist strategies: ``tf.data.Dataset`` and shuffled
``jaxdist.Dataset`` input on 4 replicas against plain Keras on one device over the same global
batches, and how a dataset is divided across processes (``AutoShardPolicy``; the 2-process runs
are ``test_input_across_processes_matches_one_device`` in test_keras_partial_batches.py).
Needs 4 devices for the Keras runs (8 forced CPU devices in CI, see conftest.py).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover
    pytest.skip("keras runs on another backend", allow_module_level=True)

import jaxdist  # noqa: E402
from jaxdist._src.input import autoshard  # noqa: E402
from jaxdist._src.keras import partial_batches  # noqa: E402

_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(70, 5)).astype("float32")
Y = (X @ np.array([1.0, -2.0, 0.5, 1.5, -1.0], "float32") > 0).astype("int32")


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _close(got, want, what=""):
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{what} {k}")


def _tf():
    return pytest.importorskip("tensorflow",
                               reason="tensorflow (the tfdata test extra) is not installed")


@pytest.mark.devices(4)
def test_fit_evaluate_predict_a_tf_data_dataset(devices):
    tf = _tf()
    ref = _model()
    want = ref.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                   validation_data=(X[:9], Y[:9]), validation_batch_size=4).history
    with jaxdist.MirroredStrategy(devices[:4]).scope():
        model = _model()
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(32).prefetch(tf.data.AUTOTUNE)
    val = tf.data.Dataset.from_tensor_slices((X[:9], Y[:9])).batch(4)
    got = model.fit(ds, epochs=2, verbose=0, validation_data=val).history  # last batches 6, 1
    _close(got, want, "fit")
    for a, b in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    _close(model.evaluate(ds, verbose=0, return_dict=True),
           ref.evaluate(X, Y, batch_size=32, verbose=0, return_dict=True), "evaluate")
    pred = model.predict(tf.data.Dataset.from_tensor_slices(X).batch(32), verbose=0)
    np.testing.assert_allclose(pred, ref.predict(X, verbose=0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="tf.data.Dataset, `y` should not be passed"):
        model.fit(ds, Y, verbose=0)


@pytest.mark.devices(4)
def test_fit_a_shuffled_jaxdist_dataset_sees_its_passes_in_order(devices):
    # Keras reads one batch to build the model before the first epoch; that pass is resumed,
    # so epoch k is the dataset's pass k (its k-th shuffle), as one device over those batches.
    ds = jaxdist.Dataset.from_tensor_slices((X, Y)).shuffle(70, seed=5).batch(32)
    again = jaxdist.Dataset.from_tensor_slices((X, Y)).shuffle(70, seed=5).batch(32)
    batches = list(again) + list(again)
    ref = _model()
    want = ref.fit((b for b in batches), steps_per_epoch=3, epochs=2, verbose=0).history
    with jaxdist.MirroredStrategy(devices[:4]).scope():
        model = _model()
    _close(model.fit(ds, epochs=2, verbose=0).history, want, "fit")
    for a, b in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_dataset_adapter_resumes_only_a_one_batch_peek():
    ds = jaxdist.Dataset.range(6).batch(2)
    adapter = partial_batches.DatasetAdapter(ds)
    peek = adapter.get_numpy_iterator()
    assert next(peek)[0].tolist() == [0, 1]  # abandoned after one batch (Keras's build)
    assert [b[0].tolist() for b in adapter.get_numpy_iterator()] == [[0, 1], [2, 3], [4, 5]]
    assert [b[0].tolist() for b in adapter.get_numpy_iterator()] == [[0, 1], [2, 3], [4, 5]]
    partial = adapter.get_numpy_iterator()
    next(partial), next(partial)  # two batches read: not a peek, the next pass starts anew
    assert len(list(adapter.get_numpy_iterator())) == 3
    assert adapter.num_batches == 3
    assert partial_batches.DatasetAdapter(ds.repeat()).num_batches is None  # infinite


def test_array_shards_agree_across_processes_whatever_their_numpy_state():
    # Keras shuffles arrays with numpy's global generator; each process's share comes from one
    # generator seeded alike everywhere, so the processes' rows form the same global batches.
    from keras.src.trainers.data_adapters import ArrayDataAdapter

    x = np.arange(70, dtype=np.float32)[:, None]
    shares = []
    for index, state in ((0, 1), (1, 2)):
        np.random.seed(state)  # different global states on the two "processes"
        inner = ArrayDataAdapter(x, x, batch_size=32, shuffle=True)
        adapter = partial_batches.ProcessRowsAdapter(inner, 2, index, seed=11)
        before = np.random.get_state()[1].copy()
        shares.append([[b[0][:, 0] for b in adapter.get_numpy_iterator()] for _ in range(2)])
        np.testing.assert_array_equal(np.random.get_state()[1], before)  # left untouched
        assert adapter.batch_size == 16 and adapter.partial_batch_size == 3
    for epoch in range(2):
        got = [np.concatenate([a, b]) for a, b in zip(shares[0][epoch], shares[1][epoch])]
        assert [len(g) for g in got] == [32, 32, 6]
        assert sorted(np.concatenate(got).tolist()) == list(range(70))
    assert not np.array_equal(np.concatenate(shares[0][0]), np.concatenate(shares[0][1]))


def test_auto_shard_policies_of_datasets():
    batches = jaxdist.Dataset.range(20).batch(8)  # 8, 8, 4 rows
    got = [b.tolist() for b in autoshard.auto_shard(batches, 2, 1)]
    assert got == [[4, 5, 6, 7], [12, 13, 14, 15], [18, 19]]
    with pytest.raises(ValueError, match="does not split across 3 processes"):
        list(autoshard.auto_shard(batches, 3, 0))
    uneven = [b.tolist() for b in autoshard.auto_shard(batches, 3, 2, uneven=True)]
    assert uneven == [[6, 7], [14, 15], [19]]
    options = jaxdist.data.Options()
    options.experimental_distribute.auto_shard_policy = jaxdist.AutoShardPolicy.OFF
    off = batches.with_options(options)
    assert autoshard.policy_of(off) is jaxdist.AutoShardPolicy.OFF
    assert autoshard.auto_shard(off, 2, 1) is off
    with pytest.raises(ValueError, match="shuffle without a seed"):
        autoshard.auto_shard(jaxdist.Dataset.range(8).shuffle(8).batch(4), 2, 0)
    assert autoshard.auto_shard(jaxdist.Dataset.range(8).shuffle(8).batch(4), 1, 0) is not None
    with pytest.raises(ValueError, match="FileListDataset"):
        autoshard.auto_shard(batches, 2, 0, policy="file")


def test_tf_data_options_choose_the_policy():
    tf = _tf()
    ds = tf.data.Dataset.range(16).batch(8)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    assert autoshard.policy_of(ds.with_options(options)) is jaxdist.AutoShardPolicy.OFF
    assert autoshard.policy_of(ds) is jaxdist.AutoShardPolicy.AUTO
    assert [b.tolist() for b in autoshard.auto_shard(ds, 2, 0)] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    # A tf.data.Options is accepted by jaxdist.Dataset.with_options too.
    tagged = jaxdist.Dataset.range(4).with_options(options)
    assert tagged.options().experimental_distribute.auto_shard_policy.name == "OFF"


def test_a_jaxdist_dataset_under_the_default_strategy_scope():
    """TF's default strategy takes tf.data in fit; jaxdist's default strategy scope takes a
    jaxdist.Dataset (no distribution: one device, the dataset's batches as they are)."""
    import keras
    import numpy as np

    import jaxdist

    x = np.random.default_rng(0).normal(size=(20, 3)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    with jaxdist.get_strategy().scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(jaxdist.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2,
                            verbose=0)
    assert len(history.history["loss"]) == 2
    assert model.predict(jaxdist.Dataset.from_tensor_slices(x).batch(8), verbose=0).shape == (20, 2)
