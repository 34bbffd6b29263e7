"""The data format of workers' answers (``answer_codec``): every refusal is typed and names
the worker; nothing a worker sends is unpickled or given power over the chief's objects."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from jaxdist._src.coordinator.answer_codec import (
    MAGIC,
    MAX_DEPTH,
    NotDataError,
    RemoteException,
    UntrustedPickleError,
    decode,
    encode,
)


def _array(name: bytes, shape: tuple[int, ...], raw: bytes) -> bytes:
    return (MAGIC + b"a" + bytes([len(name)]) + name + bytes([len(shape)])
            + b"".join(struct.pack("<Q", d) for d in shape) + raw)


@pytest.mark.parametrize("dtype", [b"O", b"|O", b"object", b"V8", b"i4,O", b"(2,)i4", b"<U"])
def test_pointer_bearing_and_structured_dtypes_are_refused_naming_the_worker(dtype):
    with pytest.raises(UntrustedPickleError, match=r"^worker:3 sent an answer") as e:
        decode(_array(dtype, (1,), b"A" * 8), "worker:3")
    assert e.value.sender == "worker:3"


def test_nesting_is_bounded_on_both_sides():
    deep: list = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(NotDataError, match=f"deeper than {MAX_DEPTH}"):
        encode(deep)
    payload = MAGIC + b"l\x01\0\0\0" * 100_000 + b"N"
    with pytest.raises(UntrustedPickleError, match=f"deeper than {MAX_DEPTH}"):
        decode(payload, "worker:0")
    ok: list = []
    for _ in range(MAX_DEPTH - 1):
        ok = [ok]
    assert decode(encode(ok)) == ok


def test_counts_and_shapes_past_the_bytes_are_refused_before_allocating():
    for payload in (MAGIC + b"l" + struct.pack("<I", 0xFFFFFFFF),
                    MAGIC + b"b" + struct.pack("<I", 1 << 30) + b"x",
                    _array(b"float32", (1 << 62,), b""),
                    _array(b"float32", (0, 1 << 63), b""),
                    MAGIC + b"N" + b"trailing"):
        with pytest.raises(UntrustedPickleError, match="worker:0"):
            decode(payload, "worker:0")


def test_bools_are_normalised_and_strings_checked():
    got = decode(_array(b"bool", (3,), b"\0\x01\x07"))
    assert got.dtype == np.bool_ and got.tolist() == [False, True, True]
    with pytest.raises(UntrustedPickleError, match="U\\+10FFFF"):
        decode(_array(b"<U1", (1,), b"\xff" * 4), "worker:0")


def test_exceptions_are_rebuilt_only_for_builtin_and_jaxdist_types():
    from jaxdist.coordinator import WorkerUnavailableError

    error = decode(encode(WorkerUnavailableError("gone", task="ps:0")))
    assert type(error) is WorkerUnavailableError and error.task == "ps:0"
    for e in (SystemExit(2), KeyboardInterrupt(), _Mine("x")):
        got = decode(encode(e))
        assert isinstance(got, RemoteException) and got.name == type(e).__qualname__


def test_an_exceptions_attributes_cannot_replace_its_methods():
    hostile = ValueError("v")
    hostile.add_note("n")
    hostile.__dict__.update(add_note="not a method", with_traceback=1, args=("x",), code=7)
    got = decode(encode(hostile), "worker:0")
    assert type(got) is ValueError and got.args == ("v",) and got.code == 7
    assert got.__notes__ == ["n"] and callable(got.add_note) and callable(got.with_traceback)


class _Mine(Exception):
    pass
