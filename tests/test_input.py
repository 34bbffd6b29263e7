"""Distributed input: splitting in order, structures, partial batches, prefetch, contexts."""

import jax
import numpy as np
import pytest
from devutil import PRECISE, first_devices

import jaxdist
from jaxdist import Dataset, InputContext, InputOptions, PerReplica


@pytest.fixture
def strategy():
    return jaxdist.MirroredStrategy(first_devices(4))  # the tests' numbers are for 4 replicas


def _rows(strategy, v):
    return [np.asarray(p) for p in strategy.experimental_local_results(v)]


def test_global_batch_split_in_order(strategy):
    x = np.arange(16 * 2).reshape(16, 2)
    (xd,) = list(strategy.experimental_distribute_dataset([x]))
    assert isinstance(xd, PerReplica) and xd.shape == (4, 2)
    parts = _rows(strategy, xd)
    for i, p in enumerate(parts):  # replica i gets rows i*b .. (i+1)*b - 1
        np.testing.assert_array_equal(p, x[4 * i : 4 * (i + 1)])
    devs = [list(p.devices())[0] for p in strategy.experimental_local_results(xd)]
    assert devs == list(strategy.extended.worker_devices)


def test_tuples_dicts_and_generators(strategy):
    def gen():
        for k in range(3):
            yield {"x": np.full((8, 3), k, np.float32), "y": (np.arange(8), np.ones(8))}

    out = list(strategy.experimental_distribute_dataset(gen()))
    assert len(out) == 3
    assert isinstance(out[2]["x"], PerReplica) and out[2]["x"].shape == (2, 3)
    assert isinstance(out[0]["y"][0], PerReplica)
    np.testing.assert_array_equal(_rows(strategy, out[1]["y"][0])[3], [6, 7])


def test_dataset_pipeline_and_make_numpy_dataset(strategy):
    x = np.arange(20, dtype=np.float32)
    ds = strategy.experimental_make_numpy_dataset(x).batch(8, drop_remainder=True)
    assert ds.cardinality() == 2
    out = list(strategy.experimental_distribute_dataset(ds))
    assert len(out) == 2
    np.testing.assert_array_equal(np.concatenate(_rows(strategy, out[1])), x[8:16])


def test_dataset_shuffle_is_deterministic_and_reshuffles_per_epoch():
    ds = Dataset.from_tensor_slices(np.arange(50)).shuffle(50, seed=3).batch(10)
    a = np.concatenate(list(ds))
    b = np.concatenate(list(ds))
    again = np.concatenate(
        list(Dataset.from_tensor_slices(np.arange(50)).shuffle(50, seed=3).batch(10))
    )
    assert sorted(a) == list(range(50)) and not np.array_equal(a, np.arange(50))
    assert not np.array_equal(a, b), "each epoch reshuffles"
    np.testing.assert_array_equal(a, again)
    rep = Dataset.from_tensor_slices(np.arange(4)).repeat(2).map(lambda v: v * 10).skip(1).take(5)
    assert [int(v) for v in rep] == [10, 20, 30, 0, 10]


def test_indivisible_batch_is_split_as_tf_by_default(strategy):
    """TF's rebatching: 6 rows on 4 replicas -> 2, 2, 1, 1 (nothing dropped)."""
    (x,) = list(strategy.experimental_distribute_dataset([np.arange(6)]))
    assert x.lengths == (2, 2, 1, 1)
    got = [np.asarray(v).tolist() for v in strategy.experimental_local_results(x)]
    assert got == [[0, 1], [2, 3], [4], [5]]


def test_indivisible_batch_is_an_error_when_asked(strategy):
    with pytest.raises(ValueError, match="6 rows does not split evenly across 4 replicas"):
        list(strategy.experimental_distribute_dataset(
            [np.zeros((6, 2))], InputOptions(partial_batch="error")))


