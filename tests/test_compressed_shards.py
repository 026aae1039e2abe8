"""Compressed shards (``.tar.gz``/``.tgz``, ``.tar.zst``) and shards written by other tools.

Shards here are made by GNU ``tar`` (gnu and posix formats, long names, hard links, symlinks,
gzip and zstd) and by webdataset's ``ShardWriter``; what the loader yields from them is compared,
field by field, with what webdataset's own reader yields for the same bytes (webdataset reads
``.tar.zst`` only through its decompressed ``.tar``, since Python's ``tarfile`` has no zstd
before 3.14). The in-memory ``FakeStore`` stands in for S3 and cuts streams to test restarts.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import warnings
from collections import Counter
from pathlib import Path

import pytest
import webdataset as wds
import zstandard

from loader import AsyncS3Dataset, ConfigError, Limits, Reading, Store
from loader.errors import EmptyDatasetError, ShardFormatError
from loader.formats.compression import compression_of, is_shard_name, open_decoder
from loader.formats.tar import TarStreamParser
from loader.retry import RetryPolicy

from fakes import FakeStore, reusable

BUCKET = "bucket"
FAST_RETRY = RetryPolicy(base_delay=0.001, max_delay=0.01)
LONG_DIR = "very-long-directory-name-" * 5  # member names over 100 bytes: GNU L / pax path


# ----------------------------------------------------------------------------- helpers


def digests(sample: dict) -> tuple[str, dict[str, str]]:
    """``(key, {field: sha256})`` of a sample from either reader (dunder fields left out)."""
    fields = {k: hashlib.sha256(v).hexdigest() for k, v in sample.items() if not k.startswith("__")}
    return sample["__key__"], fields


def webdataset_reads(path: Path) -> list[tuple[str, dict[str, str]]]:
    """What webdataset's own reader yields for a local shard file, in order."""
    dataset = wds.WebDataset(str(path), shardshuffle=False, empty_check=False)
    return [digests(sample) for sample in dataset]


def loader_reads(objects: dict[str, bytes], spec: str, **options) -> tuple[list, AsyncS3Dataset]:
    fake = FakeStore.with_objects(BUCKET, objects)
    retry = options.pop("retry", FAST_RETRY)
    options.setdefault("limits", Limits(concurrency=4))  # 4 parts of one shard: shard after shard,
    # as webdataset reads them
    dataset = AsyncS3Dataset.from_shards(spec, store=Store(backend=reusable(fake), retry=retry), **options)
    return [digests(sample) for sample in dataset], dataset


def make_tree(root: Path, samples: int = 12) -> None:
    """A directory of WebDataset samples, with a long name, a hard link and a symlink in it."""
    data = root / "data"
    (data / LONG_DIR).mkdir(parents=True)
    for i in range(samples):
        rng = hashlib.sha256(f"sample-{i}".encode()).digest()
        (data / f"s{i:03d}.jpg").write_bytes(rng * (40 + 37 * i))
        (data / f"s{i:03d}.cls").write_bytes(str(i % 7).encode())
        (data / f"s{i:03d}.meta.json").write_bytes(json.dumps({"i": i}).encode())
    (data / LONG_DIR / "deep.sample.txt").write_bytes(b"long name " * 300)
    # sorted by name, "s000.jpg" comes before "s000z.jpg": the latter is stored as a hard link
    os.link(data / "s000.jpg", data / "s000z.jpg")
    (data / "s001z.jpg").symlink_to("s001.jpg")


def gnu_tar(root: Path, out: Path, fmt: str, compress: str | None) -> Path:
    """``tar --format=FMT [-z|--zstd] -cf OUT data`` with GNU tar, sorted by name."""
    args = ["tar", f"--format={fmt}", "--sort=name", "--owner=0", "--group=0", "-C", str(root)]
    if compress == "gzip":
        args.append("-z")
    if compress == "zstd" and tar_has_zstd():
        args.append("--zstd")
    subprocess.run([*args, "-cf", str(out), "data"], check=True)
    if compress == "zstd" and not tar_has_zstd():  # an old tar: compress its output ourselves
        out.write_bytes(zstandard.ZstdCompressor().compress(out.read_bytes()))
    return out


