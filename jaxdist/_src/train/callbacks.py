"""Keras callbacks for ``Trainer.fit`` / ``evaluate`` / ``predict``: same names, same hook points.

A callback gets ``set_params(params)`` and ``set_model(trainer)`` (``self.model`` is the
``Trainer``: ``stop_training``, ``learning_rate``, ``get_weights``/``set_weights``, ``step``,
``epoch``, ``run_dir``), then ``on_train_begin/end``, ``on_epoch_begin/end(epoch, logs)``,
``on_train_batch_begin/end(batch, logs)``, ``on_test_begin/end``, ``on_test_batch_begin/end``,
``on_predict_begin/end`` and ``on_predict_batch_begin/end``. ``logs`` of ``on_epoch_end`` holds
the epoch's training metrics and ``val_``-prefixed validation metrics, as in Keras. Setting
``self.model.stop_training = True`` ends ``fit`` after the current batch.

Batch hooks run once per compiled dispatch (``steps_per_execution`` steps, as in Keras);
``batch`` is the index of the dispatch's last step in the epoch. Batch ``logs`` (the running
means of the epoch) are fetched from the devices only when a callback overrides a batch hook.

Callbacks that write files (``ModelCheckpoint``, ``BackupAndRestore``, ``CSVLogger``,
``TensorBoard``) run on the chief only (``writes_files = True``); the others run on every
process, which see the same all-reduced metrics and so decide the same.

Example:
    >>> import jaxdist
    >>> import numpy as np
    >>> from jaxdist.train.callbacks import CSVLogger, EarlyStopping, ReduceLROnPlateau
    >>> import optax
    >>> from flax import nnx
    >>> x, y = np.ones((64, 4), np.float32), np.zeros((64,), np.int32)
    >>> xv, yv = x[:32], y[:32]
    >>> trainer = jaxdist.Trainer(nnx.Linear(4, 2, rngs=nnx.Rngs(0)),
    ...                           optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
    ...                           global_batch_size=32)
    >>> history = trainer.fit((x, y), epochs=3, validation_data=(xv, yv), verbose=0, callbacks=[
    ...     EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True),
    ...     ReduceLROnPlateau(factor=0.5, patience=2),
    ...     CSVLogger("runs/log.csv")])
    >>> len(history.history["val_loss"])
    3
"""

from __future__ import annotations

import csv
import dataclasses
import inspect
import math
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from typing import Any

Logs = Mapping[str, Any]


