"""``jaxdist.train.models``: the small flax NNX models of the job configs, notebooks and docs.

Example:
    >>> from flax import nnx
    >>> from jaxdist.train.models import MLP
    >>> model = MLP(64, [128], 10, rngs=nnx.Rngs(0))
"""

from jaxdist._src.job.models import CNN, MLP

__all__ = ["CNN", "MLP"]