def test_partial_batch_drop_and_pad(strategy):
    batches = [np.ones((8, 2)), np.full((6, 2), 2.0)]
    dropped = list(
        strategy.experimental_distribute_dataset(batches, InputOptions(partial_batch="drop"))
    )
    assert len(dropped) == 1
    padded = list(
        strategy.experimental_distribute_dataset(batches, InputOptions(partial_batch="pad"))
    )
    (full, full_mask), (part, mask) = padded
    assert part.shape == (2, 2)
    rows = np.concatenate(_rows(strategy, part))
    m = np.concatenate(_rows(strategy, mask))
    np.testing.assert_array_equal(m, [1, 1, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(rows[:6], 2.0)
    np.testing.assert_array_equal(rows[6:], 0.0)
    assert np.concatenate(_rows(strategy, full_mask)).min() == 1.0
    with pytest.raises(ValueError, match="partial_batch='keep'"):
        InputOptions(partial_batch="keep")


def test_masked_loss_with_padding_matches_unpadded(strategy):
    x = np.arange(6, dtype=np.float32)
    ((xd, md),) = list(
        strategy.experimental_distribute_dataset([x], InputOptions(partial_batch="pad"))
    )

    def fn(xb, m):
        per = xb**2
        return jaxdist.get_replica_context().all_reduce(
            "SUM", jaxdist.compute_average_loss(per, sample_weight=m, global_batch_size=6)
        )

    np.testing.assert_allclose(strategy.run(fn, args=(xd, md)), np.mean(x**2), rtol=1e-6)


@pytest.mark.parametrize("thread", [False, True])
@pytest.mark.parametrize("buffer", [0, 1, 3])
def test_prefetch_buffer_sizes(strategy, buffer, thread):
    batches = [np.full((4, 1), i) for i in range(7)]
    opts = InputOptions(experimental_per_replica_buffer_size=buffer, prefetch_thread=thread)
    out = [
        int(_rows(strategy, b)[0][0, 0])
        for b in strategy.experimental_distribute_dataset(batches, opts)
    ]
    assert out == list(range(7))


@pytest.mark.parametrize("thread", [False, True])
def test_errors_from_the_source_reach_the_consumer(strategy, thread):
    def bad():
        yield np.zeros((4, 1))
        raise RuntimeError("source broke at batch 2")

    opts = InputOptions(prefetch_thread=thread)
    it = iter(strategy.experimental_distribute_dataset(bad(), opts))
    next(it)
    with pytest.raises(RuntimeError, match="source broke"):
        next(it)
    with pytest.raises(StopIteration):  # a failed source is finished
        next(it)


@pytest.mark.parametrize("buffer", [1, 2])
def test_default_prefetch_reads_ahead_in_the_callers_thread(strategy, buffer):
    """The default keeps ``buffer`` batches on the devices ahead of the one returned, read
    in the thread that calls ``next`` (no background thread)."""
    import threading

    read: list[tuple[int, str]] = []

    def source():
        for i in range(5):
            read.append((i, threading.current_thread().name))
            yield np.full((4, 1), float(i))

    opts = InputOptions(experimental_per_replica_buffer_size=buffer)
    it = iter(strategy.experimental_distribute_dataset(source(), opts))
    assert read == []  # nothing is read before the first next()
    first = next(it)
    assert float(_rows(strategy, first)[0][0, 0]) == 0.0
    assert [i for i, _ in read] == list(range(buffer + 1))
    assert {name for _, name in read} == {threading.current_thread().name}
    assert not any(t.name == "jaxdist-prefetch" for t in threading.enumerate())
    rest = [float(_rows(strategy, b)[0][0, 0]) for b in it]
    assert rest == [1.0, 2.0, 3.0, 4.0]


def test_prefetch_thread_option_is_checked():
    with pytest.raises(TypeError, match="prefetch_thread must be a bool, got 'yes'"):
        InputOptions(prefetch_thread="yes")


def test_fetch_to_device_false_keeps_host_batches(strategy):
    opts = InputOptions(experimental_fetch_to_device=False)
    (xd,) = list(strategy.experimental_distribute_dataset([np.arange(8.0)], opts))
    assert isinstance(xd.stacked, np.ndarray)
    out = strategy.run(
        lambda x: jaxdist.get_replica_context().all_reduce("SUM", x.sum()), args=(xd,)
    )
    assert float(out) == 28.0


def test_bad_dataset_types(strategy):
    with pytest.raises(TypeError, match="from_tensor_slices"):
        strategy.experimental_distribute_dataset({"x": np.zeros((4, 1))})
    with pytest.raises(TypeError, match="iterable of batches"):
        iter(strategy.experimental_distribute_dataset(42))
    with pytest.raises(ValueError, match="different batch sizes"):
        list(strategy.experimental_distribute_dataset([(np.zeros((4, 1)), np.zeros((8, 1)))]))


def test_distribute_datasets_from_function(strategy):
    seen = []

    def dataset_fn(ctx: InputContext):
        seen.append(ctx)
        b = ctx.get_per_replica_batch_size(8)
        return Dataset.from_tensor_slices(np.arange(32)).batch(b)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    ctx = seen[0]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 4)
    batches = list(dist)
    assert len(batches) == 4
    # each replica gets its own element of the per-pipeline dataset
    np.testing.assert_array_equal(np.stack(_rows(strategy, batches[0])), np.arange(8).reshape(4, 2))


def test_input_context_batch_size_errors():
    ctx = InputContext(1, 0, 4)
    assert ctx.get_per_replica_batch_size(16) == 4
    with pytest.raises(ValueError, match="10 is not divisible by num_replicas_in_sync 4"):
        ctx.get_per_replica_batch_size(10)
    with pytest.raises(ValueError, match="input_pipeline_id=2"):
        InputContext(2, 2, 4)


def test_default_strategy_passes_datasets_through():
    s = jaxdist.get_strategy()
    data = [np.ones((3, 2))]
    out = list(s.experimental_distribute_dataset(data))
    assert out[0].shape == (3, 2)
    assert s.run(lambda x: x.sum(), args=(out[0],)) == 6.0


def test_tf_data_dataset_is_split_as_a_jaxdist_dataset(strategy):
    # The tf.data path of experimental_distribute_dataset (the `tfdata` test extra installs
    # TensorFlow in CI): the same per-replica values as the same jaxdist.Dataset, partial last
    # batch (18 rows in batches of 8 end with 2: 2, 0, 0, 0 on 4 replicas, as TF) included.
    tf = pytest.importorskip("tensorflow", reason="tensorflow (the tfdata test extra) is absent")
    x = np.arange(36, dtype=np.float32).reshape(18, 2)
    y = np.arange(18, dtype=np.int64)
    want = list(strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices({"x": x, "y": y}).batch(8)))
    got = list(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices({"x": x, "y": y}).batch(8)))
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        for k in ("x", "y"):
            assert isinstance(g[k], PerReplica) and g[k].lengths == w[k].lengths
            for a, b in zip(_rows(strategy, g[k]), _rows(strategy, w[k])):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a, b)
    assert got[2]["x"].lengths == (2, 0, 0, 0)
    spec = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(x).batch(8)).element_spec
    assert spec == strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices(x).batch(8)).element_spec


