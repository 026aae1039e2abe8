"""Property tests for the seeded shuffle buffer (``loader.datasets.shuffle``)."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from loader.datasets.shuffle import shuffled

sizes = st.integers(0, 40)
lengths = st.integers(0, 200)
seeds = st.integers(0, 2**32)


class Counting:
    """An iterable that records how many items were taken, to check what the buffer holds."""

    def __init__(self, n: int) -> None:
        self.n, self.taken = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.taken = i + 1
            yield i


@given(n=lengths, size=sizes, seed=seeds)
def test_a_permutation_held_within_the_window(n, size, seed):
    source = Counting(n)
    out = []
    for item in shuffled(source, size, random.Random(seed)):
        out.append(item)
        if len(out) < n - max(size, 1):
            # never more than `size` items read and not yet handed out
            assert source.taken - len(out) <= max(size, 1)
            assert item < len(out) + max(size, 1), "an item leaves at most `size` places late"
    assert sorted(out) == list(range(n))


@given(n=lengths, seed=seeds)
def test_sizes_0_and_1_keep_the_order(n, seed):
    assert list(shuffled(range(n), 0, random.Random(seed))) == list(range(n))
    assert list(shuffled(range(n), 1, random.Random(seed))) == list(range(n))


@given(n=st.integers(20, 200), size=st.integers(2, 40), seed=seeds)
def test_the_same_seed_repeats_and_the_order_is_mixed(n, size, seed):
    first = list(shuffled(range(n), size, random.Random(seed)))
    assert first == list(shuffled(range(n), size, random.Random(seed)))
    assert first != list(range(n)) or n < 3


def test_the_first_item_out_comes_after_the_window_filled():
    source = Counting(100)
    iterator = shuffled(source, 10, random.Random(1))
    next(iterator)
    assert source.taken == 11


@given(n=lengths, size=st.integers(2, 40), seed=seeds, limit=st.integers(1, 400),
       weights=st.lists(st.integers(1, 50), min_size=1, max_size=10))
def test_a_byte_limit_bounds_what_is_held(n, size, seed, limit, weights):
    """Whenever the next item is read, what the buffer holds is within both limits (or is one
    item, which may alone be over the byte limit)."""
    cost = {i: weights[i % len(weights)] for i in range(n)}
    out: list[int] = []

    def source():
        for i in range(n):
            held = [j for j in range(i) if j not in set(out)]
            assert len(held) <= size
            assert len(held) <= 1 or sum(cost[j] for j in held) <= limit
            yield i

    out.extend(shuffled(source(), size, random.Random(seed), max_bytes=limit, nbytes=cost.__getitem__))
    assert sorted(out) == list(range(n))
    again = shuffled(range(n), size, random.Random(seed), max_bytes=limit, nbytes=cost.__getitem__)
    assert out == list(again)


def test_the_buffer_fills_to_exactly_its_limits():
    """Before each read the buffer holds exactly what its limits allow once warm: `size` items,
    as many as fit in `max_bytes`, or one item alone larger than `max_bytes`."""
    for size, limit, weight, full in ((100, 5, 1, 5), (3, 100, 1, 3), (100, 7, 10, 1)):
        out: list[int] = []
        held_at_read = []

        def source(out=out, held_at_read=held_at_read):
            for i in range(30):
                held_at_read.append(i - len(out))
                yield i

        out.extend(shuffled(source(), size, random.Random(0), max_bytes=limit, nbytes=lambda _, w=weight: w))
        assert sorted(out) == list(range(30))
        assert held_at_read[full:] == [full] * (30 - full), (size, limit, weight)


def test_nbytes_without_a_byte_limit_is_the_plain_buffer():
    plain = list(shuffled(range(50), 8, random.Random(3)))
    assert list(shuffled(range(50), 8, random.Random(3), nbytes=lambda _: 1)) == plain
