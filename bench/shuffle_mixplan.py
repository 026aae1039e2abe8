"""What one DataLoader worker of a shuffled mix spends planning its epoch, before and after.

    flock /tmp/bench.lock python bench/shuffle_mixplan.py --base f6d471b --positions 400000

A mix of two sources read in lanes (100 units each, counts only: no server, no reads), one epoch
of ``--positions`` samples; the main process resolves the mix (as ``set_epoch`` does before its
workers start), then worker 0 of ``--workers`` plans its share: where each of its positions comes
from and the reads of its lanes (``MixSource.stream`` up to the engine). Each revision's package
(``git archive``) in a child process, revisions alternated over ``--rounds`` rounds; medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class _Counted:
    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def count(self) -> int:
        return sum(self.counts)

    def deals_lanes(self) -> bool:
        return True

    def unit_counts(self) -> list[int]:
        return self.counts

    def lane_reads(self, segments, sizes, wanted, *, seed, epoch):  # type: ignore[no-untyped-def]
        from loader.datasets.protocol import Read

        async def job(ctx) -> None:  # type: ignore[no-untyped-def]
            pass

        # one read for all: the source's own cutting is the same before and after, not measured
        return [(Read(job, len(wanted)), list(range(len(wanted))))]

    def resolve(self) -> None:
        pass


class _Options:
    memory_budget = None
    queue_bytes = 0
    batch_size = None

    def preload_backend(self) -> None:
        pass

    def limits(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None


def child(positions: int, workers: int) -> None:
    from loader.datasets import mix
    from loader.datasets.object_source import ObjectProgress
    from loader.datasets.protocol import Slot

    parts = [mix.Part(name, _Counted([positions // 200] * 100), None, True, "continue", seed)
             for seed, name in enumerate(("a", "b"))]
    source = mix.MixSource(parts, _Options(), None)  # type: ignore[arg-type]
    source.resolve()  # the main process, before its workers start
    slot = Slot(rank=0, world_size=1, worker=0, num_workers=workers, seed=1, epoch=1, shuffle=True, policy="pad")
    started = time.perf_counter()
    for _ in source.stream(slot, ObjectProgress(None), lambda jobs, limits, schedule: list(jobs)):
        pass
    print(json.dumps({"seconds": time.perf_counter() - started}))


def main() -> None:
    from bench.shuffle import export

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="f6d471b")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--positions", type=int, default=400_000)
    parser.add_argument("--workers", default="2,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, type=int)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    trees = {"before": export(args.base), "after": export(args.head)}
    found: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
            for workers in map(int, args.workers.split(",")):
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(args.positions),
                                      str(workers)], env={"PYTHONPATH": f"{trees[name]}:{ROOT}", "PATH": ""},
                                     cwd=trees[name], check=True, capture_output=True, text=True).stdout
                found.setdefault((name, workers), []).append(json.loads(out)["seconds"])
    print(f"{args.positions:,} positions, 2 sources in lanes, worker 0 of N; medians of {args.rounds} "
          f"alternated rounds (before = {args.base}, after = {args.head})\n")
    print("| workers | before s | after s | after/before | rounds before | rounds after |")
    print("|--:|--:|--:|--:|---|---|")
    for workers in map(int, args.workers.split(",")):
        before, after = found["before", workers], found["after", workers]
        b, a = statistics.median(before), statistics.median(after)
        print(f"| {workers} | {b:.2f} | {a:.2f} | {a / b:.2f} | {' '.join(f'{x:.2f}' for x in before)} | "
              f"{' '.join(f'{x:.2f}' for x in after)} |")


if __name__ == "__main__":
    main()
