"""``python -m loader``: help texts, one-line argument errors, and the pure packing behind ``shard``.

No server here: commands that need one are checked for the errors they give before any request
(bad URI, size, name format, no credentials), and ``loader.tools.shard.pack`` runs against the
in-memory ``FakeStore`` (resume, multipart, aborts). The real-server tests are in
``integration/test_cli_s3.py``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.errors import ConfigError, StoreError, TransientStoreError
from loader.formats.compression import is_shard_name
from loader.formats.grouping import iter_samples, split_key
from loader.formats.packing import (
    END_OF_ARCHIVE,
    PROGRESS_NAME,
    check_name_format,
    encode_member,
    end_of_archive,
    group_samples,
    header_size,
    member_problem,
    parse_progress,
    plan_fingerprint,
    plan_shards,
    progress_document,
    shuffle_samples,
    source_directory,
    tar_header,
)
from loader.formats.tar import TarStreamParser
from loader.s3 import ObjectInfo
from loader.shard_index.format import INDEX_NAME, index_counts
from loader.shard_index.read import read_index_counts
from loader.tools import cli
from loader.tools.ls import (
    ParquetRows,
    is_parquet,
    log2_histogram,
    mostly,
    render_histogram,
    shard_destination,
    summarize_listing,
)
from loader.tools.shard import PackOptions, pack
from loader.tools.sizes import format_size, parse_size

from fakes import FakeStore, reusable

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("demo", "serve", "ls", "shard", "bench")
_S3_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL", "MINIO_ENDPOINT",
            "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MINIO_ACCESS_KEY",
            "MINIO_SECRET_KEY", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "LOADER_STORE")


def run_cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m loader ARGV`` in a subprocess with the S3 variables cleared (plus ``env``)."""
    return run_many([(argv, env)], timeout)[0]


