"""``loader bench``: samples/s and MB/s of the loader on your own data, before training on it.

A ``DataLoader`` over ``AsyncS3Dataset`` as a training script runs it, with a collate function
that only counts, then ``stats()``'s requests and latency percentiles: a seeded subset of keys in
per-object mode, the first ``samples`` samples in shard mode, the first ``samples`` rows of
Parquet files (docs/design/cli.md).
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import TYPE_CHECKING, Any

from ..checks import check_int
from ..config import S3Config
from ..errors import ConfigError
from ..formats.compression import SHARD_SUFFIXES, is_shard_name
from ..uri import parse_s3_uri
from .ls import among, is_parquet, mostly
from .sizes import format_size

if TYPE_CHECKING:
    from ..retry import RetryPolicy

DEFAULT_SAMPLES = 5000
DEFAULT_WORKERS = 2
DEFAULT_BATCH_SIZE = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """``samples``: how many to read (0: one whole pass); the rest as in ``AsyncS3Dataset``."""

    samples: int = DEFAULT_SAMPLES
    workers: int = DEFAULT_WORKERS
    batch_size: int = DEFAULT_BATCH_SIZE
    shards: bool = False
    objects: bool = False
    store: str | None = None
    concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("samples", 0), ("workers", 0), ("batch_size", 1)):
            check_int(name, getattr(self, name), minimum=low, must=f"an integer >= {low}")
        check_int("concurrency", self.concurrency, minimum=1, optional=True, must="a positive integer")
        if self.shards and self.objects:
            raise ConfigError("shards=True and objects=True contradict each other; give one")


def names_shards(uri: str) -> bool:
    """A URI that names tar shards (one, or a brace pattern of them) rather than a prefix."""
    return is_shard_name(uri) or ("{" in uri and any(suffix in uri for suffix in SHARD_SUFFIXES))


def names_parquet(uri: str) -> bool:
    """A URI that names Parquet files (one, or a brace pattern of them) rather than a prefix."""
    return uri.endswith(".parquet") or ("{" in uri and ".parquet" in uri)


def _payload(value: Any) -> int:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, dict):  # a Parquet struct, as the Hub's image column: {"bytes": ..., "path": ...}
        return sum(len(v) for v in value.values() if isinstance(v, (bytes, bytearray, memoryview)))
    return 0


def count_batch(batch: list[dict[str, Any]]) -> tuple[int, int]:
    """The bench's collate function: (samples, payload bytes) of a batch, nothing copied."""
    return len(batch), sum(_payload(v) for sample in batch for v in sample.values())


