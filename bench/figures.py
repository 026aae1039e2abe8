"""Small costs the code's design rests on, measured here: import times before the first
sample, reading a listing page, shuffling an epoch's order.

    python -m bench.figures                      # prints a Markdown table (about a minute)

Module docstrings state these choices without numbers; this script gives the numbers, so that
bench/results/ can hold them with a date and the machine they were measured on.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

REPEATS = 7


def _median_s(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def import_cost_s(code: str) -> float:
    """Seconds ``code`` adds to a fresh interpreter's start, median of ``REPEATS``."""
    def run(snippet: str) -> Callable[[], object]:
        return lambda: subprocess.run([sys.executable, "-c", snippet], check=True)
    return _median_s(run(code)) - _median_s(run("pass"))


def listing_page(keys: int = 1000) -> bytes:
    """A ``ListObjectsV2`` answer of ``keys`` objects, as S3 writes one (``encoding-type=url``)."""
    contents = "".join(
        f"<Contents><Key>train/{i:08d}.jpg</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
        f"<ETag>&quot;{i:032x}&quot;</ETag><Size>{110_000 + i}</Size><StorageClass>STANDARD</StorageClass>"
        f"</Contents>" for i in range(keys))
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name>'
        f"<Prefix>train/</Prefix><KeyCount>{keys}</KeyCount><MaxKeys>{keys}</MaxKeys>"
        "<EncodingType>url</EncodingType><IsTruncated>true</IsTruncated>"
        f"<NextContinuationToken>token</NextContinuationToken>{contents}</ListBucketResult>"
    ).encode()


def listing_costs_us_per_key(keys: int = 1000) -> dict[str, float]:
    """CPU per listed key of the three ways to read a page: ours, ElementTree, botocore's parser."""
    import botocore.session
    from botocore.parsers import create_parser

    from loader.s3 import list_xml as listxml

    body = listing_page(keys)
    operation = botocore.session.get_session().get_service_model("s3").operation_model("ListObjectsV2")
    parser = create_parser("rest-xml")
    answer = {"body": body, "headers": {}, "status_code": 200}
    assert listxml._parse_flat_page(body) is not None  # the fast path applies to this page
    ways = {
        "listxml, regular expressions (the usual page)": lambda: listxml._parse_flat_page(body),
        "listxml, ElementTree (any other page)": lambda: listxml._parse_list_page(body),
        "botocore's parser": lambda: parser.parse(answer, operation.output_shape),
    }
    return {name: _median_s(fn) / keys * 1e6 for name, fn in ways.items()}


def shuffle_s(n: int = 1_000_000) -> float:
    """One worker's share of a shuffled epoch order, started: its first 64 items."""
    from loader.datasets.partition import partition

    def start() -> list[int]:
        share = partition(n, seed=0, epoch=1, shuffle=True, rank=0, world_size=1, worker=0, num_workers=2)
        return [item for _, item in zip(range(64), share)]

    return _median_s(start, repeats=5)


def main() -> None:
    rows = [
        ("import botocore's SigV4 signer (`botocore.auth`)", f"{import_cost_s('import botocore.auth'):.3f} s"),
        ("import aiohttp and botocore", f"{import_cost_s('import aiohttp, botocore.session'):.3f} s"),
        ("import aioboto3 and build a session", f"{import_cost_s('import aioboto3; aioboto3.Session()'):.3f} s"),
        ("import the http.client lister (`loader.s3.http_lister`)",
         f"{import_cost_s('import loader.s3.http_lister'):.3f} s"),
    ]
    rows += [(f"read a listing page: {name}", f"{us:.1f} us per key")
             for name, us in listing_costs_us_per_key().items()]
    rows.append(("a worker's share of a shuffled order of 1,000,000 items, first 64 items",
                 f"{shuffle_s() * 1e3:.2f} ms"))
    print(f"Python {platform.python_version()}, {platform.machine()}, medians\n")
    print("| what | cost |\n|---|--:|")
    for what, cost in rows:
        print(f"| {what} | {cost} |")


if __name__ == "__main__":
    main()
