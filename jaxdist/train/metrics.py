"""``jaxdist.train.metrics``: metric objects for ``Trainer(metrics=[...])`` under Keras' names
(strings such as ``"accuracy"`` work too).

Strings work as in Keras (``"accuracy"``, ``"categorical_accuracy"``, ``"binary_accuracy"``,
``"sparse_top_k_categorical_accuracy"``, ``"auc"``); these are the objects. Each replica returns
sums that are all-reduced and divided once, so a metric over 8 replicas equals the
single-device value.

Example:
    >>> from jaxdist.train.metrics import SparseTopKCategoricalAccuracy
    >>> top3 = SparseTopKCategoricalAccuracy(k=3)
    >>> trainer = jaxdist.Trainer(model, optax.adam(1e-3), global_batch_size=64,  # doctest: +SKIP
    ...                           metrics=["accuracy", top3])
"""

from jaxdist._src.train.keras_metrics import (
    AUC,
    BinaryAccuracy,
    CategoricalAccuracy,
    MeanMetricWrapper,
    Metric,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    get,
)

__all__ = [
    "AUC",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "MeanMetricWrapper",
    "Metric",
    "SparseCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
    "get",
]
