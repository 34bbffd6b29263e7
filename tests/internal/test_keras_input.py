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
from jaxdist._src.keras import input_adapters  # noqa: E402

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
    adapter = input_adapters.DatasetAdapter(ds)
    peek = adapter.get_numpy_iterator()
    assert next(peek)[0].tolist() == [0, 1]  # abandoned after one batch (Keras's build)
    assert [b[0].tolist() for b in adapter.get_numpy_iterator()] == [[0, 1], [2, 3], [4, 5]]
    assert [b[0].tolist() for b in adapter.get_numpy_iterator()] == [[0, 1], [2, 3], [4, 5]]
    partial = adapter.get_numpy_iterator()
    next(partial), next(partial)  # two batches read: not a peek, the next pass starts anew
    assert len(list(adapter.get_numpy_iterator())) == 3
    assert adapter.num_batches == 3
    assert input_adapters.DatasetAdapter(ds.repeat()).num_batches is None  # infinite


def test_array_shards_agree_across_processes_whatever_their_numpy_state():
    # Keras shuffles arrays with numpy's global generator; each process's share comes from one
    # generator seeded alike everywhere, so the processes' rows form the same global batches.
    from keras.src.trainers.data_adapters import ArrayDataAdapter

    x = np.arange(70, dtype=np.float32)[:, None]
    shares = []
    for index, state in ((0, 1), (1, 2)):
        np.random.seed(state)  # different global states on the two "processes"
        inner = ArrayDataAdapter(x, x, batch_size=32, shuffle=True)
        adapter = input_adapters.ProcessRowsAdapter(inner, 2, index, seed=11)
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


def _tf_policy(ds, name):
    tf = _tf()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, name)
    return ds.with_options(options)


def _ids(source):
    return [np.asarray(b).tolist() for b in source]


def test_tf_data_across_processes_follows_its_auto_shard_policy():
    """TF's meanings with the dataset's batch as the global batch (``B`` rows, ``P``
    processes): AUTO / DATA keep this process's rows of every global batch; OFF (each process
    already reads its own data) feeds each global batch as ``P`` steps of ``B/P`` rows; FILE on
    a pipeline that reads no files is refused with the fix."""
    tf = _tf()
    ds = tf.data.Dataset.range(20).batch(8)  # 8, 8, 4 rows
    for policy in ("AUTO", "DATA"):
        source, pieces = input_adapters.tf_data_source(_tf_policy(ds, policy), 2, 1)
        assert pieces == 1 and _ids(source) == [[4, 5, 6, 7], [12, 13, 14, 15], [18, 19]]
    own = _tf_policy(tf.data.Dataset.range(20).shard(2, 1).batch(8), "OFF")  # 1, 3, ... 19
    source, pieces = input_adapters.tf_data_source(own, 2, 1)
    assert pieces == 2
    assert _ids(source) == [[1, 3, 5, 7], [9, 11, 13, 15], [17], [19]]
    adapter = input_adapters.DatasetAdapter(own, None, source, pieces)
    assert adapter.num_batches == 4  # 2 global batches, each 2 steps
    with pytest.raises(ValueError, match=r"FILE on a tf.data.Dataset that reads no files"):
        input_adapters.tf_data_source(_tf_policy(ds, "FILE"), 2, 0)


def test_tf_data_file_policy_shards_files_as_tf_does(tmp_path):
    """FILE: TF's own rewrite gives process ``p`` of ``P`` files ``p, p+P, ...``; each batch
    it reads (``B`` rows of its files) is fed as ``P`` steps of ``B/P`` rows. Too few files, or
    none, is refused; AUTO shards such a pipeline by data (every process reads every file)."""
    tf = _tf()
    files = []
    for f in range(4):
        files.append(str(tmp_path / f"part-{f}.tfrecord"))
        with tf.io.TFRecordWriter(files[-1]) as w:
            for r in range(6):
                w.write(tf.io.serialize_tensor(tf.constant(f * 100 + r, tf.int64)).numpy())

    def pipeline(paths):
        return tf.data.TFRecordDataset(paths).map(
            lambda s: tf.io.parse_tensor(s, tf.int64)).batch(4)

    assert input_adapters.tf_data_files(pipeline(files)) == (True, 4)
    assert input_adapters.tf_data_files(tf.data.Dataset.range(4)) == (False, None)
    source, pieces = input_adapters.tf_data_source(_tf_policy(pipeline(files), "FILE"), 2, 1)
    assert pieces is None  # the step count of this process's files is not known
    assert input_adapters.DatasetAdapter(pipeline(files), None, source, pieces).num_batches is None
    assert _ids(source) == [[100, 101], [102, 103], [104, 105], [300, 301], [302, 303],
                            [304, 305]]
    with pytest.raises(ValueError, match=r"1 file\(s\) cannot be split across 2 processes"):
        input_adapters.tf_data_source(_tf_policy(pipeline(files[:1]), "FILE"), 2, 0)
    source, pieces = input_adapters.tf_data_source(pipeline(files), 2, 1)  # AUTO
    assert pieces == 1 and _ids(source)[:2] == [[2, 3], [100, 101]]


