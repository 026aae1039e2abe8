"""``mix()``: weighted mixing of per-object and shard sources, exact per window, the same on any
topology, resumable on another one, one engine for all sources (in-memory store)."""

from __future__ import annotations

import collections
import io
import itertools
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, ConfigError, Limits, Split, mix
from loader.datasets.mix_order import DrawOrder, apportion
from loader.engine import fetch

from fakes import FakeStore, payloads, reusable

BATCH = 4


def build_store():
    """Three sources in one bucket: 60 objects, 5 plain shards of 9, 4 gzip shards of 7."""
    fake = FakeStore.with_objects("bucket", payloads(60, size=16, prefix="web/"))
    counts = {}
    for name, shards, per, mode in (("plain", 5, 9, "w"), ("gz", 4, 7, "w:gz")):
        for number in range(shards):
            out = io.BytesIO()
            with tarfile.open(fileobj=out, mode=mode) as tar:
                for i in range(per):
                    data = f"{name}-{number}-{i}".encode()
                    info = tarfile.TarInfo(f"{name}{number:02d}/{i:04d}.txt")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
            suffix = ".tar" if mode == "w" else ".tar.gz"
            key = f"{name}/{number}{suffix}"
            fake.objects["bucket", key] = out.getvalue()
            counts[f"s3://bucket/{key}"] = per
    return fake, counts


FAKE, COUNTS = build_store()
SIZES = {"web": 60, "plain": 45, "gz": 28}


def sources(**options):
    store = reusable(FAKE)
    web = AsyncS3Dataset.from_prefix("s3://bucket/web/", shuffle=True, store=store)
    plain = AsyncS3Dataset.from_shards("s3://bucket/plain/", shuffle=True, store=store, sample_counts=COUNTS)
    gz = AsyncS3Dataset.from_shards("s3://bucket/gz/", shuffle=True, store=store, sample_counts=COUNTS)
    return {"web": web, "plain": plain, "gz": gz}, store


def make(weights=None, **options):
    datasets, store = sources()
    options.setdefault("seed", 3)
    return mix(datasets, weights, store=store, **options)


def run(world_size, num_workers, epoch=1, steps=None, resume=None, lanes=None, **options):
    """Every rank's batches of one epoch (ranks simulated with rank=/world_size=); ``lanes``:
    the rank x worker slots of the run that started the epoch, where another one did."""
    out, probe = [], None
    for rank in range(world_size):
        ds = make(batch_size=BATCH, split=Split(rank=rank, world_size=world_size), **options)
        if resume is not None or lanes is not None:
            ds.resume(epoch=epoch, samples_seen=resume or 0, lanes=lanes)
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=BATCH, num_workers=num_workers,
                            collate_fn=lambda batch: [(s["__source__"], s["__key__"]) for s in batch])
        out.append(list(itertools.islice(loader, steps)))
        probe = ds
    return out, probe


def global_order(per_rank):
    """The job's samples in the order of the epoch: step by step, rank by rank."""
    steps = max(len(batches) for batches in per_rank)
    return [s for step in range(steps) for batches in per_rank if step < len(batches) for s in batches[step]]


WEIGHTS = {"web": 0.5, "plain": 0.3, "gz": 0.2}


def test_counts_per_source_follow_the_weights_and_every_sample_carries_its_source():
    ds = make(WEIGHTS, samples_per_epoch=100)
    ds.set_epoch(0)
    got = [(s["__source__"], s["__key__"]) for s in ds]
    assert len(got) == 100
    assert collections.Counter(name for name, _ in got) == {"web": 50, "plain": 30, "gz": 20}
    names = [name for name, _ in got]
    for name, weight in WEIGHTS.items():
        seen = 0
        for t, current in enumerate(names, 1):
            seen += current == name
            assert abs(seen - weight * t) < 1, f"prefix {t}: {name} {seen} vs {weight * t}"
    # a source with fewer samples than its share repeats only after every one of its samples
    gz = [key for name, key in got if name == "gz"]
    assert len(set(gz)) == 20


