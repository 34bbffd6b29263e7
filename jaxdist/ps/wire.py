"""Wire format: messages of JSON metadata plus raw array bytes, split into chunks. No pickle.

A message is ``(meta, arrays)``: ``meta`` is a JSON-serialisable dict, ``arrays`` maps names to
numpy arrays. Each array travels as its dtype name, shape and raw little-endian bytes, so every
dtype numpy and ``ml_dtypes`` know (``bfloat16``, the ``float8`` family, ``int4``, ...)
round-trips bit-exactly. A message is cut into chunks of at most ``chunk_bytes`` so tensors of
hundreds of MB stream through gRPC without hitting message-size limits.

Frame of the first chunk: ``b"JDW1"``, 8-byte little-endian header length, 8-byte total payload
length, the JSON header, then the first payload bytes. Later chunks are payload bytes only.

Example:
    >>> chunks = list(encode({"op": "pull"}, {"w": np.ones((2, 3), np.float32)}))
    >>> meta, arrays = decode(chunks)
    >>> arrays["w"].shape
    (2, 3)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from jaxdist.ps.memory import ALIGNMENT, BufferPool, aligned_empty

MAGIC = b"JDW1"
DEFAULT_CHUNK_BYTES = 1 << 20
_PREFIX = struct.Struct("<4sQQ")


class WireError(ValueError):
    """A message that cannot be encoded or decoded (bad dtype, truncated data, bad header)."""


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype called ``name`` (numpy names, or an ``ml_dtypes`` name like bfloat16).

    Example:
        >>> dtype_from_name("bfloat16")
        dtype(bfloat16)
    """
    ml = getattr(ml_dtypes, name, None)
    if ml is not None and isinstance(ml, type):
        return np.dtype(ml)
    try:
        dt = np.dtype(name)
    except TypeError:
        raise WireError(
            f"unknown dtype name {name!r}: expected a numpy or ml_dtypes name"
        ) from None
    if dt.kind in "OUSV" or dt.fields is not None:
        raise WireError(f"dtype {name!r} has no raw-bytes wire form: expected a numeric dtype")
    return dt


def dtype_name(dtype: Any) -> str:
    """The wire name of ``dtype`` (``dtype_from_name`` inverts it)."""
    dt = np.dtype(dtype)
    if dt.kind in "OUS" or (dt.kind == "V" and getattr(ml_dtypes, dt.name, None) is None):
        raise WireError(
            f"arrays of dtype {dt} cannot cross the wire: expected a numeric dtype "
            f"(bool, ints, floats, complex, or an ml_dtypes type such as bfloat16)"
        )
    return dt.name


def _as_wire_array(x: Any) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def encode(
    meta: Mapping[str, Any] | None = None,
    arrays: Mapping[str, Any] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[bytes]:
    """Yields the chunks of one message.

    Args:
        meta: JSON-serialisable metadata.
        arrays: name -> array-like (numpy, jax, scalars).
        chunk_bytes: the most bytes one chunk carries.

    Raises:
        WireError: an array has a dtype without a raw-bytes form (strings, objects).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    specs = []
    views: list[Any] = []
    offset = 0
    for name, x in (arrays or {}).items():
        arr = _as_wire_array(x)
        pad = (-offset) % ALIGNMENT  # every array starts aligned in the decoded payload
        if pad and arr.nbytes:
            views.append(memoryview(bytes(pad)))
            offset += pad
        specs.append([name, dtype_name(arr.dtype), list(arr.shape), offset, arr.nbytes])
        offset += arr.nbytes
        if arr.nbytes:
            views.append(memoryview(arr.reshape(-1).view(np.uint8)))
    header = json.dumps({"meta": dict(meta or {}), "arrays": specs}).encode()
    # Each payload byte is copied once, straight from the array into the chunk gRPC sends:
    # full chunks are slices of one array; only the pieces that share a chunk (the header,
    # small arrays, the ends of large ones) are joined.
    pending: list[Any] = [_PREFIX.pack(MAGIC, len(header), offset) + header]
    pending_n = len(pending[0])
    for view in views:
        pos, n = 0, len(view)
        if pending_n + n < chunk_bytes:
            pending.append(view)
            pending_n += n
            continue
        pos = max(0, chunk_bytes - pending_n)
        pending.append(view[:pos])
        yield b"".join(pending)
        pending, pending_n = [], 0
        while n - pos >= chunk_bytes:
            yield bytes(view[pos : pos + chunk_bytes])
            pos += chunk_bytes
        if pos < n:
            pending, pending_n = [view[pos:]], n - pos
    if pending:
        yield b"".join(pending)


def decode(
    chunks: Iterable[bytes], pool: BufferPool | None = None
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Reassembles one message from its chunks: returns ``(meta, arrays)``.

    The arrays are writable views of one payload buffer, taken from ``pool`` when given
    (``jaxdist.ps.memory.RECEIVE_POOL`` recycles buffers that earlier messages' arrays no
    longer use). Each starts on a 64-byte boundary (the encoder pads between arrays), so JAX
    on CPU takes it without a copy.

    Raises:
        WireError: the chunks do not form a complete message.
    """
    it = iter(chunks)
    try:
        first = next(it)
    except StopIteration:
        raise WireError("empty message: expected at least one chunk") from None
    if len(first) < _PREFIX.size:
        raise WireError(f"first chunk has {len(first)} bytes, shorter than the frame prefix")
    magic, hlen, total = _PREFIX.unpack_from(first)
    if magic != MAGIC:
        raise WireError(f"bad frame magic {magic!r}: expected {MAGIC!r}")
    start = _PREFIX.size
    try:
        header = json.loads(bytes(first[start : start + hlen]))
    except ValueError as e:
        raise WireError(f"bad message header: {e}") from None
    payload = pool.take(total) if pool is not None else aligned_empty(total)
    got = len(first) - start - hlen
    if got > total:
        raise WireError(f"first chunk carries {got} payload bytes, message declares {total}")
    payload[:got] = np.frombuffer(first, np.uint8, count=got, offset=start + hlen)
    for chunk in it:
        n = len(chunk)
        if got + n > total:
            raise WireError(f"message has more than the {total} payload bytes it declares")
        payload[got : got + n] = np.frombuffer(chunk, np.uint8)
        got += n
    if got != total:
        raise WireError(f"truncated message: got {got} of {total} payload bytes")
    arrays = {}
    for name, dname, shape, off, nbytes in header["arrays"]:
        dt = dtype_from_name(dname)
        arrays[name] = payload[off : off + nbytes].view(dt).reshape(shape)
    return header["meta"], arrays


def message_nbytes(arrays: Mapping[str, Any]) -> int:
    """Payload bytes the arrays of a message take on the wire."""
    return sum(np.asarray(x).nbytes for x in arrays.values())


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "WireError",
    "decode",
    "dtype_from_name",
    "dtype_name",
    "encode",
    "message_nbytes",
]
