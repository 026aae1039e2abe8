"""Key ranges for listing one prefix in parallel: where to split one.

``KeySpace`` guesses split points from the keys seen: a bad guess costs a short page, never a
key. Where a range ends, and which split points a server's order allows, is the server's
capability (``s3.listing_order``); why this is exact: docs/design/listing.md.
"""
from __future__ import annotations

import bisect
import os

DEPTH = 64  # characters after the prefix that positions resolve


def plain(key: str) -> bool:
    """Whether ``key`` is usable as a ``StartAfter`` bound by every backend: no control
    characters, no empty, ``.`` or ``..`` path segment (object_store refuses those)."""
    if not key or any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        return False
    return all(part not in ("", ".", "..") for part in key.split("/"))


class KeySpace:
    """Keys that start with a common ``prefix``, read as numbers in base ``len(alphabet) + 1``
    (digit 0: the key has ended), ``DEPTH`` digits after the prefix.

    Positions only guide where to split; a character outside the alphabet counts as the
    nearest one below it.
    """

    def __init__(self, prefix: str, alphabet: str, folder_ends: frozenset[int] = frozenset()) -> None:
        self.prefix = prefix
        self.folder_ends = folder_ends  # lengths at which keys seen so far have a "/"
        self.chars = sorted(set(alphabet))
        self.base = len(self.chars) + 1
        self.end = self.base ** DEPTH  # the position of "after every key"

    @classmethod
    def of(cls, keys: list[str], prefix: str | None = None) -> KeySpace:
        """The space of ``keys`` below ``prefix`` (default: their common prefix), in the
        alphabet of the keys, with the folder ends that they show."""
        if prefix is None:
            prefix = os.path.commonprefix(keys) if keys else ""
        rests = [key[len(prefix):] for key in keys]
        ends = frozenset(len(prefix) + i for rest in set(rests) for i, c in enumerate(rest) if c == "/")
        return cls(prefix, "".join(rests), ends)

    def position(self, key: str | None) -> int:
        """``key``'s position in ``[0, end]``; ``None`` is the end."""
        if key is None:
            return self.end
        if not key.startswith(self.prefix):
            return 0 if key < self.prefix else self.end
        value = 0
        rest = key[len(self.prefix):len(self.prefix) + DEPTH]
        for char in rest:
            value = value * self.base + bisect.bisect_right(self.chars, char)
        return value * self.base ** (DEPTH - len(rest))

    def key_at(self, position: int) -> str:
        """A key at ``position`` made of the alphabet (the inverse of ``position``, up to the
        characters that ``position`` rounds down)."""
        digits = []
        for _ in range(DEPTH):
            position, digit = divmod(position, self.base)
            digits.append(digit)
        while digits and digits[0] == 0:  # trailing zeros: the key ended there
            digits.pop(0)
        return self.prefix + "".join(self.chars[max(d, 1) - 1] for d in reversed(digits))

    def between(self, lo: str, hi: str | None, fraction: float = 0.5, ahead: int | None = None
                ) -> str | None:
        """A plain key strictly between ``lo`` and ``hi`` (``None``: no upper bound): at
        ``fraction`` of the way, or ``ahead`` positions after ``lo`` when that is nearer.
        None when the space has no such key to offer."""
        start, stop = self.position(lo), self.position(hi)
        if stop <= start:
            return None
        step = int((stop - start) * fraction)
        if ahead is not None:
            step = min(step, ahead)
        for careful in (True, False):
            for offset in (step, (stop - start) // 2, stop - start - 1):
                if offset >= 1:
                    bound = self._shortest(self.key_at(start + offset), lo, hi, careful)
                    if bound is not None:
                        return bound
        return None

    def _shortest(self, key: str, lo: str, hi: str | None, careful: bool) -> str | None:
        """The shortest plain prefix of ``key`` strictly between ``lo`` and ``hi``, not cut
        where ``key`` has a ``/`` nor, when ``careful``, where the keys seen have one."""
        for end in range(len(self.prefix) + 1, len(key) + 1):
            bound = key[:end]
            if key[end:end + 1] == "/" or (careful and end in self.folder_ends):
                continue  # likely a folder's name: SeaweedFS would skip the folder after it
            if lo < bound and (hi is None or bound < hi) and plain(bound):
                return bound
        return None
