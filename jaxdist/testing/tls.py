"""One throwaway PKI per test process, for tests that start servers by hand.

``LocalCluster`` makes its own CA per cluster; tests and benchmarks that start
``python -m jaxdist.server`` or a ``ParameterServer`` themselves use this one: an identity
``"task"`` for the processes they start and ``"client"`` for themselves.

Example:
    >>> client_tls = install_process_tls()      # this process now speaks mutual TLS
    >>> env = dict(os.environ)
    >>> env.update(task_tls().env())            # for a server process it starts
"""

from __future__ import annotations

import atexit
import os
import threading

from jaxdist._src.cluster.pki import LocalPKI, local_pki
from jaxdist._src.cluster.tls import INSECURE_ENV, TLSConfig

_lock = threading.Lock()
_pki: list[LocalPKI] = []


def process_pki() -> LocalPKI:
    """The process-wide PKI (identities ``"task"`` and ``"client"``), made on first use.

    Example:
        >>> process_pki().identities["client"]
        TLSConfig(ca='.../ca.pem', cert='.../client.pem', key='.../client.key', server_name=None)
    """
    with _lock:
        if not _pki:
            _pki.append(local_pki(["task", "client"]))
            atexit.register(_pki[0].cleanup)
        return _pki[0]


def task_tls() -> TLSConfig:
    """The identity for server processes a test starts.

    Example:
        >>> env = {}
        >>> env.update(task_tls().env())
        >>> sorted(env)
        ['JAXDIST_TLS_CA', 'JAXDIST_TLS_CERT', 'JAXDIST_TLS_KEY']
    """
    return process_pki().identities["task"]


def install_process_tls() -> TLSConfig:
    """Makes this process use the ``"client"`` identity (``JAXDIST_TLS_*`` in ``os.environ``).

    Example:
        >>> tls = install_process_tls()
    """
    tls = process_pki().identities["client"]
    os.environ.pop(INSECURE_ENV, None)
    os.environ.update(tls.env())
    return tls


__all__ = ["install_process_tls", "process_pki", "task_tls"]
