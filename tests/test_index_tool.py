"""``loader index`` (``shard_index/write.py``) against the in-memory store: what it writes, where, how it
resumes, and that ``from_shards`` then reads equal ranks from it without being told anything."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

import pytest
from test_shard_index import PATTERN, SIZES, store_with_index
from test_shards import BUCKET, build_shard, shard_key, shard_url

from loader import AsyncS3Dataset, ConfigError, Reading, Split
from loader.errors import NoSuchKeyError
from loader.shard_index.format import parse_index
from loader.shard_index.write import IndexOptions, index_shards

from fakes import FakeStore, reusable

INDEX = "shards/index.json"


def index_of(fake, key=INDEX):
    document = json.loads(fake.objects[BUCKET, key])
    return document, parse_index(document, key)


def run(fake, spec=PATTERN, **options):
    return index_shards(spec, IndexOptions(**options), store=reusable(fake))


@pytest.mark.parametrize("spec", [PATTERN, f"s3://{BUCKET}/shards/",
                                  [shard_url(s) for s in range(4)]])
def test_counts_sizes_etags_and_offsets_of_every_shard(spec):
    fake, _ = store_with_index(index=False)
    report = run(fake, spec)
    assert report.complete and report.indexed == 4 and report.samples == sum(SIZES)
    assert report.index_url == f"s3://{BUCKET}/{INDEX}"
    document, entries = index_of(fake)
    assert document["version"] == 1 and document["samples"] == 90
    for s, n in enumerate(SIZES):
        data, samples = build_shard(s, n, 100, 400)
        entry = entries[shard_url(s)]
        assert entry.samples == n and entry.size == len(data)
        assert entry.etag == fake.etag_of(BUCKET, shard_key(s))
        assert list(entry.offsets) == [first for _, _, first, _ in samples]
    for s in range(4):
        assert fake.requests_by_key[shard_key(s)] == 1, "each shard read once"


def test_what_it_writes_is_what_a_three_rank_job_reads_with_equal_counts():
    fake, _ = store_with_index(index=False)
    run(fake)
    lengths = []
    for rank in range(3):
        ds = AsyncS3Dataset.from_shards(PATTERN, store=reusable(fake), split=Split(rank=rank, world_size=3))
        assert len(ds) == 30
        lengths.append(len(list(ds)))
    assert lengths == [30, 30, 30]


def gnu_tar(members):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_compressed_shards_get_counts_without_offsets():
    long = "d/" + "x" * 120  # a GNU long name
    plain = gnu_tar([(f"{long}{i}.txt", b"t%d" % i) for i in range(7)] + [("d/z.cls", b"1")])
    fake = FakeStore.with_objects(BUCKET, {"gz/a.tar.gz": gzip.compress(plain), "gz/b.tgz": gzip.compress(plain)})
    run(fake, f"s3://{BUCKET}/gz/")
    document, entries = index_of(fake, "gz/index.json")
    for name in ("a.tar.gz", "b.tgz"):
        entry = entries[f"s3://{BUCKET}/gz/{name}"]
        assert entry.samples == 8 and entry.offsets is None
        assert entry.size == len(fake.objects[BUCKET, f"gz/{name}"])
    assert all(shard["compression"] == "gzip" and shard["bytes"] == len(plain) for shard in document["shards"])


def test_stopped_runs_resume_and_changed_shards_are_read_again():
    fake, _ = store_with_index(index=False)
    report = run(fake, concurrency=1, stop_after=2)
    assert not report.complete and report.indexed == 2
    _, entries = index_of(fake)
    assert len(entries) == 2, "the index so far was written when the run stopped"
    fake.reset_counters()
    report = run(fake)
    assert report.complete and report.already == 2 and report.indexed == 2
    assert sum(fake.requests_by_key[shard_key(s)] for s in range(4)) == 2, "only the other two read"
    data, _ = build_shard(1, 12, 100, 400)
    fake.objects[BUCKET, shard_key(1)] = data  # shard 1 rewritten with 12 samples
    fake.reset_counters()
    report = run(fake)
    assert report.already == 3 and report.indexed == 1
    assert fake.requests_by_key[shard_key(1)] == 1
    assert index_of(fake)[1][shard_url(1)].samples == 12
    assert run(fake, force=True).indexed == 4


def test_an_interrupted_run_keeps_what_it_indexed():
    fake, _ = store_with_index(index=False)
    seen = []

    def progress(report, total):
        def hook(nbytes, shards):
            seen.append(shards)
            if sum(seen) == 3:
                raise KeyboardInterrupt
        return hook

    with pytest.raises(KeyboardInterrupt):
        index_shards(PATTERN, IndexOptions(concurrency=1), store=reusable(fake), progress=progress)
    assert len(index_of(fake)[1]) == 3


def test_entries_of_other_shards_are_kept():
    fake, _ = store_with_index(index=False)
    run(fake, f"s3://{BUCKET}/shards/train-{{0000..0001}}.tar")
    run(fake, f"s3://{BUCKET}/shards/train-{{0002..0003}}.tar")
    assert set(index_of(fake)[1]) == {shard_url(s) for s in range(4)}


def test_out_writes_elsewhere_and_index_reads_it():
    fake, _ = store_with_index(index=False)
    report = run(fake, out=f"s3://{BUCKET}/meta/")
    assert report.index_url == f"s3://{BUCKET}/meta/index.json" and (BUCKET, INDEX) not in fake.objects
    ds = AsyncS3Dataset.from_shards(PATTERN, store=reusable(fake), reading=Reading(index=report.index_url))
    assert ds.shard_counts() == SIZES


def test_a_missing_shard_is_named():
    fake, _ = store_with_index(index=False)
    with pytest.raises(NoSuchKeyError, match=r"shard s3://bucket/shards/train-0004.tar does not exist"):
        run(fake, f"s3://{BUCKET}/shards/train-{{0000..0004}}.tar")


def test_another_files_index_json_is_not_replaced():
    fake, _ = store_with_index(index=False)
    fake.objects[BUCKET, INDEX] = b"[1, 2, 3]"
    with pytest.raises(ConfigError, match=r"index.json is not a shard index .* give --out"):
        run(fake)
    assert fake.objects[BUCKET, INDEX] == b"[1, 2, 3]"


def test_an_index_written_by_loader_shard_is_extended_not_replaced():
    fake, _ = store_with_index()
    document = json.loads(fake.objects[BUCKET, INDEX])
    document.update(created_by="loader shard", fingerprint="abc")
    for shard in document["shards"]:
        del shard["etag"]  # as loader shard wrote them before it recorded ETags
    fake.objects[BUCKET, INDEX] = json.dumps(document).encode()
    report = run(fake)
    assert report.indexed == 4  # read again to record their versions
    again, entries = index_of(fake)
    assert again["fingerprint"] == "abc" and all(entry.etag for entry in entries.values())


def test_loader_shard_records_each_shards_size_and_etag_and_from_shards_finds_its_index():
    from loader.tools.shard import PackOptions, pack

    objects = {f"src/{i:04d}.{ext}": b"%d" % i * 50 for i in range(60) for ext in ("txt", "cls")}
    fake = FakeStore.with_objects(BUCKET, objects)
    pack(f"s3://{BUCKET}/src/", f"s3://{BUCKET}/dst/", PackOptions(target_size=2_000), store=reusable(fake))
    document, entries = index_of(fake, "dst/index.json")
    for shard in document["shards"]:
        assert shard["size"] == len(fake.objects[BUCKET, shard["key"]])
        assert shard["etag"] == fake.etag_of(BUCKET, shard["key"])
    lengths = [len(list(AsyncS3Dataset.from_shards(f"s3://{BUCKET}/dst/", store=reusable(fake),
                                                    split=Split(rank=r, world_size=4)))) for r in range(4)]
    assert lengths == [15] * 4 and len(entries) > 4
    assert len(AsyncS3Dataset.from_shards(f"s3://{BUCKET}/dst/", store=reusable(fake))) == 60  # no batch_size


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_ranged_parts_when_asked_give_the_same_index():
    fake, _ = store_with_index(index=False)
    run(fake)
    streamed = index_of(fake)[1]
    fake.reset_counters()
    run(fake, force=True, parts_inflight=3, part_size=4096)
    assert index_of(fake)[1] == streamed
    assert all(fake.requests_by_key[shard_key(s)] > 3 for s in range(4)), "read as ranged parts"


def test_indexing_never_imports_torch():
    """``loader index`` is a command line tool: no torch import (seconds) on its way."""
    import subprocess
    import sys
    from pathlib import Path

    script = """
import sys
from fakes import FakeStore, reusable
from loader.shard_index.write import index_shards
import io, tarfile
out = io.BytesIO()
with tarfile.open(fileobj=out, mode="w") as tar:
    info = tarfile.TarInfo("a/1.txt"); info.size = 1; tar.addfile(info, io.BytesIO(b"x"))
fake = FakeStore.with_objects("bkt", {"s/0.tar": out.getvalue(), "t/1.tar": out.getvalue()})
assert index_shards("s3://bkt/s/", store=reusable(fake)).samples == 1
assert index_shards(["s3://bkt/t/1.tar"], store=reusable(fake)).samples == 1
assert "torch" not in sys.modules, "torch was imported"
"""
    here = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", script], cwd=here, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
