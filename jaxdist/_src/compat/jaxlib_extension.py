"""jaxlib's C++ extension, reached without importing JAX (or any of jaxdist).

``distributed/service_process.py`` runs JAX's coordination service in a helper process that
starts on every multi-process job; importing JAX there would cost about a second that every
process waits for. That process loads this file by its path (``runpy.run_path``), so it imports
nothing but jaxlib's extension. ``jax_internals.jax_extension`` is the same module reached
through JAX.

Example:
    >>> from jaxdist._src.compat.jaxlib_extension import jaxlib_extension
    >>> callable(jaxlib_extension().get_distributed_runtime_service)
    True
"""

from __future__ import annotations

from typing import Any


def jaxlib_extension() -> Any:
    """``jaxlib._jax``: the C++ extension (the distributed runtime service and client).

    Public replacement: none (``jax.distributed.initialize`` starts the service only inside
    process 0; no public API starts it in a process of its own).
    """
    try:
        from jaxlib import _jax
    except ImportError:  # a jaxlib that names it otherwise: through JAX
        from jax._src.lib import _jax
    return _jax


__all__ = ["jaxlib_extension"]
