"""How mixed are shuffled batches, and how fast: before and after the windowed shuffle.

    flock /tmp/bench.lock python bench/shuffle.py --base 1e9950c --out bench/results/shuffle-DATE.md
    flock /tmp/bench.lock python bench/shuffle.py --base 1e9950c --only shards:sorted:none,objects --rounds 5

Data, on the embedded server, ``--samples`` samples of 10 classes written two ways: sorted by
label (keys in class order, tar shards packed in class order with their index, Hub-style Parquet
files with row groups of 100 rows) and unsorted (the same labels in a seeded random order). Each
mode (objects, shards, Parquet, a ``mix()`` of the shards and the Parquet files, each source
shuffled) x ``batch_size=`` (none, 8, 32) x data runs one epoch with
``shuffle=True`` and a ``DataLoader`` of ``--workers`` workers (batch 8 and 32 where no
``batch_size=`` is dealt), in a child process per revision (``--base`` and ``--head``, commits
exported with ``git archive``), revisions alternated over ``--rounds`` rounds. Per run:
distinct labels per batch against what a uniform permutation gives (``bench.labelmix``),
single-label batches, and rows per second of the epoch (medians over rounds).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "shuffle"
CLASSES = 10


def labels_for(samples: int, data: str) -> list[int]:
    labels = [i * CLASSES // samples for i in range(samples)]
    if data == "unsorted":
        random.Random(7).shuffle(labels)
    return labels


def build(samples: int, size: int, per_shard: int) -> dict[str, bytes]:
    """Every object of both layouts, keyed by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    objects: dict[str, bytes] = {}
    for data in ("sorted", "unsorted"):
        labels = labels_for(samples, data)
        body = [os.urandom(size) for _ in range(samples)]
        for i, label in enumerate(labels):
            objects[f"{data}/obj/{i:06d}.bin"] = body[i]
            objects[f"{data}/obj/{i:06d}.cls"] = str(label).encode()
        entries = []
        for number, start in enumerate(range(0, samples, per_shard)):
            out = io.BytesIO()
            with tarfile.open(fileobj=out, mode="w") as tar:
                for i in range(start, min(samples, start + per_shard)):
                    for ext, value in (("cls", str(labels[i]).encode()), ("bin", body[i])):
                        info = tarfile.TarInfo(f"{i:06d}.{ext}")
                        info.size = len(value)
                        tar.addfile(info, io.BytesIO(value))
            shard = out.getvalue()
            with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
                offsets = [m.offset for m in tar.getmembers()][::2]
            key = f"{data}/tar/{number:05d}.tar"
            objects[key] = shard
            entries.append({"url": f"s3://{BUCKET}/{key}", "samples": len(offsets), "offsets": offsets,
                            "size": len(shard), "etag": hashlib.md5(shard).hexdigest()})  # as `loader index`
        objects[f"{data}/tar/index.json"] = json.dumps({"version": 1, "shards": entries}).encode()
        half = samples // 2
        for number, rows in enumerate((range(0, half), range(half, samples))):
            table = pa.table({"image": [{"bytes": body[i], "path": f"{i}.jpg"} for i in rows],
                              "label": pa.array([labels[i] for i in rows], pa.int64())})
            out = io.BytesIO()
            pq.write_table(table, out, row_group_size=100)
            objects[f"{data}/pq/train-{number:05d}-of-00002.parquet"] = out.getvalue()
    return objects


def runs(only: str = "") -> list[tuple[str, str, int | None, int]]:
    """(mode, data, batch_size=, the DataLoader's batch); ``only``: comma-separated
    ``mode[:data[:batch_size=]]`` filters (e.g. ``shards:sorted:none,mix``), empty for all."""
    out = []
    for mode in ("objects", "shards", "parquet", "mix"):
        for data in ("sorted", "unsorted"):
            for dealt in (None, 8, 32):
                for batch in ((8, 32) if dealt is None else (dealt,)):
                    out.append((mode, data, dealt, batch))
    wanted = [part.split(":") for part in only.split(",") if part]
    return [run for run in out if not wanted or any(
        want == [str(field if field is not None else "none") for field in run[:len(want)]] for want in wanted)]


