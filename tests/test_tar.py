"""Tests for loader.formats.tar: round trips through Python's tarfile, truncation, garbage and resume."""

from __future__ import annotations

import gzip
import io
import os
import random
import struct
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.datasets.object_samples import field_of
from loader.errors import ShardFormatError
from loader.formats.grouping import SampleGrouper, iter_samples, split_key
from loader.formats.tar import BLOCK_SIZE, TarMember, TarStreamParser

URL = "s3://bucket/shards/train-00007.tar"
FORMATS = [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]
FORMAT_IDS = ["ustar", "gnu", "pax"]
END = bytes(2 * BLOCK_SIZE)
USTAR = b"ustar\x0000"


# -- helpers ------------------------------------------------------------------------------------


def tar_bytes(entries, fmt=tarfile.PAX_FORMAT, **tar_kwargs) -> bytes:
    """Write ``entries`` (name, data) or (name, data, tarinfo-type, linkname) with tarfile."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, **tar_kwargs) as tf:
        for entry in entries:
            name, data = entry[0], entry[1]
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if len(entry) > 2:
                info.type = entry[2]
                info.linkname = entry[3] if len(entry) > 3 else ""
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def split_at(stream: bytes, points) -> list[bytes]:
    cuts = [0, *sorted(min(max(p, 0), len(stream)) for p in points), len(stream)]
    return [stream[a:b] for a, b in zip(cuts, cuts[1:])]


def parse_members(chunks, url=URL) -> list[TarMember]:
    parser = TarStreamParser(url)
    members = [m for chunk in chunks for m in parser.feed(chunk)]
    parser.close()
    return members


def block_checksum(block: bytes | bytearray, signed: bool = False) -> int:
    body = bytes(block[:148]) + b" " * 8 + bytes(block[156:])
    return sum(struct.unpack("512b", body)) if signed else sum(body)


def with_checksum(block: bytearray, signed: bool = False) -> bytes:
    block[148:156] = b"%06o\x00 " % (block_checksum(block, signed) & 0o777777)
    return bytes(block)


def header(name: bytes, size: int, typeflag: bytes = b"0", magic: bytes = USTAR) -> bytearray:
    block = bytearray(BLOCK_SIZE)
    block[0 : len(name)] = name
    block[100:108] = b"0000644\x00"
    block[124:136] = b"%011o\x00" % size
    block[136:148] = b"14644731640\x00"
    block[156:157] = typeflag
    block[257:265] = magic
    return block


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK_SIZE)


SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]  # megabyte payloads are intended


# -- strategies ---------------------------------------------------------------------------------

# Key segments: any printable unicode (spaces included) but no '/', '.', NUL or surrogates.
_segment = st.text(
    st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/."),
    min_size=1,
    max_size=60,
)
_keys = st.lists(_segment, min_size=1, max_size=5).map("/".join)
_exts = st.text("abcdefghijklmnopqrstuvwxyz0123456789.-", min_size=1, max_size=8)
_small = st.binary(max_size=700)
# Megabyte payloads cheaply: a short random pattern repeated, plus a random tail.
_large = st.builds(
    lambda pattern, reps, tail: pattern * reps + tail,
    st.binary(min_size=16, max_size=64),
    st.one_of(st.integers(1, 2_000), st.integers(20_000, 60_000)),
    st.binary(max_size=600),
)
_payloads = st.one_of(_small, _small, _small, _large)
_fields = st.lists(st.tuples(_exts, _payloads), min_size=1, max_size=4, unique_by=lambda f: f[0])
_samples = st.lists(
    st.tuples(_keys, _fields, st.booleans()), min_size=0, max_size=6, unique_by=lambda s: s[0]
)


def write_samples(samples, fmt) -> tuple[bytes, list[dict]]:
    """Write samples with tarfile; return the stream and the samples it really holds.

    With ``dir_entry`` set, a directory member (and a symlink) precede the sample. USTAR cannot
    store every long name; members it refuses are left out of both.
    """
    buf = io.BytesIO()
    expected: list[dict] = []
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for key, fields, dir_entry in samples:
            if dir_entry:
                for info in (tarfile.TarInfo(key + "_dir"), tarfile.TarInfo(key + "_link")):
                    info.type = tarfile.DIRTYPE if info.name.endswith("_dir") else tarfile.SYMTYPE
                    info.linkname = "" if info.type == tarfile.DIRTYPE else "elsewhere"
                    if _fits(info, fmt):
                        tf.addfile(info)
            sample: dict = {}
            for ext, data in fields:
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                if _fits(info, fmt):
                    tf.addfile(info, io.BytesIO(data))
                    sample[ext] = data
            if sample:
                expected.append(
                    {"__key__": key, "__url__": URL, "__index__": len(expected), **sample}
                )
    return buf.getvalue(), expected


def _fits(info: tarfile.TarInfo, fmt: int) -> bool:
    try:
        info.tobuf(fmt, "utf-8", "surrogateescape")
    except ValueError:  # USTAR: name too long
        return False
    return True


def _split_points(data, length: int) -> list[int]:
    """Random split points, some at and next to block boundaries, some adjacent (1-byte chunks)."""
    near_block = st.builds(
        lambda block, delta: block * BLOCK_SIZE + delta,
        st.integers(0, max(length // BLOCK_SIZE, 0)),
        st.integers(-2, 2),
    )
    points = data.draw(st.lists(st.one_of(st.integers(0, length), near_block), max_size=40))
    runs = data.draw(st.lists(st.integers(0, length), max_size=3))
    for start in runs:  # a run of 1-byte chunks
        points.extend(range(start, min(start + 20, length)))
    return points


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@settings(max_examples=100, deadline=None, suppress_health_check=SLOW_OK)
@given(samples=_samples, data=st.data())
def test_round_trip_any_chunking(fmt, samples, data):
    stream, expected = write_samples(samples, fmt)
    chunks = split_at(stream, _split_points(data, len(stream)))
    assert list(iter_samples(chunks, URL)) == expected


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@settings(max_examples=25, deadline=None)
@given(
    samples=st.lists(
        st.tuples(
            _keys,
            st.lists(st.tuples(_exts, _small), min_size=1, max_size=3, unique_by=lambda f: f[0]),
            st.booleans(),
        ),
        max_size=3,
        unique_by=lambda s: s[0],
    )
)
def test_round_trip_one_byte_chunks(fmt, samples):
    stream, expected = write_samples(samples, fmt)
    assert list(iter_samples([stream[i : i + 1] for i in range(len(stream))], URL)) == expected


@settings(max_examples=30, deadline=None, suppress_health_check=SLOW_OK)
@given(samples=_samples, fmt=st.sampled_from(FORMATS), data=st.data())
def test_member_offsets_match_tarfile(samples, fmt, data):
    stream, _ = write_samples(samples, fmt)
    chunks = split_at(stream, _split_points(data, len(stream)))
    with tarfile.open(fileobj=io.BytesIO(stream)) as tf:
        regular = [info for info in tf.getmembers() if info.isreg()]
    members = parse_members(chunks)
    assert [(m.name, m.offset) for m in members] == [(i.name, i.offset) for i in regular]


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_round_trip_megabyte_members(fmt):
    rng = random.Random(fmt)
    entries = [
        ("big/" + "x" * 90 + "/0001.bin", rng.randbytes(1000) * 5_000 + b"end"),
        ("big/" + "x" * 90 + "/0001.cls", b"1"),
        ("big/0002.bin", rng.randbytes(3 << 20)),
        ("big/0002.json", b""),
    ]
    stream = tar_bytes(entries, fmt=fmt)
    sizes = [1, 511, 512, 513, 65_535, 65_536, 1 << 20, 3 << 20]
    points, pos = [], 0
    while pos < len(stream):
        pos += rng.choice(sizes)
        points.append(pos)
    assert [(m.name, m.data) for m in parse_members(split_at(stream, points))] == entries


def test_bytearray_and_memoryview_chunks_are_copied():
    stream = tar_bytes([("k.bin", b"x" * 100_000)])
    buf = bytearray(stream[:70_000])
    parser = TarStreamParser(URL)
    assert parser.feed(buf) == []
    buf[:] = bytes(len(buf))  # the caller reuses its buffer
    (member,) = parser.feed(memoryview(stream)[70_000:])
    assert member.data == b"x" * 100_000


# -- member types -------------------------------------------------------------------------------


def test_directories_and_zero_size_members():
    stream = tar_bytes(
        [
            ("a", b"", tarfile.DIRTYPE),
            ("a/x.txt", b""),
            ("a/x.cls", b"1"),
            ("a/y.txt", b""),
        ]
    )
    assert list(iter_samples([stream], URL)) == [
        {"__key__": "a/x", "__url__": URL, "__index__": 0, "txt": b"", "cls": b"1"},
        {"__key__": "a/y", "__url__": URL, "__index__": 1, "txt": b""},
    ]


def test_links_and_devices_are_skipped():
    stream = tar_bytes(
        [
            ("k.jpg", b"jpeg"),
            ("k.lnk", b"", tarfile.SYMTYPE, "k.jpg"),
            ("k.hard", b"", tarfile.LNKTYPE, "k.jpg"),
            ("k.fifo", b"", tarfile.FIFOTYPE),
            ("k.cls", b"3"),
        ]
    )
    members = parse_members([stream])
    assert [m.name for m in members] == ["k.jpg", "k.cls"]
    assert list(iter_samples([stream], URL)) == [
        {"__key__": "k", "__url__": URL, "__index__": 0, "jpg": b"jpeg", "cls": b"3"}
    ]


def test_unknown_type_data_is_skipped():
    volume = with_checksum(header(b"label", 5, typeflag=b"V"))
    stream = volume + padded(b"12345") + with_checksum(header(b"k.txt", 2)) + padded(b"hi") + END
    assert [(m.name, m.data) for m in parse_members([stream])] == [("k.txt", b"hi")]


def test_v7_header_without_magic():
    v7_dir = with_checksum(header(b"old/", 0, typeflag=b"\x00", magic=bytes(8)))
    v7_file = with_checksum(header(b"old/k.txt", 3, typeflag=b"\x00", magic=bytes(8)))
    stream = v7_dir + v7_file + padded(b"abc") + END
    assert [(m.name, m.data, m.offset) for m in parse_members([stream])] == [
        ("old/k.txt", b"abc", BLOCK_SIZE)
    ]


def test_ustar_prefix_is_joined_but_gnu_prefix_area_is_not():
    long_dir = "d" * 120
    stream = tar_bytes([(f"{long_dir}/k.txt", b"x")], fmt=tarfile.USTAR_FORMAT)
    assert stream[345:345 + 120] == long_dir.encode()  # really stored in the prefix field
    assert parse_members([stream])[0].name == f"{long_dir}/k.txt"
    gnu = header(b"k.txt", 1, magic=b"ustar  \x00")
    gnu[345:357] = b"14644731640\x00"  # GNU atime lives where ustar keeps the prefix
    assert parse_members([with_checksum(gnu) + padded(b"x") + END])[0].name == "k.txt"


def test_base256_size_and_signed_checksum():
    block = header("é.bin".encode(), 0)
    block[124:136] = b"\x80" + (700).to_bytes(11, "big")
    stream = with_checksum(block, signed=True) + padded(b"z" * 700) + END
    (member,) = parse_members([stream])
    assert (member.name, member.data) == ("é.bin", b"z" * 700)


def test_pax_size_overrides_header_size():
    records = b"12 size=700\n"
    pax = with_checksum(header(b"././@PaxHeader", len(records), typeflag=b"x")) + padded(records)
    stream = pax + with_checksum(header(b"k.bin", 0)) + padded(b"q" * 700) + END
    assert [(m.name, m.data, m.offset) for m in parse_members([stream])] == [
        ("k.bin", b"q" * 700, 0)
    ]


def test_pax_global_header_path_is_ignored():
    stream = tar_bytes(
        [("k.txt", b"a"), ("k.cls", b"b")], pax_headers={"path": "global-name", "comment": "x"}
    )
    assert stream[156:157] == b"g"
    members = parse_members([stream])
    assert [m.name for m in members] == ["k.txt", "k.cls"]
    assert members[0].offset == 2 * BLOCK_SIZE  # the global header is not part of the member


def test_long_names_unicode_and_offsets_include_extension_headers():
    name = "données/" + "ü" * 150 + "/sample 1.jpg"
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        stream = tar_bytes([("first.txt", b"1"), (name, b"jpeg")], fmt=fmt)
        members = parse_members([stream])
        assert members[1].name == name
        assert members[1].offset == 2 * BLOCK_SIZE  # the L / x header, not the ustar header


def test_invalid_utf8_ustar_name_survives_as_surrogate_escape():
    stream = with_checksum(header(b"k\xff.txt", 1)) + padded(b"x") + END
    (member,) = parse_members([stream])
    assert member.name == "k\udcff.txt"
    assert member.name.encode("utf-8", "surrogateescape") == b"k\xff.txt"


def test_gnu_sparse_is_refused():
    stream = with_checksum(header(b"k.bin", 0, typeflag=b"S")) + END
    with pytest.raises(ShardFormatError, match="sparse") as info:
        parse_members([stream])
    assert info.value.offset == 0


def test_bad_pax_record():
    records = b"99 path=x\n"
    stream = with_checksum(header(b"pax", len(records), typeflag=b"x")) + padded(records) + END
    with pytest.raises(ShardFormatError, match="pax extended header at byte 0") as info:
        parse_members([stream])
    assert info.value.url == URL and info.value.offset == 0


# -- end of archive ---------------------------------------------------------------------------


def test_empty_stream_is_an_empty_shard():
    assert list(iter_samples([], URL)) == []
    assert list(iter_samples([b""], URL)) == []
    parser = TarStreamParser(URL)
    parser.close()
    assert not parser.finished


@pytest.mark.parametrize("size", [BLOCK_SIZE, 2 * BLOCK_SIZE, 10240, 10240 + 300])
def test_only_end_blocks(size):
    parser = TarStreamParser(URL)
    assert parser.feed(bytes(size)) == []
    parser.close()
    assert parser.finished
    assert list(iter_samples([bytes(size)], URL)) == []


def test_empty_tarfile_archive():
    stream = tar_bytes([])
    assert len(stream) == 10240
    assert list(iter_samples([stream], URL)) == []


def test_missing_end_blocks_are_accepted():
    stream = tar_bytes([("k.txt", b"a" * 600), ("k.cls", b"b")])
    bare = stream[: 5 * BLOCK_SIZE]  # two members, no end blocks
    assert [m.name for m in parse_members([bare])] == ["k.txt", "k.cls"]


def test_bytes_after_the_end_are_ignored():
    stream = tar_bytes([("k.txt", b"a")]) + b"trailing junk" + tar_bytes([("z.txt", b"b")])
    parser = TarStreamParser(URL)
    assert [m.name for m in parser.feed(stream)] == ["k.txt"]
    assert parser.finished
    parser.close()


# -- truncation and garbage -------------------------------------------------------------------


def _valid_cut_points(stream: bytes) -> set[int]:
    """Cuts that leave a complete archive: before a member's first header, or after the last."""
    with tarfile.open(fileobj=io.BytesIO(stream)) as tf:
        infos = tf.getmembers()
    if not infos:  # only end blocks: any prefix of zeros is an empty archive
        return set(range(len(stream) + 1))
    last = infos[-1]
    end = last.offset_data + (last.size + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    return {0, *(i.offset for i in infos)} | set(range(end, len(stream) + 1))


def _truncation_stream() -> bytes:
    return tar_bytes(
        [
            ("a/" + "long" * 40 + ".jpg", os.urandom(1300)),
            ("a/x.cls", b"7"),
            ("a/dir", b"", tarfile.DIRTYPE),
            ("é/y.txt", b""),
            ("y.bin", os.urandom(512)),
        ],
        fmt=tarfile.PAX_FORMAT,
    )


def test_every_truncation_point_is_detected():
    stream = _truncation_stream()
    valid = _valid_cut_points(stream)
    for cut in range(len(stream) + 1):
        parser = TarStreamParser(URL)
        for piece in (stream[:cut][:700], stream[:cut][700:]):
            parser.feed(piece)
        if cut in valid:
            parser.close()
            continue
        with pytest.raises(ShardFormatError) as info:
            parser.close()
        err = info.value
        assert (err.url, err.offset) == (URL, cut), cut
        assert URL in str(err) and f"byte {cut}" in str(err) and "truncated" in str(err)


@settings(max_examples=80, deadline=None, suppress_health_check=SLOW_OK)
@given(samples=_samples, fmt=st.sampled_from(FORMATS), data=st.data())
def test_random_truncation(samples, fmt, data):
    stream, _ = write_samples(samples, fmt)
    cut = data.draw(st.integers(0, len(stream)))
    chunks = split_at(stream[:cut], _split_points(data, cut))
    if cut in _valid_cut_points(stream):
        parse_members(chunks)
        return
    with pytest.raises(ShardFormatError, match="truncated") as info:
        parse_members(chunks)
    assert (info.value.url, info.value.offset) == (URL, cut)


def test_truncated_member_message():
    stream = tar_bytes([("x.jpg", b"j" * 1000)])
    with pytest.raises(ShardFormatError) as info:
        parse_members([stream[: BLOCK_SIZE + 100]])
    assert str(info.value) == (
        f"{URL}: truncated: stream ended at byte 612 inside member 'x.jpg' "
        "which needs 900 more bytes"
    )


def test_truncated_inside_padding_and_after_extension_header():
    stream = tar_bytes([("x.jpg", b"j" * 1000)])
    with pytest.raises(ShardFormatError, match="inside the padding after member 'x.jpg'"):
        parse_members([stream[: BLOCK_SIZE + 1000]])
    long = tar_bytes([("n" * 200 + ".jpg", b"j")], fmt=tarfile.GNU_FORMAT)
    with pytest.raises(ShardFormatError, match="after the extension header at byte 0") as info:
        parse_members([long[: 2 * BLOCK_SIZE]])
    assert info.value.offset == 2 * BLOCK_SIZE


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + random.Random(1).randbytes(5000),
        random.Random(2).randbytes(4096),
        b"<html><body>Access denied</body></html>" * 20,
    ],
    ids=["jpeg", "random", "html"],
)
def test_garbage_is_not_a_tar(garbage):
    with pytest.raises(ShardFormatError) as info:
        list(iter_samples([garbage[:1000], garbage[1000:]], URL))
    err = info.value
    assert "not a tar archive (bad header checksum at byte 0)" in str(err)
    assert (err.url, err.offset) == (URL, 0) and URL in str(err)


