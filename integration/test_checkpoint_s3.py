"""``loader.checkpoint`` on a real S3 server: a ~300 MB state dict round-trips bit-exactly with
bounded memory (peak RSS measured in fresh subprocesses, save and load apart), and a save that
fails midway (a part refused, an exception inside ``torch.save``, ``KeyboardInterrupt``) leaves
no incomplete multipart upload, as seen by an independent client (boto3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import anyio
import pytest
import torch

from loader import Limits, checkpoint
from loader.errors import AccessDeniedError, NoSuchBucketError, NoSuchKeyError, StoreError
from loader.s3.aioboto3_store import Aioboto3Store

MiB = 1 << 20
SMALL_PART = 5 * MiB  # S3's minimum part size
RSS_LIMIT = 1.6  # peak RSS above the interpreter's baseline, in units of the state dict's size

# Run in a fresh interpreter (so the test process's memory cannot pollute the peak): builds or
# loads ~300 MB of float32 tensors, each reproducible from its name, and reports JSON.
CHILD = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import torch
    from loader import checkpoint

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def peak():
        # VmHWM: this address space's high-water mark. Not ru_maxrss, which Linux carries over
        # from the parent through fork + exec (a big pytest process would count as our peak).
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    def make(name):
        kind, i = name.split(".")
        g = torch.Generator().manual_seed(int(i) + (0 if kind == "big" else 1000))
        return torch.randn(12_500_000 if kind == "big" else 1000, generator=g)

    names = [f"big.{i}" for i in range(6)] + [f"small.{i}" for i in range(200)]
    mode, uri = sys.argv[1], sys.argv[2]
    base = rss()
    if mode == "save":
        state = {name: make(name) for name in names}
        started = time.perf_counter()
        checkpoint.save(state, uri)
    else:
        started = time.perf_counter()
        state = checkpoint.load(uri, map_location="cpu")
    seconds = time.perf_counter() - started
    out = {"base": base, "peak": peak(), "seconds": seconds,
           "size": sum(t.nbytes for t in state.values()),
           "threads": [t.name for t in threading.enumerate()]}
    if mode == "load":  # one regenerated tensor at a time, after the peak was read
        out["names_match"] = sorted(state) == sorted(names)
        out["unequal"] = [n for n in names if not (n in state and torch.equal(state[n], make(n)))]
    print(json.dumps(out))
    """
)


def run_child(mode: str, uri: str) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, mode, uri], env=dict(os.environ),
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_300mb_round_trip_is_exact_with_bounded_memory(s3_server, s3_env, record_property):
    uri = f"s3://{s3_server.new_bucket('ckpt')}/run/step-100.pt"
    saved = run_child("save", uri)
    loaded = run_child("load", uri)
    assert loaded["names_match"] and loaded["unequal"] == []
    assert loaded["size"] == saved["size"] > 280 * MiB
    size = saved["size"]
    report = []
    for mode, got in (("save", saved), ("load", loaded)):
        over = (got["peak"] - got["base"]) / size
        record_property(f"{mode}_peak_rss_over_baseline_x", round(over, 2))
        report.append(
            f"{mode}: {size / MiB:.0f} MiB in {got['seconds']:.1f} s, peak RSS {got['peak'] / MiB:.0f} MiB "
            f"= baseline {got['base'] / MiB:.0f} MiB + {over:.2f}x the state dict "
            f"({got['peak'] / size:.2f}x with the interpreter and torch)"
        )
        assert got["threads"] == ["MainThread"], got["threads"]
    print("\n" + "\n".join(report))
    for got in (saved, loaded):
        assert got["peak"] - got["base"] < RSS_LIMIT * size, report


# ---------------------------------------------------------------------------- failures midway


class Hooked:
    """An ``Aioboto3Store`` whose ``upload_part`` calls ``hook(part_number)`` first."""

    def __init__(self, inner: Aioboto3Store, hook) -> None:
        self._inner = inner
        self._hook = hook

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def upload_part(self, bucket, key, upload_id, part_number, data):
        self._hook(part_number)
        return await self._inner.upload_part(bucket, key, upload_id, part_number, data)


def hooked(config, hook):
    async def factory():
        return Hooked(await Aioboto3Store.open(config, max_connections=8), hook)

    return factory


def boto3_client(s3_server):
    import boto3

    config = s3_server.config
    return boto3.client("s3", endpoint_url=config.endpoint_url, region_name=config.region,
                        aws_access_key_id=config.access_key_id,
                        aws_secret_access_key=config.secret_access_key)


def assert_nothing_left(s3_server, bucket: str, key: str) -> None:
    """No incomplete multipart upload and no object, asked of boto3 and of our own store."""
    client = boto3_client(s3_server)
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads] == []
    assert client.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount", 0) == 0

    async def ours():
        store = await Aioboto3Store.open(s3_server.config, max_connections=2)
        try:
            return await store.list_multipart_uploads(bucket, "")
        finally:
            await store.aclose()

    assert anyio.run(ours) == []


@pytest.fixture(autouse=True)
def no_thread_left():
    """Every checkpoint call, failed ones included, ends its helper thread before returning."""
    before = set(threading.enumerate())
    yield
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, f"threads left running: {left}"


def big_state(n: int = 8) -> dict:
    """~40 MB in 8 tensors: eight 5 MiB parts."""
    g = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(1_250_000, generator=g) for i in range(n)}


