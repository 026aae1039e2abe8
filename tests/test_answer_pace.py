"""The pace every answer keeps (``loader.s3.answer_pace``): its limits as pure functions, and the
waits it bounds, which count the time spent waiting for the server, never the reader's own."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.s3.answer_pace import MIN_RATE, AnswerTooSlow, Pace, body_deadline, paced, within

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@settings(deadline=None)
@given(st.floats(0.01, 60), st.integers(0, 1 << 40), st.floats(0, 1e6))
def test_a_body_at_the_least_rate_never_runs_out_of_time(read_timeout, received, waited):
    pace = Pace(read_timeout)
    pace.received, pace.waited = received, waited
    if waited < read_timeout or received >= MIN_RATE * waited:
        assert pace.next_wait() > 0, "a body on pace may always wait for its next byte"
    assert pace.next_wait() + waited >= read_timeout - 1e-9 * (1 + waited), "read_timeout first"
    assert body_deadline(read_timeout, received) >= body_deadline(read_timeout, received // 2)


async def test_the_pace_counts_waiting_for_the_server_not_the_reader():
    pace = Pace(0.3)
    for _ in range(3):
        await paced(pace, asyncio.sleep(0.01))
        pace.received += 100
        await asyncio.sleep(0.15)  # the reader's own time: 0.45 s in all, past read_timeout
    assert await paced(pace, asyncio.sleep(0.05, "on")) == "on"


async def test_a_server_behind_its_pace_fails_with_what_was_due():
    pace = Pace(0.1)
    with pytest.raises(AnswerTooSlow, match=r"bytes/s .* under 16384 bytes/s past RetryPolicy.read_timeout"):
        await paced(pace, asyncio.sleep(5))
    assert 0.1 <= pace.waited < 5


async def test_a_timeout_from_inside_is_not_taken_for_the_deadline():
    async def stalls() -> None:
        raise TimeoutError("the client's own read timeout")

    with pytest.raises(TimeoutError, match="client's own") as info:
        await within(5, stalls(), lambda: AnswerTooSlow("no"))
    assert not isinstance(info.value, AnswerTooSlow)
