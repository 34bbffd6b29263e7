"""The ``Trainer`` with a ``ClusterCoordinator``: the chief schedules steps onto worker tasks.

``CoordinatorHook`` is the ``TrainerHook`` of a ``ParameterServerStrategy`` that has a
``ClusterCoordinator`` (TF2 parameter-server training, as Keras' ``Model.fit`` with
``tf.distribute.ParameterServerStrategy``). ``Trainer.fit`` runs on the chief only:

* the chief creates the model's parameters and optimizer state on the ps tasks (the optimizer
  must be a ``jaxdist.ps.optimizers`` spec);
* it creates a per-worker dataset: worker ``i`` of ``n`` iterates its own disjoint,
  deterministic share of every epoch's order (examples ``i, i+n, ...``), batch by batch,
  repeating epoch after epoch; a restarted worker rebuilds it. A grain ``MapDataset`` (a
  picklable, random-access description of the data) is shared the same way, element by
  element (``GrainWorkerShard``); streams that exist only in the chief's process (generators,
  iterables, grain ``IterDataset``) are refused, as TF's ``Model.fit`` refuses generators
  with ``ParameterServerStrategy``;
* each training step is one scheduled function (``WorkerStep``): on whichever worker runs it,
  it takes the next batch of that worker's iterator, pulls the parameters, computes the
  gradient with jit synchronously across the worker's local devices, and pushes it; the ps
  tasks apply the update. ``steps_per_execution`` steps are scheduled at a time, and the
  chief only waits for results when it logs, checks for NaN, checkpoints or evaluates;
* at logging, checkpoint and epoch boundaries the chief ``join``s, then evaluates on its own
  devices with the pulled parameters and asks the ps tasks to checkpoint
  (``extended.save``); ``fit`` resumes from the latest such checkpoint.

A step lost with its worker runs again on another worker (at-least-once). The step function
lives in this module, so workers import it; the model's graph definition and the loss travel
by value (cloudpickle), the strategy and the variables as references.

Example:
    >>> strategy = jaxdist.ParameterServerStrategy()    # TF_CONFIG: chief:0  # doctest: +SKIP
    >>> coordinator = jaxdist.coordinator.ClusterCoordinator(strategy)  # doctest: +SKIP
    >>> with strategy.scope():  # doctest: +SKIP
    ...     trainer = jaxdist.Trainer(model, jaxdist.ps.optimizers.adam(3e-3),
    ...                               global_batch_size=32, strategy=strategy)
    >>> trainer.fit((x, y), epochs=10,  # on the workers  # doctest: +SKIP
    ...             validation_data=(x_val, y_val))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jaxdist._src.ps import optimizers as ps_optimizers
from jaxdist._src.strategies.current import get_replica_context
from jaxdist._src.train import data as data_lib
from jaxdist._src.train import keras_metrics
from jaxdist._src.train.hooks import LazyStats, TrainerHook
from jaxdist._src.train.parameter_server.between_graph import (
    ParameterServerHook,
    PSHookMixin,
    replica_gradients,
)
from jaxdist._src.train.state import TrainerContext, TrainState

#: The ps collection the trainer's parameters live in.
COLLECTION = "model"


def coordinator_of(strategy: Any) -> Any:
    """The live ``ClusterCoordinator`` of ``strategy``, or ``None``."""
    return getattr(strategy.extended, "cluster_coordinator", None)


def parameter_server_hook(strategy: Any) -> TrainerHook:
    """The hook of a ``ParameterServerStrategy``: the coordinator's if it has a live
    ``ClusterCoordinator`` (TF2), else between-graph training (TF1)."""
    if coordinator_of(strategy) is not None:
        return CoordinatorHook(strategy)
    return ParameterServerHook(strategy)


def worker_share(order: np.ndarray, worker: int, num_workers: int,
                 batch_size: int) -> np.ndarray:
    """Worker ``worker``'s share of an epoch's ``order``: every ``num_workers``-th example
    from ``worker`` on, cut to whole batches (every worker gets as many)."""
    batches = (len(order) // num_workers) // batch_size
    return order[worker::num_workers][:batches * batch_size]


class WorkerShard:
    """The per-worker dataset function: worker ``i`` iterates its share of every epoch.

    Called on the worker with its ``InputContext`` (``input_pipeline_id`` = worker index,
    ``num_input_pipelines`` = workers); yields ``(x, y)`` batches of ``batch_size`` rows,
    epoch after epoch from ``start_epoch`` (skipping ``start_batch`` batches of it).

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.train.parameter_server.coordinated import WorkerShard
        >>> from jaxdist import InputContext
        >>> x, y = np.ones((128, 4), np.float32), np.zeros((128,), np.int32)
        >>> it = iter(WorkerShard(x, y, 32, seed=0)(InputContext(2, 1)))
        >>> xb, yb = next(it)                # worker 1's first batch of epoch 0
    """

    def __init__(self, x: Any, y: np.ndarray, batch_size: int, seed: int = 0,
                 shuffle: bool = True, start_epoch: int = 0, start_batch: int = 0,
                 w: np.ndarray | None = None):
        self.x, self.y, self.w, self.batch_size = x, y, w, int(batch_size)
        self.seed, self.shuffle = seed, shuffle
        self.start_epoch, self.start_batch = int(start_epoch), int(start_batch)

    def __call__(self, ctx: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.batches(ctx.input_pipeline_id, ctx.num_input_pipelines)

    def batches(self, worker: int, num_workers: int) -> Iterator[tuple[Any, ...]]:
        """The batches of ``worker`` (endless): ``(x, y)``, or ``(x, y, w)`` with sample
        weights; ``x`` an array or a dict of feature arrays."""
        b, epoch, skip = self.batch_size, self.start_epoch, self.start_batch
        n = len(self.y)
        while True:
            order = data_lib.epoch_order(n, epoch, self.seed, self.shuffle)
            share = worker_share(order, worker, num_workers, b)
            if len(share) == 0:
                raise ValueError(f"worker {worker} of {num_workers} has no whole batch of {b} "
                                 f"in {n} training examples")
            for j in range(skip, len(share) // b):
                idx = share[j * b:(j + 1) * b]
                xb = jax.tree.map(lambda a: a[idx], self.x)  # noqa: B023
                yield (xb, self.y[idx]) if self.w is None else (xb, self.y[idx], self.w[idx])
            epoch, skip = epoch + 1, 0


class GrainWorkerShard:
    """The per-worker dataset function of a grain ``MapDataset``: worker ``i`` of ``n`` reads
    elements ``i, i+n, ...`` of every epoch (the same count for every worker: ``N // n`` of the
    ``N`` elements), in the dataset's order, and regroups their rows into batches of
    ``batch_size`` (the rest of its share is dropped, as the array path's share is cut to whole
    batches). Every epoch reads the dataset in the same order, as ``fit`` on one process does
    (shuffle with grain: ``.shuffle(seed)``); a resumed shard skips ``start_batch`` batches of
    ``start_epoch``.

    Args:
        dataset: the ``grain.MapDataset``; each element a batch ``(x, y)``, ``(x, y,
            sample_weight)`` or a dict with ``"x"``, ``"y"``, of ``rows`` rows (a single
            example when the label is a scalar).
        batch_size: rows per step.
        num_elements: elements of an epoch (the dataset's length, less a short last element).
        rows: rows of every element.
        class_weight: Keras' ``class_weight``.

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.train.parameter_server.coordinated import GrainWorkerShard
        >>> import grain  # doctest: +NEEDS_GRAIN
        >>> from jaxdist import InputContext
        >>> examples = [(np.ones(4, np.float32), np.int32(0)) for _ in range(128)]
        >>> ds = grain.MapDataset.source(examples).batch(32)
        >>> shard = GrainWorkerShard(ds, 32, num_elements=len(ds) - 1, rows=32)
        >>> xb, yb = next(iter(shard(InputContext(2, 1))))   # worker 1's first batch (element 1)
    """

    def __init__(self, dataset: Any, batch_size: int, num_elements: int, rows: int,
                 start_epoch: int = 0, start_batch: int = 0,
                 class_weight: Mapping[int, float] | None = None):
        self.dataset, self.batch_size = dataset, int(batch_size)
        self.num_elements, self.rows = int(num_elements), int(rows)
        self.start_epoch, self.start_batch = int(start_epoch), int(start_batch)
        self.class_weight = class_weight

    def batches_per_worker(self, num_workers: int) -> int:
        """Whole batches of each worker's share of an epoch."""
        return (self.num_elements // num_workers) * self.rows // self.batch_size

    def __call__(self, ctx: Any) -> Iterator[tuple[Any, ...]]:
        return self.batches(ctx.input_pipeline_id, ctx.num_input_pipelines)

    def batches(self, worker: int, num_workers: int) -> Iterator[tuple[Any, ...]]:
        """The batches of ``worker`` (endless): ``(x, y)`` or ``(x, y, w)``."""
        from jaxdist._src.train import inputs as inputs_lib

        src = inputs_lib.StreamSource(self.dataset, "train_data", self.class_weight)
        b, skip = self.batch_size, self.start_batch
        per = self.batches_per_worker(num_workers)
        if per == 0:
            raise ValueError(f"worker {worker} of {num_workers} has no whole batch of {b} "
                             f"in its {self.num_elements // num_workers} elements of "
                             f"{self.rows} rows")
        share = range(worker, self.num_elements, num_workers)[:self.num_elements // num_workers]
        while True:
            buf: list[tuple[Any, Any, Any]] = []
            have = done = 0
            for i in share:
                part = src.normalize(self.dataset[i])
                n = inputs_lib.row_count(part[0])
                if n != self.rows:
                    raise ValueError(f"element {i} of the grain dataset has {n} rows; expected "
                                     f"{self.rows}, as its first element (every element but "
                                     f"the last must have as many)")
                buf.append(part)
                have += n
                while have >= b and done < per:
                    (xb, yb, wb), buf, have = inputs_lib.take(buf, b)
                    done += 1
                    if done > skip:
                        yield (xb, yb) if wb is None else (xb, yb, wb)
                if done == per:
                    break
            skip = 0


class WorkerStep:
    """One training step, run on a worker task by the coordinator.

    Takes the next batch of the worker's iterator, pulls the parameters (``strategy.run`` with
    the ``PSVariables``), computes loss and gradient on the worker's local devices (jit, the
    batch split across them, gradients all-reduced), pushes the gradient and returns
    ``{"loss", "correct", "weight"}`` (and ``"metrics"``: the metrics' sums) of the step.

    Dropout keys are ``fold_in(fold_in(seed key, step), local replica)``, ``step`` being the
    global step the coordinator scheduled (unique per step): they differ per step and replica,
    do not depend on which worker runs the step (a step run again after a worker died draws
    the same masks), and a run with one worker is reproducible from the model's seed (equal
    to between-graph training with one worker). Without ``step`` a per-worker counter is used.

    Args:
        model_state: the model's ``ModelState`` (graph definition, random streams; no
            parameters).
        loss_fn: ``(logits, labels) -> per-example loss``.
        global_batch_size: rows per step (per worker; split across its devices).
        variables: the model's ``PSVariables``.
        rest: the model's non-parameter state (host arrays).
        strategy: the coordinator's strategy (the worker's own one when this runs there).
        compute_dtype: mixed precision's compute dtype, or ``None``.
    """

    def __init__(self, model_state: Any, loss_fn: Callable, global_batch_size: int,
                 variables: Any, rest: Any, strategy: Any, compute_dtype: Any = None,
                 metrics: Any = ()):
        # metrics: the trainer's ``(name, metric, weighted)`` specs
        self.model_state, self.loss_fn = model_state, loss_fn
        self.metrics = tuple(metrics)
        self.global_batch_size = int(global_batch_size)
        self.variables, self.rest, self.strategy = variables, rest, strategy
        self.compute_dtype = compute_dtype
        self._replica_fn: Callable | None = None
        self._rngs: Any = None
        self._count = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_replica_fn": None, "_rngs": None}

    def __call__(self, iterator: Iterator, step: Any = None) -> dict[str, np.ndarray]:
        batch = next(iterator)
        x, y = batch[0], batch[1]
        w = batch[2] if len(batch) > 2 else np.ones((len(y),), np.float32)
        strategy = self.strategy
        n, b = strategy.num_replicas_in_sync, self.global_batch_size
        if b % n:
            raise ValueError(f"global_batch_size={b} does not divide across the {n} local "
                             f"devices of this worker; expected a multiple of {n}")
        if self._replica_fn is None:  # once per worker: strategy.run keeps it compiled
            self._replica_fn = _make_grad_replica(self.model_state, self.loss_fn, b,
                                                  self.compute_dtype, self.metrics)
            self._rngs = strategy.place(self.model_state.rngs)
        per = b // n

        def part(tree: Any) -> Any:
            return jax.tree.map(lambda a: strategy.experimental_distribute_values_from_function(
                lambda ctx: a[ctx.replica_id_in_sync_group * per:
                              (ctx.replica_id_in_sync_group + 1) * per]), tree)

        count, self._count = self._count, self._count + 1
        step = count if step is None else int(step)
        stats, grads = strategy.run(self._replica_fn,
                                    args=(self.variables, self.rest, self._rngs,
                                          part(x), part(y), part(np.asarray(w, np.float32)),
                                          np.int32(step)))
        self.variables.apply_gradients(grads)
        return jax.device_get(stats)


def _make_grad_replica(ms: Any, loss_fn: Callable, global_batch_size: int,
                       compute_dtype: Any = None, metrics: Any = ()) -> Callable:
    def grad_replica(params, rest, rngs, x, y, w, step):
        ctx = get_replica_context()
        replica = ctx.replica_id_in_sync_group

        # the same sums as the synchronous trainer's (weighted_metrics weighted by w)
        return replica_gradients(
            ms, params, rest, rngs, x, y, w, loss_fn=loss_fn,
            global_batch_size=global_batch_size, step=step, replica=replica,
            compute_dtype=compute_dtype,
            metric_sums=lambda logits, y_, w_: keras_metrics.metric_sums(metrics, logits, y_,
                                                                          None, w_))

    return grad_replica


class StepStats(LazyStats):
    """The statistics of scheduled steps, fetched when first read: ``stats["loss"]`` (one
    value per step), ``"correct"``, ``"weight"`` and ``"metrics"`` (``{name: {sum: per-step
    values}}``). Every step counts once, whichever worker ran it (a step lost with its worker
    and run again returns one result). The ``Trainer`` reads it only to log or check NaN.

    Example:
        >>> stats = StepStats([coordinator.schedule(step_fn, args=(it,))])  # doctest: +SKIP
        >>> stats["loss"]          # waits for the step  # doctest: +SKIP
    """

    def __init__(self, remote_values: list[Any]):
        self.remote_values = remote_values
        self._stacked: dict[str, Any] | None = None

    def _fetch(self) -> dict[str, Any]:
        if self._stacked is None:
            values = [rv.fetch() for rv in self.remote_values]
            self._stacked = jax.tree.map(
                lambda *a: np.asarray([np.asarray(v, np.float64) for v in a]), *values)
        return self._stacked

    def __repr__(self) -> str:
        return f"StepStats(steps={len(self.remote_values)})"


def _is_grain_map_dataset(data: Any) -> bool:
    """Whether ``data`` is a grain ``MapDataset`` (grain imported only if ``data`` is grain's)."""
    if data is None or not type(data).__module__.startswith("grain"):
        return False
    import grain

    return isinstance(data, grain.MapDataset)


def _element_rows(train: Any, elem: Any) -> int:
    """Rows of one element of the stream ``train``."""
    from jaxdist._src.train import inputs as inputs_lib

    x, y, _ = train.normalize(elem)
    return inputs_lib.row_count(x) if y is None else int(np.shape(y)[0])


class CoordinatorHook(PSHookMixin, TrainerHook):
    """``TrainerHook`` for a ``ParameterServerStrategy`` with a ``ClusterCoordinator`` (see the
    module docstring).

    Args:
        strategy: the chief's ``ParameterServerStrategy``; ``ClusterCoordinator(strategy)``
            must have been created.
    """

    owns_input = True
    accepts_streams = True  # a grain MapDataset; begin_fit refuses the others
    is_chief = True  # the coordinator's process is the chief

    def __init__(self, strategy: Any):
        self.strategy = strategy
        self.coordinator = coordinator_of(strategy)
        if self.coordinator is None:
            raise ValueError(f"{strategy!r} has no running ClusterCoordinator; create "
                             f"jaxdist.coordinator.ClusterCoordinator(strategy) first")
        self.num_workers = self.coordinator.num_workers
        self.variables: Any = None
        self._step_fn: WorkerStep | None = None
        self._train: Any = None
        self._iterator: Any = None
        self._grain: tuple[int, int] | None = None  # a MapDataset's (elements, rows)
        self._host_rest: Any = None

    # ------------------------------------------------------------------ state
    def init_state(self, ctx: TrainerContext, params: Any, rest: Any) -> TrainState:
        self.check_model(ctx)
        spec = ps_optimizers.as_spec(ctx.optimizer)
        host, self._host_rest = jax.device_get(params), jax.device_get(rest)
        with self.strategy.scope():
            self.variables = self.strategy.create_variables(host, spec, name=COLLECTION)
            rest = self.strategy.place(rest)
        return TrainState(host, rest, None)

    def _worker_step(self, ctx: TrainerContext) -> WorkerStep:
        """The scheduled step function of ``ctx.global_batch_size`` (one per batch size)."""
        if self._step_fn is None or self._step_fn.global_batch_size != ctx.global_batch_size:
            import dataclasses

            ms = dataclasses.replace(ctx.model_state, params=None)  # the parameters: on the ps
            self._step_fn = WorkerStep(ms, ctx.loss_fn, ctx.global_batch_size,
                                       self.variables, self._host_rest, self.strategy,
                                       ctx.compute_dtype, ctx.metric_specs)
        return self._step_fn

    def current_state(self, ctx: TrainerContext, state: TrainState) -> TrainState:
        self.coordinator.join()
        return state.replace(params=self.variables.pull())

    # ------------------------------------------------------------------ data and steps
    def begin_fit(self, ctx: TrainerContext, state: TrainState, train: Any) -> None:
        grain_map = _is_grain_map_dataset(getattr(train, "data", None))
        if not isinstance(train, data_lib.ArrayData) and not grain_map:
            raise data_lib.DataError(
                f"ClusterCoordinator training takes in-memory arrays or a grain MapDataset "
                f"(each worker reads its share of every epoch, sent with the per-worker "
                f"dataset); got a {train.name}: a {train.name} lives in the chief's process and "
                f"the workers cannot read it. Pass (x, y) arrays or a grain.MapDataset (not "
                f"to_iter_dataset()), or use ParameterServerStrategy without a coordinator "
                f"(between-graph: each worker reads the stream it is given)")
        self._grain = None
        if grain_map:
            ds = train.data
            n = len(ds)
            if n <= 0 or n >= 2 ** 62:
                raise data_lib.DataError(
                    f"ClusterCoordinator training needs a finite grain MapDataset (its length "
                    f"is an epoch); got one of length {n}: leave out .repeat(), fit repeats "
                    f"it every epoch")
            rows = train.rows_per_element()
            last = _element_rows(train, ds[n - 1])
            if last != rows and n > 1:
                n -= 1  # a short last element (batch without drop_remainder) is dropped
            self._grain = (n, rows)
        if self._train is not train:
            self._train, self._iterator = train, None

    def stream_steps_per_epoch(self, ctx: TrainerContext, train: Any,
                               steps_per_epoch: int | None) -> int | None:
        """A grain ``MapDataset``'s steps per epoch: every worker's whole batches."""
        if self._grain is None:
            return None
        n, rows = self._grain
        spe = self.num_workers * GrainWorkerShard(None, ctx.global_batch_size, n,
                                                  rows).batches_per_worker(self.num_workers)
        if spe == 0:
            raise data_lib.DataError(
                f"train_data: the grain MapDataset's {n} elements of {rows} rows give no whole "
                f"batch of {ctx.global_batch_size} to each of the {self.num_workers} "
                f"workers; use a smaller global_batch_size or more data")
        if steps_per_epoch is not None and int(steps_per_epoch) != spe:
            raise data_lib.DataError(
                f"steps_per_epoch={steps_per_epoch}: with a ClusterCoordinator an epoch of a "
                f"grain MapDataset is every worker's whole batches ({spe} steps); leave "
                f"steps_per_epoch out, or pass steps=N for a number of steps")
        return spe

    def epoch_order(self, ctx: TrainerContext, num_examples: int, epoch: int) -> np.ndarray:
        """The examples the workers train on in ``epoch``: worker 0's share, then worker 1's...
        (its length sets the steps of an epoch: every worker's whole batches)."""
        order = data_lib.epoch_order(num_examples, epoch, ctx.seed, ctx.shuffle)
        b, n = ctx.global_batch_size, self.num_workers
        return np.concatenate([worker_share(order, w, n, b) for w in range(n)])

    def _start_input(self, ctx: TrainerContext, state: TrainState) -> None:
        train = self._train
        if train is None:
            raise RuntimeError("CoordinatorHook.train_step before begin_fit: the Trainer "
                               "passes the training data to the hook first")
        if self._grain is not None:
            shard: Any = GrainWorkerShard(train.data, ctx.global_batch_size, *self._grain,
                                          start_epoch=state.epoch,
                                          start_batch=state.step_in_epoch // self.num_workers,
                                          class_weight=train.class_weight)
        else:
            shard = WorkerShard(train.x, train.y, ctx.global_batch_size, ctx.seed,
                                ctx.shuffle, state.epoch,
                                state.step_in_epoch // self.num_workers, w=train.w)
        dataset = self.coordinator.create_per_worker_dataset(shard)
        self._iterator = iter(dataset)

    def train_step(self, ctx: TrainerContext, state: TrainState, x: Any, y: Any,
                   num_steps: int, w: Any = None, chunk: int = 0
                   ) -> tuple[TrainState, StepStats]:
        del x, y, w  # the workers read their own shares (per-worker datasets)
        step_fn = self._worker_step(ctx)
        if self._iterator is None:
            self._start_input(ctx, state)
        rvs = [self.coordinator.schedule(step_fn,
                                         args=(self._iterator, np.int64(state.step + i)))
               for i in range(num_steps)]
        return state, StepStats(rvs)

    # ------------------------------------------------------------------ checkpoints
    def resume(self, ctx: TrainerContext, state: TrainState, steps_per_epoch: int
               ) -> tuple[TrainState, Any]:
        directory = os.path.abspath(ctx.checkpoint_dir)
        step = self.strategy.extended.latest_checkpoint_step(directory, "ps:0")
        if step is None:
            return state, None
        step = min(self.strategy.extended.restore(directory, step))
        epoch, in_epoch = divmod(step, steps_per_epoch)
        return state.replace(step=step, epoch=epoch, step_in_epoch=in_epoch,
                             last_checkpoint=step), None

    def set_weights(self, ctx: TrainerContext, state: TrainState, params: Any) -> TrainState:
        """Assigns the ps variables once the steps scheduled so far have pushed."""
        self.coordinator.join()
        return super().set_weights(ctx, state, params)

    def save(self, ctx: TrainerContext, state: TrainState, data_position: Any = None
             ) -> TrainState:
        self.coordinator.join()
        self.strategy.extended.save(os.path.abspath(ctx.checkpoint_dir), state.step,
                                    keep=ctx.keep_checkpoints)
        return state.replace(last_checkpoint=state.step)

    def end_training(self, ctx: TrainerContext, state: TrainState) -> TrainState:
        state = self.current_state(ctx, state)
        runs = self.coordinator.functions_run()
        states = self.coordinator.worker_states()
        print("[coordinator] steps run: " + ", ".join(
            f"{st.name} {n}" + (f" (restarted {st.restarts}x)" if st.restarts else "")
            for st, n in zip(states, runs)), flush=True)
        return state

__all__ = ["COLLECTION", "CoordinatorHook", "GrainWorkerShard", "StepStats", "WorkerShard",
           "WorkerStep", "coordinator_of", "parameter_server_hook", "worker_share"]