class Callback:
    """Base class of callbacks (Keras' ``keras.callbacks.Callback``); override any hook.

    Example:
        >>> from jaxdist.train.callbacks import Callback
        >>> class PrintLoss(Callback):
        ...     def on_epoch_end(self, epoch, logs=None):
        ...         print(epoch, logs["loss"])
    """

    #: Writes files: runs on the chief only.
    writes_files: bool = False

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    @property
    def trainer(self) -> Any:
        """The ``Trainer`` (the same object as ``self.model``)."""
        return self.model

    def set_params(self, params: dict[str, Any]) -> None:
        """``{"epochs", "steps", "verbose"}`` of this ``fit``."""
        self.params = params

    def set_model(self, model: Any) -> None:
        """The ``Trainer`` running the callbacks."""
        self.model = model

    def on_train_begin(self, logs: Logs | None = None) -> None: ...
    def on_train_end(self, logs: Logs | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_begin(self, logs: Logs | None = None) -> None: ...
    def on_test_end(self, logs: Logs | None = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_begin(self, logs: Logs | None = None) -> None: ...
    def on_predict_end(self, logs: Logs | None = None) -> None: ...
    def on_predict_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...


_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end")


def _overrides(cb: Callback, name: str) -> bool:
    return getattr(type(cb), name, None) is not getattr(Callback, name)


class History(Callback):
    """What ``fit`` returns: Keras' ``History``.

    Attributes:
        history: ``{"loss": [...], "accuracy": [...], "val_loss": [...], ...}``, one entry per
            completed epoch (validation entries for the epochs that were validated).
        epoch: the epoch indices of the entries.
        params: ``{"epochs", "steps", "verbose"}`` of the ``fit``.
        records: every metrics record written during ``fit`` (JSON lines records).

    Example:
        >>> history = trainer.fit((x, y), epochs=3)   # doctest: +SKIP
        >>> history.history["loss"], history.epoch   # doctest: +SKIP
    """

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []
        self.records: list[dict[str, Any]] = []

    def add(self, prefix: str, values: Mapping[str, float]) -> None:
        """Appends ``values`` under ``prefix + name``."""
        for k, v in values.items():
            self.history.setdefault(prefix + k, []).append(float(v))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(int(epoch))
        self.add("", logs or {})


class CallbackList:
    """Calls every hook of a list of callbacks (the chief-only ones only on the chief).

    Args:
        callbacks: the callbacks, in order.
        model: the ``Trainer``.
        is_chief: whether this process writes files.
        params: passed to ``set_params``.

    Example:
        >>> from jaxdist.train.callbacks import CallbackList, EarlyStopping
        >>> cbs = CallbackList([EarlyStopping()], model=None, is_chief=True)
        >>> cbs.on_train_begin()
    """

    def __init__(self, callbacks: Iterable[Callback] = (), model: Any = None,
                 is_chief: bool = True, params: dict[str, Any] | None = None):
        self.callbacks: list[Callback] = []
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks: {cb!r} is not a jaxdist.train.Callback; "
                                f"expected e.g. EarlyStopping(...) or a Callback subclass")
            if cb.writes_files and not is_chief:
                continue
            self.callbacks.append(cb)
        for cb in self.callbacks:
            cb.set_params(dict(params or {}))
            cb.set_model(model)

    @property
    def wants_batch_logs(self) -> bool:
        """Whether a callback overrides a training batch hook (logs are then fetched)."""
        return any(_overrides(cb, h) for cb in self.callbacks for h in _BATCH_HOOKS)

    def overrides(self, *hooks: str) -> bool:
        """Whether a callback implements one of ``hooks`` (e.g. ``"on_test_batch_end"``), so
        the caller computes what it would be passed only when someone reads it.

        Example:
            >>> from jaxdist.train.callbacks import CallbackList, LambdaCallback
            >>> f = lambda batch, logs: None
            >>> CallbackList([LambdaCallback(on_test_batch_end=f)]).overrides("on_test_batch_end")
            True
        """
        return any(_overrides(cb, h) or _lambda_overrides(cb, h)
                   for cb in self.callbacks for h in hooks)

    def __getattr__(self, name: str) -> Callable[..., None]:
        if not name.startswith("on_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> None:
            for cb in self.callbacks:
                getattr(cb, name)(*args, **kwargs)

        return call


def with_callbacks(phase: str) -> Callable:
    """Decorates ``Trainer.evaluate`` (``"test"``) or ``predict`` (``"predict"``): an optional
    ``callbacks=[...]`` argument gets ``on_<phase>_begin()`` and ``on_<phase>_end(logs)``, and
    the method gets the ``CallbackList`` as ``callback_list`` (for the batch hooks).

    Example:
        >>> trainer.evaluate(  # doctest: +SKIP
        ...     (x, y), callbacks=[LambdaCallback(on_test_end=print)])
    """
    import functools

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self: Any, *args: Any, callbacks: Iterable[Callback] | None = None,
                callback_list: CallbackList | None = None, **kwargs: Any) -> Any:
            if callback_list is not None:  # fit's validation: its callbacks, begin/end there
                return method(self, *args, callback_list=callback_list, **kwargs)
            if not callbacks:
                return method(self, *args, **kwargs)
            cbs = CallbackList(callbacks, model=self, is_chief=self.should_save_summary)
            getattr(cbs, f"on_{phase}_begin")()
            out = method(self, *args, callback_list=cbs, **kwargs)
            getattr(cbs, f"on_{phase}_end")(out if isinstance(out, dict) else {"outputs": out})
            return out

        return run

    return wrap


def _monitor_op(mode: str, monitor: str, min_delta: float) -> tuple[Callable, float]:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode={mode!r} is not valid; expected 'auto', 'min' or 'max'")
    if mode == "auto":
        mode = "max" if any(w in monitor for w in ("acc", "auc", "precision", "recall")) \
            else "min"
    if mode == "min":
        return (lambda cur, best: cur < best - abs(min_delta)), math.inf
    return (lambda cur, best: cur > best + abs(min_delta)), -math.inf


def _current(logs: Logs | None, monitor: str, who: str) -> float | None:
    logs = logs or {}
    if monitor not in logs:
        import warnings

        warnings.warn(f"{who}: monitor={monitor!r} is not in the logs (available: "
                      f"{', '.join(sorted(logs)) or 'none'}); skipping", stacklevel=3)
        return None
    return float(logs[monitor])


class EarlyStopping(Callback):
    """Stops training when ``monitor`` stops improving (Keras' ``EarlyStopping``).

    Args:
        monitor: the logged value to watch, e.g. ``"val_loss"``, ``"val_accuracy"``.
        min_delta: smaller changes do not count as improvement.
        patience: epochs without improvement before stopping.
        verbose: print a line when stopping.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (max for accuracy-like names).
        baseline: stop if the value does not beat this within ``patience`` epochs.
        restore_best_weights: at the end, put back the weights of the best epoch.
        start_from_epoch: epochs to wait before watching.

    Example:
        >>> from jaxdist.train.callbacks import EarlyStopping
        >>> stop = EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True)
    """

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0,
                 verbose: int = 0, mode: str = "auto", baseline: float | None = None,
                 restore_best_weights: bool = False, start_from_epoch: int = 0):
        super().__init__()
        if int(patience) < 0:
            raise ValueError(f"patience={patience!r} is not valid; expected >= 0")
        self.monitor, self.min_delta, self.patience = monitor, float(min_delta), int(patience)
        self.verbose, self.mode, self.baseline = verbose, mode, baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = int(start_from_epoch)
        self.better, self._init = _monitor_op(mode, monitor, self.min_delta)
        self.stopped_epoch = 0

    def on_train_begin(self, logs=None):
        self.wait = 0
        self.stopped_epoch = 0
        self.best = self._init
        self.best_weights = None
        self.best_epoch = 0

    def on_epoch_end(self, epoch, logs=None):
        current = _current(logs, self.monitor, "EarlyStopping")
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = self.model.get_weights()
        self.wait += 1
        if self.better(current, self.best):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            if self.baseline is None or self.better(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0 and self.verbose:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose:
                print(f"Restoring model weights from the end of the best epoch: "
                      f"{self.best_epoch + 1}.")
            self.model.set_weights(self.best_weights)


class TerminateOnNaN(Callback):
    """Stops training when the loss becomes NaN or infinite (Keras' ``TerminateOnNaN``).

    Unlike ``Trainer(halt_on_nan=True)`` (an error), this ends ``fit`` normally.

    Example:
        >>> trainer = jaxdist.Trainer(..., halt_on_nan=False)   # doctest: +SKIP
        >>> trainer.fit(data, callbacks=[TerminateOnNaN()])    # doctest: +SKIP
    """

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            print(f"Batch {batch}: Invalid loss, terminating training")
            self.model.stop_training = True


class ReduceLROnPlateau(Callback):
    """Multiplies the learning rate by ``factor`` when ``monitor`` stops improving.

    The rate lives in the optimizer state (``optax.inject_hyperparams``; job configs build
    optimizers so), so a change recompiles nothing.

    Args:
        monitor: the logged value to watch.
        factor: the new rate is ``rate * factor`` (< 1).
        patience: epochs without improvement before reducing.
        verbose: print a line at each reduction.
        mode: ``"min"``, ``"max"`` or ``"auto"``.
        min_delta: smaller changes do not count as improvement.
        cooldown: epochs to wait after a reduction.
        min_lr: the rate never goes below this.

    Example:
        >>> from jaxdist.train.callbacks import ReduceLROnPlateau
        >>> reduce_lr = ReduceLROnPlateau(monitor="val_loss", factor=0.2, patience=5, min_lr=1e-5)
    """

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10,
                 verbose: int = 0, mode: str = "auto", min_delta: float = 1e-4,
                 cooldown: int = 0, min_lr: float = 0.0):
        super().__init__()
        if float(factor) >= 1.0:
            raise ValueError(f"factor={factor!r} is not valid; ReduceLROnPlateau does not "
                             f"support a factor >= 1.0")
        self.monitor, self.factor, self.patience = monitor, float(factor), int(patience)
        self.verbose, self.mode, self.min_delta = verbose, mode, float(min_delta)
        self.cooldown, self.min_lr = int(cooldown), float(min_lr)
        self.better, self._init = _monitor_op(mode, monitor, self.min_delta)

    def set_model(self, model):
        super().set_model(model)
        model.learning_rate  # noqa: B018 - fails now, with the fix, if it cannot change

    def on_train_begin(self, logs=None):
        self.best, self.wait, self.cooldown_counter = self._init, 0, 0

    def on_epoch_end(self, epoch, logs=None):
        current = _current(logs, self.monitor, "ReduceLROnPlateau")
        if current is None:
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self.better(current, self.best):
            self.best, self.wait = current, 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.patience:
                old = float(self.model.learning_rate)
                if old > self.min_lr:
                    new = max(old * self.factor, self.min_lr)
                    self.model.learning_rate = new
                    if self.verbose:
                        print(f"Epoch {epoch + 1}: ReduceLROnPlateau reducing learning rate "
                              f"to {new:g}.")
                    self.cooldown_counter, self.wait = self.cooldown, 0


