"""``InputOptions`` and ``InputContext`` (tf.distribute's input configuration objects)."""

from __future__ import annotations

import dataclasses
import enum


class AutoShardPolicy(enum.Enum):
    """How a multi-worker dataset is split across input pipelines (``tf.data``'s names).

    Example:
        >>> from jaxdist.input.autoshard import with_auto_shard_policy
        >>> ds = with_auto_shard_policy(batches, jaxdist.AutoShardPolicy.DATA)
        >>> dist = strategy.experimental_distribute_dataset(ds)
    """

    OFF = "OFF"
    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    HINT = "HINT"


_PARTIAL = ("split", "error", "drop", "pad")


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for distributed datasets (``tf.distribute.InputOptions``).

    Args:
        experimental_fetch_to_device: copy each batch to the replicas' devices ahead of use
            (default True); False leaves batches in host memory until ``run`` needs them.
        experimental_per_replica_buffer_size: how many batches are prefetched ahead (0: each
            batch is read and copied when ``next`` asks for it).
        prefetch_thread: read and copy the batches ahead in a background thread. Default
            False: in the caller's thread, at each ``next`` (as flax's ``prefetch_to_device``):
            the copies are asynchronous and run while the steps already dispatched compute, and
            no second Python thread competes with the step for the GIL and the cores (1-4%
            slower on 2 CPU cores with 2 devices). Worth it when the source's ``next`` waits
            without holding the GIL (files, ``tf.data``) for longer than a step.
        experimental_replication_mode: accepted for compatibility (per-worker only).
        experimental_place_dataset_on_device: accepted for compatibility.
        partial_batch: what to do with a batch that does not split evenly across the replicas
            (the last partial batch of an epoch, or a group of per-replica elements that does
            not fill every replica): ``"split"`` (default, TF's behaviour) splits it as TF does,
            possibly into empty per-replica batches (``range(9).batch(2)`` on 2 replicas ends
            with ``[[8], []]``): the ``PerReplica`` values record each replica's real length,
            ``strategy.run`` passes zero-padded batches and ``compute_average_loss`` ignores the
            padding (``ReplicaContext.valid_rows``). ``"error"`` raises, ``"drop"`` drops the
            batch, ``"pad"`` pads it with zeros and yields ``(batch, mask)`` pairs where
            ``mask`` is 1.0 for real rows and 0.0 for padding.

    Example:
        >>> opts = jaxdist.InputOptions(experimental_per_replica_buffer_size=2,
        ...                             partial_batch="pad")
    """

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 1
    experimental_replication_mode: str = "PER_WORKER"
    experimental_place_dataset_on_device: bool = False
    partial_batch: str = "split"
    prefetch_thread: bool = False

    def __post_init__(self):
        if self.partial_batch not in _PARTIAL:
            raise ValueError(
                f"InputOptions.partial_batch={self.partial_batch!r}: expected one of {_PARTIAL}"
            )
        if not isinstance(self.prefetch_thread, bool):
            raise TypeError(
                f"InputOptions.prefetch_thread must be a bool, got {self.prefetch_thread!r}"
            )
        if self.experimental_per_replica_buffer_size < 0:
            raise ValueError(
                "InputOptions.experimental_per_replica_buffer_size must be >= 0, got "
                f"{self.experimental_per_replica_buffer_size}"
            )


class InputContext:
    """What ``distribute_datasets_from_function`` passes to the dataset function.

    Args:
        num_input_pipelines: how many input pipelines (processes) there are.
        input_pipeline_id: this pipeline's index in ``[0, num_input_pipelines)``.
        num_replicas_in_sync: the total number of replicas.

    Example:
        >>> ctx = jaxdist.InputContext(num_input_pipelines=2, input_pipeline_id=0,
        ...                            num_replicas_in_sync=8)
        >>> ctx.get_per_replica_batch_size(64)
        8
    """

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
    ):
        if not 0 <= input_pipeline_id < num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id={input_pipeline_id} is not in [0, {num_input_pipelines})"
            )
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; an error if it does not divide."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"The global batch size {global_batch_size} is not divisible by "
                f"num_replicas_in_sync {self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self.num_input_pipelines}, "
            f"input_pipeline_id={self.input_pipeline_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )

    def __str__(self) -> str:
        # TF's string form (distribute_lib_test checks it).
        return (f"tf.distribute.InputContext(input pipeline id {self.input_pipeline_id}, "
                f"total: {self.num_input_pipelines})")
