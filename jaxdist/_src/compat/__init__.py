"""Adapters over third-party internals: the one place each private API is used.

``jax_internals`` holds every use of ``jax._src``; nothing else in jaxdist imports it. This package
is the bottom layer: it imports nothing of jaxdist, and every package may import it.
"""