@pytest.mark.parametrize("payload", [b"a", os.urandom(5000)], ids=["short", "long"])
def test_gzip_compressed_shard_gets_a_hint(payload):
    with pytest.raises(ShardFormatError, match="not a tar archive.*gzip"):
        list(iter_samples([gzip.compress(tar_bytes([("k.txt", payload)]))], URL))


def test_short_garbage_object():
    with pytest.raises(ShardFormatError, match="not a tar archive") as info:
        list(iter_samples([b"hello"], URL))
    assert info.value.offset == 5


def test_corrupt_header_in_the_middle():
    stream = bytearray(tar_bytes([("a.txt", b"a" * 600), ("b.txt", b"b")]))
    stream[3 * BLOCK_SIZE + 3] ^= 0xFF  # the second member's name
    parser = TarStreamParser(URL)
    # The member before the damage is delivered first; the error comes with the next call.
    assert [m.name for m in parser.feed(bytes(stream))] == ["a.txt"]
    with pytest.raises(ShardFormatError, match="corrupt tar header at byte 1536") as info:
        parser.feed(b"more")
    assert info.value.offset == 3 * BLOCK_SIZE
    with pytest.raises(ShardFormatError):  # the parser stays failed
        parser.close()
    with pytest.raises(ShardFormatError, match="byte 1536"):  # chunk starting with the damage
        parse_members([bytes(stream[: 3 * BLOCK_SIZE]), bytes(stream[3 * BLOCK_SIZE :])])