class LambdaCallback(Callback):
    """A callback from functions (Keras' ``LambdaCallback``).

    Args:
        on_epoch_begin, on_epoch_end: ``fn(epoch, logs)``.
        on_train_batch_begin, on_train_batch_end: ``fn(batch, logs)``.
        on_train_begin, on_train_end: ``fn(logs)``.
        **kwargs: any other hook by name.

    Example:
        >>> from jaxdist.train.callbacks import LambdaCallback
        >>> cb = LambdaCallback(on_epoch_end=lambda epoch, logs: print(epoch, logs["loss"]))
    """

    def __init__(self, on_epoch_begin=None, on_epoch_end=None, on_train_begin=None,
                 on_train_end=None, on_train_batch_begin=None, on_train_batch_end=None,
                 **kwargs: Callable):
        super().__init__()
        hooks = dict(on_epoch_begin=on_epoch_begin, on_epoch_end=on_epoch_end,
                     on_train_begin=on_train_begin, on_train_end=on_train_end,
                     on_train_batch_begin=on_train_batch_begin,
                     on_train_batch_end=on_train_batch_end, **kwargs)
        for name, fn in hooks.items():
            if not name.startswith("on_") or not hasattr(Callback, name):
                raise ValueError(f"LambdaCallback: {name!r} is not a callback hook; expected "
                                 f"one of on_epoch_begin, on_epoch_end, on_train_batch_end, ...")
            if fn is not None:
                setattr(self, name, fn)

    @property
    def _overridden(self) -> set[str]:
        return {k for k in vars(self) if k.startswith("on_")}


