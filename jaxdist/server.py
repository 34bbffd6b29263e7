"""``python -m jaxdist.server``: a parameter-server or worker task that serves until told to stop.

The cluster comes from ``TF_CONFIG`` (the ``task`` must be of type ``ps``, or ``worker`` for
a worker that runs the functions a ``jaxdist.coordinator.ClusterCoordinator`` sends), the
token from ``TF_CONFIG["token"]`` or ``$JAXDIST_CLUSTER_TOKEN``. SIGTERM or SIGINT stop it
cleanly.

Example:
    $ python -m jaxdist.server --checkpoint_dir /tmp/ckpt
"""

import sys

from jaxdist._src.coordinator.server import Server, main

__all__ = ["Server", "main"]

if __name__ == "__main__":
    sys.exit(main())
