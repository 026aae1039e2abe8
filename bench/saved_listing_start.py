"""CPU from a saved listing to one worker's first job, no network: ``python -m bench.saved_listing_start``.

    python -m bench.saved_listing_start --keys 200000 1000000

Writes a listing snapshot of N synthetic keys (``train/00000000.jpg`` ..., one object per
sample, as ``loader ls --save`` would: with its count of hidden keys and how the keys group into
samples kept beside them), then times in this process, with ``time.process_time``: opening it
(mapped, checksums verified, hidden keys counted), the sample index (read from the snapshot,
the fields' checks), and one worker's share of a shuffled epoch up to its first sample's keys.
This is the part of "the first sample from a saved listing" that grows with N; the backend's
import, the engine's start and the first GET do not. ``--regroup`` saves the snapshot without
the grouping (as a snapshot of an earlier release), so the index groups the keys again.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from loader.datasets.object_samples import build_index, sample_notes
from loader.datasets.partition import partition
from loader.listing.inputs import count_hidden, snapshot_notes
from loader.listing.keylist import KeyList
from loader.listing.snapshots import load_snapshot, save_snapshot

URI = "s3://bkt/train/"


def measure(n: int, regroup: bool = False) -> tuple[float, float, float]:
    keys = KeyList.from_keys((f"train/{i:08d}.jpg" for i in range(n)), sizes=[110_000] * n)
    path = os.path.join(tempfile.mkdtemp(prefix="saved-listing-"), "listing.keys")
    save_snapshot(keys, path, URI, snapshot_notes(None if regroup else sample_notes))
    del keys
    began = time.process_time()
    loaded = load_snapshot(path, URI)
    assert count_hidden(loaded) == 0
    opened = time.process_time()
    index = build_index(loaded, where=URI, prefix="train/")
    indexed = time.process_time()
    share = partition(len(index), seed=0, epoch=0, shuffle=True, rank=0, world_size=1, worker=0,
                      num_workers=2)
    assert index.objects(share[0])
    return opened - began, indexed - opened, time.process_time() - indexed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--regroup", action="store_true",
                        help="a snapshot without the grouping kept: the index groups the keys again")
    args = parser.parse_args()
    print("| keys | open the snapshot | sample index | a worker's share, first sample | total |")
    print("|--:|--:|--:|--:|--:|")
    for n in args.keys:
        opened, indexed, first = measure(n, args.regroup)
        print(f"| {n:,} | {opened * 1e3:.1f} ms | {indexed:.3f} s | {first * 1e3:.2f} ms | "
              f"{opened + indexed + first:.3f} s |")


if __name__ == "__main__":
    main()