def test_restart_after_a_corrupt_header_rereads_it():
    stream = tar_bytes([("a.txt", b"a" * 600), ("b.txt", b"b")])
    damaged = bytearray(stream)
    damaged[3 * BLOCK_SIZE + 3] ^= 0xFF
    parser = TarStreamParser(URL)
    assert [m.name for m in parser.feed(bytes(damaged))] == ["a.txt"]
    with pytest.raises(ShardFormatError):
        parser.close()
    assert parser.resume_offset == 3 * BLOCK_SIZE  # the bad header: a retry may get good bytes
    parser.restart_at(3 * BLOCK_SIZE)
    assert [m.name for m in parser.feed(stream[3 * BLOCK_SIZE :])] == ["b.txt"]
    parser.close()


@settings(max_examples=150, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    flips=st.lists(st.tuples(st.integers(0, 6 * BLOCK_SIZE), st.integers(1, 255)), max_size=6),
    chunk=st.integers(1, 2000),
)
def test_damaged_streams_raise_only_shard_format_errors(fmt, flips, chunk):
    entries = [
        ("d" * 60 + "/" + "ü" * 40 + ".txt", b"t" * 700),  # prefix in ustar, L in GNU, x in pax
        ("k.cls", b"1"),
        ("k", b"", tarfile.DIRTYPE),
    ]
    stream = bytearray(tar_bytes(entries, fmt=fmt))
    for pos, mask in flips:
        stream[pos] ^= mask
    chunks = [bytes(stream[i : i + chunk]) for i in range(0, len(stream), chunk)]
    try:
        list(iter_samples(chunks, URL))
    except ShardFormatError as err:  # anything else (struct, unicode, IndexError...) fails
        assert err.url == URL and isinstance(err.offset, int) and URL in str(err)


