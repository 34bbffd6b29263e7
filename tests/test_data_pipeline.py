"""``jaxdist.Dataset`` against tf.data: the examples of tf.data's docstrings (TF 2.21, ported with
``tf.data`` -> ``jaxdist.data``; inputs and expected outputs as TF documents them), the semantics
TF's tutorials rely on (shuffle, repeat, cache, partial batches, cardinality), and, where
TensorFlow is installed, the same pipelines run through both and compared element by element.
Host-only: no devices needed.
"""

import numpy as np
import pytest

import jaxdist
from jaxdist import data
from jaxdist.data import Dataset

INF, UNK = data.INFINITE_CARDINALITY, data.UNKNOWN_CARDINALITY


def items(ds):
    return [a.item() for a in ds.as_numpy_iterator()]


# ------------------------------------------------------------------ tf.data's docstring examples


def test_docstring_as_numpy_iterator_and_from_tensor_slices():
    assert items(Dataset.from_tensor_slices([1, 2, 3])) == [1, 2, 3]
    ds = Dataset.from_tensor_slices({"a": ([1, 2], [3, 4]), "b": [5, 6]})
    assert list(ds.as_numpy_iterator()) == [{"a": (1, 3), "b": 5}, {"a": (2, 4), "b": 6}]
    rows = list(Dataset.from_tensor_slices([[1, 2], [3, 4]]).as_numpy_iterator())
    assert [r.tolist() for r in rows] == [[1, 2], [3, 4]] and rows[0].dtype == np.int32
    ds = Dataset.from_tensor_slices(([1, 2], [3, 4], [5, 6]))
    assert [(a.item(), b.item(), c.item()) for a, b, c in ds.as_numpy_iterator()] == [
        (1, 3, 5), (2, 4, 6)]
    assert list(Dataset.from_tensor_slices({"a": [1, 2], "b": [3, 4]}).as_numpy_iterator()) == [
        {"a": 1, "b": 3}, {"a": 2, "b": 4}]
    features = np.array([[1, 3], [2, 1], [3, 3]])
    labels = np.array([0, 1, 0])
    zipped = Dataset.zip((Dataset.from_tensor_slices(features),
                          Dataset.from_tensor_slices(labels)))
    together = Dataset.from_tensor_slices((features, labels))
    for (a, b), (c, d) in zip(zipped, together, strict=True):
        np.testing.assert_array_equal(a, c)
        assert b == d


def test_docstring_from_tensors():
    out = list(Dataset.from_tensors([1, 2, 3]).as_numpy_iterator())
    assert len(out) == 1 and out[0].tolist() == [1, 2, 3] and out[0].dtype == np.int32
    out = list(Dataset.from_tensors(np.array([1, 2, 3])).repeat(2).as_numpy_iterator())
    assert [a.tolist() for a in out] == [[1, 2, 3], [1, 2, 3]]


def test_docstring_range():
    assert items(Dataset.range(5)) == [0, 1, 2, 3, 4]
    assert items(Dataset.range(2, 5)) == [2, 3, 4]
    assert items(Dataset.range(1, 5, 2)) == [1, 3]
    assert items(Dataset.range(1, 5, -2)) == []
    assert items(Dataset.range(5, 1)) == []
    assert items(Dataset.range(5, 1, -2)) == [5, 3]
    assert items(Dataset.range(2, 5, output_type=np.int32)) == [2, 3, 4]
    out = items(Dataset.range(1, 5, 2, output_type=np.float32))
    assert out == [1.0, 3.0] and isinstance(out[0], float)
    assert next(iter(Dataset.range(3))).dtype == np.int64


