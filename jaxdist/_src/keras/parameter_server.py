"""Keras 3 ``model.fit`` under ``ParameterServerStrategy``: variables on the ps tasks.

``attach(model, strategy)`` (after ``model.compile``) moves a Keras model's trainable variables
to the ps tasks and replaces its train step, so ``model.fit`` trains asynchronously:

* **between-graph** (TF1 style; every worker runs the same program and its own ``fit`` on its
  own share of the data): each step pulls the trainable variables, computes loss and gradients
  with ``jax.value_and_grad`` of Keras's own ``compute_loss_and_updates`` (jit), and pushes the
  gradients; each ps applies the Keras optimizer's update (translated by
  ``keras_optimizer_spec``) to its shards. The chief creates the variables, other workers wait
  for them. ``max_staleness`` of the strategy (SSP) is honoured.
* **with a ClusterCoordinator** (TF2 style; ``fit`` runs on the coordinator): every step is a
  function scheduled onto some worker, with its batch as argument (the coordinator's Keras data
  pipeline decides the batches, so epochs and shuffling are Keras's own); the worker pulls,
  computes, pushes, and returns the step's metric state, which the coordinator sums into its
  metrics. A step lost with its worker runs again on another one (at-least-once).
  ``steps_per_execution`` steps are dispatched before the coordinator folds in finished ones.

What stays where: the optimizer state lives on the ps (Keras's own optimizer variables are not
updated); non-trainable state (BatchNormalization statistics, seed generators) stays on the
worker that computes (with a coordinator: the state returned by the latest finished step is
kept by the coordinator's model); metrics are computed on the worker (with a coordinator:
summed on the coordinator, so every metric variable must declare Keras's ``"sum"``
aggregation, as all built-in metrics do).

Whenever Keras reads the model's weights during ``fit`` (a callback touching ``model``, the
epoch end, validation) and at the end of ``fit`` they are pulled from the ps first, so they are
the ps's current values; ``pull_weights()`` pulls them at any other time. A worker computes on
all its compute devices (the batch split over them in one jit).
Callbacks that cannot work when the state lives on the ps are rejected when ``fit`` starts:
``ReduceLROnPlateau`` / ``LearningRateScheduler`` (the learning rate is the ps optimizer's),
``BackupAndRestore`` (use ``strategy.extended.save`` / ``restore``: ps checkpoints hold the
optimizer state) and ``EarlyStopping(restore_best_weights=True)``.

Example:
    >>> import keras  # doctest: +NEEDS_KERAS
    >>> import numpy as np
    >>> import jaxdist.keras
    >>> x, y = np.ones((64, 4), np.float32), np.ones((64, 1), np.float32)
    >>> strategy = jaxdist.ParameterServerStrategy()          # TF_CONFIG names the cluster
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    >>> jaxdist.keras.attach(model, strategy)
    KerasPSTraining(...)
    >>> history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)  # pulls, pushes, async
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import keras
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist._src.compat import keras_internals as ki
from jaxdist._src.keras.ps_embedding import SparseTable, input_index, table_optimizer
from jaxdist._src.keras.ps_optimizers import keras_optimizer_spec
from jaxdist._src.ps import optimizers as ps_opt

#: The ps collection a Keras model's trainable variables live in (by default).
COLLECTION = "keras"

_REJECTED_CALLBACKS = {
    "ReduceLROnPlateau": "the learning rate is the ps optimizer's; give the optimizer a "
                         "keras.optimizers.schedules.ExponentialDecay learning rate, or pass "
                         "ps_optimizer=jaxdist.ps.optimizers.<opt>(<schedule spec>) to attach",
    "LearningRateScheduler": "the learning rate is the ps optimizer's; give the optimizer a "
                             "keras.optimizers.schedules.ExponentialDecay learning rate, or "
                             "pass ps_optimizer= with a jaxdist.ps.optimizers schedule",
    "BackupAndRestore": "the variables and the optimizer state live on the ps tasks; save and "
                        "resume them with strategy.extended.save(dir, step) / "
                        "strategy.extended.restore(dir) (or jaxdist.Server --checkpoint_dir)",
    "SwapEMAWeights": "the ps optimizer keeps no EMA of the weights",
}


def check_callbacks(callbacks: Any) -> None:
    """Raises ``ValueError`` for a Keras callback that cannot work with state on the ps.

    Example:
        >>> import keras  # doctest: +NEEDS_KERAS
        >>> from jaxdist._src.keras.parameter_server import check_callbacks
        >>> check_callbacks([keras.callbacks.EarlyStopping()])   # fine
    """
    items = getattr(callbacks, "callbacks", callbacks) or []
    for cb in items:
        name = type(cb).__name__
        why = _REJECTED_CALLBACKS.get(name)
        if why is None and name == "EarlyStopping" and getattr(cb, "restore_best_weights",
                                                               False):
            why = ("restoring the best weights would set them on this worker only; the ps "
                   "would keep training from its own; use restore_best_weights=False and a "
                   "ModelCheckpoint(save_best_only=True) (it pulls the weights from the ps)")
        if why is not None:
            raise ValueError(f"Keras callback {name} does not work under "
                             f"ParameterServerStrategy: {why}")


def _check_metric_aggregation(model: Any) -> None:
    for v in model.metrics_variables:
        agg = getattr(v, "aggregation", "sum")
        if agg != "sum":
            raise ValueError(
                f"metric variable {v.path!r} declares aggregation={agg!r}: with a "
                f"ClusterCoordinator each worker's step returns its metric state and the "
                f"coordinator sums them, which is right only for 'sum' variables (all "
                f"built-in Keras metrics); compute this metric with model.evaluate instead"
            )


class _StepCompute:
    """The jitted gradient step of a Keras model: loss, gradients, new non-trainable and
    metric state of one batch, from trainable values given as arguments.

    With several ``devices`` (the worker's compute devices) the batch is split over them and
    the state replicated: one jit over the worker's devices (XLA inserts the all-reduce), so
    the numbers are those of the whole batch on one device.
    """

    def __init__(self, model: Any, devices: Sequence[Any] = ()):
        self.model = model

        def step(trainable, non_trainable, metrics_vars, opt_vars, x, y, sw):
            (_, aux), grads = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)(
                trainable, non_trainable, metrics_vars, x, y, sw, training=True,
                optimizer_variables=opt_vars)
            unscaled, y_pred, non_trainable, metrics_vars = aux
            logs, metrics_vars = ki.update_metrics_variables(
                model, metrics_vars, unscaled, x, y, y_pred, sw)
            return logs, grads, non_trainable, metrics_vars

        self._step = jax.jit(step) if (model.jit_compile and not model.run_eagerly) else step
        self._n = len(devices)
        if self._n > 1:
            mesh = Mesh(np.asarray(list(devices)), ("batch",))
            self._split = NamedSharding(mesh, PartitionSpec("batch"))
            self._replicated = NamedSharding(mesh, PartitionSpec())

    def _place(self, state: Any, batch: Any) -> tuple[Any, Any]:
        for leaf in jax.tree.leaves(batch):
            rows = np.shape(leaf)[0] if np.ndim(leaf) else None
            if rows is None or rows % self._n:
                raise ValueError(
                    f"a batch of {rows} rows cannot be split over this worker's {self._n} "
                    f"compute devices: use a batch_size divisible by {self._n} (and drop the "
                    f"remainder), or ParameterServerStrategy(compute_devices=[one device])")
        return (jax.device_put(state, self._replicated), jax.device_put(batch, self._split))

    def __call__(self, trainable, non_trainable, metrics_vars, opt_vars, data):
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        if self._n > 1:
            (trainable, non_trainable, metrics_vars, opt_vars), (x, y, sw) = self._place(
                (list(trainable), list(non_trainable), list(metrics_vars), list(opt_vars)),
                (x, y, sw))
        return self._step(trainable, non_trainable, metrics_vars, opt_vars, x, y, sw)


def _compute_devices(strategy: Any) -> tuple:
    return tuple(strategy.extended.worker_devices)


def _values(variables: Any) -> list:
    return [v.value for v in variables]


class _PSState:
    """A model's trainable variables as the ps holds them: dense ``PSVariables`` (in the order
    of ``dense_index``) and sparse tables (one buffer variable each on this process)."""

    def __init__(self, model: Any, variables: Any, tables: list):
        self.model, self.variables, self.tables = model, variables, tables
        sparse = {t.var_index for t in tables}
        self.dense_index = [i for i in range(len(model.trainable_variables)) if i not in sparse]

    def merge(self, dense: Any, current: Any = None, rows: dict | None = None) -> list:
        """The full trainable list: ``dense`` values, and the sparse buffers from ``rows`` (by
        variable index) or zeros of their current shape (``current`` is ignored for them)."""
        n = len(self.model.trainable_variables)
        out: list = [None] * n
        for i, x in zip(self.dense_index, dense):
            out[i] = x
        for t in self.tables:
            j = t.var_index
            if rows and j in rows:
                out[j] = rows[j]
            else:  # the buffer's contents never matter: every step fills it with its rows
                out[j] = np.zeros(tuple(self.model.trainable_variables[j].shape),
                                  t.table.dtype)
        return out

    def pull_batch(self, data: Any) -> tuple[Any, list, list]:
        """Pulls the dense variables and the batch's sparse rows: ``(data with renumbered
        ids, trainable values, lookups)``."""
        if not self.tables:
            return data, list(self.variables.pull()), []
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        rows, looks = {}, []
        for t in self.tables:
            x, r, look = t.pull(x)
            rows[t.var_index] = r
            looks.append(look)
        return (x, y, sw), self.merge(self.variables.pull(), rows=rows), looks

    def push(self, grads: list, looks: list) -> None:
        self.variables.apply_gradients([grads[i] for i in self.dense_index])
        for t, look in zip(self.tables, looks):
            t.push(look, grads[t.var_index])



class KerasPSTraining:
    """What ``attach`` returns: the handle of a Keras model trained on parameter servers.

    Attributes:
        model: the Keras model.
        strategy: the ``ParameterServerStrategy``.
        variables: the ``PSVariables`` holding ``model.trainable_variables`` (in that order).
        ps_optimizer: the ``jaxdist.ps.optimizers`` spec the ps applies.
        steps: steps this process ran (between-graph) or scheduled (coordinator).

    Example:
        >>> import keras  # doctest: +NEEDS_KERAS
        >>> import numpy as np
        >>> import jaxdist.keras
        >>> x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: trains locally
        >>> training = jaxdist.keras.attach(model, strategy)
        >>> history = model.fit(x, y, epochs=2, verbose=0)
        >>> training.pull_weights()      # the ps's current values into the model
    """

    def __init__(self, model: Any, strategy: Any, ps_optimizer: Any = None,
                 name: str = COLLECTION, sparse_embeddings: Sequence[str] = (),
                 embedding_optimizer: Any = None):
        from jaxdist._src.strategies.parameter_server import ParameterServerStrategy

        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(f"jaxdist.keras.attach needs a ParameterServerStrategy, got "
                            f"{strategy!r}; for synchronous strategies use "
                            f"jaxdist.keras.scope(strategy)")
        if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
            raise ValueError("attach the model after model.compile(optimizer=..., loss=...): "
                             "the Keras optimizer decides the update the ps applies")
        self.model, self.strategy = model, strategy
        self._optimizer = model.optimizer
        self.ps_optimizer = (ps_opt.as_spec(ps_optimizer) if ps_optimizer is not None
                             else keras_optimizer_spec(model.optimizer))
        self.coordinator = strategy.extended.cluster_coordinator
        self._name, self._sparse_names = name, list(sparse_embeddings)
        self._embedding_optimizer = embedding_optimizer
        layers = [_embedding_layer(model, n) for n in sparse_embeddings]
        for layer in layers:
            input_index(model, layer)  # refuse before anything is created on the ps
        self.variables: Any = None
        self.tables: list[SparseTable] = []
        self.steps = 0
        self._compute: _StepCompute | None = None
        self._pending: deque = deque()
        self._worker_step: Any = None
        self._install()
        if model.built:
            self._create_on_ps()
        # else (no keras.Input, never called): as TF's fit, the first fit / evaluate /
        # predict builds the model from its first batch, then its variables go to the ps.

    def _create_on_ps(self) -> None:
        """Creates the model's trainable variables on the ps (the chief; other workers wait
        for them) and takes their values."""
        model, strategy, name = self.model, self.strategy, self._name
        layers = [_embedding_layer(model, n) for n in self._sparse_names]
        if self.coordinator is not None:
            _check_metric_aggregation(model)
        sparse_ids = {id(layer.embeddings) for layer in layers}
        self._dense_index = [i for i, v in enumerate(model.trainable_variables)
                             if id(v) not in sparse_ids]
        init = [np.asarray(model.trainable_variables[i].value) for i in self._dense_index]
        if layers:
            spec = table_optimizer(self.ps_optimizer, self._embedding_optimizer,
                                   self._sparse_names)
        with strategy.scope():
            self.variables = strategy.create_variables(init, self.ps_optimizer, name=name)
            for layer in layers:
                full = np.asarray(layer.embeddings.value)
                table = strategy.create_embedding(
                    f"{name}/{layer.name}", full.shape[0], full.shape[1], optimizer=spec,
                    initializer=full, dtype=full.dtype)
                self.tables.append(SparseTable(model, layer, table))
        self._ps = _PSState(model, self.variables, self.tables)
        if self.coordinator is not None:
            # Serialized now: during fit Keras detaches the values from the model's variables
            # (and before the tables shrink: the workers load the model whole once).
            self._worker_step = KerasWorkerStep(
                _model_bytes(model), self.variables, strategy,
                [(t.layer.name, t.table, t.input_index) for t in self.tables])
        for t in self.tables:
            t.shrink(1)  # the table is on the ps: free this process's copy

    def _ensure_on_ps(self, model: Any) -> None:
        """A lazily built model, now built by Keras from its first batch: its variables go
        to the ps, and the model takes the ps's values (the chief's initial ones)."""
        if self.variables is not None:
            return
        if not model.built:
            raise ValueError(f"model {model.name!r} is still not built after Keras saw its "
                             f"first batch: give it a keras.Input or call "
                             f"model.build(input_shape) before fit")
        self._create_on_ps()
        self.pull_weights()

    # ------------------------------------------------------------------ model hooks
    def _install(self) -> None:
        from jaxdist._src.keras import model_strategy

        model, handle = self.model, self
        # evaluate / predict / ... enter jaxdist's trainer hooks (jaxdist.Dataset input)
        model_strategy.add_model_hooks(model)

        def make_train_function(self_model, force=False):
            if self_model.optimizer is not handle._optimizer:
                raise ValueError("the model was compiled again with another optimizer after "
                                 "jaxdist.keras.attach; call attach(model, strategy) again")
            handle._ensure_on_ps(self_model)  # Keras built the model before asking
            self_model.train_function = (handle._coordinator_train_function
                                         if handle.coordinator is not None
                                         else handle._train_function)

        def lazy(method: str) -> Any:
            def make(self_model, force=False):
                if self_model.built:
                    handle._ensure_on_ps(self_model)
                if handle.tables:
                    sparse = (handle._sparse_test_function if method == "make_test_function"
                              else handle._sparse_predict_function)
                    key = method.replace("make_", "")
                    setattr(self_model, key, sparse)
                    return sparse
                return getattr(type(self_model), method)(self_model, force)

            return make

        def jax_state_sync(self_model):
            handle._refresh_jax_state()
            return type(self_model).jax_state_sync(self_model)

        def fit(self_model, *args, **kwargs):
            # fit(x, y, batch_size, epochs, verbose, callbacks, ...)
            check_callbacks(kwargs.get("callbacks", args[5] if len(args) > 5 else None))
            try:
                with model_strategy.hooks(scope=False):
                    return type(self_model).fit(self_model, *args, **kwargs)
            finally:
                handle._finish()

        methods = [("make_train_function", make_train_function),
                   ("make_test_function", lazy("make_test_function")),
                   ("make_predict_function", lazy("make_predict_function")),
                   ("jax_state_sync", jax_state_sync), ("fit", fit)]
        if self._sparse_names:
            methods += self._sparse_methods()
        for name, fn in methods:
            ki.set_instance_method(model, name, fn, hook=False)
        model.train_function = None
        model.test_function = None
        model.predict_function = None

    def _sparse_methods(self) -> list:
        handle = self
        cls = type(self.model)

        def guarded(method: str) -> Any:
            original = getattr(cls, method)

            def call(self_model, *args, **kwargs):
                if any(t.cap for t in handle.tables):
                    names = [t.layer.name for t in handle.tables]
                    raise ValueError(
                        f"model.{method}: the tables of the sparse embeddings {names} live on "
                        f"the ps tasks (this worker holds only a batch's rows); call "
                        f"training.pull_weights(full_tables=True) first (it reads the whole "
                        f"tables), or save the ps state with strategy.extended.save(dir, step)")
                return original(self_model, *args, **kwargs)

            return call

        return [(m, guarded(m)) for m in ("get_weights", "save", "save_weights")]

    def _refresh_jax_state(self) -> None:
        """Before Keras writes its step state into the model: take the ps's values."""
        state = ki.step_state(self.model)
        if not state or ki.step_state_synced(self.model) or self.variables is None:
            return
        self._drain(state)
        state["trainable_variables"] = self._ps.merge(self.variables.pull(),
                                                   state.get("trainable_variables"))

    def _finish(self) -> None:
        if self.variables is None:  # fit failed before the model was built
            return
        self._drain(None)
        self.pull_weights()
        if self.coordinator is None:
            self.strategy.extended.worker_done()

    def pull_weights(self, full_tables: bool = False) -> None:
        """Assigns the ps's current values to ``model.trainable_variables``.

        Args:
            full_tables: also read the whole tables of the sparse embeddings back into their
                layers (needed before ``model.save`` / ``get_weights``; the next step shrinks
                them again).
        """
        if self.variables is None:
            raise RuntimeError(f"model {self.model.name!r} is not built yet, so nothing is on "
                               f"the ps: its first fit / evaluate / predict builds it")
        trainable = self.model.trainable_variables
        for i, x in zip(self._dense_index, self.variables.pull()):
            trainable[i].assign(x)
        if full_tables:
            for t in self.tables:
                t.restore(t.table.read_value())

    # ------------------------------------------------------------------ between-graph
    def _train_function(self, state: Any, iterator: Any) -> tuple[Any, Any]:
        model, ext = self.model, self.strategy.extended
        if self._compute is None:
            self._compute = _StepCompute(model, _compute_devices(self.strategy))
        _, non_trainable, opt_vars, metrics_vars = state
        logs, params = None, None
        for i in range(max(1, int(model.steps_per_execution))):
            try:
                data = next(iterator)
            except StopIteration:
                if i == 0:
                    raise
                break
            ext.begin_step()
            data, params, looks = self._ps.pull_batch(data)
            logs, grads, non_trainable, metrics_vars = self._compute(
                params, non_trainable, metrics_vars, opt_vars, data)
            self._ps.push(list(grads), looks)
            self.steps += 1
        return logs, (params, non_trainable, opt_vars, metrics_vars)

    def _batches(self, iterator: Any) -> list:
        """The next ``steps_per_execution`` batches (fewer at the end; StopIteration if
        none)."""
        out: list = []
        for _ in range(max(1, int(self.model.steps_per_execution))):
            try:
                out.append(next(iterator))
            except StopIteration:
                if not out:
                    raise
                break
        return out

    def _sparse_test_function(self, state: Any, iterator: Any) -> tuple[Any, Any]:
        if getattr(self, "_test_step", None) is None:
            self._test_step = jax.jit(self.model.test_step)
        logs = None
        trainable, non_trainable, metrics_vars = state
        for data in self._batches(iterator):
            data, params, _ = self._ps.pull_batch(data)
            params = self._ps.merge([trainable[i] for i in self._dense_index],
                                 rows={t.var_index: params[t.var_index] for t in self.tables})
            logs, (_, non_trainable, metrics_vars) = self._test_step(
                (params, non_trainable, metrics_vars), data)
        return logs, (trainable, non_trainable, metrics_vars)

    def _sparse_predict_function(self, state: Any, iterator: Any) -> tuple[Any, Any]:
        if getattr(self, "_predict_step", None) is None:
            self._predict_step = jax.jit(self.model.predict_step)
        trainable, non_trainable = state
        outputs = []
        for data in self._batches(iterator):
            if not isinstance(data, tuple):
                data = (data,)
            data, params, _ = self._ps.pull_batch(data)
            params = self._ps.merge([trainable[i] for i in self._dense_index],
                                 rows={t.var_index: params[t.var_index] for t in self.tables})
            out, non_trainable = self._predict_step((params, non_trainable), data)
            outputs.append(out)
        out = outputs[0] if len(outputs) == 1 else jax.tree.map(
            lambda *xs: jax.numpy.concatenate(xs), *outputs)
        return out, (trainable, non_trainable)

    # ------------------------------------------------------------------ coordinator
    def _coordinator_train_function(self, state: Any, iterator: Any) -> tuple[Any, Any]:
        model = self.model
        trainable, non_trainable, opt_vars, metrics_vars = state
        n = max(1, int(model.steps_per_execution))
        for i in range(n):
            try:
                data = next(iterator)
            except StopIteration:
                if i == 0:
                    raise
                break
            data = jax.device_get(data)
            self._pending.append(self.coordinator.schedule(self._worker_step, args=(data,)))
            self.steps += 1
        metrics_vars = [np.asarray(m) for m in metrics_vars]
        non_trainable = list(non_trainable)
        limit = max(n, 2 * self.coordinator.num_workers)
        while len(self._pending) > limit:
            metrics_vars, non_trainable = self._fold(self._pending.popleft().fetch(),
                                                     metrics_vars, non_trainable)
        logs = _metric_logs(model, metrics_vars)
        return logs, (trainable, non_trainable, opt_vars, metrics_vars)

    def _fold(self, result: Any, metrics_vars: list, non_trainable: list) -> tuple[list, list]:
        deltas, new_non_trainable = result
        metrics_vars = [np.asarray(m) + d for m, d in zip(metrics_vars, deltas)]
        return metrics_vars, list(new_non_trainable) or non_trainable

    def _drain(self, state: dict | None) -> None:
        if not self._pending:
            return
        if state is None:
            state = ki.step_state(self.model) or {}
        metrics_vars = list(state.get("metrics_variables") or
                            _values(self.model.metrics_variables))
        non_trainable = list(state.get("non_trainable_variables") or
                             _values(self.model.non_trainable_variables))
        while self._pending:
            metrics_vars, non_trainable = self._fold(self._pending.popleft().fetch(),
                                                     metrics_vars, non_trainable)
        if state:
            state["metrics_variables"] = metrics_vars
            state["non_trainable_variables"] = non_trainable
        else:
            for v, x in zip(self.model.metrics_variables, metrics_vars):
                v.assign(x)
            for v, x in zip(self.model.non_trainable_variables, non_trainable):
                v.assign(x)

    def __repr__(self) -> str:
        mode = "coordinator" if self.coordinator is not None else "between-graph"
        return (f"KerasPSTraining({self.model.name!r}, {mode}, "
                f"optimizer={self.ps_optimizer.key()}, steps={self.steps})")


