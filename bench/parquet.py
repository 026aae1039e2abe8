"""``python -m bench.parquet``: a Parquet data set of photo JPEGs in a Hub-style image column, read
through the embedded server by this project, by ``pyarrow.dataset`` over pyarrow's own
``S3FileSystem``, and by Hugging Face ``datasets`` streaming the same files, in one run.

Data: ``--rows`` distinct photo-like JPEGs (``loader.tools.demo.photo_jpeg``, ~50 KiB; ``--distinct``
of them drawn, each row's copy made distinct by its number appended after the JPEG's end, which
decoders ignore) in ``--files`` Parquet files with row groups of ``--row-group`` rows (the Hub's
image data sets use 100), columns ``image: struct<bytes: binary, path: string>`` and ``label``.
Every loader hands the training loop one Python dict per row with the image's bytes (no decode),
through ``DataLoader(batch_size=32, num_workers=w)`` for each ``--workers`` count (default 0 and 2,
workers started the default way). With workers, each loader splits the files as its users get:
this project deals row groups to ranks and workers itself; ``datasets``' ``IterableDataset`` deals
its files to workers; ``pyarrow.dataset`` has no notion of workers, so a small ``IterableDataset``
gives each worker every n-th fragment (file). Each peer runs with its own defaults for read-ahead
(``pyarrow.dataset``: ``batch_readahead=16``, ``fragment_readahead=4``, its default batch size;
``datasets``: its parquet builder's defaults). Rounds alternate the loaders and worker counts; the
tables give medians of samples/s and of the time from building the dataset to its first sample.
CPU per row (this process with its threads and its finished workers, the server process) says
where the time goes on a machine where the server and the client share two cores. ``--latency MS``
and ``--bandwidth MB`` put ``integration/faults``' ``FaultProxy`` in front of the server (MS before
each request is forwarded: S3's time to first byte; each answer served at MB/s: S3's ~85-90 MB/s
per connection; loopback has neither); the proxy runs in a process of its own, its CPU in neither
column. Writes
``bench/results/parquet-workers-<date>.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import io
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from loader import AsyncS3Dataset, S3Config
from loader.tools.demo import photo_jpeg
from loader.tools.devserver import DevServer

BUCKET = "parquetbench"
PREFIX = "data/"
RESULTS = Path(__file__).resolve().parent / "results"
COLUMNS = ["image", "label"]


def make_files(rows: int, files: int, row_group: int, distinct: int) -> dict[str, bytes]:
    """``files`` Parquet files of ``rows`` rows in all, written by pyarrow as the Hub's are."""
    base = [photo_jpeg(i) for i in range(distinct)]
    per = -(-rows // files)
    out: dict[str, bytes] = {}
    for number in range(files):
        first, last = number * per, min(rows, (number + 1) * per)
        images = [{"bytes": base[i % distinct] + i.to_bytes(8, "little"), "path": f"{i:07d}.jpg"}
                  for i in range(first, last)]
        table = pa.table({"image": images, "label": pa.array([i % 1000 for i in range(first, last)], pa.int64())})
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=row_group)
        out[f"{PREFIX}train-{number:05d}-of-{files:05d}.parquet"] = sink.getvalue()
    return out


class Rows(IterableDataset):
    """An iterable of rows made by ``make_rows()`` when iterated (a peer, for the DataLoader)."""

    def __init__(self, make_rows: Callable[[], Iterable[dict[str, Any]]]) -> None:
        self.make_rows = make_rows

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.make_rows())


class Endpoint(NamedTuple):
    """Where the loaders read from (the server, or the latency proxy in front of it) and the
    server's process, whose CPU is measured."""

    config: S3Config
    endpoint_url: str
    pid: int | None


@contextlib.contextmanager
def proxy_process(upstream: str, latency: float, bandwidth: float | None) -> Iterator[str]:
    """``integration/faults``' proxy in a process of its own (``python -m faults``), so that its
    CPU and its GIL are not the loaders': its endpoint URL while it runs."""
    command = [sys.executable, "-m", "faults", "--upstream", upstream, "--latency", str(latency),
               "--max-lifetime", "7200"] + (["--bandwidth", str(bandwidth)] if bandwidth else [])
    proc = subprocess.Popen(command, cwd=Path(__file__).resolve().parent.parent / "integration",
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().strip()
        if not endpoint.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"the fault proxy did not start (it said {endpoint!r})")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def ours(server: Endpoint, **options: Any) -> IterableDataset:
    return AsyncS3Dataset.from_parquet(f"s3://{BUCKET}/{PREFIX}", columns=COLUMNS, config=server.config, **options)


