"""The tail of real S3 through the fault proxy, on the real server: stragglers are hedged (the
first answer wins, each sample once, within the hedging budget) and a throttle is met with fewer
requests (few SlowDowns, nothing lost or duplicated, and the report says so). Counts, shares and
bounds only: the rates are in bench/results/tail-2026-11-28-c.md (``python -m bench.tail``).
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, AsyncS3MapDataset
from loader.engine import DEFAULT_MAX_INFLIGHT
from loader.listing import nodeshare
from loader.s3 import hedging, throttle

from datasets import sha256, upload_objects
from faults import FaultPlan, FaultProxy

OBJECTS = 400
BACKENDS = ("aioboto3", "obstore")

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def objects(s3_server):
    """``OBJECTS`` small objects in a fresh bucket: (bucket, {key: sha256})."""
    bucket = s3_server.new_bucket("tail")
    items = {f"train/{i:05d}.bin": i.to_bytes(4, "big") * 512 for i in range(OBJECTS)}
    upload_objects(s3_server.minio, bucket, items)
    return bucket, {key: sha256(data) for key, data in items.items()}


def read_all(s3_server, proxy: FaultProxy, bucket: str, keys: list[str], store: str, num_workers: int = 0):
    """Every sample through the proxy, and the dataset's stats for the epoch."""
    config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
    dataset = AsyncS3Dataset.from_keys(bucket, keys, config=config, store=store, shuffle=True, seed=3)
    got = collections.Counter()
    for sample in DataLoader(dataset, batch_size=None, num_workers=num_workers):
        got[(sample["__url__"].split("/", 3)[3], sha256(sample["bin"]))] += 1
    return got, dataset.stats(), dataset.report()


@pytest.mark.parametrize("store", BACKENDS)
def test_stragglers_are_hedged_and_every_sample_comes_once(s3_server, objects, store):
    bucket, digests = objects
    with FaultProxy(s3_server.config.endpoint_url, FaultPlan(straggle=0.03, straggle_seconds=3.0,
                                                             seed=5)) as proxy:
        got, stats, report = read_all(s3_server, proxy, bucket, sorted(digests), store)
        counts = proxy.counts
    assert got == collections.Counter(digests.items())  # each once: the loser's bytes never counted
    assert counts["straggle"] >= 5  # the condition happened (3 % of ~400 GETs)
    hedged, won = stats["hedged"], stats["hedges_won"]
    # bounded: a small share of requests
    assert hedged <= hedging.HEDGE_SHARE * stats["requests"] + hedging.HEDGE_BURST
    # every straggling request was hedged, save those that were hedges themselves: a hedge that
    # straggled too lost its race (hedged - won of them), every other one won it
    assert won >= 1 and hedged + (hedged - won) >= counts["straggle"], (stats, counts)
    assert stats["requests"] == OBJECTS + hedged + stats["retries"]  # one GET each, the hedges, any retry
    assert "were sent again" in report


@pytest.mark.parametrize("store", BACKENDS)
def test_a_throttle_is_met_with_fewer_requests(s3_server, objects, store):
    """The prefix takes 100 GETs/s; beyond it, 503 SlowDown. Without the rate limit the engine's
    64 requests in flight met it with a storm of retries (more SlowDowns than answers)."""
    bucket, digests = objects
    with FaultProxy(s3_server.config.endpoint_url, FaultPlan(get_rate=100.0)) as proxy:
        got, stats, report = read_all(s3_server, proxy, bucket, sorted(digests), store)
        counts, proxy_decisions = proxy.counts, proxy.decisions
    assert got == collections.Counter(digests.items())  # nothing lost, nothing twice
    slowdowns = counts["throttled"]
    assert slowdowns >= 1  # the throttle was met ...
    # ... and answered by sending less, once the first two windows of requests in flight have
    # gone: the burst sent before any answer, and the window sent when that burst was answered
    # without a SlowDown (nothing yet says there is a limit). Those two are the harness's more
    # than the control's: the proxy is a thread of this process, so when the loaded process
    # stalls it reads the first burst late, its bucket refills meanwhile, the whole burst gets
    # through and the second window meets the bucket empty (once 85 SlowDowns of 495 GETs in
    # the suite; with the proxy in a process of its own, never more than 5.4 % loaded). After
    # them, the control's own share: 1 % quiet, at most 9 % loaded; 72 % without the control.
    kinds = [kind for method, _, kind in proxy_decisions if method == "GET"]
    later = kinds[2 * DEFAULT_MAX_INFLIGHT:]
    assert later.count("slowdown") <= 0.15 * len(later), (counts, kinds.count("slowdown") - later.count("slowdown"))
    # hedges go out only before the throttle shows: under the suite's load the first answers can
    # be slow enough to be hedged (tests/test_hedging.py: none once it has shown). Each SlowDown
    # is counted once in stats(), never twice; one answered to the loser of a hedge's race, which
    # was cancelled, is never read (27 of the proxy's 29 once, in a run of 4 GETs beyond the
    # samples and their retries: hedges)
    assert slowdowns - stats["hedged"] <= stats["throttled"] <= slowdowns, (stats, counts)
    assert stats["hedged"] <= hedging.HEDGE_SHARE * stats["requests"] + hedging.HEDGE_BURST
    assert "S3 throttled this job" in report