def test_docstring_zip():
    a, b = Dataset.range(1, 4), Dataset.range(4, 7)
    assert [(i.item(), j.item()) for i, j in Dataset.zip(a, b).as_numpy_iterator()] == [
        (1, 4), (2, 5), (3, 6)]
    assert [(i.item(), j.item()) for i, j in Dataset.zip(b, a).as_numpy_iterator()] == [
        (4, 1), (5, 2), (6, 3)]
    c = Dataset.range(7, 13).batch(2)
    got = [(i.item(), j.item(), k.tolist()) for i, j, k in Dataset.zip(a, b, c)]
    assert got == [(1, 4, [7, 8]), (2, 5, [9, 10]), (3, 6, [11, 12])]
    d = Dataset.range(13, 15)
    assert [(i.item(), j.item()) for i, j in Dataset.zip(a, d)] == [(1, 13), (2, 14)]
    named = Dataset.zip({"x": a, "y": b})
    assert [(e["x"].item(), e["y"].item()) for e in named] == [(1, 4), (2, 5), (3, 6)]
    assert Dataset.zip(a, d).cardinality() == 2


def test_docstring_concatenate():
    a, b = Dataset.range(1, 4), Dataset.range(4, 8)
    assert items(a.concatenate(b)) == [1, 2, 3, 4, 5, 6, 7]
    c = Dataset.zip((a, b))
    with pytest.raises(TypeError, match="different element structures"):
        list(a.concatenate(c))


def test_docstring_repeat_enumerate_take_skip_shard():
    assert items(Dataset.from_tensor_slices([1, 2, 3]).repeat(3)) == [1, 2, 3] * 3
    out = [(p.item(), e.item())
           for p, e in Dataset.from_tensor_slices([1, 2, 3]).enumerate(start=5)]
    assert out == [(5, 1), (6, 2), (7, 3)]
    out = [(p.item(), e.tolist())
           for p, e in Dataset.from_tensor_slices([(7, 8), (9, 10)]).enumerate()]
    assert out == [(0, [7, 8]), (1, [9, 10])]
    assert items(Dataset.range(10).take(3)) == [0, 1, 2]
    assert items(Dataset.range(10).skip(7)) == [7, 8, 9]
    a = Dataset.range(10)
    assert items(a.shard(num_shards=3, index=0)) == [0, 3, 6, 9]
    assert items(a.shard(num_shards=3, index=1)) == [1, 4, 7]
    assert items(a.shard(num_shards=3, index=2)) == [2, 5, 8]


def test_docstring_cache():
    calls = []

    def square(x):
        calls.append(int(x))
        return x ** 2

    ds = Dataset.range(5).map(square).cache()
    assert items(ds) == [0, 1, 4, 9, 16]
    assert items(ds) == [0, 1, 4, 9, 16]  # read from the cache: map ran once per element
    assert calls == [0, 1, 2, 3, 4]


def test_docstring_batch():
    got = list(Dataset.range(8).batch(3).as_numpy_iterator())
    assert [b.tolist() for b in got] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    got = list(Dataset.range(8).batch(3, drop_remainder=True).as_numpy_iterator())
    assert [b.tolist() for b in got] == [[0, 1, 2], [3, 4, 5]]


def test_docstring_map():
    assert items(Dataset.range(1, 6).map(lambda x: x + 1)) == [2, 3, 4, 5, 6]
    elements = [(1, "foo"), (2, "bar"), (3, "baz")]
    ds = Dataset.from_generator(lambda: elements, (np.int32, np.str_))
    assert items(ds.map(lambda x_int, y_str: x_int)) == [1, 2, 3]  # a tuple is unpacked
    elements = [{"a": 1, "b": "foo"}, {"a": 2, "b": "bar"}, {"a": 3, "b": "baz"}]
    ds = Dataset.from_generator(lambda: elements, {"a": np.int32, "b": np.str_})
    assert list(ds.map(lambda d: str(d["a"]) + d["b"])) == ["1foo", "2bar", "3baz"]

    def h(x):
        return 37.0, [1, 2], np.array([1.0, 2.0], dtype=np.float64)

    first = next(iter(Dataset.range(3).map(h)))
    assert [(np.shape(v), np.asarray(v).dtype) for v in first] == [
        ((), np.float32), ((2,), np.int32), ((2,), np.float64)]

    def i(x):
        return (37.0, [42, 16]), 7

    (f, ints), seven = next(iter(Dataset.range(3).map(i)))
    assert f.dtype == np.float32 and ints.dtype == np.int32 and ints.shape == (2,)
    assert seven.dtype == np.int32
    ds = Dataset.range(1, 6).map(lambda x: x + 1, num_parallel_calls=data.AUTOTUNE,
                                 deterministic=False)
    assert items(ds) == [2, 3, 4, 5, 6]


