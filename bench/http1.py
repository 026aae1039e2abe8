"""CPU per signed GET: aiohttp's client against ``loader.s3.http1``: ``python -m bench.http1``.

    python -m bench.http1 --objects 1000 --rounds 4

The same SigV4-signed requests (``SignedGetter.request``) for N objects of ~110 KB on the
embedded SeaweedFS server, 64 in flight, sent once through an ``aiohttp.ClientSession`` (as
the aioboto3 backend's direct transport sent them before ``http1``, with the same options) and
once through ``http1.ConnectionPool``, in alternated rounds. CPU is this process's
(``time.process_time``: user + system, socket reads included), per GET; the server's is not.
Only the HTTP client differs: signing, keys and server are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

BUCKET = "bench-http1"
SIZE = 110_000


async def _timed(get: Callable[[str], Awaitable[bytes]], keys: list[str], inflight: int
                 ) -> tuple[float, float]:
    """CPU µs per GET and GETs per second, ``inflight`` at once."""
    gate = asyncio.Semaphore(inflight)

    async def one(key: str) -> int:
        async with gate:
            return len(await get(key))

    cpu, wall = time.process_time(), time.perf_counter()
    sizes = await asyncio.gather(*(one(key) for key in keys))
    assert sum(sizes) == SIZE * len(keys)
    return (time.process_time() - cpu) / len(keys) * 1e6, len(keys) / (time.perf_counter() - wall)


async def compare(config: Any, keys: list[str], rounds: int, inflight: int) -> dict[str, list[tuple[float, float]]]:
    import aiohttp

    from loader.retry import RetryPolicy
    from loader.s3.aioboto3_store import _given_credentials
    from loader.s3.signed_get import SignedGetter

    getter = SignedGetter(config, _given_credentials(config), max_connections=inflight,
                          retry=RetryPolicy())
    keys_of = await _given_credentials(config)()
    session = aiohttp.ClientSession(  # the options the direct transport gave aiohttp's client
        connector=aiohttp.TCPConnector(limit=inflight, ssl=False),
        timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=30),
        auto_decompress=False, skip_auto_headers=("Accept", "Accept-Encoding"))
    origin = config.endpoint_url.rstrip("/")

    async def through_aiohttp(key: str) -> bytes:
        target, headers = getter.request(BUCKET, key, None, None, None, keys_of,
                                         datetime.datetime.now(datetime.timezone.utc))
        async with session.get(origin + target, headers=headers, allow_redirects=False) as answer:
            assert answer.status == 200, answer.status
            return await answer.read()

    async def through_http1(key: str) -> bytes:
        data, _ = await getter.get(BUCKET, key)
        assert data is not None
        return data

    clients = {"aiohttp": through_aiohttp, "http1": through_http1}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
    try:
        for get in clients.values():  # warm up: connections open, code paths run once
            await _timed(get, keys[:inflight * 2], inflight)
        for round_ in range(rounds):
            order = list(clients) if round_ % 2 == 0 else list(reversed(clients))
            for name in order:
                results[name].append(await _timed(clients[name], keys, inflight))
                print(f"round {round_} {name:8s} {results[name][-1][0]:6.0f} us/GET "
                      f"{results[name][-1][1]:6.0f} GETs/s", flush=True)
    finally:
        await session.close()
        await getter.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=64)
    args = parser.parse_args()

    from loader.tools.devserver import DevServer

    with DevServer(buckets=[BUCKET]) as server:
        client = server.client()
        keys = [f"o/{i:05d}.jpg" for i in range(args.objects)]
        for key in keys:
            client.put_object(Bucket=BUCKET, Key=key, Body=os.urandom(SIZE))
        results = asyncio.run(compare(server.config, keys, args.rounds, args.inflight))
    base = results["aiohttp"]
    print()
    print(f"{args.objects} GETs of {SIZE:,} bytes per round, {args.inflight} in flight, "
          f"{args.rounds} alternated rounds, embedded SeaweedFS on 127.0.0.1, load average "
          f"{os.getloadavg()[0]:.1f}")
    print()
    print("| client | CPU per GET, median (min-max) | GETs/s median | CPU vs aiohttp, median of per-round ratios |")
    print("|---|--:|--:|--:|")
    for name, runs in results.items():
        cpu = [c for c, _ in runs]
        ratio = statistics.median(c / b for (c, _), (b, _) in zip(runs, base, strict=True))
        print(f"| {name} | {statistics.median(cpu):.0f} us ({min(cpu):.0f}-{max(cpu):.0f}) | "
              f"{statistics.median(r for _, r in runs):,.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
