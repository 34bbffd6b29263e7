"""Keras models, optimizers and metrics inside ``strategy.run`` (TF's custom training loop).

TF's "Custom training with tf.distribute.Strategy" tutorial calls a Keras model, a Keras
optimizer and Keras metrics inside ``strategy.run``; the step closes over them. On JAX a
compiled step cannot assign Keras variables, so ``strategy.run`` carries their state: it finds
the Keras objects the step function reaches (its closure, the globals it names, and the functions
those name, recursively), passes their variables' values into the compiled
step, runs the step under a ``keras.StatelessScope`` that maps each variable to its value, and
assigns the values the step wrote back to the variables afterwards. Nothing to declare: the
tutorial ports with API renames plus the gradient line, which becomes
``jaxdist.keras.value_and_grad`` (JAX differentiates functions, not tapes).

Values that differ across replicas after the step are reduced by the variable's own Keras
``aggregation`` (TF's SyncOnRead): ``"sum"`` (metric state) adds each replica's change once,
``"mean"`` averages, ``"only_first_replica"`` takes replica 0's; a non-trainable variable with
``"none"`` (BatchNormalization's moving statistics) is averaged, as TF's are. A trainable or
optimizer variable that differs is an error naming it (its update used a per-replica value
that was never reduced).

Example:
    >>> import jax
    >>> import numpy as np
    >>> import keras, jaxdist.keras  # doctest: +NEEDS_KERAS
    >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    ...     optimizer = keras.optimizers.SGD(0.1)
    ...     train_accuracy = keras.metrics.SparseCategoricalAccuracy()
    >>> loss_object = keras.losses.SparseCategoricalCrossentropy(
    ...     from_logits=True, reduction="none")
    >>> def compute_loss(labels, predictions):
    ...     return jaxdist.compute_average_loss(loss_object(labels, predictions),
    ...                                         global_batch_size=8)
    >>> def train_step(inputs):
    ...     images, labels = inputs
    ...     def forward():
    ...         predictions = model(images, training=True)
    ...         return compute_loss(labels, predictions), predictions
    ...     (loss, predictions), gradients = jaxdist.keras.value_and_grad(
    ...         forward, model.trainable_variables, has_aux=True)
    ...     optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    ...     train_accuracy.update_state(labels, predictions)
    ...     return loss
    >>> batch = next(iter(strategy.experimental_distribute_dataset(
    ...     jaxdist.Dataset.from_tensor_slices(
    ...         (np.ones((8, 4), np.float32), np.zeros((8,), np.int32))).batch(8))))
    >>> per_replica_losses = strategy.run(train_step, args=(batch,))
"""

from __future__ import annotations

import contextlib
import sys
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax import lax

from jaxdist._src.strategies.fn_key import function_key

_MAX_DEPTH = 6


def _keras() -> Any:
    mod = sys.modules.get("keras")
    try:
        if mod is None or mod.backend.backend() != "jax":
            return None
    except AttributeError:  # keras is being imported right now
        return None
    return mod