def _lambda_overrides(cb: Callback, name: str) -> bool:
    return isinstance(cb, LambdaCallback) and name in cb._overridden


class CSVLogger(Callback):
    """Writes one CSV row per epoch: ``epoch`` and every logged value (Keras' ``CSVLogger``).

    Args:
        filename: the CSV file (its directory is created).
        separator: the column separator.
        append: append to an existing file (default: overwrite).

    Example:
        >>> from jaxdist.train.callbacks import CSVLogger
        >>> csv_logger = CSVLogger("runs/digits/training.csv")
    """

    writes_files = True

    def __init__(self, filename: str | os.PathLike, separator: str = ",", append: bool = False):
        super().__init__()
        self.filename, self.sep, self.append = os.fspath(filename), separator, append
        self.keys: list[str] | None = None
        self._file = None
        self._writer = None

    def on_train_begin(self, logs=None):
        os.makedirs(os.path.dirname(os.path.abspath(self.filename)), exist_ok=True)
        exists = self.append and os.path.isfile(self.filename) and os.path.getsize(self.filename)
        self._file = open(self.filename, "a" if self.append else "w", newline="")
        self._writer, self.keys = None, None
        self._has_header = bool(exists)

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        if self.keys is None:
            self.keys = sorted(logs)
            self._writer = csv.DictWriter(self._file, fieldnames=["epoch", *self.keys],
                                          delimiter=self.sep, extrasaction="ignore")
            if not self._has_header:
                self._writer.writeheader()
        row = {"epoch": epoch, **{k: logs.get(k, "NA") for k in self.keys}}
        self._writer.writerow(row)
        self._file.flush()

    def on_train_end(self, logs=None):
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoard(Callback):
    """Writes the epoch's metrics as TensorBoard scalars (Keras' ``TensorBoard``).

    Training values go to ``<log_dir>/train`` and validation values (without ``val_``) to
    ``<log_dir>/validation`` under the same tags (``epoch_loss``, ``epoch_accuracy``, ...), so
    TensorBoard overlays them; ``epoch_learning_rate`` too. With an integer ``update_freq``,
    ``batch_<name>`` scalars every that many batches as well. Event files are written with
    tensorboardX (no TensorFlow needed); view them with ``tensorboard --logdir <log_dir>``.

    Args:
        log_dir: the directory (default: the trainer's run directory, else ``"logs"``).
        update_freq: ``"epoch"`` or a number of batches.

    Example:
        >>> from jaxdist.train.callbacks import TensorBoard
        >>> tensorboard = TensorBoard(log_dir="runs/keras_style", update_freq=10)
    """

    writes_files = True

    def __init__(self, log_dir: str | os.PathLike | None = None,
                 update_freq: str | int = "epoch"):
        super().__init__()
        if update_freq != "epoch" and not (isinstance(update_freq, int) and update_freq > 0):
            raise ValueError(f"update_freq={update_freq!r} is not valid; expected 'epoch' or a "
                             f"positive number of batches")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.update_freq = update_freq
        self._writers: dict[str, Any] = {}
        self._batches = 0

    def _writer(self, phase: str) -> Any:
        if phase not in self._writers:
            from tensorboardX import SummaryWriter

            base = self.log_dir or getattr(self.model, "run_dir", None) or "logs"
            self._writers[phase] = SummaryWriter(logdir=os.path.join(base, phase))
        return self._writers[phase]

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq == "epoch":
            return
        self._batches += 1
        if self._batches % self.update_freq == 0:
            step = int(getattr(self.model, "step", self._batches))
            for k, v in (logs or {}).items():
                if isinstance(v, (int, float)):
                    self._writer("train").add_scalar(f"batch_{k}", float(v), step)

    def on_epoch_end(self, epoch, logs=None):
        lr = getattr(self.model, "current_learning_rate", lambda: None)()
        values = dict(logs or {})
        if lr is not None:
            values.setdefault("learning_rate", lr)
        for k, v in values.items():
            if not isinstance(v, (int, float)):
                continue
            phase, tag = ("validation", k[4:]) if k.startswith("val_") else ("train", k)
            self._writer(phase).add_scalar(f"epoch_{tag}", float(v), epoch)
        for w in self._writers.values():
            w.flush()

    def on_train_end(self, logs=None):
        for w in self._writers.values():
            w.close()
        self._writers.clear()

    # The overlay needs only the epoch values; the batch hook is used with update_freq.
    @property
    def wants_batches(self) -> bool:
        return self.update_freq != "epoch"


