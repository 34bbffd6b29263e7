"""One throwaway PKI per test process, for tests that start servers by hand.

``LocalCluster`` makes its own CA per cluster; tests and benchmarks that start
``python -m jaxdist.server`` or a ``ParameterServer`` themselves use this one: an identity
``"task"`` for the processes they start and ``"client"`` for themselves. ``local_pki(names,
hosts=[...])`` issues a throwaway CA and one certificate per name (``LocalPKI``), for tests and
small clusters; use your own PKI in production.

Example:
    >>> import os
    >>> from jaxdist.testing.tls import install_process_tls, task_tls
    >>> client_tls = install_process_tls()      # this process now speaks mutual TLS
    >>> env = dict(os.environ)
    >>> env.update(task_tls().env())            # for a server process it starts
"""

from __future__ import annotations

import atexit
import os
import threading

from jaxdist._src.security import tls as _tls
from jaxdist._src.security.pki import LocalPKI, local_pki

_lock = threading.Lock()
_pki: list[LocalPKI] = []


def process_pki() -> LocalPKI:
    """The process-wide PKI (identities ``"task"`` and ``"client"``), made on first use.

    Example:
        >>> from jaxdist.testing.tls import process_pki
        >>> process_pki().identities["client"]
        TLSConfig(ca='.../ca.pem', cert='.../client.pem', key='.../client.key', server_name=None)
    """
    with _lock:
        if not _pki:
            _pki.append(local_pki(["task", "client"]))
            atexit.register(_pki[0].cleanup)
        return _pki[0]


def task_tls() -> _tls.TLSConfig:
    """The identity for server processes a test starts.

    Example:
        >>> from jaxdist.testing.tls import task_tls
        >>> env = {}
        >>> env.update(task_tls().env())
        >>> sorted(env)
        ['JAXDIST_TLS_CA', 'JAXDIST_TLS_CERT', 'JAXDIST_TLS_KEY']
    """
    return process_pki().identities["task"]


def install_process_tls() -> _tls.TLSConfig:
    """Makes this process use the ``"client"`` identity (``JAXDIST_TLS_*`` in ``os.environ``).

    Example:
        >>> from jaxdist.testing.tls import install_process_tls
        >>> tls = install_process_tls()
    """
    tls = process_pki().identities["client"]
    os.environ.pop(_tls.INSECURE_ENV, None)
    os.environ.update(tls.env())
    return tls


__all__ = ["LocalPKI", "install_process_tls", "local_pki", "process_pki", "task_tls"]