def tar_has_zstd() -> bool:
    probe = subprocess.run(["tar", "--zstd", "--version"], capture_output=True, check=False)
    return probe.returncode == 0 and shutil.which("zstd") is not None


def plain_copy(path: Path, compress: str | None, into: Path) -> Path:
    """The decompressed ``.tar`` of a shard, for readers without zstd."""
    data = path.read_bytes()
    if compress == "zstd":
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    into.write_bytes(data)
    return into


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize("key, kind", [
    ("a/train-0000.tar", None), ("a/train-0000.tar.gz", "gzip"), ("a/train-0000.tgz", "gzip"),
    ("a/train-0000.tar.zst", "zstd"), ("a/train-0000.tzst", "zstd"),
])
def test_shard_names_and_their_compression(key, kind):
    assert is_shard_name(key)
    assert compression_of(key) == kind


@pytest.mark.parametrize("key", ["a/x.gz", "a/x.zst", "a/index.json", "a/x.tar.bz2", "a/tar"])
def test_other_names_are_not_shards(key):
    assert not is_shard_name(key)


# ----------------------------------------------------------------------------- GNU tar


@pytest.mark.parametrize("compress, suffix", [
    (None, ".tar"), ("gzip", ".tar.gz"), ("gzip", ".tgz"), ("zstd", ".tar.zst"),
])
@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_gnu_tar_shards_read_as_webdataset_reads_them(tmp_path, fmt, compress, suffix):
    make_tree(tmp_path)
    shard = gnu_tar(tmp_path, tmp_path / f"shard{suffix}", fmt, compress)
    expected = webdataset_reads(plain_copy(shard, compress, tmp_path / "plain.tar")
                                if compress == "zstd" else shard)
    assert len(expected) == 12 + 1  # the 12 samples and the long-named one; links are not samples
    with pytest.warns(RuntimeWarning, match=r"1 hard link\(s\) and 1 symbolic link\(s\)") as caught:
        got, dataset = loader_reads({f"shards/shard{suffix}": shard.read_bytes()},
                                    f"s3://{BUCKET}/shards/shard{suffix}")
    assert got == expected
    assert len([w for w in caught if "hard link" in str(w.message)]) == 1  # once per shard
    assert dataset.stats()["tar_links_skipped"] == 2
    long = [key for key, _ in got if LONG_DIR in key]
    assert long == [f"data/{LONG_DIR}/deep"]


def test_posix_tar_long_link_targets_are_named_in_the_warning(tmp_path):
    make_tree(tmp_path)
    target = f"{LONG_DIR}/deep.sample.txt"
    (tmp_path / "data" / "s002z.txt").symlink_to(target)
    shard = gnu_tar(tmp_path, tmp_path / "shard.tar.gz", "posix", "gzip")
    with pytest.warns(RuntimeWarning, match=r"2 symbolic link"):
        got, dataset = loader_reads({"s/a.tar.gz": shard.read_bytes()}, f"s3://{BUCKET}/s/a.tar.gz")
    parser = TarStreamParser("x")
    raw = gzip.decompress(shard.read_bytes())
    parser.feed(raw)
    assert (parser.hard_links, parser.symlinks) == (1, 2)
    assert parser.first_link == ("data/s000z.jpg", "data/s000.jpg")
    assert dataset.stats()["tar_links_skipped"] == 3


# ----------------------------------------------------------------------------- webdataset's writer


