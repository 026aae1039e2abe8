"""What holding every answer to a pace costs (``loader/s3/answer_pace.py``): the deadlines that
botocore's and obstore's paths put around their awaits, so that a server sending a byte now and
then cannot hold a read for ever.

Against the embedded SeaweedFS, one process: 100 KiB objects read whole, 32 GETs in flight,
through botocore's path (``Aioboto3Store(direct_gets=False)``) and obstore, with the deadlines
on and (patched out) off, alternated round by round so that drift on a shared machine hits both
alike. The signed ``http1`` path checks the pace as bytes arrive and is not measured here.
Prints the process CPU per GET and the on/off ratio.

    python -m bench.answer_pace [--rounds 8]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio

from loader.retry import RetryPolicy
from loader.s3 import aioboto3_store, obstore_store
from loader.s3.aioboto3_store import Aioboto3Store
from loader.tools.devserver import DevServer

SMALL = 100 << 10
OBJECTS = 400


async def _bare_within(seconds: float, awaitable: Awaitable[Any], too_slow: Callable[[], Any]) -> Any:
    return await awaitable


@contextlib.contextmanager
def paced(on: bool) -> Iterator[None]:
    """The deadlines as they are, or every ``within`` made a plain await."""
    saved = aioboto3_store.within, obstore_store.within
    if not on:
        aioboto3_store.within = obstore_store.within = _bare_within
    try:
        yield
    finally:
        aioboto3_store.within, obstore_store.within = saved


async def read_objects(store: Any, bucket: str) -> None:
    limiter = anyio.CapacityLimiter(32)

    async def one(i: int) -> None:
        async with limiter:
            await store.get(bucket, f"o/{i:05d}")

    async with anyio.create_task_group() as tg:
        for i in range(OBJECTS):
            tg.start_soon(one, i)


async def measure(config: Any, bucket: str, rounds: int) -> dict[tuple[str, bool], list[float]]:
    out: dict[tuple[str, bool], list[float]] = {}
    for backend in ("botocore", "obstore"):
        if backend == "botocore":
            store: Any = await Aioboto3Store.open(config, max_connections=32, retry=RetryPolicy(),
                                                  direct_gets=False)
        else:
            store = await obstore_store.ObstoreStore.open(config, max_connections=32, retry=RetryPolicy())
        try:
            await read_objects(store, bucket)  # warm the pool
            for round_ in range(rounds):
                for on in ((True, False) if round_ % 2 == 0 else (False, True)):
                    with paced(on):
                        cpu = time.process_time()
                        await read_objects(store, bucket)
                        out.setdefault((backend, on), []).append((time.process_time() - cpu) / OBJECTS)
        finally:
            await store.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    with DevServer(buckets=["bench"]) as server:
        client = server.client()
        blob = os.urandom(SMALL)
        for i in range(OBJECTS):
            client.put_object(Bucket="bench", Key=f"o/{i:05d}", Body=blob)
        results = anyio.run(measure, server.config, "bench", args.rounds)
    print("| path | CPU per GET, deadlines off | CPU per GET, deadlines on | ratio on/off |")
    print("|---|---|---|---|")
    for backend in ("botocore", "obstore"):
        off, on = (statistics.median(results[backend, flag]) for flag in (False, True))
        print(f"| {backend} | {off * 1e6:.0f} µs | {on * 1e6:.0f} µs | {on / off:.2f} |")


if __name__ == "__main__":
    main()
