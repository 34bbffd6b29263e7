"""The structure ``Dataset.from_generator`` checks a generator's elements against:
``TensorSpec`` (``tf.TensorSpec``) and ``output_types`` / ``output_shapes`` read as specs.

Example:
    >>> import numpy as np
    >>> from jaxdist._src.input.signature import TensorSpec, conform
    >>> spec = (TensorSpec((None,), np.float32), TensorSpec((), np.int32))
    >>> x, y = conform(([1, 2], 3), spec, spec)
    >>> x.dtype, y.dtype
    (dtype('float32'), dtype('int32'))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class TensorSpec:
    """The shape and dtype of one array of an element (``tf.TensorSpec``), for
    ``Dataset.from_generator(output_signature=...)``.

    Args:
        shape: the shape; ``None`` for a dimension of any size (or ``None`` for any shape).
        dtype: a numpy dtype (or anything ``np.dtype`` reads, or a ``tf.DType``).
        name: accepted for compatibility.

    Example:
        >>> import jaxdist
        >>> import numpy as np
        >>> spec = jaxdist.data.TensorSpec(shape=(None, 3), dtype=np.float32)
    """

    def __init__(self, shape: Sequence[int | None] | None, dtype: Any = np.float32,
                 name: str | None = None):
        self.shape = None if shape is None else tuple(shape)
        self.dtype = np_dtype(dtype)
        self.name = name

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape}, dtype={self.dtype.name})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TensorSpec) and self.shape == other.shape
                and self.dtype == other.dtype)

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))


def np_dtype(dtype: Any) -> np.dtype:
    dtype = getattr(dtype, "as_numpy_dtype", dtype)  # tf.DType
    return np.dtype(dtype)


def shape_of(shape: Any) -> tuple[int | None, ...] | None:
    """A shape (tuple, list, ``tf.TensorShape``, ``None``) as a tuple with ``None`` dims."""
    if shape is None:
        return None
    if hasattr(shape, "rank") and hasattr(shape, "as_list"):  # tf.TensorShape
        if shape.rank is None:
            return None
        return tuple(shape.as_list())
    return tuple(None if d is None else int(d) for d in shape)


def _is_spec(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.ndarray)


def _is_dtype_leaf(x: Any) -> bool:
    if x is None or isinstance(x, (tuple, list, dict)):
        return False
    try:
        np_dtype(x)
        return True
    except TypeError:
        return False


def signature_from_types(types: Any, shapes: Any) -> Any:
    """``output_types`` (+ ``output_shapes``) as a structure of ``TensorSpec``."""
    if _is_dtype_leaf(types):
        shape = shape_of(shapes) if shapes is not None else None
        return TensorSpec(shape, types)
    if isinstance(types, dict):
        return {k: signature_from_types(v, None if shapes is None else shapes[k])
                for k, v in types.items()}
    if isinstance(types, (tuple, list)):
        if shapes is not None and len(shapes) != len(types):
            raise ValueError(f"from_generator: output_shapes {shapes} does not match "
                             f"output_types {types}")
        return tuple(signature_from_types(t, None if shapes is None else shapes[i])
                     for i, t in enumerate(types))
    raise TypeError(f"from_generator: output_types must be dtypes (or a tuple / dict of "
                    f"them), got {types!r}")


def conform(element: Any, spec: Any, signature: Any) -> Any:
    """``element`` converted to ``spec`` (a TensorSpec-like or a structure of them)."""
    if _is_spec(spec):
        dtype = np_dtype(spec.dtype)
        try:
            value = np.asarray(element, dtype=dtype)
        except (TypeError, ValueError):
            raise TypeError(
                f"`generator` yielded an element that could not be converted to the expected "
                f"type. The expected type was {dtype.name}, but the yielded element was "
                f"{element!r}.") from None
        want = shape_of(spec.shape)
        if want is not None and (len(want) != value.ndim or any(
                w is not None and w != g for w, g in zip(want, value.shape))):
            raise ValueError(
                f"`generator` yielded an element of shape {value.shape} where an element of "
                f"shape {want} was expected.")
        return value[()] if value.ndim == 0 else value
    if isinstance(spec, dict):
        if not isinstance(element, dict) or set(element) != set(spec):
            raise TypeError(_structure_error(element, signature))
        return {k: conform(element[k], s, signature) for k, s in spec.items()}
    if isinstance(spec, (tuple, list)):
        if not isinstance(element, (tuple, list)) or len(element) != len(spec):
            raise TypeError(_structure_error(element, signature))
        return tuple(conform(e, s, signature) for e, s in zip(element, spec))
    raise TypeError(f"from_generator: output_signature must be TensorSpecs (or a tuple / dict "
                    f"of them), got {spec!r}")


def _structure_error(element: Any, signature: Any) -> str:
    return (f"`generator` yielded an element that did not match the expected structure. The "
            f"expected structure was {signature}, but the yielded element was {element!r}.")


__all__ = ["TensorSpec", "conform", "np_dtype", "shape_of", "signature_from_types"]
