"""``loader index`` on the command line: its arguments, progress bar and summary (the work is
``shard_index/write.py``, imported only when the command runs)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import IO

from .arguments import (
    ENV_HELP,
    EXIT_INTERRUPTED,
    EXIT_OK,
    _Formatter,
    _positive_int,
    _s3_uri,
    add_deprecated_alias,
    add_long_run_options,
    add_retry_options,
    retry_policy,
)
from .bars import Bars


def register(subparsers: argparse._SubParsersAction) -> None:
    """``index``: count the samples of shards other tools wrote; write the index from_shards finds."""
    p = subparsers.add_parser(
        "index", help="count the samples of tar shards (any tool's) and write the index from_shards finds",
        description=(
            "Read each tar shard once (plain, .tar.gz/.tgz or .tar.zst; written by webdataset, GNU "
            "tar or anything else), in parallel, and write index.json in the shards' folder: each "
            "shard's sample count, size, ETag and (uncompressed) sample offsets. from_shards finds it "
            "by itself, so every rank of a job reads the same number of samples. Interrupted? Run "
            "the same command again: the index is written as shards finish, and shards already in "
            "it (unchanged since) are not read again; after shards change or are added, it reads "
            "only those. " + ENV_HELP
        ),
        epilog=(
            "examples:\n"
            "  loader index 's3://data/train-{000000..001023}.tar'\n"
            "  loader index s3://data/shards/\n"
            "  loader index s3://data/a.tar.gz s3://data/b.tar.gz --out s3://mine/meta/index.json\n"
            "\nthen read them with:\n"
            "  ds = AsyncS3Dataset.from_shards(\"s3://data/shards/\", shuffle=True)  # the index is found\n"
            "  ds = AsyncS3Dataset.from_shards(..., index=\"s3://mine/meta/index.json\")  # after --out"
        ),
        formatter_class=_Formatter,
    )
    p.add_argument("shards", nargs="+", type=_s3_uri, metavar="SHARDS",
                   help="a brace pattern (quote it), shard URIs, or a prefix holding the shards")
    p.add_argument("--out", type=_s3_uri, default=None, metavar="URI",
                   help="write the index here instead of index.json in the shards' folder "
                        "(then pass index=URI to from_shards)")
    p.add_argument("--concurrency", type=_positive_int, default=8, metavar="N",
                   help="shards read at once (default: 8)")
    p.add_argument("--part-concurrency", type=_positive_int, default=1, metavar="P", dest="parts_inflight",
                   help="ranged GETs at once per large uncompressed shard (default: 1, one stream "
                        "each; more helps a few very large shards on a distant store)")
    p.add_argument("--overwrite", action="store_true",
                   help="read every shard again, even those indexed and unchanged")
    add_deprecated_alias(p, "--force", "--overwrite", "overwrite")
    add_deprecated_alias(p, "--parts-inflight", "--part-concurrency", "parts_inflight", type=_positive_int,
                         metavar="P")
    add_long_run_options(p)
    add_retry_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    from ..shard_index.write import DEFAULT_PART_SIZE, IndexOptions, IndexReport, index_shards
    from .sizes import format_size

    out, err = out or sys.stdout, err or sys.stderr
    options = IndexOptions(out=args.out, concurrency=args.concurrency, force=args.overwrite,
                           parts_inflight=args.parts_inflight, part_size=args.part_size or DEFAULT_PART_SIZE,
                           stop_after=args.stop_after)
    bars = Bars(args.progress, err)

    def progress(report: IndexReport, total_bytes: int) -> Callable[[int, int], None]:
        return bars.counting("index", total_bytes, report.shards - report.already, "shards")

    shards = args.shards[0] if len(args.shards) == 1 else args.shards
    try:
        report = index_shards(shards, options, retry=retry_policy(args), progress=progress)
    except KeyboardInterrupt:
        bars.close()
        print("loader index: interrupted; the shards indexed so far are in the index: run the same "
              "command again to index the rest", file=err)
        return EXIT_INTERRUPTED
    bars.close()
    if not report.complete:
        print(f"loader index: stopped after {report.indexed} shard(s) (--stop-after); run the same "
              "command again to index the rest", file=err)
        return EXIT_INTERRUPTED
    seconds = max(report.seconds, 1e-9)
    print(f"indexed {report.indexed:,} shard(s) ({report.samples:,} samples, "
          f"{format_size(report.bytes_read)}) in {report.seconds:.1f} s "
          f"({format_size(report.bytes_read / seconds)}/s, {report.indexed / seconds:.1f} shards/s)"
          + (f"; {report.already:,} were indexed already" if report.already else ""), file=out)
    print(f"index: {report.index_url}", file=out)
    where = f", index={report.index_url!r}" if args.out else ""
    print(f"read them with: AsyncS3Dataset.from_shards({shards!r}{where})", file=out)
    return EXIT_OK
