"""The public modules' one helper: the public name of each class they re-export."""


def publish(module_name: str, *classes: type) -> None:
    """Gives ``classes`` the public module users import them from as their ``__module__``.

    Tracebacks, ``repr`` and pickles then name ``jaxdist.PeerLostError`` rather than the
    private module that defines it.

    Example:
        >>> from jaxdist._src.publish import publish
        >>> class PeerLostError(Exception): ...
        >>> publish("jaxdist", PeerLostError)
        >>> PeerLostError.__module__
        'jaxdist'
    """
    for cls in classes:
        cls.__module__ = module_name