def test_bad_size_field():
    block = header(b"k.txt", 0)
    block[124:136] = b"12x4\x00" + bytes(7)
    with pytest.raises(ShardFormatError, match="size field") as info:
        parse_members([with_checksum(block) + END])
    assert info.value.offset == 0


# -- resume -------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=SLOW_OK)
@given(samples=_samples, fmt=st.sampled_from(FORMATS), data=st.data())
def test_restart_at_resume_offset_loses_and_repeats_nothing(samples, fmt, data):
    stream, _ = write_samples(samples, fmt)
    want = parse_members([stream])
    parser = TarStreamParser(URL)
    got: list[TarMember] = []
    start = 0
    for _ in range(data.draw(st.integers(0, 3))):  # up to three dropped connections
        cut = data.draw(st.integers(start, len(stream)))
        for chunk in split_at(stream[start:cut], _split_points(data, cut - start)):
            got.extend(parser.feed(chunk))
        start = parser.resume_offset
        assert start < cut + BLOCK_SIZE  # past a delivered member's padding at most
        parser.restart_at(start)
    got.extend(parser.feed(stream[start:]))
    parser.close()
    assert got == want


def test_resume_offsets_while_parsing():
    stream = tar_bytes([("n" * 150 + ".jpg", b"j" * 1000), ("k.cls", b"1")], fmt=tarfile.GNU_FORMAT)
    parser = TarStreamParser(URL)
    assert parser.resume_offset == 0
    parser.feed(stream[:3 * BLOCK_SIZE])  # L header + its data + the member's header
    assert parser.resume_offset == 0
    (member,) = parser.feed(stream[3 * BLOCK_SIZE : 3 * BLOCK_SIZE + 1000])
    assert member.offset == 0
    assert parser.resume_offset == 5 * BLOCK_SIZE  # past the padding: the member was delivered
    parser.feed(stream[5 * BLOCK_SIZE : 5 * BLOCK_SIZE + 10])
    assert parser.resume_offset == 5 * BLOCK_SIZE
    with pytest.raises(ValueError, match="resume_offset 2560"):
        parser.restart_at(5 * BLOCK_SIZE + 10)
    parser.restart_at(5 * BLOCK_SIZE)
    assert [m.name for m in parser.feed(stream[5 * BLOCK_SIZE :])] == ["k.cls"]
    assert parser.finished
    parser.close()


