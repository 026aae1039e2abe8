"""How mixed are the batches? Per-object mode against shard mode on shards packed by class.

    python -m bench.batch_mix --out bench/results/batch-mix-DATE.md

The demo's layout: ``--samples`` samples of 3 classes, keys sorted by class
(``train/<class>/<n>.jpg``), as objects and as 8 tar shards packed two ways, in key order (every
shard one class) and in a seeded random order (``loader shard --shuffle``, the demo since then),
plus the class-sorted samples in 4x more, smaller shards. Each runs through ``AsyncS3Dataset``
with ``shuffle=True`` and a ``DataLoader`` of ``--workers`` workers, batch 64, two epochs, on the
embedded server. Per batch: the share of its most common class (1/3 is perfectly even; a batch
drawn at random from the whole set averages ~0.42 at 64 samples) and the number of classes in it.
Payloads are random bytes of ``--size`` (mixing does not look at them).
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from loader import AsyncS3Dataset
from loader.tools.demo import pack_shards
from loader.tools.devserver import DevServer
from loader.tools.examples import put_all as upload

BUCKET = "mix"
CLASSES = ("red", "green", "blue")
BATCH = 64


def label_of(sample: dict[str, Any]) -> int:
    """The class: the shard's ``.cls`` member, or the key's folder."""
    if "cls" in sample:
        return int(sample["cls"])
    return CLASSES.index(sample["__key__"].rsplit("/", 2)[-2])


def batches(dataset: AsyncS3Dataset, workers: int, epochs: int) -> list[list[int]]:
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=lambda samples: [label_of(s) for s in samples])
    out: list[list[int]] = []
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        out.extend(batch for batch in loader if len(batch) == BATCH)
    del loader
    return out


def mix(labels: list[list[int]]) -> tuple[float, float, float]:
    """(mean share of the top class, worst batch's top share, mean classes per batch)."""
    tops = [Counter(batch).most_common(1)[0][1] / len(batch) for batch in labels]
    return statistics.mean(tops), max(tops), statistics.mean(len(set(batch)) for batch in labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--size", type=int, default=48 * 1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    per_class = args.samples // len(CLASSES)
    samples = {f"train/{name}/{i:05d}.jpg": os.urandom(args.size)
               for name in CLASSES for i in range(per_class)}
    labels = {key: CLASSES.index(key.split("/")[1]) for key in samples}
    per_shard = -(-len(samples) // 8)
    layouts = {
        "sorted": dict(pack_shards(samples, per_shard, labels)),
        "shuffled": dict(pack_shards(samples, per_shard, labels, seed=0)),
        "sorted32": dict(pack_shards(samples, -(-len(samples) // 32), labels)),
    }
    objects = dict(samples)
    for layout, shards in layouts.items():
        objects.update({f"{layout}/{key}": data for key, data in shards.items()})
    rows = []
    with DevServer(buckets=[BUCKET]) as server:
        config = server.config
        upload(config, objects, bucket=BUCKET)
        runs = [
            ("per-object, shuffle=True", AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", shuffle=True,
                                                                  config=config)),
            ("8 shards packed in class order, shuffle=True (buffer 1000)",
             AsyncS3Dataset.from_shards(f"s3://{BUCKET}/sorted/shards/", shuffle=True, config=config)),
            ("32 shards packed in class order, shuffle=True",
             AsyncS3Dataset.from_shards(f"s3://{BUCKET}/sorted32/shards/", shuffle=True, config=config)),
            ("8 shards packed shuffled (`loader shard --shuffle`), shuffle=True",
             AsyncS3Dataset.from_shards(f"s3://{BUCKET}/shuffled/shards/", shuffle=True, config=config)),
        ]
        for name, dataset in runs:
            top, worst, classes = mix(batches(dataset, args.workers, args.epochs))
            rows.append(f"| {name} | {top:.2f} | {worst:.2f} | {classes:.2f} |")
    table = "\n".join([
        f"{args.samples} samples of 3 classes, batch {BATCH}, num_workers={args.workers}, "
        f"{args.epochs} epochs (full batches only)\n",
        "| data | top class share per batch, mean | worst batch | classes per batch |",
        "|---|--:|--:|--:|", *rows])
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
