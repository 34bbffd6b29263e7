"""The supported-version check both adapters (``jax_internals``, ``keras_internals``) use."""

from __future__ import annotations


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.10.2rc1"`` -> ``(0, 10, 2)``: the first three numeric parts.

    Example:
        >>> from jaxdist._src.compat.versions import version_tuple
        >>> version_tuple("3.15.1.dev0")
        (3, 15, 1)
    """
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def outside_range(who: str, package: str, found: str,
                  supported: tuple[tuple[int, ...], tuple[int, ...]]) -> str | None:
    """``None`` when ``low <= found < high``, else the sentence saying which range ``who`` supports.

    Example:
        >>> from jaxdist._src.compat.versions import outside_range
        >>> outside_range("jaxdist", "jax", "0.9.0", ((0, 10, 2), (0, 11, 0)))
        'jaxdist supports jax >= 0.10.2, < 0.11.0; found jax 0.9.0'
    """
    low, high = supported
    if low <= version_tuple(found) < high:
        return None
    fmt = ".".join
    return (f"{who} supports {package} >= {fmt(map(str, low))}, < {fmt(map(str, high))}; "
            f"found {package} {found}")
