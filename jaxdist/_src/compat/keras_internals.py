"""Every use of Keras internals, with the Keras versions it is written for.

jaxdist drives Keras 3 (JAX backend) through its public API where one exists. Where none does,
the private object is reached here, and only here: ``keras.src`` modules, private attributes of
Keras objects (``model._compile_metrics``, ``optimizer._learning_rate``, ...) and the methods of
Keras's ``JAXTrainer``. Each adapter names the public API that would replace it, or says none
exists. ``check_version()`` says whether the installed Keras is one these adapters were written
and tested for (``SUPPORTED``; importing this module warns otherwise);
``tests/internal/test_keras_internals.py`` checks each adapter still finds what it needs and that no
other module of jaxdist reaches a Keras internal.

**JAXTrainer hooks are scoped.** jaxdist changes what Keras's ``fit`` does for a model of a
strategy (partial batches padded and masked, steps in flight bounded, central-storage
placement, the model's strategy re-entered outside its scope, as TF does). Keras has no public
hook for these (its ``Distribution`` only places variables and batches), so the trainer's
methods are wrapped, but only while some thread is inside a jaxdist scope
(``trainer_hooks(...)``: entered by ``strategy.scope()`` once keras is imported and by a
``StrategyDistribution``'s ``scope()``; reference-counted, restored to Keras's own functions
when the last scope is left), and each wrapper calls Keras's own method unchanged on a thread
that is not inside such a scope. A model compiled inside a scope carries per-instance hooks
(``set_instance_method``) on its entry points (``fit``, ``evaluate``, ...) that enter the
hooks again for its own calls, so it keeps its strategy outside the scope, as TF models do. Why
not per model only: a model built *outside* a scope and fit inside one is distributed too (as
in TF), and Keras builds the step loop (``JAXTrainer._make_function``) and checks shardings
(``_check_sharding_consistency``) on the class; nothing on a model marks it before ``compile``.
Outside every jaxdist scope ``JAXTrainer`` holds Keras's own functions, so plain Keras models
behave exactly as without jaxdist. Each wrapper replaces a method on the class that defines it
(``compile`` on Keras's base ``Trainer``), never shadows it on a subclass: Keras's loader takes
``type(model).compile != Trainer.compile`` for a custom ``compile`` and then skips restoring
the optimizer, loss and metrics, which a shadowing wrapper would trigger inside every scope.

Example:
    >>> from jaxdist._src.compat import keras_internals
    >>> keras_internals.check_version()          # None: a supported Keras
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras

from jaxdist._src.compat.versions import outside_range

#: The Keras releases the adapters below are written for: (lowest, first unsupported).
SUPPORTED = ((3, 8, 0), (4, 0, 0))

#: Private attributes of Keras objects that only this module may read or write.
PRIVATE_ATTRIBUTES = frozenset({
    "_backend_mesh", "_call_has_training_arg", "_check_sharding_consistency", "_compile_loss",
    "_compile_metrics", "_flat_losses", "_flat_metrics", "_flat_weighted_metrics",
    "_flatten_layers", "_flatten_y", "_get_state_sharding_spec", "_inbound_nodes",
    "_jax_state", "_jax_state_synced", "_layout", "_learning_rate", "_load_model_from_fileobj",
    "_loss_tracker", "_losses_override", "_make_function", "_save_model",
    "_save_model_to_fileobj", "_shape", "_symbolic_build", "_training_metadata_path",
    "_update_metrics_variables", "_value", "_weights_path",
})


def check_version(version: str | None = None) -> str | None:
    """``None`` for a supported Keras, else a sentence saying which range is supported.

    Example:
        >>> from jaxdist._src.compat.keras_internals import check_version
        >>> check_version("3.7.0")
        'jaxdist.keras supports keras >= 3.8.0, < 4.0.0; found keras 3.7.0'
    """
    found = getattr(keras, "__version__", "0") if version is None else version
    return outside_range("jaxdist.keras", "keras", found, SUPPORTED)


def warn_if_unsupported() -> None:
    """Warns (at import of this module) when the installed Keras is outside ``SUPPORTED``."""
    message = check_version()
    if message is not None:
        warnings.warn(message + ": private Keras APIs jaxdist adapts may have moved",
                      RuntimeWarning, stacklevel=2)


warn_if_unsupported()


# ---------------------------------------------------------------------- data adapters
def data_adapter_base() -> type:
    """Keras's ``DataAdapter`` base class (what ``fit`` reads any input through).

    Public replacement: none (``keras.utils.PyDataset`` is public, but it is indexed by batch
    and cannot wrap another adapter).
    """
    from keras.src.trainers.data_adapters import data_adapter

    return data_adapter.DataAdapter


def get_data_adapter(x: Any, y: Any = None, **kwargs: Any) -> Any:
    """Keras's own adapter for ``fit``'s arguments (arrays, generators, ``PyDataset``, ...).

    Public replacement: none.
    """
    from keras.src.trainers import data_adapters

    return data_adapters.get_data_adapter(x, y, **kwargs)


def is_array_data_adapter(adapter: Any) -> bool:
    """Whether ``adapter`` is Keras's ``ArrayDataAdapter`` (in-memory arrays).

    Public replacement: none.
    """
    from keras.src.trainers import data_adapters

    return isinstance(adapter, data_adapters.ArrayDataAdapter)


def array_data_adapter(*args: Any, **kwargs: Any) -> Any:
    """Keras's ``ArrayDataAdapter(x, y, batch_size=..., shuffle=...)``.

    Public replacement: none.
    """
    from keras.src.trainers import data_adapters

    return data_adapters.ArrayDataAdapter(*args, **kwargs)


def is_tf_dataset(x: Any) -> bool:
    """Whether ``x`` is a ``tf.data.Dataset`` (without importing TensorFlow).

    Public replacement: none.
    """
    from keras.src.trainers import data_adapters

    return data_adapters.is_tf_dataset(x)


def train_validation_split(arrays: tuple, validation_split: float) -> tuple:
    """``fit``'s ``validation_split``: ``(train arrays, validation arrays)``.

    Public replacement: none.
    """
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def class_weight_to_sample_weights(y: Any, class_weight: dict) -> Any:
    """``fit``'s ``class_weight`` as the sample weights of the batch whose targets are ``y``.

    Public replacement: none.
    """
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


def numpy_batches(batches: Any) -> Iterator[Any]:
    """Keras's conversion of an iterable of batches into numpy batches.

    Public replacement: none.
    """
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.get_numpy_iterator(batches)


def jax_batches(batches: Any) -> Iterator[Any]:
    """Keras's conversion of an iterable of batches into JAX batches.

    Public replacement: none.
    """
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.get_jax_iterator(batches)


# ---------------------------------------------------------------------- saving
def model_to_bytes(model: Any) -> bytes:
    """The compiled model in Keras's ``.keras`` format, weights included, as bytes.

    Public replacement: ``model.save(path)`` (a file path only).
    """
    import io

    from keras.src.saving import saving_lib

    buf = io.BytesIO()
    saving_lib._save_model_to_fileobj(model, buf, "h5")
    return buf.getvalue()


def model_from_bytes(data: bytes) -> Any:
    """The model ``model_to_bytes`` wrote, compiled.

    Public replacement: ``keras.models.load_model(path)`` (a file path only).
    """
    import io

    from keras.src.saving import saving_lib

    return saving_lib._load_model_from_fileobj(io.BytesIO(data), custom_objects=None,
                                               compile=True, safe_mode=True)


# ---------------------------------------------------------------------- models and trainer
def symbolic_build(model: Any, data_batch: Any) -> None:
    """Builds a compiled model's layers, loss and metrics from one (symbolic) batch, as ``fit``
    does before its first step.

    Public replacement: none (``model.build(input_shape)`` builds the layers only).
    """
    model._symbolic_build(data_batch=data_batch)


def update_metrics_variables(model: Any, metrics_variables: Any, unscaled_loss: Any, x: Any,
                             y: Any, y_pred: Any, sample_weight: Any) -> tuple[Any, Any]:
    """``JAXTrainer``'s metric update of a train step: ``(logs, new metric values)``.

    Public replacement: none (``train_step`` does it inside, together with the update).
    """
    return model._update_metrics_variables(metrics_variables, unscaled_loss, x, y, y_pred,
                                           sample_weight)


def step_state(model: Any) -> dict | None:
    """The state ``fit`` holds outside the model's variables between steps, by kind
    (``"trainable_variables"``, ...), or ``None``.

    Public replacement: none (``model.jax_state_sync()`` writes it back).
    """
    return getattr(model, "_jax_state", None)


def step_state_synced(model: Any) -> bool:
    """Whether ``fit``'s step state was written back into the model's variables.

    Public replacement: none.
    """
    return bool(getattr(model, "_jax_state_synced", True))


def flatten_layers(model: Any) -> list:
    """Every layer of ``model``, nested ones included.

    Public replacement: none (``model.layers`` lists the direct children only).
    """
    return list(model._flatten_layers())


def call_has_training_arg(model: Any) -> bool:
    """Whether ``model.call`` takes a ``training`` argument.

    Public replacement: none.
    """
    return bool(model._call_has_training_arg)


@contextlib.contextmanager
def losses_override(model: Any, losses: list) -> Iterator[None]:
    """``model.losses`` reads ``losses`` inside the block (as ``compute_loss_and_updates`` sets
    the losses a stateless call returned).

    Public replacement: none.
    """
    if not losses:
        yield
        return
    model._losses_override.clear()
    model._losses_override = losses
    try:
        yield
    finally:
        model._losses_override.clear()


def loss_tracker(model: Any) -> Any:
    """The ``Mean`` metric behind the ``loss`` entry of ``fit``'s logs.

    Public replacement: none.
    """
    return model._loss_tracker


def loss_reductions(model: Any) -> list:
    """The reductions of the compiled losses (one per output).

    Public replacement: none (``model.loss`` gives the losses as passed to ``compile``, read
    when the compiled ones are not flattened yet).
    """
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None:
        return []
    flat = getattr(compile_loss, "_flat_losses", None)
    if flat:
        return [getattr(fn, "reduction", "sum_over_batch_size") for _, fn, _, _ in flat]
    return [getattr(fn, "reduction", "sum_over_batch_size")
            for fn in keras.tree.flatten(model.loss) if fn is not None]


def loss_tracker_variable_ids(model: Any) -> set[int]:
    """``id``s of the variables of the per-output loss trackers of the compiled loss.

    Public replacement: none.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    return {id(v) for m in getattr(compile_loss, "metrics", ()) for v in m.variables}