def _is_keras_object(x: Any, keras: Any) -> bool:
    return isinstance(x, (keras.Layer, keras.optimizers.Optimizer, keras.metrics.Metric))


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def find_keras_objects(fn: Callable) -> list[Any]:
    """The Keras layers/models, optimizers and metrics ``fn`` can reach, in a stable order.

    Searched: ``fn``'s closure cells, the module globals its code names (nested functions
    included), and the same for every function found there (to a bounded depth).

    Example:
        >>> from jaxdist._src.keras.custom_loop import find_keras_objects
        >>> import keras  # doctest: +NEEDS_KERAS
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> optimizer = keras.optimizers.SGD(0.1)
        >>> def train_step(x):
        ...     return model(x), optimizer
        >>> objs = find_keras_objects(train_step)     # [model, optimizer]
        >>> len(objs)
        2
    """
    keras = _keras()
    if keras is None:
        return []
    found: dict[int, Any] = {}
    seen: set[int] = set()

    def visit(x: Any, depth: int) -> None:
        if id(x) in seen or depth > _MAX_DEPTH:
            return
        seen.add(id(x))
        if _is_keras_object(x, keras):
            found.setdefault(id(x), x)
            return
        if isinstance(x, types.MethodType):
            visit(x.__self__, depth + 1)
            visit(x.__func__, depth + 1)
            return
        if isinstance(x, (list, tuple)):
            for item in x:
                visit(item, depth + 1)
            return
        if isinstance(x, dict):
            for item in x.values():
                visit(item, depth + 1)
            return
        func = getattr(x, "__wrapped__", None)
        if func is not None and callable(func):
            visit(func, depth + 1)
        if not isinstance(x, types.FunctionType):
            return
        for cell in x.__closure__ or ():
            try:
                visit(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                pass
        glb = x.__globals__
        for name in sorted(_code_names(x.__code__)):
            if name in glb:
                visit(glb[name], depth + 1)

    visit(fn, 0)
    return list(found.values())


def _variables(objects: Sequence[Any], keras: Any) -> list[Any]:
    """Every variable of ``objects`` (unbuilt optimizers are built for the models' weights)."""
    models = [o for o in objects if isinstance(o, keras.Layer)]
    out: dict[int, Any] = {}
    for obj in objects:
        if isinstance(obj, keras.optimizers.Optimizer) and not obj.built:
            trainable = [v for m in models for v in m.trainable_variables]
            if trainable:
                obj.build(trainable)
        for v in obj.variables:
            out.setdefault(id(v), v)
    return list(out.values())


_FN_OBJECTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WRAPPERS: dict[Any, Callable] = {}


def run_state_hook(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``strategy.run``'s hook: ``None`` when ``fn`` reaches no Keras state, else
    ``(step, step_args, write_back)`` (see ``jaxdist.register_run_state_hook``).
    """
    keras = _keras()
    if keras is None:
        return None
    try:
        objects = _FN_OBJECTS.get(fn)
    except TypeError:
        objects = None
    if objects is None:
        objects = find_keras_objects(fn)
        try:
            _FN_OBJECTS[fn] = objects
        except TypeError:
            pass
    if not objects:
        return None
    variables = _variables(objects, keras)
    if not variables:
        return None
    key = (function_key(fn), tuple(id(v) for v in variables))
    try:
        step = _WRAPPERS.get(key)
    except TypeError:
        key, step = None, None
    if step is None:
        metrics = [o for o in objects if isinstance(o, keras.metrics.Metric)]
        step = _make_step(fn, variables, metrics)
        if key is not None:
            if len(_WRAPPERS) > 256:
                _WRAPPERS.pop(next(iter(_WRAPPERS)))
            _WRAPPERS[key] = step
    values = [v.value for v in variables]

    def write_back(new_values: list[Any]) -> None:
        for v, old, new in zip(variables, values, new_values):
            if new is not old:
                v.assign(new)

    return step, (values, tuple(args), dict(kwargs)), write_back


def _make_step(fn: Callable, variables: list[Any], metrics: list[Any]) -> Callable:
    keras = _keras()

    def step(values, args, kwargs):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))) as scope, \
                _padding_masked(metrics):
            out = fn(*args, **kwargs)
        new = []
        for v, old in zip(variables, values):
            cur = scope.get_current_value(v)
            new.append(old if cur is None else cur)
        return out, _sync_on_read(variables, values, new)

    step.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)
    step.__wrapped__ = fn
    return step


@contextlib.contextmanager
def _padding_masked(metrics: list[Any]) -> Iterator[None]:
    """On a partial-batch step, the metrics' ``update_state`` ignores the padding rows.

    jaxdist pads each replica's rows of a partial last batch to one size; a metric updated with
    per-row values would count the padding. While the step is traced, each metric's
    ``update_state`` (an attribute of that metric object only, removed afterwards) multiplies
    its ``sample_weight`` by the replica's row mask when its first argument has the padded row
    count, so totals and counts are over the real rows, as TF's are.
    """
    from jaxdist._src.strategies import context as ctx_lib
    from jaxdist._src.strategies.replica_context import padded_rows_of, row_mask_of

    frame = ctx_lib.top()
    rctx = None if frame is None else frame.replica_context
    # jaxdist's own reads of the row mask (the step's code did not ask: an unmasked loss in
    # it is still warned about, see ReplicaContext.valid_rows).
    rows = None if rctx is None else padded_rows_of(rctx)
    if rows is None or not metrics:
        yield
        return
    mask = row_mask_of(rctx, rows)

    def masked(update):
        def update_state(*args, sample_weight=None, **kwargs):
            first = args[0] if args else next(iter(kwargs.values()), None)
            shape = getattr(first, "shape", ())
            if len(shape) >= 1 and shape[0] == rows:
                weight = mask.astype("float32")
                if sample_weight is not None:
                    sw = jax.numpy.asarray(sample_weight)
                    weight = weight.reshape((rows,) + (1,) * (sw.ndim - 1)) * sw
                sample_weight = weight
            return update(*args, sample_weight=sample_weight, **kwargs)

        return update_state

    patched = []
    try:
        for m in metrics:
            if "update_state" not in vars(m):
                m.update_state = masked(m.update_state)
                patched.append(m)
        yield
    finally:
        for m in patched:
            del m.update_state


def _sync_on_read(variables: list[Any], old: list[Any], new: list[Any]) -> list[Any]:
    from jaxdist._src.strategies import context as ctx_lib
    from jaxdist._src.strategies.cross_device_ops import varying_axes

    frame = ctx_lib.top()
    rctx = None if frame is None else frame.replica_context
    axes = None if rctx is None else rctx.axis_name
    if axes is None:
        return new
    n = rctx.strategy.num_replicas_in_sync
    out = []
    for v, o, x in zip(variables, old, new):
        varies = bool(set(axes) & varying_axes(x))
        agg = str(getattr(v, "aggregation", "none") or "none").lower()
        if agg == "sum" and x is not o:
            delta = x - o
            delta = lax.psum(delta, axes) if varies else delta * n
            out.append((o + delta).astype(x.dtype))
        elif not varies:
            out.append(x)
        elif agg == "mean" or (agg == "none" and not v.trainable and "optimizer" not in v.path):
            out.append(lax.pmean(x, axes).astype(x.dtype))
        elif agg == "only_first_replica":
            out.append(lax.all_gather(x, axes, tiled=False).reshape((-1, *x.shape))[0])
        else:
            raise ValueError(
                f"Keras variable {v.path!r} (aggregation={agg!r}, trainable={v.trainable}) "
                f"differs across the replicas after the step: its update used a per-replica "
                f"value that was never reduced. Compute gradients with "
                f"jaxdist.keras.value_and_grad of a loss scaled by compute_average_loss (they "
                f"are then summed over the replicas), or reduce the value with "
                f"jaxdist.get_replica_context().all_reduce first."
            )
    return out


def value_and_grad(
    fn: Callable[[], Any], variables: Sequence[Any], has_aux: bool = False
) -> tuple[Any, list[Any]]:
    """``fn()``'s value and its gradient with respect to Keras ``variables`` (TF's tape).

    The JAX form of ``with tf.GradientTape() as tape: loss = fn()`` followed by
    ``tape.gradient(loss, variables)``: ``fn`` takes no arguments and reads the variables
    (calls the model); the gradients come back in the order of ``variables``. Updates the
    forward pass makes to other variables (BatchNormalization's moving statistics) are kept.
    Inside ``strategy.run`` the variables are replicated state, so the gradients are already
    summed over the replicas (scale the loss with ``jaxdist.compute_average_loss``, as TF's
    tutorial does); pass them to ``optimizer.apply_gradients`` as they are.

    Args:
        fn: a function of no arguments returning a scalar loss, or ``(loss, aux)`` with
            ``has_aux``.
        variables: the Keras variables to differentiate with respect to (usually
            ``model.trainable_variables``).
        has_aux: whether ``fn`` returns ``(loss, aux)``.

    Returns:
        ``(value, gradients)``: ``value`` is what ``fn`` returned.

    Example:
        >>> import numpy as np
        >>> import keras, jaxdist.keras  # doctest: +NEEDS_KERAS
        >>> x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> optimizer, loss_object = keras.optimizers.SGD(0.1), keras.losses.MeanSquaredError()
        >>> loss, grads = jaxdist.keras.value_and_grad(
        ...     lambda: loss_object(y, model(x, training=True)), model.trainable_variables)
        >>> _ = optimizer.apply_gradients(zip(grads, model.trainable_variables))
    """
    keras = _keras()
    if keras is None:
        raise RuntimeError("jaxdist.keras.value_and_grad needs Keras 3 on the JAX backend")
    from jaxdist._src.compat import keras_internals as ki

    variables = list(variables)
    outer = ki.current_stateless_scope()
    outer_values = None if outer is None else ki.scope_values(outer)

    def current(v):
        if outer is not None:
            cur = outer.get_current_value(v)
            if cur is not None:
                return cur
        return v.value

    values = [current(v) for v in variables]
    watched = {id(v) for v in variables}

    def pure(vals):
        with keras.StatelessScope() as scope:
            values_now = ki.scope_values(scope)
            if outer_values is not None:  # the step's other variables keep their traced values
                values_now.update(outer_values)
            for v, x in zip(variables, vals):
                values_now[id(v)] = x
            result = fn()
        before = {} if outer_values is None else outer_values
        updates = [
            (var_id, value)
            for var_id, value in ki.scope_values(scope).items()
            if var_id not in watched and before.get(var_id) is not value
        ]
        loss, aux = result if has_aux else (result, None)
        return loss, (aux, updates)

    (loss, (aux, updates)), grads = jax.value_and_grad(pure, has_aux=True)(values)
    if outer_values is not None:  # forward-pass updates (BatchNorm statistics) reach the outer
        for var_id, value in updates:
            outer_values[var_id] = jax.lax.stop_gradient(value)
    return ((loss, aux) if has_aux else loss), list(grads)


__all__ = ["find_keras_objects", "run_state_hook", "value_and_grad"]
