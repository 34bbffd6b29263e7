"""What a worker sends the chief as a result or an exception: data, rebuilt by jaxdist.

A worker's answer is authenticated (its MAC), but a compromised worker MACs whatever it
likes. If the chief unpickled it, the worker could run code on the chief (a pickle may call
any importable function) or corrupt its memory (a pickled numpy array of dtype ``object``
over a few bytes is a pointer the chief would follow). So nothing a worker sends is
unpickled on the chief: a function's result and a worker's exception travel in this small
data format, and the chief rebuilds them itself, checking every length against the bytes
that are there before it allocates anything:

* ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``bytearray``;
* ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``, ``collections.OrderedDict``,
  ``range``, ``slice``, nested at most ``MAX_DEPTH`` deep;
* numpy arrays, masked arrays, scalars and dtypes of the dtypes that are plain bytes: bool,
  integers, floats, complex, datetimes, fixed-width strings (``U``, ``S``) and the
  ``ml_dtypes`` types (bfloat16, float8, int4, ...) -- each as dtype name, shape and raw
  bytes (``jaxdist._src.transport.wire``'s dtype names). Object, void, structured and other
  pointer-bearing dtypes have no form here;
* exceptions: module, type name, ``args`` and attributes (each data). The chief rebuilds a
  builtin exception type or one of jaxdist's own; any other type arrives as a
  ``RemoteError`` naming it.

A result that is not such data (a user class, a function) is sent as a marker naming its type
(and, for a chief that trusts every worker, pickled beside it): ``decode`` raises
``UntrustedPickleError`` naming the worker and the type.
``JAXDIST_COORDINATOR_TRUST_WORKER_PICKLES=1`` unpickles such results as TensorFlow does:
then a compromised worker can run code on the chief.

Example:
    >>> import numpy as np
    >>> from jaxdist._src.coordinator.answer_codec import decode, encode
    >>> decode(encode({"loss": np.float32(0.5), "ids": np.arange(3)}), "worker:0")
    {'loss': np.float32(0.5), 'ids': array([0, 1, 2])}
    >>> decode(b"JDA1" + b"a\\x01O\\x01" + bytes(16), "worker:0")
    Traceback (most recent call last):
    ...
    jaxdist.coordinator.UntrustedPickleError: worker:0 ...
"""

from __future__ import annotations

import builtins
import collections
import os
import pickle
import re
import struct
import sys
from typing import Any

import ml_dtypes
import numpy as np

from jaxdist._src.transport import wire

TRUST_ENV = "JAXDIST_COORDINATOR_TRUST_WORKER_PICKLES"
MAGIC = b"JDA1"
#: The deepest nesting of containers a value may have (on both sides).
MAX_DEPTH = 64
#: The most dimensions an array may have (numpy's own limit).
MAX_NDIM = 64
#: The longest integer, in bytes (two's complement), a value may hold.
MAX_INT_BYTES = 1024

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_STRING_DTYPE = re.compile(r"[<|]?[US][0-9]{1,7}")


class UntrustedPickleError(pickle.UnpicklingError):
    """A worker's answer holds something the chief does not build from a worker.

    Raised when the chief decodes a worker's result or exception: a type that is not data, a
    pointer-bearing dtype (object, void, structured), or bytes that do not decode. The
    message names the worker (``sender``) and what was refused.

    Attributes:
        sender: the worker whose answer it was (``"worker:0"``), or ``""``.
    """

    def __init__(self, message: str, sender: str = ""):
        super().__init__(message)
        self.sender = sender


class NotDataError(TypeError):
    """A value (on the worker) that has no form in this format; names the offending type."""


def trusted() -> bool:
    """Whether ``JAXDIST_COORDINATOR_TRUST_WORKER_PICKLES`` asks to unpickle anything.

    Example:
        >>> from jaxdist._src.coordinator.answer_codec import trusted
        >>> trusted()
        False
    """
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


