"""Unit and property tests for ``loader.uri``: ``s3://`` parsing and WebDataset brace patterns."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loader.errors import ConfigError
from loader.uri import (
    MAX_EXPANSION,
    S3Uri,
    bucket_name_problem,
    check_bucket_name,
    expand_braces,
    object_url,
    parse_s3_uri,
    sibling_matches,
)

# ------------------------------------------------------------------------------ parse_s3_uri


@pytest.mark.parametrize(
    ("uri", "bucket", "key"),
    [
        ("s3://bucket/train/", "bucket", "train/"),
        ("s3://bucket/train/000001.tar", "bucket", "train/000001.tar"),
        ("s3://bucket", "bucket", ""),
        ("s3://bucket/", "bucket", ""),
        ("s3://my.bucket-1_x/a//b", "my.bucket-1_x", "a//b"),
        ("s3://abc/k", "abc", "k"),
        ("s3://0data/k with spaces/ü.jpg", "0data", "k with spaces/ü.jpg"),
        ("s3://" + "b" * 255 + "/k", "b" * 255, "k"),
    ],
)
def test_parse_good_uris(uri, bucket, key):
    parsed = parse_s3_uri(uri)
    assert parsed == S3Uri(bucket, key)
    assert (parsed.bucket, parsed.key) == (bucket, key)
    bucket_out, key_out = parsed  # a NamedTuple unpacks
    assert (bucket_out, key_out) == (bucket, key)


@pytest.mark.parametrize(
    "uri", ["bucket/key", "http://bucket/key", "S3://bucket/key", "s3:/bucket/key", "s3:bucket", "", " s3://b/k"]
)
def test_parse_rejects_non_s3_uris_with_advice(uri):
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(repr(uri))} is not an S3 URI; write it as 's3://bucket/prefix/'$"
    ):
        parse_s3_uri(uri)


@pytest.mark.parametrize("value", [None, 42, b"s3://bucket/key"])
def test_parse_rejects_non_strings(value):
    with pytest.raises(ConfigError, match=rf"^{re.escape(repr(value))} is not an S3 URI"):
        parse_s3_uri(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("uri", "bucket"),
    [
        ("s3://", ""),
        ("s3:///key", ""),
        ("s3://My-Bucket/key", "My-Bucket"),
        ("s3://-bucket/key", "-bucket"),
        ("s3://.bucket/key", ".bucket"),
        ("s3://b/key", "b"),
        ("s3://ab/key", "ab"),  # S3 bucket names have at least 3 characters, as the message says
        ("s3://buck et/key", "buck et"),
        ("s3://bucket:9000/key", "bucket:9000"),
        ("s3://" + "b" * 256 + "/k", "b" * 256),
    ],
)
def test_parse_rejects_bad_bucket_names(uri, bucket):
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(repr(uri))}: {re.escape(repr(bucket))} is not a valid bucket name "
        r"\(3-255 lowercase letters, digits, '\.', '-', '_'\)$",
    ):
        parse_s3_uri(uri)


def test_parse_errors_are_value_errors():
    with pytest.raises(ValueError):
        parse_s3_uri("bucket/key")


def test_str_and_object_url_round_trip():
    assert str(S3Uri("bucket", "a/b.tar")) == "s3://bucket/a/b.tar"
    assert object_url("bucket", "a/b.tar") == "s3://bucket/a/b.tar"
    assert str(parse_s3_uri("s3://bucket/")) == "s3://bucket/"


@given(
    bucket=st.from_regex(r"[a-z0-9][a-z0-9.\-_]{2,62}", fullmatch=True),
    key=st.text(max_size=50),
)
def test_parse_inverts_object_url(bucket, key):
    assert parse_s3_uri(object_url(bucket, key)) == S3Uri(bucket, key)


# ------------------------------------------------------------------------------ expand_braces


def test_no_braces_is_the_pattern_itself():
    assert expand_braces("s3://bucket/train.tar") == ["s3://bucket/train.tar"]
    assert expand_braces("") == [""]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("s-{00..02}.tar", ["s-00.tar", "s-01.tar", "s-02.tar"]),
        ("train-{000000..000002}.tar", ["train-000000.tar", "train-000001.tar", "train-000002.tar"]),
        ("{1..3}", ["1", "2", "3"]),
        ("{0..2}", ["0", "1", "2"]),  # a lone 0 is not padding
        ("{8..11}", ["8", "9", "10", "11"]),
        ("{08..11}", ["08", "09", "10", "11"]),
        ("{5..5}", ["5"]),
        ("{-2..1}", ["-2", "-1", "0", "1"]),
        ("{98..100}", ["98", "99", "100"]),
    ],
)
def test_ranges(pattern, expected):
    assert expand_braces(pattern) == expected


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("{00..100}", ["000", "001"]),  # padding goes to the wider end, so the names stay sorted
        ("{1..010}", ["001", "002"]),  # a leading zero on either end pads (as bash and braceexpand do)
        ("{0001..3}", ["0001", "0002"]),
    ],
)
def test_zero_padding_uses_the_wider_end(pattern, expected):
    names = expand_braces(pattern)
    assert names[:2] == expected
    assert len({len(name) for name in names}) == 1
    assert names == sorted(names)


def test_comma_lists():
    assert expand_braces("{train,val,test}.tar") == ["train.tar", "val.tar", "test.tar"]
    assert expand_braces("x{a,}y") == ["xay", "xy"]
    assert expand_braces("{,a}") == ["", "a"]
    assert expand_braces("{a..b,c}") == ["a..b", "c"]  # not a numeric range: a list


def test_multiple_groups_expand_left_to_right():
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert expand_braces("s3://bkt/{train,val}/shard-{00..01}.tar") == [
        "s3://bkt/train/shard-00.tar",
        "s3://bkt/train/shard-01.tar",
        "s3://bkt/val/shard-00.tar",
        "s3://bkt/val/shard-01.tar",
    ]
    assert len(expand_braces("{0..9}{0..9}{0..9}")) == 1000
    assert expand_braces("{0..9}{0..9}{0..9}") == [f"{i:03d}" for i in range(1000)]


def test_backwards_range_says_how_to_write_it():
    with pytest.raises(
        ConfigError, match=r"^'s-\{05\.\.01\}\.tar': range \{05\.\.01\} runs backwards; write \{01\.\.05\}$"
    ):
        expand_braces("s-{05..01}.tar")


@pytest.mark.parametrize("pattern", ["{a..b}", "{abc}", "{}", "{1...3}", "{1..}", "{..3}", "x-{0..1}-{y}"])
def test_group_that_is_neither_range_nor_list(pattern):
    body = re.findall(r"\{([^{}]*)\}", pattern)[-1]
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(repr(pattern))}: \{{{re.escape(body)}\}} is neither a range "
        r"\{a\.\.b\} nor a list \{x,y\}$",
    ):
        expand_braces(pattern)


@pytest.mark.parametrize(
    "pattern",
    [
        "s-{00..02",
        "s-00..02}",
        "{a,b}}",
        "{{a,b}",  # an unbalanced brace before a group is caught too
        "x}{1,2}",
        "{a,{b,c}}",  # nested
        "{0..1}-{",
        "}",
        "{",
    ],
)
def test_unbalanced_or_nested_braces(pattern):
    with pytest.raises(ConfigError, match=rf"^{re.escape(repr(pattern))} has an unbalanced or nested brace$"):
        expand_braces(pattern)


def test_huge_product_is_refused():
    with pytest.raises(ConfigError, match=r"^'\{0\.\.3999\}\{0\.\.3999\}' expands to more than 10,000,000 names$"):
        expand_braces("{0..3999}{0..3999}")


def test_huge_single_range_is_refused_without_building_it():
    """Refused by arithmetic: building a list of 10**15 names first would exhaust memory."""
    with pytest.raises(ConfigError, match=r"expands to more than 10,000,000 names"):
        expand_braces("shard-{000000000000000..999999999999999}.tar")
    with pytest.raises(ConfigError, match=r"expands to more than 10,000,000 names"):
        expand_braces(f"{{0..{MAX_EXPANSION}}}")  # one name more than the limit


def test_errors_are_value_errors():
    with pytest.raises(ValueError):
        expand_braces("{3..1}")


@given(
    lo=st.integers(0, 10**6),
    span=st.integers(0, 300),
    width=st.integers(1, 8),
    prefix=st.text(alphabet="abc-_/.", max_size=5),
    suffix=st.sampled_from(["", ".tar", "-x.tar.gz"]),
)
def test_range_property(lo, span, width, prefix, suffix):
    hi = lo + span
    names = expand_braces(f"{prefix}{{{lo:0{width}d}..{hi:0{width}d}}}{suffix}")
    assert len(names) == hi - lo + 1
    assert len(set(names)) == len(names)
    numbers = [int(name[len(prefix):len(name) - len(suffix)]) for name in names]
    assert numbers == list(range(lo, hi + 1))
    padded = width > 1 and (len(str(lo)) < width or len(str(hi)) < width)
    if padded:
        assert names == sorted(names)
        assert len({len(name) for name in names}) == 1


@given(
    groups=st.lists(
        st.one_of(
            st.tuples(st.integers(0, 20), st.integers(0, 4)).map(lambda t: (t[0], t[0] + t[1])),
            st.lists(st.text(alphabet="xyz", max_size=3), min_size=2, max_size=3),
        ),
        max_size=3,
    )
)
def test_count_is_the_product_of_group_sizes(groups):
    pattern, expected = "", 1
    for group in groups:
        if isinstance(group, tuple):
            pattern += f"[{{{group[0]}..{group[1]}}}]"
            expected *= group[1] - group[0] + 1
        else:
            pattern += "[{" + ",".join(group) + "}]"
            expected *= len(group)
    assert len(expand_braces(pattern)) == expected


def test_sibling_matches_names_what_else_a_folder_prefix_matched():
    keys = ["train/imgs/0.jpg", "train/imgs/1.jpg", "train/imgs-shards/s0.tar", "train/imgs.txt",
            "train/imgs-shards/s1.tar"]
    assert sibling_matches("train/imgs", keys) == ["train/imgs-shards/", "train/imgs.txt"]
    assert sibling_matches("train/imgs/", keys) == [], "a trailing slash names only the folder"
    assert sibling_matches("", keys) == []
    assert sibling_matches("train/img", ["train/img0.jpg", "train/img1.jpg"]) == [], "a partial name"
    assert sibling_matches("train/imgs", ["train/imgs/0.jpg"]) == [], "only the folder matched"


folder_names = st.text(alphabet="abc-.", min_size=1, max_size=4)


@given(prefix=folder_names, inside=st.lists(folder_names, max_size=4),
       beside=st.lists(st.tuples(folder_names, st.booleans()), max_size=4))
def test_sibling_matches_returns_exactly_the_other_matches(prefix, inside, beside):
    """Keys in the folder never appear; every other key matched appears once, cut after its own
    first slash past the prefix; nothing at all when no key lies in the folder."""
    keys = [f"{prefix}/{name}" for name in inside]
    others = set()
    for suffix, nested in beside:
        key = prefix + suffix + ("/x" if nested else "")
        if key.startswith(prefix + "/"):
            continue
        keys.append(key)
        slash = key.find("/", len(prefix))
        others.add(key if slash < 0 else key[: slash + 1])
    got = sibling_matches(prefix, keys)
    assert got == (sorted(others) if inside else [])


def test_expansion_limit_is_exact(monkeypatch):
    """The cap counts exactly: a pattern of MAX_EXPANSION names expands, one more is refused,
    for one range (wherever it starts) and for a product of groups."""
    import loader.uri as uri_module

    monkeypatch.setattr(uri_module, "MAX_EXPANSION", 100)
    assert len(expand_braces("s{1..100}")) == 100
    assert len(expand_braces("s{51..150}")) == 100
    assert len(expand_braces("s{1..10}-{1..10}")) == 100
    for too_many in ("s{1..101}", "s{50..150}", "s{1..10}-{1..11}"):
        with pytest.raises(ConfigError):
            expand_braces(too_many)


def test_zero_padding_follows_the_written_width():
    assert expand_braces("x{0..10}")[:3] == ["x0", "x1", "x2"], "a lone 0 is not padding"
    assert expand_braces("x{-03..-01}") == ["x-03", "x-02", "x-01"]
    assert expand_braces("x{08..10}") == ["x08", "x09", "x10"]


def test_sibling_matches_cuts_nested_keys_at_their_first_folder():
    keys = ["train/imgs/0.jpg", "train/imgs-shards/a/b/c.tar", "train/imgs-shards/a/d.tar"]
    assert sibling_matches("train/imgs", keys) == ["train/imgs-shards/"]


# ------------------------------------------------------------------------------ new bucket names

VALID_BUCKET = st.from_regex(r"[a-z0-9]([a-z0-9]|[.-](?=[a-z0-9])){1,61}[a-z0-9]", fullmatch=True)


@given(VALID_BUCKET)
def test_names_that_follow_s3s_rules_are_accepted(name):
    if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", name):
        assert bucket_name_problem(name) == "it is written like an IP address"
    else:
        assert bucket_name_problem(name) is None and check_bucket_name(name) == name


@given(VALID_BUCKET, st.sampled_from("_A ~/:é"), st.data())
def test_a_character_outside_the_rule_is_named(name, bad, data):
    at = data.draw(st.integers(0, len(name)))
    broken = name[:at] + bad + name[at:]
    problem = bucket_name_problem(broken)
    assert problem is not None and (repr(bad) in problem or "character" in problem), problem


@pytest.mark.parametrize(("name", "problem"), [
    ("ft", "it has 2 character(s)"),
    ("a" * 64, "it has 64 character(s)"),
    ("Bad_Bucket", "it holds 'B', '_'"),
    ("-data", "it starts or ends with '.' or '-'"),
    ("data.", "it starts or ends with '.' or '-'"),
    ("my..data", "it holds '..'"),
    ("192.168.1.10", "it is written like an IP address"),
])
def test_invalid_bucket_names_say_why_and_the_rule(name, problem):
    assert bucket_name_problem(name) == problem
    with pytest.raises(ConfigError, match=rf"^--bucket {re.escape(repr(name))} is not a valid bucket name "
                                          rf"\({re.escape(problem)}\); use 3-63 characters of lowercase "
                                          r"letters, digits, dots and hyphens, starting and ending with a "
                                          r"letter or digit, no '\.\.', not an IP address$"):
        check_bucket_name(name, "--bucket")