def bench(uri: str, options: BenchOptions | None = None, *, config: S3Config | None = None,
          retry: RetryPolicy | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Read ``uri`` through a DataLoader and measure; returns the numbers ``bench_lines`` prints."""
    from torch.utils.data import DataLoader
    from tqdm import tqdm

    from ..datasets.groups import Limits, Store
    from ..datasets.iterable import AsyncS3Dataset

    options = options or BenchOptions()
    if options.shards or (names_shards(uri) and not options.objects):
        mode = "shards"
    elif names_parquet(uri) and not options.objects:
        mode = "parquet"
    else:
        mode = "objects"
    backend: Any = options.store if retry is None else Store(backend=options.store, retry=retry)
    common: dict[str, Any] = dict(shuffle=True, seed=options.seed, store=backend, config=config,
                                  limits=Limits(concurrency=options.concurrency))
    total: int | None
    note = ""
    if mode == "objects":
        dataset = AsyncS3Dataset.from_prefix(uri, **common)
        keys = dataset.keys()  # listing happens here, outside the measured time
        if not options.objects and mostly(keys, is_parquet):
            mode = "parquet"
            note = (f"{among(keys, is_parquet)[0]:,} of the {len(keys):,} objects under {uri} are Parquet files: "
                    f"read as rows, as AsyncS3Dataset.from_parquet({uri!r}) reads them (--objects reads "
                    "each object as one sample)")
        elif not options.objects and mostly(keys, is_shard_name):
            mode = "shards"
            note = (f"{among(keys, is_shard_name)[0]:,} of the {len(keys):,} objects under {uri} are tar shards: read "
                    f"in shard mode, as AsyncS3Dataset.from_shards({uri!r}) reads them (--objects reads "
                    "each object as one sample)")
    if mode == "objects":
        index = dataset.samples()
        if options.samples and options.samples < len(index):
            chosen = random.Random(options.seed).sample(range(len(index)), options.samples)
            dataset = AsyncS3Dataset.from_keys(parse_s3_uri(uri).bucket,
                                               [key for i in sorted(chosen) for key in index.objects(i)],
                                               **common)
            index = dataset.samples()
        total = len(index)
        listed = f"{total:,} samples ({len(index.keys):,} objects)"
    elif mode == "parquet":
        from ..datasets.parquet_source import ParquetSource

        dataset = AsyncS3Dataset.from_parquet(uri, **common)
        source = dataset.source
        assert isinstance(source, ParquetSource)
        rows = sum(plan.rows for plan in source.plans())  # listing and footers here, outside the measured time
        total = min(options.samples, rows) if options.samples else rows
        listed = f"{rows:,} rows in {len(source.files()):,} Parquet files"
    else:
        dataset = AsyncS3Dataset.from_shards(uri, **common)
        shards = dataset.shards()
        total = options.samples or None
        listed = f"{len(shards):,} shards"

    loader = DataLoader(dataset, batch_size=options.batch_size, num_workers=options.workers,
                        collate_fn=count_batch)
    samples = nbytes = 0
    first_batch: float | None = None
    started = time.perf_counter()
    with tqdm(total=total, unit=" samples", desc="bench", disable=progress is False,
              dynamic_ncols=True, leave=False) as bar:
        iterator = iter(loader)
        try:
            for count, size in iterator:
                if first_batch is None:
                    first_batch = time.perf_counter() - started
                samples += count
                nbytes += size
                bar.update(count)
                if options.samples and samples >= options.samples:
                    break
        finally:
            del iterator  # shuts the workers down now, so their statistics are written
    seconds = time.perf_counter() - started
    stats = dataset.stats() or {}
    return {
        "uri": uri, "mode": mode, "note": note, "listed": listed, "store": dataset.options.store.backend,
        "workers": options.workers, "batch_size": options.batch_size,
        "concurrency": options.concurrency, "samples": samples, "bytes": nbytes,
        "seconds": seconds, "first_batch_s": first_batch,
        "samples_per_s": samples / seconds if seconds else None,
        "mb_per_s": nbytes / 1e6 / seconds if seconds else None,
        "requests": stats.get("requests"), "request_errors": stats.get("request_errors"),
        "retries": stats.get("retries"),
        "latency_p50_s": stats.get("latency_p50_s"), "latency_p90_s": stats.get("latency_p90_s"),
        "latency_p99_s": stats.get("latency_p99_s"),
    }


def bench_lines(result: dict[str, Any]) -> list[str]:
    """The short table ``loader bench`` prints."""

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1e3:.1f}"

    def count(value: int | None) -> str:
        return "n/a" if value is None else f"{value:,}"

    mode = {"objects": "per-object", "shards": "shards", "parquet": "Parquet rows"}[result["mode"]]
    first = result["first_batch_s"]
    rows = [
        ("samples", f"{result['samples']:,}", f"of {result['listed']}"),
        ("seconds", f"{result['seconds']:.2f}",
         f"first batch after {first:.2f} s" if first is not None else "no batch arrived"),
        ("samples/s", f"{result['samples_per_s'] or 0:,.0f}", ""),
        ("MB/s", f"{result['mb_per_s'] or 0:,.1f}", f"{format_size(result['bytes'])} of payload"),
        ("requests", count(result["requests"]),
         f"{count(result['request_errors'])} failed, {count(result['retries'])} retried"),
        ("latency p50/p90/p99",
         f"{ms(result['latency_p50_s'])} / {ms(result['latency_p90_s'])} / {ms(result['latency_p99_s'])} ms",
         {"shards": "time to first byte for streamed shards", "parquet": "per ranged GET of a row group's "
          "column chunks"}.get(result["mode"], "per GET")),
    ]
    lines = [f"loader bench {result['uri']} ({mode}, store {result['store']}, {result['workers']} "
             f"workers, batch {result['batch_size']}, concurrency {result['concurrency'] or 'default'})"]
    lines += [f"  {name:<20} {value:>22}   {note}".rstrip() for name, value, note in rows]
    if result.get("note"):
        lines.append(f"note: {result['note']}")
    return lines
