"""``jaxdist.data``: ``tf.data``'s names for jaxdist's input pipeline (``tf.data`` ->
``jaxdist.data``).

Example:
    >>> import jaxdist
    >>> ds = jaxdist.data.Dataset.range(10).batch(4).prefetch(jaxdist.data.AUTOTUNE)
    >>> options = jaxdist.data.Options()
    >>> options.experimental_distribute.auto_shard_policy = (
    ...     jaxdist.data.experimental.AutoShardPolicy.DATA)
    >>> ds = ds.with_options(options)
"""

from types import SimpleNamespace

from jaxdist._src.input.autoshard import FileListDataset, with_auto_shard_policy
from jaxdist._src.input.dataset import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
)
from jaxdist._src.input.optional import Optional
from jaxdist._src.input.options import AutoShardPolicy, DistributeOptions, Options
from jaxdist._src.input.signature import TensorSpec

#: ``tf.data.experimental``'s names used with distribution: ``AUTOTUNE``, ``AutoShardPolicy``,
#: ``DistributeOptions``, ``INFINITE_CARDINALITY``, ``Optional``, ``UNKNOWN_CARDINALITY``.
experimental = SimpleNamespace(
    AUTOTUNE=AUTOTUNE,
    AutoShardPolicy=AutoShardPolicy,
    DistributeOptions=DistributeOptions,
    INFINITE_CARDINALITY=INFINITE_CARDINALITY,
    Optional=Optional,
    UNKNOWN_CARDINALITY=UNKNOWN_CARDINALITY,
)

__all__ = [
    "AUTOTUNE",
    "AutoShardPolicy",
    "Dataset",
    "DistributeOptions",
    "FileListDataset",
    "INFINITE_CARDINALITY",
    "Optional",
    "Options",
    "TensorSpec",
    "UNKNOWN_CARDINALITY",
    "experimental",
    "with_auto_shard_policy",
]
