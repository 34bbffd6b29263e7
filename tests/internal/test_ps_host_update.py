"""The ps's numpy ``assign_add`` (``jaxdist._src.ps.host_update``): same bits as the jitted add,
in place only when nothing else holds the value, other dtypes on the jitted add."""

import platform
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdist._src.ps import host_update
from jaxdist._src.ps.service import _ASSIGN_ADD, ParameterService

X86_GLIBC = platform.machine() in ("x86_64", "AMD64") and platform.libc_ver()[0] == "glibc"


def _is_float(dtype):
    return dtype.kind == "f" or dtype == np.dtype(ml_dtypes.bfloat16)


def _values(dtype, n, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if _is_float(dtype):
        info = ml_dtypes.finfo(dtype)
        x = rng.normal(size=n) * rng.choice([1.0, 1e-3, 1e-30, 1e-38, 1e-40, 1e30], n)
        with np.errstate(over="ignore"):
            x = x.astype(dtype)
        special = np.array([info.smallest_subnormal, -info.smallest_subnormal, 0.0, -0.0,
                            np.inf, -np.inf, np.nan, info.max], dtype)
        k = min(n, special.size)
        x[:k] = special[:k]
        return x
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype, endpoint=True)
    return np.ones(n, dtype)


def _jitted_reference(value, grads):
    """What the ps computed before the host add: the donating jitted add, push after push."""
    v = jnp.array(value)
    for g in grads:
        v = _ASSIGN_ADD(v, g)
    return np.asarray(v)


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.int16, np.int32, np.uint8,
                                   np.uint16, np.uint32, np.float16, ml_dtypes.bfloat16,
                                   np.complex64, np.bool_],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (7,), (33, 65)], ids=str)
def test_push_is_bit_identical_to_the_jitted_add(dtype, shape):
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    value = _values(dtype, n, 0).reshape(shape)
    grads = [_values(dtype, n, s).reshape(shape) for s in (1, 2, 3)]
    svc = ParameterService("ps:0")
    svc.create({"w": value}, {"w": {}})
    for i, g in enumerate(grads):
        assert svc.push({"w": g}, {"w": i})["w"]["version"] == i + 1
    got, version = svc.pull(["w"])["w"]
    want = _jitted_reference(value, grads)
    assert version == 3
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    on_host = type(svc._vars["w"].value) is np.ndarray
    if (dtype == np.dtype(np.float32) and X86_GLIBC) or dtype.kind in "iu":
        assert on_host, f"{dtype} should take the numpy add"
    if dtype not in host_update.HOST_ADD_DTYPES:
        assert not on_host, f"{dtype} should stay on the jitted add"


def test_denormals_are_flushed_like_xla_and_the_thread_mode_comes_back():
    tiny = np.finfo(np.float32).smallest_subnormal
    svc = ParameterService("ps:0")
    svc.create({"w": np.array([tiny, np.finfo(np.float32).tiny, 1.0], np.float32)}, {"w": {}})
    svc.push({"w": np.array([tiny, -tiny, 1e-45], np.float32)}, {"w": 0})
    got = svc.pull(["w"])["w"][0]
    want = np.asarray(_ASSIGN_ADD(jnp.array([tiny, np.finfo(np.float32).tiny, 1.0],
                                            np.float32),
                                  np.array([tiny, -tiny, 1e-45], np.float32)))
    assert got.tobytes() == want.tobytes()
    # numpy in this thread keeps IEEE denormals after the push
    assert np.add(np.float32(tiny), np.float32(tiny)) == np.float32(2 * tiny)


def test_a_pulled_value_never_changes_and_unshared_values_update_in_place():
    svc = ParameterService("ps:0")
    svc.create({"w": np.zeros(1000, np.float32)}, {"w": {}})
    pulled = svc.pull(["w"])["w"][0]
    view = pulled[10:20]
    svc.push({"w": np.ones(1000, np.float32)}, {"w": 0})
    assert not pulled.any() and not view.any()  # a pull in flight sees its snapshot
    np.testing.assert_array_equal(svc.pull(["w"])["w"][0], np.ones(1000, np.float32))
    del pulled, view
    address = svc._vars["w"].value.ctypes.data
    svc.push({"w": np.ones(1000, np.float32)}, {"w": 1})
    assert svc._vars["w"].value.ctypes.data == address  # nothing held it: in place
    held = jnp.asarray(svc.pull(["w"])["w"][0])  # a JAX array made from a pulled value
    snapshot = np.asarray(held).copy()
    svc.push({"w": np.ones(1000, np.float32)}, {"w": 2})
    np.testing.assert_array_equal(np.asarray(held), snapshot)
    np.testing.assert_array_equal(svc.pull(["w"])["w"][0], np.full(1000, 3, np.float32))