def test_start_offset_for_a_ranged_get():
    stream = tar_bytes([("a.txt", b"a"), ("b.txt", b"b")])
    parser = TarStreamParser(URL, start_offset=2 * BLOCK_SIZE)
    (member,) = parser.feed(stream[2 * BLOCK_SIZE :])
    assert member == TarMember("b.txt", b"b", 2 * BLOCK_SIZE)
    assert parser.bytes_parsed == len(stream) - 2 * BLOCK_SIZE
    assert parser.members_parsed == 1


# -- grouping -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a/b.c.jpg", ("a/b", "c.jpg")),
        ("b.jpg", ("b", "jpg")),
        ("a.d/b.JPG", ("a.d/b", "JPG")),
        ("a/b", ("a/b", "")),
        ("b.", ("b", "")),
        ("a/.hidden", ("a/", "hidden")),
        ("", ("", "")),
    ],
)
def test_split_key(name, expected):
    assert split_key(name) == expected


def test_duplicate_extension_names_the_key():
    stream = tar_bytes([("s/k.jpg", b"1"), ("s/k.jpg", b"2")])
    with pytest.raises(ShardFormatError, match="sample 's/k' already has a 'jpg' field") as info:
        list(iter_samples([stream], URL))
    assert info.value.offset == 2 * BLOCK_SIZE and info.value.url == URL


def test_reserved_extension_is_an_error():
    with pytest.raises(ShardFormatError, match="reserved"):
        list(iter_samples([tar_bytes([("k.__key__", b"1")])], URL))


