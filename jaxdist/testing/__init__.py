"""``jaxdist.testing``: a multi-process cluster harness for tests and benchmarks.

Submodules: ``jaxdist.testing.tls`` (one throwaway PKI per test process),
``jaxdist.testing.netns`` (a multi-host cluster on one Linux machine: hosts as network
namespaces; root and iproute2) and ``jaxdist.testing.workloads`` (``python -m
jaxdist.testing.workloads``: small deterministic training jobs run as cluster tasks). A wait
that runs out raises ``jaxdist.ClusterTimeoutError``.

Example:
    >>> with LocalCluster(workers=2, devices_per_process=1) as c:  # doctest: +SKIP
    ...     c.start(python_command("jaxdist.testing.workloads", "linreg", "--steps", "4"))
    ...     codes = c.join(timeout=120)              # {"worker:0": 0, "worker:1": 0}
"""

from jaxdist._src.launch.harness import LocalCluster, python_command
from jaxdist._src.launch.local import pick_free_ports

__all__ = ["LocalCluster", "pick_free_ports", "python_command"]