def test_per_replica_elements_of_different_structures_are_an_error(strategy):
    """distribute_datasets_from_function: the replicas' elements must have one structure
    (stacking leaves of {'a', 'b'} with {'a', 'c'} would silently mix them)."""
    good = {"a": np.zeros((2, 1)), "b": np.ones((2, 1))}
    odd = {"a": np.zeros((2, 1)), "c": np.ones((2, 1))}
    n = strategy.num_replicas_in_sync
    dist = strategy.distribute_datasets_from_function(lambda ctx: [good] * (n - 1) + [odd])
    with pytest.raises(ValueError, match="pytree structure"):
        next(iter(dist))


def _linear(params, x):
    # a non-zero bias: a padding row (zeros) gives a non-zero prediction, so a padding row
    # that leaks into the results changes them
    return x @ params["w"] + params["b"]


@pytest.mark.parametrize("num_replicas", [4, 8])
def test_per_row_outputs_of_a_partial_step_line_up_with_the_inputs(num_replicas):
    # 41 rows, global batch 16: the last batch has 9 rows (4, 4, 1, 0 on 4 replicas; 2, 2, 2, 2,
    # 1, 0, 0, 0 on 8), each replica's rows padded to one shape inside run. Gathered per-row
    # outputs must be the 41 real rows, in order, as a one-device computation gives them.
    if len(jax.devices()) < num_replicas:
        pytest.skip(f"needs {num_replicas} devices, {len(jax.devices())} available")
    strategy = jaxdist.MirroredStrategy(jax.devices()[:num_replicas])
    rng = np.random.RandomState(0)
    x = rng.randn(41, 3).astype(np.float32)
    y = np.arange(41, dtype=np.int32)
    params = {"w": rng.randn(3, 2).astype(np.float32), "b": np.float32([1.5, -2.0])}
    want = np.asarray(jax.jit(_linear)(params, x))  # one device
    with strategy.scope():
        state = jax.tree.map(jax.numpy.asarray, params)

    def step(params, xb, yb):
        preds = _linear(params, xb)
        loss = jaxdist.compute_average_loss(jax.numpy.sum(preds, axis=1), global_batch_size=16)
        return {"preds": preds, "labels": yb, "loss": loss,
                "first_col": preds.T,               # leading axis 2: not per row
                "total": jaxdist.get_replica_context().all_reduce("SUM", loss)}

    ds = Dataset.from_tensor_slices((x, y)).batch(16)
    preds, labels, local_preds, sums = [], [], [], []
    for xb, yb in strategy.experimental_distribute_dataset(ds):
        out = strategy.run(step, args=(state, xb, yb))
        preds.append(np.asarray(strategy.gather(out["preds"], axis=0)))
        labels.append(np.asarray(strategy.gather(out["labels"], axis=0)))
        local_preds.append(np.concatenate(
            [np.asarray(p) for p in strategy.experimental_local_results(out["preds"])]))
        sums.append(np.asarray(strategy.reduce("SUM", out["preds"], axis=0)))
        # scalars and other shapes come back as on a full step
        assert out["loss"].lengths is None and out["first_col"].lengths is None
        assert out["first_col"].shape[1] == xb.shape[0]
        assert not isinstance(out["total"], PerReplica)
    assert out["preds"].lengths == xb.lengths  # the last, partial step
    assert sum(out["preds"].lengths) == 9
    preds, labels = np.concatenate(preds), np.concatenate(labels)
    assert preds.shape == (41, 2) and labels.shape == (41,)
    np.testing.assert_array_equal(labels, y)  # in order
    np.testing.assert_allclose(preds, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(local_preds), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.sum(sums, axis=0), want.sum(0), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="different shapes"):  # TF's rule for ragged replicas
        strategy.reduce("SUM", out["preds"], axis=None)

    # Inside a user's jax.jit (TF: inside tf.function) the same rows come back.
    @jax.jit
    def jitted(state, xb, yb):
        out = strategy.run(step, args=(state, xb, yb))
        return (strategy.gather(out["preds"], axis=0),
                strategy.reduce("SUM", out["preds"], axis=0))

    rows, total = jitted(state, xb, yb)
    np.testing.assert_allclose(rows, want[32:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(total, want[32:].sum(0), rtol=1e-4, atol=1e-4)


def test_partial_step_outputs_of_the_row_count_size_but_not_per_row_are_not_cut(strategy):
    # 6 rows on 4 replicas: 2, 2, 1, 1 rows, padded to 2; the weights also have 2 entries, so a
    # per-replica gradient has the padded row count as its leading axis without being per row.
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    (xb,) = list(strategy.experimental_distribute_dataset([x]))
    assert xb.lengths == (2, 2, 1, 1)
    with strategy.scope():
        w = jax.numpy.ones(2)

    def step(w, xb):
        ctx = jaxdist.get_replica_context()

        def loss(w):
            return jaxdist.compute_average_loss(xb @ w, global_batch_size=6)

        grads = jax.grad(loss)(ctx.local(w))   # per-replica gradient, shape (2,)
        return {"preds": xb @ w, "grads": grads}

    out = strategy.run(step, args=(w, xb))
    assert out["preds"].lengths == (2, 2, 1, 1)
    assert out["grads"].lengths is None
    total = strategy.reduce("SUM", out["grads"], axis=None)  # TF's reduce of per-replica grads
    np.testing.assert_allclose(total, x.sum(0) / 6, rtol=1e-6)
    np.testing.assert_allclose(strategy.gather(out["preds"], axis=0), x @ np.ones(2))

    # A replica function whose shapes are fixed in its code cannot be traced with another row
    # count: the leading-axis test alone decides (its per-row output is still cut right).
    def fixed(xb):
        return xb.reshape(2, 2) + 1.0

    rows = strategy.run(fixed, args=(xb,))
    assert rows.lengths == (2, 2, 1, 1)
    np.testing.assert_allclose(strategy.gather(rows, axis=0), x + 1.0)


@pytest.mark.parametrize("buffer", [0, 1])
def test_get_next_as_optional_is_tfs_optional(strategy, buffer):
    """TF's ``tf.experimental.Optional``: never ``None``; ``has_value()`` False at the end,
    ``get_value()`` the batch (a ValueError when empty); not a valid argument of ``run``."""
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    it = iter(strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices(x).batch(8),
        InputOptions(experimental_per_replica_buffer_size=buffer)))
    full = it.get_next_as_optional()
    assert isinstance(full, jaxdist.data.Optional) and full.has_value()
    assert "has_value=True" in repr(full)
    np.testing.assert_array_equal(strategy.gather(full.get_value(), axis=0), x)
    empty = it.get_next_as_optional()
    assert empty is not None and not empty.has_value()
    assert repr(empty) == "Optional(has_value=False)"
    with pytest.raises(ValueError, match="does not have a value"):
        empty.get_value()
    assert it.get_next_as_optional().has_value() is False  # stays empty
    with pytest.raises(TypeError):
        hash(full)
    with pytest.raises(TypeError, match="neither an array nor hashable"):
        strategy.run(lambda b: b, args=(empty,))
    assert jaxdist.data.experimental.Optional is jaxdist.data.Optional
    assert jaxdist.data.Optional.from_value(np.int32(3)).element_spec == jax.ShapeDtypeStruct(
        (), np.int32)
    with pytest.raises(ValueError, match="without an element_spec"):
        jaxdist.data.Optional().element_spec  # noqa: B018 - the property raises


@pytest.mark.parametrize("precise", PRECISE)
def test_dropping_an_iterator_does_not_wait_for_its_prefetch_thread(strategy, precise):
    """An iterator nobody holds only tells its prefetch thread to stop (its finalizer runs
    wherever the collector does, so it must not wait): a thread held by a blocking source
    ends once the source gives its next element."""
    import gc
    import threading
    import time

    waiting, release = threading.Event(), threading.Event()

    def source():
        yield np.zeros((4, 1))
        waiting.set()
        assert release.wait(60), "the test never released the source"
        yield np.ones((4, 1))

    before = set(threading.enumerate())
    it = iter(strategy.experimental_distribute_dataset(
        source(), InputOptions(prefetch_thread=True)))
    [thread] = [t for t in threading.enumerate() if t not in before]
    assert thread.name == "jaxdist-prefetch"
    assert waiting.wait(30), "the prefetch thread never asked for the second element"
    t0 = time.monotonic()
    del it
    gc.collect()
    dropped_in = time.monotonic() - t0
    assert thread.is_alive()  # still held by the source
    release.set()
    thread.join(30)
    assert not thread.is_alive(), "the prefetch thread did not stop"
    if precise:
        assert dropped_in < 1.0, f"dropping the iterator waited {dropped_in:.1f} s"