class ModelCheckpoint(Callback):
    """Saves the model (orbax) every epoch or every ``save_freq`` steps (Keras' name).

    ``filepath`` may hold ``{epoch}`` (1-based, as Keras) and logged values
    (``"ckpt/e{epoch:02d}-{val_loss:.3f}"``); each formatted path is an orbax checkpoint
    directory (``jaxdist.train.Checkpointer``, restorable with ``Trainer.load_weights``).

    Args:
        filepath: where to save (a template).
        monitor: the logged value that decides the best model.
        verbose: print a line at each save.
        save_best_only: save only when ``monitor`` improved (the latest best overwrites the
            previous one when ``filepath`` has no template).
        save_weights_only: save only the model's variables (``params`` and ``rest``); else
            the whole training state (optimizer included) and its position.
        mode: ``"min"``, ``"max"`` or ``"auto"``.
        save_freq: ``"epoch"`` or a number of steps.
        initial_value_threshold: only a value better than this is saved.

    Example:
        >>> from jaxdist.train.callbacks import ModelCheckpoint
        >>> checkpoint = ModelCheckpoint("runs/best", monitor="val_accuracy", save_best_only=True)
    """

    writes_files = True

    def __init__(self, filepath: str | os.PathLike, monitor: str = "val_loss", verbose: int = 0,
                 save_best_only: bool = False, save_weights_only: bool = False,
                 mode: str = "auto", save_freq: str | int = "epoch",
                 initial_value_threshold: float | None = None):
        super().__init__()
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(f"save_freq={save_freq!r} is not valid; expected 'epoch' or a "
                             f"positive number of steps")
        self.filepath, self.monitor, self.verbose = os.fspath(filepath), monitor, verbose
        self.save_best_only, self.save_weights_only = save_best_only, save_weights_only
        self.save_freq = save_freq
        self.better, init = _monitor_op(mode, monitor, 0.0)
        self.best = init if initial_value_threshold is None else float(initial_value_threshold)
        self._last_step = 0
        self.saved: list[str] = []

    def _save(self, epoch: int, logs: Logs | None) -> None:
        logs = dict(logs or {})
        if self.save_best_only:
            current = _current(logs, self.monitor, "ModelCheckpoint")
            if current is None or not self.better(current, self.best):
                return
            self.best = current
        try:
            path = self.filepath.format(epoch=epoch + 1, **logs)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"ModelCheckpoint: filepath {self.filepath!r} names {e}, which is "
                             f"not in the logs (available: epoch, {', '.join(sorted(logs))})"
                             ) from None
        self.model.save_checkpoint_to(path, weights_only=self.save_weights_only)
        self.saved.append(os.path.abspath(path))
        if self.verbose:
            print(f"Epoch {epoch + 1}: saved the model to {path}")

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch":
            return
        step = int(self.model.step)
        if step // self.save_freq > self._last_step // self.save_freq:
            self._save(int(self.model.epoch), logs)
        self._last_step = step

    def on_train_begin(self, logs=None):
        self._last_step = int(self.model.step)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch, logs)