def test_members_without_extension_fill_data_and_hidden_ones_are_skipped():
    """As in per-object mode (``objects.field_of``): no extension, or a trailing dot, is the
    field ``"data"``; hidden files are skipped and counted."""
    grouper = SampleGrouper(URL)
    out = [grouper.add(TarMember(name, name.encode(), 0))
           for name in ["README", "a/.DS_Store", "a/._k.jpg", "k.", "k.txt", "a/k.jpg"]]
    assert grouper.members_skipped == 2
    assert out == [None, None, None,
                   {"__key__": "README", "__url__": URL, "__index__": 0, "data": b"README"},
                   None,
                   {"__key__": "k", "__url__": URL, "__index__": 1, "data": b"k.", "txt": b"k.txt"}]
    assert grouper.flush() == {"__key__": "a/k", "__url__": URL, "__index__": 2, "jpg": b"a/k.jpg"}
    assert grouper.flush() is None
    assert field_of("README") == field_of("k.") == "data"


def test_key_runs_and_indices():
    grouper = SampleGrouper(URL, start_index=10)
    names = ["a.jpg", "a.cls", "b.jpg", "a.jpg"]
    out = [grouper.add(TarMember(n, n.encode(), i * 1024)) for i, n in enumerate(names)]
    first = {"__key__": "a", "__url__": URL, "__index__": 10, "jpg": b"a.jpg", "cls": b"a.cls"}
    assert out[:3] == [None, None, first]
    assert out[3]["__key__"] == "b" and out[3]["__index__"] == 11
    assert grouper.pending_offset == 3 * 1024
    assert grouper.flush()["__index__"] == 12  # a key that comes back starts another sample


# -- every field and message as written (each test below was asked for by mutation testing) -----


def test_numeric_fields_octal_and_base256():
    from loader.formats.tar import _parse_number

    assert _parse_number(b"00000001750\x00") == 0o1750
    assert _parse_number(b"000000001750") == 0o1750  # all twelve bytes digits, no NUL
    assert _parse_number(b"  1750 \x00\x00\x00\x00\x00") == 0o1750
    assert _parse_number(bytes(12)) == 0 and _parse_number(b"    \x00" + bytes(7)) == 0
    assert _parse_number(b"\x80\x01" + bytes(10)) == 1 << 80  # big-endian, after the marker byte
    assert _parse_number(b"\x80" + (700).to_bytes(11, "big")) == 700
    assert _parse_number(b"\xff" * 11 + b"\xfe") == -2  # two's complement over the whole field
    assert _parse_number(b"\xff\x00" + bytes(10)) == -(1 << 88)
    with pytest.raises(ValueError):
        _parse_number(b"1\xff" + bytes(10))


@given(st.binary(min_size=BLOCK_SIZE, max_size=BLOCK_SIZE))
def test_byte_sum_is_the_sum_of_the_bytes(block):
    from loader.formats.tar import _byte_sum

    assert _byte_sum(block) == sum(block)


@pytest.mark.parametrize("form", [b"%06o\x00 ", b"%07o\x00", b"%07o ", b"%6o\x00 "],
                         ids=["tarfile", "gnu", "space-ended", "space-padded"])
def test_checksum_field_as_each_writer_ends_it(form):
    block = header(b"k.txt", 2)
    block[148:156] = form % block_checksum(block)
    stream = bytes(block) + padded(b"hi") + END
    assert [(m.name, m.data) for m in parse_members([stream])] == [("k.txt", b"hi")]


def test_pax_records():
    from loader.formats.tar import _parse_pax

    assert _parse_pax(b"11 path=ab\n" + bytes(5)) == {"path": b"ab"}  # NUL padding ends the records
    assert _parse_pax(b"6 a=b\n12 size=700\n") == {"a": b"b", "size": b"700"}
    assert _parse_pax(b"7 \xffk=v\n") == {"\udcffk": b"v"}  # keys keep undecodable bytes
    for data, message in [
        (b"path=ab\n", "record without a length"),
        (b" 6 a=b\n", "record without a length"),
        (b"x6 a=b\n", "record length b'x6' is not a number"),
        (b"99 path=x\n", "record length 99 does not fit"),
        (b"1 \n", "record length 1 does not fit"),
        (b"6 =ab\n", "record without 'key='"),
    ]:
        with pytest.raises(ValueError) as info:
            _parse_pax(data)
        assert str(info.value) == message, data


def pax_record(key: str, value: str) -> bytes:
    """One pax record, ``"%d key=value\\n"``, whose length counts its own digits."""
    body = f" {key}={value}\n".encode()
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def pax_header(records: bytes, at_name: bytes = b"././@PaxHeader") -> bytes:
    return with_checksum(header(at_name, len(records), typeflag=b"x")) + padded(records)