def update_compile_metrics(model: Any, y: Any, y_pred: Any, row_weight: Any,
                           metric_weight: Any) -> None:
    """Keras's ``CompileMetrics.update_state`` with explicit weights: ``metrics=`` get
    ``row_weight`` (Keras gives them none), ``weighted_metrics=`` get ``metric_weight``.

    Public replacement: none (``model.compute_metrics`` weighs ``metrics=`` by nothing).
    """
    compiled = model._compile_metrics
    if compiled is None:
        return
    if not compiled.built:
        compiled.build(y, y_pred)
    y_true = compiled._flatten_y(y)
    y_pred = compiled._flatten_y(y_pred)
    for m, y_t, y_p in zip(compiled._flat_metrics, y_true, y_pred):
        if m:
            m.update_state(y_t, y_p, row_weight)
    weights = compiled._flatten_y(metric_weight)
    if len(weights) < len(y_true):  # one weight for every output, as Keras repeats it
        weights = [weights[0] for _ in y_true]
    for m, y_t, y_p, w in zip(compiled._flat_weighted_metrics, y_true, y_pred, weights):
        if m:
            m.update_state(y_t, y_p, w)


def _jax_trainer() -> type:
    from keras.src.backend.jax.trainer import JAXTrainer

    return JAXTrainer


