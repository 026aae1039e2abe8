"""``python -m bench.index``: ``loader index`` throughput (MB/s, shards/s) on the embedded server.

Three sets of synthetic shards (written with ``tarfile``, as another tool would): large
uncompressed shards (read as parallel ranged parts), many small ones (where the cost per shard
shows), and ``.tar.gz`` shards (one stream each, decompressed). For each, the median of
``--repeats`` runs of ``index_shards(..., force=True)`` at each ``--concurrency``, next to a
baseline measured in the same run: the same shards fetched with the same store and concurrency,
bytes discarded (no parsing). Writes ``bench/results/index-<date>.md`` and ``.json``.

    python -m bench.index
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gzip
import io
import json
import os
import random
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import anyio

from loader.retry import RetryPolicy
from loader.s3 import open_store
from loader.s3.blocking import run_async
from loader.shard_index.write import IndexOptions, index_shards
from loader.testing import DevServer

SETS = {  # name: (shards, samples per shard, payload bytes per sample, gzip)
    "large": (12, 330, 100_000, False),
    "small": (240, 20, 10_000, False),
    "gzip": (12, 330, 100_000, True),
}


def shard_bytes(number: int, samples: int, payload: int, compressed: bool) -> bytes:
    rng = random.Random(number)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(samples):
            # half random, half repeated: gzip has something to do, and something to gain
            data = rng.randbytes(payload // 2) + bytes([i % 256]) * (payload - payload // 2)
            for ext, body in (("bin", data), ("cls", str(i % 10).encode())):
                info = tarfile.TarInfo(f"s{number:05d}/{i:06d}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    body = out.getvalue()
    return gzip.compress(body, compresslevel=1, mtime=0) if compressed else body


def upload(server: DevServer, bucket: str) -> dict[str, tuple[int, int]]:
    """Every set under its own prefix; returns ``{set: (shards, stored bytes)}``."""
    import boto3

    config = server.config
    s3 = boto3.client("s3", endpoint_url=config.endpoint_url, aws_access_key_id=config.access_key_id,
                      aws_secret_access_key=config.secret_access_key, region_name=config.region)
    sizes = {}
    for name, (shards, samples, payload, compressed) in SETS.items():
        total = 0
        for number in range(shards):
            body = shard_bytes(number, samples, payload, compressed)
            suffix = ".tar.gz" if compressed else ".tar"
            s3.put_object(Bucket=bucket, Key=f"{name}/shard-{number:05d}{suffix}", Body=body)
            total += len(body)
        sizes[name] = (shards, total)
    return sizes


def fetch_all(server: DevServer, bucket: str, prefix: str, concurrency: int) -> float:
    """Seconds to stream every object under ``prefix`` with ``concurrency`` at once (baseline)."""
    factory = functools.partial(open_store, "aioboto3", server.config, max_connections=4 * concurrency,
                                retry=RetryPolicy())

    async def main() -> float:
        store = await factory()
        try:
            keys = [info.key async for info in store.list(bucket, prefix) if not info.key.endswith(".json")]
            started = time.perf_counter()
            limiter = anyio.CapacityLimiter(concurrency)

            async def one(key: str) -> None:
                async with limiter:
                    async for _ in store.stream(bucket, key):
                        pass

            async with anyio.create_task_group() as tg:
                for key in keys:
                    tg.start_soon(one, key)
            return time.perf_counter() - started
        finally:
            await store.aclose()

    return run_async(main)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.index", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8", help="comma-separated (default: 1,8)")
    p.add_argument("--parts", default="1,4", help="parts_inflight values, comma-separated (default: 1,4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    parts_levels = [int(c) for c in args.parts.split(",")]
    rows = []
    started_at = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, DevServer(data_dir=tmp, buckets=["bench"]) as server:
        sizes = upload(server, "bench")
        for name, (shards, stored) in sizes.items():
            fetch_all(server, "bench", f"{name}/", 8)  # warm-up: the server's first read of new data is slower
            for concurrency in levels:
                for parts in parts_levels if name == "large" else [1]:
                    index_runs, fetch_runs, samples = [], [], 0
                    for _ in range(args.repeats):
                        fetch_runs.append(fetch_all(server, "bench", f"{name}/", concurrency))
                        options = IndexOptions(concurrency=concurrency, parts_inflight=parts, force=True)
                        report = index_shards(f"s3://bench/{name}/", options, config=server.config)
                        index_runs.append(report.seconds)
                        samples = report.samples
                    seconds, baseline = statistics.median(index_runs), statistics.median(fetch_runs)
                    row = {"set": name, "shards": shards, "samples": samples, "stored_mb": stored / 1e6,
                           "concurrency": concurrency, "parts_inflight": parts, "index_s": seconds,
                           "fetch_s": baseline, "mb_per_s": stored / 1e6 / seconds,
                           "shards_per_s": shards / seconds, "fetch_mb_per_s": stored / 1e6 / baseline,
                           "vs_fetch": baseline / seconds, "runs_s": index_runs, "fetch_runs_s": fetch_runs}
                    rows.append(row)
                    print(f"{name:6} c={concurrency} parts={parts}: {row['mb_per_s']:6.0f} MB/s "
                          f"{row['shards_per_s']:6.1f} shards/s (fetch alone {row['fetch_mb_per_s']:.0f} MB/s; "
                          f"index = {row['vs_fetch']:.2f}x its speed)")
    meta = {"date": started_at, "load_at_start": load, "cpus": os.cpu_count(), "repeats": args.repeats}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"index-{started_at[:10]}"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# `loader index` throughput",
        "",
        f"{started_at}, embedded SeaweedFS on 127.0.0.1, {os.cpu_count()} CPUs shared by client and server "
        f"(load average at start {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}); measured with "
        "`python -m bench.index` while no other measurement ran. Median of "
        f"{args.repeats} runs of `index_shards(..., force=True)` (listing, one GET of the old index, "
        "every shard streamed, parsed and grouped, the index written); \"fetch alone\" streams the same "
        "objects with the same store and concurrency and discards the bytes, in the same run. MB are "
        "stored bytes (compressed for gzip). Compare ratios, not absolutes.",
        "",
        "| set | shards | samples | MB stored | concurrency | parts in flight | index MB/s | shards/s | "
        "fetch alone MB/s | index / fetch |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(f"| {r['set']} | {r['shards']} | {r['samples']:,} | {r['stored_mb']:.0f} | {r['concurrency']} | "
                     f"{r['parts_inflight']} | "
                     f"{r['mb_per_s']:.0f} | {r['shards_per_s']:.1f} | {r['fetch_mb_per_s']:.0f} | "
                     f"{r['vs_fetch']:.2f} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