def test_pushing_the_pulled_value_itself_adds_the_old_value():
    svc = ParameterService("ps:0")
    svc.create({"w": np.arange(5, dtype=np.int32)}, {"w": {}})
    value = svc.pull(["w"])["w"][0]
    svc.push({"w": value}, {"w": 0})
    np.testing.assert_array_equal(svc.pull(["w"])["w"][0], 2 * np.arange(5, dtype=np.int32))
    np.testing.assert_array_equal(value, np.arange(5, dtype=np.int32))


def test_concurrent_pushes_and_pulls_lose_nothing():
    svc = ParameterService("ps:0")
    svc.create({"w": np.zeros(4096, np.float32)}, {"w": {}})
    errors = []

    def pusher():
        for i in range(200):
            svc.push({"w": np.ones(4096, np.float32)}, {"w": i})

    def puller():
        for _ in range(200):
            v = svc.pull(["w"])["w"][0]
            if not (v == v[0]).all():  # a torn read: part old, part new
                errors.append(v.copy())

    threads = [threading.Thread(target=f) for f in (pusher, pusher, puller, puller)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    got, version = svc.pull(["w"])["w"]
    assert version == 400 and (got == 400).all()


def test_the_jitted_add_still_serves_values_it_made():
    # A bfloat16 variable stays a JAX array; pulls copy nothing and see the sum.
    svc = ParameterService("ps:0")
    svc.create({"h": np.ones(3, ml_dtypes.bfloat16)}, {"h": {}})
    svc.push({"h": np.ones(3, ml_dtypes.bfloat16)}, {"h": 0})
    assert isinstance(svc._vars["h"].value, jax.Array)
    np.testing.assert_array_equal(svc.pull(["h"])["h"][0].astype(np.float32), [2, 2, 2])


def test_host_add_mode_refuses_a_numpy_add_that_differs(monkeypatch):
    monkeypatch.setattr(host_update, "_MODES", {})

    def off_by_one(value, delta):  # an "XLA" whose add no numpy add matches
        return value + delta + np.ones_like(value)

    assert host_update.host_add_mode(np.dtype(np.int32), off_by_one) is None
    assert host_update.host_add_mode(np.dtype(np.float16), off_by_one) is None


def test_large_values_keep_the_jitted_add():
    n = host_update.HOST_ADD_MAX_BYTES // 4 + 16
    svc = ParameterService("ps:0")
    svc.create({"w": np.ones(n, np.float32), "s": np.ones(16, np.float32)}, {"w": {}, "s": {}})
    svc.push({"w": np.ones(n, np.float32), "s": np.ones(16, np.float32)}, {"w": 0, "s": 0})
    assert isinstance(svc._vars["w"].value, jax.Array)
    assert type(svc._vars["s"].value) is np.ndarray
    assert (svc.pull(["w"])["w"][0] == 2).all()


def test_row_pushes_to_a_dense_variable_never_change_a_pulled_value():
    svc = ParameterService("ps:0")
    svc.create({"w": np.zeros((4, 2), np.float32)}, {"w": {}})
    svc.push({"w": np.ones((4, 2), np.float32)}, {"w": 0})  # stays a numpy value
    pulled = svc.pull(["w"])["w"][0]
    svc.push_rows("w", np.array([1]), np.ones((1, 2), np.float32), 1)
    np.testing.assert_array_equal(pulled, np.ones((4, 2), np.float32))
    np.testing.assert_array_equal(svc.pull(["w"])["w"][0][1], [2, 2])


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.uint64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [5, host_update.HOST_ADD_MAX_BYTES // 8 + 3], ids=["small", "large"])
def test_64_bit_variables_keep_their_dtype_and_every_bit(dtype, n):
    if jax.config.jax_enable_x64:
        pytest.skip("with x64 the jitted add holds 64-bit values (covered above)")
    value, grads = _values(dtype, n, 0), [_values(dtype, n, s) for s in (1, 2)]
    if dtype == np.float64:
        value[:3] = 1.0
        grads[0][:3] = grads[1][:3] = 1e-10  # lost in float32
    svc = ParameterService("ps:0")
    svc.create({"w": value}, {"w": {}})
    for i, g in enumerate(grads):
        svc.push({"w": g}, {"w": i})  # the second push was refused once the value narrowed
    got = svc.pull(["w"])["w"][0]
    with np.errstate(all="ignore"):
        want = (value + grads[0]) + grads[1]
    assert got.dtype == np.dtype(dtype) and got.tobytes() == want.tobytes()
    if dtype == np.float64:
        assert (got[:3] > 1.0).all()
