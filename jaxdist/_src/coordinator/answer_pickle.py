"""What the coordinator unpickles from a worker: data, not code.

A worker's answer is authenticated (its MAC), but a compromised worker MACs whatever it
likes: if the chief unpickled it with plain ``pickle.loads``, the worker could run code on
the chief (a pickle may call any importable function). The chief therefore loads results
and exceptions with a restricted unpickler that builds only:

* numbers, strings, bytes, ``None`` and the builtin containers (tuple, list, dict, set,
  frozenset, bytearray, complex, slice, range, ``collections.OrderedDict``);
* numpy arrays (masked and record arrays included), scalars and dtypes (``ml_dtypes``
  dtypes such as bfloat16 included);
* builtin exception types and jaxdist's own errors.

Anything else (a user class, a function, ``os.system``) is refused with
``UntrustedPickleError``, naming what it referred to, before it is built: a result becomes
that error at ``fetch()``, an exception becomes a ``RemoteError`` carrying the worker's type
name, message and traceback. ``JAXDIST_COORDINATOR_TRUST_WORKER_PICKLES=1`` (or
``trusted=True``) unpickles anything, as TensorFlow does: then a compromised worker can run
code on the chief.

Example:
    >>> loads(pickle.dumps({"loss": np.float32(0.5)}))
    {'loss': np.float32(0.5)}
    >>> loads(pickle.dumps(os.getcwd))
    Traceback (most recent call last):
    UntrustedPickleError: ...
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import sys
from typing import Any

TRUST_ENV = "JAXDIST_COORDINATOR_TRUST_WORKER_PICKLES"

_BUILTIN_TYPES = frozenset({"complex", "set", "frozenset", "bytearray", "slice", "range",
                            "bool", "int", "float", "str", "bytes", "list", "dict", "tuple"})
_ALLOWED = frozenset({
    ("collections", "OrderedDict"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
    ("numpy.ma.core", "_mareconstruct"), ("numpy.ma.core", "MaskedArray"),
    ("numpy.ma", "MaskedArray"), ("numpy", "recarray"), ("numpy.rec", "recarray"),
    ("numpy", "record"),
})


class UntrustedPickleError(pickle.UnpicklingError):
    """A worker's pickle refers to something the coordinator does not build from a worker."""


def trusted() -> bool:
    """Whether ``JAXDIST_COORDINATOR_TRUST_WORKER_PICKLES`` asks to unpickle anything.

    Example:
        >>> trusted()
        False
    """
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


def _allowed(module: str, name: str) -> Any:
    """The global ``module.name`` when it is data (see the module docstring), else ``None``."""
    if module == "builtins":
        value = getattr(builtins, name, None)
        if name in _BUILTIN_TYPES or (isinstance(value, type)
                                      and issubclass(value, BaseException)):
            return value
        return None
    if (module, name) in _ALLOWED:
        __import__(module)
        return getattr(sys.modules[module], name)
    if module == "numpy" or module.startswith("ml_dtypes"):  # scalar and dtype types
        import numpy as np

        value = getattr(sys.modules.get(module), name, None)
        if isinstance(value, type) and (issubclass(value, np.generic)
                                        or issubclass(value, np.dtype)):
            return value
        return None
    if (module == "jaxdist" or module.startswith("jaxdist.")) and module in sys.modules:
        value = getattr(sys.modules[module], name, None)  # jaxdist's own errors
        if isinstance(value, type) and issubclass(value, BaseException):
            return value
    return None


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        value = _allowed(module, name)
        if value is None:
            raise UntrustedPickleError(
                f"{module[:100]}.{name[:100]}: the coordinator builds only numbers, strings, "
                f"numpy arrays and builtin containers from a worker's pickle, so that a "
                f"worker cannot run code on the chief; return plain data from the function, "
                f"or set {TRUST_ENV}=1 to unpickle anything (every worker is then trusted "
                f"with code execution on the chief)")
        return value


def loads(payload: bytes, trusted_: bool | None = None) -> Any:
    """Unpickles a worker's ``payload``, building data only (unless trusted).

    Args:
        payload: the pickle bytes.
        trusted_: unpickle anything; ``None``: ``JAXDIST_COORDINATOR_TRUST_WORKER_PICKLES``.

    Raises:
        UntrustedPickleError: the pickle refers to something that is not data.
    """
    if trusted() if trusted_ is None else trusted_:
        return pickle.loads(payload)
    return _DataUnpickler(io.BytesIO(payload)).load()


__all__ = ["TRUST_ENV", "UntrustedPickleError", "loads", "trusted"]
