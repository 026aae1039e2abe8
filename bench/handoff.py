"""``python -m bench.handoff``: what the loader costs per sample when the network costs nothing.

Two questions of issue #7 ("cheap hand-off"), answered without a server:

1. **Engine CPU per sample.** ``FetchEngine`` runs one-GET jobs (``loader.datasets.object_samples.object_job``, what
   per-object mode runs) against ``MemoryStore``, a zero-latency in-memory ``ObjectStore`` whose
   every key holds the same 100 KiB ``bytes`` object (ordered and completed delivery), and shard-like
   jobs of 100 items each (interleave and completed, as shard mode). Reported per sample:
   the process's CPU (``time.process_time``), the engine thread's (``time.thread_time`` read inside
   the loop thread when the store opens and when it closes) and the consumer thread's. Then the
   same through ``AsyncS3Dataset.from_keys(..., store=factory)`` iterated directly and through a
   ``DataLoader(num_workers=0)``: what a user pays per sample apart from the network.
2. **The DataLoader's raw-bytes ceiling, bytes vs uint8 tensors.** An in-memory
   ``IterableDataset`` of ~107 KiB random payloads, handed through ``DataLoader(batch_size=32,
   num_workers=w, prefetch_factor=2, persistent_workers=True)`` as sample dicts whose payload is
   ``bytes`` (pickled through the worker's pipe), a ``torch.uint8`` tensor per sample (moved to
   shared memory, one segment per tensor; with both of torch's sharing strategies), or one packed
   uint8 tensor per batch (one shared segment per batch); and ``AsyncS3Dataset`` over
   ``MemoryStore`` holding the same payloads, to see how close the loader gets to the ceiling.

The machine is small and shared: compare ratios within one run, not numbers across runs.

    python -m bench.handoff            # ~2 min on 2 cores
    python -m bench.handoff --quick    # ~40 s
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from loader import AsyncS3Dataset
from loader.datasets.object_samples import object_job, object_sample
from loader.engine.fetch import DEFAULT_MAX_INFLIGHT, EngineLimits, FetchEngine, JobContext, JobFn
from loader.formats.shards import DEFAULT_SHARDS_INFLIGHT
from loader.s3.protocol import ObjectInfo

from .harness import RESULTS_DIR
from .loaders import BATCH_SIZE, PREFETCH_FACTOR

BUCKET = "bench"
ENGINE_PAYLOAD = 100 << 10
HANDOFF_MEAN = 107 << 10  # the bench's JPEGs: ~107 KiB
HANDOFF_SPREAD = 0.1  # payload sizes uniform in mean x (1 +- spread), as JPEG sizes vary
SHARD_ITEMS = 100  # items per job in the shard-like engine runs


# ----------------------------------------------------------------------------- the store


class MemoryStore:
    """A zero-latency ``ObjectStore`` over a dict: ``get`` returns the stored object itself.

    ``get`` never suspends, so a job runs from start to ``emit`` in one step: what is left is the
    engine's own cost. It notes the thread's CPU clock when opened and closed (both happen inside
    the engine's loop thread), which gives the engine thread's CPU for the whole pass.
    """

    def __init__(self, objects: Mapping[str, bytes]) -> None:
        self.objects = objects
        self.cpu_opened = time.thread_time()
        self.cpu_closed: float | None = None

    async def list(self, bucket: str, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        for key in sorted(k for k in self.objects if k.startswith(prefix)):
            yield ObjectInfo(key, len(self.objects[key]))

    async def get(self, bucket: str, key: str, **versions: Any) -> bytes:
        return self.objects[key]  # one version only: a pin has nothing to do

    async def get_range(self, bucket: str, key: str, start: int, end: int | None,
                        **versions: Any) -> bytes:
        return self.objects[key][start:end]

    async def get_if_changed(self, bucket: str, key: str, etag: str, start: int = 0,
                             end: int | None = None, **versions: Any) -> bytes | None:
        return None

    async def stream(self, bucket: str, key: str, start: int = 0,
                     chunk_size: int = 1 << 20, **versions: Any) -> AsyncIterator[bytes]:
        data = self.objects[key]
        for offset in range(start, len(data), chunk_size):
            yield data[offset:offset + chunk_size]

    async def put(self, bucket: str, key: str, data: bytes) -> None:
        raise PermissionError("MemoryStore is read-only")

    async def aclose(self) -> None:
        self.cpu_closed = time.thread_time()

    @property
    def engine_cpu(self) -> float:
        """CPU seconds of the engine thread between open and close."""
        return (self.cpu_closed or time.thread_time()) - self.cpu_opened


@dataclasses.dataclass
class MemoryStoreFactory:
    """``store=`` for ``AsyncS3Dataset`` and ``FetchEngine``: opens a ``MemoryStore`` in the loop.

    Picklable (a module-level class holding a dict), so DataLoader workers can get one too.
    """

    objects: Mapping[str, bytes]
    opened: list[MemoryStore] = dataclasses.field(default_factory=list)

    async def __call__(self) -> MemoryStore:
        store = MemoryStore(self.objects)
        self.opened.append(store)
        return store


# ----------------------------------------------------------------------------- part 1: the engine


@dataclasses.dataclass
class CpuSplit:
    """CPU per sample of one pass, in microseconds: the process, the engine thread, the consumer."""

    samples: int
    seconds: float
    process_us: float
    engine_us: float | None
    consumer_us: float

    @property
    def rate(self) -> float:
        return self.samples / self.seconds


def _timed_pass(iterate: Callable[[], int], factory: MemoryStoreFactory) -> CpuSplit:
    """Run ``iterate`` (which returns how many samples it saw) and split its CPU."""
    gc.collect()
    wall, process, consumer = time.perf_counter(), time.process_time(), time.thread_time()
    samples = iterate()
    consumer = time.thread_time() - consumer
    process = time.process_time() - process
    wall = time.perf_counter() - wall
    engine = sum(store.engine_cpu for store in factory.opened) if factory.opened else None
    return CpuSplit(samples, wall, 1e6 * process / samples,
                    None if engine is None else 1e6 * engine / samples, 1e6 * consumer / samples)


def _median_split(runs: list[CpuSplit]) -> CpuSplit:
    """The run with the median process CPU (one real run, not a mix of fields)."""
    return sorted(runs, key=lambda r: r.process_us)[len(runs) // 2]


def shard_like_job(bucket: str, key: str, position: int, items: int) -> JobFn:
    """A job like a shard's: one GET, then ``items`` samples emitted one by one (no tar parsing,
    so that what is measured is the engine's hand-off of many items per job)."""

    async def job(ctx: JobContext) -> None:
        data = await ctx.store.get(bucket, key)
        for item in range(items):
            await ctx.emit(((position, item), object_sample(bucket, key, data)), len(data))

    return job


def engine_pass(keys: list[str], objects: Mapping[str, bytes], delivery: str,
                items_per_job: int = 1) -> CpuSplit:
    """``FetchEngine`` over one-GET jobs (``object_job``, or ``shard_like_job`` when
    ``items_per_job`` > 1), default limits, ``delivery`` order."""
    factory = MemoryStoreFactory(objects)

    def iterate() -> int:
        if items_per_job == 1:
            jobs = (object_job(BUCKET, key, position) for position, key in enumerate(keys))
        else:
            jobs = (shard_like_job(BUCKET, key, position, items_per_job)
                    for position, key in enumerate(keys[:len(keys) // items_per_job]))
        # shard mode runs DEFAULT_SHARDS_INFLIGHT jobs at a time, per-object mode max_inflight
        inflight = DEFAULT_MAX_INFLIGHT if items_per_job == 1 else DEFAULT_SHARDS_INFLIGHT
        engine = FetchEngine(jobs, factory,
                             limits=EngineLimits(delivery=delivery, max_inflight=inflight))
        count = 0
        for _ in engine:
            count += 1
        return count

    return _timed_pass(iterate, factory)


def dataset_pass(keys: list[str], objects: Mapping[str, bytes], dataloader: bool) -> CpuSplit:
    """``AsyncS3Dataset.from_keys`` over the memory store, iterated directly or by a
    ``DataLoader(num_workers=0, batch_size=32)`` (its fetch and collate in the same process)."""
    factory = MemoryStoreFactory(objects)
    dataset = AsyncS3Dataset.from_keys(BUCKET, keys, store=factory)

    def iterate() -> int:
        if not dataloader:
            return sum(1 for _ in dataset)
        loader = DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=0)
        return sum(len(batch["__key__"]) for batch in loader)

    return _timed_pass(iterate, factory)


def measure_engine(samples: int, repeats: int) -> list[dict[str, Any]]:
    """Part 1: every delivery mode, then the dataset path; the median of ``repeats`` passes."""
    payload = random.Random(0).randbytes(ENGINE_PAYLOAD)
    keys = [f"train/{i:06d}.jpg" for i in range(samples)]
    objects = dict.fromkeys(keys, payload)  # the same bytes object for every key
    # per-object mode delivers "ordered" or "completed"; shard mode "interleave" or "completed"
    # (one-item jobs under "interleave" are a worst case no dataset uses: a lane takes its next
    # job only once the consumer has drained the last one, so each hand-off carries ~1 item)
    cases: list[tuple[str, Callable[[], CpuSplit]]] = [
        (f"FetchEngine, one-GET jobs ({DEFAULT_MAX_INFLIGHT} in flight), {delivery}",
         lambda d=delivery: engine_pass(keys, objects, d)) for delivery in ("ordered", "completed")
    ]
    cases += [
        (f"FetchEngine, {SHARD_ITEMS}-item jobs ({DEFAULT_SHARDS_INFLIGHT} in flight), {delivery}",
         lambda d=delivery: engine_pass(keys, objects, d, SHARD_ITEMS))
        for delivery in ("interleave", "completed")
    ]
    cases += [("AsyncS3Dataset.from_keys, iterated", lambda: dataset_pass(keys, objects, False)),
              ("AsyncS3Dataset + DataLoader(num_workers=0)", lambda: dataset_pass(keys, objects, True))]
    rows = []
    for name, run in cases:
        run()  # warm-up: imports, first-use hooks, allocator
        best = _median_split([run() for _ in range(repeats)])
        rows.append({"case": name, **dataclasses.asdict(best), "samples_per_s": best.rate})
        print(f"  {name}: {best.process_us:.1f} us/sample", file=sys.stderr)
    return rows


# ----------------------------------------------------------------------------- part 2: the DataLoader


def make_payloads(count: int, seed: int = 0) -> dict[str, bytes]:
    """``count`` random payloads of ~107 KiB, keyed like the bench's objects."""
    rng = random.Random(seed)
    low, high = int(HANDOFF_MEAN * (1 - HANDOFF_SPREAD)), int(HANDOFF_MEAN * (1 + HANDOFF_SPREAD))
    return {f"objects/{i:06d}.jpg": rng.randbytes(rng.randint(low, high)) for i in range(count)}


def as_tensor(data: bytes) -> torch.Tensor:
    """A uint8 tensor with its own copy of ``data`` (``bytes`` are read-only; tensors are not)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class Payloads(IterableDataset):
    """The ceiling: sample dicts like ours (``__key__``, ``__url__``, ``jpg``) from RAM, split
    across workers; ``jpg`` is the ``bytes`` or, with ``tensors``, a uint8 tensor per sample."""

    def __init__(self, objects: Mapping[str, bytes], tensors: bool) -> None:
        self.items = sorted(objects.items())
        self.tensors = tensors

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for key, data in self.items[worker::workers]:
            yield {"__key__": key.rsplit(".", 1)[0], "__url__": f"s3://{BUCKET}/{key}",
                   "jpg": as_tensor(data) if self.tensors else data}


def collate_lists(batch: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """``{field: [value per sample]}``: what ``default_collate`` gives for str and bytes fields,
    and also for tensors of different sizes (``default_collate`` would try to stack them)."""
    return {name: [sample[name] for sample in batch] for name in batch[0]}


def collate_packed(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """All payloads of a batch in one uint8 tensor plus ``offsets`` (length B + 1).

    In a worker the tensor is allocated in shared memory, as ``default_collate`` does for stacked
    batches, so the hand-off moves one segment per batch and the main process copies nothing;
    sample ``i`` is the view ``jpg[offsets[i]:offsets[i + 1]]``.
    """
    payloads = [sample["jpg"] for sample in batch]
    offsets = [0]
    for data in payloads:
        offsets.append(offsets[-1] + len(data))
    if get_worker_info() is not None:
        packed = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(offsets[-1]))
    else:
        packed = torch.empty(offsets[-1], dtype=torch.uint8)
    view = packed.numpy()
    for data, start, end in zip(payloads, offsets, offsets[1:]):
        view[start:end] = memoryview(data)
    return {"__key__": [s["__key__"] for s in batch], "__url__": [s["__url__"] for s in batch],
            "jpg": packed, "offsets": torch.tensor(offsets)}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of handing payloads from workers to the main process."""

    name: str
    build: Callable[[Mapping[str, bytes]], IterableDataset]
    collate: Callable[[list[dict[str, Any]]], Any]
    sharing: str = "file_descriptor"  # torch.multiprocessing sharing strategy for tensors


VARIANTS = (
    Variant("bytes (pickled)", lambda objects: Payloads(objects, tensors=False), collate_lists),
    Variant("uint8 tensor per sample", lambda objects: Payloads(objects, tensors=True), collate_lists),
    Variant("uint8 tensor per sample, file_system sharing",
            lambda objects: Payloads(objects, tensors=True), collate_lists, sharing="file_system"),
    Variant("one packed uint8 tensor per batch", lambda objects: Payloads(objects, tensors=False),
            collate_packed),
    Variant("AsyncS3Dataset over MemoryStore (bytes)",
            lambda objects: AsyncS3Dataset.from_keys(BUCKET, sorted(objects),
                                                     store=MemoryStoreFactory(dict(objects))),
            collate_lists),
)


def _tree_cpu() -> dict[int, float]:
    """CPU seconds of this process and its descendants (DataLoader workers), per pid."""
    me = psutil.Process()
    out = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        out[proc.pid] = times.user + times.system
    return out


def _epoch(loader: DataLoader, dataset: Any, epoch: int) -> tuple[int, float]:
    """One full pass: (samples, seconds); ``iter()`` (waking persistent workers) untimed."""
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)
    batches = iter(loader)
    began, samples = time.perf_counter(), 0
    for batch in batches:
        samples += len(batch["__key__"])
    return samples, time.perf_counter() - began


def handoff_run(variant: Variant, objects: Mapping[str, bytes], workers: int,
                epochs: int) -> dict[str, Any]:
    """Warm-up epoch, then ``epochs`` timed ones: median samples/s, client CPU per sample."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(variant.sharing)  # workers fork with it
    dataset = variant.build(objects)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=workers,
                        prefetch_factor=PREFETCH_FACTOR, persistent_workers=True,
                        collate_fn=variant.collate)
    try:
        _epoch(loader, dataset, 0)
        before = _tree_cpu()
        timed = [_epoch(loader, dataset, e) for e in range(1, epochs + 1)]
        after = _tree_cpu()
    finally:
        del loader  # persistent workers stop here
        gc.collect()
        torch.multiprocessing.set_sharing_strategy(previous)
    samples = sum(n for n, _ in timed)
    if any(n != len(objects) for n, _ in timed):
        raise RuntimeError(f"{variant.name}: epochs gave {[n for n, _ in timed]} samples, "
                           f"expected {len(objects)}")
    cpu = sum(value - before.get(pid, 0.0) for pid, value in after.items())
    rate = statistics.median(n / s for n, s in timed)
    mean = sum(map(len, objects.values())) / len(objects)
    return {"variant": variant.name, "workers": workers, "samples_per_s": rate,
            "mb_per_s": rate * mean / 1e6, "client_us": 1e6 * cpu / samples,
            "rates": [n / s for n, s in timed]}


def measure_handoff(samples: int, workers: tuple[int, ...], epochs: int,
                    rounds: int) -> list[dict[str, Any]]:
    """Part 2: every variant at every worker count, ``rounds`` times in turn, so that a change
    in the machine's load (it is shared) spreads over all variants instead of hitting one."""
    objects = make_payloads(samples)
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    handoff_run(VARIANTS[0], objects, workers[0], 1)  # untimed: the first run of a process is slower
    for round_ in range(rounds):
        for w in workers:
            for variant in VARIANTS:
                row = handoff_run(variant, objects, w, epochs)
                runs.setdefault((w, variant.name), []).append(row)
                print(f"  round {round_ + 1} w={w} {variant.name}: {row['samples_per_s']:.0f}/s, "
                      f"{row['client_us']:.0f} us/sample", file=sys.stderr)
    rows = []
    for done in runs.values():
        rates = [rate for row in done for rate in row["rates"]]
        rate = statistics.median(rates)
        rows.append({**done[0], "samples_per_s": rate, "mb_per_s": rate * done[0]["mb_per_s"]
                     / done[0]["samples_per_s"], "client_us": statistics.mean(r["client_us"] for r in done),
                     "rates": rates})
    return rows


# ----------------------------------------------------------------------------- report


def engine_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| case | samples/s | process CPU µs/sample | engine thread µs | consumer thread µs |",
           "|---|---:|---:|---:|---:|"]
    for r in rows:
        engine = "–" if r["engine_us"] is None else f"{r['engine_us']:.1f}"
        out.append(f"| {r['case']} | {r['samples_per_s']:,.0f} | {r['process_us']:.1f} | "
                   f"{engine} | {r['consumer_us']:.1f} |")
    return out


def handoff_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| num_workers | payload | samples/s | MB/s | vs bytes | client CPU µs/sample |",
           "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        base = next(b for b in rows if b["workers"] == r["workers"] and b["variant"] == VARIANTS[0].name)
        out.append(f"| {r['workers']} | {r['variant']} | {r['samples_per_s']:,.0f} | "
                   f"{r['mb_per_s']:,.0f} | {r['samples_per_s'] / base['samples_per_s']:.2f}× | "
                   f"{r['client_us']:,.0f} |")
    return out


def report(engine: list[dict[str, Any]], handoff: list[dict[str, Any]], args: argparse.Namespace) -> str:
    cores = psutil.cpu_count()
    load = ", ".join(f"{x:.2f}" for x in psutil.getloadavg())
    lines = [
        "# Hand-off benchmark (`python -m bench.handoff`)", "",
        f"{cores} cores, load average {load} at the end; torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}. Compare ratios within this run.", "",
        f"## Engine CPU per sample ({args.engine_samples:,} one-GET jobs, zero-latency in-memory "
        f"store, {ENGINE_PAYLOAD >> 10} KiB payload, median of {args.repeats})", "",
        *engine_table(engine), "",
        "Process CPU is everything the process spent (engine thread + consumer + thread start/stop); "
        "the engine thread's is read inside the loop thread when the store opens and closes. "
        "Goal: ≤ 30 µs per sample.", "",
        f"## DataLoader hand-off ({args.handoff_samples:,} samples of ~{HANDOFF_MEAN >> 10} KiB, "
        f"batch_size={BATCH_SIZE}, prefetch_factor={PREFETCH_FACTOR}, persistent workers, "
        f"median of {args.rounds} × {args.epochs} epochs, variants run in turn)", "",
        *handoff_table(handoff), "",
        "Client CPU: user+system of the main process and its workers over the timed epochs. "
        "\"vs bytes\": samples/s relative to the bytes ceiling at the same num_workers.", "",
    ]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.handoff",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer samples, epochs and repeats (~40 s)")
    p.add_argument("--engine-samples", type=int, help="jobs per engine pass (default 20000; quick 5000)")
    p.add_argument("--handoff-samples", type=int, help="samples per epoch (default 2000; quick 1000)")
    p.add_argument("--workers", default="2,4", help="num_workers values (default 2,4)")
    p.add_argument("--epochs", type=int, help="timed epochs (default 5; quick 2)")
    p.add_argument("--rounds", type=int, help="DataLoader runs per variant, in turn (default 2; quick 1)")
    p.add_argument("--repeats", type=int, help="engine passes per case (default 5; quick 3)")
    p.add_argument("--skip", choices=("engine", "handoff"), help="leave one part out")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "handoff.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.engine_samples = args.engine_samples or (5_000 if args.quick else 20_000)
    args.handoff_samples = args.handoff_samples or (1_000 if args.quick else 2_000)
    args.epochs = args.epochs or (2 if args.quick else 5)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.rounds = args.rounds or (1 if args.quick else 2)
    workers = tuple(int(w) for w in args.workers.split(","))
    torch.set_num_threads(1)  # as in bench.child: no intra-op threads spinning in the main process
    # The DataLoader part first: it forks workers, which is best done before this process has run
    # any engine thread.
    handoff = ([] if args.skip == "handoff" else
               measure_handoff(args.handoff_samples, workers, args.epochs, args.rounds))
    engine = [] if args.skip == "engine" else measure_engine(args.engine_samples, args.repeats)
    text = report(engine, handoff, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