def pyarrow_dataset(server: Endpoint) -> IterableDataset:
    import pyarrow.dataset as pads
    from pyarrow import fs

    config = server.config
    endpoint = server.endpoint_url.split("://", 1)[1]

    def rows() -> Iterator[dict[str, Any]]:
        s3 = fs.S3FileSystem(access_key=config.access_key_id, secret_key=config.secret_access_key,
                             endpoint_override=endpoint, scheme="http", region=config.region,
                             force_virtual_addressing=False)
        dataset = pads.dataset(f"{BUCKET}/{PREFIX}", format="parquet", filesystem=s3)
        info = get_worker_info()
        if info is not None:  # each DataLoader worker reads every n-th file
            fragments = list(dataset.get_fragments())[info.id::info.num_workers]
            dataset = pads.FileSystemDataset(fragments, dataset.schema, dataset.format, s3)
        for batch in dataset.to_batches(columns=COLUMNS):
            yield from batch.to_pylist()

    return Rows(rows)


def hf_datasets(server: Endpoint) -> IterableDataset:
    from datasets import load_dataset

    config = server.config
    options = {"key": config.access_key_id, "secret": config.secret_access_key,
               "client_kwargs": {"endpoint_url": server.endpoint_url, "region_name": config.region}}

    # Handed to the DataLoader as it is (a torch IterableDataset that deals its files to workers).
    stream = load_dataset("parquet", data_files={"train": f"s3://{BUCKET}/{PREFIX}*.parquet"}, split="train",
                          streaming=True, storage_options=options)
    return stream.select_columns(COLUMNS)


LOADERS: dict[str, Callable[[Endpoint], IterableDataset]] = {
    "this project (`from_parquet`)": ours,
    "`pyarrow.dataset` + `S3FileSystem`": pyarrow_dataset,
    "Hugging Face `datasets` streaming": hf_datasets,
}


def first_image(batch: list[dict[str, Any]]) -> int:
    assert isinstance(batch[0]["image"]["bytes"], bytes)
    return len(batch)


def cpu_seconds(process: psutil.Process | None = None) -> float:
    """CPU seconds of ``process`` (None: this one, its threads and its children that ended included:
    DataLoader workers that are not persistent end, and are waited for, with the epoch)."""
    times = (process or psutil.Process()).cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def rss(process: psutil.Process) -> int:
    """Resident bytes of ``process`` and its children (DataLoader workers)."""
    total = 0
    for each in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += each.memory_info().rss
    return total


