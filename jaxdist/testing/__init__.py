"""jaxdist.testing: a multi-process cluster harness for tests (``LocalCluster``)."""

from jaxdist.testing.cluster import LocalCluster, python_command

__all__ = ["LocalCluster", "python_command"]
