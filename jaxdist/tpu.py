"""TF's ``tf.tpu.experimental`` names (also reachable as ``jaxdist.tpu.experimental``); compile-only
TPU topologies.

``Topology`` and ``DeviceAssignment`` describe a TPU slice; a named topology (``"v5e:2x2"``)
gives libtpu's compile-only devices, so ``TPUStrategy(topology=...)`` compiles steps for a TPU
on a machine without one and reports their per-chip memory and FLOPs (``CompileReport``).

Example:
    >>> import jaxdist
    >>> topology = jaxdist.tpu.experimental.Topology("v5e:2x2")  # doctest: +NEEDS_LIBTPU
    >>> strategy = jaxdist.TPUStrategy(topology=topology)
"""

import sys

from jaxdist._src.publish import publish as _publish
from jaxdist._src.strategies.compile_report import CompileOnlyError, CompileReport
from jaxdist._src.strategies.tpu import (
    DeviceAssignment,
    Topology,
    initialize_tpu_system,
    libtpu_available,
    shutdown_tpu_system,
)

#: ``jaxdist.tpu.experimental.X`` is ``jaxdist.tpu.X`` (TF's ``tf.tpu.experimental`` names).
experimental = sys.modules[__name__]
sys.modules.setdefault(__name__ + ".experimental", experimental)

__all__ = [
    "CompileOnlyError",
    "CompileReport",
    "DeviceAssignment",
    "Topology",
    "initialize_tpu_system",
    "libtpu_available",
    "shutdown_tpu_system",
]

_publish(__name__, CompileOnlyError)