def test_the_order_is_the_same_on_any_topology():
    """Given the lanes of the run that started the epoch (shuffled shards are dealt to them),
    every topology reads the same order."""
    three, _ = run(3, 2, samples_per_epoch=90)
    one, _ = run(1, 0, samples_per_epoch=90, lanes=6)
    two, _ = run(2, 3, samples_per_epoch=90, lanes=6)
    assert global_order(one) == global_order(three) == global_order(two)
    assert [len(b) for b in three] == [8, 8, 8], "every rank the same number of batches"


def test_resume_on_another_topology_continues_the_mix_exactly():
    whole, _ = run(1, 0, epoch=2, samples_per_epoch=96, lanes=6)
    head, probe = run(3, 2, epoch=2, steps=3, samples_per_epoch=96)
    seen = probe.samples_seen(3)
    with pytest.raises(ConfigError, match="lanes="):
        make(batch_size=BATCH, split=Split(rank=0, world_size=2)).resume(epoch=2, samples_seen=seen)
    tail, _ = run(2, 3, epoch=2, resume=seen, lanes=6, samples_per_epoch=96)
    assert global_order(head) + global_order(tail) == global_order(whole)


def test_state_dict_resumes_in_the_same_place():
    ds = make(WEIGHTS, samples_per_epoch=70)
    ds.set_epoch(4)
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(23)]
    state = ds.state_dict()
    del it
    again = make(WEIGHTS, samples_per_epoch=70)
    again.load_state_dict(state)
    rest = [s["__key__"] for s in again]
    whole = make(WEIGHTS, samples_per_epoch=70)
    whole.set_epoch(4)
    assert head + rest == [s["__key__"] for s in whole]


def test_continue_sees_every_sample_before_any_repeats_across_epochs():
    ds = make({"web": 1, "plain": 1, "gz": 1}, samples_per_epoch=30)  # 10 a source per epoch
    seen = collections.defaultdict(list)
    for epoch in range(9):
        ds.set_epoch(epoch)
        for sample in ds:
            seen[sample["__source__"]].append(sample["__key__"])
    for name, size in SIZES.items():
        keys = seen[name]
        for start in range(0, len(keys) - size + 1, size):
            assert len(set(keys[start:start + size])) == size, f"{name}: a pass repeats a sample"


def test_epoch_sampling_starts_each_epoch_on_a_fresh_pass():
    ds = make({"web": 1, "plain": 1, "gz": 1}, samples_per_epoch=30, sampling={"web": "epoch"})
    firsts = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        firsts.append([s["__key__"] for s in ds if s["__source__"] == "web"])
    assert all(len(set(keys)) == 10 for keys in firsts)
    assert firsts[0] != firsts[1] != firsts[2]


def test_the_default_epoch_is_the_longest_without_a_repeat():
    ds = make(WEIGHTS)
    # web 60 / 0.5 = 120, plain 45 / 0.3 = 150, gz 28 / 0.2 = 140: 120 samples
    assert len(ds) == 120
    sized = make()  # no weights: proportional to sizes, every sample once
    assert len(sized) == sum(SIZES.values())
    sized.set_epoch(0)
    got = [(s["__source__"], s["__key__"]) for s in sized]
    assert len(set(got)) == len(got) == sum(SIZES.values())


def test_one_engine_serves_every_source(monkeypatch):
    engines = []
    real = fetch.FetchEngine.__init__

    def counting(self, *args, **kwargs):
        engines.append(kwargs.get("limits"))
        real(self, *args, **kwargs)

    monkeypatch.setattr(fetch.FetchEngine, "__init__", counting)
    ds = make(WEIGHTS, samples_per_epoch=40)
    assert len(list(ds)) == 40
    assert len(engines) == 1 and engines[0].delivery == "scheduled"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"weights": {"web": 1}}, "one weight per dataset"),
    ({"weights": {"web": -1, "plain": 1, "gz": 1}}, r"weights\['web'\]=-1"),
    ({"weights": {"web": float("inf"), "plain": 1, "gz": 1}}, r"weights\['web'\]=inf must be a finite"),
    ({"weights": {"web": float("nan"), "plain": 1, "gz": 1}}, r"weights\['web'\]=nan must be a finite"),
    ({"weights": {"web": 0, "plain": 0, "gz": 0}}, "above zero"),
    ({"samples_per_epoch": 0}, "samples_per_epoch=0"),
    ({"sampling": "sometimes"}, "sampling='sometimes'"),
])
def test_bad_mix_arguments_are_named(kwargs, match):
    datasets, store = sources()
    with pytest.raises(ConfigError, match=match):
        mix(datasets, store=store, **kwargs)


