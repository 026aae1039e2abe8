"""CPU of ``loader.s3.http1``'s answer parsing against an earlier revision's:
``python -m bench.http1_parse --against REV``.

Feeds a typical S3 answer (SeaweedFS's headers, a 110 KB body in two reads, as one GET sees it)
to a connection with no socket, over and over, alternating the two parsers round by round, and
prints the median CPU per answer. Only parsing and the body's hand-over are measured (no
signing, no socket), which is what changes when the parser's checks do.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

HEAD = (b"HTTP/1.1 200 OK\r\nAccept-Ranges: bytes\r\nContent-Length: 110000\r\n"
        b"Content-Type: application/octet-stream\r\nEtag: \"7b9c1f1c1d0e6a2f4d2f1d2c3b4a5968\"\r\n"
        b"Last-Modified: Sat, 28 Nov 2026 10:00:00 GMT\r\nServer: SeaweedFS 4.48\r\n"
        b"X-Amz-Request-Id: 1234567890abcdef\r\nDate: Sat, 28 Nov 2026 10:00:00 GMT\r\n\r\n")
BODY = b"x" * 110_000


class _Transport:
    def write(self, data: bytes) -> None: ...
    def abort(self) -> None: ...
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


def _load(revision: str, directory: str) -> ModuleType:
    source = subprocess.run(["git", "show", f"{revision}:loader/s3/http1.py"], check=True,
                            capture_output=True).stdout
    path = Path(directory) / "http1_then.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("http1_then", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _per_answer(module: ModuleType, answers: int) -> float:
    connection = module._Connection(module._Watchdog(5))
    connection.connection_made(_Transport())
    first, rest = HEAD + BODY[:65_000], BODY[65_000:]
    cpu = time.process_time()
    for _ in range(answers):
        connection.send(b"GET / HTTP/1.1\r\n\r\n")
        connection.data_received(first)
        connection.data_received(rest)
        assert len(await connection.read_all()) == len(BODY)
    return (time.process_time() - cpu) / answers * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD~1", help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--answers", type=int, default=20_000)
    args = parser.parse_args()
    from loader.s3 import http1

    with tempfile.TemporaryDirectory() as directory:
        then = _load(args.against, directory)
        times: dict[str, list[float]] = {args.against: [], "this tree": []}
        for round_ in range(args.rounds):
            pair = [(args.against, then), ("this tree", http1)]
            for name, module in pair if round_ % 2 == 0 else pair[::-1]:
                times[name].append(asyncio.run(_per_answer(module, args.answers)))
    print(f"| parser | CPU per answer, median of {args.rounds} (µs) | rounds |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
