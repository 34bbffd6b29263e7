"""Strategy-specific parts of the ``Trainer``: where the state lives and what one step does.

The ``Trainer`` always delegates to one ``TrainerHook``, chosen once in ``Trainer.__init__``
(``jaxdist._src.train.strategy_registry.hook_for``): it creates the state, runs a training step,
resumes, checkpoints and finishes, while the ``Trainer`` keeps its own data order, metrics,
logging, NaN checks and evaluation. ``SyncHook`` is the hook of the synchronous strategies
(state placed by the strategy, the optax update applied in every replica); the parameter-server
hooks are in ``jaxdist._src.train.parameter_server``.

Example:
    >>> from jaxdist._src.train.strategy_registry import hook_for
    >>> hook_for(jaxdist.MirroredStrategy())
    SyncHook()
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jaxdist._src.train import data as data_lib

#: The key of the packed statistics of a synchronous step, and the fields packed in it (the
#: step's float32 ``loss``, ``correct`` and ``weight``, one row per step).
PACKED = "packed"
PACKED_FIELDS = ("loss", "correct", "weight")


class LazyStats(Mapping):
    """A read-only mapping of step statistics computed by ``_fetch()`` when first read.

    Subclasses implement ``_fetch`` (it caches its answer); reading a key, iterating or
    ``len`` fetch.
    """

    __slots__ = ()

    def _fetch(self) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self._fetch()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fetch())

    def __len__(self) -> int:
        return len(self._fetch())


class PackedStepStats(LazyStats):
    """The statistics of one dispatch of a synchronous step, fetched once, when first read:
    ``stats["loss"]``, ``"correct"``, ``"weight"`` (one value per step) and ``"metrics"`` when
    there are metrics. The step returns ``loss``, ``correct`` and ``weight`` stacked in one
    device array (``PACKED``), so reading them is one device-to-host transfer, not three.

    Example:
        >>> stats = PackedStepStats({"packed": packed})  # a step's outputs  # doctest: +SKIP
        >>> stats["loss"]          # waits for the step  # doctest: +SKIP
    """

    __slots__ = ("_device", "_host")

    def __init__(self, device: Mapping[str, Any]):
        self._device = device
        self._host: dict[str, Any] | None = None

    def _fetch(self) -> dict[str, Any]:
        if self._host is None:
            try:
                host = dict(jax.device_get(dict(self._device)))
            except Exception as e:
                # the step failed: with several processes, name a lost peer as run() does
                from jaxdist._src.cluster.bringup import raise_if_peer_lost

                raise_if_peer_lost(e, "a step")
                raise
            packed = host.pop(PACKED, None)
            if packed is not None:
                packed = np.asarray(packed)
                for i, name in enumerate(PACKED_FIELDS):
                    host[name] = packed[..., i]
            self._host = host
            self._device = {}
        return self._host

    def __repr__(self) -> str:
        return f"PackedStepStats(fetched={self._host is not None})"


class TrainerHook:
    """What a strategy with its own state handling does inside ``Trainer``.

    Every method gets the ``Trainer`` (``trainer``) and may read and set its attributes
    (``params``, ``rest``, ``opt_state``, ``step``, ``epoch``, ``step_in_epoch``,
    ``last_checkpoint``). The defaults do nothing special; a subclass overrides what differs.

    Example:
        >>> class MyHook(TrainerHook):
        ...     def train_step(self, trainer, x, y, num_steps):
        ...         ...
    """

    #: Whether this task evaluates and logs validation metrics.
    should_evaluate: bool = True
    #: Whether the hook feeds its steps itself (e.g. per-worker datasets on remote workers):
    #: the ``Trainer`` then builds no batches and passes ``x = y = None`` to ``train_step``.
    owns_input: bool = False
    #: Whether the state (``params``, ``opt_state``) lives in the ``Trainer`` itself, so the
    #: learning rate and the weights can be set there.
    local_state: bool = False
    #: Whether ``fit`` may take a stream of batches (else in-memory arrays only).
    accepts_streams: bool = False
    #: Whether ``train_step`` takes input blocks: ``x``, ``y``, ``w`` hold several chunks
    #: (``Trainer._input_block``) and ``chunk=j`` names the one to run.
    input_blocks: bool = False

    def begin_fit(self, trainer: Any, train: Any) -> None:
        """Called at the start of ``fit`` with the training data (an ``ArrayData``)."""

    def stream_steps_per_epoch(self, trainer: Any, train: Any,
                               steps_per_epoch: int | None) -> int | None:
        """The steps of an epoch of the stream ``train`` when the hook sets them (e.g. every
        worker's whole batches of a grain ``MapDataset`` under a coordinator), else ``None``."""
        return None

    def init_state(self, trainer: Any, params: Any, rest: Any) -> tuple[Any, Any, Any]:
        """Creates the training state; returns ``(params, rest, opt_state)`` for the trainer."""
        raise NotImplementedError

    def epoch_order(self, trainer: Any, num_examples: int, epoch: int) -> np.ndarray:
        """The example indices this task trains on in ``epoch``, in order."""
        return data_lib.epoch_order(num_examples, epoch, trainer.seed, trainer.shuffle)

    def train_step(self, trainer: Any, x: Any, y: Any, num_steps: int,
                   w: Any = None) -> dict[str, Any]:
        """Runs ``num_steps`` steps on the distributed chunk ``(x, y)`` with sample weights
        ``w`` (ordered as the trainer's ``_local_rows``); returns ``{"loss", "correct",
        "weight"}`` with one entry per step (``weight``: the sum of the sample weights)."""
        raise NotImplementedError

    def current_params(self, trainer: Any) -> Any:
        """The parameters to evaluate or predict with now."""
        return trainer.params

    def resume(self, trainer: Any, steps_per_epoch: int) -> None:
        """Restores the state and position (``step``, ``epoch``, ``step_in_epoch``) from
        ``trainer.checkpoint_dir`` if there is a checkpoint."""

    def save(self, trainer: Any) -> None:
        """Checkpoints the state at ``trainer.step`` (called on every task; the hook decides)."""

    def end_training(self, trainer: Any) -> None:
        """Called when this task has run its last step, before the final checkpoint and
        evaluation."""

    def state_version(self, trainer: Any) -> Any:
        """A value that changes when the parameters change outside this task's own steps
        (``None``: they never do). The ``Trainer`` validates again at the end of ``fit`` when
        it differs from the last validation's: other workers' last pushes count."""
        return None

    def end_fit(self, trainer: Any) -> None:
        """Called at the very end of ``fit``, after the final checkpoint and evaluation."""

    def get_learning_rate(self, trainer: Any) -> float:
        """The learning rate the strategy's optimizer applies now (``trainer.learning_rate``)."""
        raise ValueError(f"the learning rate cannot be read under "
                         f"{type(trainer.strategy).__name__}")

    def set_learning_rate(self, trainer: Any, value: float) -> None:
        """Changes the learning rate from the next update on."""
        raise ValueError(f"the learning rate cannot be changed under "
                         f"{type(trainer.strategy).__name__}")

    def current_learning_rate(self, trainer: Any) -> float | None:
        """The learning rate for the logs (``None``: not known)."""
        return None

    def set_weights(self, trainer: Any, params: Any) -> None:
        """Replaces the model's parameters (``trainer.set_weights``)."""
        raise ValueError(f"set_weights is not supported under "
                         f"{type(trainer.strategy).__name__}")


class SyncHook(TrainerHook):
    """The hook of the synchronous strategies: the state lives in the ``Trainer``, placed by
    the strategy, and one ``strategy.run`` of the trainer's replica step updates it.

    Args:
        strategy: the strategy (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``, ...).

    Example:
        >>> hook = SyncHook(jaxdist.MirroredStrategy())
        >>> hook.local_state
        True
    """

    local_state = True
    accepts_streams = True
    input_blocks = True

    def __init__(self, strategy: Any):
        self.strategy = strategy
        # Device copies of the step numbers passed to the compiled step, made once per input
        # block (the block's first step) and once per chunk index: no per-dispatch transfer.
        self._block_step: tuple[int, Any] | None = None
        self._chunk_ids: dict[int, Any] = {}

    def __repr__(self) -> str:
        return "SyncHook()"

    def _on_device(self, value: int) -> Any:
        sharding = self.strategy.extended.replicated_sharding
        if not sharding.is_fully_addressable:
            # Across processes a placement talks to the peers: leave it to ``strategy.run``,
            # whose errors name a lost peer (``PeerLostError``).
            return np.int32(value)
        return jax.device_put(np.int32(value), sharding)

    def init_state(self, trainer: Any, params: Any, rest: Any) -> tuple[Any, Any, Any]:
        with self.strategy.scope():
            params = self.strategy.place(params)
            rest = self.strategy.place(rest)
            opt_state = self.strategy.place(trainer.optimizer.init(params))
        return params, rest, opt_state

    def train_step(self, trainer: Any, x: Any, y: Any, num_steps: int,
                   w: Any = None, chunk: int = 0) -> dict[str, Any]:
        """Runs chunk ``chunk`` of the input block ``(x, y, w)`` (``num_steps`` steps; the
        block's chunks run in order, so its first step is ``trainer.step - chunk *
        num_steps``)."""
        first = trainer.step - chunk * num_steps
        if self._block_step is None or self._block_step[0] != first:
            self._block_step = (first, self._on_device(first))
        chunk_id = self._chunk_ids.get(chunk)
        if chunk_id is None:
            chunk_id = self._chunk_ids[chunk] = self._on_device(chunk)
        trainer.params, trainer.rest, trainer.opt_state, stats = self.strategy.run(
            trainer._train_replica,
            args=(trainer.params, trainer.rest, trainer._rngs, trainer.opt_state, x, y, w,
                  self._block_step[1], chunk_id))
        return PackedStepStats(stats)

    def resume(self, trainer: Any, steps_per_epoch: int) -> None:
        ckpt = trainer._checkpointer_or_none()
        restored = ckpt.restore_latest(like=trainer.state, what="model")
        if restored is None:
            return
        state, meta = restored
        trainer._restored_position = meta.get("data_position")
        trainer.params, trainer.rest = state["params"], state["rest"]
        trainer.opt_state = state["opt_state"]
        trainer.step = int(meta["step"])
        trainer.epoch = int(meta["epoch"])
        trainer.step_in_epoch = int(meta["step_in_epoch"])
        trainer.last_checkpoint = trainer.step

    def save(self, trainer: Any) -> None:
        ckpt = trainer._checkpointer_or_none()
        if ckpt is None or not trainer.should_checkpoint:
            return
        meta = {"step": trainer.step, "epoch": trainer.epoch,
                "step_in_epoch": trainer.step_in_epoch, "seed": trainer.seed,
                "global_batch_size": trainer.global_batch_size}
        if trainer._data_position is not None:  # a stream's position (grain's iterator state)
            meta["data_position"] = trainer._data_position
        ckpt.save(trainer.step, trainer.state, meta)
        trainer.last_checkpoint = trainer.step


__all__ = ["PACKED", "PACKED_FIELDS", "PackedStepStats", "SyncHook", "TrainerHook"]