def _metric_logs(model: Any, metrics_vars: list) -> dict:
    with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, metrics_vars))):
        return model.get_metrics_result()


def _model_bytes(model: Any) -> bytes:
    """The compiled model in Keras's own format (``.keras``, weights included), for the
    workers: built once per worker from these bytes."""
    return ki.model_to_bytes(model)


class KerasWorkerStep:
    """One Keras training step, scheduled by a ``ClusterCoordinator`` onto a worker.

    The model travels as bytes of Keras's own format (the same bytes every time, so a worker
    unpickles the step once and keeps its jitted function); the variables and the strategy as
    references resolved on the worker.

    Args:
        model_bytes: the compiled model (``.keras`` format).
        variables: the ``PSVariables`` of the model's trainable variables.
        strategy: the coordinator's ``ParameterServerStrategy``.
        tables: ``(layer name, EmbeddingTable, input index)`` of the sparse embeddings.

    Returns (when called with a batch): ``(metric deltas, non-trainable state)`` of the step.
    """

    def __init__(self, model_bytes: bytes, variables: Any, strategy: Any,
                 tables: Sequence[tuple[str, Any, int]] = ()):
        self.model_bytes, self.variables, self.strategy = model_bytes, variables, strategy
        self.tables = list(tables)
        self._model: Any = None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items()
                if k in ("model_bytes", "variables", "strategy", "tables")} | {"_model": None}

    def _build(self, data: Any) -> None:
        model = ki.model_from_bytes(self.model_bytes)
        tables = [SparseTable(model, model.get_layer(name), table, index)
                  for name, table, index in self.tables]
        for t in tables:
            t.shrink(1)  # the table is on the ps
        self._ps = _PSState(model, self.variables, tables)
        ki.symbolic_build(model, data)
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        model.reset_metrics()
        self._model = model
        self._compute = _StepCompute(model, _compute_devices(self.strategy))
        self._metrics0 = [np.asarray(v.value) for v in model.metrics_variables]
        self._non_trainable = _values(model.non_trainable_variables)
        self._opt_vars = _values(model.optimizer.variables)

    def __call__(self, data: Any) -> tuple[list, list]:
        if self._model is None:
            self._build(data)
        data, params, looks = self._ps.pull_batch(data)
        _, grads, non_trainable, metrics_vars = self._compute(
            params, self._non_trainable, list(self._metrics0), self._opt_vars, data)
        self._ps.push(list(grads), looks)
        self._non_trainable = non_trainable
        deltas = [np.asarray(m) - m0 for m, m0 in zip(jax.device_get(metrics_vars),
                                                      self._metrics0)]
        return deltas, [np.asarray(x) for x in jax.device_get(non_trainable)]


