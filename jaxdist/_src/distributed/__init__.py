"""A job's life: the bring-up of a synchronous cluster (``jax.distributed``'s coordination
service and client, the token handshake, the bring-up state), watching peers and steps,
preemption notices, the agreed checkpoint step, termination and restart codes (TF's
``tf.distribute.experimental.PreemptionCheckpointHandler``)."""
