"""``python -m bench.run``: this project's loaders next to s3torchconnector and webdataset.

Starts the embedded SeaweedFS server on 127.0.0.1, uploads a synthetic JPEG data set (objects and
tar shards of the same samples), puts a 20 ms latency proxy in front of it, and measures every
loader x workload (raw, decode) x added latency x num_workers, one child process per loader, with
identical DataLoader settings. Writes ``bench/results/results.md``, ``results.json`` and
``chart.png``. See ``bench/README.md``.

    python -m bench.run                 # full run (~10 min on 2 cores)
    python -m bench.run --quick         # ~2 min: 600 samples, workers 0,2, one timed epoch
    python -m bench.run --only shard,wds --workers 0,2 --latency 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .harness import RESULTS_DIR, Harness, Options, select_loaders
from .report import goals, write_all


def _numbers(kind: type, what: str, example: str):
    """An argparse type: comma-separated non-negative ``kind`` values, e.g. ``0,2,4``."""
    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give comma-separated {what}, e.g. {example}") from None
        if not values or any(v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated {what} >= 0")
        return values
    return parse


_ints = _numbers(int, "integers", "0,2,4")
_floats = _numbers(float, "seconds", "0,0.02")


def _words(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return values
    return parse


def parser(description: str = __doc__) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=description.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="600 samples, workers 0,2, 1 timed epoch, shorter caps (~2 min)")
    p.add_argument("--samples", type=int, help="data set size (default 2000; quick 600)")
    p.add_argument("--decode-samples", type=int,
                   help="the decode workload reads a copy of the first N samples, so that full epochs "
                        "stay short (default 512; quick 256)")
    p.add_argument("--shards", type=int, default=8, help="tar shards holding the same samples (default 8)")
    p.add_argument("--only", metavar="PATTERN",
                   help="loaders to run: comma-separated substrings or globs of their names "
                        "(ceiling, ours-obj-aioboto3, ours-obj-obstore, ours-shard-aioboto3, "
                        "ours-shard-obstore, s3tc-map, s3tc-iter, wds)")
    p.add_argument("--no-peers", action="store_true", help="skip s3torchconnector and webdataset")
    p.add_argument("--workers", type=_ints, help="num_workers values (default 0,2,4; quick 0,2)")
    p.add_argument("--latency", type=_floats, default=(0.0, 0.02),
                   help="added time to first byte in seconds (default 0,0.02)")
    p.add_argument("--workload", type=_words(("raw", "decode", "fast")), default=("raw", "decode"),
                   help="raw, decode (the usual Pillow recipe), fast (loader.decode.decode_image), "
                        "comma-separated (default raw,decode)")
    p.add_argument("--epochs", type=int, help="timed epochs per run, median reported (default 2; quick 1)")
    p.add_argument("--epoch-seconds", type=float,
                   help="cap per timed epoch of the peers and the ceiling, seconds (default 3; quick 1); ours always run full epochs")
    p.add_argument("--warmup-seconds", type=float, help="cap on the warm-up epoch (default 1; quick 0.5)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"output directory (default {RESULTS_DIR})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def options_from(args: argparse.Namespace, loaders: tuple[str, ...]) -> Options:
    quick = args.quick
    samples = args.samples or (600 if quick else 2000)
    if samples < 32:
        raise SystemExit("--samples must be at least 32 (one batch)")
    if args.shards < 1:
        raise SystemExit("--shards must be at least 1")
    return Options(
        samples=samples, decode_samples=args.decode_samples or (256 if quick else 512), shards=args.shards, workers=args.workers or ((0, 2) if quick else (0, 2, 4)),
        latencies=args.latency,
        workloads=args.workload, loaders=loaders,
        epochs=args.epochs or (1 if quick else 2),
        warmup_seconds=args.warmup_seconds or (0.5 if quick else 1.0),
        epoch_seconds=args.epoch_seconds or (1.0 if quick else 3.0),
        quick=quick, out_dir=args.out,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    loaders = select_loaders(args.only, peers=not args.no_peers)
    if not loaders:
        raise SystemExit(f"--only {args.only!r} matches no loader")
    harness = Harness(options_from(args, loaders), progress=not args.no_progress)
    results = harness.run()
    paths = write_all(results, harness.meta, args.out)
    items = goals(results)
    print()
    for g in items:
        print(f"  [{g.status:>6}] {g.text}: {g.measured} (target {g.target})")
    failed = [r for r in results if r.get("error")]
    print(f"\n{len(results)} runs, {len(failed)} failed; {sum(g.status == 'met' for g in items)} of "
          f"{len(items)} goals met. Wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
