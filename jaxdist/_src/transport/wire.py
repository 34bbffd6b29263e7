"""Wire format: messages of JSON metadata plus raw array bytes, split into chunks. No pickle.

A message is ``(meta, arrays)``: ``meta`` is a JSON-serialisable dict, ``arrays`` maps names to
numpy arrays. Each array travels as its dtype name, shape and raw little-endian bytes, so every
dtype numpy and ``ml_dtypes`` know (``bfloat16``, the ``float8`` family, ``int4``, ...)
round-trips bit-exactly. A message is cut into chunks of at most ``chunk_bytes`` so tensors of
hundreds of MB stream through gRPC without hitting message-size limits.

Frame of the first chunk: ``b"JDW1"``, 8-byte little-endian header length, 8-byte total payload
length, the JSON header, then the first payload bytes. Later chunks are payload bytes only.

Example:
    >>> import numpy as np
    >>> from jaxdist._src.transport.wire import decode, encode
    >>> chunks = list(encode({"op": "pull"}, {"w": np.ones((2, 3), np.float32)}))
    >>> meta, arrays = decode(chunks)
    >>> arrays["w"].shape
    (2, 3)
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from jaxdist._src.transport.memory import ALIGNMENT, BufferPool, aligned_empty

MAGIC = b"JDW1"
DEFAULT_CHUNK_BYTES = 1 << 20
_PREFIX = struct.Struct("<4sQQ")


class WireError(ValueError):
    """A message that cannot be encoded or decoded (bad dtype, truncated data, bad header)."""


class MessageTooLargeError(WireError):
    """A message declares more payload bytes than the receiver accepts (``max_bytes``).

    Raised from the frame prefix, before any payload buffer is allocated.

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.transport.wire import decode, encode
        >>> chunks = list(encode({"step": 1}, {"w": np.zeros(1024, np.float32)}))
        >>> decode(chunks, max_bytes=1000)   # the header declares 4 KiB of arrays
        Traceback (most recent call last):
        ...
        jaxdist._src.transport.wire.MessageTooLargeError: ...
    """


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype called ``name`` (numpy names, or an ``ml_dtypes`` name like bfloat16).

    Names that parse are cached (at most 256; a bad name raises every time).

    Example:
        >>> from jaxdist._src.transport.wire import dtype_from_name
        >>> dtype_from_name("bfloat16")
        dtype(bfloat16)
    """
    if not isinstance(name, str) or not name or len(name) > 64:
        raise WireError(f"bad dtype name {str(name)[:64]!r}: expected a numpy or ml_dtypes name")
    return _dtype_from_name(name)


@functools.lru_cache(maxsize=256)
def _dtype_from_name(name: str) -> np.dtype:
    ml = getattr(ml_dtypes, name, None) if not name.startswith("_") else None
    try:
        if ml is not None and isinstance(ml, type) and issubclass(ml, np.generic):
            dt = np.dtype(ml)
        else:
            dt = np.dtype(name)
    except Exception:  # noqa: BLE001 - numpy's dtype parser raises several types
        raise WireError(
            f"unknown dtype name {name!r}: expected a numpy or ml_dtypes name"
        ) from None
    if dt.kind in "OUS" or dt.fields is not None or dt.subdtype is not None or (
            dt.kind == "V" and getattr(ml_dtypes, dt.name, None) is None):
        raise WireError(f"dtype {name!r} has no raw-bytes wire form: expected a numeric dtype")
    return dt


def dtype_name(dtype: Any) -> str:
    """The wire name of ``dtype`` (``dtype_from_name`` inverts it)."""
    name = _NAMES.get(dtype) if isinstance(dtype, np.dtype) else None
    if name is not None:
        return name
    dt = np.dtype(dtype)
    if dt.kind in "OUS" or (dt.kind == "V" and getattr(ml_dtypes, dt.name, None) is None):
        raise WireError(
            f"arrays of dtype {dt} cannot cross the wire: expected a numeric dtype "
            f"(bool, ints, floats, complex, or an ml_dtypes type such as bfloat16)"
        )
    if len(_NAMES) < 256:
        _NAMES[dt] = dt.name
    return dt.name


_NAMES: dict[np.dtype, str] = {}  # dtype_name's answers for dtypes that have a wire form


def as_wire_array(x: Any) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _layout(meta: Mapping[str, Any] | None, arrays: Mapping[str, Any] | None
            ) -> tuple[bytes, list[Any], int]:
    """A message's JSON header, the views its payload is made of, and the payload's size."""
    specs = []
    views: list[Any] = []
    offset = 0
    for name, x in (arrays or {}).items():
        arr = as_wire_array(x)
        pad = (-offset) % ALIGNMENT  # every array starts aligned in the decoded payload
        if pad and arr.nbytes:
            views.append(memoryview(bytes(pad)))
            offset += pad
        specs.append([name, dtype_name(arr.dtype), list(arr.shape), offset, arr.nbytes])
        offset += arr.nbytes
        if arr.nbytes:
            views.append(memoryview(arr.reshape(-1).view(np.uint8)))
    header = json.dumps({"meta": dict(meta or {}), "arrays": specs}).encode()
    return header, views, offset