def _embedding_layer(model: Any, name: str) -> Any:
    layer = model.get_layer(name)
    if not isinstance(layer, keras.layers.Embedding) or getattr(layer, "lora_enabled", False) \
            or getattr(layer, "quantization_mode", None):
        raise ValueError(f"sparse_embeddings: layer {name!r} is a {type(layer).__name__}, "
                         f"expected a plain keras.layers.Embedding (no LoRA, not quantized)")
    return layer


def attach(model: Any, strategy: Any, *, ps_optimizer: Any = None, name: str = COLLECTION,
           sparse_embeddings: Sequence[str] = (),
           embedding_optimizer: Any = None) -> KerasPSTraining:
    """Trains ``model`` on parameter servers: ``model.fit`` then pulls, computes and pushes.

    Call it after ``model.compile`` on every worker (between-graph) or on the coordinator
    (with a ``ClusterCoordinator`` created for ``strategy``).

    Args:
        model: a built, compiled Keras 3 model (JAX backend).
        strategy: a ``ParameterServerStrategy``.
        ps_optimizer: a ``jaxdist.ps.optimizers`` spec to apply on the ps instead of the
            translation of the Keras optimizer.
        name: the ps collection of the trainable variables (same on every worker).
        sparse_embeddings: names of ``keras.layers.Embedding`` layers whose tables live on the
            ps as row-sharded tables: a step pulls and pushes only its batch's rows
            (see ``jaxdist._src.keras.ps_embedding``).
        embedding_optimizer: the row-wise ``jaxdist.ps.optimizers`` spec of those tables
            (default: the model's, when row-wise updates equal Keras's: SGD, Adagrad).

    Returns:
        The ``KerasPSTraining`` handle.

    Raises:
        TypeError: ``strategy`` is not a ``ParameterServerStrategy``.
        ValueError: the model is not compiled/built, or its optimizer has no ps equivalent.

    Example:
        >>> import keras  # doctest: +NEEDS_KERAS
        >>> import numpy as np
        >>> import jaxdist.keras
        >>> x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: trains locally
        >>> model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        >>> training = jaxdist.keras.attach(model, strategy)
        >>> history = model.fit(x, y, epochs=2, verbose=0)
    """
    return KerasPSTraining(model, strategy, ps_optimizer, name, tuple(sparse_embeddings),
                           embedding_optimizer)


__all__ = ["COLLECTION", "KerasPSTraining", "KerasWorkerStep", "attach", "check_callbacks"]
