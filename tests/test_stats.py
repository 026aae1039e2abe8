"""Loader statistics: latency histogram, per-worker rows summed in the main process."""

from __future__ import annotations

import functools
import logging
import math
import pickle
import time

from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, Limits, TransientStoreError
from loader.datasets.stats import StepWaits, report, timed
from loader.s3.recording import BOUNDS, LatencyHistogram

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
    # one GET per object and the retry; a loaded machine may make a GET straggle, and its hedge counts
    assert stats["requests"] == 121 + stats["hedged"] and stats["request_errors"] == 1 and stats["retries"] == 1
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
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), store=reusable(FakeStore.with_objects("bucket", objects)))
    with caplog.at_level(logging.INFO, logger="loader.stats"):  # the documented switch
        list(ds)
    assert any("worker 0: 10 samples" in record.getMessage() for record in caplog.records)


def test_pickling_outside_a_process_start_gives_a_private_board():
    objects = payloads(5, size=10)
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), store=None)
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._board._cells is not ds._board._cells


# ----------------------------------------------------------------------------- where the time goes


def _sleepy(seconds):
    """A transform that costs ``seconds`` per sample (module-level: it pickles into workers)."""
    return functools.partial(_sleep_then, seconds)


def _sleep_then(seconds, sample):
    time.sleep(seconds)
    return sample["bin"]


def test_timed_measures_the_training_loops_wait_per_step():
    """A store that answers one GET at a time in 20 ms, batches of 4, a loop that does nothing:
    each step waits for several GETs; the same data with a loop that takes 20 ms per step and
    requests that cost nothing: the data is there before the loop asks."""
    objects = payloads(48, size=100)
    slow = AsyncS3Dataset.from_keys("bucket", sorted(objects), limits=Limits(concurrency=1),
                                    store=reusable(FakeStore.with_objects("bucket", objects, latency=0.02)))
    batches = [len(batch["bin"]) for batch in slow.timed(DataLoader(slow, batch_size=4))]
    waited = slow.stats()
    assert batches == [4] * 12 and waited["steps"] == 12 and waited["samples"] == 48
    assert waited["step_wait_p50_s"] >= 0.04, "at least two 20 ms GETs per step, one at a time"
    assert waited["step_wait_p50_s"] <= waited["step_wait_p95_s"] <= waited["step_wait_p99_s"]
    assert waited["data_wait_fraction"] > 0.5 and waited["first_batch_s"] > 0
    assert "raise Limits(concurrency=)" in slow.report(), slow.report()

    fast = AsyncS3Dataset.from_keys("bucket", sorted(objects),
                                    store=reusable(FakeStore.with_objects("bucket", objects)))
    for _ in fast.timed(DataLoader(fast, batch_size=4)):
        time.sleep(0.02)
    kept_up = fast.stats()
    assert kept_up["steps"] == 12 and kept_up["step_s"] >= 12 * 0.02
    assert kept_up["data_wait_fraction"] < waited["data_wait_fraction"]


def test_worker_rows_say_where_the_loaders_time_went():
    """Transform time, time in GETs and the hand-off are measured in each DataLoader worker and
    summed in the main process; the step waits are measured in the main process itself."""
    objects = payloads(40, size=100)
    fake = FakeStore.with_objects("bucket", objects, latency=0.01)
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), store=reusable(fake),
                                  transform=_sleepy(0.005))
    loader = DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context="fork")
    steps = sum(1 for _ in ds.timed(loader))
    stats = ds.stats()
    assert steps == stats["steps"] == 8 and stats["workers"] == 2
    assert stats["transform_s"] >= 40 * 0.005, "every sample's transform, in both workers"
    assert stats["get_s"] >= 40 * 0.01, "every GET's 10 ms, summed"
    assert stats["handoff_s"] > 0 and stats["consumer_wait_s"] > 0
    assert 1 <= stats["peak_inflight"] <= 64
    text = ds.report()
    assert "training waited for data" in text and "in transform" in text and "advice:" in text


