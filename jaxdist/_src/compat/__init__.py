"""Adapters over third-party internals: the one place each private API is used.

``jax_internals`` holds every use of ``jax._src`` (and a jit's private cache count),
``jaxlib_extension`` jaxlib's C++ extension reached without JAX, ``flax_internals`` flax's private
names, ``keras_internals`` Keras's; nothing else in jaxdist reaches them. ``filesystem`` asks the
platform for a filesystem's free space (checkpoint writers). This package
is the bottom layer: it imports nothing of jaxdist, and every package may import it.
"""