def overrides_trainer_method(model: Any, name: str) -> bool:
    """Whether ``type(model)`` overrides Keras's own trainer method ``name`` (``train_step``,
    ``compute_loss``, ...).

    Public replacement: none.
    """
    from keras.src.trainers import trainer as base_trainer

    for cls in type(model).__mro__:
        if name in cls.__dict__:
            return cls not in (_jax_trainer(), base_trainer.Trainer)
    return False


def step_jit() -> Callable:
    """The ``jit`` Keras's JAX trainer compiles its steps with (``jax.jit``, or flax's
    ``nnx.jit`` when Keras runs on NNX).

    Public replacement: none.
    """
    from keras.src.backend.jax import trainer

    return trainer.jit


# ---------------------------------------------------------------------- optimizers, variables
def learning_rate_of(optimizer: Any) -> Any:
    """The optimizer's learning rate as given (a float, a variable or a schedule object).

    Public replacement: none (``optimizer.learning_rate`` evaluates a schedule).
    """
    return optimizer._learning_rate


def explicit_layout(variable: Any) -> Any:
    """The layout a variable was created with (``keras.Variable(..., layout=...)``), or ``None``.

    Public replacement: none.
    """
    return getattr(variable, "_layout", None)


def replace_variable_value(variable: Any, value: Any) -> None:
    """Gives ``variable`` a value of another shape (``assign`` requires the same shape).

    Public replacement: none.
    """
    variable._shape = tuple(value.shape)
    variable._value = value