def encoded_nbytes(meta: Mapping[str, Any] | None = None,
                   arrays: Mapping[str, Any] | None = None) -> int:
    """The bytes ``encode(meta, arrays)`` yields in all (prefix, header, padded payload).

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.transport.wire import encode, encoded_nbytes
        >>> msg = ({"step": 1}, {"w": np.ones(3)})
        >>> encoded_nbytes(*msg) == sum(len(c) for c in encode(*msg))
        True
    """
    header, _, payload = _layout(meta, arrays)
    return _PREFIX.size + len(header) + payload


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
    header, views, offset = _layout(meta, arrays)
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
    chunks: Iterable[bytes], pool: BufferPool | None = None, max_bytes: int | None = None
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Reassembles one message from its chunks: returns ``(meta, arrays)``.

    The arrays are writable views of one payload buffer, taken from ``pool`` when given
    (``jaxdist._src.transport.memory.RECEIVE_POOL`` recycles buffers that earlier messages'
    arrays no longer use). Each starts on a 64-byte boundary (the encoder pads between
    arrays), so JAX on CPU takes it without a copy.

    Every field of the frame is checked before it is used: the declared payload size against
    ``max_bytes`` (before the payload buffer is allocated), the header length against the first
    chunk, and each array's dtype, shape (non-negative dimensions), offset and byte count
    against the payload. Any input either decodes or raises ``WireError``.

    Args:
        chunks: the message's chunks.
        pool: recycles payload buffers.
        max_bytes: the most payload bytes accepted (``None``: no limit).

    Raises:
        MessageTooLargeError: the message declares more than ``max_bytes`` payload bytes.
        WireError: the chunks do not form a complete, consistent message.

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.transport.wire import decode, encode
        >>> meta, arrays = decode(encode({"op": "pull"}, {"w": np.ones(3)}), max_bytes=1 << 20)
    """
    it = iter(chunks)
    try:
        first = next(it)
    except StopIteration:
        raise WireError("empty message: expected at least one chunk") from None
    first = _as_bytes(first)
    if len(first) < _PREFIX.size:
        raise WireError(f"first chunk has {len(first)} bytes, shorter than the frame prefix "
                        f"({_PREFIX.size} bytes)")
    magic, hlen, total = _PREFIX.unpack_from(first)
    if magic != MAGIC:
        raise WireError(f"bad frame magic {magic!r}: expected {MAGIC!r}")
    if max_bytes is not None and total > max_bytes:
        raise MessageTooLargeError(
            f"message declares {total} payload bytes, more than the {max_bytes} this receiver "
            f"accepts (max_request_bytes)"
        )
    start = _PREFIX.size
    if hlen > len(first) - start:
        raise WireError(f"header length {hlen} runs past the first chunk's "
                        f"{len(first) - start} bytes after the prefix")
    header = _parse_header(first[start : start + hlen])
    specs = check_specs(header["arrays"], total)
    got = len(first) - start - hlen
    if got > total:
        raise WireError(f"first chunk carries {got} payload bytes, message declares {total}")
    try:
        payload = pool.take(total) if pool is not None else aligned_empty(total)
    except (MemoryError, ValueError):
        raise MessageTooLargeError(
            f"message declares {total} payload bytes: cannot allocate them") from None
    payload[:got] = np.frombuffer(first, np.uint8, count=got, offset=start + hlen)
    for chunk in it:
        chunk = _as_bytes(chunk)
        n = len(chunk)
        if got + n > total:
            raise WireError(f"message has more than the {total} payload bytes it declares")
        payload[got : got + n] = np.frombuffer(chunk, np.uint8)
        got += n
    if got != total:
        raise WireError(f"truncated message: got {got} of {total} payload bytes")
    arrays = {}
    for name, dt, shape, off, nbytes in specs:
        arrays[name] = payload[off : off + nbytes].view(dt).reshape(shape)
    return header["meta"], arrays


def _as_bytes(chunk: Any) -> bytes:
    if not isinstance(chunk, (bytes, bytearray, memoryview)):
        raise WireError(f"a chunk is {type(chunk).__name__}: expected bytes")
    return chunk


MAX_WIRE_INT = 2**63 - 1  # every JSON integer on the wire fits a signed 64-bit integer


def _bounded_int(text: str) -> int:
    value = int(text) if len(text) <= 21 else None
    if value is None or not -MAX_WIRE_INT - 1 <= value <= MAX_WIRE_INT:
        shown = text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"
        raise WireError(f"the integer {shown} does not fit a signed 64-bit integer: every "
                        f"integer in a message must lie in [-2**63, 2**63 - 1]")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise WireError(f"the key {key[:100]!r} appears twice in one object: each "
                                f"name (a variable, a field) may appear once")
            seen.add(key)
    return out


def loads_header(raw: bytes | bytearray) -> Any:
    """Parses a message's JSON header with every integer bounded and every key unique.

    Integers must fit a signed 64-bit integer, so no field of any request can carry a number
    the server would keep, compare or format at unbounded cost (``10**4000`` as a version,
    say). Floats (``NaN`` included) are left to the field that reads them, which checks its
    range. An object that names a key twice (``{"versions": {"w": 1, "w": 2}}``, which JSON
    parsers resolve differently) is refused.

    Raises:
        WireError: the text is not JSON, nests too deeply, carries such an integer, or names
            a key twice in one object; the message names it.

    Example:
        >>> from jaxdist._src.transport.wire import loads_header
        >>> loads_header(b'{"versions": {"w": 3}}')
        {'versions': {'w': 3}}
    """
    try:
        return json.loads(bytes(raw), parse_int=_bounded_int, object_pairs_hook=_unique_keys)
    except WireError:
        raise
    except (ValueError, RecursionError) as e:
        raise WireError(f"{type(e).__name__}: {str(e)[:200]}") from None


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = loads_header(raw)
    except WireError as e:
        raise WireError(f"bad message header: {e}") from None
    if (not isinstance(header, dict) or not isinstance(header.get("meta"), dict)
            or not isinstance(header.get("arrays"), list)):
        raise WireError("bad message header: expected a JSON object with a 'meta' object and "
                        "an 'arrays' list")
    return header


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_spec(spec: Any, total: int) -> tuple[str, np.dtype, tuple[int, ...], int, int]:
    """One array's ``[name, dtype, shape, offset, nbytes]`` checked against the payload."""
    if not isinstance(spec, list) or len(spec) != 5:
        raise WireError(f"bad array spec {str(spec)[:100]}: expected [name, dtype, shape, "
                        f"offset, nbytes]")
    name, dname, shape, off, nbytes = spec
    if not isinstance(name, str) or not isinstance(dname, str):
        raise WireError(f"bad array spec {str(spec)[:100]}: name and dtype must be strings")
    dt = dtype_from_name(dname)
    if (not isinstance(shape, list) or len(shape) > 64
            or not all(_is_int(d) and d >= 0 for d in shape)):
        raise WireError(f"array {name[:100]!r}: bad shape {str(shape)[:100]}: expected a list "
                        f"of at most 64 non-negative integers")
    if not (_is_int(off) and _is_int(nbytes) and 0 <= off and 0 <= nbytes
            and off + nbytes <= total):
        raise WireError(f"array {name[:100]!r}: bytes [{off!r}, +{nbytes!r}) lie outside the "
                        f"{total}-byte payload")
    count = 1
    for d in shape:
        count *= d
    if count * dt.itemsize != nbytes:
        raise WireError(f"array {name[:100]!r}: shape {shape} of {dname} needs "
                        f"{count * dt.itemsize} bytes, the header says {nbytes}")
    if nbytes and off % dt.alignment:
        raise WireError(f"array {name[:100]!r}: offset {off} is not a multiple of {dname}'s "
                        f"alignment {dt.alignment}")
    return name, dt, tuple(shape), off, nbytes


def check_specs(specs: list[Any], total: int) -> list[tuple[str, np.dtype, tuple[int, ...],
                                                            int, int]]:
    """Every array spec of a header checked against the payload (``_check_spec``), each name
    once: a message naming an array twice (a push carrying two gradients for one variable)
    is refused before any array is used.

    Raises:
        WireError: a bad spec, or a name given twice (the message names it).
    """
    checked = [_check_spec(s, total) for s in specs]
    if len({s[0] for s in checked}) != len(checked):
        seen: set[str] = set()
        for name, *_ in checked:
            if name in seen:
                raise WireError(f"array {name[:100]!r} appears twice in the message: each "
                                f"name (a variable) may appear once")
            seen.add(name)
    return checked


def message_nbytes(arrays: Mapping[str, Any]) -> int:
    """Payload bytes the arrays of a message take on the wire."""
    return sum(np.asarray(x).nbytes for x in arrays.values())


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MessageTooLargeError",
    "MAX_WIRE_INT",
    "WireError",
    "check_specs",
    "decode",
    "dtype_from_name",
    "dtype_name",
    "encode",
    "encoded_nbytes",
    "loads_header",
    "message_nbytes",
]