class BackupAndRestore(Callback):
    """Backs the training state up in ``backup_dir`` and resumes from it (Keras' name).

    This is what ``Trainer(checkpoint_dir=...)`` and a config's ``checkpoint.dir`` do: at the
    start of ``fit`` the model, optimizer, step and data position are restored from the latest
    backup; during training a backup is written every ``save_freq`` steps (or at each epoch end)
    and at the end. Writes happen on the chief only; every process restores.

    Args:
        backup_dir: the directory of the backups.
        save_freq: ``"epoch"`` or a number of steps.
        delete_checkpoint: delete the backups when ``fit`` ends normally (Keras' default).
            ``Trainer(checkpoint_dir=...)`` keeps them.

    Example:
        >>> trainer.fit(data, epochs=10, callbacks=[BackupAndRestore("backup")])  # doctest: +SKIP
    """

    def __init__(self, backup_dir: str | os.PathLike, save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True):
        super().__init__()
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(f"save_freq={save_freq!r} is not valid; expected 'epoch' or a "
                             f"positive number of steps")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq, self.delete_checkpoint = save_freq, delete_checkpoint

    def checkpoint_config(self, config: Any) -> Any:
        """The trainer's ``CheckpointConfig`` pointed at ``backup_dir``: a new one
        (``dataclasses.replace``), which ``fit`` hands to ``Trainer.replace_checkpoint_config``
        before it resumes; the callback assigns nothing of the trainer.

        Raises:
            ValueError: ``config`` already names another checkpoint directory.

        Example:
            >>> from jaxdist.train import CheckpointConfig
            >>> from jaxdist.train.callbacks import BackupAndRestore
            >>> new = BackupAndRestore("backup", save_freq=10).checkpoint_config(
            ...     CheckpointConfig())
            >>> new.dir, new.every_steps, new.resume
            ('backup', 10, True)
        """
        if config.dir is not None and os.path.abspath(config.dir) != \
                os.path.abspath(self.backup_dir):
            raise ValueError(f"BackupAndRestore({self.backup_dir!r}) and the trainer's "
                             f"checkpoint_dir={config.dir!r} disagree; use one of them")
        # Steps: the trainer saves every save_freq steps; "epoch": at each epoch end (below).
        every = self.save_freq if self.save_freq != "epoch" else 2 ** 62
        return dataclasses.replace(config, dir=self.backup_dir, resume=True, every_steps=every)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch" and self.model.last_checkpoint != self.model.step:
            self.model.save_checkpoint()

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and not self.model.stop_training_by_error:
            if self.model.should_checkpoint and os.path.isdir(self.backup_dir):
                self.model.close_checkpointer()
                shutil.rmtree(self.backup_dir, ignore_errors=True)


