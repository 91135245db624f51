"""Eager argument checks with messages that name the argument and echo the value."""

from __future__ import annotations


def check_int(name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum``.

    Raises:
        TypeError: ``value`` is not an ``int``.
        ValueError: ``value`` is below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
    return value
