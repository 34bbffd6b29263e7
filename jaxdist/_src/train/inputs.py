"""What ``Trainer.fit`` / ``evaluate`` / ``predict`` accept as data, as Keras' ``Model.fit`` does.

* In-memory arrays: ``(x, y)``, ``(x, y, sample_weight)``, ``{"x": ..., "y": ...}``, ``x`` and a
  separate ``y=``, where ``x`` is an array or a dict of named feature arrays. The Trainer
  shuffles them with its seed, every epoch, and resumes at the exact batch.
* Streams of batches: a ``jaxdist.Dataset``, a grain ``MapDataset`` / ``IterDataset``, a
  ``tf.data.Dataset`` (anything with ``as_numpy_iterator``), a list, a generator or any other
  iterable. Each element is a batch ``(x, y)``, ``(x, y, sample_weight)`` or a dict with ``"x"``,
  ``"y"`` (and ``"sample_weight"``); elements whose label is a scalar are single examples. The
  rows are regrouped into global batches of ``global_batch_size`` (the last partial batch of an
  epoch is dropped in training, padded and masked in evaluation). A re-iterable stream
  (dataset, list) is iterated anew every epoch; a generator is read on across epochs and
  needs ``steps_per_epoch``, as in Keras.

A stream keeps its position for checkpoints: a grain iterator's own state
(``get_state``/``set_state``) is saved with the checkpoint, so a resumed ``fit`` reads exactly
the batches an uninterrupted one would; other re-iterable streams skip the batches of the
epoch already trained (exact when the stream yields the same order every time); a generator
continues wherever the new one starts.

grain is optional (``pip install 'jaxdist[grain]'``) and imported only when used.

Example:
    >>> import numpy as np
    >>> import grain  # doctest: +NEEDS_GRAIN
    >>> examples = [(np.ones(4, np.float32), np.int32(i % 2)) for i in range(256)]
    >>> ds = grain.MapDataset.source(examples).shuffle(seed=0).batch(64)
    >>> trainer.fit(ds, epochs=3)  # doctest: +SKIP
    >>> trainer.fit(({"image": x, "mask": m}, y), sample_weight=w,  # doctest: +SKIP
    ...             validation_split=0.1)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from jaxdist._src.train.data import ArrayData, DataError

GRAIN_INSTALL = "pip install 'jaxdist[grain]'"


def import_grain() -> Any:
    """``import grain``, or a clear error with the install command.

    Example:
        >>> from jaxdist._src.train.inputs import import_grain
        >>> grain = import_grain()
    """
    try:
        import grain
    except ImportError:
        raise ImportError(f"grain is not installed; install it with: {GRAIN_INSTALL}") from None
    return grain


def _is_grain(data: Any) -> bool:
    return any(c.__module__.startswith("grain") for c in type(data).__mro__)


def _is_array_like(v: Any) -> bool:
    return isinstance(v, np.ndarray) or (hasattr(v, "__array__") and hasattr(v, "shape"))


def is_features(v: Any) -> bool:
    if isinstance(v, Mapping):
        return bool(v) and all(_is_array_like(a) for a in v.values())
    return _is_array_like(v)


def apply_class_weight(y: np.ndarray, w: np.ndarray | None,
                       class_weight: Mapping[int, float] | None) -> np.ndarray | None:
    """Multiplies the sample weights by ``class_weight[label]`` (Keras' ``class_weight``).

    Raises:
        DataError: labels that are not integer class ids, or a class missing from the dict.

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.train.inputs import apply_class_weight
        >>> apply_class_weight(np.array([0, 1, 1]), None, {0: 1.0, 1: 0.5})
        array([1. , 0.5, 0.5], dtype=float32)
    """
    if not class_weight:
        return w
    y = np.asarray(y)
    if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer)
                           or np.all(np.mod(y, 1) == 0)):
        raise DataError(f"class_weight needs integer class ids of shape (n,), got labels of "
                        f"shape {y.shape} and dtype {y.dtype}")
    missing = sorted(set(np.unique(y).astype(int).tolist()) - {int(k) for k in class_weight})
    if missing:
        raise DataError(f"class_weight has no weight for class {missing[0]}; expected a weight "
                        f"for every class in the labels")
    table = {int(k): float(v) for k, v in class_weight.items()}
    cw = np.asarray([table[int(c)] for c in y], np.float32)
    return cw if w is None else np.asarray(w, np.float32) * cw


def array_data(x: Any, y: Any = None, sample_weight: Any = None, what: str = "data"
               ) -> ArrayData | None:
    """``x`` (and ``y``, ``sample_weight``) as ``ArrayData`` if they are in-memory arrays, else
    ``None`` (a stream).

    Raises:
        DataError: arrays without labels, or mismatched rows.

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.train.inputs import array_data
        >>> x, y = np.ones((100, 4), np.float32), np.zeros((100,), np.int32)
        >>> array_data(x, y).x.shape
        (100, 4)
    """
    if isinstance(x, ArrayData):
        if y is not None or sample_weight is not None:
            return ArrayData(x.x, x.y if y is None else y,
                             x.w if sample_weight is None else sample_weight)
        return x
    if isinstance(x, Mapping) and "x" in x and is_features(x["x"]):
        if "y" not in x:
            raise DataError(f"{what}: the dict has 'x' but no 'y'; expected labels")
        return ArrayData(x["x"], x["y"], x.get("sample_weight", sample_weight))
    if (isinstance(x, (tuple, list)) and len(x) in (2, 3) and is_features(x[0])
            and _is_array_like(x[1])):
        if y is not None:
            raise DataError(f"{what}: y was given twice (in the tuple and as y=)")
        return ArrayData(x[0], x[1], x[2] if len(x) == 3 else sample_weight)
    if is_features(x):
        if y is None:
            raise DataError(f"{what}: got features without labels; pass y=, or (x, y)")
        return ArrayData(x, y, sample_weight)
    return None


def split_last(data: ArrayData, validation_split: float) -> tuple[ArrayData, ArrayData]:
    """Keras' ``validation_split``: the last fraction of the rows, before any shuffling.

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.train.inputs import array_data, split_last
        >>> data = array_data(np.ones((100, 4), np.float32), np.zeros((100,), np.int32))
        >>> train, val = split_last(data, 0.2)
        >>> len(train), len(val)
        (80, 20)
    """
    if not 0.0 < validation_split < 1.0:
        raise DataError(f"validation_split={validation_split} is not valid; expected a "
                        f"fraction in (0, 1)")
    n = len(data)
    n_val = int(n * validation_split)
    if n_val == 0 or n_val == n:
        raise DataError(f"validation_split={validation_split} of {n} examples leaves "
                        f"{n - n_val} for training and {n_val} for validation; expected both > 0")
    return data.take(np.arange(n - n_val)), data.take(np.arange(n - n_val, n))


def _element(elem: Any, what: str) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` of a stream element (``y``/``w`` ``None`` when absent)."""
    if isinstance(elem, Mapping) and "x" in elem:
        return elem["x"], elem.get("y"), elem.get("sample_weight")
    if isinstance(elem, (tuple, list)):
        if len(elem) == 1:
            return elem[0], None, None
        if len(elem) in (2, 3):
            return elem[0], elem[1], elem[2] if len(elem) == 3 else None
        raise DataError(f"{what}: a stream element is a tuple of {len(elem)}; expected (x,), "
                        f"(x, y) or (x, y, sample_weight)")
    if is_features(elem):
        return elem, None, None
    raise DataError(f"{what}: a stream element is a {type(elem).__name__}; expected a batch "
                    f"(x, y), (x, y, sample_weight) or a dict with 'x' and 'y'")


def _tree(x: Any, fn) -> Any:
    return {k: fn(v) for k, v in x.items()} if isinstance(x, Mapping) else fn(x)


def row_count(x: Any) -> int:
    first = next(iter(x.values())) if isinstance(x, Mapping) else x
    return int(np.shape(first)[0])


class StreamSource:
    """A stream of batches (see the module docstring).

    Args:
        data: the dataset, iterable or generator.
        what: its name in error messages (``"train_data"`` ...).
        class_weight: Keras' ``class_weight`` (multiplies the sample weights).

    Example:
        >>> import jaxdist
        >>> import numpy as np
        >>> from jaxdist._src.train.inputs import StreamSource
        >>> x, y = np.ones((64, 4), np.float32), np.zeros((64,), np.int32)
        >>> src = StreamSource(jaxdist.Dataset.from_tensor_slices((x, y)).batch(32), "data")
        >>> xb, yb, wb = next(src.batches(32, epoch=0))
    """

    def __init__(self, data: Any, what: str, class_weight: Mapping[int, float] | None = None):
        self.data, self.what, self.class_weight = data, what, class_weight
        self.is_grain = _is_grain(data)
        if self.is_grain:
            import_grain()
        self.kind = ("grain" if self.is_grain
                     else "tf.data" if hasattr(data, "as_numpy_iterator") else "iterable")
        if self.kind == "iterable" and not hasattr(data, "__iter__"):
            raise DataError(f"{what}: got {type(data).__name__}; expected arrays (x, y), a "
                            f"dict with 'x' and 'y', a jaxdist.Dataset, a grain dataset, a "
                            f"tf.data.Dataset or an iterable of batches")
        # A generator (its own iterator) is read on across epochs; others start anew.
        self.reiterable = self.kind != "iterable" or iter(data) is not data
        self._shared: Iterator[Any] | None = None if self.reiterable else iter(data)
        self._peeked: list[Any] = []
        self._iterator: Any = None

    @property
    def name(self) -> str:
        """The stream's type name, for messages."""
        return f"{type(self.data).__module__.split('.')[0]}.{type(self.data).__name__}"

    def num_elements(self) -> int | None:
        """The stream's length in elements, when known."""
        if self.kind == "tf.data" and hasattr(self.data, "cardinality"):
            try:
                n = int(self.data.cardinality())
            except (TypeError, ValueError):
                return None
            return n if n >= 0 else None
        try:
            return len(self.data)
        except TypeError:
            return None

    def _new_iterator(self) -> Iterator[Any]:
        if not self.reiterable:
            return self._shared
        if self.kind == "tf.data":
            return iter(self.data.as_numpy_iterator())
        return iter(self.data)

    def peek(self) -> tuple[Any, Any, Any]:
        """The first element's ``(x, y, w)`` (a generator keeps it for the first epoch)."""
        if self.reiterable:
            it = self._new_iterator()
            elem = next(it, None)
        else:
            if not self._peeked:
                elem = next(self._shared, None)
                if elem is not None:
                    self._peeked.append(elem)
            elem = self._peeked[0] if self._peeked else None
        if elem is None:
            raise DataError(f"{self.what}: the {self.name} is empty")
        return self.normalize(elem)

    def rows_per_element(self) -> int:
        """Rows of the first element (1 for single examples)."""
        x, y, _ = self.peek()
        return row_count(x) if y is None else int(np.shape(y)[0])

    def normalize(self, elem: Any) -> tuple[Any, Any, Any]:
        x, y, w = _element(elem, self.what)
        x = _tree(x, np.asarray)
        if y is not None:
            y = np.asarray(y)
            if y.ndim == 0:  # a single example: make it a batch of one
                x, y = _tree(x, lambda a: a[None]), y[None]
                w = None if w is None else np.asarray(w, np.float32).reshape(1)
        if y is not None:
            w = apply_class_weight(y, None if w is None else np.asarray(w, np.float32),
                                   self.class_weight)
        return x, y, w

    def batches(self, size: int, epoch: int, skip: int = 0, state: Any = None,
                pad_last: bool = False) -> Iterator[tuple[Any, Any, Any]]:
        """Global batches of ``size`` rows for ``epoch``.

        Args:
            size: rows per batch.
            epoch: the epoch (for the position record).
            skip: batches of this epoch already trained (skipped unless ``state`` restores).
            state: a grain iterator state from ``position()`` to continue from.
            pad_last: yield the last partial batch too (evaluation), else drop it.
        """
        it = self._new_iterator()
        if self._peeked:
            it, self._peeked = itertools.chain(self._peeked, it), []
        restored = False
        if state is not None and self.is_grain and hasattr(it, "set_state"):
            it.set_state(state)
            restored = True
        self._iterator, self._epoch, self._consumed = it, epoch, 0
        if restored:
            self._consumed = skip
        buf: list[tuple[Any, Any, Any]] = []
        have = 0
        to_skip = 0 if restored or not self.reiterable else skip
        for elem in it:
            part = self.normalize(elem)
            buf.append(part)
            have += row_count(part[0])
            while have >= size:
                batch, buf, have = take(buf, size)
                if to_skip:
                    to_skip -= 1
                    continue
                self._consumed += 1
                self._exact = have == 0
                yield batch
        if pad_last and have:
            batch, buf, have = take(buf, have)
            self._consumed += 1
            yield batch

    def position(self) -> dict[str, Any]:
        """Where the stream is now: ``{"epoch", "batches"[, "grain_state"]}``; the grain state
        is recorded when the last batch ended on an element boundary."""
        pos: dict[str, Any] = {"epoch": int(self._epoch), "batches": int(self._consumed)}
        it = self._iterator
        if self.is_grain and getattr(self, "_exact", False) and hasattr(it, "get_state"):
            pos["grain_state"] = it.get_state()
        return pos


def take(buf: list[tuple[Any, Any, Any]], size: int
          ) -> tuple[tuple[Any, Any, Any], list[tuple[Any, Any, Any]], int]:
    """The first ``size`` rows of the buffered parts; the rest stays buffered."""
    xs = [p[0] for p in buf]
    if isinstance(xs[0], Mapping):
        x = {k: np.concatenate([p[k] for p in xs]) for k in xs[0]}
    else:
        x = np.concatenate(xs)
    has_y = buf[0][1] is not None
    y = np.concatenate([p[1] for p in buf]) if has_y else None
    if any(p[2] is not None for p in buf):
        w = np.concatenate([p[2] if p[2] is not None else np.ones((row_count(p[0]),), np.float32)
                            for p in buf])
    else:
        w = None
    total = row_count(x)
    head = (_tree(x, lambda a: a[:size]), None if y is None else y[:size],
            None if w is None else w[:size])
    rest: list[tuple[Any, Any, Any]] = []
    if total > size:
        rest = [(_tree(x, lambda a: a[size:]), None if y is None else y[size:],
                 None if w is None else w[size:])]
    return head, rest, total - size


def source(data: Any, y: Any = None, sample_weight: Any = None,
           class_weight: Mapping[int, float] | None = None, what: str = "data"
           ) -> ArrayData | StreamSource:
    """``ArrayData`` for in-memory arrays (class weights applied), else a ``StreamSource``.

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.train.inputs import source
        >>> x, y = np.ones((100, 4), np.float32), np.zeros((100,), np.int32)
        >>> source((x, y), what="train_data")
        ArrayData(...)
    """
    arrays = array_data(data, y, sample_weight, what)
    if arrays is not None:
        if class_weight:
            arrays = ArrayData(arrays.x, arrays.y,
                               apply_class_weight(arrays.y, arrays.w, class_weight))
        return arrays
    if y is not None or sample_weight is not None:
        raise DataError(f"{what}: y= and sample_weight= go with array x; a "
                        f"{type(data).__name__} yields them in its elements")
    return StreamSource(data, what, class_weight)


__all__ = ["GRAIN_INSTALL", "StreamSource", "apply_class_weight", "array_data",
           "import_grain", "source", "split_last"]
