"""Parquet source against the in-memory store: footers, column selection, exact splits by row
group on any topology, resume, shuffle, cycling, mixing, and the bad inputs (missing column,
corrupt footer, a file overwritten after its footer was read, a budget too small)."""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from loader import (
    AsyncS3Dataset,
    ConfigError,
    EmptyDatasetError,
    Limits,
    ObjectChangedError,
    ParquetFormatError,
    Reading,
    Split,
    mix,
)
from loader.formats.parquet import SparseFile, class_label_names, merge_ranges, split_ranges

from fakes import FakeStore, payloads, reusable

ROWS = (37, 0, 50, 13)  # rows per file; the second file has none


def parquet_bytes(rows: int, file: int, row_group_size: int = 10) -> bytes:
    table = pa.table({
        "image": [{"bytes": bytes([file, i % 256]) * 20000, "path": f"{file}-{i}.jpg"} for i in range(rows)],
        "label": pa.array([i % 5 for i in range(rows)], pa.int64()),
        "tag": pa.array([f"t{i % 3}" for i in range(rows)]).dictionary_encode(),
        "tokens": [list(range(i % 4)) for i in range(rows)],
        "unused": [b"u" * 300] * rows,
    })
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=row_group_size, compression="none", use_dictionary=["tag"])
    return out.getvalue()


def build_store() -> FakeStore:
    fake = FakeStore.with_objects("bucket", payloads(20, size=16, prefix="web/"))
    for number, rows in enumerate(ROWS):
        fake.objects["bucket", f"pq/part-{number}.parquet"] = parquet_bytes(rows, number)
    return fake


FAKE = build_store()
TOTAL = sum(ROWS)


def dataset(**options):
    options.setdefault("store", reusable(FAKE))
    reading = options.get("reading", Reading())  # units of two or three row groups of 400 KB:
    options["reading"] = dataclasses.replace(reading, part_size=reading.part_size or 1 << 20)
    return AsyncS3Dataset.from_parquet("s3://bucket/pq/", columns=options.pop("columns", ["image", "label", "tag",
                                                                                         "tokens"]), **options)


def keys(ds, epoch=0):
    ds.set_epoch(epoch)
    return [sample["__key__"] for sample in ds]


def test_rows_carry_their_key_url_and_selected_columns():
    samples = list(dataset(limits=Limits(concurrency=4)))  # one row group at a time: file order
    assert len(samples) == TOTAL
    first = samples[0]
    assert first["__key__"] == "pq/part-0/0" and first["__url__"] == "s3://bucket/pq/part-0.parquet"
    assert set(first) == {"__key__", "__url__", "image", "label", "tag", "tokens"}
    assert first["image"] == {"bytes": bytes([0, 0]) * 20000, "path": "0-0.jpg"}
    assert first["tag"] == "t0" and first["tokens"] == []
    assert [s["__key__"] for s in samples] == [f"pq/part-{f}/{i}" for f, n in enumerate(ROWS) for i in range(n)]