class ProgbarLogger(Callback):
    """Accepted for Keras code; the trainer's own progress output (``verbose``) does this.

    Example:
        >>> trainer.fit(data, callbacks=[ProgbarLogger()])  # as without it  # doctest: +SKIP
    """


CALLBACKS: dict[str, type[Callback]] = {
    c.__name__: c for c in (EarlyStopping, ModelCheckpoint, BackupAndRestore,
                            ReduceLROnPlateau, TerminateOnNaN, CSVLogger, TensorBoard,
                            ProgbarLogger)
}


def from_config(entries: Iterable[Mapping[str, Any]], where: str = "callbacks",
                resolve_path: Callable[[str], str] | None = None) -> list[Callback]:
    """Builds callbacks from config entries ``{"name": "EarlyStopping", **kwargs}``.

    Args:
        entries: the config's ``callbacks`` list.
        where: the config key, for error messages.
        resolve_path: maps a relative ``filename``/``filepath``/``log_dir``/``backup_dir``
            (e.g. into the run directory).

    Raises:
        ValueError: one line naming the entry, the bad key or value and what is valid.

    Example:
        >>> from jaxdist._src.train.callbacks import from_config
        >>> from_config([{"name": "EarlyStopping", "monitor": "val_loss", "patience": 2}])
        [<jaxdist._src.train.callbacks.EarlyStopping object at ...>]
    """
    out = []
    for i, entry in enumerate(entries or ()):
        at = f"{where}[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise ValueError(f"{at}: {entry!r} is not valid; expected a mapping with a class "
                             f"name, e.g. {{name: EarlyStopping, patience: 3}}")
        kwargs = dict(entry)
        name = kwargs.pop("name")
        if name == "LambdaCallback":
            raise ValueError(f"{at}.name: LambdaCallback takes Python functions and cannot be "
                             f"named in a config; pass it to Trainer.fit(callbacks=[...])")
        if name not in CALLBACKS:
            raise ValueError(f"{at}.name: {name!r} is not a known callback; expected one of: "
                             f"{', '.join(sorted(CALLBACKS))}")
        cls = CALLBACKS[name]
        params = inspect.signature(cls).parameters
        for key in kwargs:
            if key not in params:
                raise ValueError(f"{at}.{key}: unknown argument of {name}; valid: "
                                 f"{', '.join(params)}")
        if resolve_path is not None:
            for key in ("filename", "filepath", "log_dir", "backup_dir"):
                if isinstance(kwargs.get(key), str):
                    kwargs[key] = resolve_path(kwargs[key])
        try:
            out.append(cls(**kwargs))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{at} ({name}): {e}") from None
    return out


def needs_batch_logs(callbacks: Iterable[Callback]) -> bool:
    """Whether any callback uses the training batch hooks' ``logs``.

    Example:
        >>> from jaxdist._src.train.callbacks import needs_batch_logs
        >>> from jaxdist.train.callbacks import TerminateOnNaN
        >>> needs_batch_logs([TerminateOnNaN()])
        True
    """
    for cb in callbacks:
        if isinstance(cb, TensorBoard):
            if cb.wants_batches:
                return True
            continue
        if isinstance(cb, ModelCheckpoint) and cb.save_freq == "epoch":
            continue
        if any(_overrides(cb, h) or _lambda_overrides(cb, h) for h in _BATCH_HOOKS):
            return True
    return False


__all__ = ["CALLBACKS", "BackupAndRestore", "CSVLogger", "Callback", "CallbackList",
           "EarlyStopping", "History", "LambdaCallback", "ModelCheckpoint", "ProgbarLogger",
           "ReduceLROnPlateau", "TensorBoard", "TerminateOnNaN", "from_config",
           "needs_batch_logs"]