def place_variable(variable: Any, sharding: Any) -> None:
    """Moves ``variable``'s value onto ``sharding`` and makes it the variable's layout (so the
    trainer's jitted step keeps it there).

    Public replacement: none (a Keras variable takes its layout when it is created).
    """
    import jax

    variable._layout = sharding
    variable._value = jax.device_put(variable._value, sharding)


def inbound_nodes(layer: Any) -> list:
    """The nodes of the functional graph that call ``layer``.

    Public replacement: none.
    """
    return list(getattr(layer, "_inbound_nodes", []))


def set_backend_mesh(device_mesh: Any, mesh: Any) -> None:
    """Makes a ``keras.distribution.DeviceMesh`` use the ``jax.sharding.Mesh`` ``mesh`` itself
    (Keras would build its own twin with other axis types).

    Public replacement: none.
    """
    device_mesh._backend_mesh = mesh


# ---------------------------------------------------------------------- stateless scopes
def current_stateless_scope() -> Any:
    """The innermost ``keras.StatelessScope`` entered, or ``None``.

    Public replacement: none (``keras.StatelessScope`` is public; the current one is not).
    """
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


def scope_values(scope: Any) -> dict[int, Any]:
    """The values a ``keras.StatelessScope`` holds, by ``id`` of their variable (mutable).

    Public replacement: ``scope.get_current_value(variable)`` reads one value; there is none to
    list or set them.
    """
    return scope.state_mapping


# ---------------------------------------------------------------------- callbacks
def chief_only_file_callbacks(is_chief: Callable[[], bool]) -> tuple[type, type]:
    """``(ModelCheckpoint, BackupAndRestore)`` subclasses of Keras's that write files only where
    ``is_chief()`` (``BackupAndRestore`` still restores everywhere).

    Public replacement: none (Keras's callbacks take no writer predicate).
    """

    class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
        def _save_model(self, epoch: int, batch: Any, logs: dict | None) -> None:
            if is_chief():
                super()._save_model(epoch, batch, logs)

    class BackupAndRestore(keras.callbacks.BackupAndRestore):
        def _save_model(self) -> None:
            if is_chief():
                super()._save_model()

        def on_train_end(self, logs: dict | None = None) -> None:
            if is_chief():
                super().on_train_end(logs)

    return ModelCheckpoint, BackupAndRestore


def backup_paths(callback: Any) -> tuple[str, str]:
    """``(weights file, training-metadata JSON)`` of a Keras ``BackupAndRestore``.

    Public replacement: none (Keras names both files in its ``__init__`` only).
    """
    return callback._weights_path, callback._training_metadata_path


def skip_batches(model: Any, count: int) -> None:
    """The next ``count`` batches ``model.fit`` reads are consumed without training (a resumed
    epoch's batches trained before a preemption); then ``model.train_function`` is Keras's own
    again. Each skipped dispatch reports empty logs.

    Public replacement: none (Keras 3 resumes at epoch boundaries only: ``initial_epoch``).
    """
    inner = model.train_function
    per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
    remaining = [int(count)]

    def train_function(state: Any, iterator: Any) -> tuple[Any, Any]:
        if remaining[0] <= 0:
            return inner(state, iterator)
        for _ in range(min(per_call, remaining[0])):
            next(iterator)
        remaining[0] -= per_call
        if remaining[0] <= 0:
            model.train_function = inner
        return {}, state

    if count > 0:
        model.train_function = train_function


# ---------------------------------------------------------------------- per-model hooks
#: The functions ``set_instance_method`` bound as jaxdist hooks (``clear_instance_hooks``
#: removes the model attributes bound to them).
_MODEL_HOOKS: weakref.WeakSet = weakref.WeakSet()


def set_instance_method(model: Any, name: str, fn: Callable, hook: bool = True) -> None:
    """Binds ``fn`` as ``model.<name>`` on this model only (its class is untouched).

    Keras layers track attributes set on them; a method is set past that tracking.
    ``hook`` marks it as a jaxdist hook that ``clear_instance_hooks`` removes.

    Public replacement: none needed (plain Python); kept here for Keras's attribute tracking.
    """
    import types

    if hook:
        fn = _marked(fn)
    object.__setattr__(model, name, types.MethodType(fn, model))


