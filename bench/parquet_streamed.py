"""``python -m bench.parquet_streamed``: one large row group read whole and read streamed.

A Parquet file of one row group of photo JPEGs (``--rows``, ~50 KB each; pages of 16 rows) on the
embedded server, optionally behind the fault proxy (``--latency``, ``--bandwidth``), read by
``from_parquet`` in a fresh process per run: with no budget (the row group fetched whole) and with
``Limits(memory=--memory MiB)``, less than the row group needs whole, so it is read streamed
(``StreamedFile``). Reports rows/s, the process's peak RSS growth while it reads (after a read of
a small file: imports and the backend's start-up apart), and the bytes of pieces held at once
(streamed). Medians of ``--rounds``.

    python -m bench.parquet_streamed --rows 2400 --memory 96 --latency 20 --bandwidth 90
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

BUCKET = "streamed"
KEY = "big/a.parquet"


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One read in this (fresh) process."""
    import threading

    import psutil

    from loader import AsyncS3Dataset, Limits, S3Config
    from loader.formats import parquet

    files: list[Any] = []

    class Recorded(parquet.StreamedFile):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            files.append(self)

    parquet.StreamedFile = Recorded  # type: ignore[misc]
    options: dict[str, Any] = {"limits": Limits(memory=spec["memory"] << 20)} if spec["memory"] else {}
    config = S3Config(**spec["config"])
    # imports and the backend's start-up first (a small file), so the RSS growth is the read's
    assert sum(1 for _ in AsyncS3Dataset.from_parquet(f"s3://{BUCKET}/small/", config=config, **options)) == 10
    process = psutil.Process()
    before = peak = process.memory_info().rss
    reading = True

    def watch() -> None:  # the peak RSS while reading, sampled (ru_maxrss holds the import's peak)
        nonlocal peak
        while reading:
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.perf_counter()
    rows = sum(1 for _ in AsyncS3Dataset.from_parquet(f"s3://{BUCKET}/big/", config=config, **options))
    took = time.perf_counter() - started
    reading = False
    watcher.join()
    grown = peak - before
    return {"rows": rows, "rate": rows / took, "rss": grown, "streamed": bool(files),
            "held": max((f.peak for f in files), default=0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.parquet_streamed", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2400)
    p.add_argument("--memory", type=int, default=96, help="MiB of Limits(memory=) for the streamed read")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--latency", type=float, default=0.0)
    p.add_argument("--bandwidth", type=float, default=None)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.parquet import proxy_process
    from loader.tools.demo import photo_jpeg
    from loader.tools.devserver import DevServer

    photos = [photo_jpeg(i) for i in range(200)]
    out = io.BytesIO()
    table = pa.table({"image": [photos[i % 200] + i.to_bytes(8, "little") for i in range(args.rows)],
                      "label": list(range(args.rows))})
    pq.write_table(table, out, row_group_size=args.rows, write_batch_size=16)
    data = out.getvalue()
    chunk = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0).column(0).total_compressed_size
    print(f"one row group of {args.rows} rows, its image column chunk {chunk / 1e6:.0f} MB", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {"whole (no budget)": [], f"streamed (Limits(memory={args.memory} MiB))": []}
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(tempfile.TemporaryDirectory())
        server = stack.enter_context(DevServer(data_dir=root, buckets=[BUCKET]))
        server.client().put_object(Bucket=BUCKET, Key=KEY, Body=data)
        small = io.BytesIO()
        pq.write_table(table.slice(0, 10), small)
        server.client().put_object(Bucket=BUCKET, Key="small/a.parquet", Body=small.getvalue())
        config = server.config
        if args.latency or args.bandwidth:
            endpoint = stack.enter_context(proxy_process(server.endpoint_url, args.latency / 1000,
                                                         args.bandwidth * 1e6 if args.bandwidth else None))
            config = dataclasses.replace(config, endpoint_url=endpoint)
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        for _ in range(args.rounds):
            for name, memory in zip(runs, (0, args.memory)):
                spec = json.dumps({"memory": memory, "config": fields})
                done = subprocess.run([sys.executable, "-m", "bench.parquet_streamed", "--child", spec],
                                      capture_output=True, text=True, check=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                assert result["rows"] == args.rows, result
                runs[name].append(result)
                print(f"  {name}: {result}", file=sys.stderr, flush=True)
    print(f"| read | rows/s (median of {args.rounds}) | peak RSS growth | pieces held at once |")
    print("|---|--:|--:|--:|")
    for name, results in runs.items():
        rate = statistics.median(r["rate"] for r in results)
        rss = statistics.median(r["rss"] for r in results)
        held = max(r["held"] for r in results)
        print(f"| {name} | {rate:,.0f} | {rss / 2**20:,.0f} MiB | {held / 2**20:,.0f} MiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
