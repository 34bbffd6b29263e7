"""``InputOptions`` and ``InputContext`` (tf.distribute's input configuration objects)."""

from __future__ import annotations

import dataclasses
import enum


class AutoShardPolicy(enum.Enum):
    """How a multi-worker dataset is split across input pipelines (``tf.data``'s names).

    Example:
        >>> import jaxdist
        >>> from jaxdist.data import with_auto_shard_policy
        >>> batches = jaxdist.Dataset.range(16).batch(4)
        >>> ds = with_auto_shard_policy(batches, jaxdist.AutoShardPolicy.DATA)
        >>> strategy = jaxdist.MultiWorkerMirroredStrategy()   # TF_CONFIG unset: one worker
        >>> dist = strategy.experimental_distribute_dataset(ds)
    """

    OFF = "OFF"
    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    HINT = "HINT"


def as_policy(policy: object) -> AutoShardPolicy:
    """``policy`` as an ``AutoShardPolicy`` (a TF ``AutoShardPolicy`` or a name is read by name).

    Example:
        >>> from jaxdist._src.input.options import as_policy
        >>> as_policy("data")
        <AutoShardPolicy.DATA: 'DATA'>
    """
    if isinstance(policy, AutoShardPolicy):
        return policy
    name = getattr(policy, "name", policy)
    try:
        return AutoShardPolicy[str(name).upper()]
    except KeyError:
        raise ValueError(
            f"auto_shard_policy={policy!r}: expected one of "
            f"{[p.name for p in AutoShardPolicy]}"
        ) from None


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
        >>> import jaxdist
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
        >>> import jaxdist
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


class DistributeOptions:
    """How a dataset is split across workers (``tf.data.experimental.DistributeOptions``).

    Attributes:
        auto_shard_policy: the ``AutoShardPolicy`` used when the dataset feeds several
            processes (``MultiWorkerMirroredStrategy``): ``experimental_distribute_dataset`` and
            Keras ``fit`` / ``evaluate`` / ``predict``. Default ``AUTO``.
        num_devices: accepted for compatibility.

    Example:
        >>> import jaxdist
        >>> options = jaxdist.data.Options()
        >>> options.experimental_distribute.auto_shard_policy = jaxdist.AutoShardPolicy.OFF
    """

    _FIELDS = ("auto_shard_policy", "num_devices")

    def __init__(self):
        object.__setattr__(self, "_set", {})

    def __getattr__(self, name: str):
        if name in DistributeOptions._FIELDS:
            default = AutoShardPolicy.AUTO if name == "auto_shard_policy" else None
            return self._set.get(name, default)
        raise AttributeError(f"DistributeOptions has no option {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name not in DistributeOptions._FIELDS:
            raise AttributeError(
                f"DistributeOptions has no option {name!r}; expected one of "
                f"{list(DistributeOptions._FIELDS)}")
        if name == "auto_shard_policy":
            value = as_policy(value)
        self._set[name] = value

    def _merged(self, other: DistributeOptions) -> DistributeOptions:
        out = DistributeOptions()
        out._set.update(self._set)
        out._set.update(other._set)
        return out


class Options:
    """A dataset's options (``tf.data.Options``); set with ``Dataset.with_options``.

    Only options set explicitly are recorded, so ``ds.with_options(a).with_options(b)`` keeps
    what ``a`` sets unless ``b`` sets it too (as tf.data merges options).

    Attributes:
        experimental_distribute: ``DistributeOptions`` (``auto_shard_policy``).
        deterministic, experimental_deterministic: accepted for compatibility (jaxdist
            datasets are always deterministic).

    Example:
        >>> import jaxdist
        >>> options = jaxdist.data.Options()
        >>> options.experimental_distribute.auto_shard_policy = jaxdist.AutoShardPolicy.DATA
        >>> ds = jaxdist.Dataset.range(8).batch(4).with_options(options)
        >>> ds.options().experimental_distribute.auto_shard_policy
        <AutoShardPolicy.DATA: 'DATA'>
    """

    def __init__(self):
        self.experimental_distribute = DistributeOptions()
        self.deterministic: bool | None = None
        self.experimental_deterministic: bool | None = None

    def merge(self, other: Options) -> Options:
        """These options with the ones ``other`` sets (``other`` wins)."""
        out = Options()
        out.experimental_distribute = self.experimental_distribute._merged(
            other.experimental_distribute)
        for name in ("deterministic", "experimental_deterministic"):
            value = getattr(other, name)
            setattr(out, name, getattr(self, name) if value is None else value)
        return out


def as_options(options) -> Options:
    """``options`` as jaxdist ``Options`` (a ``tf.data.Options`` is read for its
    ``experimental_distribute.auto_shard_policy``)."""
    if isinstance(options, Options):
        return options
    dist = getattr(options, "experimental_distribute", None)
    policy = getattr(dist, "auto_shard_policy", None)
    if dist is None:
        raise TypeError(
            f"with_options expects jaxdist.data.Options (or tf.data.Options), got {options!r}")
    out = Options()
    if policy is not None:
        out.experimental_distribute.auto_shard_policy = policy
    return out