def run_many(cases: list[tuple[tuple[str, ...] | list[str], dict[str, str] | None]],
             timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Several ``python -m loader`` runs side by side (each start imports torch: ~1.5 s)."""
    procs = []
    for argv, env in cases:
        environ = {k: v for k, v in os.environ.items() if k not in _S3_VARS}
        environ.update(env or {})
        procs.append((list(argv), subprocess.Popen(
            [sys.executable, "-m", "loader", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=environ, cwd=REPO)))
    results = []
    for argv, proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    return results


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("loader"), lines[0]
    assert "error:" in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------ help and usage


def test_top_level_help_lists_every_subcommand():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for command in COMMANDS:
        assert f"\n    {command}" in proc.stdout, f"{command} missing from --help"
    assert "AWS_ENDPOINT_URL" in proc.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_subcommand_help_explains_itself(command):
    out = io.StringIO()
    with pytest.raises(SystemExit) as exited:
        import contextlib

        with contextlib.redirect_stdout(out):
            cli.main([command, "--help"])
    assert exited.value.code == 0
    text = out.getvalue()
    assert text.startswith(f"usage: loader {command}")
    if command != "serve":
        assert "example" in text


def test_shard_help_says_how_to_read_the_result_and_hides_test_flags():
    text = run_cli("shard", "--help").stdout
    for needle in ("--target-size", "256MB", "1GiB", "index.json", "from_shards(", "by itself", "resume"):
        assert needle.lower() in text.lower(), needle
    assert "--stop-after" not in text and "--part-size" not in text
    assert "sample_counts" not in text  # from_shards finds the index itself


def test_no_command_prints_help_and_fails_as_usage():
    proc = run_cli()
    assert proc.returncode == 2
    assert "COMMAND" in proc.stderr and "Traceback" not in proc.stderr


BAD_ARGUMENTS = [
    (["frobnicate"], ["invalid choice"]),
    (["ls"], ["URI"]),
    (["ls", "bucket/train/"], ["not an S3 URI"]),
    (["ls", "s3://Bad_Bucket/x"], ["not a valid bucket name"]),
    (["shard", "s3://bkt/a/"], ["DST_PREFIX"]),
    (["shard", "train/", "s3://bkt/b/"], ["SRC_PREFIX", "not an S3 URI"]),
    (["shard", "s3://bkt/a/", "s3://bkt/b/", "--target-size", "12XB"], ["--target-size", "not a size"]),
    (["shard", "s3://bkt/a/", "s3://bkt/b/", "--target-size", "0"], ["less than one byte"]),
    (["shard", "s3://bkt/a/", "s3://bkt/b/", "--name-format", "shard.tar"], ["same name"]),
    (["shard", "s3://bkt/a/", "s3://bkt/b/", "--name-format", "s-{:05d}.zip"], ["'.tar'"]),
    (["shard", "s3://bkt/a/", "s3://bkt/b/", "--name-format", "s-{name}.tar"], ["shard number"]),
    (["shard", "s3://bkt/a/", "s3://bkt/b/", "--concurrency", "0"], ["not a positive integer"]),
    (["bench", "s3://bkt/x/", "--workers", "-1"], ["negative"]),
    (["bench", "s3://bkt/x/", "--samples", "many"], ["not an integer"]),
    (["bench", "s3://bkt/x/", "--store", "boto2"], ["invalid choice"]),
    (["demo", "--samples", "0"], ["not a positive integer"]),
    (["serve", "--port", "99999"], ["TCP port"]),
    (["serve", "--bucket", "ft"], ["--bucket", "'ft' is not a valid bucket name", "3-63 characters"]),
    (["ls", "s3://bkt/x/", "--retry-deadline", "0"], ["--retry-deadline", "not a positive number of seconds"]),
    (["index", "s3://bkt/s/", "--retry-deadline", "soon"], ["--retry-deadline", "not a number of seconds"]),
]
NO_CREDENTIALS = [
    ["ls", "s3://bkt/train/"],
    ["shard", "s3://bkt/train/", "s3://bkt/shards/"],
    ["bench", "s3://bkt/train/", "--workers", "0"],
]


SUBPROCESS_CASES = {2, 6, 13}  # a few through `python -m loader` (each start imports torch: ~1.5 s)


@pytest.fixture(scope="module")
def error_runs() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Some bad-argument cases and every no-credentials case as real ``python -m loader`` runs."""
    cases = [(BAD_ARGUMENTS[i][0], None) for i in sorted(SUBPROCESS_CASES)]
    cases += [(argv, {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}) for argv in NO_CREDENTIALS]
    return {tuple(argv): proc for (argv, _), proc in zip(cases, run_many(cases))}


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess:
    """``cli.main(argv)`` as if it were a process: exit code and captured output."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


@pytest.mark.parametrize("case", range(len(BAD_ARGUMENTS)))
def test_bad_arguments_are_one_line_usage_errors(error_runs, capsys, case):
    argv, needles = BAD_ARGUMENTS[case]
    proc = error_runs[tuple(argv)] if case in SUBPROCESS_CASES else run_in_process(argv, capsys)
    assert_one_line_error(proc, 2, *needles)


@pytest.mark.parametrize("argv", NO_CREDENTIALS)
def test_missing_credentials_are_one_line_errors(error_runs, argv):
    proc = error_runs[tuple(argv)]
    assert_one_line_error(proc, 1, "no credentials", "AWS_ACCESS_KEY_ID", "AWS_PROFILE=NAME",
                          "loader serve --background", "Tried: the environment")
    assert "S3Config" not in proc.stderr  # a shell user gets shell advice


def test_a_bad_endpoint_variable_is_a_one_line_error():
    proc = run_cli("ls", "s3://bkt/train/", env={"AWS_ENDPOINT_URL": "127.0.0.1:9000"})
    assert_one_line_error(proc, 1, "AWS_ENDPOINT_URL", "http://127.0.0.1:9000")


@pytest.mark.parametrize("argv", [
    ["ls", "s3://bkt/x/"], ["shard", "s3://bkt/a/", "s3://bkt/b/"], ["index", "s3://bkt/s/"],
    ["bench", "s3://bkt/x/"],
])
def test_every_verb_that_talks_to_the_store_takes_a_retry_deadline(argv):
    """The advice to wait out longer outages can be followed from a shell: each verb that
    talks to the store sets ``RetryPolicy(deadline=...)`` from ``--retry-deadline``."""
    from loader.retry import RetryPolicy
    from loader.tools.arguments import retry_policy

    parser = cli.build_parser()
    assert retry_policy(parser.parse_args(argv)) is None  # the library's default
    assert retry_policy(parser.parse_args([*argv, "--retry-deadline", "7.5"])) == RetryPolicy(deadline=7.5)


def test_shard_refuses_the_sources_own_folder_as_destination_before_any_request():
    proc = run_cli("shard", "s3://bkt/train", "s3://bkt/train/",
                   env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k",
                        "AWS_SECRET_ACCESS_KEY": "s"})
    assert_one_line_error(proc, 1, "is the folder of SRC_PREFIX", "one inside the source is fine")


def test_worker_tracebacks_are_cut_to_their_last_line():
    text = ("Caught NoSuchKeyError in DataLoader worker process 0.\nOriginal Traceback (most recent "
            "call last):\n  File \"x.py\", line 1, in f\nloader.errors.NoSuchKeyError: s3://b/k: "
            "no such key")
    assert cli.one_line(StoreError(text)) == "s3://b/k: no such key"
    assert cli.one_line(ConfigError("two\n  lines")) == "two lines"


# ------------------------------------------------------------------------ sizes


@pytest.mark.parametrize("text,expected", [
    ("256MB", 256_000_000), ("256mb", 256_000_000), ("1GiB", 1 << 30), ("1gi", 1 << 30),
    ("500k", 500_000), ("500K", 500_000), ("500KiB", 512_000), ("4096", 4096), ("1.5G", 1_500_000_000),
    (" 64 MiB ", 64 << 20), ("2TB", 2 * 10**12), ("7b", 7), (".5k", 500),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MB", "12XB", "-5MB", "1e3", "1,000", "0", "0.1", "five"])
def test_parse_size_rejects_with_an_example(text):
    with pytest.raises(ConfigError, match=r"256MB"):
        parse_size(text)


@given(st.integers(1, 10**6), st.sampled_from(["", "k", "KB", "M", "MiB", "Gi", "g"]))
def test_parse_size_scales_integers_exactly(number, unit):
    factor = {"": 1, "k": 10**3, "KB": 10**3, "M": 10**6, "MiB": 2**20, "Gi": 2**30, "g": 10**9}[unit]
    assert parse_size(f"{number}{unit}") == number * factor


def test_format_size():
    assert format_size(0) == "0 B"
    assert format_size(1023) == "1023 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(256 * 10**6) == "244 MiB"
    assert format_size(3 << 30) == "3 GiB"


# ------------------------------------------------------------------------ tar layout


@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), min_size=1,
               max_size=300), st.integers(0, 10**12))
def test_header_size_matches_the_header_tarfile_writes(name, size):
    header = tar_header(name, size)
    assert len(header) == header_size(name)
    assert len(header) % 512 == 0


def test_headers_are_deterministic_and_readable_by_tarfile():
    data = b"hello"
    blob = b"".join(encode_member("d/" + "n" * 150 + ".txt", data)) + end_of_archive()
    assert blob == b"".join(encode_member("d/" + "n" * 150 + ".txt", data)) + end_of_archive()
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        (info,) = tar.getmembers()
        assert info.name == "d/" + "n" * 150 + ".txt" and info.mtime == 0 and info.mode == 0o644
        assert tar.extractfile(info).read() == data


# ------------------------------------------------------------------------ grouping and planning

_DIRS = ["", "a/", "a.b/", "a/b.d/", "d" * 120 + "/"]
_STEMS = ["x", "x-1", "x0", "y", "b", "b.c", ".hidden", "Z"]
_EXTS = ["jpg", "cls", "json", "c.jpg", "tar.gz", "", "__key__"]


@st.composite
def listings(draw, valid_only: bool = False):
    """A source listing ``(prefix, [(key, size)])`` with keys that interleave in sort order."""
    prefix = draw(st.sampled_from(["train/", "train/part-", ""]))
    entries = draw(st.lists(st.tuples(st.sampled_from(_DIRS), st.sampled_from(_STEMS),
                                      st.sampled_from(_EXTS), st.integers(0, 3000)), max_size=40))
    base = source_directory(prefix)
    objects = {}
    for directory, stem, ext, size in entries:
        name = directory + stem + (f".{ext}" if ext else "")
        key = prefix + name
        if valid_only and member_problem(key[len(base):]):
            continue
        objects[key] = size
    return prefix, sorted(objects.items())


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(listings(), st.integers(512, 20_000), st.booleans(), st.integers(0, 3))
def test_plan_puts_every_object_in_exactly_one_shard_and_never_splits_a_sample(listing, target, shuffle, seed):
    prefix, objects = listing
    samples, skipped = group_samples(objects, prefix)
    base = source_directory(prefix)
    # every object is either a member of exactly one sample or skipped, with the reason it has
    members = [m.key for s in samples for m in s.members]
    assert sorted(members + [k for k, _ in skipped]) == [k for k, _ in objects]
    assert len(set(members)) == len(members)
    for key, reason in skipped:
        assert member_problem(key[len(base):]) == reason
    for sample in samples:
        assert {split_key(m.name)[0] for m in sample.members} == {sample.key}
    if shuffle:
        samples = shuffle_samples(samples, seed)
    plans = plan_shards(samples, target)
    assert [s for p in plans for s in p.samples] == samples  # all, once, in order
    seen_keys = [s.key for p in plans for s in p.samples]
    assert len(seen_keys) == len(set(seen_keys)), "a sample key appears in two places"
    for plan in plans:
        assert plan.samples, "an empty shard"
        assert plan.bytes <= target or len(plan.samples) == 1
        assert plan.bytes == sum(s.tar_bytes for s in plan.samples) + END_OF_ARCHIVE
    for before, after in zip(plans, plans[1:]):  # greedy: the next sample did not fit
        assert before.bytes + after.samples[0].tar_bytes > target


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(listings(valid_only=True), st.integers(512, 8_000))
def test_planned_bytes_and_offsets_are_what_the_tar_holds(listing, target):
    prefix, objects = listing
    samples, skipped = group_samples(objects, prefix)
    assert not skipped
    data = {key: key.encode()[:size].ljust(size, b"#") for key, size in objects}
    for plan in plan_shards(samples, target):
        blob = b"".join(piece for m in plan.members for piece in encode_member(m.name, data[m.key]))
        blob += end_of_archive()
        assert len(blob) == plan.bytes
        parsed = list(iter_samples([blob], "s3://b/shard.tar"))
        assert [p["__key__"] for p in parsed] == [s.key for s in plan.samples]
        for got, sample in zip(parsed, plan.samples):
            assert {ext: got[ext] for ext in got if not ext.startswith("__")} == {
                split_key(m.name)[1]: data[m.key] for m in sample.members}
        starts = {}
        for member in TarStreamParser("s3://b/shard.tar").feed(blob):
            starts.setdefault(split_key(member.name)[0], member.offset)
        assert tuple(starts[s.key] for s in plan.samples) == plan.offsets


def test_group_samples_groups_by_key_even_when_listing_interleaves():
    objects = [("t/a/b.c.jpg", 1), ("t/a/b.d/x.jpg", 2), ("t/a/b.e.jpg", 3), ("t/a/b.jpg", 4)]
    samples, skipped = group_samples(objects, "t/")
    assert not skipped
    assert [(s.key, [m.name for m in s.members]) for s in samples] == [
        ("a/b", ["a/b.c.jpg", "a/b.e.jpg", "a/b.jpg"]), ("a/b.d/x", ["a/b.d/x.jpg"])]


def test_group_samples_names_members_relative_to_the_prefix_directory():
    samples, _ = group_samples([("data/train/part-1.jpg", 1)], "data/train/part-")
    assert samples[0].members[0].name == "part-1.jpg"
    samples, _ = group_samples([("data/x.jpg", 1)], "data")
    assert samples[0].members[0].name == "data/x.jpg"


def test_group_samples_reports_objects_that_cannot_be_members():
    _, skipped = group_samples([("t/README", 1), ("t/.DS_Store", 1), ("t/a.__key__", 1)], "t/")
    assert [(k, r.split(" (")[0]) for k, r in skipped] == [
        ("t/.DS_Store", "its basename starts with '.'"),
        ("t/README", "its basename has no extension"),
        ("t/a.__key__", "its extension '__key__' is a reserved sample field")]


def test_a_sample_bigger_than_the_target_gets_a_shard_of_its_own():
    samples, _ = group_samples([("t/a.bin", 10), ("t/b.bin", 10_000), ("t/c.bin", 10)], "t/")
    plans = plan_shards(samples, 2048)
    assert [[s.key for s in p.samples] for p in plans] == [["a"], ["b"], ["c"]]
    assert plans[1].bytes > 2048 and plans[0].bytes <= 2048


def test_check_name_format():
    assert check_name_format("train-{:06d}.tar") == "train-{:06d}.tar"
    assert check_name_format("sub/{}.tar") == "sub/{}.tar"
    with pytest.raises(ConfigError, match="relative"):
        check_name_format("/{}.tar")


def test_progress_of_another_plan_is_refused_with_advice():
    fp = plan_fingerprint("s3://b/t/", [("t/a.jpg", 1)], {"target_size": 10})
    other = plan_fingerprint("s3://b/t/", [("t/a.jpg", 2)], {"target_size": 10})
    doc = progress_document(fp, "s3://b/t/", "s3://b/s/", 3, {2, 0}, {"target_size": 10})
    assert parse_progress(json.loads(json.dumps(doc)), fp, "p") == {0, 2}
    with pytest.raises(ConfigError, match="different run.*--overwrite"):
        parse_progress(doc, other, "p")
    with pytest.raises(ConfigError, match="--overwrite"):
        parse_progress({"version": 99}, fp, "p")


def test_index_counts_checks_the_document():
    assert index_counts({"version": 1, "shards": [{"url": "s3://b/s/0.tar", "samples": 3}]}) == {
        "s3://b/s/0.tar": 3}
    with pytest.raises(ConfigError, match="not an index"):
        index_counts({"shards": []})
    with pytest.raises(ConfigError, match=r"shards\[0\]"):
        index_counts({"version": 1, "shards": [{"url": "s3://b/s/0.tar"}]})


# ------------------------------------------------------------------------ ls


def test_log2_histogram_and_its_text():
    buckets = log2_histogram([0, 1, 3, 3, 8, 20, 1000, 1024])
    assert [(b.low, b.high, b.objects) for b in buckets][:6] == [
        (0, 1, 1), (1, 2, 1), (2, 4, 2), (4, 8, 0), (8, 16, 1), (16, 32, 1)]
    assert buckets[-1] == (1024, 2048, 1) and sum(b.objects for b in buckets) == 8
    lines = render_histogram(buckets, width=10)
    assert "██████████" in lines[2] and lines[2].endswith(" 2")
    assert "4 B – 8 B" in lines[3] and "█" not in lines[3]  # one empty bucket: shown
    assert lines[6].split() == ["...", "0"]  # 32 B .. 512 B: four empty buckets, one line
    assert "512 B – 1 KiB" in lines[7] and "1 KiB – 2 KiB" in lines[8] and len(lines) == 9


def test_ls_summary_suggests_shards_for_small_objects_only():
    small = [ObjectInfo(f"t/{i:04d}.jpg", 3000 + i) for i in range(100)]
    text = "\n".join(summarize_listing("s3://b/t/", small))
    assert "100 objects" in text and "jpg 100" in text and "loader shard s3://b/t/" in text
    big = [ObjectInfo(f"t/{i:04d}.bin", 8 << 20) for i in range(3)]
    assert "loader shard" not in "\n".join(summarize_listing("s3://b/t/", big))
    tars = [ObjectInfo(f"s/{i}.tar", 100) for i in range(3)]
    assert "from_shards" in "\n".join(summarize_listing("s3://b/s/", tars))


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz", ".tgz", ".tar.zst", ".tzst"])
def test_ls_sees_compressed_shards_as_shards_too(suffix):
    """Small compressed shards are shards already: no advice to pack them into shards."""
    listing = [ObjectInfo(f"s/shard-{i:05d}{suffix}", 3000) for i in range(2)]
    listing += [ObjectInfo("s/index.json", 900), ObjectInfo("s/_progress.json", 300)]
    text = "\n".join(summarize_listing("s3://bkt/s/", listing))
    assert "these look like tar shards (2 of 4 objects)" in text and "from_shards('s3://bkt/s/')" in text
    assert "loader shard" not in text and "Pack them" not in text
    assert mostly((info.key for info in listing), is_shard_name)


def test_ls_sees_parquet_files_with_their_footers_rows_and_no_shard_advice():
    """Small Parquet files are read by rows already: the hint names from_parquet, the rows the
    footers gave and any file whose footer did not read; never `loader shard`."""
    listing = [ObjectInfo(f"pq/part-{i}.parquet", 3000) for i in range(3)] + [ObjectInfo("pq/README.md", 90)]
    rows = ParquetRows(1234, 9, ("s3://bkt/pq/part-2.parquet does not end in the Parquet magic",))
    text = "\n".join(summarize_listing("s3://bkt/pq/", listing, parquet=rows))
    assert ("these are Parquet files (3 of 4 objects, 1,234 rows in 9 row groups): read them with "
            "AsyncS3Dataset.from_parquet('s3://bkt/pq/')") in text
    assert "  unreadable: s3://bkt/pq/part-2.parquet does not end in the Parquet magic" in text
    assert "loader shard" not in text and "Pack them" not in text and "max_inflight" not in text
    assert mostly((info.key for info in listing), is_parquet) and not mostly(["a.parquet", "b", "c"], is_parquet)
    small = [ObjectInfo(f"t/{i:04d}.jpg", 3000) for i in range(10)]
    assert "Limits(concurrency=) / latency" in "\n".join(summarize_listing("s3://b/t/", small))


def test_shards_are_judged_by_their_share_of_the_objects():
    assert mostly(["a.tar", "b.jpg"], is_shard_name) and not mostly(["a.tar", "b.jpg", "c.jpg"], is_shard_name)
    assert not mostly(["index.json"], is_shard_name) and not mostly([], is_shard_name)
    assert not mostly(["x/index.json.tar.txt"], is_shard_name)


def test_ls_suggests_a_destination_that_can_exist():
    assert shard_destination("s3://bkt") == shard_destination("s3://bkt/") == "s3://bkt/shards/"
    assert shard_destination("s3://bkt/train/") == shard_destination("s3://bkt/train") == "s3://bkt/train-shards/"
    small = [ObjectInfo(f"{i:04d}.jpg", 3000) for i in range(10)]
    assert "  loader shard s3://bkt s3://bkt/shards/ --target-size 256MB" in summarize_listing("s3://bkt", small)


@pytest.mark.parametrize("src", ["s3://bkt", "s3://bkt/", "s3://bkt/src"])
def test_pack_into_a_folder_inside_the_source_leaves_that_folder_out(src):
    """What ``ls`` suggests for a whole bucket (or a prefix without its slash) works, and a rerun
    does not take the shards it wrote for source objects."""
    objects = {f"src/{k}": v for k, v in source_objects(40).items()}
    fake = FakeStore.with_objects(BUCKET, objects)
    dst = shard_destination(src)
    first = pack(src, dst, PackOptions(target_size=20_000), store=reusable(fake))
    assert first.complete and first.objects == 80 and first.resumed == 0
    again = pack(src, dst, PackOptions(target_size=20_000), store=reusable(fake))
    assert again.complete and again.objects == 80 and again.resumed == again.shards

# ------------------------------------------------------------------------ pack() on the fake store

BUCKET = "bkt"


def source_objects(n: int, seed: int = 0) -> dict[str, bytes]:
    """``n`` samples of two objects each (``.bin`` of varying size and ``.cls``)."""
    out = {}
    for i in range(n):
        out[f"src/{i:05d}.bin"] = bytes([(i + seed) % 251]) * (100 + (i * 37) % 900)
        out[f"src/{i:05d}.cls"] = str(i % 10).encode()
    return out


def read_shards(fake: FakeStore, prefix: str = "dst/") -> dict[str, dict[str, bytes]]:
    """Every sample in the ``.tar`` objects under ``prefix``: ``{key: {ext: bytes}}`` (no dups)."""
    samples: dict[str, dict[str, bytes]] = {}
    for (bucket, key), blob in sorted(fake.objects.items()):
        if bucket == BUCKET and key.startswith(prefix) and key.endswith(".tar"):
            for sample in iter_samples([blob], key):
                assert sample["__key__"] not in samples, f"duplicate sample {sample['__key__']}"
                samples[sample["__key__"]] = {k: v for k, v in sample.items() if not k.startswith("__")}
    return samples


def expected_samples(objects: dict[str, bytes]) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    for key, data in objects.items():
        stem, ext = split_key(key[len("src/"):])
        out.setdefault(stem, {})[ext] = data
    return out


def index_of(fake: FakeStore) -> dict:
    return json.loads(fake.objects[BUCKET, "dst/" + INDEX_NAME])


def test_pack_writes_shards_that_hold_exactly_the_objects(no_leaked_threads):
    objects = source_objects(300)
    fake = FakeStore.with_objects(BUCKET, objects)
    report = pack("s3://bkt/src/", "s3://bkt/dst", PackOptions(target_size=20_000, concurrency=3,
                                                              max_inflight=8),
                  store=reusable(fake))
    assert report.complete and report.objects == 600 and report.samples == 300
    assert read_shards(fake) == expected_samples(objects)
    index = index_of(fake)
    assert index["samples"] == 300 and index["objects"] == 600 and len(index["shards"]) == report.shards
    for shard in index["shards"]:
        blob = fake.objects[BUCKET, shard["key"]]
        assert shard["url"] == f"s3://bkt/{shard['key']}" and shard["bytes"] == len(blob) <= 20_000
        assert shard["samples"] == len(shard["offsets"]) == len(list(iter_samples([blob], "x")))
    assert fake.peak_inflight <= 8
    progress = json.loads(fake.objects[BUCKET, "dst/" + PROGRESS_NAME])
    assert progress["done"] == list(range(report.shards))
    counts = read_index_counts("s3://bkt/dst/", store=reusable(fake))
    assert counts == {s["url"]: s["samples"] for s in index["shards"]}


def test_reading_the_index_retries_as_the_callers_policy_says():
    from loader.errors import TransientStoreError
    from loader.retry import RetryPolicy

    fake = FakeStore.with_objects(BUCKET, {"dst/" + INDEX_NAME: json.dumps(
        {"version": 1, "shards": [{"url": "s3://bkt/dst/0.tar", "samples": 3}]}).encode()})
    quick = {"base_delay": 0.001, "max_delay": 0.002}

    def slow_down() -> TransientStoreError:
        return TransientStoreError("SlowDown", bucket=BUCKET, key="dst/" + INDEX_NAME)

    fake.fail = {"dst/" + INDEX_NAME: [slow_down(), slow_down()]}
    with pytest.raises(TransientStoreError, match="SlowDown"):
        read_index_counts("s3://bkt/dst/", store=reusable(fake), retry=RetryPolicy(max_attempts=2, **quick))
    fake.fail = {"dst/" + INDEX_NAME: [slow_down(), slow_down()]}
    assert read_index_counts("s3://bkt/dst/", store=reusable(fake),
                             retry=RetryPolicy(max_attempts=3, **quick)) == {"s3://bkt/dst/0.tar": 3}


def test_pack_streams_big_shards_as_multipart_uploads():
    objects = source_objects(200)
    fake = FakeStore.with_objects(BUCKET, objects, min_part_size=4096)
    report = pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(target_size=60_000, part_size=4096),
                  store=reusable(fake))
    assert report.complete
    assert fake.multipart_created >= report.shards - 1 and fake.completed == fake.multipart_created
    assert fake.parts_uploaded > fake.multipart_created
    assert not fake.uploads
    assert read_shards(fake) == expected_samples(objects)


def test_an_interrupted_run_resumes_without_duplicates_or_rewrites():
    objects = source_objects(200)
    fake = FakeStore.with_objects(BUCKET, objects)
    options = dict(target_size=10_000, concurrency=2)
    first = pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(**options, stop_after=3),
                 store=reusable(fake))
    assert not first.complete and 3 <= first.written < first.shards
    assert (BUCKET, "dst/" + INDEX_NAME) not in fake.objects
    assert not fake.uploads, "the cancelled shards' uploads were not aborted"
    done_before = {k: v for k, v in fake.objects.items() if k[1].endswith(".tar")}
    puts_before = fake.puts
    second = pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(**options), store=reusable(fake))
    assert second.complete and second.resumed == len(done_before) >= 3
    assert second.written == second.shards - second.resumed
    for key, blob in done_before.items():
        assert fake.objects[key] is blob, f"{key} was written again"
    # one PUT per new shard, one per progress record (they may coalesce), the index
    assert fake.puts - puts_before <= 2 * second.written + 2
    assert read_shards(fake) == expected_samples(objects)
    third = pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(**options), store=reusable(fake))
    assert third.complete and third.written == 0 and third.resumed == third.shards


def test_a_rerun_with_other_options_or_a_changed_source_is_refused():
    objects = source_objects(50)
    fake = FakeStore.with_objects(BUCKET, objects)
    pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(target_size=10_000), store=reusable(fake))
    with pytest.raises(ConfigError, match="different run"):
        pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(target_size=20_000), store=reusable(fake))
    fake.objects[BUCKET, "src/99999.bin"] = b"new"
    with pytest.raises(ConfigError, match="different run"):
        pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(target_size=10_000), store=reusable(fake))
    report = pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(target_size=10_000, overwrite=True),
                  store=reusable(fake))
    assert report.complete and report.samples == 51


def test_existing_shards_without_a_progress_file_are_not_overwritten_silently():
    fake = FakeStore.with_objects(BUCKET, {**source_objects(5), "dst/shard-00000.tar": b"mine"})
    with pytest.raises(ConfigError, match="--overwrite"):
        pack("s3://bkt/src/", "s3://bkt/dst/", store=reusable(fake))
    assert fake.objects[BUCKET, "dst/shard-00000.tar"] == b"mine"


def test_objects_that_cannot_be_members_stop_the_run_unless_skipped():
    fake = FakeStore.with_objects(BUCKET, {**source_objects(5), "src/README": b"hi"})
    with pytest.raises(ConfigError, match="README.*--skip-invalid"):
        pack("s3://bkt/src/", "s3://bkt/dst/", store=reusable(fake))
    report = pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(skip_invalid=True), store=reusable(fake))
    assert report.complete and [s.key for s in report.skipped] == ["src/README"]
    assert index_of(fake)["skipped_objects"] == 1


def test_a_failing_part_upload_aborts_and_leaves_no_shard_or_upload():
    objects = source_objects(100)
    fake = FakeStore.with_objects(BUCKET, objects, part_fail={2: StoreError("boom: 403")})
    with pytest.raises(StoreError, match="boom"):
        pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(target_size=10**6, part_size=2000),
             store=reusable(fake))
    assert not fake.uploads and fake.aborted == 1
    assert not [k for k in fake.objects if k[1].endswith(".tar")]


def test_transient_faults_are_retried_and_shuffle_is_deterministic():
    objects = source_objects(60)
    flaky = {"src/00007.bin": [TransientStoreError("503")], "src/00033.cls": [TransientStoreError("reset")]}
    runs = []
    for _ in range(2):
        fake = FakeStore.with_objects(BUCKET, objects, fail=flaky)
        report = pack("s3://bkt/src/", "s3://bkt/dst/",
                      PackOptions(target_size=8_000, shuffle=True, seed=5), store=reusable(fake))
        assert report.complete
        assert read_shards(fake) == expected_samples(objects)
        runs.append({k: v for k, v in fake.objects.items() if k[1].endswith(".tar")})
    assert runs[0] == runs[1], "the same seed must make the same shards"
    keys = [s["__key__"] for s in iter_samples([runs[0][BUCKET, "dst/shard-00000.tar"]], "x")]
    assert keys != sorted(keys)


def test_source_changing_during_the_run_is_reported():
    objects = source_objects(10)
    fake = FakeStore.with_objects(BUCKET, objects)

    original_get = fake.get

    async def get(bucket, key):
        data = await original_get(bucket, key)
        return data + b"!" if key == "src/00004.bin" else data

    fake.get = get
    with pytest.raises(Exception, match="changed while packing"):
        pack("s3://bkt/src/", "s3://bkt/dst/", store=reusable(fake))
    assert not [k for k in fake.objects if k[1].endswith(".tar")]


def test_uploads_a_killed_run_left_open_are_aborted_on_the_rerun():
    import anyio

    objects = source_objects(40)
    fake = FakeStore.with_objects(BUCKET, objects)
    first = pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(target_size=5_000, stop_after=1,
                                                              concurrency=1), store=reusable(fake))
    assert not first.complete
    # what SIGKILL mid-shard leaves: an open upload for a shard not yet written, and one of
    # someone else's that is not ours to touch
    fake.closed = False  # pack() closed it
    anyio.run(fake.create_multipart, BUCKET, "dst/shard-00002.tar")
    anyio.run(fake.create_multipart, BUCKET, "dst/other.bin")
    second = pack("s3://bkt/src/", "s3://bkt/dst/", PackOptions(target_size=5_000, concurrency=1),
                  store=reusable(fake))
    assert second.complete
    assert [u.key for u in fake.uploads.values()] == ["dst/other.bin"]
    assert read_shards(fake) == expected_samples(objects)


def test_version_names_the_distribution(capsys):
    import loader

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"loader (s3stream-loader) {loader.__version__}"


def test_ls_never_imports_torch():
    """``loader ls`` is a command line tool: neither listing nor its failure imports torch
    (seconds before the answer). The endpoint is a closed port on loopback, so the listing fails
    at first contact, through the same path a successful one takes."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = f"""
import os, sys
os.environ.update(AWS_ENDPOINT_URL="http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="k",
                  AWS_SECRET_ACCESS_KEY="s")
from loader.tools.cli import main
try:
    main(["ls", "s3://bucket/prefix/"])
except SystemExit as exc:
    assert exc.code == 1, exc.code
assert "torch" not in sys.modules, "torch was imported"
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "127.0.0.1" in proc.stderr


def test_a_reader_that_leaves_early_ends_the_command_without_a_traceback():
    """``loader ls ... | head``: the pipe closes while the command still writes; it stops with
    a failing status and nothing on stderr, as a Unix tool does."""
    code = ("import argparse, sys; from loader.tools import cli\n"
            "def run(args):\n"
            "    for _ in range(100_000):\n"
            "        print('s3://bucket/key' * 5)\n"
            "class Parser:\n"
            "    def parse_args(self, argv):\n"
            "        return argparse.Namespace(run=run, command='ls')\n"
            "cli.build_parser = Parser\n"
            "sys.exit(cli.main([]))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(100).startswith(b"s3://bucket/key")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err