def test_docstring_filter():
    ds = Dataset.from_tensor_slices([1, 2, 3]).filter(lambda x: x < 3)
    assert items(ds) == [1, 2]
    assert items(ds.filter(lambda x: np.equal(x, 1))) == [1]
    with pytest.raises(ValueError, match="scalar boolean"):
        list(Dataset.range(3).filter(lambda x: np.array([True, False])))


def test_docstring_unbatch_prefetch_cardinality():
    elements = [[1, 2, 3], [1, 2], [1, 2, 3, 4]]
    ds = Dataset.from_generator(lambda: elements, np.int64).unbatch()
    assert items(ds) == [1, 2, 3, 1, 2, 1, 2, 3, 4]
    assert items(Dataset.range(3).prefetch(2)) == [0, 1, 2]
    ds = Dataset.range(42)
    assert ds.cardinality() == 42
    ds = ds.repeat()
    assert ds.cardinality() == data.INFINITE_CARDINALITY
    ds = ds.filter(lambda x: True)
    assert ds.cardinality() == data.UNKNOWN_CARDINALITY


# ------------------------------------------------------------------------------ semantics


def test_cardinality_as_tf_counts():
    r = Dataset.range(10)
    filtered = r.filter(lambda x: True)
    cases = {
        "range": (r, 10), "take": (r.take(3), 3), "take_all": (r.take(-1), 10),
        "take_inf": (r.repeat().take(3), 3), "take_unknown": (filtered.take(3), UNK),
        "skip": (r.skip(7), 3), "skip_past": (r.skip(20), 0), "skip_all": (r.skip(-1), 0),
        "skip_inf": (r.repeat().skip(3), INF), "skip_unknown": (filtered.skip(1), UNK),
        "filter": (filtered, UNK), "repeat": (r.repeat(3), 30), "repeat0": (r.repeat(0), 0),
        "repeat_inf": (r.repeat(), INF), "repeat_unknown_inf": (filtered.repeat(), INF),
        "repeat_empty": (Dataset.range(0).repeat(), 0),
        "batch": (r.batch(3), 4), "batch_drop": (r.batch(3, drop_remainder=True), 3),
        "batch_inf": (r.repeat().batch(3), INF),
        "unbatch_static": (r.batch(2, drop_remainder=True).unbatch(), 10),
        "unbatch": (r.batch(3).unbatch(), UNK), "unbatch_inf": (r.repeat().batch(2).unbatch(),
                                                                INF),
        "shard": (r.shard(3, 1), 3), "shard_inf": (r.repeat().shard(3, 1), INF),
        "zip": (Dataset.zip(r, r.repeat()), 10), "zip_unknown": (Dataset.zip(r, filtered), UNK),
        "concatenate": (r.concatenate(r.repeat()), INF), "concatenate2": (r.concatenate(r), 20),
        "map": (r.map(lambda x: x), 10), "enumerate": (r.enumerate(), 10),
        "cache": (r.cache(), 10), "prefetch": (r.prefetch(1), 10),
        "shuffle": (r.shuffle(4), 10), "generator": (Dataset.from_generator(lambda: [1], np.int32),
                                                     UNK),
        "from_tensors": (Dataset.from_tensors([1, 2]), 1),
    }
    got = {k: ds.cardinality() for k, (ds, _) in cases.items()}
    assert got == {k: want for k, (_, want) in cases.items()}
    assert len(r.batch(3)) == 4
    with pytest.raises(TypeError, match="infinite"):
        len(r.repeat())
    with pytest.raises(TypeError, match="unknown"):
        len(filtered)
    for name in ("take_inf", "skip_past", "batch", "unbatch_static", "shard", "zip",
                 "concatenate2", "repeat"):
        ds, want = cases[name]
        assert len(list(ds)) == want, name