def test_an_unseeded_tf_data_shuffle_sharded_by_data_warns():

    tf = _tf()
    tf.random.set_seed(None)  # a global seed (keras.utils.set_random_seed) seeds every shuffle
    unseeded = tf.data.Dataset.range(16).shuffle(16).batch(8)
    assert input_adapters.tf_data_has_unseeded_shuffle(unseeded)
    with pytest.warns(RuntimeWarning, match="shuffle without a seed .* 2 processes"):
        input_adapters.tf_data_source(unseeded, 2, 0)
    seeded = tf.data.Dataset.range(16).shuffle(16, seed=3).batch(8)
    assert not input_adapters.tf_data_has_unseeded_shuffle(seeded)
    assert not input_adapters.tf_data_has_unseeded_shuffle(tf.data.Dataset.range(4).batch(2))
    nested = tf.data.Dataset.range(2).interleave(lambda i: tf.data.Dataset.range(4).shuffle(4))
    assert input_adapters.tf_data_has_unseeded_shuffle(nested)
    tf.random.set_seed(1)
    assert not input_adapters.tf_data_has_unseeded_shuffle(
        tf.data.Dataset.range(16).shuffle(16).batch(8))


def test_generator_and_py_dataset_shares_agree_across_processes():
    """Each process iterates the same generator / PyDataset and keeps its rows of every
    global batch; a PyDataset shuffled by fit draws its order (Python's random) from one seed,
    whatever each process's own random state."""
    import random

    from jaxdist._src.compat import keras_internals as ki

    x = np.arange(48, dtype=np.float32)[:, None]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return x[16 * i:16 * (i + 1)], x[16 * i:16 * (i + 1)]

    shares = []
    for index, state in ((0, 1), (1, 2)):
        random.seed(state)
        adapter = input_adapters.ProcessRowsAdapter(
            ki.get_data_adapter(Batches(), shuffle=True), 2, index, seed=5)
        before = random.getstate()
        shares.append([b[0][:, 0].astype(int).tolist() for b in adapter.get_numpy_iterator()])
        assert random.getstate() == before  # left untouched
    steps = [sorted(a + b) for a, b in zip(*shares)]
    assert all(not set(a) & set(b) for a, b in zip(*shares))
    assert sorted(s[0] for s in steps) == [0, 16, 32]
    assert all(s == list(range(s[0], s[0] + 16)) for s in steps)

    def gen():
        for i in range(0, 48, 16):
            yield x[i:i + 16], x[i:i + 16]

    got = [b[0][:, 0].astype(int).tolist() for b in input_adapters.ProcessRowsAdapter(
        ki.get_data_adapter(gen()), 2, 1, seed=None).get_numpy_iterator()]
    assert got == [list(range(8, 16)), list(range(24, 32)), list(range(40, 48))]


def test_a_threaded_py_dataset_shuffle_is_refused_across_processes():

    class Threaded(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=2)

        def __len__(self):
            return 1

        def __getitem__(self, i):
            return X[:8], Y[:8]

    with pytest.raises(ValueError, match="shuffle=False .* or workers=1"):
        input_adapters._refuse_threaded_shuffle(Threaded(), True, 2)
    input_adapters._refuse_threaded_shuffle(Threaded(), False, 2)


@pytest.mark.devices(2)
def test_a_repeated_seeded_tf_data_shuffle_trains_on_plain_keras_batches(devices):
    """Keras reads a tf.data dataset with a new iterator for its pre-build peek and another
    for fit (a seeded shuffle's order depends on how many were made): jaxdist does the same,
    so fit(steps_per_epoch) on a repeated pipeline sees plain Keras's batches."""
    tf = _tf()

    def run(strategy):
        keras.utils.set_random_seed(0)  # TF's shuffle seed is (global seed, seed=3)
        ds = tf.data.Dataset.from_tensor_slices((X[:64], Y[:64])).shuffle(64, seed=3)
        ds = ds.repeat().batch(16)
        with strategy.scope():
            m = _model()
        m.fit(ds, epochs=2, steps_per_epoch=4, verbose=0)
        return [np.asarray(w) for w in m.get_weights()]

    ref = run(jaxdist.get_strategy())
    got = run(jaxdist.MirroredStrategy(devices[:2]))
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
