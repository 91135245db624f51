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


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``.

    Raises:
        TypeError: ``value`` is not a ``bool``.
    """
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r} ({type(value).__name__}).")
    return value


def check_input_key(value: object) -> int | str:
    """Return ``value`` if it can select a batch's input: an ``int`` index or a ``str`` key.

    Raises:
        TypeError: ``value`` is neither.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"`input_key` must be an int index or a str key, got {value!r} "
            f"({type(value).__name__})."
        )
    return value