def test_shuffle_seeds_reshuffles_and_buffer():
    ds = Dataset.range(50).shuffle(50, seed=3)
    a, b = items(ds), items(ds)
    assert sorted(a) == list(range(50)) and a != list(range(50))
    assert a != b, "each pass reshuffles"
    assert items(Dataset.range(50).shuffle(50, seed=3)) == a  # same seed, same orders
    fixed = Dataset.range(50).shuffle(50, seed=3, reshuffle_each_iteration=False)
    assert items(fixed) == items(fixed)
    twice = items(fixed.repeat(2))
    assert twice[:50] == twice[50:]
    # reshuffle_each_iteration=True: each repeat pass has its own order.
    passes = items(ds.repeat(2))
    assert sorted(passes[:50]) == sorted(passes[50:]) and passes[:50] != passes[50:]
    # A small buffer only moves elements a bounded distance ahead (tf.data's buffer).
    small = items(Dataset.range(100).shuffle(5, seed=0))
    assert sorted(small) == list(range(100))
    assert all(v <= i + 4 for i, v in enumerate(small))
    # The row-indexed fast path and the element path give the same order for a seed.
    slow = Dataset.range(30).map(lambda x: x).shuffle(7, seed=2)
    assert items(slow) == items(Dataset.range(30).shuffle(7, seed=2))
    unseeded = Dataset.range(20).shuffle(20, reshuffle_each_iteration=False)
    assert items(unseeded) == items(unseeded)
    with pytest.raises(ValueError, match="buffer_size must be >= 1"):
        Dataset.range(3).shuffle(0)


def test_shuffle_then_batch_is_one_gather_and_matches_the_element_path():
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    fast = Dataset.from_tensor_slices(x).shuffle(20, seed=0).batch(6)
    slow = Dataset.from_tensor_slices(x).map(lambda r: r).shuffle(20, seed=0).batch(6)
    for a, b in zip(fast, slow, strict=True):
        np.testing.assert_array_equal(a, b)
        assert not a.flags.writeable
    got = np.concatenate(list(fast))
    assert sorted(got[:, 0].tolist()) == x[:, 0].tolist()


def test_batches_of_consecutive_rows_are_views():
    x = np.arange(24, dtype=np.float32).reshape(12, 2).copy()
    x.flags.writeable = False  # read-only and owning its data: the snapshot is x itself
    for ds in (Dataset.from_tensor_slices(x).batch(4),
               Dataset.from_tensor_slices(x).skip(2).take(8).batch(4),
               Dataset.from_tensor_slices(x).repeat(2).batch(4),
               Dataset.from_tensor_slices(x).cache().batch(4)):
        for b in ds:
            assert np.shares_memory(b, x) and not b.flags.writeable
    got = np.concatenate(list(Dataset.from_tensor_slices(x).repeat(2).batch(5)))
    np.testing.assert_array_equal(got, np.concatenate([x, x]))


def test_cache_freezes_a_shuffle_and_partial_passes_do_not_fill_it(tmp_path):
    ds = Dataset.range(10).shuffle(10, seed=1).cache()
    first = items(ds)
    assert items(ds) == first and items(ds.repeat(2)) == first * 2
    calls = []
    mapped = Dataset.range(4).map(lambda x: calls.append(1) or x).cache()
    assert items(mapped.take(2)) == [0, 1]
    assert items(mapped) == [0, 1, 2, 3]
    assert items(mapped) == [0, 1, 2, 3]
    assert len(calls) == 2 + 4  # the partial pass did not finish the cache
    path = str(tmp_path / "c")
    assert items(Dataset.range(3).map(lambda x: x * 2).cache(path)) == [0, 2, 4]
    # A new pipeline over the same file reads it (tf.data's file cache outlives the run).
    assert items(Dataset.range(3).map(lambda x: x * 100).cache(path)) == [0, 2, 4]