def test_a_source_setting_what_the_mix_decides_is_refused():
    datasets, store = sources()
    datasets["web"] = AsyncS3Dataset.from_prefix("s3://bucket/web/", store=store, batch_size=8)
    with pytest.raises(ConfigError, match=r"mix source 'web' sets batch_size=8.*give batch_size=... to mix"):
        mix(datasets, store=store)


def test_unindexed_shards_in_a_mix_say_how_to_count_them():
    store = reusable(FAKE)
    datasets = {"web": AsyncS3Dataset.from_prefix("s3://bucket/web/", store=store),
                "plain": AsyncS3Dataset.from_shards("s3://bucket/plain/", store=store)}
    ds = mix(datasets, store=store)
    with pytest.raises(ConfigError, match="mix source 'plain'.*sample_counts"):
        ds.set_epoch(0)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=6).filter(any))
def test_interleave_prefixes_hold_every_share_within_tijdemans_bound(counts):
    order = [s for s, _ in DrawOrder(counts).walk()]
    total = len(order)
    assert total == sum(counts)
    active = len([n for n in counts if n])
    bound = 1 - 1 / (2 * active - 2) if active > 1 else 0  # Tijdeman's
    running = [0] * len(counts)
    for t, s in enumerate(order, 1):
        running[s] += 1
        for source, n in enumerate(counts):
            assert abs(running[source] - n * t / total) <= bound + 1e-12
    if len([n for n in counts if n]) <= 2:  # two sources: every window within one
        for source, n in enumerate(counts):
            prefix = [0]
            for s in order:
                prefix.append(prefix[-1] + (s == source))
            deviation = [prefix[t] - n * t / total for t in range(total + 1)]
            assert max(deviation) - min(deviation) < 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=5).filter(any), st.data())
def test_interleave_locate_agrees_with_the_walk(counts, data):
    interleave = DrawOrder(counts)
    walk = list(interleave.walk())
    positions = data.draw(st.lists(st.integers(0, len(walk) - 1), max_size=20))
    assert interleave.locate(positions) == [walk[p] for p in positions]
    for s, n in enumerate(counts):
        assert [k for t, k in walk if t == s] == list(range(n))


@given(st.integers(0, 10_000), st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=6)
       .filter(lambda w: sum(w) > 0))
def test_apportion_sums_and_stays_within_one_of_each_share(total, weights):
    counts = apportion(total, weights)
    assert sum(counts) == total
    whole = sum(weights)
    for count, weight in zip(counts, weights):
        assert abs(count - total * weight / whole) < 1


def test_a_slow_source_does_not_stall_the_others_before_the_buffer_is_full():
    """The first object of one source takes a second; meanwhile the rest of the mix (both
    sources) is fetched ahead, up to the queue's bound and no further."""
    slow_first = "a/000000.bin"
    fake = FakeStore.with_objects("bucket", {**payloads(40, size=16, prefix="a/"),
                                             **payloads(200, size=16, prefix="b/")},
                                  latency=lambda key: 1.0 if key == slow_first else 0.0)
    store = reusable(fake)
    datasets = {"a": AsyncS3Dataset.from_prefix("s3://bucket/a/", store=store),
                "b": AsyncS3Dataset.from_prefix("s3://bucket/b/", store=store)}
    with pytest.deprecated_call(match="queue_items="):  # the queue's own size has no new spelling
        ds = mix(datasets, {"a": 1, "b": 1}, samples_per_epoch=80, store=store,
                 limits=Limits(concurrency=8), queue_items=24)
    ds.set_epoch(0)
    samples = list(ds)
    assert samples[0]["__source__"] == "a" and len(samples) == 80
    # what had started by the time the slow object arrived (the consumer's pace plays no part)
    slow_started = next(at for at, key in fake.gets_started if key == slow_first)
    while_waiting = [key for at, key in fake.gets_started if key != slow_first and at < slow_started + 0.9]
    fast = [key for key in while_waiting if key.startswith("b/")]
    assert len(while_waiting) >= 24 and len(fast) >= 12, \
        f"only {len(while_waiting)} samples ({len(fast)} of b) fetched while waiting"
    assert len(while_waiting) <= 24 + 8 + 1, \
        f"{len(while_waiting)} fetched: more than the queue and the requests in flight"


