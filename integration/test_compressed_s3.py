"""Compressed shards end to end on a real S3 server: ``.tgz`` and ``.tar.zst``, exactly once.

Shards of incompressible payloads (so a compressed shard is as long as its tar and a cut lands
in the middle of it), read plainly with both backends, then through the fault proxy
(integration/faults/) with resets, ``503 SlowDown``, truncated bodies and stalls: a compressed
shard cannot be resumed at an offset, so every fault restarts its stream from the first byte, and
the samples parsed before the cut must not come again.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io

import pytest
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, Reading, RetryPolicy, Store

from datasets import sha256
from faults import FAULT_KINDS, FaultPlan, FaultProxy
from shardsets import SUFFIXES, compress, pack

KINDS = ("tgz", "zstd")
BACKENDS = ("aioboto3", "obstore")
SHARDS, PER_SHARD, PAYLOAD = 6, 90, 4000  # ~750 KB per shard
# The GETs below are counted exactly (one more per fault): timeouts of 2 s fire on a loaded
# machine for answers and connections that are only slow, retries no fault explains (seen in
# test_reliability.py's fault suite at load 14-16; 5 s held there). The stall still outlasts
# the read timeout, and costs it: 10 s made each case ~3x longer.
TIMEOUT = 5.0
FAST_RETRY = RetryPolicy(read_timeout=TIMEOUT, connect_timeout=TIMEOUT, base_delay=0.01, max_delay=0.2,
                         max_attempts=12)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def compressed(s3_server):
    """The same samples as ``.tgz`` shards under ``tgz/`` and as ``.tar.zst`` under ``zstd/``."""
    bucket = s3_server.new_bucket("cmp")
    expected: dict[str, str] = {}
    for shard in range(SHARDS):
        samples = {}
        for i in range(PER_SHARD):
            key = f"s{shard:02d}/{i:05d}"
            seed = hashlib.sha256(key.encode()).digest()
            data = b"".join(hashlib.sha256(seed + n.to_bytes(4, "big")).digest()
                            for n in range(PAYLOAD // 32 + i % 7))
            samples[key] = {"bin": data, "cls": str(i % 10).encode()}
            expected[key] = sha256(data)
        tar = pack(samples)
        for kind in KINDS:
            body = compress(tar, kind)
            assert len(body) > 0.6 * len(tar), "payloads must not compress (cuts land mid-shard)"
            s3_server.minio.put_object(bucket, f"{kind}/shard-{shard:04d}{SUFFIXES[kind]}",
                                       io.BytesIO(body), len(body))
    return bucket, expected


def keyed(sample) -> tuple[str, str]:
    return sample["__key__"], sha256(sample["bin"])


def assert_exactly_once(got: list[tuple[str, str]], expected: dict[str, str]) -> None:
    counts = collections.Counter(key for key, _ in got)
    twice = [key for key, n in counts.items() if n > 1]
    assert not twice, f"delivered twice: {twice[:5]}"
    assert dict(got) == expected


@pytest.mark.parametrize("store", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_compressed_shards_exactly_once(s3_server, compressed, kind, store):
    bucket, expected = compressed
    dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/{kind}/", shuffle=True, seed=2,
                                         config=s3_server.config, store=store, reading=Reading(part_size=64 << 10))
    assert all(shard.compression == ("gzip" if kind == "tgz" else "zstd") for shard in dataset.shards())
    if store == "aioboto3":  # forked workers; obstore's runtime is not fork-safe in this process
        batches = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork",
                             timeout=120)
    else:
        batches = DataLoader(dataset, batch_size=None)
    assert_exactly_once([keyed(sample) for sample in batches], expected)
    stats = dataset.stats()
    assert stats["requests"] == SHARDS, f"one GET per shard, never ranged parts: {stats}"


@pytest.mark.parametrize("store", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_compressed_shards_exactly_once_through_injected_faults(s3_server, compressed, kind, store):
    bucket, expected = compressed
    # seed 39: 3 resets, 2 SlowDowns, 5 cuts and one stall before the 6 shards finish (each
    # fault one more GET; the draws go by arrival), so the stall's read timeout is paid once
    plan = FaultPlan(reset=0.1, slowdown=0.1, truncate=0.3, stall=0.03, stall_seconds=TIMEOUT + 2,
                     seed=39)
    try:
        proxy = FaultProxy(s3_server.config.endpoint_url, FaultPlan())
    except ValueError as exc:
        pytest.skip(f"the fault proxy needs a loopback http server: {exc}")
    with proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        dataset = AsyncS3Dataset.from_shards(
            f"s3://{bucket}/{kind}/shard-{{0000..{SHARDS - 1:04d}}}{SUFFIXES[kind]}", shuffle=True,
            seed=4, config=config, store=Store(backend=store, retry=FAST_RETRY), reading=Reading(chunk_size=32 << 10))
        dataset.resolve()  # the look for an index (none here) before the faults: they are for the shards
        proxy.set_plan(plan)
        got = [keyed(sample) for sample in dataset]
        counts = proxy.counts
        gets = [(target, fault) for method, target, fault in proxy.decisions
                if method == "GET" and target.startswith(f"/{bucket}/{kind}/shard-")]
    assert_exactly_once(got, expected)
    injected = sum(counts[name] for name in FAULT_KINDS)
    assert counts["truncate"] >= 2, f"the plan cut too few streams to test restarts: {dict(counts)}"
    assert counts["upstream_errors"] == 0, dict(counts)
    # every fault cost exactly one more GET of the whole shard, and nothing else was requested
    assert len(gets) == SHARDS + injected, (len(gets), dict(counts))
    stats = dataset.stats()
    hidden = len(gets) - stats["requests"]  # aiohttp resends a GET reset before any answer
    assert 0 <= hidden <= (counts["reset"] if store == "aioboto3" else 0), (stats, dict(counts))
    assert stats["retries"] == stats["requests"] - SHARDS, stats
    print(f"\n{kind} via {store}: {len(got)} samples exactly once through {injected} faults "
          f"({ {k: counts[k] for k in FAULT_KINDS} }), {len(gets)} GETs for {SHARDS} shards")
