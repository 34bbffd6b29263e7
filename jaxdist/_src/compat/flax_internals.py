"""Every use of flax's private names, each with the public API that would replace it.

``tests/internal/test_jax_internals.py`` checks each adapter still finds what it needs, so a flax
that moves one fails there, by name. flax is optional: nothing here imports it before a caller
has (an NNX object, or an ``nnx.jit`` function, exists only once ``flax.nnx`` is imported).

Example:
    >>> from flax import nnx
    >>> from jaxdist._src.compat import flax_internals
    >>> flax_internals.is_nnx_jit(nnx.jit(lambda x: x)), flax_internals.is_nnx_jit(abs)
    (True, False)
"""

from __future__ import annotations

import sys
from typing import Any


def is_nnx_jit(fn: Any) -> bool:
    """Whether ``fn`` is a function ``nnx.jit`` made (flax's ``JitWrapped``); ``False`` while
    ``flax.nnx`` is not imported.

    Public replacement: none yet (``flax.nnx`` exports ``jit`` but not the type of what it
    returns, ``flax.nnx.transforms.compilation.JitWrapped``).
    """
    if "flax.nnx" not in sys.modules:
        return False
    from flax.nnx.transforms.compilation import JitWrapped

    return isinstance(fn, JitWrapped)


__all__ = ["is_nnx_jit"]
