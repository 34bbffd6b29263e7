"""Ctrl-C in ``python -m jaxdist.train``: at any moment, one line on stderr and exit status 130.

Python turns SIGINT into a ``KeyboardInterrupt`` raised in the main thread at its next
bytecode. In a training process that goes wrong three ways: during the imports it ends in a
traceback; inside a garbage-collection callback of XLA it is printed as "Exception ignored" and
lost (training goes on); and while XLA's compiler threads still run, the unwinding and the
interpreter's shutdown that follow can end in a native crash (SIGSEGV, exit 139). So the CLI's
process answers SIGINT itself: ``install`` sets a handler and a wake-up pipe
(``signal.set_wakeup_fd``) read by a small thread, so the interrupt is acted on at once even
while the main thread waits inside native code; the one that gets there first flushes stdout,
writes ``python -m jaxdist.train: interrupted`` and ends the process with ``os._exit(130)``:
no unwinding, no interpreter shutdown. Checkpoints are written atomically, so the latest
complete one is intact.

``jaxdist/__init__.py`` calls ``install_for_main`` first thing, so a Ctrl-C during the imports
of ``python -m jaxdist.train`` is answered too. A handler installed later for SIGINT (e.g. a
parameter server's graceful stop) takes over: the thread only acts while this module's handler
is the installed one. A process that ignores SIGINT (started in the background by a shell)
keeps ignoring it.

Example:
    >>> from jaxdist._src.job.interrupt import main_module
    >>> install()                 # in the main thread of a CLI process  # doctest: +SKIP
    True
    >>> main_module(["python", "-m", "jaxdist.train", "--config", "c.yaml"])
    'jaxdist.train'
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence

#: The exit status of an interrupted process (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130
#: The modules whose ``python -m`` process this module answers SIGINT for from the start.
MAIN_MODULES = ("jaxdist.train",)

_state = {"installed": False, "message": "python -m jaxdist.train: interrupted"}
_exiting = threading.Lock()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - exiting anyway
            pass


def exit_now() -> None:
    """Writes the one line and ends the process with status 130 (once, from any thread)."""
    if not _exiting.acquire(blocking=False):
        return   # another thread is already ending the process
    flusher = threading.Thread(target=_flush, daemon=True)
    flusher.start()
    flusher.join(0.5)   # a stream held by a blocked writer must not hold up the exit
    try:
        os.write(2, (_state["message"] + "\n").encode())
    except OSError:
        pass
    os._exit(EXIT_INTERRUPTED)


def _handler(signum: int, frame: object) -> None:
    exit_now()


def _watch(fd: int) -> None:
    """Reads the signal numbers the C-level handler writes to the wake-up pipe."""
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT in data and signal.getsignal(signal.SIGINT) is _handler:
            exit_now()


def install(message: str = "python -m jaxdist.train: interrupted") -> bool:
    """Makes SIGINT end this process at once with ``message`` on stderr and status 130.

    Only in the main thread, and not when SIGINT is ignored; a second call does nothing.

    Returns:
        Whether the handler is installed.

    Example:
        >>> install()                                           # doctest: +SKIP
        True
    """
    if _state["installed"]:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return False
    _state["message"] = message
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGINT, _handler)
    try:
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # pragma: no cover - not the main thread of the main interpreter
        os.close(read)
        os.close(write)
        return True   # the handler alone still answers (when the main thread runs Python)
    threading.Thread(target=_watch, args=(read,), daemon=True,
                     name="jaxdist-sigint").start()
    _state["installed"] = True
    return True


def main_module(argv: Sequence[str] | None = None) -> str | None:
    """The module of a ``python -m MODULE`` command line (``sys.orig_argv``), else ``None``.

    Example:
        >>> from jaxdist._src.job.interrupt import main_module
        >>> main_module(["python", "-X", "dev", "-m", "jaxdist.train"])
        'jaxdist.train'
        >>> main_module(["python", "train.py", "--config", "c.yaml"]) is None
        True
    """
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    # The interpreter's options come first, and "-m MODULE" ends them.
    if "-m" not in argv[1:-1]:
        return None
    return argv[argv.index("-m", 1) + 1]


def install_for_main() -> bool:
    """``install()`` while Python is starting ``python -m jaxdist.train`` (its imports are
    running: ``sys.argv[0]`` is still ``"-m"``), so that a Ctrl-C during them is answered.

    Example:
        >>> from jaxdist._src.job.interrupt import install_for_main
        >>> install_for_main()          # in a test process: not the CLI, nothing installed
        False
    """
    if sys.argv[:1] != ["-m"] or main_module() not in MAIN_MODULES:
        return False
    return install()


__all__ = ["EXIT_INTERRUPTED", "MAIN_MODULES", "exit_now", "install", "install_for_main",
           "main_module"]
