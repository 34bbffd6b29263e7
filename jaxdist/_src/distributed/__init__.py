"""A job's life: preemption notices, the agreed checkpoint step, restart codes (TF's
``tf.distribute.experimental.PreemptionCheckpointHandler``)."""
