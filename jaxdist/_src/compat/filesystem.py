"""The filesystem's free space, as far as the platform tells it: what the checkpoint writers (the
Trainer's orbax checkpoints, the parameter servers' own files) check before an atomic write.

Example:
    >>> from jaxdist._src.compat.filesystem import free_bytes
    >>> free_bytes("/") is None or free_bytes("/") >= 0
    True
"""

from __future__ import annotations

import os

#: Room kept beyond a checkpoint's own bytes (directories, the ``latest`` pointer).
MARGIN_BYTES = 64 << 10


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged user may still write on the filesystem of ``path`` (the nearest
    existing parent's), or ``None`` when it cannot be asked.

    Example:
        >>> import tempfile
        >>> from jaxdist._src.compat.filesystem import free_bytes
        >>> free_bytes(tempfile.gettempdir() + "/not/yet/made") is not None
        True
    """
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


__all__ = ["MARGIN_BYTES", "free_bytes"]