def test_pax_errors_name_the_header_and_its_offset():
    first = with_checksum(header(b"a.txt", 1)) + padded(b"1")
    cases = [
        (pax_record("GNU.sparse.major", "1"), "unsupported tar member: the pax extended header at byte 1024 "
                                     "is for a GNU sparse file"),
        (pax_record("size", "abc"), "corrupt tar: the pax extended header at byte 1024 has a bad size b'abc'"),
        (pax_record("size", "-5"), "corrupt tar: the pax extended header at byte 1024 has a bad size b'-5'"),
        (b"9 a=bcd\n", "corrupt tar: bad record in the pax extended header at byte 1024 "
                         "(record length 9 does not fit)"),
    ]
    for records, message in cases:
        stream = first + pax_header(records) + with_checksum(header(b"k.bin", 0)) + END
        parser = TarStreamParser(URL)
        assert [m.name for m in parser.feed(stream)] == ["a.txt"]  # delivered before the error
        with pytest.raises(ShardFormatError) as info:
            parser.close()
        assert str(info.value) == f"{URL}: {message}", records
        assert (info.value.url, info.value.offset) == (URL, 1024)


def test_pax_size_zero_overrides_a_header_size():
    stream = pax_header(pax_record("size", "0")) + with_checksum(header(b"k.bin", 5)) + END
    assert [(m.name, m.data) for m in parse_members([stream])] == [("k.bin", b"")]


def test_negative_base256_size_is_refused_with_its_offset():
    first = with_checksum(header(b"a.txt", 1)) + padded(b"1")
    block = header(b"k.bin", 0)
    block[124:136] = b"\xff" * 11 + b"\xfe"
    parser = TarStreamParser(URL)
    with pytest.raises(ShardFormatError) as info:
        parser.feed(first)
        parser.feed(with_checksum(block) + END)
    assert str(info.value) == f"{URL}: corrupt tar header at byte 1024: negative size -2"
    assert info.value.offset == 1024


def test_bad_size_field_message_shows_the_field():
    block = header(b"k.txt", 0)
    block[124:136] = b"12x4\x00" + bytes(7)
    with pytest.raises(ShardFormatError) as info:
        parse_members([with_checksum(block) + END])
    assert str(info.value) == (
        f"{URL}: corrupt tar header at byte 0: size field {bytes(block[124:136])!r} is not a number")


def test_compression_hints_read_whole():
    plain = random.Random(3).randbytes(BLOCK_SIZE)
    zstd_like = b"\x28\xb5\x2f\xfd" + plain[4:]
    gzip_like = gzip.compress(b"x" * 4000)
    expected = {
        plain: "",
        zstd_like: "; it looks zstd-compressed: name it .tar.zst (read as zstd), or store it as plain tar",
        gzip_like: "; it looks gzip-compressed: name it .tar.gz or .tgz (read as gzip), or store it as "
                   "plain tar",
    }
    for data, hint in expected.items():
        with pytest.raises(ShardFormatError) as info:
            parse_members([data + bytes(BLOCK_SIZE)])  # a whole first block: its checksum fails
        assert str(info.value) == f"{URL}: not a tar archive (bad header checksum at byte 0){hint}"


def test_errors_without_a_url_say_stream():
    with pytest.raises(ShardFormatError) as info:
        parse_members([b"hello"], url="")
    assert str(info.value).startswith("<stream>: truncated or not a tar archive: stream ended at byte 5")


def test_feed_after_close_is_refused():
    parser = TarStreamParser(URL)
    parser.feed(tar_bytes([("k.txt", b"1")]))
    parser.close()
    with pytest.raises(ValueError, match="feed\\(\\) after close\\(\\)"):
        parser.feed(b"")


def test_a_stream_ending_inside_the_end_block_is_complete():
    member = with_checksum(header(b"k.txt", 1)) + padded(b"1")
    parser = TarStreamParser(URL)
    assert [m.name for m in parser.feed(member + bytes(100))] == ["k.txt"]
    assert not parser.finished
    parser.close()
    assert parser.finished and parser.resume_offset == len(member)


def test_end_block_right_after_an_extension_header():
    stream = pax_header(pax_record("path", "ab")) + END
    with pytest.raises(ShardFormatError) as info:
        parse_members([stream])
    assert str(info.value) == (
        f"{URL}: corrupt tar: end-of-archive block at byte 1024 right after the extension header "
        "at byte 0, which must be followed by a member")
    assert info.value.offset == 1024


def test_truncated_inside_a_long_name_or_a_skipped_member_says_which():
    long_name = with_checksum(header(b"././@LongLink", 300, typeflag=b"L"))
    with pytest.raises(ShardFormatError) as info:
        parse_members([long_name + b"n" * 100])
    assert str(info.value) == (f"{URL}: truncated: stream ended at byte 612 inside the GNU long-name "
                               "header at byte 0 which needs 200 more bytes")
    volume = with_checksum(header(b"label", 5, typeflag=b"V"))
    with pytest.raises(ShardFormatError) as info:
        parse_members([volume + b"12"])
    assert str(info.value) == (f"{URL}: truncated: stream ended at byte 514 inside member 'label' "
                               "which needs 3 more bytes")