def _marked(fn: Callable) -> Callable:
    def bound(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)

    _MODEL_HOOKS.add(bound)
    bound.__name__ = getattr(fn, "__name__", "hook")
    bound.__doc__ = getattr(fn, "__doc__", None)
    return bound


def instance_hooks(model: Any) -> list[str]:
    """Names of the jaxdist hooks ``set_instance_method`` set on ``model``."""
    return sorted(name for name, v in vars(model).items() if _is_hook(v))


def _is_hook(value: Any) -> bool:
    try:
        return getattr(value, "__func__", None) in _MODEL_HOOKS
    except TypeError:  # a bound method of something unhashable
        return False


def clear_instance_hooks(model: Any) -> None:
    """Removes the jaxdist hooks ``set_instance_method`` set on ``model`` (not others')."""
    for name in instance_hooks(model):
        object.__delattr__(model, name)


# ---------------------------------------------------------------------- JAXTrainer hooks
_LOCK = threading.RLock()
_FACTORIES: list[tuple[str, Callable[[Any], Any]]] = []
_STOCK: dict[str, Any] = {}  # name -> Keras's own function while wrapped
_OWNER: dict[str, type] = {}  # name -> the class of JAXTrainer's MRO that defines it
_COUNT = 0


class _Here(threading.local):
    depth = 0  # trainer_hooks() entered on this thread
    scopes = 0  # ... of which by a jaxdist scope


_HERE = _Here()


def register_trainer_hooks(factories: Sequence[tuple[str, Callable[[Any], Any]]]) -> None:
    """Sets the wrappers ``trainer_hooks`` installs: ``(method name, factory)`` pairs, applied
    in order (a later one wraps an earlier one of the same name); ``factory(original)``
    returns the wrapper. Idempotent; refused while the hooks are installed.

    Raises:
        RuntimeError: called with other factories while some scope has them installed.
    """
    global _FACTORIES
    with _LOCK:
        new = list(factories)
        if new == _FACTORIES:
            return
        if _COUNT:
            raise RuntimeError("JAXTrainer hooks cannot change while a jaxdist scope is entered")
        _FACTORIES = new


def _install() -> None:
    # Each wrapper replaces the method on the class that defines it (``JAXTrainer`` for most,
    # Keras's base ``Trainer`` for ``compile``), never shadows it on a subclass: Keras compares
    # ``type(model).compile`` with ``Trainer.compile`` to decide that a model's ``compile`` is
    # custom (and then skips restoring the optimizer, loss and metrics when loading), so a
    # shadowing wrapper would make every model loaded inside a scope lose its compile state.
    trainer = _jax_trainer()
    for name, factory in _FACTORIES:
        if name not in _STOCK:
            owner = next((c for c in trainer.__mro__ if name in c.__dict__), None)
            if owner is None:
                continue  # this Keras has no such method (older: no sharding check)
            _OWNER[name] = owner
            _STOCK[name] = owner.__dict__[name]
        owner = _OWNER[name]
        setattr(owner, name, factory(owner.__dict__[name]))


def _restore() -> None:
    for name, original in _STOCK.items():
        setattr(_OWNER[name], name, original)
    _STOCK.clear()
    _OWNER.clear()


@contextlib.contextmanager
def trainer_hooks(scope: bool = True) -> Iterator[None]:
    """Inside the block, Keras's ``JAXTrainer`` methods carry the registered jaxdist wrappers,
    and they act on this thread (``hooks_active_here()``); other threads get Keras's own
    behaviour from them. Reentrant and reference-counted across threads: the last block left
    puts Keras's own functions back.

    Args:
        scope: whether a jaxdist scope enters it (``False``: a model's own hook, for one call).

    Example:
        >>> with trainer_hooks():  # doctest: +SKIP
        ...     model.fit(x, y)
    """
    global _COUNT
    with _LOCK:
        if _COUNT == 0:
            _install()
        _COUNT += 1
    _HERE.depth += 1
    _HERE.scopes += int(scope)
    try:
        yield
    finally:
        _HERE.depth -= 1
        _HERE.scopes -= int(scope)
        with _LOCK:
            _COUNT -= 1
            if _COUNT == 0:
                _restore()


def hooks_active_here() -> bool:
    """Whether this thread is inside ``trainer_hooks()`` (the wrappers act)."""
    return _HERE.depth > 0


