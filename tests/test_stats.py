"""Loader statistics: latency histogram, per-worker rows summed in the main process."""

from __future__ import annotations

import logging
import math
import pickle

from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, TransientStoreError
from loader.stores.recording import BOUNDS, LatencyHistogram

from fakes import FakeStore, payloads, reusable


@given(st.lists(st.floats(1e-4, 100.0), min_size=1, max_size=300), st.sampled_from([0.5, 0.9, 0.99]))
def test_percentiles_are_within_one_bucket_of_the_exact_value(values, q):
    histogram = LatencyHistogram()
    for value in values:
        histogram.add(value)
    exact = sorted(values)[max(1, math.ceil(q * len(values))) - 1]
    estimate = histogram.percentile(q)
    assert exact <= estimate <= exact * 2 ** 0.25 + 1e-12, "the bucket's upper bound, ~19 % above at most"
    assert histogram.total == len(values)


def test_empty_histogram_has_no_percentiles():
    assert LatencyHistogram().percentile(0.5) is None
    assert len(LatencyHistogram().counts) == len(BOUNDS) + 1


def test_main_process_sees_the_sum_of_all_workers():
    objects = payloads(120, size=1000)
    key = sorted(objects)[7]
    fake = FakeStore.with_objects("bucket", objects, latency=0.005,
                                  fail={key: [TransientStoreError("slow down", bucket="bucket", key=key)]})
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), store=reusable(fake))
    assert len(list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))) == 120
    stats = ds.stats()
    assert stats["workers"] == 2
    assert stats["samples"] == 120 and stats["bytes"] == 120_000
    assert stats["requests"] == 121 and stats["request_errors"] == 1 and stats["retries"] == 1
    assert 0.005 <= stats["latency_p50_s"] <= stats["latency_p90_s"] <= stats["latency_p99_s"]
    assert stats["samples_per_s"] > 0 and stats["consumer_wait_s"] >= 0


def test_a_smaller_run_replaces_the_rows_of_a_bigger_one():
    objects = payloads(40, size=10)
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), store=reusable(FakeStore.with_objects("bucket", objects)))
    list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert ds.stats()["workers"] == 2
    list(ds)
    assert ds.stats()["workers"] == 1 and ds.stats()["samples"] == 40


def test_stats_are_logged_at_the_end_of_a_pass(caplog):
    objects = payloads(10, size=10)
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), log_stats=True,
                                  store=reusable(FakeStore.with_objects("bucket", objects)))
    with caplog.at_level(logging.INFO, logger="loader"):
        list(ds)
    assert any("worker 0: 10 samples" in record.getMessage() for record in caplog.records)


def test_pickling_outside_a_process_start_gives_a_private_board():
    objects = payloads(5, size=10)
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), store=None)
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._board._cells is not ds._board._cells