def test_only_the_selected_column_chunks_are_fetched():
    fake = build_store()
    ds = dataset(store=reusable(fake), columns=["label"])
    ds.resolve()
    fetched = []
    plain_get_range = fake.get_range

    async def get_range(bucket, key, start, end, **kwargs):
        data = await plain_get_range(bucket, key, start, end, **kwargs)
        fetched.append(len(data))
        return data

    fake.get_range = get_range
    assert sorted(s["label"] for s in ds) == sorted(i % 5 for n in ROWS for i in range(n))
    whole = sum(len(v) for (_, k), v in fake.objects.items() if k.startswith("pq/"))
    plans = ds.source.plans()
    assert len(plans) == 3  # the small label chunks: one unit per file, one GET per chunk (not the gaps)
    assert len(fetched) == sum(len(plan.ranges) for plan in plans) == sum(-(-n // 10) for n in ROWS)
    assert sum(fetched) < whole / 1000


@pytest.mark.parametrize("world,workers", [(1, 0), (2, 2), (3, 2)])
def test_ranks_and_workers_read_every_row_once_in_equal_shares(world, workers):
    seen = []
    lengths = set()
    for rank in range(world):
        ds = dataset(split=Split(rank=rank, world_size=world, pad="drop"), shuffle=True, seed=3)
        ds.set_epoch(1)
        rank_keys = [s["__key__"] for s in loader_of(ds, workers)]
        lengths.add(len(rank_keys))
        seen += rank_keys
    assert lengths == {TOTAL // world}
    assert len(seen) == len(set(seen)) == TOTAL // world * world


def loader_of(ds, num_workers: int) -> DataLoader:
    if num_workers == 0:
        return DataLoader(ds, batch_size=None)
    return DataLoader(ds, batch_size=None, num_workers=num_workers, multiprocessing_context="fork")


def test_shuffle_changes_with_the_epoch_and_repeats_with_the_seed():
    a, b = keys(dataset(shuffle=True, seed=1), 0), keys(dataset(shuffle=True, seed=1), 1)
    assert sorted(a) == sorted(b) and a != b
    assert keys(dataset(shuffle=True, seed=1), 0) == a


def test_resume_mid_epoch_on_another_topology_reads_the_rest_once():
    whole = keys(dataset(batch_size=4, shuffle=True, seed=2), 3)
    first = dataset(batch_size=4, shuffle=True, seed=2, split=Split(rank=0, world_size=1))
    first.set_epoch(3)
    taken = []
    for sample in first:
        taken.append(sample["__key__"])
        if len(taken) == 24:
            break
    rest = []
    for rank in range(2):
        ds = dataset(batch_size=4, shuffle=True, seed=2, split=Split(rank=rank, world_size=2))
        ds.resume(epoch=3, samples_seen=24, lanes=1)  # dealt to one lane
        rest += [s["__key__"] for s in ds]
    assert taken == whole[:24]
    assert sorted(taken + rest) == sorted(whole)


def test_state_dict_resumes_exactly_once():
    ds = dataset(shuffle=True, seed=5, reading=Reading(shuffle_buffer=8))
    ds.set_epoch(0)
    it = iter(ds)
    taken = [next(it)["__key__"] for _ in range(30)]
    state = ds.state_dict()
    it.close()
    again = dataset(shuffle=True, seed=5, reading=Reading(shuffle_buffer=8))
    again.load_state_dict(state)
    rest = [s["__key__"] for s in again]
    assert len(taken) + len(rest) == TOTAL and set(taken).isdisjoint(rest)


def test_consecutive_row_groups_of_a_file_form_units_up_to_part_size():
    plans = dataset().source.plans()
    assert [(p.file, p.groups, p.rows) for p in plans] == [
        (0, (0, 1), 20), (0, (2, 3), 17), (2, (0, 1), 20), (2, (2, 3), 20), (2, (4,), 10), (3, (0, 1), 13)]
    assert all(p.fetched <= 1 << 20 for p in plans)


def test_a_budget_makes_units_smaller_before_it_refuses_one():
    ds = dataset(limits=Limits(memory=8 << 20))  # 1.5 MiB for each of 4 units: one row group of 400 KB each
    plans = ds.source.plans()
    assert all(plan.need <= ds.source.read_bytes() // 4 for plan in plans)
    assert [plan.groups for plan in plans][:4] == [(0,), (1,), (2,), (3,)]
    assert len(list(ds)) == TOTAL


def test_samples_per_epoch_cycles_the_row_groups():
    ds = dataset(split=Split(samples_per_epoch=250), shuffle=True)
    got = keys(ds)
    assert len(got) == 250
    assert set(got) == {f"pq/part-{f}/{i}" for f, n in enumerate(ROWS) for i in range(n)}


def test_mixed_with_objects():
    store = reusable(FAKE)
    web = AsyncS3Dataset.from_prefix("s3://bucket/web/", store=store)
    rows = dataset(store=store)
    ds = mix({"web": web, "rows": rows}, {"web": 1, "rows": 1}, samples_per_epoch=60, store=store)
    counts = collections.Counter(s["__source__"] for s in ds)
    assert counts == {"web": 30, "rows": 30}


def test_a_column_the_file_lacks_names_file_and_column():
    with pytest.raises(ConfigError, match=r"s3://bucket/pq/part-0.parquet has no column 'nope'"):
        dataset(columns=["label", "nope"]).resolve()


def test_a_corrupt_or_truncated_footer_names_the_file():
    fake = build_store()
    good = fake.objects["bucket", "pq/part-2.parquet"]
    fake.objects["bucket", "pq/part-2.parquet"] = good[:-20] + b"\xff" * 16 + good[-4:]
    with pytest.raises(ParquetFormatError, match=r"s3://bucket/pq/part-2.parquet"):
        dataset(store=reusable(fake)).resolve()
    fake.objects["bucket", "pq/part-2.parquet"] = good[: len(good) // 2]
    with pytest.raises(ParquetFormatError, match=r"s3://bucket/pq/part-2.parquet.*magic"):
        dataset(store=reusable(fake)).resolve()


def test_a_file_overwritten_after_its_footer_was_read():
    fake = build_store()
    ds = dataset(store=reusable(fake))
    ds.resolve()
    fake.objects["bucket", "pq/part-0.parquet"] = parquet_bytes(37, 9)
    with pytest.raises(ObjectChangedError, match=r"part-0.parquet was overwritten after its footer was read"):
        list(ds)


def test_files_without_rows_are_an_error():
    fake = FakeStore.with_objects("bucket", {"empty/a.parquet": parquet_bytes(0, 0)})
    with pytest.raises(EmptyDatasetError, match="hold no rows"):
        AsyncS3Dataset.from_parquet("s3://bucket/empty/", store=reusable(fake)).resolve()


def test_a_budget_too_small_for_a_row_group_says_what_it_needs():
    fake = FakeStore.with_objects("bucket", {"big/a.parquet": parquet_bytes(20, 1)})
    big = pa.table({"blob": [b"x" * (64 << 10)] * 256})
    out = io.BytesIO()
    pq.write_table(big, out, row_group_size=256, compression="none", use_dictionary=False)
    fake.objects["bucket", "big/b.parquet"] = out.getvalue()
    ds = AsyncS3Dataset.from_parquet("s3://bucket/big/", store=reusable(fake), limits=Limits(memory=16 << 20))
    with pytest.raises(ConfigError, match=r"row group 0 of s3://bucket/big/b.parquet needs \d+ bytes"):
        ds.resolve()


def test_named_files_and_missing_ones():
    ds = AsyncS3Dataset.from_parquet("s3://bucket/pq/part-{2..3}.parquet", store=reusable(FAKE))
    assert len(list(ds)) == ROWS[2] + ROWS[3]
    from loader import NoSuchKeyError

    with pytest.raises(NoSuchKeyError, match="part-7.parquet does not exist"):
        AsyncS3Dataset.from_parquet("s3://bucket/pq/part-7.parquet", store=reusable(FAKE)).resolve()


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(1, 100)), max_size=12), st.integers(1, 64))
@settings(max_examples=100, deadline=None)
def test_ranges_merge_and_split_without_losing_a_byte(spans, part):
    spans = [(start, start + length) for start, length in spans]
    merged = merge_ranges(spans)
    covered = {b for start, end in spans for b in range(start, end)}
    assert {b for start, end in merged for b in range(start, end)} == covered
    assert all(a[1] < b[0] for a, b in zip(merged, merged[1:]))
    parts = split_ranges(merged, part)
    assert all(0 < end - start <= part for start, end in parts)
    assert {b for start, end in parts for b in range(start, end)} == covered


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["b", "bucket-2"]), st.text(min_size=1, max_size=12),
                          st.integers(12, 1 << 40), st.one_of(st.none(), st.text(max_size=40)),
                          st.integers(4, 1 << 40), st.binary(max_size=64)), max_size=6))
