"""The progress bars of a long command (``shard``, ``index``): shown on a terminal unless
``--progress``/``--no-progress`` says otherwise, bytes with a running count beside them."""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Any


def bar_disabled(wanted: bool | None, stream: IO[str]) -> bool:
    """``--progress``/``--no-progress`` as given, else a bar only where ``stream`` is a terminal."""
    if wanted is None:
        return not (hasattr(stream, "isatty") and stream.isatty())
    return not wanted


class Bars:
    """The bars one command opened, closed together (also when Ctrl-C ends the command)."""

    def __init__(self, wanted: bool | None, stream: IO[str]) -> None:
        self.stream = stream
        self.disabled = bar_disabled(wanted, stream)
        self._bars: list[Any] = []

    def counting(self, desc: str, total_bytes: int, total: int, noun: str) -> Callable[[int, int], None]:
        """A bar of ``total_bytes``; its hook ``(nbytes, count)`` advances it and shows
        ``done/total noun`` beside it."""
        from tqdm import tqdm  # imported only when a command runs: `loader --help` stays quick

        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                   file=self.stream, dynamic_ncols=True, disable=self.disabled)
        self._bars.append(bar)
        done = 0

        def hook(nbytes: int, count: int) -> None:
            nonlocal done
            done += count
            bar.set_postfix_str(f"{done:,}/{total:,} {noun}", refresh=False)
            bar.update(nbytes)

        return hook

    def close(self) -> None:
        for bar in self._bars:
            bar.close()
