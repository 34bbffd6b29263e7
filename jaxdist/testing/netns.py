"""A multi-host test cluster on one Linux machine: hosts as network namespaces on a private
bridge (``NetworkNamespaces``), and ``LocalCluster`` with one task per host
(``NetnsCluster``). Needs root and iproute2; ``unavailable_reason()`` says why not elsewhere.

Example:
    >>> from jaxdist.testing.netns import address_plan
    >>> address_plan(3)
    ['10.213.0.1', '10.213.0.2', '10.213.0.3']
    >>> with NetnsCluster(NetworkNamespaces(3), workers=3) as c:   # doctest: +SKIP
    ...     c.start(python_command("jaxdist.testing.workloads", "linreg"))
    ...     c.net.set_link(c.host_of["worker:2"], up=False)        # pull worker:2's cable
"""

from jaxdist._src.launch.netns import (
    NetnsCluster,
    NetnsUnavailable,
    NetworkNamespaces,
    address_plan,
    sweep_stale,
    unavailable_reason,
)

__all__ = ["NetnsCluster", "NetnsUnavailable", "NetworkNamespaces", "address_plan",
           "sweep_stale", "unavailable_reason"]