# ----------------------------------------------------------------------------- a worker's share of lanes


class _Counted:
    """A source of known unit counts that a mix reads in lanes (what ``_walk`` asks of one)."""

    def __init__(self, counts):
        self.counts = counts

    def count(self):
        return sum(self.counts)

    def deals_lanes(self):
        return True

    def unit_counts(self):
        return self.counts


class _Options:
    memory_budget = None
    queue_bytes = 0

    def __init__(self, batch_size):
        self.batch_size = batch_size

    def preload_backend(self):
        pass


def _walked_by_hand(source, slot, wanted, laned):
    """What ``_walk`` finds, by walking every position of the draw order."""
    from loader.datasets import lanes

    workers = max(1, slot.num_workers)
    count = (slot.lanes or slot.world_size * workers) if slot.positions is not None else slot.world_size * workers
    chunks = {s: [first for first, _ in source._share_chunks(s, slot.epoch)] for s in laned}
    sizes = {s: [[0] * count for _ in chunks[s]] for s in laned}
    located, draws = {}, {}
    for q, (s, k) in enumerate(DrawOrder(source.shares()).walk()):
        if q in wanted:
            located[q] = (s, k)
        if s in laned:
            chunk = max(c for c, first in enumerate(chunks[s]) if first <= k)
            lane = (lanes.block_lane(q, source.options.batch_size, count)[0] if slot.positions is not None
                    else lanes.strided_lane(q, slot.world_size, workers))
            if q in wanted:
                draws[q] = (chunk, lane, sizes[s][chunk][lane])
            sizes[s][chunk][lane] += 1
    return located, draws, sizes


@settings(deadline=None, max_examples=40)
@given(units=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(any), min_size=1, max_size=3),
       weights=st.lists(st.integers(1, 5), min_size=3, max_size=3), length=st.integers(1, 700),
       laned=st.sets(st.integers(0, 2), min_size=1), world=st.integers(1, 2), workers=st.integers(0, 3),
       batch=st.sampled_from([None, 1, 3, 8]), epoch=st.integers(0, 3), pick=st.randoms(use_true_random=False))
def test_a_worker_s_lanes_counted_from_the_tallied_order_are_the_walk_s(units, weights, length, laned, world,
                                                                      workers, batch, epoch, pick):
    from loader.datasets.mix import MixSource, Part
    from loader.datasets.protocol import Slot

    parts = [Part(f"s{n}", _Counted(counts), weights[n], True, "continue" if n % 2 == 0 else "epoch", 7 + n)
             for n, counts in enumerate(units)]
    source = MixSource(parts, _Options(batch), length)
    laned = {s for s in laned if s < len(parts)} or {0}
    total = sum(source.shares())
    wanted = sorted(pick.sample(range(total), min(total, pick.randint(1, 60))))
    slot = Slot(rank=world - 1, world_size=world, worker=max(0, workers - 1), num_workers=workers, seed=1,
                epoch=epoch, shuffle=True, policy="pad", positions=wanted if batch else None,
                lanes=pick.randint(1, 5) if batch else None)
    walked = source._walk(slot, wanted + wanted[:2], laned)  # a padded share repeats positions
    located, draws, sizes = _walked_by_hand(source, slot, set(wanted), laned)
    assert walked.located == located
    assert walked.draws == draws
    assert walked.sizes == sizes