def test_a_name_filling_all_100_bytes():
    name = b"n" * 96 + b".txt"
    block = header(name, 1)
    assert len(name) == 100 and block[100:101] == b"0"  # the mode field follows without a NUL
    stream = with_checksum(block) + padded(b"1") + END
    assert [m.name for m in parse_members([stream])] == [name.decode()]


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_links_are_counted_with_the_first_ones_target(fmt):
    # a target longer than the 100-byte linkname field needs GNU 'K' or pax 'linkpath'
    target = "t.jpg" if fmt == tarfile.USTAR_FORMAT else "d/" * 60 + "t.jpg"
    stream = tar_bytes([
        ("k.jpg", b"jpeg"),
        ("k.soft", b"", tarfile.SYMTYPE, target),
        ("k.hard", b"", tarfile.LNKTYPE, "k.jpg"),
        ("k.soft2", b"", tarfile.SYMTYPE, "other.jpg"),
        ("k.hard2", b"", tarfile.LNKTYPE, "k.jpg"),
        ("a/", b"", tarfile.DIRTYPE),
        ("k.cls", b"3"),
    ], fmt=fmt)
    parser = TarStreamParser(URL)
    members = parser.feed(stream)
    parser.close()
    assert [m.name for m in members] == ["k.jpg", "k.cls"] and parser.members_parsed == 2
    assert (parser.hard_links, parser.symlinks) == (2, 2)
    assert parser.first_link == ("k.soft", target)


def test_hard_link_first_and_no_links():
    stream = tar_bytes([("k.jpg", b"1"), ("k.hard", b"", tarfile.LNKTYPE, "k.jpg"),
                        ("k.soft", b"", tarfile.SYMTYPE, "k.jpg")], fmt=tarfile.USTAR_FORMAT)
    parser = TarStreamParser(URL)
    parser.feed(stream)
    assert (parser.hard_links, parser.symlinks, parser.first_link) == (1, 1, ("k.hard", "k.jpg"))
    plain = TarStreamParser(URL)
    plain.feed(tar_bytes([("a.txt", b"1"), ("b.txt", b"2"), ("c.txt", b"3")]))
    assert (plain.hard_links, plain.symlinks, plain.first_link, plain.members_parsed) == (0, 0, None, 3)


@pytest.mark.parametrize(("name", "expected"), [
    ("a/b.c/d.jpg", ("a/b.c/d", "jpg")),  # only the basename's dot counts
    (".jpg", ("", "jpg")),
])
def test_split_key_more(name, expected):
    assert split_key(name) == expected


def test_grouper_skips_hidden_files_in_nested_folders_and_errors_carry_url_and_offset():
    grouper = SampleGrouper(URL)
    assert grouper.pending_offset is None
    assert grouper.add(TarMember("a/b/._k.jpg", b"x", 0)) is None and grouper.members_skipped == 1
    with pytest.raises(ShardFormatError) as info:
        grouper.add(TarMember("k.__url__", b"x", 4096))
    assert (info.value.url, info.value.offset) == (URL, 4096)
    assert str(info.value) == (f"{URL}: member 'k.__url__' at byte 4096 has the extension '__url__', "
                               "which is a reserved sample field; rename it")


def test_offsets_and_byte_counts_run_on_after_the_end():
    stream = tar_bytes([("k.txt", b"1")])
    parser = TarStreamParser(URL)
    parser.feed(stream[:700])
    parser.feed(stream[700:])
    parser.feed(b"trailing bytes")
    assert parser.finished and parser.bytes_parsed == parser.offset == len(stream) + 14


def test_unknown_type_takes_its_size_from_pax():
    volume = with_checksum(header(b"label", 0, typeflag=b"V"))
    stream = (pax_header(pax_record("size", "5")) + volume + padded(b"12345")
              + with_checksum(header(b"k.txt", 2)) + padded(b"hi") + END)
    assert [(m.name, m.data) for m in parse_members([stream])] == [("k.txt", b"hi")]


def test_sparse_and_truncated_extension_headers_say_which():
    with pytest.raises(ShardFormatError) as info:
        parse_members([with_checksum(header(b"k.bin", 0, typeflag=b"S")) + END])
    assert str(info.value) == f"{URL}: unsupported tar member at byte 0: GNU sparse file 'k.bin'"
    for typeflag, what in [(b"K", "GNU long-link"), (b"g", "pax global")]:
        with pytest.raises(ShardFormatError) as info:
            parse_members([with_checksum(header(b"x", 300, typeflag=typeflag)) + b"n" * 100])
        assert str(info.value) == (f"{URL}: truncated: stream ended at byte 612 inside the {what} "
                                   "header at byte 0 which needs 200 more bytes")


def test_six_digit_checksums_and_full_width_fields():
    # bytes of 0xff in the name and link name push the checksum to six significant octal digits
    block = header(b"\xff" * 95 + b".txt", 1, typeflag=b"2")
    block[157:257] = b"t" * 96 + b".txt"  # a link name filling its 100 bytes, magic right after
    stream = with_checksum(block) + with_checksum(header(b"k.txt", 1)) + padded(b"1") + END
    assert block_checksum(block) >= 0o100000
    parser = TarStreamParser(URL)
    assert [m.name for m in parser.feed(stream)] == ["k.txt"]
    assert parser.first_link == ("\udcff" * 95 + ".txt", "t" * 96 + ".txt")
    prefixed = header(b"k.txt", 1)
    prefixed[345:500] = b"p" * 155  # a prefix filling its 155 bytes; the unused bytes after it
    prefixed[500:512] = b"junk" + bytes(8)  # are not part of it
    (member,) = parse_members([with_checksum(prefixed) + padded(b"1") + END])
    assert member.name == "p" * 155 + "/k.txt"
