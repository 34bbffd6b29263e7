"""Wire format: every dtype round-trips bit-exactly, chunking, errors."""

import ml_dtypes
import numpy as np
import pytest

from jaxdist._src.transport import wire

DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
    ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e4m3b11fnuz, ml_dtypes.int4, ml_dtypes.uint4,
]


def _random(dtype, shape, rng):
    dt = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    if dt == np.bool_:
        return raw.astype(bool).reshape(shape)
    if dt.name in ("int4", "uint4"):
        lo, hi = (-8, 8) if dt.name == "int4" else (0, 16)
        return rng.integers(lo, hi, size=shape).astype(dt)
    return raw.view(dt).reshape(shape)  # arbitrary bit patterns, NaNs included


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5, 2)])
def test_every_dtype_round_trips_bit_exactly(dtype, shape):
    x = _random(dtype, shape, np.random.default_rng(0))
    meta, out = wire.decode(wire.encode({"k": [1, "a"]}, {"x": x}, chunk_bytes=5))
    y = out["x"]
    assert meta == {"k": [1, "a"]}
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.tobytes() == x.tobytes()


def test_many_arrays_and_chunk_boundaries():
    rng = np.random.default_rng(1)
    arrays = {f"a{i}": rng.normal(size=(i, 3)).astype(np.float32) for i in range(10)}
    for chunk in (1, 7, 64, 1 << 20):
        chunks = list(wire.encode({}, arrays, chunk_bytes=chunk))
        assert all(len(c) <= max(chunk, len(chunks[0])) for c in chunks[1:])
        _, out = wire.decode(chunks)
        for k, v in arrays.items():
            np.testing.assert_array_equal(out[k], v)


def test_big_endian_and_non_contiguous_inputs():
    x = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]
    _, out = wire.decode(wire.encode({}, {"x": x}))
    np.testing.assert_array_equal(out["x"], x)


def test_large_message_is_chunked():
    x = np.arange(3 << 20, dtype=np.float32)  # 12 MiB
    chunks = list(wire.encode({}, {"x": x}, chunk_bytes=1 << 20))
    assert len(chunks) >= 12
    np.testing.assert_array_equal(wire.decode(chunks)[1]["x"], x)


def test_errors_name_the_bad_value():
    with pytest.raises(wire.WireError, match="dtype <U1|dtype <U"):
        list(wire.encode({}, {"s": np.array(["a"])}))
    with pytest.raises(wire.WireError, match="unknown dtype name 'nope'"):
        wire.dtype_from_name("nope")
    chunks = list(wire.encode({}, {"x": np.ones(10)}))
    with pytest.raises(wire.WireError, match="truncated"):
        wire.decode([chunks[0][:-8]])
    with pytest.raises(wire.WireError, match="magic"):
        wire.decode([b"XXXX" + chunks[0][4:]])