def test_map_filter_unpack_tuples_not_dicts_or_namedtuples():
    import collections

    pair = collections.namedtuple("pair", "a b")
    ds = Dataset.from_tensor_slices(pair(np.arange(3), np.arange(3) * 10))
    assert [int(p.b) for p in ds.map(lambda p: p)] == [0, 10, 20]  # one argument
    ds = Dataset.from_tensor_slices({"x": np.arange(3), "y": np.ones(3)})
    assert [int(e) for e in ds.map(lambda d: d["x"])] == [0, 1, 2]
    ds = Dataset.from_tensor_slices((np.arange(4), np.arange(4) * 2))
    assert [int(b) for _, b in ds.filter(lambda a, b: a % 2 == 0)] == [0, 4]


def test_partial_batches_infinite_repeat_and_element_structure():
    x, y = np.arange(10, dtype=np.float32), np.arange(10) % 2
    ds = Dataset.from_tensor_slices({"x": x, "y": y}).map(
        lambda e: (e["x"] * 2, e["y"])).batch(4)
    got = list(ds)
    assert [b[0].shape for b in got] == [(4,), (4,), (2,)]
    assert isinstance(got[0], tuple) and got[0][1].dtype == y.dtype
    inf = Dataset.from_tensor_slices(x).batch(4).repeat()
    it = iter(inf)
    sizes = [next(it).shape[0] for _ in range(7)]
    assert sizes == [4, 4, 2, 4, 4, 2, 4]
    across = list(Dataset.from_tensor_slices(x).repeat().batch(4).take(3))
    np.testing.assert_array_equal(across[2], [8, 9, 0, 1])  # batches cross pass boundaries
    with pytest.raises(ValueError, match="cannot stack elements of different shapes"):
        list(Dataset.from_generator(lambda: [[1, 2], [1]], np.int32).batch(2))


def test_from_generator_signatures():
    def gen():
        for i in range(3):
            yield i, [1.5] * i

    sig = (data.TensorSpec((), np.int32), data.TensorSpec((None,), np.float32))
    got = list(Dataset.from_generator(gen, output_signature=sig))
    assert [(int(a), b.tolist()) for a, b in got] == [(0, []), (1, [1.5]), (2, [1.5, 1.5])]
    assert got[1][0].dtype == np.int32 and got[1][1].dtype == np.float32
    old = Dataset.from_generator(gen, output_types=(np.int64, np.float64),
                                 output_shapes=((), (None,)))
    assert [b.dtype for _, b in old] == [np.float64] * 3
    with pytest.raises(ValueError, match=r"shape \(2,\) where an element of shape \(\) was"):
        list(Dataset.from_generator(lambda: [[1, 2]], output_signature=data.TensorSpec(
            (), np.int32)))
    with pytest.raises(TypeError, match="did not match the expected structure"):
        list(Dataset.from_generator(lambda: [1], output_signature=sig))
    args = list(Dataset.from_generator(lambda n: range(n), np.int64, args=(3,)))
    assert [int(a) for a in args] == [0, 1, 2]
    assert Dataset.from_generator(gen, output_signature=sig).cardinality() == UNK
    with pytest.raises(TypeError, match="not both"):
        Dataset.from_generator(gen, output_types=np.int32, output_signature=sig)
    # jax.ShapeDtypeStruct works as a spec.
    import jax

    spec = jax.ShapeDtypeStruct((2,), np.float32)
    assert next(iter(Dataset.from_generator(lambda: [[1, 2]], output_signature=spec))).dtype \
        == np.float32