def test_files_and_footers_travel_packed_as_one_shared_list(entries):
    """What a job shares (one record per file in a ``KeyList``) gives back every file and footer,
    through the key-list file format every process of a machine maps."""
    from loader.datasets.parquet_source import pack_footers, unpack_footers
    from loader.formats.parquet import Footer, ParquetRef
    from loader.listing.keyfile import parse_keys, to_bytes

    files = [ParquetRef(bucket, key, size, etag) for bucket, key, size, etag, _, _ in entries]
    footers = [Footer(start, data) for *_, start, data in entries]
    packed = pack_footers(files, footers)
    assert unpack_footers(packed) == (files, footers)
    assert unpack_footers(parse_keys(to_bytes(packed))) == (files, footers)


@pytest.mark.parametrize("given,workers,expected", [(None, 0, 4), (None, 2, 2), (None, 8, 1), (3, 2, 3)])
def test_row_groups_in_flight_are_per_rank_unless_given(monkeypatch, given, workers, expected):
    """By default a rank's units in flight are shared among its DataLoader workers; a value
    given is what every process uses."""
    import types

    import torch.utils.data

    info = types.SimpleNamespace(num_workers=workers) if workers else None
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: info)
    options = {} if given is None else {"limits": Limits(concurrency=4 * given)}  # row groups: concurrency // 4
    assert dataset(**options).source.limits("ordered").max_inflight == expected


