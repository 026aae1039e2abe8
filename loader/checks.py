"""Checks of users' settings, worded once: a ``ConfigError`` that names the setting and shows
the value given."""

from __future__ import annotations

from typing import Any, Literal, overload

from .errors import ConfigError


@overload
def check_int(name: str, value: Any, *, minimum: int | None = ..., maximum: int | None = ...,
              must: str | None = ..., optional: Literal[False] = ...) -> int: ...


@overload
def check_int(name: str, value: Any, *, minimum: int | None = ..., maximum: int | None = ...,
              must: str | None = ..., optional: bool) -> int | None: ...


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    must: str | None = None,
    optional: bool = False,
) -> int | None:
    """``value``, if it is an ``int`` (a ``bool`` is not) in ``[minimum, maximum]``; else a ``ConfigError``.

    ``must`` words one message for every failure: ``"{name}={value!r} must be {must}"``; without
    it, a value of another type "is not an int" and one out of bounds "must be >= minimum" (or
    "<= maximum"). ``optional``: None passes too (a setting that may be left out).
    """
    if value is None and optional:
        return None
    whole = isinstance(value, int) and not isinstance(value, bool)
    low = whole and minimum is not None and value < minimum
    if whole and not low and (maximum is None or value <= maximum):
        return value
    if must is not None:
        raise ConfigError(f"{name}={value!r} must be {must}")
    if not whole:
        raise ConfigError(f"{name}={value!r} is not an int")
    raise ConfigError(f"{name}={value!r} must be " + (f">= {minimum}" if low else f"<= {maximum}"))