def test_options_merge_and_tf_spelling():
    ds = Dataset.range(8).batch(4)
    assert ds.options().experimental_distribute.auto_shard_policy is jaxdist.AutoShardPolicy.AUTO
    opts = data.Options()
    opts.experimental_distribute.auto_shard_policy = data.experimental.AutoShardPolicy.OFF
    off = ds.with_options(opts)
    assert off.options().experimental_distribute.auto_shard_policy is jaxdist.AutoShardPolicy.OFF
    other = data.Options()
    other.deterministic = False
    both = off.map(lambda x: x).with_options(other)  # options survive transformations
    assert both.options().experimental_distribute.auto_shard_policy.name == "OFF"
    assert both.options().deterministic is False
    assert ds.options().experimental_distribute.auto_shard_policy.name == "AUTO"
    assert items(off.unbatch()) == list(range(8))
    with pytest.raises(AttributeError, match="no option 'auto_shard'"):
        opts.experimental_distribute.auto_shard = 1
    with pytest.raises(ValueError, match="auto_shard_policy='FILES'"):
        opts.experimental_distribute.auto_shard_policy = "FILES"


def test_unseeded_shuffle_is_tracked_through_the_pipeline():
    assert Dataset.range(4).shuffle(4).batch(2).map(lambda x: x)._unseeded_shuffle
    assert not Dataset.range(4).shuffle(4, seed=0).batch(2)._unseeded_shuffle
    assert Dataset.zip(Dataset.range(3), Dataset.range(3).shuffle(3))._unseeded_shuffle


# ----------------------------------------------------------- the same pipelines through tf.data


def _pipelines():
    return {
        "slices_batch": lambda D: D.from_tensor_slices(np.arange(10.0)).batch(3),
        "slices_list": lambda D: D.from_tensor_slices([[1, 2], [3, 4], [5, 6]]),
        "dict_map_batch": lambda D: D.from_tensor_slices(
            {"a": np.arange(7), "b": np.arange(7.0) * 2}).map(
                lambda e: (e["a"] + 1, e["b"])).batch(2, drop_remainder=True),
        "tuple_filter": lambda D: D.from_tensor_slices(
            (np.arange(9), np.arange(9) * 3)).filter(lambda a, b: a % 3 == 0),
        "repeat_take_skip": lambda D: D.range(5).repeat().skip(3).take(9),
        "batch_unbatch": lambda D: D.range(7).batch(3).unbatch(),
        "repeat_batch": lambda D: D.range(5).repeat(3).batch(4),
        "zip_enumerate": lambda D: D.zip(D.range(4), D.range(10, 20).batch(2)).enumerate(3),
        "zip_dict": lambda D: D.zip({"x": D.range(3), "y": D.range(5, 9)}),
        "concat_shard": lambda D: D.range(4).concatenate(D.range(10, 13)).shard(2, 1),
        "cache_map": lambda D: D.range(6).map(lambda x: x * x).cache().batch(4),
        "from_tensors_repeat": lambda D: D.from_tensors(np.arange(3)).repeat(2),
        "map_scalars": lambda D: D.range(3).map(lambda x: (x, 2.5, 7)),
        "range_args": lambda D: D.range(10, 1, -3),
    }


@pytest.mark.parametrize("name", sorted(_pipelines()))
def test_same_elements_as_tf_data(name):
    tf = pytest.importorskip("tensorflow", reason="tensorflow (the tfdata test extra) is absent")
    make = _pipelines()[name]
    want_ds, got_ds = make(tf.data.Dataset), make(Dataset)
    assert got_ds.cardinality() == int(want_ds.cardinality())
    want = list(want_ds.as_numpy_iterator())
    got = list(got_ds.as_numpy_iterator())
    assert len(got) == len(want)
    import jax

    for g, w in zip(got, want):
        gl, gt = jax.tree.flatten(g)
        wl, wt = jax.tree.flatten(w)
        assert gt == wt, (name, gt, wt)
        for a, b in zip(gl, wl):
            assert np.asarray(a).dtype == np.asarray(b).dtype, (name, a, b)
            np.testing.assert_array_equal(a, b)
