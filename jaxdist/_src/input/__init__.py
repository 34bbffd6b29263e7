"""Distributed input: datasets, per-replica splitting, prefetch to devices."""

from jaxdist._src.input.dataset import Dataset
from jaxdist._src.input.distributed import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    DistributedIterator,
)
from jaxdist._src.input.options import AutoShardPolicy, InputContext, InputOptions

__all__ = [
    "AutoShardPolicy",
    "Dataset",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
]
