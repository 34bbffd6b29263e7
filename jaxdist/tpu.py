"""TF's ``tf.tpu.experimental`` entry points."""

from jaxdist.strategies.tpu import initialize_tpu_system, shutdown_tpu_system

__all__ = ["initialize_tpu_system", "shutdown_tpu_system"]