SHAPES = {
    "token bucket, connection kept": FaultPlan(get_rate=100.0, slowdown_close=False),
    "sliding second, closing": FaultPlan(get_rate=100.0, throttle="window"),
    "token bucket, doubling after 2 s": FaultPlan(get_rate=100.0, get_rate_rises_after=2.0),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_of_throttle_is_met_each_sample_once(s3_server, objects, shape):
    """Two DataLoader workers (two processes, one limit) against each shape of limit the proxy
    has (the closing token bucket is the test above): every sample once, the throttle met and
    answered by sending less. Shares with slack for a busy machine and a run of ~4 s, where the
    first burst (both workers' 64 requests, sent before any answer) is most of the SlowDowns;
    the rates are in bench/results/tail-2026-11-28-c.md."""
    bucket, digests = objects
    with FaultProxy(s3_server.config.endpoint_url, SHAPES[shape]) as proxy:
        got, stats, report = read_all(s3_server, proxy, bucket, sorted(digests), "aioboto3", num_workers=2)
        counts = proxy.counts
    assert got == collections.Counter(digests.items())  # nothing lost, nothing twice
    assert counts["throttled"] >= 1  # the throttle was met ...
    assert counts["throttled"] <= 0.40 * counts["requests"], counts  # ... and not with a storm (68 % without)
    # each SlowDown counted once in stats(), never twice; on a loaded machine a few that closed
    # their connection were not read as SlowDown by the client (193 of the proxy's 203 once)
    assert 0.9 * counts["throttled"] <= stats["throttled"] <= counts["throttled"], (stats, counts)
    assert "S3 throttled this job" in report


def test_the_map_dataset_reads_through_the_same_control(s3_server, objects):
    """The process's control for the bucket outlives one dataset: a second dataset meets the
    throttle with the rate the first one found, so it is answered SlowDown less often."""
    bucket, digests = objects
    keys = sorted(digests)
    with FaultProxy(s3_server.config.endpoint_url, FaultPlan(get_rate=100.0)) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        shares = []
        for _ in range(2):
            before = proxy.counts
            dataset = AsyncS3MapDataset.from_keys(bucket, keys, config=config)
            loader = DataLoader(dataset, batch_size=50, collate_fn=list)
            got = [sample["__url__"].split("/", 3)[3] for batch in loader for sample in batch]
            assert sorted(got) == keys
            after = proxy.counts
            shares.append((after["throttled"] - before["throttled"]) / (after["requests"] - before["requests"]))
        counts = proxy.counts
    assert counts["throttled"] >= 1
    assert shares[1] <= shares[0] and counts["throttled"] <= 0.10 * counts["requests"], (shares, counts)
    control = throttle.control_for(proxy.endpoint_url, bucket)
    assert control.statistics().throttled == counts["throttled"]


def test_the_map_dataset_hedges_stragglers(s3_server, objects):
    """A batch of the map dataset waits for its slowest object: a straggler is sent again there
    too, each sample once."""
    bucket, digests = objects
    keys = sorted(digests)
    with FaultProxy(s3_server.config.endpoint_url, FaultPlan(straggle=0.03, straggle_seconds=3.0,
                                                             seed=7)) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        dataset = AsyncS3MapDataset.from_keys(bucket, keys, config=config)
        loader = DataLoader(dataset, batch_size=50, collate_fn=list)
        got = collections.Counter((s["__url__"].split("/", 3)[3], sha256(s["bin"])) for b in loader for s in b)
        counts = proxy.counts
    assert got == collections.Counter(digests.items())
    assert counts["straggle"] >= 5  # the condition happened (3 % of ~400 GETs)
    stats = hedging.control_for(proxy.endpoint_url, bucket).statistics()
    assert stats.hedges_won >= 1 and stats.hedged + (stats.hedged - stats.hedges_won) >= counts["straggle"], (
        stats, counts)
    assert stats.hedged <= hedging.HEDGE_SHARE * stats.requests + hedging.HEDGE_BURST


@pytest.mark.parametrize("start", [None, "spawn"], ids=["default start", "spawn"])
def test_the_next_epochs_workers_start_at_the_limit_the_last_ones_found(s3_server, objects, start,
                                                                       tmp_path, monkeypatch):
    """DataLoader workers are new every epoch (``persistent_workers=False``, the default): the
    second epoch's start at the limit the first epoch's found (``loader.s3.handoff``), where they
    had started knowing nothing and sent their start window into the closed second again (two
    workers' 64 requests each into a second that allows 100). A machine's share folder of its
    own: the limit of an earlier test's proxy, on a port used again, is not this one's."""
    monkeypatch.setenv(nodeshare.SHARE_DIR_ENV, str(tmp_path))
    bucket, digests = objects
    with FaultProxy(s3_server.config.endpoint_url, FaultPlan(get_rate=100.0, throttle="window")) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        dataset = AsyncS3Dataset.from_keys(bucket, sorted(digests), config=config, shuffle=True, seed=3)
        loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=start)
        slowdowns = []
        for epoch in range(2):
            dataset.set_epoch(epoch)
            before = proxy.counts
            got = collections.Counter((s["__url__"].split("/", 3)[3], sha256(s["bin"])) for s in loader)
            assert got == collections.Counter(digests.items())  # nothing lost, nothing twice
            after = proxy.counts
            slowdowns.append((after["throttled"] - before["throttled"], after["requests"] - before["requests"]))
    assert slowdowns[0][0] >= 1, slowdowns  # the first epoch met the limit ...
    # ... the second started at what it found. Quiet, 15 runs: 12-24 of ~415. On a machine
    # loaded with two busy processes, 5 runs each: 12-22 forked, 27-44 spawned, and once in the
    # suite 49 of 449 (11 %): the first epoch's worker that started late ran alone at its end and
    # grew into the other's share, and the sum of both was handed on. Without the handoff 101-162
    # of ~500 (20-32 %): the bound sits between, where the handoff's absence fails on any machine
    assert slowdowns[1][0] <= 0.15 * slowdowns[1][1], slowdowns