@pytest.mark.server_sensitive
def test_refused_part_aborts_the_upload(s3_server):
    bucket = s3_server.new_bucket("ckpt")
    uri = f"s3://{bucket}/run/refused.pt"
    started: list[int] = []

    def refuse_third(number: int) -> None:
        started.append(number)
        if number == 3:
            raise AccessDeniedError("part 3 refused by the test")

    with pytest.raises(AccessDeniedError, match="part 3 refused") as info:
        checkpoint.save(big_state(), uri, store=hooked(s3_server.config, refuse_third),
                        part_size=SMALL_PART, limits=Limits(concurrency=2))
    assert uri in str(info.value)
    assert max(started) < 8
    assert_nothing_left(s3_server, bucket, "run/refused.pt")


@pytest.mark.server_sensitive
def test_exception_inside_torch_save_midway_aborts(s3_server, monkeypatch):
    """The file object raising after ~12 MB (parts already up), as a failing disk or a
    serialization bug inside torch.save would."""
    bucket = s3_server.new_bucket("ckpt")
    uri = f"s3://{bucket}/run/broken.pt"
    written = [0]
    original = checkpoint._PartWriter.write

    def failing_write(self, data):
        written[0] += len(memoryview(data).cast("B"))
        if written[0] > 12 * MiB:
            raise OSError("disk on fire (raised by the test)")
        return original(self, data)

    monkeypatch.setattr(checkpoint._PartWriter, "write", failing_write)
    uploaded: list[int] = []
    with pytest.raises(OSError, match="disk on fire") as info:
        checkpoint.save(big_state(), uri, store=hooked(s3_server.config, uploaded.append),
                        part_size=SMALL_PART)
    assert any(uri in note for note in info.value.__notes__)
    assert uploaded, "no part was uploaded before the failure: the test tests nothing"
    assert_nothing_left(s3_server, bucket, "run/broken.pt")


@pytest.mark.server_sensitive
def test_keyboard_interrupt_midway_aborts(s3_server, sigint_raises):
    """A real SIGINT to the main thread while part 3 uploads."""
    assert threading.current_thread() is threading.main_thread()
    bucket = s3_server.new_bucket("ckpt")
    uri = f"s3://{bucket}/run/interrupted.pt"
    started: list[int] = []

    def interrupt_at_third(number: int) -> None:
        started.append(number)
        if number == 3:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(big_state(12), uri, store=hooked(s3_server.config, interrupt_at_third),
                        part_size=SMALL_PART, limits=Limits(concurrency=2))
    assert max(started) < 12
    assert_nothing_left(s3_server, bucket, "run/interrupted.pt")


# ---------------------------------------------------------------------------- small things


@pytest.mark.server_sensitive
def test_small_checkpoint_obstore_name_and_missing_objects(s3_server, s3_env):
    bucket = s3_server.new_bucket("ckpt")
    uri = f"s3://{bucket}/small.pt"
    state = {"w": torch.arange(1000.0), "step": 7}
    checkpoint.save(state, uri, store="obstore")  # obstore has no multipart here: aioboto3
    out = checkpoint.load(uri, store="obstore")
    assert torch.equal(out["w"], state["w"]) and out["step"] == 7
    assert boto3_client(s3_server).list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []

    with pytest.raises(NoSuchKeyError) as info:
        checkpoint.load(f"s3://{bucket}/nope.pt")
    assert f"s3://{bucket}/nope.pt" in str(info.value)
    with pytest.raises(NoSuchBucketError) as info:
        checkpoint.load("s3://no-such-bucket-here/x.pt")
    assert "s3://no-such-bucket-here/x.pt" in str(info.value)
    with pytest.raises(NoSuchBucketError) as info:
        checkpoint.save(big_state(2), "s3://no-such-bucket-here/x.pt", part_size=SMALL_PART)
    assert "s3://no-such-bucket-here/x.pt" in str(info.value)


@pytest.mark.server_sensitive
def test_multipart_methods_of_the_store(s3_server):
    """The ``MultipartStore`` methods of ``Aioboto3Store`` on their own."""
    bucket = s3_server.new_bucket("ckpt")

    async def main():
        store = await Aioboto3Store.open(s3_server.config, max_connections=4)
        try:
            upload_id = await store.create_multipart(bucket, "m/obj")
            assert await store.list_multipart_uploads(bucket, "m/") == [("m/obj", upload_id)]
            assert await store.list_multipart_uploads(bucket, "other/") == []
            first = await store.upload_part(bucket, "m/obj", upload_id, 1, b"a" * SMALL_PART)
            last = await store.upload_part(bucket, "m/obj", upload_id, 2, bytearray(b"tail"))
            await store.complete_multipart(bucket, "m/obj", upload_id, [(1, first), (2, last)])
            assert await store.get_range(bucket, "m/obj", SMALL_PART - 2, None) == b"aatail"
            assert await store.list_multipart_uploads(bucket, "") == []

            doomed = await store.create_multipart(bucket, "m/doomed")
            await store.abort_multipart(bucket, "m/doomed", doomed)
            await store.abort_multipart(bucket, "m/doomed", doomed)  # idempotent
            with pytest.raises(StoreError, match="no longer exists") as info:
                await store.upload_part(bucket, "m/doomed", doomed, 1, b"x")
            assert not isinstance(info.value, NoSuchKeyError)
            assert f"s3://{bucket}/m/doomed" in str(info.value)
            assert await store.list_multipart_uploads(bucket, "") == []
        finally:
            await store.aclose()

    anyio.run(main)
