"""Metrics for ``Trainer(metrics=[...])``, with Keras' names, reduced exactly across replicas.

A metric never averages averages. Inside the replica function ``update(logits, labels, mask)``
returns *sums* over that replica's rows (correct predictions and a count, confusion counts per
threshold, ...); the trainer all-reduces them with ``SUM`` across the replicas (and so across
processes), adds them up over the steps on the host, and ``result(totals)`` divides once. A
metric over 8 replicas with a padded, partial last batch therefore equals the single-device
value.

Strings (as in Keras): ``"accuracy"`` / ``"acc"`` / ``"sparse_categorical_accuracy"`` (argmax
of the logits against integer labels; the trainer's built-in count), ``"categorical_accuracy"``
(one-hot labels), ``"binary_accuracy"`` (a logit > 0 against a 0/1 label),
``"sparse_top_k_categorical_accuracy"`` (k=5), ``"auc"`` (ROC AUC of binary scores). Objects:
``SparseTopKCategoricalAccuracy(k=3)``, ``AUC(num_thresholds=200)``, ``MeanMetricWrapper(fn)``,
or a subclass of ``Metric``; a plain function ``fn(logits, labels) -> per-example values``
is wrapped in ``MeanMetricWrapper``.

Example:
    >>> import jaxdist
    >>> from jaxdist.train.metrics import SparseTopKCategoricalAccuracy
    >>> import optax
    >>> from flax import nnx
    >>> model = nnx.Linear(4, 10, rngs=nnx.Rngs(0))
    >>> trainer = jaxdist.Trainer(model, optax.adam(1e-3), global_batch_size=64,
    ...                           metrics=["accuracy", SparseTopKCategoricalAccuracy(k=3)])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Metric:
    """A metric as sums over examples: ``update`` inside the step, ``result`` on the host.

    Subclasses set ``name`` and implement ``update`` (jax, per replica, returns a dict of sums
    that the trainer all-reduces with ``SUM``) and ``result`` (numpy totals -> a float).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist.train.metrics import Metric
        >>> class MeanLogit(Metric):
        ...     name = "mean_logit"
        ...     def update(self, logits, labels, mask):
        ...         return {"total": jnp.sum(logits.mean(-1) * mask), "count": jnp.sum(mask)}
        ...     def result(self, totals):
        ...         return float(totals["total"] / totals["count"])
    """

    name: str = "metric"

    def update(self, logits: jax.Array, labels: jax.Array, mask: jax.Array) -> dict[str, Any]:
        """Sums over this replica's rows (``mask`` is 1 for real rows, 0 for padding)."""
        raise NotImplementedError

    def result(self, totals: Mapping[str, Any]) -> float:
        """The metric's value from the sums of every replica and step."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _ratio(num: Any, den: Any) -> float:
    den = float(np.sum(den))
    return float(np.sum(num)) / den if den else float("nan")


class MeanMetricWrapper(Metric):
    """The mean over examples of ``fn(logits, labels)`` (Keras' ``MeanMetricWrapper``).

    Example:
        >>> from jaxdist.train.metrics import MeanMetricWrapper
        >>> MeanMetricWrapper(lambda logits, y: (logits.argmax(-1) == y), name="hit")
        MeanMetricWrapper(name='hit')
    """

    def __init__(self, fn: Callable[[jax.Array, jax.Array], jax.Array], name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "mean")

    def update(self, logits, labels, mask):
        values = jnp.asarray(self.fn(logits, labels), jnp.float32).reshape(mask.shape[0], -1)
        return {"total": jnp.sum(values.mean(-1) * mask), "count": jnp.sum(mask)}

    def result(self, totals):
        return _ratio(totals["total"], totals["count"])


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """Fraction of rows whose largest logit is the integer label.

    Example:
        >>> from jaxdist.train.metrics import SparseCategoricalAccuracy
        >>> SparseCategoricalAccuracy().name
        'sparse_categorical_accuracy'
    """

    def __init__(self, name: str = "sparse_categorical_accuracy"):
        super().__init__(lambda logits, y: jnp.argmax(logits, -1) == y.astype(jnp.int32), name)


class CategoricalAccuracy(MeanMetricWrapper):
    """Fraction of rows whose largest logit is at the one-hot label's 1.

    Example:
        >>> from jaxdist.train.metrics import CategoricalAccuracy
        >>> CategoricalAccuracy().name
        'categorical_accuracy'
    """

    def __init__(self, name: str = "categorical_accuracy"):
        super().__init__(lambda logits, y: jnp.argmax(logits, -1) == jnp.argmax(y, -1), name)


class BinaryAccuracy(MeanMetricWrapper):
    """Fraction of rows where ``logit > threshold`` matches ``label > 0.5`` (logits, not
    probabilities: the default threshold 0 is probability 0.5).

    Example:
        >>> from jaxdist.train.metrics import BinaryAccuracy
        >>> BinaryAccuracy().name
        'binary_accuracy'
    """

    def __init__(self, name: str = "binary_accuracy", threshold: float = 0.0):
        self.threshold = threshold

        def fn(logits, y):
            logits = logits.reshape(y.shape) if logits.size == y.size else logits
            return (logits > threshold) == (y > 0.5)

        super().__init__(fn, name)


class SparseTopKCategoricalAccuracy(Metric):
    """Fraction of rows whose integer label is among the ``k`` largest logits.

    Example:
        >>> from jaxdist.train.metrics import SparseTopKCategoricalAccuracy
        >>> SparseTopKCategoricalAccuracy(k=3).name
        'sparse_top_k_categorical_accuracy'
    """

    def __init__(self, k: int = 5, name: str = "sparse_top_k_categorical_accuracy"):
        if int(k) < 1:
            raise ValueError(f"k={k!r} is not valid; expected k >= 1")
        self.k = int(k)
        self.name = name

    def update(self, logits, labels, mask):
        k = min(self.k, logits.shape[-1])
        _, top = jax.lax.top_k(logits, k)
        hit = jnp.any(top == labels.astype(jnp.int32)[:, None], axis=-1)
        return {"total": jnp.sum(hit * mask), "count": jnp.sum(mask)}

    def result(self, totals):
        return _ratio(totals["total"], totals["count"])


class AUC(Metric):
    """ROC AUC of binary scores, the streaming approximation Keras computes.

    The score of a row is ``sigmoid(logit)`` for one output, or the softmax probability of
    class 1 for two outputs. True/false positives and negatives are counted at
    ``num_thresholds`` thresholds (Keras' ``[0 - eps, 1/(n-1), ..., 1 + eps]``) and summed
    over replicas and steps; the area is the trapezoidal sum over the ROC points (Keras'
    ``summation_method="interpolation"`` for ROC).

    Args:
        num_thresholds: thresholds in [0, 1] (> 1).
        name: the logged name.

    Example:
        >>> from jaxdist.train.metrics import AUC
        >>> AUC(num_thresholds=200).name
        'auc'
    """

    def __init__(self, num_thresholds: int = 200, name: str = "auc"):
        if int(num_thresholds) < 2:
            raise ValueError(f"num_thresholds={num_thresholds!r} is not valid; expected > 1")
        self.num_thresholds = int(num_thresholds)
        self.name = name
        eps = 1e-7
        inner = [(i + 1) / (self.num_thresholds - 1) for i in range(self.num_thresholds - 2)]
        self.thresholds = np.asarray([0.0 - eps, *inner, 1.0 + eps], np.float32)

    def scores(self, logits: jax.Array) -> jax.Array:
        """The positive-class probability of each row."""
        if logits.ndim == 1 or logits.shape[-1] == 1:
            return jax.nn.sigmoid(logits.reshape(logits.shape[0]))
        if logits.shape[-1] == 2:
            return jax.nn.softmax(logits, -1)[:, 1]
        raise ValueError(f"AUC needs binary scores: one or two outputs per row, got "
                         f"{logits.shape[-1]} (use sparse_top_k_categorical_accuracy or "
                         f"accuracy for {logits.shape[-1]} classes)")

    def update(self, logits, labels, mask):
        p = self.scores(logits).astype(jnp.float32)
        pos = (labels.reshape(p.shape[0]) > 0.5).astype(jnp.float32) * mask
        neg = (1.0 - (labels.reshape(p.shape[0]) > 0.5).astype(jnp.float32)) * mask
        above = (p[:, None] > jnp.asarray(self.thresholds)[None, :]).astype(jnp.float32)
        return {"tp": pos @ above, "fp": neg @ above,
                "fn": pos @ (1.0 - above), "tn": neg @ (1.0 - above)}

    def result(self, totals):
        tp, fp = np.asarray(totals["tp"], np.float64), np.asarray(totals["fp"], np.float64)
        fn, tn = np.asarray(totals["fn"], np.float64), np.asarray(totals["tn"], np.float64)
        tpr = np.divide(tp, tp + fn, out=np.zeros_like(tp), where=(tp + fn) > 0)
        fpr = np.divide(fp, fp + tn, out=np.zeros_like(fp), where=(fp + tn) > 0)
        return float(np.sum((fpr[:-1] - fpr[1:]) * (tpr[:-1] + tpr[1:]) / 2.0))


def metric_sums(specs: Sequence[tuple[str, Any, bool]], logits: jax.Array, y: jax.Array,
                mask: Any, w: Any = None) -> dict[str, Any]:
    """``{"metrics": {name: sums}}`` for ``(name, metric, weighted)`` specs: unweighted
    metrics count the rows where ``mask`` is 1 (``None``: all), weighted ones weight each
    row by ``w`` (times ``mask``). Used inside replica functions (jax).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.train.keras_metrics import metric_sums
        >>> from jaxdist.train.metrics import AUC
        >>> logits, labels = jnp.array([[2.0], [-1.0]]), jnp.array([[1.0], [0.0]])
        >>> sample_weight = jnp.array([1.0, 2.0])
        >>> sums = metric_sums([("auc", AUC(), False), ("weighted_auc", AUC(), True)],
        ...                    logits, labels, None, sample_weight)
        >>> sorted(sums["metrics"]), sorted(sums["metrics"]["auc"])
        (['auc', 'weighted_auc'], ['fn', 'fp', 'tn', 'tp'])
    """
    if not specs:
        return {}
    mask = jnp.ones(y.shape[:1], jnp.float32) if mask is None else mask.astype(jnp.float32)
    weighted = mask if w is None else mask * w.astype(jnp.float32)
    return {"metrics": {name: m.update(logits, y, weighted if is_weighted else mask)
                        for name, m, is_weighted in specs}}


_ACCURACY_NAMES = ("accuracy", "acc", "sparse_categorical_accuracy")
METRICS: dict[str, Callable[..., Metric]] = {
    "categorical_accuracy": CategoricalAccuracy,
    "binary_accuracy": BinaryAccuracy,
    "sparse_top_k_categorical_accuracy": SparseTopKCategoricalAccuracy,
    "auc": AUC,
}


def is_accuracy(spec: Any) -> bool:
    """Whether ``spec`` is Keras' ``"accuracy"`` (the trainer's built-in sparse accuracy)."""
    return isinstance(spec, str) and spec in _ACCURACY_NAMES


def get(spec: Any) -> Metric:
    """A ``Metric`` from a name, a ``{"name": ..., **kwargs}`` mapping, a ``Metric`` or a
    function ``fn(logits, labels) -> per-example values``.

    Raises:
        ValueError: an unknown name or bad arguments, naming the valid ones.

    Example:
        >>> from jaxdist.train.metrics import get
        >>> get({"name": "sparse_top_k_categorical_accuracy", "k": 3}).k
        3
    """
    if isinstance(spec, Metric):
        return spec
    if isinstance(spec, Mapping):
        kwargs = dict(spec)
        name = kwargs.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(f"metric {dict(spec)!r} has no 'name'; expected e.g. "
                             f"{{name: sparse_top_k_categorical_accuracy, k: 3}}")
        if is_accuracy(name) and not kwargs:
            return SparseCategoricalAccuracy()
        if name not in METRICS:
            raise ValueError(f"metric {name!r} is not known; expected one of: "
                             f"{', '.join(sorted([*_ACCURACY_NAMES, *METRICS]))}")
        try:
            return METRICS[name](**kwargs)
        except TypeError as e:
            raise ValueError(f"metric {name!r}: {e}") from None
    if isinstance(spec, str):
        if is_accuracy(spec):
            return SparseCategoricalAccuracy()
        return get({"name": spec})
    if callable(spec):
        return MeanMetricWrapper(spec)
    raise ValueError(f"metric {spec!r} is not valid; expected a name, a Metric or a function "
                     f"(logits, labels) -> per-example values")


@dataclasses.dataclass(frozen=True)
class MetricSetup:
    """The metrics a ``TrainConfig`` names, resolved once: the ``Metric`` objects and the
    names they are logged under (Keras' names, ``weighted_`` before a repeated name).

    Attributes:
        metrics: the unweighted metrics (accuracy aside).
        weighted_metrics: the ``weighted_metrics``.
        specs: ``(logged name, metric, weighted)`` of each.
        accuracy: whether the accuracy is computed (by the step itself).

    Example:
        >>> from jaxdist._src.train.keras_metrics import MetricSetup
        >>> from jaxdist.train import TrainConfig
        >>> setup = MetricSetup.from_config(TrainConfig(metrics=["accuracy", "auc"]))
        >>> setup.accuracy, [name for name, _, _ in setup.specs]
        (True, ['auc'])
    """

    metrics: tuple[Metric, ...]
    weighted_metrics: tuple[Metric, ...]
    specs: tuple[tuple[str, Metric, bool], ...]
    accuracy: bool

    @classmethod
    def from_config(cls, config: Any) -> MetricSetup:
        """The metrics of a ``TrainConfig`` (``metrics``, ``weighted_metrics``,
        ``accuracy``)."""
        metrics, weighted = config.metrics, config.weighted_metrics
        names = (["accuracy"] if config.accuracy else []) if metrics is None else list(metrics)
        accuracy = any(is_accuracy(m) for m in names)
        plain = tuple(get(m) for m in names if not is_accuracy(m))
        weighted_objs = tuple(get(m) for m in (weighted or ()))
        taken = {"loss", *(["accuracy"] if accuracy else []), *(m.name for m in plain)}
        specs = [(m.name, m, False) for m in plain]
        for spec, m in zip(weighted or (), weighted_objs):
            name = spec if is_accuracy(spec) else m.name
            name = f"weighted_{name}" if name in taken else name
            taken.add(name)
            specs.append((name, m, True))
        return cls(plain, weighted_objs, tuple(specs), accuracy)


__all__ = ["AUC", "BinaryAccuracy", "CategoricalAccuracy", "METRICS", "MeanMetricWrapper",
           "MetricSetup",
           "Metric", "SparseCategoricalAccuracy", "SparseTopKCategoricalAccuracy", "get",
           "is_accuracy", "metric_sums"]
