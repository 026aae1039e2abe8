"""The ``Source`` seam: a source written outside the package gets epochs, blocks, resume and
workers from ``AsyncS3Dataset`` without any change to it; the accessors say what a source lacks."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, ConfigError, Split, Store
from loader.datasets import partition
from loader.datasets.object_source import ObjectProgress
from loader.datasets.options import Options
from loader.datasets.progress import Watermark
from loader.datasets.protocol import Slot

from fakes import FakeStore, reusable


class Numbers:
    """A third kind of source: ``n`` integers, each fetched by a job of its own (no store use)."""

    kind = "numbers"

    def __init__(self, n, options):
        self.n = n
        self.options = options

    def resolve(self):
        pass

    def size(self):
        return self.n

    def count(self):
        return self.n

    def missing_count(self):
        return ""

    def fixed_rank_length(self):
        return None

    def deals_lanes(self):
        return False  # a permutation of the numbers, the same on any topology

    def skipped(self, url, key):
        return f"number {key}"

    def progress(self, state):
        return ObjectProgress(Watermark.from_state(state["delivered"]) if state else None)

    def stream(self, slot, progress, run):
        n = self.n
        order = partition.epoch_order(n, seed=slot.seed, epoch=slot.epoch, shuffle=slot.shuffle)
        plan = ([order[p] for p in slot.positions] if slot.positions is not None
                else partition.partition(n, policy=slot.policy, **slot.where()))

        def job(tag, number):
            async def run_job(ctx):
                await ctx.emit((tag, {"__key__": str(number), "n": number}), 8)
            return run_job

        jobs = [job(tag, number) for tag, number in enumerate(plan) if tag not in progress.delivered]
        yield from run(jobs, self.options.engine_limits("ordered"))

    def transform(self, sample):
        return sample

    def describe(self):
        return f"{self.n} numbers"

    def versions(self):
        return None  # nothing listed: no versions for a disk cache to check


def numbers(n, **options):
    fake = FakeStore.with_objects("bucket", {})
    opts = Options(store=Store(backend=reusable(fake)), **options)
    return AsyncS3Dataset(Numbers(n, opts), options=opts)


def test_a_new_source_is_read_exactly_once_across_simulated_ranks():
    got = []
    for rank in range(3):
        ds = numbers(50, shuffle=True, seed=1, split=Split(rank=rank, world_size=3, pad="drop"))
        ds.set_epoch(2)
        assert len(ds) == 16
        got.extend(sample["n"] for sample in ds)
    assert len(got) == 48 == len(set(got))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 60), world=st.integers(1, 4), batch=st.integers(1, 5), data=st.data())
def test_a_new_source_gets_block_dealing_and_elastic_resume(n, world, batch, data):
    """Stop after some steps on ``world`` ranks, resume on another number of ranks: every
    number exactly once, up to the pad repeats at the very end."""
    def run(world_size, steps=None, seen=None):
        out, first = [], None
        for rank in range(world_size):
            ds = numbers(n, shuffle=True, seed=7, batch_size=batch, split=Split(rank=rank, world_size=world_size))
            if seen is not None:
                ds.resume(epoch=1, samples_seen=seen)
            else:
                ds.set_epoch(1)
            first = first or ds
            stop = None if steps is None else steps * batch
            out.extend(s["n"] for s in itertools.islice(ds, stop))
        return out, first

    total_steps = partition.steps_per_rank(n, batch, world)
    steps = data.draw(st.integers(0, total_steps))
    head, ds = run(world, steps=steps)
    seen = ds.samples_seen(steps)
    later = data.draw(st.integers(1, 4))
    tail, _ = run(later, seen=seen)
    assert set(head) | set(tail) == set(range(n))
    assert len(head) + len(tail) - n <= (world - 1) + (later - 1), "repeats only from padding"


def test_a_new_source_resumes_from_state_dict_in_a_dataloader_worker():
    ds = numbers(40, shuffle=True, seed=3)
    dl = DataLoader(ds, batch_size=None, num_workers=0)
    it = iter(dl)
    head = [next(it)["n"] for _ in range(13)]
    state = ds.state_dict()
    del it
    assert state["mode"] == "numbers"
    fresh = numbers(40, shuffle=True, seed=3)
    fresh.load_state_dict(state)
    tail = [s["n"] for s in fresh]
    assert sorted(head + tail) == list(range(40))


def test_a_state_of_another_kind_of_source_is_refused():
    state = numbers(5).state_dict()
    fake = FakeStore.with_objects("bucket", {"a.bin": b"x"})
    objects = AsyncS3Dataset.from_keys("bucket", ["a.bin"], store=reusable(fake))
    with pytest.raises(ConfigError, match="mode 'numbers'.*not for a objects dataset"):
        objects.load_state_dict(state)


def test_accessors_say_what_the_source_does_not_have():
    fake = FakeStore.with_objects("bucket", {"a.bin": b"x"})
    objects = AsyncS3Dataset.from_keys("bucket", ["a.bin"], store=reusable(fake))
    shards = AsyncS3Dataset.from_shards("s3://bucket/s-{0..1}.tar", store=reusable(fake))
    with pytest.raises(TypeError, match=r"shards\(\) is not available here: this dataset reads 1 keys"):
        objects.shards()
    with pytest.raises(TypeError, match=r"keys\(\) is not available here: this dataset reads shards"):
        shards.keys()
    assert shards.classes is None and objects.classes is None
    assert numbers(3).classes is None


def test_slot_where_feeds_partition():
    slot = Slot(rank=1, world_size=2, worker=0, num_workers=2, seed=3, epoch=4, shuffle=True,
                policy="pad")
    assert partition.partition(10, policy="pad", **slot.where()) == partition.partition(
        10, seed=3, epoch=4, shuffle=True, rank=1, world_size=2, worker=0, num_workers=2, policy="pad")
