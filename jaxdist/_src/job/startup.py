"""Imported first by ``jaxdist/__init__.py``: while Python starts ``python -m jaxdist.train``,
Ctrl-C is answered (one line, exit 130; ``jaxdist._src.job.interrupt``) from the first import
on; in any other process importing this does nothing.

Example:
    >>> from jaxdist._src.job import startup
    >>> startup.INSTALLED                     # a test process is not the CLI
    False
"""

from __future__ import annotations

from jaxdist._src.job.interrupt import install_for_main

#: Whether this process's SIGINT handler was installed at import.
INSTALLED: bool = install_for_main()

__all__ = ["INSTALLED"]