def test_report_advises_by_the_largest_share():
    base = {"samples": 1000, "seconds": 10.0, "workers": 2, "requests": 1000, "get_s": 30.0,
            "latency_p50_s": 0.02, "latency_p99_s": 0.05, "peak_inflight": 64, "steps": 100,
            "data_wait_s": 5.0, "step_s": 5.0, "data_wait_fraction": 0.5, "first_batch_s": 0.5,
            "step_wait_p50_s": 0.04, "step_wait_p95_s": 0.08, "step_wait_p99_s": 0.1}
    split = {"consumer_wait_s": 1.0, "transform_s": 1.0, "handoff_s": 1.0}

    def advice(inflight_limit=64, **changes):
        return report({**base, **split, **changes}, inflight_limit=inflight_limit).rsplit("advice: ", 1)[1]

    assert "add DataLoader workers" in advice(transform_s=15.0)
    assert "hand over less" in advice(handoff_s=15.0)
    assert "raise Limits(concurrency=)" in advice(consumer_wait_s=15.0)
    assert "client's CPU per request" in advice(consumer_wait_s=15.0, inflight_limit=128)
    assert "keeps up" in advice(data_wait_fraction=0.01, transform_s=15.0)
    no_steps = {k: v for k, v in base.items() if not k.startswith(("step", "data_wait", "first"))}
    text = report({**no_steps, **split})
    assert "ds.timed(loader)" in text and "training waited" not in text
    lines = text.splitlines()  # the advice points at the split, which comes before it
    assert "split above" in lines[-1] and any(line.startswith("loader processes") for line in lines[:-1])


def test_start_up_is_kept_apart_from_the_steady_state():
    """A slow first batch (workers starting) and then data always ready: the first batch is
    reported apart, the steady state's share is its own, and the advice reads the steady state
    (a short epoch once advised "handing samples to the main process is the limit")."""
    def batches():
        time.sleep(0.25)  # the first batch: start-up (long beside 16 steps that do nothing, however busy)
        yield from range(17)

    waits = StepWaits()
    steps = 0
    for _ in timed(batches(), waits):
        steps += 1
    summary = waits.summary()
    assert steps == summary["steps"] == 17
    assert summary["first_batch_s"] >= 0.25 and summary["data_wait_s"] < summary["first_batch_s"]
    assert summary["step_wait_p99_s"] < summary["first_batch_s"]

    stats = {"samples": 1088, "seconds": 1.0, "workers": 2, "startup_s": 0.4, "steps": 17, "steady_steps": 15,
             "startup_wait_s": 0.16, "end_wait_s": 0.02,
             "data_wait_s": 0.004, "step_s": 0.85, "data_wait_fraction": 0.0047, "first_batch_s": 0.15,
             "step_wait_p50_s": 0.0002, "step_wait_p95_s": 0.0004, "step_wait_p99_s": 0.0005,
             "consumer_wait_s": 0.01, "transform_s": 0.05, "handoff_s": 1.5}
    text = report(stats)
    assert "start-up, apart from the rest: first batch after 150.0 ms, the first 2 (one per worker) after " \
           "160.0 ms in all" in text
    assert "over 15 steps" in text and "(0% of its time)" in text and "20.0 ms at the end" in text
    assert "start-up to the first sample 0.40 s, apart" in text
    assert "keeps up" in text.rsplit("advice: ", 1)[1], text

    two = StepWaits(startup_steps=2)  # two DataLoader workers: each one's first batch is start-up
    assert list(timed(iter([1, 2]), two)) == [1, 2] and two.summary()["data_wait_fraction"] is None
    assert two.summary()["steady_steps"] == 0
    assert "all start-up" in report({"samples": 2, "seconds": 0.1, **two.summary()})


def test_the_loader_processes_keep_their_start_up_apart():
    """The wait for the engine's first item is start-up: counted in ``startup_s``, not in
    ``consumer_wait_s`` (whose share picks the advice)."""
    objects = payloads(8, size=10)
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), limits=Limits(concurrency=8),
                                  store=reusable(FakeStore.with_objects("bucket", objects, latency=0.05)))
    assert len(list(ds)) == 8
    stats = ds.stats()
    assert stats["startup_s"] >= 0.05, "the first GET's 50 ms"
    assert stats["peak_inflight"] == 8, "all 8 GETs were in flight together"
    assert stats["consumer_wait_s"] < stats["startup_s"], "so the first answer's wait was the start-up"


def test_step_waits_leave_the_loop_free_to_break():
    objects = payloads(40, size=10)
    ds = AsyncS3Dataset.from_keys("bucket", sorted(objects), store=reusable(FakeStore.with_objects("bucket", objects)))
    for step, _ in enumerate(ds.timed(DataLoader(ds, batch_size=4))):
        if step == 2:
            break
    assert ds.stats()["steps"] == 3
    assert AsyncS3Dataset.from_keys("bucket", ["a.bin"], store=None).report().startswith("no epoch yet")


def test_a_throttled_job_is_told_in_one_line_what_helps_on_s3():
    from loader.datasets.stats import report

    text = report({"requests": 10_000, "throttled": 900, "get_s": 1.0})
    lines = [line for line in text.splitlines() if "SlowDown" in line]
    assert len(lines) == 1 and "9% of requests (900)" in lines[0]
    for advice in ("more prefixes", "Limits(concurrency=)", "shards instead of objects"):
        assert advice in lines[0]
    assert "SlowDown" not in report({"requests": 10_000, "throttled": 0, "get_s": 1.0})