def write_with_shardwriter(directory: Path, pattern: str, count: int) -> list[Path]:
    with wds.ShardWriter(str(directory / pattern), maxcount=count // 3, verbose=0) as sink:
        for i in range(count):
            sink.write({"__key__": f"sample{i:05d}", "png": os.urandom(100 + i * 13),
                        "cls": i % 10, "json": {"caption": f"number {i}"}, "txt": f"text {i}"})
    return sorted(directory.glob("shard-*"))


@pytest.mark.parametrize("pattern", ["shard-%06d.tar.gz", "shard-%06d.tar"])
def test_shardwriter_shards_read_as_webdataset_reads_them(tmp_path, pattern):
    paths = write_with_shardwriter(tmp_path, pattern, 60)
    assert len(paths) == 3
    expected = [sample for path in paths for sample in webdataset_reads(path)]
    objects = {f"wds/{path.name}": path.read_bytes() for path in paths}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no links here: no warning either
        got, dataset = loader_reads(objects, f"s3://{BUCKET}/wds/")  # a prefix: listed
    assert got == expected
    assert len(got) == 60 and dataset.stats()["tar_links_skipped"] == 0


def test_brace_pattern_list_and_single_uri_of_compressed_shards(tmp_path):
    paths = write_with_shardwriter(tmp_path, "shard-%06d.tar.gz", 60)
    objects = {f"wds/{path.name}": path.read_bytes() for path in paths}
    objects["wds/shard-000001.tgz"] = objects.pop("wds/shard-000001.tar.gz")  # both suffixes
    expected = [sample for path in paths for sample in webdataset_reads(path)]
    specs = [f"s3://{BUCKET}/wds/shard-{{000000..000000}}.tar.gz",
             f"s3://{BUCKET}/wds/shard-000001.tgz", f"s3://{BUCKET}/wds/shard-000002.tar.gz"]
    got, _ = loader_reads(objects, specs)
    assert got == expected
    single, _ = loader_reads(objects, f"s3://{BUCKET}/wds/shard-000001.tgz")
    assert single == expected[20:40]


# ----------------------------------------------------------------------------- shards of our own


def build_samples(n: int, seed: int = 0) -> dict[str, dict[str, bytes]]:
    out = {}
    for i in range(n):
        blob = hashlib.sha256(f"{seed}-{i}".encode()).digest()
        out[f"k{seed:02d}/{i:05d}"] = {"bin": blob * (20 + i % 50), "cls": str(i % 10).encode()}
    return out


def tar_of(samples: dict[str, dict[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for key, fields in samples.items():
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def compress(data: bytes, kind: str) -> bytes:
    if kind == "gzip":
        return gzip.compress(data, compresslevel=6, mtime=0)
    return zstandard.ZstdCompressor(write_checksum=True).compress(data)


def expected_digests(samples: dict[str, dict[str, bytes]]) -> dict[str, dict[str, str]]:
    return {key: {ext: hashlib.sha256(v).hexdigest() for ext, v in fields.items()}
            for key, fields in samples.items()}


SUFFIX = {"gzip": ".tar.gz", "zstd": ".tar.zst"}


@pytest.fixture(params=["gzip", "zstd"])
def kind(request):
    return request.param


def compressed_store(kind: str, shards: int = 4, per_shard: int = 80):
    objects, expected = {}, {}
    for s in range(shards):
        samples = build_samples(per_shard, seed=s)
        objects[f"c/shard-{s:04d}{SUFFIX[kind]}"] = compress(tar_of(samples), kind)
        expected.update(expected_digests(samples))
    return objects, expected


def assert_exactly(got: list, expected: dict) -> None:
    counts = Counter(key for key, _ in got)
    assert not [k for k, n in counts.items() if n > 1], "a sample came twice"
    assert dict(got) == expected


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_cut_streams_restart_from_the_first_byte_without_duplicates(kind):
    objects, expected = compressed_store(kind)
    sizes = {key: len(value) for key, value in objects.items()}
    fake = FakeStore.with_objects(BUCKET, objects)
    first = f"c/shard-0000{SUFFIX[kind]}"
    last = f"c/shard-0003{SUFFIX[kind]}"
    fake.truncate = {first: [sizes[first] // 3, (2 * sizes[first]) // 3, None],
                     last: [sizes[last] - 10, None]}
    dataset = AsyncS3Dataset.from_shards(f"s3://{BUCKET}/c/", store=Store(backend=reusable(fake), retry=FAST_RETRY),
                                         reading=Reading(chunk_size=4096, part_size=1024))
    got = [digests(sample) for sample in dataset]
    assert_exactly(got, expected)
    assert fake.requests_by_key[first] == 3 and fake.requests_by_key[last] == 2
    assert dataset.stats()["retries"] == 3


@pytest.mark.usefixtures("small_parts")  # parts of a few KiB
def test_compressed_shards_are_never_read_as_ranged_parts(kind):
    objects, expected = compressed_store(kind, shards=2, per_shard=200)
    fake = FakeStore.with_objects(BUCKET, objects)
    dataset = AsyncS3Dataset.from_shards(f"s3://{BUCKET}/c/", store=reusable(fake),
                                         reading=Reading(part_size=1024))  # 4 parts in flight
    assert all(shard.size and shard.size > 2048 for shard in dataset.shards())
    fake.reset_counters()
    assert_exactly([digests(sample) for sample in dataset], expected)
    assert fake.requests == 2


def test_every_sample_once_with_workers_and_shuffle(kind):
    from torch.utils.data import DataLoader

    objects, expected = compressed_store(kind)
    fake = FakeStore.with_objects(BUCKET, objects)
    fake.truncate = {key: [len(value) // 2, None] for key, value in objects.items()}
    dataset = AsyncS3Dataset.from_shards(f"s3://{BUCKET}/c/", store=Store(backend=reusable(fake), retry=FAST_RETRY),
                                         shuffle=True, seed=3, reading=Reading(chunk_size=2048))
    got = [digests(s) for s in DataLoader(dataset, batch_size=None, num_workers=2,
                                          multiprocessing_context="fork")]
    assert_exactly(got, expected)


def test_a_truncated_object_is_a_format_error_and_can_be_skipped(kind):
    objects, expected = compressed_store(kind, shards=2)
    key = f"c/shard-0001{SUFFIX[kind]}"
    objects[key] = objects[key][: len(objects[key]) // 2]
    with pytest.raises(ShardFormatError, match=rf"truncated {kind} stream.*inside a {kind}"):
        loader_reads(objects, f"s3://{BUCKET}/c/")
    with pytest.warns(RuntimeWarning, match="skipping the rest of shard"):
        got, dataset = loader_reads(objects, f"s3://{BUCKET}/c/", on_error="warn")
    assert dataset.stats()["shards_skipped"] == 1
    assert {key for key, _ in got} >= {k for k in expected if k.startswith("k00/")}


def test_a_plain_tar_named_as_compressed_says_so(kind):
    objects = {f"c/x{SUFFIX[kind]}": tar_of(build_samples(3))}
    with pytest.raises(ShardFormatError, match=rf"not {kind}-compressed.*plain tar archive: name it \.tar"):
        loader_reads(objects, f"s3://{BUCKET}/c/x{SUFFIX[kind]}")


def test_a_compressed_shard_named_tar_gets_a_hint(kind):
    objects = {"c/x.tar": compress(tar_of(build_samples(3)), kind)}
    with pytest.raises(ShardFormatError, match=rf"{kind}-compressed.*\.tar"):
        loader_reads(objects, f"s3://{BUCKET}/c/x.tar")


def test_an_empty_compressed_object_is_an_empty_shard(kind):
    got, _ = loader_reads({f"c/x{SUFFIX[kind]}": b""}, f"s3://{BUCKET}/c/x{SUFFIX[kind]}")
    assert got == []


def test_a_prefix_lists_every_kind_of_shard_and_nothing_else():
    samples = build_samples(5)
    plain = tar_of(samples)
    objects = {"m/a.tar": plain, "m/b.tar.gz": compress(plain, "gzip"), "m/c.tgz": compress(plain, "gzip"),
               "m/d.tar.zst": compress(plain, "zstd"), "m/e.tzst": compress(plain, "zstd"),
               "m/index.json": b"{}", "m/f.gz": b"not a shard", "m/g.tar.bz2": b"not read"}
    fake = FakeStore.with_objects(BUCKET, objects)
    dataset = AsyncS3Dataset.from_shards(f"s3://{BUCKET}/m/", store=reusable(fake))
    assert [shard.key for shard in dataset.shards()] == ["m/a.tar", "m/b.tar.gz", "m/c.tgz",
                                                         "m/d.tar.zst", "m/e.tzst"]
    got = [digests(sample) for sample in dataset]
    assert Counter(key for key, _ in got) == {key: 5 for key in samples}


def test_a_prefix_without_shards_names_every_suffix():
    fake = FakeStore.with_objects(BUCKET, {"m/x.json": b"{}"})
    dataset = AsyncS3Dataset.from_shards(f"s3://{BUCKET}/m/", store=reusable(fake))
    with pytest.raises(EmptyDatasetError, match=r"'\.tar' or '\.tar\.gz' or '\.tgz'"):
        dataset.shards()


def test_without_a_zstd_library_the_error_names_the_extra(monkeypatch):
    for name in ("zstandard", "compression", "backports"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"x-0000\.tar\.zst.*pip install 's3stream-loader\[zstd\]'"):
        AsyncS3Dataset.from_shards(f"s3://{BUCKET}/c/x-{{0000..0003}}.tar.zst")
    AsyncS3Dataset.from_shards(f"s3://{BUCKET}/c/x-{{0000..0003}}.tar.gz")  # gzip needs nothing


# ----------------------------------------------------------------------------- decoders


def feed_all(kind: str, data: bytes, step: int, piece: int = 1 << 16) -> tuple[bytes, int]:
    decoder = open_decoder(kind, "s3://b/x", piece)
    out, largest = bytearray(), 0
    for at in range(0, len(data), step):
        for chunk in decoder.decode(data[at: at + step]):
            largest = max(largest, len(chunk))
            out += chunk
    decoder.finish()
    return bytes(out), largest


@pytest.mark.parametrize("step", [1, 1000, 1 << 20])
def test_gzip_members_padding_and_bounded_pieces(step):
    data = os.urandom(200_000) + bytes(3_000_000)
    stream = gzip.compress(data[:50_000]) + gzip.compress(data[50_000:]) + bytes(2048)
    out, largest = feed_all("gzip", stream, step, piece=65536)
    assert out == data
    assert largest <= 65536  # 3 MB of zeros from a few KB of input still comes in bounded pieces


def test_gzip_garbage_after_the_end_is_an_error():
    with pytest.raises(ShardFormatError, match="not gzip after the end"):
        feed_all("gzip", gzip.compress(b"abc") + b"trailing junk", 4096)


def test_gzip_corruption_is_an_error():
    stream = bytearray(gzip.compress(os.urandom(100_000)))
    stream[len(stream) // 2] ^= 0xFF
    with pytest.raises(ShardFormatError, match="corrupt gzip stream"):
        feed_all("gzip", bytes(stream), 4096)


@pytest.mark.parametrize("step", [1, 1000, 1 << 20])
def test_zstd_frames_in_sequence(step):
    data = os.urandom(150_000)
    compressor = zstandard.ZstdCompressor(write_checksum=True)
    stream = compressor.compress(data[:70_000]) + compressor.compress(data[70_000:])
    out, _ = feed_all("zstd", stream, step)
    assert out == data


def test_zstd_corruption_is_an_error():
    stream = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(os.urandom(100_000)))
    stream[len(stream) // 2] ^= 0xFF
    with pytest.raises(ShardFormatError, match="corrupt zstd stream"):
        feed_all("zstd", bytes(stream), 4096)


# ----------------------------------------------------------------------------- loader shard --compress


def pack_source(n: int) -> dict[str, bytes]:
    out = {}
    for i in range(n):
        out[f"src/{i:05d}.bin"] = hashlib.sha256(str(i).encode()).digest() * (5 + i % 40)
        out[f"src/{i:05d}.cls"] = str(i % 10).encode()
    return out


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_pack_compresses_shards_that_read_back_exactly(kind):
    from loader.shard_index.format import INDEX_NAME
    from loader.tools.shard import PackOptions, pack

    source = pack_source(150)
    fake = FakeStore.with_objects(BUCKET, source, min_part_size=4096)
    options = PackOptions(target_size=40_000, part_size=4096, compress=kind, concurrency=2)
    report = pack(f"s3://{BUCKET}/src/", f"s3://{BUCKET}/dst/", options, store=reusable(fake))
    assert report.complete and report.shards >= 3
    names = sorted(key for (_, key) in fake.objects if key.startswith("dst/shard-"))
    assert names and all(name.endswith(SUFFIX[kind]) for name in names)
    index = json.loads(fake.objects[BUCKET, "dst/" + INDEX_NAME])
    assert index["compression"] == kind
    for shard in index["shards"]:
        stored = fake.objects[BUCKET, shard["key"]]
        assert shard["stored_bytes"] == len(stored) < shard["bytes"]  # compressed, and smaller
    dataset = AsyncS3Dataset.from_shards(f"s3://{BUCKET}/dst/", store=reusable(fake))
    got = {s["__key__"]: (s["bin"], s["cls"]) for s in dataset}
    assert got == {f"{i:05d}": (source[f"src/{i:05d}.bin"], source[f"src/{i:05d}.cls"])
                   for i in range(150)}
    # a rerun makes the same bytes (deterministic compression), and resumes without rewriting
    again = pack(f"s3://{BUCKET}/src/", f"s3://{BUCKET}/dst/", options, store=reusable(fake))
    assert again.complete and again.written == 0 and again.resumed == report.shards
    fresh = FakeStore.with_objects(BUCKET, source, min_part_size=4096)
    pack(f"s3://{BUCKET}/src/", f"s3://{BUCKET}/dst/", options, store=reusable(fresh))
    assert all(fresh.objects[BUCKET, name] == fake.objects[BUCKET, name] for name in names)


def test_pack_resumes_compressed_shards_from_the_progress_record():
    from loader.tools.shard import PackOptions, pack

    source = pack_source(120)
    fake = FakeStore.with_objects(BUCKET, source)
    options = dict(target_size=10_000, compress="gzip", concurrency=1)
    first = pack(f"s3://{BUCKET}/src/", f"s3://{BUCKET}/dst/", PackOptions(**options, stop_after=2),
                 store=reusable(fake))
    assert not first.complete
    kept = {k: v for k, v in fake.objects.items() if k[1].endswith(".tar.gz")}
    second = pack(f"s3://{BUCKET}/src/", f"s3://{BUCKET}/dst/", PackOptions(**options),
                  store=reusable(fake))
    assert second.complete and second.resumed == len(kept) >= 2
    assert all(fake.objects[key] is blob for key, blob in kept.items())
    dataset = AsyncS3Dataset.from_shards(f"s3://{BUCKET}/dst/", store=reusable(fake))
    assert sorted(s["__key__"] for s in dataset) == [f"{i:05d}" for i in range(120)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(compress="gzip", name_format="s-{:04d}.tar"), r"gzip shards: end it in '\.tar\.gz'"),
    (dict(name_format="s-{:04d}.tar.zst"), r"plain tar shards.*'\.tar'"),
    (dict(compress="lz4"), "compress='lz4'"),
])
def test_pack_options_check_the_suffix_against_the_compression(kwargs, match):
    from loader.tools.shard import PackOptions

    with pytest.raises(ConfigError, match=match):
        PackOptions(**kwargs)
    assert PackOptions(compress="zstd").name_format == "shard-{:05d}.tar.zst"
    assert PackOptions(compress="gzip", name_format="t-{:03d}.tgz").name_format == "t-{:03d}.tgz"


def test_cli_shard_compress_flag_reaches_the_options(monkeypatch):
    from loader.tools import cli

    seen = {}

    def fake_pack(src, dst, options, **kwargs):
        seen["options"] = options
        raise KeyboardInterrupt

    monkeypatch.setattr("loader.tools.shard.pack", fake_pack)
    args = cli.build_parser().parse_args(["shard", "s3://bkt/src/", "s3://bkt/dst/", "--compress", "zstd"])
    args.run(args, out=io.StringIO(), err=io.StringIO())
    assert seen["options"].compress == "zstd"
    assert seen["options"].name_format == "shard-{:05d}.tar.zst"
