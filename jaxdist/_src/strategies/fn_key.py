"""The compile cache's identity of a replica function: ``function_key(fn)``.

TF custom loops often define ``step_fn`` inside ``train_step``, so every ``strategy.run`` gets
a new function object. Two function objects behave the same when traced if they run the same
code over the same globals and reach the same values through their closure cells and
defaults: the second is then as good as calling the first again, and may share its compiled
step. ``function_key`` says when that holds, conservatively:

* a plain Python function (``def`` / ``lambda``; no attributes of its own) is keyed by its code
  object, its globals dict (by identity), and, for each closure cell, default and keyword
  default, the value's identity; immutable scalars (``None``, bools, ints, floats, complex,
  strings, bytes, numpy scalars, and tuples of these) by type and exact value (a float by its
  bits: ``0.0`` and ``-0.0`` differ); a nested plain function by its own key (to a depth of 4);
* anything else (an object with ``__call__``, a ``functools.partial``, a function with
  attributes, such as a ``jax.jit`` or ``nnx.jit`` wrapper) is keyed by itself, as before.

Identity keys hold the values (``_Same``), so an identity can never be reused by a new object
while the key lives. An array captured by the closure is therefore one compiled step per array
object, as jit bakes a captured array into the program: pass arrays that change as arguments.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

_MAX_DEPTH = 4
_EMPTY_CELL = object()


class _Same:
    """Equal to another ``_Same`` of the same object (``is``); holds the object."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return type(other) is _Same and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"_Same({type(self.obj).__name__} at {id(self.obj):#x})"


class FunctionKey:
    """Hashable; equal for two functions that trace the same (see the module docstring)."""

    __slots__ = ("fn", "parts", "_hash")

    def __init__(self, fn: types.FunctionType, parts: tuple):
        self.fn = fn  # the function this key was made from (for messages)
        self.parts = parts
        self._hash = hash(parts)

    def __eq__(self, other: object) -> bool:
        return type(other) is FunctionKey and (
            other is self or (other._hash == self._hash and other.parts == self.parts))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"FunctionKey({getattr(self.fn, '__qualname__', self.fn)!r})"


def _value_key(x: Any, depth: int) -> Any:
    t = type(x)
    if x is None or t is bool or t is int or t is str or t is bytes:
        return (t, x)
    if t is float:
        return (t, x.hex())
    if t is complex:
        return (t, x.real.hex(), x.imag.hex())
    if isinstance(x, np.generic) and x.dtype.kind in "biufc":
        return (t, x.dtype.str, x.tobytes())
    if t is tuple:
        return (t, tuple(_value_key(v, depth) for v in x))
    if t is types.FunctionType and depth < _MAX_DEPTH:
        return function_key(x, depth + 1)
    return _Same(x)


def function_key(fn: Any, _depth: int = 0) -> Any:
    """The compile cache's key of ``fn``: a ``FunctionKey`` for a plain function, else ``fn``.

    Example:
        >>> from jaxdist._src.strategies.fn_key import function_key
        >>> def make(scale):
        ...     def step(x):
        ...         return x * scale
        ...     return step
        >>> function_key(make(2.0)) == function_key(make(2.0))   # same code, same value
        True
        >>> function_key(make(2.0)) == function_key(make(3.0))
        False
    """
    if type(fn) is not types.FunctionType or fn.__dict__:
        return fn
    cells = fn.__closure__ or ()
    closure = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not yet assigned
            closure.append(_Same(_EMPTY_CELL))
            continue
        closure.append(_value_key(value, _depth))
    defaults = tuple(_value_key(v, _depth) for v in (fn.__defaults__ or ()))
    kwdefaults = tuple(sorted(
        (k, _value_key(v, _depth)) for k, v in (fn.__kwdefaults__ or {}).items()))
    try:
        return FunctionKey(fn, (fn.__code__, _Same(fn.__globals__), tuple(closure), defaults,
                                kwdefaults))
    except TypeError:  # pragma: no cover - an unhashable part (not expected)
        return fn


__all__ = ["FunctionKey", "function_key"]