def child(workers: int, samples: int, only: str) -> None:
    """In a revision's process: every run once, one JSON line each."""
    from torch.utils.data import DataLoader

    from loader import AsyncS3Dataset, S3Config

    sys.path.insert(0, str(ROOT))
    from bench.labelmix import label_mix

    config = S3Config.from_env()
    for mode, data, dealt, batch in runs(only):
        options = {"shuffle": True, "seed": 1, "config": config}
        if dealt is not None:
            options["batch_size"] = dealt
        if mode == "objects":
            ds = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/{data}/obj/", **options)
        elif mode == "shards":
            ds = AsyncS3Dataset.from_shards(f"s3://{BUCKET}/{data}/tar/", **options)
        elif mode == "parquet":
            ds = AsyncS3Dataset.from_parquet(f"s3://{BUCKET}/{data}/pq/", columns=["image", "label"], **options)
        else:  # each sample twice: once from the shards, once from the Parquet files
            from loader import mix

            each = {"shuffle": True, "config": config}
            ds = mix({"tar": AsyncS3Dataset.from_shards(f"s3://{BUCKET}/{data}/tar/", **each),
                      "pq": AsyncS3Dataset.from_parquet(f"s3://{BUCKET}/{data}/pq/", columns=["image", "label"],
                                                        **each)}, **options)
        ds.set_epoch(1)

        def labels(batch_samples):
            return [int(s["cls"]) if "cls" in s else int(s["label"]) for s in batch_samples]

        loader = DataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=labels)
        started = time.perf_counter()
        batches = list(loader)
        seconds = time.perf_counter() - started
        rows = sum(len(b) for b in batches)
        counts = [(2 if mode == "mix" else 1) * samples // CLASSES] * CLASSES
        found = label_mix(batches, counts)
        print(json.dumps({"run": [mode, data, dealt, batch], "rows": rows, "rows_s": rows / seconds,
                          "distinct": found.distinct, "uniform": found.uniform, "single": found.single,
                          "batches": found.batches}), flush=True)


def export(commit: str) -> str:
    """The package as of ``commit``, in a temporary folder (edits made meanwhile do not count)."""
    folder = Path(tempfile.mkdtemp(prefix=f"shuffle-{commit[:12]}-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "loader"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="1e9950c")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--size", type=int, default=8 * 1024)
    parser.add_argument("--per-shard", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", default="", help="mode[:data[:batch_size=]], comma-separated (default: every run)")
    parser.add_argument("--raw", type=Path, default=None, help="also write every round's rows and load as JSON here")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args.workers, args.samples, args.only)
        return
    from loader.tools.devserver import DevServer
    from loader.tools.examples import put_all as upload

    revisions = {"before": export(args.base), "after": export(args.head)}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.head], check=True,
                          capture_output=True, text=True).stdout.strip()
    results: dict[str, dict[tuple, list[dict]]] = {name: {} for name in revisions}
    loads: list[str] = []
    with DevServer(buckets=[BUCKET]) as server:
        chosen = runs(args.only)
        kinds = {"objects": ("obj",), "shards": ("tar",), "parquet": ("pq",), "mix": ("tar", "pq")}
        layouts = {(data, kind) for mode, data, _, _ in chosen for kind in kinds[mode]}  # what the runs read
        objects = build(args.samples, args.size, args.per_shard)
        upload(server.config, {key: body for key, body in objects.items() if tuple(key.split("/")[:2]) in layouts},
               bucket=BUCKET)
        del objects
        env = {**os.environ, **server.config.to_env()}
        for round_ in range(args.rounds):
            for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
                command = [sys.executable, str(Path(__file__).resolve()), "--child",
                           "--workers", str(args.workers), "--samples", str(args.samples), "--only", args.only]
                done = subprocess.run(command, env={**env, "PYTHONPATH": revisions[name]}, cwd=revisions[name],
                                      check=True, capture_output=True, text=True)
                for line in done.stdout.splitlines():
                    row = json.loads(line)
                    results[name].setdefault(tuple(row["run"]), []).append(row)
                load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
                loads.append(f"round {round_} {name}: {load}")
                print(f"round {round_} {name} done (load {load})", file=sys.stderr, flush=True)
    lines = [
        f"{args.samples} samples of {CLASSES} classes ({args.size} B each; shards of {args.per_shard}; "
        f"Parquet: 2 files, row groups of 100 rows), shuffle=True, num_workers={args.workers}, one epoch per "
        f"run, embedded SeaweedFS on loopback; before = {args.base}, after = {head}; medians of "
        f"{args.rounds} alternated rounds. Distinct: mean distinct labels per batch / what a uniform "
        "permutation gives. Single: single-label batches of all full batches. The machine was shared "
        "(other builds running): compare the two columns of one row, not rows across runs.\n",
        "| mode | data | batch_size= | batch | distinct before | distinct after | single before | "
        "single after | rows/s before | rows/s after | after/before | after/before per round |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for run in runs(args.only):
        cells = []
        for name in ("before", "after"):
            rows = results[name][tuple(run)]
            ratio = statistics.median(r["distinct"] / r["uniform"] for r in rows)
            print(f"{run} {name}: " + " ".join(f"{r['rows_s']:.0f}" for r in rows), file=sys.stderr)
            single = statistics.median(r["single"] for r in rows)
            speed = statistics.median(r["rows_s"] for r in rows)
            cells.append((ratio, single, rows[0]["batches"], speed))
        (rb, sb, nb, vb), (ra, sa, na, va) = cells
        mode, data, dealt, batch = run
        paired = " / ".join(f"{a['rows_s'] / b['rows_s']:.2f}"  # the two passes of one round ran side by side
                            for b, a in zip(results["before"][tuple(run)], results["after"][tuple(run)], strict=True))
        lines.append(f"| {mode} | {data} | {dealt or 'none'} | {batch} | {rb:.2f}x | {ra:.2f}x | "
                     f"{sb:.0f}/{nb} | {sa:.0f}/{na} | {vb:,.0f} | {va:,.0f} | {va / vb:.2f} | {paired} |")
    lines.append("\nLoad average (1, 5, 15 min) after each pass: " + "; ".join(loads) + ".")
    table = "\n".join(lines)
    print(table)
    if args.raw:
        args.raw.write_text(json.dumps({"base": args.base, "head": head, "loads": loads, "runs": {
            name: [rows for rows in by_run.values()] for name, by_run in results.items()}}))
    if args.out:
        args.out.write_text(f"# Shuffled batches on label-sorted data, before and after\n\n"
                            f"`python bench/shuffle.py --base {args.base}`\n\n{table}\n")


if __name__ == "__main__":
    main()
