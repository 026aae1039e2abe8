"""``python -m bench.listing``: listing one flat prefix, this project next to boto3's paginator.

Starts the embedded SeaweedFS server on 127.0.0.1, PUTs N empty objects under one flat prefix
(obstore, 64 at a time; ``--data-dir`` keeps them for the next run), then lists the prefix in
turn, in one process, with:

* boto3's ``list_objects_v2`` paginator (page after page, what most scripts do);
* ``loader.listing.keylist.list_all`` with ``parallel=1`` (page after page) and the default
  ``parallel=8`` (key ranges in parallel), over the aioboto3 and the obstore backend.

Each run is checked to return every key exactly once. Prints a markdown table: wall time
(median of ``--repeats``), client CPU (this process), server CPU (the ``weed`` process), and the
ratio to the paginator's time. Compare ratios within one run, never absolute times.

    python -m bench.listing --keys 100000                 # ~2 min on 2 cores, once the keys exist
    python -m bench.listing --keys 100000,1000000 --data-dir /var/tmp/listing-bench
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .harness import load_faults_module

BUCKET = "listing"
MARKER = "markers/complete-"  # one per prefix whose objects all exist (outside the prefix)


def flat_keys(count: int) -> list[str]:
    return [f"flat-{count}/{i:08d}.jpg" for i in range(count)]


def obstore_store(config: Any, concurrency: int) -> Any:
    from obstore.store import S3Store

    return S3Store(BUCKET, endpoint=config.endpoint_url, access_key_id=config.access_key_id,
                   secret_access_key=config.secret_access_key, region=config.region,
                   virtual_hosted_style_request=False,
                   client_options={"allow_http": True, "timeout": "300s",
                                   "pool_max_idle_per_host": str(concurrency)})


def ensure_keys(config: Any, count: int, concurrency: int = 64) -> float | None:
    """PUT the empty objects of ``flat_keys(count)`` unless a marker says they exist; the
    seconds taken, or None when they were there."""
    import obstore

    store = obstore_store(config, concurrency)
    marker = f"{MARKER}{count}"

    async def exists() -> bool:
        try:
            await obstore.head_async(store, marker)
        except FileNotFoundError:
            return False
        return True

    async def put_all() -> None:
        pending = iter(flat_keys(count))

        async def runner() -> None:
            for key in pending:
                await obstore.put_async(store, key, b"", use_multipart=False)

        await asyncio.gather(*(runner() for _ in range(concurrency)))
        await obstore.put_async(store, marker, b"", use_multipart=False)

    if asyncio.run(exists()):
        return None
    started = time.perf_counter()
    asyncio.run(put_all())
    return time.perf_counter() - started


def boto3_paginator(config: Any, prefix: str) -> int:
    import boto3

    client = boto3.client("s3", endpoint_url=config.endpoint_url, region_name=config.region,
                          aws_access_key_id=config.access_key_id,
                          aws_secret_access_key=config.secret_access_key)
    count = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        count += len(page.get("Contents", ()))
    return count


def ours(config: Any, prefix: str, store: str, parallel: int) -> int:
    from loader.listing.keylist import ListOptions, list_all
    from loader.retry import RetryPolicy
    from loader.s3 import open_store

    async def main() -> int:
        opened = await open_store(store, config, max_connections=parallel, retry=RetryPolicy())
        try:
            found = await list_all(opened, BUCKET, prefix, RetryPolicy(),
                                   options=ListOptions(concurrency=parallel))
        finally:
            await opened.aclose()
        keys = list(found)
        if keys != sorted(set(keys)) or not all(key.startswith(prefix) for key in keys):
            raise AssertionError(f"{store} parallel={parallel}: keys out of order or repeated")
        return len(keys)

    return asyncio.run(main())


@dataclasses.dataclass
class Row:
    name: str
    walls: list[float] = dataclasses.field(default_factory=list)
    client: list[float] = dataclasses.field(default_factory=list)
    server: list[float] = dataclasses.field(default_factory=list)


def server_cpu(pid: int | None) -> float:
    import psutil

    if pid is None:
        return 0.0
    process = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])


def measure(rows: dict[str, Row], name: str, run: Callable[[], int], count: int,
            pid: int | None, quiet: bool = False) -> None:
    cpu, served, started = time.process_time(), server_cpu(pid), time.perf_counter()
    found = run()
    wall = time.perf_counter() - started
    if count >= 0 and found != count:
        raise AssertionError(f"{name}: {found} keys listed, {count} expected")
    row = rows.setdefault(name, Row(name))
    row.walls.append(wall)
    row.client.append(time.process_time() - cpu)
    row.server.append(server_cpu(pid) - served)
    if not quiet:
        print(f"  {name}: {wall:.2f} s", file=sys.stderr, flush=True)


RUNS = [("boto3 paginator", None, 0), ("ours aioboto3, page after page", "aioboto3", 1),
        ("ours aioboto3, 8 ranges", "aioboto3", 8), ("ours obstore, page after page", "obstore", 1),
        ("ours obstore, 8 ranges", "obstore", 8)]


def table(count: int, rows: dict[str, Row], latency: float = 0.0) -> str:
    base = statistics.median(rows[RUNS[0][0]].walls)
    added = f", {latency * 1000:.0f} ms added before each request" if latency else ""
    lines = [f"### {count:,} keys{added}", "",
             "| lister | wall (median) | client CPU | server CPU | vs boto3's paginator |",
             "|---|--:|--:|--:|--:|"]
    for name, *_ in RUNS:
        row = rows[name]
        wall = statistics.median(row.walls)
        lines.append(f"| {name} | {wall:.2f} s | {statistics.median(row.client):.2f} s | "
                     f"{statistics.median(row.server):.2f} s | {base / wall:.1f}x |")
    return "\n".join(lines)


def run_listers(config: Any, count: int, args: argparse.Namespace, pid: int | None) -> dict[str, Row]:
    """Every lister of ``RUNS`` over ``flat-{count}/``, ``args.repeats`` rounds in turn."""
    rows: dict[str, Row] = {}
    prefix = f"flat-{count}/"
    warm: dict[str, Row] = {}  # imports and sessions made before the clock runs
    for name, store, parallel in RUNS:
        run = (functools.partial(boto3_paginator, config, MARKER) if store is None
               else functools.partial(ours, config, MARKER, store, parallel))
        measure(warm, name, run, -1, pid, quiet=True)
    for repeat in range(args.repeats):
        for name, store, parallel in RUNS:
            if store is None:
                if repeat < (args.paginator_repeats or args.repeats):
                    measure(rows, name, functools.partial(boto3_paginator, config, prefix), count, pid)
            else:
                measure(rows, name, functools.partial(ours, config, prefix, store, parallel),
                        count, pid)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.listing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", default="100000", help="comma-separated key counts (default 100000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per lister (median; default 3)")
    parser.add_argument("--paginator-repeats", type=int, default=None,
                        help="runs of boto3's paginator (default: --repeats; it is slow at 1M keys)")
    parser.add_argument("--data-dir", type=Path, help="keep the server's data here between runs")
    parser.add_argument("--latency", default="0",
                        help="comma-separated seconds added before each request by a proxy, as a "
                             "remote S3 would (default 0; e.g. 0,0.02)")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.keys.split(",")]
    from loader.tools.devserver import DevServer

    with DevServer(data_dir=args.data_dir, buckets=[] if args.data_dir else [BUCKET]) as server:
        config = server.config
        if args.data_dir and BUCKET not in {b["Name"] for b in server.client().list_buckets()["Buckets"]}:
            server.create_bucket(BUCKET)
        out = []
        latencies = [float(x) for x in args.latency.split(",")]
        for count in counts:
            took = ensure_keys(config, count)
            if took is not None:
                print(f"{count:,} empty objects PUT in {took:.0f} s", file=sys.stderr, flush=True)
            for latency in latencies:
                with contextlib.ExitStack() as stack:
                    target = config
                    if latency:
                        faults = load_faults_module()
                        proxy = stack.enter_context(faults.FaultProxy(
                            config.endpoint_url, faults.FaultPlan(latency=latency, objects_only=False),
                            max_lifetime=6 * 3600))
                        target = dataclasses.replace(config, endpoint_url=proxy.endpoint_url)
                    print(f"{count:,} keys, {latency * 1000:.0f} ms added", file=sys.stderr, flush=True)
                    out.append(table(count, run_listers(target, count, args, server.pid), latency))
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
