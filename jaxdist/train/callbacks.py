"""``jaxdist.train.callbacks``: Keras' callbacks for ``Trainer.fit`` / ``evaluate`` / ``predict``,
same names and hook points.

Same names and hook points as ``keras.callbacks``; ``self.model`` of a callback is the
``Trainer``. Callbacks that write files run on the chief only.

Example:
    >>> from jaxdist.train import callbacks as cb
    >>> stop = cb.EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True)
    >>> history = trainer.fit((x, y), epochs=50, validation_data=(xv, yv),  # doctest: +SKIP
    ...                       callbacks=[stop, cb.CSVLogger("runs/log.csv")])
"""

from jaxdist._src.train.callbacks import (
    BackupAndRestore,
    Callback,
    CallbackList,
    CSVLogger,
    EarlyStopping,
    History,
    LambdaCallback,
    ModelCheckpoint,
    ProgbarLogger,
    ReduceLROnPlateau,
    TensorBoard,
    TerminateOnNaN,
)

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "ModelCheckpoint",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
]
