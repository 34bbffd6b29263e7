"""A Keras model remembers the strategy it was compiled under, as in TF.

TF's guide builds and compiles a Keras model inside ``strategy.scope()`` and calls
``model.fit`` *outside* it; TF still distributes that ``fit``, because the model belongs to the
strategy. Two consequences on jaxdist, both wired here:

- **Synchronous strategies** (Mirrored, OneDevice, TPU, CentralStorage, MultiWorkerMirrored):
  ``fit`` / ``evaluate`` / ``predict`` called outside every strategy scope re-enter the scope the
  model was compiled in, so batches are split over the replicas as inside it.
- **ParameterServerStrategy**: a Keras model trains on the ps through
  ``jaxdist.keras.attach(model, strategy)``. A model compiled (or fit) inside the scope but not
  attached would train a local copy and leave the ps untouched, a wrong result without an
  error: its first ``fit`` raises instead (``attach`` installs its own train function on the
  model, which bypasses this check).

How: while a thread is inside a jaxdist scope (``hooks()``, entered by ``strategy.scope()``
once Keras on JAX is imported), Keras's trainer carries jaxdist's wrappers (this module's
``_factories()``, each on the class that defines the method: ``JAXTrainer``, or Keras's base
``Trainer`` for ``compile``; installed and removed by ``keras_internals.trainer_hooks``, which
says why they sit on the class). ``compile`` inside a scope records the strategy on the model
and gives the model its own entry points (``fit``, ``evaluate``, ...) that enter the hooks
again for its calls. Outside every scope ``JAXTrainer`` is Keras's own, and a model compiled
outside every scope is a plain Keras model.

Example:
    >>> import jaxdist
    >>> import numpy as np
    >>> import keras  # doctest: +NEEDS_KERAS
    >>> x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
    >>> with jaxdist.MirroredStrategy().scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(x, y, verbose=0)  # data-parallel over the replicas, as in TF
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from jaxdist._src.compat import keras_internals as ki
from jaxdist._src.keras.object_registry import ObjectRegistry

#: The strategy each Keras model was compiled under (``None``: compiled outside every scope).
_MODEL_STRATEGY = ObjectRegistry()
_ENTRY_POINTS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
                 "predict_on_batch")


def current_strategy() -> Any:
    """The strategy of the innermost scope, or ``None`` outside every scope."""
    from jaxdist._src.strategies.context import has_strategy
    from jaxdist._src.strategies.current import get_strategy

    return get_strategy() if has_strategy() else None


def _is_ps(strategy: Any) -> bool:
    from jaxdist._src.strategies.parameter_server import ParameterServerStrategy

    return isinstance(strategy, ParameterServerStrategy)


def unattached_error(model: Any, strategy: Any) -> RuntimeError:
    """The error for ``fit`` on a model of a ``ParameterServerStrategy`` that was not attached.

    Example:
        >>> import jaxdist
        >>> from jaxdist._src.keras.model_strategy import unattached_error
        >>> import keras  # doctest: +NEEDS_KERAS
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> strategy = jaxdist.ParameterServerStrategy()
        >>> raise unattached_error(model, strategy)
        Traceback (most recent call last):
        ...
        RuntimeError: Keras model '...' was compiled (or is fit) inside ...
    """
    return RuntimeError(
        f"Keras model {getattr(model, 'name', model)!r} was compiled (or is fit) inside "
        f"{type(strategy).__name__}.scope() but is not attached to the parameter servers: "
        f"model.fit would train a local copy on this process and leave the ps variables "
        f"unchanged. Call jaxdist.keras.attach(model, strategy) after model.compile (see "
        f"docs/parameter_server.md, 'Keras models'); to train locally on purpose, compile "
        f"the model outside the strategy's scope")


def strategy_of(model: Any) -> Any:
    """The strategy whose scope ``model`` was compiled in (``None``: outside every scope).

    Example:
        >>> import jax, jaxdist
        >>> from jaxdist._src.keras.model_strategy import strategy_of
        >>> import keras  # doctest: +NEEDS_KERAS
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> strategy_of(model) is strategy
        True
    """
    return _MODEL_STRATEGY.get(model)


#: Keras callbacks that write files from every process of a multi-process job (the same paths:
#: the processes overwrite each other) and the jaxdist versions that write from the chief only.
_CHIEF_ONLY = {"ModelCheckpoint": "ModelCheckpoint", "BackupAndRestore": "BackupAndRestore",
               "TensorBoard": "TensorBoard"}


def check_multi_process_callbacks(callbacks: Any) -> None:
    """Refuses Keras's own file-writing callbacks in a job of several processes.

    Keras's ``ModelCheckpoint`` / ``BackupAndRestore`` / ``TensorBoard`` know nothing about
    processes: every process would write the same files. ``jaxdist.keras`` has versions that
    write from the chief only (and restore on every process).

    Raises:
        ValueError: naming the callback and its ``jaxdist.keras`` replacement.

    Example:
        >>> from jaxdist._src.keras.model_strategy import check_multi_process_callbacks
        >>> import jaxdist.keras
        >>> check_multi_process_callbacks([jaxdist.keras.ModelCheckpoint("ckpt.keras")])
    """
    import jax
    import keras

    if jax.process_count() <= 1 or not callbacks:
        return
    from jaxdist._src.keras import callbacks as chief_only

    for cb in callbacks:
        for name, replacement in _CHIEF_ONLY.items():
            if (isinstance(cb, getattr(keras.callbacks, name))
                    and not isinstance(cb, getattr(chief_only, replacement))):
                raise ValueError(
                    f"keras.callbacks.{name} in a job of {jax.process_count()} processes: every "
                    f"process would write the same files. Use jaxdist.keras.{replacement} (same "
                    f"arguments; it writes from the chief only)")


_STEP_ATTRS = {"make_train_function": "train_function", "make_test_function": "test_function",
               "make_predict_function": "predict_function"}


#: The step functions made with a bound on the steps in flight (made once per function).
_BOUNDED_STEPS: weakref.WeakSet = weakref.WeakSet()


def _is_bounded(fn: Any) -> bool:
    try:
        return fn in _BOUNDED_STEPS
    except TypeError:  # unhashable, or no weak reference to it
        return False


def _bounded(fn: Any) -> Any:
    """``fn`` (a Keras step function) with at most 2 of its calls dispatched and unfinished.

    Keras's ``fit`` loop dispatches step after step without waiting (unless a callback reads
    the logs). With more forced CPU devices than cores, many dispatched steps that contain
    cross-device collectives make XLA's CPU rendezvous abort the process after 40 s; waiting on
    step k-2 before dispatching step k avoids it (``_src.strategies.inflight``) and keeps two
    steps in flight.
    """
    if fn is None or _is_bounded(fn):
        return fn
    from jaxdist._src.strategies.inflight import StepThrottle

    throttle = StepThrottle(2)

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        throttle.before_dispatch()
        out = fn(*args, **kwargs)
        throttle.after_dispatch(out)  # donated (deleted) outputs are skipped when waiting
        return out

    _BOUNDED_STEPS.add(step)
    return step


def _bounded_maker(maker: str, attr: str, original: Any) -> Any:
    @functools.wraps(original)
    def make(self: Any, force: bool = False) -> Any:
        if not ki.hooks_active_here():
            return original(self, force)
        strategy = strategy_of(self) or current_strategy()
        if maker == "make_train_function":
            for s in (strategy_of(self), current_strategy()):
                if s is not None and _is_ps(s):
                    raise unattached_error(self, s)
        for s in (strategy_of(self), current_strategy()):
            if s is not None and getattr(s, "compile_only", False):
                raise s.extended.compile_only_error(f"Keras {maker}")
        result = original(self, force)
        if strategy is not None:
            setattr(self, attr, _bounded(getattr(self, attr, None)))
        return result

    return make


def _reenter(name: str, original: Any) -> Any:
    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not ki.hooks_active_here():
            return original(self, *args, **kwargs)
        if name == "fit":  # fit(x, y, batch_size, epochs, verbose, callbacks, ...)
            check_multi_process_callbacks(
                kwargs.get("callbacks", args[5] if len(args) > 5 else None))
        strategy = strategy_of(self)

        def run() -> Any:
            # Under a jaxdist distribution fit / evaluate / predict read their data through a
            # padding adapter, so a partial batch is padded and masked (partial_batches).
            from jaxdist._src.keras import partial_batches

            a, k = partial_batches.adapt_call(name, original, self, args, kwargs)
            return original(self, *a, **k)

        if strategy is None or _is_ps(strategy) or current_strategy() is not None:
            return run()
        with strategy.scope():  # as TF: the model's strategy distributes it outside the scope
            return run()

    return call


def _compile(original: Any) -> Any:
    @functools.wraps(original)
    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if not ki.hooks_active_here():
            return result
        if ki.in_jaxdist_scope_here():
            _MODEL_STRATEGY.set(self, current_strategy())
            add_model_hooks(self)
            _adopt_optimizer(self)
        else:  # compiled again outside every scope (through its own hook): a plain model
            _MODEL_STRATEGY.set(self, None)
            ki.clear_instance_hooks(self)
        return result

    return compile


def _adopt_optimizer(model: Any) -> None:
    """Places the variables of an optimizer created outside the scope (TF creates an
    optimizer's slots under the model's strategy, so ``compile(optimizer)`` inside the scope
    works there too) as the scope's distribution places state. The optimizer's slots are built
    at the first step, inside the scope; only its ``iterations`` and learning rate exist yet."""
    import keras

    optimizer = getattr(model, "optimizer", None)
    distribution = keras.distribution.distribution()
    if optimizer is None or distribution is None:
        return
    for variable in optimizer.variables:
        sharding = distribution.get_variable_layout(variable)
        sharding = getattr(sharding, "backend_layout", sharding)
        devices = getattr(getattr(variable.value, "sharding", None), "device_set", None)
        if devices is not None and devices != getattr(sharding, "device_set", devices):
            ki.place_variable(variable, sharding)


def _model_hook(name: str) -> Any:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with hooks(scope=False):
            return getattr(type(self), name)(self, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"Keras's ``{name}``, with jaxdist's handling of this model's strategy."
    return call


def add_model_hooks(model: Any) -> None:
    """Gives ``model`` its own ``compile`` and entry points (``fit``, ...): each enters
    jaxdist's trainer hooks for that call, so the model keeps its strategy outside the scope.

    Example:
        >>> add_model_hooks(model)  # doctest: +SKIP
    """
    for name in ("compile", *_ENTRY_POINTS):
        ki.set_instance_method(model, name, _model_hook(name))


_FACTORIES: list = []


def _factories() -> list:
    """``(JAXTrainer method, wrapper factory)`` pairs, in the order they wrap (made once)."""
    if _FACTORIES:
        return _FACTORIES
    from jaxdist._src.keras import central_storage, partial_batches, sharding_check

    out: list = [("compile", _compile)]
    for maker in _STEP_ATTRS:  # the central-storage step inside the bounded one
        out.append((maker, functools.partial(central_storage.wrap_maker, maker)))
    for maker, attr in _STEP_ATTRS.items():
        out.append((maker, functools.partial(_bounded_maker, maker, attr)))
    for name in _ENTRY_POINTS:
        out.append((name, functools.partial(_reenter, name)))
    out.append(("_make_function", partial_batches.wrap_make_function))
    out.append(("_check_sharding_consistency", sharding_check.wrap_check))
    _FACTORIES[:] = out
    return _FACTORIES


def hooks(scope: bool = True) -> Any:
    """The context in which Keras's trainer carries jaxdist's wrappers on this thread (see the
    module docstring); ``scope``: whether a jaxdist scope enters it (not a model's own hook).

    Example:
        >>> with hooks():  # doctest: +SKIP
        ...     model.compile(optimizer="sgd", loss="mse")   # records the current strategy
    """
    ki.register_trainer_hooks(_factories())
    return ki.trainer_hooks(scope)
