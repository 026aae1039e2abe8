"""``loader.s3.answer_checks``: a right answer passes, every altered one fails (pure), and the
retry policy gives a wrong answer a few tries, not the deadline."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.errors import BadAnswerError, ThrottledError
from loader.retry import BAD_ANSWER_ATTEMPTS, Retrying, RetryPolicy
from loader.s3.answer_checks import Asked, asked_for, check_head, check_length, check_listed
from loader.s3.error_answers import clean, error_for_answer, retry_after


def right_answer(size: int, asked: Asked) -> tuple[int, dict[str, str], int]:
    """What S3 answers to ``asked`` for an object of ``size`` bytes: status, headers, length."""
    if not asked.ranged:
        return 200, {"content-length": str(size), "etag": '"e"'}, size
    stop = size if asked.end is None else min(asked.end, size)
    return 206, {"content-length": str(stop - asked.start), "etag": '"e"',
                 "content-range": f"bytes {asked.start}-{stop - 1}/{size}"}, stop - asked.start


requests = st.integers(1, 10_000).flatmap(lambda size: st.tuples(
    st.just(size), st.one_of(st.none(), st.tuples(st.integers(0, size - 1),
                                                   st.one_of(st.none(), st.integers(1, 20_000)))),
    st.booleans(), st.booleans()))


def _asked(size: int, span, known: bool, pinned: bool) -> Asked:
    conditions = {"If-Match": '"e"'} if pinned else None
    if span is None:
        return asked_for(None, conditions, size if known else None)
    start, length = span
    end = None if length is None else start + length
    return asked_for(f"bytes={start}-{'' if end is None else end - 1}", conditions,
                     size if known else None)


@settings(max_examples=300, deadline=None)
@given(request=requests, change=st.sampled_from(["none", "status", "first", "last", "total",
                                                 "length", "etag", "coding", "body"]))
def test_a_right_answer_passes_and_every_altered_one_fails(request, change):
    size, span, known, pinned = request
    asked = _asked(size, span, known, pinned)
    status, headers, length = right_answer(size, asked)
    received = length
    if change == "status":
        status = 200 if status == 206 else 206
    elif change in ("first", "last", "total") and "content-range" in headers:
        first, rest = headers["content-range"][6:].split("-")
        last, total = rest.split("/")
        values = {"first": int(first), "last": int(last), "total": int(total)}
        values[change] += 1
        headers["content-range"] = f"bytes {values['first']}-{values['last']}/{values['total']}"
    elif change == "length":
        headers["content-length"] = str(length + 1)
    elif change == "etag" and pinned:
        del headers["etag"]
    elif change == "coding":
        headers["transfer-encoding"] = "gzip, chunked"
    elif change == "body":
        received = length - 1 if length else 1
    else:
        change = "none"
    unchanged = change == "none" or (change == "total" and not known and asked.end is not None
                                     and asked.end < size)
    if change in ("first", "last", "total") and "content-range" not in headers:
        unchanged = True
    if change == "status" and status == 200 and asked.start == 0 and length == size:
        unchanged = True  # the whole object, to a range that covers it: what was asked for
    try:
        expected = check_head(status, headers.get, asked, "b", "k")
        check_length(received, expected, asked, "b", "k")
    except BadAnswerError as exc:
        assert not unchanged, f"a right answer was refused: {exc}"
        assert "s3://b/k" in str(exc)
        return
    # a Content-Range's total need only be right where the range ends at the object's end
    assert unchanged or (change == "total" and not known), f"{change} passed: {status} {headers}"


def test_a_wrong_answer_is_tried_a_few_times_not_for_the_deadline():
    retrying = Retrying(RetryPolicy(deadline=120), started=None, rng=random.Random(0))
    error = BadAnswerError("s3://b/k: wrong", bucket="b", key="k")
    for _ in range(BAD_ANSWER_ATTEMPTS - 1):
        retrying.failed(error)
    with pytest.raises(BadAnswerError, match="gave up after 3 attempt"):
        retrying.failed(error)


def test_retry_after_is_waited_within_the_policy():
    throttled = error_for_answer("SlowDown", 503, bucket="b", key="k", endpoint="http://e",
                                 headers={"retry-after": "3"}.get)
    assert isinstance(throttled, ThrottledError) and throttled.retry_after == 3
    policy = RetryPolicy(max_delay=2.0, base_delay=0.01)
    assert Retrying(policy, started=None).failed(throttled) == 2.0, "capped by max_delay"
    assert Retrying(RetryPolicy(max_delay=5.0), started=None).failed(throttled) == 3.0


NOW = 1_800_000_000.0  # a moment in 2027, seconds since the epoch


@settings(deadline=None)
@given(st.integers(0, 10**9))
def test_retry_after_in_seconds_is_that_many(seconds):
    assert retry_after(f" {seconds} ", NOW) == seconds


@settings(deadline=None)
@given(st.integers(-10**6, 10**6), st.sampled_from(["GMT", "+0000", "-0000"]))
def test_retry_after_as_an_http_date_is_the_time_until_it(offset, zone):
    import email.utils

    date = email.utils.formatdate(NOW + offset, usegmt=True).replace("GMT", zone)
    assert retry_after(date, NOW) == max(0.0, offset)


@settings(deadline=None, max_examples=300)
@given(st.text(max_size=80))
def test_retry_after_never_raises_and_is_never_negative(text):
    waited = retry_after(text, NOW)
    assert waited is None or waited >= 0
    assert retry_after(None, NOW) is None and retry_after("-5", NOW) is None
    assert retry_after("1.5", NOW) is None and retry_after("١٠", NOW) is None


def test_server_codes_are_cleaned_capped_and_a_redirect_names_the_region():
    error = error_for_answer("Bad\x1b[31mCode" + "x" * 60_000, 400, bucket="b", key="k",
                             endpoint="http://e")
    assert "\x1b" not in str(error) and len(str(error)) < 300
    moved = error_for_answer("PermanentRedirect", 301, bucket="b", key="k", endpoint="http://e",
                             headers={"x-amz-bucket-region": "eu-west-1"}.get)
    assert "AWS_REGION=eu-west-1" in str(moved)
    assert clean("a\x00b\nc") == "a b c"
    timeout = error_for_answer("", 408, bucket="b", key="k", endpoint="http://e")
    assert type(timeout).__name__ == "TransientStoreError", "a 408 is tried again"


def test_a_200_to_a_range_is_the_whole_object_only_where_its_content_range_agrees():
    """A 200 of one byte to ``bytes=0-0`` reads as a one-byte object, unless the Content-Range
    beside it says the object has two: then it is half an object, not the whole."""
    asked = asked_for("bytes=0-0", None, None)
    headers = {"content-length": "1", "content-range": "bytes 0-0/2"}
    with pytest.raises(BadAnswerError, match="Content-Range of 2 bytes in all"):
        check_head(200, headers.get, asked, "b", "k")
    assert check_head(200, {"content-length": "1"}.get, asked, "b", "k") in (None, 1)


etags = st.one_of(st.none(), st.sampled_from(["e", '"e"', 'W/"e"', "f", '"f"']))


@settings(deadline=None)
@given(st.integers(0, 2000), st.integers(0, 2000), etags, etags)
def test_a_whole_read_is_the_listed_size_unless_it_is_another_version(length, size, answer, listed):
    """The listed version (the same ETag, however quoted) must be the listed size; another ETag
    is a version written since; with no ETag listed nothing tells them apart, so any length passes."""
    def bare(tag):
        return None if tag is None else tag.removeprefix("W/").strip('"')

    refused = length != size and bare(listed) is not None and bare(answer) in (None, bare(listed))
    if refused:
        with pytest.raises(BadAnswerError, match=rf"s3://b/k: .*\(listed size {size:,}\)\): {length:,} bytes"):
            check_listed(length, answer, size, listed, "b", "k")
    else:
        check_listed(length, answer, size, listed, "b", "k")
