"""Sizes as people write them on a command line (``256MB``, ``1GiB``) and as tables print them."""

from __future__ import annotations

import math
import re

from ..errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
    "ti": 2**40, "tib": 2**40,
}


def parse_size(text: str) -> int:
    """Bytes from ``"256MB"``, ``"1GiB"``, ``"500k"``, ``"1.5G"`` or ``"4096"``.

    Decimal units (k, KB, M, MB, G, GB, T, TB) are powers of 1000, binary ones (KiB, MiB, GiB,
    TiB, or Ki, Mi, ...) powers of 1024; case does not matter. The result must be at least 1.
    """
    match = _SIZE_RE.match(text) if isinstance(text, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{text!r} is not a size; write a number with an optional unit, "
            "e.g. 256MB, 1GiB, 500k or 1048576 (bytes)"
        )
    number, unit = match.groups()
    value = math.floor(float(number) * _UNITS[unit.lower()])
    if value < 1:
        raise ConfigError(f"{text!r} is less than one byte; give a positive size such as 256MB")
    return value


def format_size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, three significant digits."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
