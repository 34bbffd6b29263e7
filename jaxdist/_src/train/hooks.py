"""Strategy-specific parts of the ``Trainer``: where the state lives and what one step does.

The ``Trainer`` always delegates to one ``TrainerHook``, chosen once in ``Trainer.__init__``
(``hook_for``): it creates the state, runs a training step, resumes, checkpoints and finishes,
while the ``Trainer`` keeps its own data order, metrics, logging, NaN checks and evaluation.
The contract is explicit: a hook takes a ``TrainState`` and a ``TrainerContext``
(``jaxdist._src.train.state``) and returns the new ``TrainState``; it never assigns an
attribute of the ``Trainer``. ``SyncHook`` is the hook of the synchronous strategies
(state placed by the strategy, the optax update applied in every replica); the parameter-server
hooks are in ``jaxdist._src.train.parameter_server``.

Example:
    >>> import jaxdist
    >>> from jaxdist._src.train.hook_registry import hook_for
    >>> hook_for(jaxdist.MirroredStrategy())
    SyncHook()
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jaxdist._src.train import data as data_lib
from jaxdist._src.train.state import TrainerContext, TrainState

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
                from jaxdist._src.distributed.bringup import raise_if_peer_lost

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
    """The per-strategy part of ``Trainer.fit`` (state creation, the step, resume and save);
    subclass it for a new strategy class.

    Every method gets a ``TrainerContext`` (``ctx``: the strategy, optimizer, loss, batch
    size, checkpoint settings...) and, where the state matters, the ``TrainState``
    (``state``); a method that changes the state returns the new one. A hook never assigns
    an attribute of the ``Trainer``. The defaults do nothing special; a subclass overrides
    what differs.

    Example:
        >>> from jaxdist.train import TrainerHook
        >>> class MyHook(TrainerHook):
        ...     def train_step(self, ctx, state, x, y, num_steps, w=None, chunk=0):
        ...         params, opt_state, stats = my_update(state.params, state.opt_state, x, y)
        ...         return state.replace(params=params, opt_state=opt_state), stats
    """

    #: Whether this task evaluates and logs validation metrics.
    should_evaluate: bool = True
    #: Whether the hook feeds its steps itself (e.g. per-worker datasets on remote workers):
    #: the ``Trainer`` then builds no batches and passes ``x = y = None`` to ``train_step``.
    owns_input: bool = False
    #: Whether the state (``params``, ``opt_state``) lives in the ``TrainState`` itself, so
    #: the learning rate and the weights can be set there.
    local_state: bool = False
    #: Whether ``fit`` may take a stream of batches (else in-memory arrays only).
    accepts_streams: bool = False
    #: Whether ``train_step`` takes input blocks: ``x``, ``y``, ``w`` hold several chunks
    #: and ``chunk=j`` names the one to run.
    input_blocks: bool = False

    def begin_fit(self, ctx: TrainerContext, state: TrainState, train: Any) -> None:
        """Called at the start of ``fit`` with the training data (an ``ArrayData`` or a
        stream)."""

    def stream_steps_per_epoch(self, ctx: TrainerContext, train: Any,
                               steps_per_epoch: int | None) -> int | None:
        """The steps of an epoch of the stream ``train`` when the hook sets them (e.g. every
        worker's whole batches of a grain ``MapDataset`` under a coordinator), else ``None``."""
        return None

    def init_state(self, ctx: TrainerContext, params: Any, rest: Any) -> TrainState:
        """Creates the training state from the model's ``params`` and ``rest``."""
        raise NotImplementedError

    def epoch_order(self, ctx: TrainerContext, num_examples: int, epoch: int) -> np.ndarray:
        """The example indices this task trains on in ``epoch``, in order."""
        return data_lib.epoch_order(num_examples, epoch, ctx.seed, ctx.shuffle)

    def train_step(self, ctx: TrainerContext, state: TrainState, x: Any, y: Any,
                   num_steps: int, w: Any = None, chunk: int = 0
                   ) -> tuple[TrainState, Mapping[str, Any]]:
        """Runs ``num_steps`` steps from ``state.step`` on the distributed chunk ``(x, y)``
        with sample weights ``w``; returns the new state (its position unchanged: the
        ``Trainer`` advances it) and ``{"loss", "correct", "weight"}`` with one entry per step
        (``weight``: the sum of the sample weights)."""
        raise NotImplementedError

    def current_state(self, ctx: TrainerContext, state: TrainState) -> TrainState:
        """The state with the parameters to evaluate or predict with now (e.g. pulled from
        the ps tasks)."""
        return state

    def resume(self, ctx: TrainerContext, state: TrainState, steps_per_epoch: int
               ) -> tuple[TrainState, Any]:
        """The state and position restored from ``ctx.checkpoint_dir`` if there is a
        checkpoint (else ``state``), and the data position saved with it (or ``None``)."""
        return state, None

    def save(self, ctx: TrainerContext, state: TrainState, data_position: Any = None
             ) -> TrainState:
        """Checkpoints ``state`` (called on every task; the hook decides); returns it with
        ``last_checkpoint`` set when a checkpoint was written. ``data_position``: a stream's
        position, saved with it."""
        return state

    def end_training(self, ctx: TrainerContext, state: TrainState) -> TrainState:
        """Called when this task has run its last step, before the final checkpoint and
        evaluation; returns the final state."""
        return state

    def state_version(self, ctx: TrainerContext, state: TrainState) -> Any:
        """A value that changes when the parameters change outside this task's own steps
        (``None``: they never do). The ``Trainer`` validates again at the end of ``fit`` when
        it differs from the last validation's: other workers' last pushes count."""
        return None

    def end_fit(self, ctx: TrainerContext, state: TrainState) -> None:
        """Called at the very end of ``fit``, after the final checkpoint and evaluation."""

    def get_learning_rate(self, ctx: TrainerContext, state: TrainState) -> float:
        """The learning rate the strategy's optimizer applies now (``trainer.learning_rate``)."""
        raise ValueError(f"the learning rate cannot be read under "
                         f"{type(ctx.strategy).__name__}")

    def set_learning_rate(self, ctx: TrainerContext, state: TrainState, value: float
                          ) -> TrainState:
        """Changes the learning rate from the next update on; returns the new state."""
        raise ValueError(f"the learning rate cannot be changed under "
                         f"{type(ctx.strategy).__name__}")

    def current_learning_rate(self, ctx: TrainerContext, state: TrainState) -> float | None:
        """The learning rate for the logs (``None``: not known)."""
        return None

    def set_weights(self, ctx: TrainerContext, state: TrainState, params: Any) -> TrainState:
        """Replaces the model's parameters (``trainer.set_weights``); returns the new state."""
        raise ValueError(f"set_weights is not supported under "
                         f"{type(ctx.strategy).__name__}")


class SyncHook(TrainerHook):
    """The hook of the synchronous strategies: the state is placed by the strategy, and one
    ``strategy.run`` of the trainer's replica step (``ctx.train_replica``) updates it.

    Args:
        strategy: the strategy (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``, ...).

    Example:
        >>> import jaxdist
        >>> from jaxdist._src.train.hooks import SyncHook
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

    def init_state(self, ctx: TrainerContext, params: Any, rest: Any) -> TrainState:
        with self.strategy.scope():
            params = self.strategy.place(params)
            rest = self.strategy.place(rest)
            opt_state = self.strategy.place(ctx.optimizer.init(params))
        return TrainState(params, rest, opt_state)

    def train_step(self, ctx: TrainerContext, state: TrainState, x: Any, y: Any,
                   num_steps: int, w: Any = None, chunk: int = 0
                   ) -> tuple[TrainState, Mapping[str, Any]]:
        """Runs chunk ``chunk`` of the input block ``(x, y, w)`` (``num_steps`` steps; the
        block's chunks run in order, so its first step is ``state.step - chunk *
        num_steps``)."""
        first = state.step - chunk * num_steps
        if self._block_step is None or self._block_step[0] != first:
            self._block_step = (first, self._on_device(first))
        chunk_id = self._chunk_ids.get(chunk)
        if chunk_id is None:
            chunk_id = self._chunk_ids[chunk] = self._on_device(chunk)
        params, rest, opt_state, stats = self.strategy.run(
            ctx.train_replica,
            args=(state.params, state.rest, ctx.rngs, state.opt_state, x, y, w,
                  self._block_step[1], chunk_id))
        return state.replace(params=params, rest=rest, opt_state=opt_state), \
            PackedStepStats(stats)

    def resume(self, ctx: TrainerContext, state: TrainState, steps_per_epoch: int
               ) -> tuple[TrainState, Any]:
        ckpt = ctx.checkpointer()
        like = {"params": state.params, "rest": state.rest, "opt_state": state.opt_state}
        restored = ckpt.restore_latest(like=like, what="model")
        if restored is None:
            return state, None
        saved, meta = restored
        step = int(meta["step"])
        return state.replace(params=saved["params"], rest=saved["rest"],
                             opt_state=saved["opt_state"], step=step,
                             epoch=int(meta["epoch"]),
                             step_in_epoch=int(meta["step_in_epoch"]),
                             last_checkpoint=step), meta.get("data_position")

    def save(self, ctx: TrainerContext, state: TrainState, data_position: Any = None
             ) -> TrainState:
        ckpt = ctx.checkpointer()
        if ckpt is None or not ctx.should_checkpoint:
            return state
        meta = {**state.checkpoint_meta(), "seed": ctx.seed,
                "global_batch_size": ctx.global_batch_size}
        if data_position is not None:  # a stream's position (grain's iterator state)
            meta["data_position"] = data_position
        ckpt.save(state.step, {"params": state.params, "rest": state.rest,
                               "opt_state": state.opt_state}, meta)
        return state.replace(last_checkpoint=state.step)


__all__ = ["PACKED", "PACKED_FIELDS", "PackedStepStats", "SyncHook", "TrainerHook"]
