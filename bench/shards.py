"""``python -m bench.shards``: shard-mode samples/s and MB/s next to webdataset, same run.

A short entry point on the same machinery as ``bench.run``: the embedded server, the same
synthetic shards, the same DataLoader settings; ``AsyncS3Dataset.from_shards`` (aioboto3 and
obstore) and webdataset's tar expander over boto3 read the same shards, raw bytes, no added
latency, num_workers 0, 2 and 4 by default. Prints a table; writes ``bench/results/shards.md`` and
``shards.json``.

    python -m bench.shards
    python -m bench.shards --workers 0,2 --latency 0,0.02 --workload raw,decode --ceiling
"""

from __future__ import annotations

import json
import sys

from .harness import Harness
from .report import best, markdown, results_table
from .run import options_from, parser

SHARD_LOADERS = ("ours-shard-aioboto3", "ours-shard-obstore", "wds")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.prog = "python -m bench.shards"
    p.set_defaults(latency=(0.0,), workload=("raw",))
    p.add_argument("--ceiling", action="store_true", help="also measure the in-memory DataLoader ceiling")
    args = p.parse_args(argv)
    loaders = SHARD_LOADERS + (("ceiling",) if args.ceiling else ())
    if args.only:
        from .harness import select_loaders
        loaders = select_loaders(args.only, peers=not args.no_peers, names=loaders)
    elif args.no_peers:
        loaders = tuple(n for n in loaders if n != "wds")
    if args.samples is None and not args.quick:
        args.samples = 1200
    harness = Harness(options_from(args, loaders), progress=not args.no_progress)
    results = harness.run()
    print()
    print(results_table(results))
    print()
    for workload in harness.options.workloads:
        for latency in harness.options.latencies:
            ms = round(latency * 1000)
            wds = best(results, "wds", workload, ms)
            for name in ("ours-shard-aioboto3", "ours-shard-obstore"):
                ours = best(results, name, workload, ms)
                if ours and wds:
                    print(f"{workload} +{ms} ms: {name} {ours['samples_per_s']:,.0f}/s "
                          f"({ours['mb_per_s']:,.0f} MB/s, w={ours['workers']}) = "
                          f"{ours['samples_per_s'] / wds['samples_per_s']:.2f}x webdataset "
                          f"({wds['samples_per_s']:,.0f}/s, w={wds['workers']})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shards.md").write_text(markdown(results, harness.meta))
    (args.out / "shards.json").write_text(json.dumps({"meta": harness.meta, "results": results}, indent=1))
    print(f"\nwrote {args.out / 'shards.md'} and {args.out / 'shards.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