def run_once(make: Callable[[Endpoint], IterableDataset], server: Endpoint,
             rows: int, workers: int) -> tuple[float, float, float, float, float]:
    """(samples/s over the epoch, seconds from building the dataset to its first sample, client and
    server CPU microseconds per row, the client's peak RSS growth in bytes, workers included)."""
    weed = psutil.Process(server.pid)
    client_cpu, server_cpu = cpu_seconds(), cpu_seconds(weed)
    me = psutil.Process()
    base = peak = rss(me)
    reading = True

    def watch() -> None:  # sampled: a worker's memory is gone once the epoch ends
        nonlocal peak
        while reading:
            peak = max(peak, rss(me))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.perf_counter()
    loader = DataLoader(make(server), batch_size=32, num_workers=workers, collate_fn=first_image)
    got, first = 0, None
    for size in loader:
        if first is None:
            first = time.perf_counter() - started
        got += size
    took = time.perf_counter() - started
    reading = False
    watcher.join()
    assert got == rows, f"read {got} rows, not {rows}"
    assert first is not None
    return (rows / took, first, (cpu_seconds() - client_cpu) / rows * 1e6,
            (cpu_seconds(weed) - server_cpu) / rows * 1e6, peak - base)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.parquet", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20000, help="rows, one JPEG each (default 20000, ~1 GB)")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--row-group", type=int, default=100)
    p.add_argument("--distinct", type=int, default=500, help="distinct photos drawn (default 500)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader worker counts (default 0 2)")
    p.add_argument("--part-mib", type=int, nargs="*", default=[],
                   help="also run this project with units of up to this many MiB (part_size=)")
    p.add_argument("--only", nargs="*", default=None, help="names of loaders to run (default all)")
    p.add_argument("--latency", type=float, default=0.0,
                   help="milliseconds before each request, through the fault proxy (default 0: none)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="MB/s each answer is served at, through the fault proxy (S3: ~85-90 per connection)")
    p.add_argument("--out", type=Path, help="the results file (default bench/results/parquet-workers-<date>.md)")
    args = p.parse_args(argv)

    with contextlib.ExitStack() as stack:
        root = stack.enter_context(tempfile.TemporaryDirectory())
        server = stack.enter_context(DevServer(data_dir=root, buckets=[BUCKET]))
        target = Endpoint(server.config, server.endpoint_url, server.pid)
        if args.latency or args.bandwidth:
            endpoint = stack.enter_context(proxy_process(server.endpoint_url, args.latency / 1000,
                                                         args.bandwidth * 1e6 if args.bandwidth else None))
            target = Endpoint(dataclasses.replace(server.config, endpoint_url=endpoint), endpoint, server.pid)
        began = time.perf_counter()
        files = make_files(args.rows, args.files, args.row_group, args.distinct)
        total = sum(map(len, files.values()))
        client = server.client()
        for key, body in files.items():
            client.put_object(Bucket=BUCKET, Key=key, Body=body)
        del files
        print(f"{args.rows} rows, {total / 1e6:,.0f} MB in {args.files} files, ready in "
              f"{time.perf_counter() - began:.0f} s")
        every = dict(LOADERS)
        for mib in args.part_mib:
            every[f"this project, `part_size={mib} MiB`"] = functools.partial(ours, part_size=mib << 20)
        loaders = {name: make for name, make in every.items()
                   if args.only is None or any(word in name for word in args.only)}
        measured: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {
            (name, w): [] for w in args.workers for name in loaders}
        for number in range(args.rounds + 1):  # round 0 warms the server and the page cache
            for workers in args.workers:
                for name, make in loaders.items():
                    rate, first, client, weed, grown = run_once(make, target, args.rows, workers)
                    print(f"round {number}, w={workers}: {name}: {rate:,.0f} samples/s, first sample {first:.2f} s, "
                          f"CPU per row {client:.0f} us here, {weed:.0f} us in the server, "
                          f"RSS +{grown / 2**20:,.0f} MiB" + (" (warm-up)" if not number else ""), flush=True)
                    if number:
                        measured[(name, workers)].append((rate, first, client, weed, grown))

    def median(name: str, workers: int, column: int) -> float:
        return statistics.median(run[column] for run in measured[(name, workers)])

    tables = []
    for workers in args.workers:
        base = median(next(iter(loaders)), workers, 0)
        lines = [f"`num_workers={workers}`\n",
                 f"| loader | samples/s (median of {args.rounds}) | MB/s | first sample, s | client CPU per row, us "
                 "| server CPU per row, us | peak RSS growth, MiB | this project's speed-up |",
                 "|---|---|---|---|---|---|---|---|"]
        for name in loaders:
            rate = median(name, workers, 0)
            lines.append(f"| {name} | {rate:,.0f} | {rate * total / args.rows / 1e6:,.0f} | "
                         f"{median(name, workers, 1):.2f} | {median(name, workers, 2):.0f} | "
                         f"{median(name, workers, 3):.0f} | "
                         f"{f'{median(name, workers, 4) / 2**20:,.0f}' if not workers else '-'} | {base / rate:.2f}x |")
        tables.append("\n".join(lines) + "\n")
    table = "\n".join(tables)
    print()
    print(table)
    stamp = datetime.date.today().isoformat()
    RESULTS.mkdir(exist_ok=True)
    out = args.out or RESULTS / f"parquet-workers-{stamp}.md"
    conditions = [f"{args.latency:g} ms before each request"] if args.latency else []
    conditions += [f"each answer served at {args.bandwidth:g} MB/s"] if args.bandwidth else []
    latency = (f", {' and '.join(conditions)} through the fault proxy (a process of its own, its CPU "
               "in neither column)") if conditions else ""
    out.write_text(
        f"# Parquet with and without DataLoader workers, {stamp}\n\n`python -m bench.parquet --rows {args.rows} "
        f"--files {args.files} --row-group {args.row_group} --rounds {args.rounds} --workers "
        f"{' '.join(map(str, args.workers))}" + (f" --latency {args.latency:g}" if args.latency else "")
        + (f" --bandwidth {args.bandwidth:g}" if args.bandwidth else "")
        + f"`: {args.rows} photo JPEGs ({total / 1e6:,.0f} MB) in a "
        f"Hub-style image column (`struct<bytes, path>`) plus a label, {args.files} files written by pyarrow "
        f"with row groups of {args.row_group} rows, embedded SeaweedFS on 127.0.0.1{latency}, rows as Python dicts "
        "with the image bytes (no decode), `DataLoader(batch_size=32, num_workers=w)`, loaders and worker "
        "counts alternating round by round after a warm-up round; CPU per row is this process's (its threads "
        "and finished workers included) and the server's; peak RSS growth is this process's over the epoch "
        "(sampled every 10 ms; with workers not shown: each forked worker's RSS counts the pages it shares "
        "with this process). The machine (2 cores) was shared with other work: "
        f"compare the ratios, not the absolute numbers.\n\n{table}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