@given(data=st.binary(min_size=1, max_size=200), cuts=st.lists(st.integers(1, 199), max_size=6),
       start=st.integers(0, 199), size=st.integers(0, 220))
def test_a_sparse_file_reads_across_the_parts_of_a_range_as_one(data, cuts, start, size):
    # A range fetched as several ranged GETs is handed over as its parts, one piece each: a read
    # that spans parts returns their bytes joined; a read outside what was fetched fails.
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    pieces = [(100 + a, data[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    file = SparseFile("s3://b/f.parquet", 100 + len(data) + 50, pieces)
    file.seek(100 + min(start, len(data) - 1))
    at = file.tell() - 100
    size = min(size, len(data) - at)
    assert bytes(file.read(size)) == data[at:at + size]
    file.seek(100 + at)
    with pytest.raises(OSError, match="were not fetched"):
        file.read(len(data) - at + 1)  # one byte past what was fetched


def big_row_group(rows: int = 200, size: int = 60_000) -> tuple[bytes, list[bytes]]:
    """One file of one row group of ``rows`` blobs of ``size`` bytes (12 MB), written in pages
    of about 8 rows (~0.5 MB): what a row group larger than its share of a budget looks like."""
    blobs = [bytes([i % 256]) * size for i in range(rows)]
    out = io.BytesIO()
    pq.write_table(pa.table({"blob": blobs, "n": list(range(rows))}), out, row_group_size=rows,
                   compression="none", use_dictionary=False, write_batch_size=8, data_page_size=256 << 10)
    return out.getvalue(), blobs


def test_a_row_group_larger_than_the_budget_allows_is_read_streamed_within_it(monkeypatch):
    """12 MB of column chunk, a budget that leaves 18 MiB for reads: read whole it would need
    ~20 MB (the chunk and a decoded batch twice), so it is read in pieces of part_size as
    pyarrow decodes it, a few at a time, and every row comes out as written."""
    from loader.formats import parquet

    data, blobs = big_row_group()
    fake = FakeStore.with_objects("bucket", {"big/a.parquet": data}, latency=0.002)
    files = []

    class Recorded(parquet.StreamedFile):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            files.append(self)

    monkeypatch.setattr(parquet, "StreamedFile", Recorded)
    ds = AsyncS3Dataset.from_parquet("s3://bucket/big/", store=reusable(fake), limits=Limits(memory=24 << 20),
                                     reading=Reading(part_size=1 << 20))
    (plan,) = ds.source.plans()
    assert plan.need > ds.source.read_bytes() >= plan.streamed_need(1 << 20)
    got = list(ds)
    assert [row["blob"] for row in got] == blobs and [row["n"] for row in got] == list(range(200))
    (file,) = files
    assert 0 < file.peak <= (parquet.STREAM_AHEAD + 2) * (1 << 20), file.peak
    assert fake.requests_by_key["big/a.parquet"] >= 12, "a piece of 1 MiB at a time, not the chunk at once"


def test_a_streamed_row_group_of_a_file_overwritten_is_object_changed_not_corrupt():
    data, _ = big_row_group()
    fake = FakeStore.with_objects("bucket", {"big/a.parquet": data})
    ds = AsyncS3Dataset.from_parquet("s3://bucket/big/", store=reusable(fake), limits=Limits(memory=24 << 20),
                                     reading=Reading(part_size=1 << 20))
    ds.resolve()
    fake.objects["bucket", "big/a.parquet"] = data[:-1] + b"!"  # a new version (its footer intact)
    with pytest.raises(ObjectChangedError, match="overwritten after its footer was read"):
        list(ds)


def test_a_row_group_too_large_even_streamed_says_both_needs():
    data, _ = big_row_group()
    fake = FakeStore.with_objects("bucket", {"big/a.parquet": data})
    ds = AsyncS3Dataset.from_parquet("s3://bucket/big/", store=reusable(fake), limits=Limits(memory=12 << 20),
                                     reading=Reading(part_size=4 << 20))
    with pytest.raises(ConfigError, match=r"needs \d+ bytes to read whole .* and \d+ read streamed"):
        ds.resolve()


def test_breaking_off_a_streamed_read_calls_off_its_pieces():
    """The consumer stops after a few rows while pieces are in flight: the read ends (the
    decoding thread waiting for a piece is woken), nothing hangs."""
    data, blobs = big_row_group()
    fake = FakeStore.with_objects("bucket", {"big/a.parquet": data}, latency=0.05)
    ds = AsyncS3Dataset.from_parquet("s3://bucket/big/", store=reusable(fake), limits=Limits(memory=24 << 20),
                                     reading=Reading(part_size=1 << 20))
    rows = iter(ds)
    assert [next(rows)["blob"] for _ in range(5)] == blobs[:5]
    rows.close()
    assert [row["n"] for row in ds][:3] == [0, 1, 2], "the next epoch reads again"


@st.composite
def chunk_layouts(draw):
    """A file's column chunks as the planner makes them: back to back, each reaching up to 100
    bytes past its end (``CHUNK_SLACK``, so into the next), read forward in reads of any size,
    the chunks' reads interleaved as pyarrow interleaves columns."""
    piece = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.one_of(st.integers(1, 300), st.sampled_from([piece, 2 * piece, 3 * piece])),
                            min_size=1, max_size=4))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    size = sum(lengths) + 8
    chunks = [(start, min(start + length + 100, size)) for start, length in zip(starts, lengths)]
    reads = [draw(st.lists(st.integers(1, 2 * piece + 5), min_size=1, max_size=40)) for _ in chunks]
    order = draw(st.permutations([c for c, steps in enumerate(reads) for _ in steps]))
    return piece, size, chunks, reads, order


@given(chunk_layouts())
@settings(max_examples=150, deadline=None)
def test_a_streamed_file_reads_every_chunk_forward_exactly_and_holds_a_few_pieces(layout):
    import anyio
    import anyio.lowlevel
    import anyio.to_thread

    from loader.formats.parquet import STREAM_AHEAD, StreamedFile

    piece, size, chunks, reads, order = layout
    data = bytes(i * 7 % 251 for i in range(size))

    async def fetch(start, end):
        await anyio.sleep(0)
        return data[start:end]

    async def main():
        async with anyio.create_task_group() as group:
            file = StreamedFile("s3://b/x.parquet", size, chunks, piece, fetch, group.start_soon,
                                anyio.lowlevel.current_token())
            at = [start for start, _ in chunks]
            steps = [iter(r) for r in reads]

            def read_all():
                for chunk in order:
                    start, end = chunks[chunk]
                    if at[chunk] >= end:
                        continue
                    file.seek(at[chunk])
                    got = bytes(file.read(min(next(steps[chunk]), end - at[chunk])))
                    assert got == data[at[chunk]:at[chunk] + len(got)] and got
                    at[chunk] += len(got)
                return file.peak

            peak = await anyio.to_thread.run_sync(read_all)
            group.cancel_scope.cancel()
        assert peak <= len(chunks) * (STREAM_AHEAD + 1) * piece

    anyio.run(main)


def test_a_streamed_row_group_whose_pages_are_larger_than_a_piece_says_so():
    """pyarrow's defaults write up to 1,024 rows per page: a 12 MB row group of 200 rows is one
    page, which a streamed read must hold whole, past its reservation. The rows still come, and
    a warning names the file and says how to write pages that stream."""
    blobs = [bytes([i % 256]) * 60_000 for i in range(200)]
    out = io.BytesIO()
    pq.write_table(pa.table({"blob": blobs}), out, row_group_size=200, compression="none", use_dictionary=False)
    fake = FakeStore.with_objects("bucket", {"big/a.parquet": out.getvalue()})
    ds = AsyncS3Dataset.from_parquet("s3://bucket/big/", store=reusable(fake), limits=Limits(memory=24 << 20),
                                     reading=Reading(part_size=1 << 20))
    with pytest.warns(RuntimeWarning, match=r"big/a.parquet: a page of \d+ bytes, larger than the pieces"):
        assert [row["blob"] for row in ds] == blobs


@pytest.mark.parametrize("damage", ["truncated", "corrupt footer"])
def test_on_error_skip_leaves_out_a_file_whose_footer_does_not_read(damage, caplog):
    """A truncated file (its footer gone) or one whose footer does not decode: ``on_error="skip"``
    reads the other files and says once which it left out; ``"warn"`` says it as a warning."""
    fake = build_store()
    good = fake.objects["bucket", "pq/part-2.parquet"]
    fake.objects["bucket", "pq/part-2.parquet"] = (good[: len(good) // 2] if damage == "truncated"
                                                   else good[:-20] + b"\xff" * 16 + good[-4:])
    with caplog.at_level(logging.WARNING, logger="loader"):
        rows = list(dataset(store=reusable(fake), on_error="skip", columns=["label"]))
    assert len(rows) == TOTAL - ROWS[2]
    assert {row["__key__"].split("/")[1] for row in rows} == {"part-0", "part-3"}
    said = [r.getMessage() for r in caplog.records if "part-2.parquet" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("skipping s3://bucket/pq/part-2.parquet (on_error='skip')"), said
    caplog.clear()
    with pytest.warns(RuntimeWarning, match=r"skipping s3://bucket/pq/part-2.parquet \(on_error='warn'\)") as seen:
        assert len(list(dataset(store=reusable(fake), on_error="warn", columns=["label"]))) == TOTAL - ROWS[2]
    assert len([w for w in seen if "part-2.parquet" in str(w.message)]) == 1
    assert not [r for r in caplog.records if "part-2.parquet" in r.getMessage()], "said twice"


def test_the_large_page_warning_is_said_once_not_logged_too(caplog):
    blobs = [bytes([i % 256]) * 60_000 for i in range(200)]
    out = io.BytesIO()
    pq.write_table(pa.table({"blob": blobs}), out, row_group_size=200, compression="none", use_dictionary=False)
    fake = FakeStore.with_objects("bucket", {"big/a.parquet": out.getvalue()})
    ds = AsyncS3Dataset.from_parquet("s3://bucket/big/", store=reusable(fake), limits=Limits(memory=24 << 20),
                                     reading=Reading(part_size=1 << 20))
    with caplog.at_level(logging.WARNING), pytest.warns(RuntimeWarning, match="larger than the pieces") as seen:
        assert len(list(ds)) == 200
    assert len([w for w in seen if "larger than the pieces" in str(w.message)]) == 1
    assert not [r for r in caplog.records if "larger than the pieces" in r.getMessage()]


HF_META = {"info": {"features": {"image": {"_type": "Image"},
                                 "label": {"names": ["cat", "dog", "eel"], "_type": "ClassLabel"},
                                 "x": {"dtype": "int64", "_type": "Value"}}}}


def hub_file(metadata) -> bytes:
    """A file as Hugging Face ``datasets`` writes one: its features as JSON in the schema's
    ``huggingface`` metadata (the shape ``datasets`` 5.2 writes, copied from one of its files)."""
    table = pa.table({"label": pa.array([0, 1, 2, 1], pa.int64()), "x": [1, 2, 3, 4]})
    out = io.BytesIO()
    pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps(metadata)}), out)
    return out.getvalue()


