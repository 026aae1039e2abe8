"""What pinning a read to one version (``If-Match``, see ``loader/s3/protocol.py``) costs.

Against the embedded SeaweedFS, one process, both backends, pinned and unpinned requests
interleaved round by round so that drift on a shared machine hits both alike:

* ``parts``: a 64 MiB object read as 2 MiB ranged GETs, 4 in flight (a shard's ranged parts);
  pinned, every request carries ``If-Match`` and hands its ETag to the pin;
* ``objects``: 100 KiB objects, 32 GETs in flight; pinned is what a disk cache's miss sends
  (obstore then needs ``get_async`` + ``bytes_async`` instead of one ``get_range_async``).

Prints the wall time and the process CPU per request, and the pinned/unpinned ratio of each.

    python -m bench.if_match [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import anyio

from loader.retry import RetryPolicy
from loader.s3 import Pin, open_store
from loader.tools.devserver import DevServer

PART = 2 << 20
SHARD = 64 << 20
SMALL = 100 << 10
OBJECTS = 400


async def read_parts(store, bucket: str, pinned: bool) -> None:
    pin = Pin() if pinned else None
    limiter = anyio.CapacityLimiter(4)

    async def one(i: int) -> None:
        async with limiter:
            await store.get_range(bucket, "shard", i * PART, (i + 1) * PART, pin=pin)

    async with anyio.create_task_group() as tg:
        for i in range(SHARD // PART):
            tg.start_soon(one, i)


async def read_objects(store, bucket: str, pinned: bool) -> None:
    limiter = anyio.CapacityLimiter(32)

    async def one(i: int) -> None:
        async with limiter:
            await store.get(bucket, f"o/{i:05d}", pin=Pin() if pinned else None)

    async with anyio.create_task_group() as tg:
        for i in range(OBJECTS):
            tg.start_soon(one, i)


async def measure(config, bucket: str, rounds: int) -> dict[tuple[str, str, bool], list[tuple[float, float]]]:
    out: dict[tuple[str, str, bool], list[tuple[float, float]]] = {}
    for backend in ("aioboto3", "obstore"):
        store = await open_store(backend, config, max_connections=32, retry=RetryPolicy())
        try:
            for what, fn in (("parts", read_parts), ("objects", read_objects)):
                await fn(store, bucket, False)  # warm the pool
                for _ in range(rounds):
                    for pinned in (False, True):
                        wall, cpu = time.perf_counter(), time.process_time()
                        await fn(store, bucket, pinned)
                        out.setdefault((backend, what, pinned), []).append(
                            (time.perf_counter() - wall, time.process_time() - cpu))
        finally:
            await store.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with DevServer(buckets=["bench"]) as server:
        client = server.client()
        client.put_object(Bucket="bench", Key="shard", Body=os.urandom(SHARD))
        blob = os.urandom(SMALL)
        for i in range(OBJECTS):
            client.put_object(Bucket="bench", Key=f"o/{i:05d}", Body=blob)
        results = anyio.run(measure, server.config, "bench", args.rounds)
    print("| backend | read | unpinned wall / CPU per request | pinned wall / CPU per request "
          "| ratio wall | ratio CPU |")
    print("|---|---|---|---|---|---|")
    for backend in ("aioboto3", "obstore"):
        for what, count in (("parts", SHARD // PART), ("objects", OBJECTS)):
            plain = results[backend, what, False]
            pinned = results[backend, what, True]
            pw, pc = (statistics.median(x[i] for x in plain) / count for i in (0, 1))
            qw, qc = (statistics.median(x[i] for x in pinned) / count for i in (0, 1))
            print(f"| {backend} | {what} | {pw * 1e3:.2f} ms / {pc * 1e3:.2f} ms | "
                  f"{qw * 1e3:.2f} ms / {qc * 1e3:.2f} ms | {qw / pw:.2f} | {qc / pc:.2f} |")


if __name__ == "__main__":
    main()