# ------------------------------------------------------------------------------ encoding
def encode(value: Any) -> bytes:
    """``value`` in this format (on the worker).

    Raises:
        NotDataError: ``value`` holds something that is not data (the message names its
            type and where it is), or nests deeper than ``MAX_DEPTH``.

    Example:
        >>> from jaxdist._src.coordinator.answer_codec import encode
        >>> encode(None)
        b'JDA1N'
    """
    out = bytearray(MAGIC)
    _encode(value, out, 0, "the result")
    return bytes(out)


def encode_opaque(value: Any, where: str) -> bytes:
    """The marker sent instead of a result that is not data: its type's name and why."""
    out = bytearray(MAGIC)
    out += b"P"
    _encode(f"{type(value).__module__}.{type(value).__qualname__}"[:200], out, 1, "")
    _encode(where[:300], out, 1, "")
    return bytes(out)


def _plain(dtype: np.dtype) -> bool:
    """Whether ``dtype``'s values are plain bytes (no pointers, no fields)."""
    if dtype.kind == "O" or dtype.fields is not None or dtype.subdtype is not None:
        return False
    return dtype.kind != "V" or isinstance(getattr(ml_dtypes, dtype.name, None), type)


def _name(dtype: np.dtype) -> str:
    if dtype.kind in "US":
        return dtype.str.replace("=", "<").replace(">", "<")
    return wire.dtype_name(dtype)


