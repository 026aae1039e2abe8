"""``python -m bench.mix``: what mixing costs. A mix of per-object JPEGs and tar shards next to
the same sources read alone, same server, same data, same run.

Two sources on the embedded server: ``objects/`` (one JPEG per sample) and the same kind of
samples in tar shards under ``shards/``. "alone" reads each source whole with its own dataset,
one after the other; "mixed" reads the whole epoch through ``loader.mix`` (one
engine, the two interleaved by weight). Runs alternate, the median of ``--repeats`` is reported,
raw bytes, ``DataLoader(batch_size=32)`` with ``--workers``. Writes ``bench/results/mix-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from pathlib import Path

from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, mix
from loader.tools.devserver import DevServer

from .data import make_samples, make_shards

BUCKET = "mixbench"
RESULTS = Path(__file__).resolve().parent / "results"


def collate(batch: list[dict]) -> int:
    return len(batch)


def timed(dataset: AsyncS3Dataset, workers: int) -> tuple[int, float]:
    loader = DataLoader(dataset, batch_size=32, num_workers=workers, collate_fn=collate,
                        persistent_workers=False)
    started = time.perf_counter()
    samples = sum(loader)
    return samples, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mix", description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=1200, help="samples per source (default 1200)")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as root, DevServer(data_dir=root, buckets=[BUCKET]) as server:
        client = server.client()
        objects = make_samples(args.samples, prefix="o/")
        shards = make_shards(make_samples(args.samples, prefix="s/"), args.shards, prefix="s/")
        for key, body in {**objects, **shards}.items():
            client.put_object(Bucket=BUCKET, Key=key, Body=body)
        counts = {f"s3://{BUCKET}/{key}": -(-args.samples // args.shards) for key in shards}
        last = sorted(shards)[-1]
        counts[f"s3://{BUCKET}/{last}"] = args.samples - (args.shards - 1) * -(-args.samples // args.shards)
        config = server.config
        total = 2 * args.samples  # the mix's epoch: both sources, every sample once, equal weights
        weights = {"objects": 0.5, "shards": 0.5}

        def sources():
            return {"objects": AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/o/objects/", config=config, shuffle=True),
                    "shards": AsyncS3Dataset.from_shards(f"s3://{BUCKET}/s/shards/", config=config, shuffle=True,
                                                         sample_counts=counts)}

        def mixed():
            ds = mix(sources(), weights, samples_per_epoch=total, seed=1, config=config)
            ds.resolve()
            return ds

        rates = {"alone": [], "mixed": []}
        for repeat in range(args.repeats + 1):  # the first pair warms up the server and caches
            seconds = 0.0
            for ds in sources().values():
                ds.resolve()
                ds.set_epoch(repeat)
                got, took = timed(ds, args.workers)
                assert got == args.samples
                seconds += took
            ds = mixed()
            ds.set_epoch(repeat)
            got, mixed_seconds = timed(ds, args.workers)
            assert got == total, f"the mix gave {got} samples, not {total}"
            if repeat:
                rates["alone"].append(total / seconds)
                rates["mixed"].append(total / mixed_seconds)
            print(f"repeat {repeat}: alone {total / seconds:,.0f}/s, mixed {total / mixed_seconds:,.0f}/s"
                  + (" (warm-up)" if not repeat else ""))

    alone_rate, mixed_rate = statistics.median(rates["alone"]), statistics.median(rates["mixed"])
    ratio = mixed_rate / alone_rate
    table = (f"| run | samples/s (median of {args.repeats}) | vs alone |\n|---|---|---|\n"
             f"| each source alone, one after the other | {alone_rate:,.0f} | 1.00 |\n"
             f"| `loader.mix`, weights {weights} | {mixed_rate:,.0f} | {ratio:.2f} |\n")
    print()
    print(table)
    stamp = datetime.date.today().isoformat()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"mix-{stamp}.md"
    out.write_text(
        f"# Mixing cost, {stamp}\n\n`python -m bench.mix --samples {args.samples} --workers {args.workers} "
        f"--repeats {args.repeats}`: {args.samples} ~110 KiB JPEGs as objects and {args.samples} in "
        f"{args.shards} tar shards, embedded SeaweedFS on 127.0.0.1, raw bytes, batch 32, "
        f"{args.workers} DataLoader workers, alternating runs. Each run reads {total} samples.\n\n{table}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
