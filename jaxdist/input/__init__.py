"""Distributed input: datasets, per-replica splitting, prefetch to devices."""

from jaxdist.input.dataset import Dataset
from jaxdist.input.distributed import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    DistributedIterator,
)
from jaxdist.input.options import AutoShardPolicy, InputContext, InputOptions

__all__ = [
    "AutoShardPolicy",
    "Dataset",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
]
