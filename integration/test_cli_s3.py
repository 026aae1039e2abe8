"""``python -m loader ls | shard | bench`` on a real S3 server, run as a user would: a subprocess
whose environment points at the server (``s3_server.env``).

``shard`` is checked end to end: 800 objects (400 samples of ``.jpg`` + ``.cls``) become tar
shards whose samples are exactly the objects (key, extension and sha256), read back through
``AsyncS3Dataset.from_shards`` with the index's sample counts; an interrupted run (stopped after
two shards, or killed) finishes on a rerun without duplicates; a shard bigger than a part goes up
as a multipart upload.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from loader import AsyncS3Dataset
from loader.shard_index.read import read_index_counts
from loader.tools.sizes import format_size

from datasets import jpeg_dataset, sha256, upload_objects
from faults import FaultPlan, FaultProxy
from s3servers import S3_VARS
from shardsets import upload_shards

REPO = Path(__file__).resolve().parents[1]
N_SAMPLES = 400  # x 2 objects (.jpg + .cls): ~2.4 kB JPEGs, ~1.6 MB of tar
CLI_VARS = S3_VARS + ("LOADER_STORE",)  # what a shell user may have set, cleared for each run


def cli_env(s3_server, **override: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLI_VARS}
    env.update(s3_server.env)
    env.update(override)
    return env


def loader_cmd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "loader", *argv]


def run_loader(s3_server, *argv: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(loader_cmd(*argv), capture_output=True, text=True, timeout=timeout,
                          env=cli_env(s3_server, **env), cwd=REPO)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loader "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def source(s3_server):
    """800 objects under train/ in a fresh bucket: (bucket, {key: sha256})."""
    bucket = s3_server.new_bucket("cli")
    return bucket, jpeg_dataset(s3_server.minio, bucket, "train/", N_SAMPLES, seed=11, with_cls=True)


@pytest.fixture(scope="module")
def packed(s3_server, source):
    """``loader shard`` of ``source`` into shards/ (about 8 shards of at most 200 kB), run once:
    the shard test checks what it made and said, the bench reads its shards. (dst URI, process)."""
    bucket, _ = source
    dst = f"s3://{bucket}/shards/"
    return dst, run_loader(s3_server, "shard", f"s3://{bucket}/train/", dst, "--target-size", "200k",
                           "--concurrency", "4", "--progress")


def tar_keys(s3_server, bucket: str, prefix: str) -> dict[str, int]:
    return {o.object_name: o.size for o in s3_server.minio.list_objects(bucket, prefix, recursive=True)
            if o.object_name.endswith(".tar")}


def read_back(s3_server, dst: str, counts: dict[str, int] | None = None) -> dict[str, str]:
    """``{"train/<key>.<ext>": sha256}`` of every member of every shard, checking for duplicates."""
    dataset = AsyncS3Dataset.from_shards(dst, config=s3_server.config, sample_counts=counts)
    got: dict[str, str] = {}
    for sample in dataset:
        for ext, value in sample.items():
            if ext.startswith("__"):
                continue
            name = f"train/{sample['__key__']}.{ext}"
            assert name not in got, f"{name} is in two shards"
            got[name] = sha256(value)
    return got


def test_shard_makes_shards_whose_samples_are_the_objects(s3_server, source, packed):
    bucket, expected = source
    dst, proc = packed
    assert_ok(proc)
    assert f"packed {2 * N_SAMPLES:,} objects ({N_SAMPLES:,} samples" in proc.stdout
    assert f"from_shards({dst!r})" in proc.stdout and "sample_counts" not in proc.stdout  # finds the index
    assert "shard" in proc.stderr and "objects" in proc.stderr  # the progress bar

    listed = tar_keys(s3_server, bucket, "shards/")
    index = json.loads(s3_server.minio.get_object(bucket, "shards/index.json").read())
    assert index["samples"] == N_SAMPLES and index["objects"] == 2 * N_SAMPLES
    assert {s["key"]: s["bytes"] for s in index["shards"]} == listed
    assert len(listed) > 5 and max(listed.values()) <= 200_000

    counts = read_index_counts(dst + "index.json", config=s3_server.config)
    assert counts == {f"s3://{bucket}/{s['key']}": s["samples"] for s in index["shards"]}
    assert sum(counts.values()) == N_SAMPLES
    dataset = AsyncS3Dataset.from_shards(dst, config=s3_server.config, sample_counts=counts)
    assert len(dataset) == N_SAMPLES
    assert read_back(s3_server, dst, counts) == expected

    # the index's offsets point at each sample's first header
    shard = index["shards"][len(index["shards"]) // 2]
    offset = shard["offsets"][3]
    head = s3_server.minio.get_object(bucket, shard["key"], offset=offset, length=512).read()
    member = tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
    assert member.name.endswith((".cls", ".jpg")) and f"train/{member.name}" in expected


@pytest.mark.parametrize("kind, suffix", [("gzip", ".tar.gz"), ("zstd", ".tar.zst")])
def test_shard_compress_makes_compressed_shards_that_read_back_exactly(s3_server, source, kind, suffix):
    bucket, expected = source
    dst = f"s3://{bucket}/shards-{kind}/"
    proc = run_loader(s3_server, "shard", f"s3://{bucket}/train/", dst, "--target-size", "500k",
                      "--compress", kind)
    assert_ok(proc)
    stored = {o.object_name: o.size for o in s3_server.minio.list_objects(bucket, f"shards-{kind}/")
              if o.object_name.endswith(suffix)}
    index = json.loads(s3_server.minio.get_object(bucket, f"shards-{kind}/index.json").read())
    assert index["compression"] == kind and len(stored) == len(index["shards"]) > 1
    assert {s["key"]: s["stored_bytes"] for s in index["shards"]} == stored
    counts = read_index_counts(dst + "index.json", config=s3_server.config)
    assert read_back(s3_server, dst, counts) == expected


def test_an_interrupted_shard_run_finishes_on_a_rerun_without_duplicates(s3_server, source):
    bucket, expected = source
    src, dst = f"s3://{bucket}/train/", f"s3://{bucket}/resumed/"
    args = ("shard", src, dst, "--target-size", "300k", "--concurrency", "2")
    first = run_loader(s3_server, *args, "--stop-after", "2")
    assert first.returncode == 130, first.stderr
    assert "run the same command again" in first.stderr and "Traceback" not in first.stderr
    early = tar_keys(s3_server, bucket, "resumed/")
    assert len(early) >= 2
    names = {o.object_name for o in s3_server.minio.list_objects(bucket, "resumed/")}
    assert "resumed/_progress.json" in names and "resumed/index.json" not in names
    etags = {key: s3_server.minio.stat_object(bucket, key).etag for key in early}

    second = run_loader(s3_server, *args)
    assert_ok(second)
    # a rerun that keeps none shows what the server listed under DST before and after it: the
    # same shards (its listing missed them) or others (its plan did not match them)
    assert f"{len(early)} shard(s) were already there" in second.stdout, (
        f"{second.stdout}{second.stderr}\nbefore the rerun: {sorted(early.items())}\n"
        f"now: {sorted(tar_keys(s3_server, bucket, 'resumed/').items())}")
    for key, etag in etags.items():
        assert s3_server.minio.stat_object(bucket, key).etag == etag, f"{key} was uploaded again"
    index = json.loads(s3_server.minio.get_object(bucket, "resumed/index.json").read())
    assert len(index["shards"]) > len(early)
    assert read_back(s3_server, dst) == expected

    third = run_loader(s3_server, *args)  # a finished run is a no-op
    assert_ok(third)
    assert f"{len(index['shards'])} shard(s) were already there" in third.stdout

    other = run_loader(s3_server, "shard", src, dst, "--target-size", "400k")
    assert_one_line_error(other, "different run", "--overwrite")


def test_a_killed_shard_run_finishes_on_a_rerun(s3_server, source):
    bucket, expected = source
    src, dst = f"s3://{bucket}/train/", f"s3://{bucket}/killed/"
    # ~30 shards: the run is still packing when the first appears
    args = ("shard", src, dst, "--target-size", "50k", "--concurrency", "1", "--get-concurrency", "2")
    proc = subprocess.Popen(loader_cmd(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=cli_env(s3_server), cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not tar_keys(s3_server, bucket, "killed/") and proc.poll() is None:
            assert time.monotonic() < deadline, "no shard appeared within 60 s"  # hang guard
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode != 0, "the run finished before it could be killed: give it more to pack"
    names = {o.object_name for o in s3_server.minio.list_objects(bucket, "killed/")}
    assert "killed/index.json" not in names

    rerun = run_loader(s3_server, *args[:5], "--concurrency", "4")
    assert_ok(rerun)
    assert "were already there" in rerun.stdout
    assert read_back(s3_server, dst) == expected
    assert open_uploads(s3_server, bucket, "killed/") == []


def open_uploads(s3_server, bucket: str, prefix: str) -> list[str]:
    """Keys of multipart uploads neither completed nor aborted (boto3: a third client)."""
    import boto3
    from botocore.config import Config

    config = s3_server.config
    client = boto3.client("s3", endpoint_url=config.endpoint_url, region_name=config.region,
                          aws_access_key_id=config.access_key_id,
                          aws_secret_access_key=config.secret_access_key,
                          config=Config(s3={"addressing_style": "path"}))
    try:
        page = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
        return [upload["Key"] for upload in page.get("Uploads", ())]
    finally:
        client.close()


def test_a_shard_bigger_than_a_part_is_a_multipart_upload(s3_server):
    bucket = s3_server.new_bucket("cli-big")
    items = {f"big/{i:02d}.bin": os.urandom(3 << 20) for i in range(4)}
    items.update({f"big/{i:02d}.txt": f"sample {i}".encode() for i in range(4)})
    upload_objects(s3_server.minio, bucket, items)
    proc = run_loader(s3_server, "shard", f"s3://{bucket}/big/", f"s3://{bucket}/out/",
                      "--target-size", "64MB", "--part-size", "5MiB")
    assert_ok(proc)
    (key, size), = tar_keys(s3_server, bucket, "out/").items()
    assert size > 12 << 20
    etag = s3_server.minio.stat_object(bucket, key).etag
    assert etag.endswith("-3"), f"expected a 3-part multipart upload, ETag {etag!r}"
    assert open_uploads(s3_server, bucket, "out/") == []
    blob = s3_server.minio.get_object(bucket, key).read()
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        got = {f"big/{m.name}": tar.extractfile(m).read() for m in tar.getmembers()}
    assert got == items


def test_ls_prints_count_size_histogram_and_the_shard_hint(s3_server, source):
    bucket, expected = source
    total = sum(o.size for o in s3_server.minio.list_objects(bucket, "train/", recursive=True))
    proc = run_loader(s3_server, "ls", f"s3://{bucket}/train/")
    assert_ok(proc)
    assert f"s3://{bucket}/train/: {2 * N_SAMPLES:,} objects, {format_size(total)} ({total:,} bytes)" in proc.stdout
    assert f"jpg {N_SAMPLES:,}" in proc.stdout and f"cls {N_SAMPLES:,}" in proc.stdout
    assert "size histogram" in proc.stdout and "█" in proc.stdout
    assert f"loader shard s3://{bucket}/train/" in proc.stdout


def test_bench_reports_throughput_in_both_modes(s3_server, source, packed):
    bucket, _ = source
    objects = run_loader(s3_server, "bench", f"s3://{bucket}/train/", "--samples", "300",
                         "--workers", "0", "--batch-size", "32")
    assert_ok(objects)
    assert "per-object" in objects.stdout and "samples/s" in objects.stdout and "MB/s" in objects.stdout
    lines = {line.split()[0]: line for line in objects.stdout.splitlines()[1:]}
    # 300 samples of a .jpg and a .cls each; on a busy machine a straggling GET may be hedged
    # (at most 5 % of the requests, plus 8: docs/design/retry.md), each hedge one request more
    requests = int(lines["requests"].split()[1].replace(",", ""))
    assert lines["samples"].split()[1] == "300" and 600 <= requests <= 600 + 30 + 8, lines["requests"]
    assert "n/a" not in lines["latency"]

    dst, proc = packed
    assert_ok(proc)
    shards = run_loader(s3_server, "bench", dst, "--shards", "--samples", "0", "--workers", "2")
    assert_ok(shards)
    assert "(shards," in shards.stdout
    assert f"{N_SAMPLES:,}" in shards.stdout.splitlines()[1]


def test_user_errors_are_one_line(s3_server, source):
    bucket, _ = source
    missing = run_loader(s3_server, "ls", "s3://no-such-bucket-cli/x/")
    assert_one_line_error(missing, "no-such-bucket-cli", "does not exist")
    typo = run_loader(s3_server, "ls", f"s3://{bucket}/nothing-here/", "--save", "keys.snapshot")
    assert_one_line_error(typo, "no objects")  # a snapshot of nothing is refused
    denied = run_loader(s3_server, "shard", f"s3://{bucket}/train/", f"s3://{bucket}/x/",
                        AWS_SECRET_ACCESS_KEY="wrong-secret")
    assert_one_line_error(denied, "access denied")
    assert "wrong-secret" not in denied.stderr
    no_dst = run_loader(s3_server, "shard", f"s3://{bucket}/train/", "s3://no-such-bucket-cli/x/")
    assert_one_line_error(no_dst, "no-such-bucket-cli", "does not exist")


def test_ls_of_nothing_says_so_and_succeeds(s3_server, source):
    """A new bucket is empty until the first upload: `ls` answers that (rc 0), not an error."""
    bucket, _ = source
    empty_bucket = s3_server.new_bucket("empty")
    whole = run_loader(s3_server, "ls", f"s3://{empty_bucket}/")
    assert_ok(whole)
    assert "0 objects, the bucket is empty" in whole.stdout
    typo = run_loader(s3_server, "ls", f"s3://{bucket}/nothing-here/")
    assert_ok(typo)
    assert "0 objects under this prefix" in typo.stdout and "case-sensitive" in typo.stdout


@pytest.fixture(scope="module")
def shard_prefix(s3_server) -> tuple[str, dict[str, int]]:
    """A small shard of each kind, .tar, .tar.gz and .tar.zst, and the index files `loader shard`
    leaves beside them, in one prefix: (the prefix's URI, {shard URI: samples})."""
    bucket = s3_server.new_bucket("cli-shards")
    counts: dict[str, int] = {}
    for seed, compression in enumerate((None, "gzip", "zstd")):
        counts.update(upload_shards(s3_server.minio, bucket, f"packed/{compression or 'tar'}-", [40 + seed],
                                    seed=seed, compression=compression)[1])
    upload_objects(s3_server.minio, bucket, {"packed/index.json": b"{}", "packed/_progress.json": b"{}"})
    return f"s3://{bucket}/packed/", counts


def test_ls_and_bench_see_shards_in_a_prefix_as_shards(s3_server, shard_prefix):
    """Small .tar, .tar.gz and .tar.zst shards (with the index files `loader shard` leaves beside
    them): `ls` says they are shards, each kind, with no advice to pack them into shards, and
    `bench` on the same prefix reads them in shard mode, each kind decompressed, and says why."""
    uri, counts = shard_prefix
    listed = run_loader(s3_server, "ls", uri)
    assert_ok(listed)
    assert f"these look like tar shards (3 of 5 objects): read them with AsyncS3Dataset.from_shards({uri!r})" \
        in listed.stdout
    assert "loader shard" not in listed.stdout and "Pack them" not in listed.stdout

    benched = run_loader(s3_server, "bench", uri, "--samples", "0", "--workers", "0")
    assert_ok(benched)
    assert "(shards," in benched.stdout.splitlines()[0]
    assert sum(counts.values()) == 123
    assert "of 3 shards" in benched.stdout and "123" in benched.stdout.splitlines()[1]
    assert f"note: 3 of the 5 objects under {uri} are tar shards: read in shard mode" in benched.stdout


def test_bench_objects_reads_a_prefix_of_shards_as_objects(s3_server, shard_prefix):
    """`bench --objects` overrides the shard mode a prefix of shards gets: per-object, without the note."""
    uri, _ = shard_prefix
    as_objects = run_loader(s3_server, "bench", uri, "--objects", "--samples", "0", "--workers", "0")
    assert_ok(as_objects)
    assert "(per-object," in as_objects.stdout and "note:" not in as_objects.stdout


def test_ls_of_a_whole_bucket_suggests_a_destination_that_works(s3_server):
    """`ls s3://b` suggests `loader shard s3://b s3://b/shards/` (not a bucket `b-shards` that
    does not exist); that command packs the bucket, and run again it finds its shards done
    rather than packing them as source objects."""
    bucket = s3_server.new_bucket("cli-root")
    objects = jpeg_dataset(s3_server.minio, bucket, "", 200, seed=5, with_cls=True)
    listed = run_loader(s3_server, "ls", f"s3://{bucket}")
    assert_ok(listed)
    command = [line.split() for line in listed.stdout.splitlines() if line.startswith("  loader shard ")]
    assert command == [["loader", "shard", f"s3://{bucket}", f"s3://{bucket}/shards/", "--target-size",
                        "256MB"]], listed.stdout
    packed = run_loader(s3_server, *command[0][1:3], command[0][3], "--target-size", "100k")
    assert_ok(packed)
    assert "packed 400 objects (200 samples" in packed.stdout
    dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/shards/", config=s3_server.config)
    got = {f"{sample['__key__']}.{ext}": sha256(value) for sample in dataset
           for ext, value in sample.items() if not ext.startswith("__")}
    assert got == objects
    again = run_loader(s3_server, *command[0][1:3], command[0][3], "--target-size", "100k")
    assert_ok(again)
    assert "packed 400 objects" in again.stdout and "were already there" in again.stdout


def test_ls_and_bench_read_a_prefix_of_parquet_files_as_rows(s3_server):
    """A folder of Parquet files (and one truncated): `ls` counts rows and row groups from the
    footers, points at from_parquet and gives no advice to pack them into tar shards; `bench`
    reads rows, not each file as one sample."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bucket = s3_server.new_bucket("cli-pq")
    files = {}
    for number, rows in enumerate((30, 25)):
        out = io.BytesIO()
        pq.write_table(pa.table({"n": list(range(rows)), "blob": [bytes([number]) * 50] * rows}), out,
                       row_group_size=10)
        files[f"pq/part-{number}.parquet"] = out.getvalue()
    upload_objects(s3_server.minio, bucket, files)
    uri = f"s3://{bucket}/pq/"
    listed = run_loader(s3_server, "ls", uri)
    assert_ok(listed)
    assert (f"these are Parquet files (2 of 2 objects, 55 rows in 6 row groups): read them with "
            f"AsyncS3Dataset.from_parquet({uri!r})") in listed.stdout, listed.stdout
    assert "loader shard" not in listed.stdout and "Pack them" not in listed.stdout

    benched = run_loader(s3_server, "bench", uri, "--samples", "0", "--workers", "0", "--batch-size", "8")
    assert_ok(benched)
    assert "(Parquet rows," in benched.stdout.splitlines()[0], benched.stdout
    lines = {line.split()[0]: line for line in benched.stdout.splitlines()[1:]}
    assert lines["samples"].split()[1] == "55" and "of 55 rows in 2 Parquet files" in lines["samples"]
    assert f"note: 2 of the 2 objects under {uri} are Parquet files: read as rows" in benched.stdout

    upload_objects(s3_server.minio, bucket, {"pq/part-2.parquet": files["pq/part-0.parquet"][:-30]})
    cut = run_loader(s3_server, "ls", uri)
    assert_ok(cut)
    assert "these are Parquet files (3 of 3 objects, 55 rows in 6 row groups)" in cut.stdout, cut.stdout
    assert f"unreadable: s3://{bucket}/pq/part-2.parquet" in cut.stdout


def test_ls_against_errors_gives_up_at_its_retry_deadline_naming_who_answered(s3_server):
    """Every request answered 503 SlowDown by a proxy in front of the server: ``loader ls
    --retry-deadline 2`` gives up at that deadline (the default is 120 s), and its error names
    the endpoint that answered (the proxy's) and advises the option, not ``RetryPolicy``."""
    plan = FaultPlan(slowdown=1.0, objects_only=False)  # listings too
    with FaultProxy(s3_server.config.endpoint_url, plan) as proxy:
        proc = run_loader(s3_server, "ls", "--retry-deadline", "2", "s3://cli/train/", timeout=90,
                          AWS_ENDPOINT_URL=proxy.endpoint_url)
        answered = proxy.counts["slowdown"]
    assert_one_line_error(proc, "loader ls: error: s3://cli/train/ (listing): the server answered SlowDown "
                          f"(HTTP 503) at {proxy.endpoint_url}; gave up after ",
                          "(its deadline of 2 s would pass before another attempt: raise it with "
                          "--retry-deadline to wait out longer outages)")
    assert "RetryPolicy" not in proc.stderr
    attempts = int(re.search(r"gave up after (\d+) attempt\(s\)", proc.stderr).group(1))
    assert attempts >= 2 and answered == attempts  # one listing's attempts, each answered by the proxy