def _little(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _array(arr: np.ndarray, out: bytearray, where: str) -> None:
    if not _plain(arr.dtype):
        raise NotDataError(f"{where} is an array of dtype {arr.dtype}, which has no raw-bytes "
                           f"form (object, void and structured dtypes hold pointers or "
                           f"fields): return numeric arrays")
    arr = _little(arr)
    name = _name(arr.dtype).encode()
    out += b"a" + _U8.pack(len(name)) + name + _U8.pack(arr.ndim)
    for d in arr.shape:
        out += _U64.pack(d)
    out += arr.tobytes()


def _encode(v: Any, out: bytearray, depth: int, where: str) -> None:
    t = type(v)
    if v is None:
        out += b"N"
    elif t is bool:
        out += b"T" if v else b"F"
    elif t is int:
        if -(1 << 63) <= v < (1 << 63):
            out += b"i" + _I64.pack(v)
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            if len(raw) > MAX_INT_BYTES:
                raise NotDataError(f"{where} holds an integer of {len(raw)} bytes: at most "
                                   f"{MAX_INT_BYTES} travel to the chief")
            out += b"I" + _U32.pack(len(raw)) + raw
    elif t is float:
        out += b"f" + _F64.pack(v)
    elif t is complex:
        out += b"c" + _C128.pack(v.real, v.imag)
    elif t is str:
        raw = v.encode("utf-8", "surrogatepass")
        out += b"s" + _U32.pack(len(raw)) + raw
    elif t is bytes or t is bytearray:
        out += (b"b" if t is bytes else b"B") + _U32.pack(len(v)) + v
    elif t is np.ndarray:
        _array(v, out, where)
    elif t is np.ma.MaskedArray:
        out += b"m"
        _array(np.ma.getdata(v), out, where)
        _array(np.ma.getmaskarray(v), out, where)
        _encode(v.fill_value[()] if isinstance(v.fill_value, np.ndarray) else v.fill_value,
                out, depth + 1, where)
    elif isinstance(v, np.generic):
        arr = np.asarray(v)
        if not _plain(arr.dtype):
            raise NotDataError(f"{where} is a numpy scalar of dtype {arr.dtype}, which has no "
                               f"raw-bytes form")
        arr = _little(arr)
        name = _name(arr.dtype).encode()
        out += b"g" + _U8.pack(len(name)) + name + arr.tobytes()
    elif t is np.dtype or isinstance(v, np.dtype):
        if not _plain(v):
            raise NotDataError(f"{where} is the dtype {v}, which has no form here")
        name = _name(v).encode()
        out += b"y" + _U8.pack(len(name)) + name
    elif depth >= MAX_DEPTH:
        raise NotDataError(f"{where} nests containers deeper than {MAX_DEPTH}")
    elif t in _SEQUENCE_TAGS:
        out += _SEQUENCE_TAGS[t] + _U32.pack(len(v))
        for i, x in enumerate(v):
            _encode(x, out, depth + 1, f"{where}[{i}]" if len(where) < 200 else where)
    elif t is dict or t is collections.OrderedDict:
        out += (b"d" if t is dict else b"o") + _U32.pack(len(v))
        for k, x in v.items():
            _encode(k, out, depth + 1, where)
            _encode(x, out, depth + 1, f"{where}[{k!r:.40}]" if len(where) < 200 else where)
    elif t is range:
        out += b"r"
        for x in (v.start, v.stop, v.step):
            _encode(x, out, depth + 1, where)
    elif t is slice:
        out += b"z"
        for x in (v.start, v.stop, v.step):
            _encode(x, out, depth + 1, where)
    elif isinstance(v, BaseException):
        out += b"x"
        _encode(t.__module__, out, depth + 1, where)
        _encode(t.__qualname__, out, depth + 1, where)
        args = OSError.__reduce__(v)[1] if isinstance(v, OSError) else v.args  # + filename
        _encode(_data_or_repr(tuple(args), depth + 1), out, depth + 1, where)
        attrs = {k: _data_or_repr(x, depth + 1) for k, x in vars(v).items()
                 if type(k) is str and k.isidentifier()
                 and (not k.startswith("__") or k == "__notes__")}
        _encode(attrs, out, depth + 1, where)
    else:
        raise NotDataError(f"{where} is a {t.__module__}.{t.__qualname__}")


_SEQUENCE_TAGS = {list: b"l", tuple: b"t", set: b"S", frozenset: b"Z"}


def _data_or_repr(v: Any, depth: int) -> Any:
    """``v`` if it encodes, else its ``repr`` (an exception's arguments and attributes)."""
    try:
        _encode(v, bytearray(), depth, "")
        return v
    except NotDataError:
        if type(v) is tuple:
            return tuple(_data_or_repr(x, depth + 1) for x in v)
        return repr(v)[:2000]


# ------------------------------------------------------------------------------ decoding
class _Refused(Exception):
    """Why the bytes do not decode (becomes ``UntrustedPickleError`` naming the sender)."""


class Opaque:
    """A result the worker could not send as data (``encode_opaque``): its type name."""

    def __init__(self, type_name: str, where: str):
        self.type_name, self.where = type_name, where


class RemoteException:
    """A worker's exception of a type the chief does not rebuild: its names and data."""

    def __init__(self, module: str, name: str, args: tuple, attrs: dict):
        self.module, self.name, self.args, self.attrs = module, name, args, attrs


def decode(payload: bytes, sender: str = "") -> Any:
    """The value a worker's ``payload`` carries, rebuilt by jaxdist (on the chief).

    An exception of a type the chief does not rebuild decodes as a ``RemoteException``; a
    result that was not data (``encode_opaque``) raises.

    Args:
        payload: the bytes, after the answer's MAC was checked.
        sender: the worker's name, for messages.

    Raises:
        UntrustedPickleError: the bytes do not decode (a bad tag or length, a dtype with no
            raw-bytes form, nesting deeper than ``MAX_DEPTH``), or the result was not data.
    """
    who = sender or "a worker"
    try:
        if bytes(payload[:4]) != MAGIC:
            raise _Refused(f"it does not start with {MAGIC!r}")
        reader = _Reader(memoryview(payload), 4)
        value = reader.value(0)
        if reader.pos != len(payload):
            raise _Refused(f"{len(payload) - reader.pos} bytes follow the value")
    except _Refused as e:
        raise UntrustedPickleError(f"{who} sent an answer the chief refuses: {e}",
                                   sender) from None
    except (ValueError, TypeError, OverflowError, MemoryError, RecursionError) as e:
        raise UntrustedPickleError(
            f"{who} sent an answer the chief refuses: {type(e).__name__}: {str(e)[:200]}",
            sender) from None
    if isinstance(value, Opaque):
        raise UntrustedPickleError(
            f"{who}: {value.where}: the coordinator builds only "
            f"numbers, strings, numpy arrays of plain dtypes and builtin containers from a "
            f"worker's answer, so that a worker cannot run code on the chief or corrupt its "
            f"memory; return plain data from the function, or set {TRUST_ENV}=1 to unpickle "
            f"anything (every worker is then trusted with code execution on the chief)",
            sender)
    return value


class _Reader:
    """Reads one value from ``buf`` at ``pos``, bounding every length by what is left."""

    def __init__(self, buf: memoryview, pos: int):
        self.buf, self.pos = buf, pos

    def take(self, n: int) -> memoryview:
        if n < 0 or n > len(self.buf) - self.pos:
            raise _Refused(f"a length of {n} bytes at offset {self.pos} passes the end "
                           f"({len(self.buf)} bytes)")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def count(self, each: int = 1) -> int:
        n = self.u32()
        if n * each > len(self.buf) - self.pos:  # every element takes a byte at least
            raise _Refused(f"a count of {n} at offset {self.pos} exceeds the bytes left")
        return n

    def dtype(self) -> np.dtype:
        name = bytes(self.take(self.u8())).decode("ascii", "strict")
        if _STRING_DTYPE.fullmatch(name):
            dt = np.dtype(name)
            if dt.itemsize == 0:
                raise _Refused(f"dtype {name!r} has no width")
            return dt
        try:
            return wire.dtype_from_name(name)
        except wire.WireError as e:
            raise _Refused(str(e)) from None

    def array(self) -> np.ndarray:
        if self.take(1) != b"a":
            raise _Refused(f"expected an array at offset {self.pos - 1}")
        dt = self.dtype()
        ndim = self.u8()
        if ndim > MAX_NDIM:
            raise _Refused(f"an array of {ndim} dimensions: at most {MAX_NDIM}")
        shape = tuple(_U64.unpack(self.take(8))[0] for _ in range(ndim))
        size = 1
        for d in shape:
            size *= d
        nbytes = size * dt.itemsize
        if nbytes > len(self.buf) - self.pos or (size == 0 and any(d > 1 << 40 for d in shape)):
            raise _Refused(f"an array of shape {shape[:8]} and dtype {dt} needs {nbytes} "
                           f"bytes; {len(self.buf) - self.pos} are left")
        return _checked(np.frombuffer(self.take(nbytes), dt, size).reshape(shape).copy())

    def value(self, depth: int) -> Any:
        tag = self.take(1).tobytes()
        if tag == b"N":
            return None
        if tag == b"T":
            return True
        if tag == b"F":
            return False
        if tag == b"i":
            return _I64.unpack(self.take(8))[0]
        if tag == b"I":
            n = self.u32()
            if n > MAX_INT_BYTES:
                raise _Refused(f"an integer of {n} bytes: at most {MAX_INT_BYTES}")
            return int.from_bytes(self.take(n), "little", signed=True)
        if tag == b"f":
            return _F64.unpack(self.take(8))[0]
        if tag == b"c":
            return complex(*_C128.unpack(self.take(16)))
        if tag == b"s":
            return bytes(self.take(self.u32())).decode("utf-8", "surrogatepass")
        if tag == b"b":
            return bytes(self.take(self.u32()))
        if tag == b"B":
            return bytearray(self.take(self.u32()))
        if tag == b"a":
            self.pos -= 1
            return self.array()
        if tag == b"m":
            data, mask = self.array(), self.array()
            if mask.dtype != np.bool_ or mask.shape != data.shape:
                raise _Refused(f"a mask of {mask.dtype}{list(mask.shape)} for data of shape "
                               f"{list(data.shape)}")
            fill = self.value(depth + 1)
            return np.ma.MaskedArray(data, mask=mask, fill_value=_fill(fill, data.dtype))
        if tag == b"g":
            dt = self.dtype()
            return _checked(np.frombuffer(self.take(dt.itemsize), dt, 1).copy())[0]
        if tag == b"y":
            return self.dtype()
        if depth >= MAX_DEPTH:
            raise _Refused(f"containers nest deeper than {MAX_DEPTH}")
        if tag in (b"l", b"t", b"S", b"Z"):
            items = [self.value(depth + 1) for _ in range(self.count())]
            return {b"l": list, b"t": tuple, b"S": set, b"Z": frozenset}[tag](items)
        if tag in (b"d", b"o"):
            n = self.count(2)
            out = {} if tag == b"d" else collections.OrderedDict()
            for _ in range(n):
                k = self.value(depth + 1)
                out[k] = self.value(depth + 1)
            return out
        if tag == b"r":
            start, stop, step = (self.value(depth + 1) for _ in range(3))
            if not all(type(x) is int for x in (start, stop, step)):
                raise _Refused("a range of non-integers")
            return range(start, stop, step)
        if tag == b"z":
            return slice(*(self.value(depth + 1) for _ in range(3)))
        if tag == b"x":
            module, name, args, attrs = (self.value(depth + 1) for _ in range(4))
            if not (type(module) is str and type(name) is str and type(args) is tuple
                    and type(attrs) is dict and all(type(k) is str for k in attrs)):
                raise _Refused("an exception without module, name, args and attributes")
            return _exception(module, name, args, attrs)
        if tag == b"P":
            type_name, where = self.value(depth + 1), self.value(depth + 1)
            return Opaque(str(type_name)[:200], str(where)[:300])
        raise _Refused(f"unknown tag {tag!r} at offset {self.pos - 1}")


def _checked(arr: np.ndarray) -> np.ndarray:
    """``arr`` with bools made 0/1 and strings' code points checked."""
    if arr.dtype == np.bool_:
        return arr.view(np.uint8) != 0
    if arr.dtype.kind == "U" and arr.size:
        codes = arr.view(np.uint32)
        if int(codes.max()) > 0x10FFFF:
            raise _Refused("a string array holds a code point above U+10FFFF")
    return arr


def _fill(value: Any, dtype: np.dtype) -> Any:
    try:
        return np.asarray(value).astype(dtype)[()] if value is not None else None
    except (TypeError, ValueError, OverflowError):
        return None


def exception_type(module: str, name: str) -> type | None:
    """The exception type ``module.name`` when the chief rebuilds it: a builtin exception or
    one of jaxdist's own errors (already imported); else ``None``.

    Example:
        >>> from jaxdist._src.coordinator.answer_codec import exception_type
        >>> exception_type("builtins", "KeyError"), exception_type("os", "system")
        (<class 'KeyError'>, None)
    """
    if not name.isidentifier():
        return None
    if module == "builtins":
        value = getattr(builtins, name, None)
    elif (module == "jaxdist" or module.startswith("jaxdist.")) and module in sys.modules:
        value = getattr(sys.modules[module], name, None)
    else:
        return None
    # Exception, not BaseException: a worker cannot make the chief raise SystemExit or
    # KeyboardInterrupt.
    return value if isinstance(value, type) and issubclass(value, Exception) else None


def _exception(module: str, name: str, args: tuple, attrs: dict) -> Any:
    cls = exception_type(module, name)
    if cls is None:
        return RemoteException(module, name, args, attrs)
    try:
        error = cls(*args)
    except Exception:  # noqa: BLE001 - a constructor with another signature
        error = cls.__new__(cls)
        error.args = args
    if type(error) is not cls:  # OSError(2, ...) makes a FileNotFoundError: keep the type
        error = cls.__new__(cls)
        error.args = args
    for key, value in attrs.items():
        if key == "args" or callable(getattr(cls, key, None)):
            continue  # never shadow a method (add_note, with_traceback) with data
        try:
            setattr(error, key, value)
        except Exception:  # noqa: BLE001 - a read-only attribute
            pass
    return error


def loads_trusted(payload: bytes) -> Any:
    """Unpickles ``payload`` with plain ``pickle`` (only when every worker is trusted)."""
    return pickle.loads(payload)


__all__ = ["MAX_DEPTH", "TRUST_ENV", "NotDataError", "Opaque", "RemoteException",
           "UntrustedPickleError", "decode", "encode", "encode_opaque", "exception_type",
           "loads_trusted", "trusted"]
