"""The argparse ``type`` functions of ``python -m jaxdist.launch``: each takes the option's
text and returns its value, or raises ``argparse.ArgumentTypeError`` naming what it got and
what it expected (argparse prints that with the option's name and exits 2).

Example:
    >>> from jaxdist._src.launch.arg_types import non_negative_int, positive_float
    >>> non_negative_int("3"), positive_float("0.5")
    (3, 0.5)
"""

from __future__ import annotations

import argparse
import math


def _number(text: str, zero_allowed: bool, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0.0 <= value if zero_allowed else 0.0 < value) or math.isinf(value):
        raise argparse.ArgumentTypeError(
            f"expected {unit} {'>=' if zero_allowed else '>'} 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (``--cpus-per-task``, ``--lost-timeout``).

    Example:
        >>> from jaxdist._src.launch.arg_types import positive_float
        >>> positive_float("0.5")
        0.5
        >>> positive_float("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: expected a number > 0, got '0'
    """
    return _number(text, zero_allowed=False, unit="a number")


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (``--gpus-per-task``).

    Example:
        >>> from jaxdist._src.launch.arg_types import non_negative_float
        >>> non_negative_float("0")
        0.0
    """
    return _number(text, zero_allowed=True, unit="a number")


def non_negative_seconds(text: str) -> float:
    """Finite seconds >= 0 (``--restart-delay``, ``--placement-timeout``).

    Example:
        >>> from jaxdist._src.launch.arg_types import non_negative_seconds
        >>> non_negative_seconds("0.5")
        0.5
        >>> non_negative_seconds("inf")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: expected seconds >= 0, got 'inf'
    """
    return _number(text, zero_allowed=True, unit="seconds")


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (``--max-restarts``).

    Example:
        >>> from jaxdist._src.launch.arg_types import non_negative_int
        >>> non_negative_int("3")
        3
        >>> non_negative_int("-1")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: expected a whole number >= 0, got '-1'
    """
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


__all__ = ["non_negative_float", "non_negative_int", "non_negative_seconds", "positive_float"]