def test_a_hub_class_label_names_the_classes():
    fake = FakeStore.with_objects("bucket", {"hub/train-0.parquet": hub_file(HF_META)})
    ds = AsyncS3Dataset.from_parquet("s3://bucket/hub/", store=reusable(fake))
    assert ds.classes == ["cat", "dog", "eel"] and ds.class_to_idx == {"cat": 0, "dog": 1, "eel": 2}
    assert [ds.classes[row["label"]] for row in ds] == ["cat", "dog", "eel", "dog"]
    only_x = AsyncS3Dataset.from_parquet("s3://bucket/hub/", columns=["x"], store=reusable(fake))
    assert only_x.classes is None and only_x.class_to_idx is None  # the label column is not read
    plain = FakeStore.with_objects("bucket", {"p/a.parquet": parquet_bytes(3, 0)})
    assert AsyncS3Dataset.from_parquet("s3://bucket/p/", store=reusable(plain)).classes is None


@pytest.mark.parametrize("metadata,columns,names", [
    (None, None, None),
    ({b"huggingface": b"not json"}, None, None),
    ({b"huggingface": b'{"info": {"features": []}}'}, None, None),
    ({b"huggingface": json.dumps(HF_META).encode()}, None, ["cat", "dog", "eel"]),
    ({b"huggingface": json.dumps(HF_META).encode()}, ["x"], None),
    ({b"huggingface": json.dumps({"info": {"features": {
        "a": {"_type": "ClassLabel", "names": ["p"]}, "b": {"_type": "ClassLabel", "names": ["q"]}}}}).encode()},
     None, None),  # two class columns, neither called label: which one is meant is not known
    ({b"huggingface": json.dumps({"info": {"features": {
        "fine": {"_type": "ClassLabel", "names": ["p"]}, "label": {"_type": "ClassLabel", "names": ["q"]}}}}).encode()},
     None, ["q"]),
    ({b"huggingface": json.dumps({"info": {"features": {
        "fine": {"_type": "ClassLabel", "names": ["p"]}, "label": {"_type": "ClassLabel", "names": ["q"]}}}}).encode()},
     ["fine", "x"], ["p"]),
])
def test_class_label_names_from_the_huggingface_metadata(metadata, columns, names):
    assert class_label_names(metadata, columns) == names


@pytest.mark.parametrize("entry,default", [("from_parquet", "32 MiB for Parquet"),
                                           ("from_shards", "16 MiB for shards")])
def test_a_part_size_below_the_floor_names_the_default_of_its_mode(entry, default):
    uri = {"from_parquet": "s3://bucket/pq/", "from_shards": "s3://bucket/s-{0..1}.tar"}[entry]
    with pytest.raises(ConfigError, match=rf"^part_size=10 is below the floor .* or leave the default \({default}\)$"):
        getattr(AsyncS3Dataset, entry)(uri, store=reusable(FAKE), reading=Reading(part_size=10))


def test_unshuffled_rows_come_in_file_order_though_units_are_read_side_by_side():
    ds = dataset()  # row_groups_inflight: 4 units read at once, several units a file
    assert ds.source.size() > len(ROWS)
    assert keys(ds) == [f"pq/part-{f}/{i}" for f, n in enumerate(ROWS) for i in range(n)]
    blocks = dataset(batch_size=4)
    assert keys(blocks) == [f"pq/part-{f}/{i}" for f, n in enumerate(ROWS) for i in range(n)]
