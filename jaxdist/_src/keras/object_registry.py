"""What jaxdist remembers about Keras's objects, kept beside them instead of written onto them.

Keras variables are unhashable (``==`` compares values) and a user's model class may define
``__eq__``, so an ``ObjectRegistry`` is keyed by identity: each entry holds a weak reference to
its object and is dropped when the object is collected (a new object at the same ``id`` never
sees an old entry).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any


class ObjectRegistry:
    """A value per object, by identity, for as long as the object lives.

    Example:
        >>> from jaxdist._src.keras.object_registry import ObjectRegistry
        >>> class Variable:
        ...     __hash__ = None  # unhashable, as Keras variables are
        >>> placed = ObjectRegistry()
        >>> v = Variable()
        >>> placed.set(v, "on the parameter device")
        >>> placed.get(v)
        'on the parameter device'
        >>> del v
        >>> len(placed)
        0
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}
        self._lock = threading.Lock()

    def set(self, obj: Any, value: Any) -> None:
        """Remembers ``value`` for ``obj`` (replacing an earlier one)."""
        key = id(obj)

        def drop(ref: weakref.ref) -> None:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry[0] is ref:
                    del self._entries[key]

        with self._lock:
            self._entries[key] = (weakref.ref(obj, drop), value)

    def get(self, obj: Any, default: Any = None) -> Any:
        """The value remembered for ``obj``, else ``default``."""
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return default
        return entry[1]

    def __len__(self) -> int:
        return len(self._entries)