def in_jaxdist_scope_here() -> bool:
    """Whether this thread is inside a jaxdist scope's ``trainer_hooks()``."""
    return _HERE.scopes > 0


def trainer_hooks_installed() -> bool:
    """Whether ``JAXTrainer`` holds jaxdist's wrappers now (some thread is in a scope)."""
    return _COUNT > 0


def stock_trainer_method(name: str) -> Any:
    """Keras's own ``JAXTrainer.<name>`` (also while jaxdist's wrapper is installed)."""
    if name in _STOCK:
        return _STOCK[name]
    return getattr(_jax_trainer(), name)



# ---------------------------------------------------------------------- another backend
_GUARDED = ("compile", "fit", "evaluate", "predict", "train_on_batch", "test_on_batch")
_GUARD_STOCK: dict[str, tuple[type, Any]] = {}
_GUARD_COUNT = 0


class _GuardHere(threading.local):
    reasons: list[str] | None = None  # the innermost scope's refusal last


_GUARD_HERE = _GuardHere()


def _refusing(name: str, original: Callable) -> Callable:
    import functools

    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _GUARD_HERE.reasons:
            raise RuntimeError(f"model.{name}() of Keras model "
                               f"{getattr(self, 'name', self)!r}: {_GUARD_HERE.reasons[-1]}")
        return original(self, *args, **kwargs)

    return call


@contextlib.contextmanager
def refuse_training(reason: str) -> Iterator[None]:
    """Inside the block, ``compile`` / ``fit`` / ``evaluate`` / ``predict`` /
    ``train_on_batch`` / ``test_on_batch`` of every Keras model raise ``RuntimeError(reason)``
    on this thread (other threads get Keras's own methods). For a jaxdist scope entered while
    Keras runs on another backend than JAX: jaxdist cannot distribute such a model, and
    training it would silently train this process alone. Reference-counted across threads;
    each method is wrapped on the class that defines it and restored when the last block ends.

    Public replacement: none (Keras has no hook before ``compile`` or ``fit``).

    Example:
        >>> with refuse_training("Keras runs on the torch backend"):  # doctest: +SKIP
        ...     model.compile(optimizer="sgd", loss="mse")             # RuntimeError
    """
    global _GUARD_COUNT
    with _LOCK:
        if _GUARD_COUNT == 0:
            for name in _GUARDED:
                owner = next((c for c in keras.Model.__mro__ if name in c.__dict__), None)
                if owner is not None:
                    _GUARD_STOCK[name] = (owner, owner.__dict__[name])
                    setattr(owner, name, _refusing(name, owner.__dict__[name]))
        _GUARD_COUNT += 1
    if _GUARD_HERE.reasons is None:
        _GUARD_HERE.reasons = []
    _GUARD_HERE.reasons.append(reason)
    try:
        yield
    finally:
        _GUARD_HERE.reasons.pop()
        with _LOCK:
            _GUARD_COUNT -= 1
            if _GUARD_COUNT == 0:
                for name, (owner, original) in _GUARD_STOCK.items():
                    setattr(owner, name, original)
                _GUARD_STOCK.clear()


__all__ = [
    "PRIVATE_ATTRIBUTES",
    "SUPPORTED",
    "array_data_adapter",
    "backup_paths",
    "call_has_training_arg",
    "check_version",
    "chief_only_file_callbacks",
    "class_weight_to_sample_weights",
    "clear_instance_hooks",
    "current_stateless_scope",
    "data_adapter_base",
    "explicit_layout",
    "flatten_layers",
    "get_data_adapter",
    "hooks_active_here",
    "in_jaxdist_scope_here",
    "inbound_nodes",
    "instance_hooks",
    "is_array_data_adapter",
    "is_tf_dataset",
    "jax_batches",
    "learning_rate_of",
    "loss_reductions",
    "loss_tracker",
    "loss_tracker_variable_ids",
    "losses_override",
    "model_from_bytes",
    "model_to_bytes",
    "numpy_batches",
    "overrides_trainer_method",
    "refuse_training",
    "register_trainer_hooks",
    "skip_batches",
    "replace_variable_value",
    "scope_values",
    "set_backend_mesh",
    "set_instance_method",
    "step_jit",
    "step_state",
    "step_state_synced",
    "stock_trainer_method",
    "symbolic_build",
    "train_validation_split",
    "trainer_hooks",
    "trainer_hooks_installed",
    "update_compile_metrics",
    "update_metrics_variables",
    "warn_if_unsupported",
]
