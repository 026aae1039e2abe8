"""Unit and property tests for ``loader.retry``: the policy, full-jitter backoff, and the retry loop.

Every async test runs under ``anyio.fail_after`` so a bug shows up as a failure, not a hang. Tests
that count attempts against the deadline pass a fake clock (``clock=``: its time moves when told,
its sleeps are recorded), so they are exact and take no time; one test uses the real clock with
loose bounds.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
import re

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

import loader.retry as retry_module
from loader import retry as contact
from loader.errors import (
    AccessDeniedError,
    BadAnswerError,
    ConfigError,
    EndpointUnreachableError,
    InvalidRangeError,
    NoSuchBucketError,
    NoSuchKeyError,
    StoreError,
    ThrottledError,
    TransientStoreError,
)
from loader.retry import (
    DEFAULT_BASE_DELAY,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_DEADLINE,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_DELAY,
    DEFAULT_READ_TIMEOUT,
    PROGRESS_AFTER,
    PROGRESS_EVERY,
    RetryPolicy,
    backoff_delay,
    call_with_retries,
    gave_up,
    is_transient,
    next_delay,
)
from loader.s3 import error_answers

DEADLINE = 30.0  # seconds any async test may take before it fails instead of hanging (a loaded machine is slow)
FAST = dict(base_delay=0.001, max_delay=0.001)


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Flaky:
    """An attempt that raises ``errors`` in turn, then returns ``value``; counts its calls."""

    def __init__(self, errors=(), value="ok"):
        self.errors = list(errors)
        self.value = value
        self.calls = 0

    async def __call__(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.value


def transient(i=0, cls=TransientStoreError):
    return cls(f"503 SlowDown #{i}", bucket="bkt", key=f"train/{i:06d}.tar")


class FakeClock:
    """A ``loader.retry.Clock`` that only moves when told to; its sleeps are recorded, not slept."""

    def __init__(self):
        self.now = 1000.0
        self.sleeps = []

    def monotonic(self):
        return self.now

    async def sleep(self, seconds):
        self.sleeps.append(seconds)
        await anyio.lowlevel.checkpoint()


@pytest.fixture
def clock():
    return FakeClock()


# ------------------------------------------------------------------------------ RetryPolicy


def test_defaults():
    policy = RetryPolicy()
    assert policy.max_attempts == DEFAULT_MAX_ATTEMPTS
    assert policy.base_delay == DEFAULT_BASE_DELAY
    assert policy.max_delay == DEFAULT_MAX_DELAY
    assert policy.deadline == DEFAULT_DEADLINE
    assert policy.connect_timeout == DEFAULT_CONNECT_TIMEOUT
    assert policy.read_timeout == DEFAULT_READ_TIMEOUT


def test_policy_is_keyword_only_frozen_and_pickles():
    with pytest.raises(TypeError):
        RetryPolicy(3)  # type: ignore[misc]
    policy = RetryPolicy(max_attempts=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_attempts = 4  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(policy)) == policy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 1},
        {"max_attempts": None},
        {"base_delay": 0.0},
        {"max_delay": 0.0},
        {"base_delay": 0, "max_delay": 0},
        {"deadline": math.inf},
        {"deadline": 1e-9, "connect_timeout": 0.001, "read_timeout": 0.001},
    ],
)
def test_valid_edge_policies(kwargs):
    RetryPolicy(**kwargs)


ATTEMPTS_RULE = r"must be at least 1 \(or None: only the deadline limits the retries\)"


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("max_attempts", 0, ATTEMPTS_RULE),
        ("max_attempts", -3, ATTEMPTS_RULE),
        ("max_attempts", 2.5, ATTEMPTS_RULE),
        ("base_delay", -0.001, "must not be negative"),
        ("base_delay", math.nan, "must not be negative"),
        ("max_delay", -1.0, "must not be negative"),
        ("max_delay", math.nan, "must not be negative"),
        ("deadline", 0, "must be positive"),
        ("deadline", -1.0, "must be positive"),
        ("deadline", math.nan, "must be positive"),
        ("connect_timeout", 0.0, "must be positive"),
        ("connect_timeout", math.nan, "must be positive"),
        ("read_timeout", -5, "must be positive"),
    ],
)
def test_invalid_policy_names_the_field_and_value(field, value, rule):
    with pytest.raises(ConfigError, match=rf"^RetryPolicy\.{field}={re.escape(repr(value))} {rule}$"):
        RetryPolicy(**{field: value})


def test_invalid_policy_is_a_value_error():
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


# ------------------------------------------------------------------------------ backoff_delay


policies = st.builds(
    RetryPolicy,
    base_delay=st.floats(0, 10, allow_nan=False),
    max_delay=st.floats(0, 1000, allow_nan=False),
)


@given(attempt=st.integers(0, 200), policy=policies, seed=st.integers(0, 2**64))
def test_backoff_is_within_the_full_jitter_bounds(attempt, policy, seed):
    delay = backoff_delay(attempt, policy, random.Random(seed))
    assert 0.0 <= delay <= min(policy.max_delay, policy.base_delay * 2**attempt)
    assert math.isfinite(delay)


jittered = st.builds(
    RetryPolicy,
    base_delay=st.floats(1e-3, 10, allow_nan=False),
    max_delay=st.floats(1e-3, 1000, allow_nan=False),
)


@given(attempt=st.integers(0, 200), policy=jittered, seed=st.integers(0, 2**64))
def test_backoff_is_deterministic_for_a_seeded_rng(attempt, policy, seed):
    delay = backoff_delay(attempt, policy, random.Random(seed))
    assert delay == backoff_delay(attempt, policy, random.Random(seed))
    assert delay > 0.0, "a positive cap gives a positive jittered delay (almost surely)"


@given(policy=jittered, seed=st.integers(0, 2**64))
def test_backoff_sequence_is_deterministic_for_a_seeded_rng(policy, seed):
    first, second, other = random.Random(seed), random.Random(seed), random.Random(seed + 1)
    sequence = [backoff_delay(n, policy, first) for n in range(20)]
    assert sequence == [backoff_delay(n, policy, second) for n in range(20)]
    # ...and the seed matters: determinism alone would hold for a constant schedule.
    assert sequence != [backoff_delay(n, policy, other) for n in range(20)]
    assert len(set(sequence)) > 1


def test_backoff_is_zero_without_base_delay():
    rng = random.Random(1)
    assert {backoff_delay(n, RetryPolicy(base_delay=0), rng) for n in range(100)} == {0.0}


def test_backoff_uses_the_whole_jitter_range():
    """Full jitter: draws spread over [0, cap), not clustered at the cap (seeded, so exact)."""
    policy = RetryPolicy(base_delay=1.0, max_delay=4.0)
    rng = random.Random(0)
    first = [backoff_delay(0, policy, rng) for _ in range(1000)]
    assert min(first) < 0.05 and max(first) > 0.95 and 0.4 < sum(first) / 1000 < 0.6
    late = [backoff_delay(10, policy, rng) for _ in range(1000)]  # capped at max_delay
    assert max(late) <= 4.0 and max(late) > 3.8 and 1.8 < sum(late) / 1000 < 2.2


def test_backoff_of_a_huge_attempt_number_is_capped():
    assert backoff_delay(10**6, RetryPolicy(max_delay=2.0), random.Random(3)) <= 2.0


def test_is_transient():
    assert is_transient(transient())
    assert is_transient(transient(cls=EndpointUnreachableError))
    for exc in (NoSuchKeyError("x"), AccessDeniedError("x"), StoreError("x"), ValueError(), KeyboardInterrupt()):
        assert not is_transient(exc)


# ------------------------------------------------------------------------------ call_with_retries


@pytest.mark.anyio
async def test_success_on_first_try():
    attempt, retried = Flaky(value=42), []
    with anyio.fail_after(DEADLINE):
        assert await call_with_retries(attempt, RetryPolicy(**FAST), on_retry=retried.append) == 42
    assert attempt.calls == 1 and retried == []


@pytest.mark.anyio
@pytest.mark.parametrize("failures", [1, 2, 5])
async def test_succeeds_after_k_transient_failures(failures):
    errors = [transient(i) for i in range(failures)]
    attempt, retried = Flaky(errors, value=b"payload"), []
    with anyio.fail_after(DEADLINE):
        result = await call_with_retries(
            attempt, RetryPolicy(max_attempts=failures + 1, **FAST), on_retry=retried.append
        )
    assert result == b"payload"
    assert attempt.calls == failures + 1
    assert [str(e) for e in retried] == [f"503 SlowDown #{i}" for i in range(failures)]


@pytest.mark.anyio
@pytest.mark.parametrize("max_attempts", [1, 2, 4])
@pytest.mark.parametrize("cls", [TransientStoreError, EndpointUnreachableError])
async def test_gives_up_after_max_attempts_with_the_same_type(max_attempts, cls):
    errors = [transient(i, cls) for i in range(max_attempts + 3)]
    attempt, retried = Flaky(errors), []
    with anyio.fail_after(DEADLINE):
        with pytest.raises(cls) as info:
            await call_with_retries(attempt, RetryPolicy(max_attempts=max_attempts, **FAST),
                                    on_retry=retried.append)
    err = info.value
    last = max_attempts - 1
    assert type(err) is cls
    assert attempt.calls == max_attempts
    assert len(retried) == max_attempts - 1  # once per retry, not for the final failure
    assert re.match(
        rf"^503 SlowDown #{last}; gave up after {max_attempts} attempt\(s\) over \d+\.\ds "
        rf"\(RetryPolicy\(max_attempts={max_attempts}\) allows no more\)$",
        str(err),
    )
    assert (err.bucket, err.key) == ("bkt", f"train/{last:06d}.tar")
    assert err.__cause__ is not None and str(err.__cause__) == f"503 SlowDown #{last}"
    back = pickle.loads(pickle.dumps(err))  # still intact across a worker boundary
    assert type(back) is cls and (back.bucket, back.key) == (err.bucket, err.key)


@pytest.mark.parametrize("cls", [TransientStoreError, BadAnswerError, ThrottledError, EndpointUnreachableError])
def test_the_endpoint_of_a_transient_error_is_given_once_and_survives_pickling(cls):
    """A DataLoader worker's error reaches the parent pickled: the endpoint that answered stays on
    it, and the final error (``gave_up``) names it."""
    err = cls("503 SlowDown", bucket="bkt", key="k", endpoint="http://127.0.0.1:9000")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == "503 SlowDown"
    assert (back.endpoint, back.bucket, back.key) == ("http://127.0.0.1:9000", "bkt", "k")
    final = pickle.loads(pickle.dumps(gave_up(err, RetryPolicy(max_attempts=2), 2, 0.5)))
    assert type(final) is cls and final.endpoint == "http://127.0.0.1:9000"
    answerer = "" if cls is EndpointUnreachableError else " at http://127.0.0.1:9000"  # it names it itself
    assert str(final).startswith(f"503 SlowDown{answerer}; gave up after 2 attempt(s)")
    assert cls("no endpoint known").endpoint == ""


def test_a_throttles_retry_after_survives_pickling():
    """The seconds a ``Retry-After`` asked for stay on a throttle's error in the parent process."""
    err = ThrottledError("503 SlowDown", bucket="bkt", key="k", endpoint="http://127.0.0.1:9000", retry_after=4.0)
    back = pickle.loads(pickle.dumps(err))
    assert (back.retry_after, back.endpoint, back.key) == (4.0, "http://127.0.0.1:9000", "k")
    assert ThrottledError("503").retry_after is None


@pytest.mark.anyio
@pytest.mark.parametrize(
    "error",
    [
        NoSuchKeyError("no such key", bucket="bkt", key="k"),
        AccessDeniedError("403 Forbidden", bucket="bkt", key="k"),
        NoSuchBucketError("no such bucket", bucket="bkt"),
        InvalidRangeError("bad range", bucket="bkt", key="k"),
        StoreError("plain store error"),
        RuntimeError("a bug in the attempt"),
        KeyError("k"),
    ],
)
async def test_permanent_errors_are_not_retried(error):
    attempt, retried = Flaky([error, transient()]), []
    with anyio.fail_after(DEADLINE):
        with pytest.raises(type(error)) as info:
            await call_with_retries(attempt, RetryPolicy(max_attempts=5, **FAST), on_retry=retried.append)
    assert info.value is error  # re-raised untouched, no "gave up" message
    assert attempt.calls == 1
    assert retried == []


@pytest.mark.anyio
async def test_permanent_error_after_transient_ones_stops_at_once():
    missing = NoSuchKeyError("gone", bucket="bkt", key="k")
    attempt, retried = Flaky([transient(0), transient(1), missing, transient(3)]), []
    with anyio.fail_after(DEADLINE):
        with pytest.raises(NoSuchKeyError) as info:
            await call_with_retries(attempt, RetryPolicy(max_attempts=10, **FAST), on_retry=retried.append)
    assert info.value is missing
    assert attempt.calls == 3 and len(retried) == 2


@pytest.mark.anyio
async def test_on_retry_is_optional():
    attempt = Flaky([transient(0)])
    with anyio.fail_after(DEADLINE):
        assert await call_with_retries(attempt, RetryPolicy(**FAST)) == "ok"
    assert attempt.calls == 2


@pytest.mark.anyio
async def test_an_rng_is_made_only_when_a_retry_happens(monkeypatch, clock):
    """Seeding a ``random.Random()`` from os.urandom costs more than a GET's Python work: a call
    that succeeds at once must not make one; a retried call makes one and reuses it."""
    made = []

    class Counting(random.Random):
        def __init__(self, *args):
            made.append(self)
            super().__init__(*args)

    monkeypatch.setattr(retry_module.random, "Random", Counting)
    policy = RetryPolicy(max_attempts=5, **FAST)
    with anyio.fail_after(DEADLINE):
        for _ in range(3):
            assert await call_with_retries(Flaky(), policy, clock=clock) == "ok"
        assert made == []
        assert await call_with_retries(Flaky([transient(i) for i in range(3)]), policy, clock=clock) == "ok"
    assert len(made) == 1 and len(clock.sleeps) == 3


@pytest.mark.anyio
async def test_sleeps_are_the_seeded_backoff_delays(clock):
    policy = RetryPolicy(max_attempts=6, base_delay=0.5, max_delay=3.0, deadline=1e9)
    attempt = Flaky([transient(i) for i in range(5)])
    with anyio.fail_after(DEADLINE):
        await call_with_retries(attempt, policy, rng=random.Random(1234), clock=clock)
    reference = random.Random(1234)
    assert clock.sleeps == [backoff_delay(n, policy, reference) for n in range(5)]


@pytest.mark.anyio
async def test_a_delay_past_the_deadline_gives_up_without_sleeping(clock):
    """With every draw at the cap (1 s) and a 0.5 s deadline, the first failure is the last."""

    class TopOfRange(random.Random):
        def uniform(self, a, b):
            return b

    attempt, retried = Flaky([transient(i) for i in range(10)]), []
    policy = RetryPolicy(max_attempts=10, base_delay=1.0, max_delay=1.0, deadline=0.5)
    with anyio.fail_after(DEADLINE):
        with pytest.raises(TransientStoreError, match=r"gave up after 1 attempt\(s\) over 0\.0s \(its "
                                                      r"deadline of 0\.5 s would pass before another attempt"):
            await call_with_retries(attempt, policy, on_retry=retried.append, rng=TopOfRange(), clock=clock)
    assert attempt.calls == 1 and retried == [] and clock.sleeps == []


@pytest.mark.anyio
async def test_deadline_counts_time_spent_in_attempts(clock):
    """Each attempt takes 1 s of (fake) time; a 3.5 s deadline allows exactly 4 attempts of 100."""

    async def slow_failure():
        slow_failure.calls += 1
        clock.now += 1.0
        raise transient(slow_failure.calls)

    slow_failure.calls = 0
    retried = []
    policy = RetryPolicy(max_attempts=100, deadline=3.5, **FAST)
    with anyio.fail_after(DEADLINE):
        with pytest.raises(TransientStoreError, match=r"^503 SlowDown #4; gave up after 4 attempt\(s\) over 4\.0s"):
            await call_with_retries(slow_failure, policy, on_retry=retried.append, rng=random.Random(0),
                                    clock=clock)
    assert slow_failure.calls == 4
    assert len(retried) == 3 and len(clock.sleeps) == 3


@pytest.mark.anyio
async def test_deadline_stops_retrying_early_in_real_time():
    async def slow_failure():
        slow_failure.calls += 1
        await anyio.sleep(0.02)
        raise transient(slow_failure.calls)

    slow_failure.calls = 0
    policy = RetryPolicy(max_attempts=1000, deadline=0.1, **FAST)
    with anyio.fail_after(DEADLINE):
        with pytest.raises(TransientStoreError, match=r"gave up after (\d+) attempt\(s\)") as info:
            await call_with_retries(slow_failure, policy)
    n = int(re.search(r"gave up after (\d+)", str(info.value)).group(1))
    assert n == slow_failure.calls
    assert 1 <= n < 20  # stopped by the deadline, far short of max_attempts


@pytest.mark.anyio
async def test_cancellation_during_backoff_propagates():
    """A cancelled caller is not held up by the backoff sleep and gets no store error."""
    attempt, retried = Flaky([transient(i) for i in range(10)]), []
    policy = RetryPolicy(max_attempts=10, base_delay=60.0, max_delay=60.0, deadline=1e6)

    class Late(random.Random):
        def uniform(self, a, b):
            return b  # a 60 s sleep that only cancellation can end

    with anyio.fail_after(DEADLINE):
        with anyio.move_on_after(0.05) as scope:
            await call_with_retries(attempt, policy, on_retry=retried.append, rng=Late())
    assert scope.cancelled_caught
    assert attempt.calls == 1 and len(retried) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("progress", [True, False])
async def test_progress_restarts_the_attempt_count(progress):
    """A call that gets somewhere before failing (a listing page, a resumed stream) starts its
    attempts over: five failures each with progress succeed under max_attempts=2; without
    progress the second failure gives up."""
    calls = 0

    async def attempt():
        nonlocal calls
        calls += 1
        if calls <= 5:
            raise TransientStoreError(f"cut after some progress ({calls})", bucket="b", key="k")
        return "done"

    policy = RetryPolicy(max_attempts=2, base_delay=0)
    if progress:
        assert await call_with_retries(attempt, policy, progressed=lambda: True) == "done"
        assert calls == 6
    else:
        with pytest.raises(TransientStoreError):
            await call_with_retries(attempt, policy, progressed=lambda: False)
        assert calls == 2


# ------------------------------------------------------------------------------ the schedule


def schedule(policy: RetryPolicy, seed: int, durations=()) -> tuple[list[float], float]:
    """When each attempt of a request that always fails starts, and when the policy gives up:
    ``next_delay`` driven as ``call_with_retries`` drives it (attempt ``i`` takes
    ``durations[i]`` seconds, 10 ms beyond the list: a refused connection takes a little time)."""
    rng, now, starts = random.Random(seed), 0.0, []
    while True:
        starts.append(now)
        now += durations[len(starts) - 1] if len(starts) <= len(durations) else 0.01
        delay = next_delay(policy, len(starts), now, rng)
        if delay is None:
            return starts, now
        now += delay


@given(seed=st.integers(0, 2**64))
def test_the_default_policy_rides_out_an_outage_of_a_minute_and_more(seed):
    """A 20 s restart or a 60 s failover: attempts go on for well over a minute (until the
    deadline is near), and one comes within max_delay of the moment the server is back."""
    policy = RetryPolicy()
    starts, gave_up_at = schedule(policy, seed)
    assert policy.max_attempts is None and gave_up_at >= policy.deadline - policy.max_delay > 60
    assert starts[-1] < policy.deadline  # the last attempt starts in time (and may end after it)
    assert all(b - a <= policy.max_delay + 0.01 for a, b in zip(starts, starts[1:]))  # wait + attempt


@given(policy=st.builds(RetryPolicy, max_attempts=st.none() | st.integers(1, 50),
                        base_delay=st.floats(0, 2), max_delay=st.floats(0, 10),
                        deadline=st.floats(0.01, 300)),
       seed=st.integers(0, 2**64), durations=st.lists(st.floats(0.01, 20), max_size=60))
def test_no_attempt_starts_after_the_deadline_nor_past_max_attempts(policy, seed, durations):
    starts, _ = schedule(policy, seed, durations)
    assert all(start < policy.deadline for start in starts)
    if policy.max_attempts is not None:
        assert len(starts) <= policy.max_attempts


@given(attempts=st.integers(1, 20), seed=st.integers(0, 2**64))
def test_max_attempts_still_tightens_the_default(attempts, seed):
    """20 attempts of instant failures wait at most ~71 s together: well inside the deadline, so
    ``max_attempts`` alone decides."""
    starts, _ = schedule(RetryPolicy(max_attempts=attempts), seed)
    assert len(starts) == attempts


# ------------------------------------------------------------------------------ what users read


class MovingClock(FakeClock):
    """A fake clock whose sleeps move it forward, as real ones do."""

    async def sleep(self, seconds):
        self.now += seconds
        await super().sleep(seconds)


@pytest.fixture
def moving(monkeypatch):
    """A ``MovingClock``, and a fresh progress throttle (it is per process); the endpoint of
    these tests has answered before (an outage, not a first contact), and no other has."""
    monkeypatch.setattr(retry_module._Throttle, "last", -math.inf)
    contact.forget()
    contact.answered(ENDPOINT)
    yield MovingClock()
    contact.forget()


ENDPOINT = "http://127.0.0.1:9000"


@pytest.mark.anyio
async def test_a_long_outage_is_reported_in_progress_lines_and_ridden_out(moving, caplog):
    """Eight requests fail together for 40 s (fake time): warning lines name what fails and for
    how long, at most one per PROGRESS_EVERY for the whole process, none for a short blip;
    then every request succeeds under the default policy."""
    back = moving.now + 40.0

    def attempt_of(i):
        async def attempt():
            if moving.now < back:
                raise error_answers.unreachable("http://127.0.0.1:9000", "bkt", f"train/{i:06d}.tar")
            return i
        return attempt

    results = []
    with caplog.at_level("WARNING", logger="loader.retry"), anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for i in range(8):
                async def one(i=i):
                    # seeded: how far the moving clock jumps depends on the jitter drawn, and an
                    # unlucky draw jumped past a progress line (seen once in a suite run)
                    results.append(await call_with_retries(attempt_of(i), RetryPolicy(), clock=moving,
                                                           rng=random.Random(i)))
                tg.start_soon(one)
    assert sorted(results) == list(range(8))
    lines = [r for r in caplog.records if r.name == "loader.retry"]
    assert all(r.levelname == "WARNING" for r in lines)
    assert 40 / PROGRESS_EVERY - 2 <= len(lines) <= 40 / PROGRESS_EVERY + 1
    first = lines[0].getMessage()
    assert re.match(r"still retrying after \d+ s of failures \(attempt \d+; gives up after 120 s, see "
                    r"RetryPolicy\): cannot connect to http://127\.0\.0\.1:9000 for s3://bkt/train/\d{6}\.tar",
                    first), first
    seconds = [int(re.search(r"after (\d+) s", r.getMessage()).group(1)) for r in lines]
    assert seconds[0] >= PROGRESS_AFTER and max(seconds) <= 40


@pytest.mark.anyio
async def test_a_short_blip_logs_nothing(moving, caplog):
    attempt = Flaky([transient(i) for i in range(3)])
    with caplog.at_level("WARNING", logger="loader.retry"), anyio.fail_after(DEADLINE):
        assert await call_with_retries(attempt, RetryPolicy(base_delay=0.1, max_delay=0.5), clock=moving) == "ok"
    assert [r for r in caplog.records if r.name == "loader.retry"] == []


@pytest.mark.anyio
@pytest.mark.parametrize("error", [
    error_answers.failed_mid_request("bkt", "train/000001.jpg", "connection reset"),
    error_answers.unreachable("http://127.0.0.1:9000", "bkt", "train/000001.jpg"),
])
async def test_the_final_error_reads_as_final(moving, error):
    """The message of the error that ends the retries says they are over, nowhere that more
    will come (stores word transient faults without promising a retry)."""
    attempt = Flaky([error] * 100)
    with anyio.fail_after(DEADLINE):
        with pytest.raises(type(error)) as info:
            await call_with_retries(attempt, RetryPolicy(deadline=30), clock=moving)
    message = str(info.value)
    assert "retry" not in message.replace("RetryPolicy", "")
    assert message.startswith(str(error) + "; gave up after ")
    assert re.search(r"over \d+\.\ds \(its deadline of 30 s would pass before another attempt: raise "
                     r"RetryPolicy\(deadline=\.\.\.\) to wait out longer outages\)$", message), message


PROXY = "http://127.0.0.1:8081"  # a proxy in front of the store, say: the endpoint that answers


@pytest.mark.anyio
@pytest.mark.parametrize(("code", "status"), [("InternalError", 500), ("", 502), ("SlowDown", 503)])
async def test_the_final_error_of_error_answers_names_the_endpoint_that_answered(moving, code, status):
    """With several endpoints, or a proxy in front, the bucket and key do not say who answered
    the errors: the final error names the endpoint (the dead-endpoint error names it already)."""
    error = error_answers.error_for_answer(code, status, bucket="bkt", key="train/000001.jpg",
                                           endpoint=PROXY)
    attempt = Flaky([error] * 100)
    with anyio.fail_after(DEADLINE):
        with pytest.raises(type(error)) as info:
            await call_with_retries(attempt, RetryPolicy(deadline=30), clock=moving)
    message = str(info.value)
    assert message.startswith(f"s3://bkt/train/000001.jpg: the server answered {code or status} "
                              f"(HTTP {status}) at {PROXY}; gave up after "), message
    assert message.count(PROXY) == 1 and info.value.endpoint == PROXY
    assert type(info.value) is type(error) and (info.value.bucket, info.value.key) == ("bkt", "train/000001.jpg")


@pytest.mark.anyio
async def test_a_tools_option_is_the_advice_while_the_tool_runs(moving, caplog):
    """Within ``advising(option)`` (the command line's ``--retry-deadline``), the progress lines
    and the final error advise the option, which a shell user can set, not ``RetryPolicy``;
    outside it, the library's words again."""
    error = error_answers.error_for_answer("InternalError", 500, bucket="bkt", key="k", endpoint=ENDPOINT)
    with contact.advising("--retry-deadline"):
        with (caplog.at_level("WARNING", logger="loader.retry"), anyio.fail_after(DEADLINE),
              pytest.raises(TransientStoreError) as info):
            await call_with_retries(Flaky([error] * 1000), RetryPolicy(deadline=30), clock=moving)
        unreachable = error_answers.unreachable("http://127.0.0.1:9", "bkt", "k")
        wrong = contact.wrong_endpoint(unreachable, 3, 4.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "loader.retry"]
    assert lines and all("see --retry-deadline): " in line for line in lines), lines
    message = str(info.value)
    assert message.endswith("(its deadline of 30 s would pass before another attempt: raise it with "
                            "--retry-deadline to wait out longer outages)"), message
    assert "RetryPolicy" not in message and "RetryPolicy" not in "".join(lines)
    assert str(wrong).endswith("retried for up to --retry-deadline.)"), str(wrong)
    after = contact.gave_up(error, RetryPolicy(deadline=30), 2, 1.0)
    assert "raise RetryPolicy(deadline=...) to wait out longer outages" in str(after)


# ------------------------------------------------------------------------------ first contact


@pytest.mark.anyio
@pytest.mark.parametrize("listing", [False, True])
async def test_a_first_contact_that_cannot_connect_fails_in_seconds(moving, listing):
    """Nothing at the endpoint has ever answered: the retries end within FIRST_CONTACT_DEADLINE
    (fake time), not the policy's 120 s, and the error names the endpoint, what was tried and the fix."""
    wrong = "http://127.0.0.1:9"
    attempt = Flaky([error_answers.unreachable(wrong, "bkt", "train/", listing=listing,
                                         reason="Connection refused")] * 1000)
    started = moving.now
    with anyio.fail_after(DEADLINE), pytest.raises(EndpointUnreachableError) as info:
        await call_with_retries(attempt, RetryPolicy(), clock=moving)
    assert moving.now - started <= contact.FIRST_CONTACT_DEADLINE
    assert attempt.calls >= 2  # retried, briefly: a server starting up gets a few seconds
    err = info.value
    assert err.endpoint == wrong and (err.bucket, err.key) == ("bkt", "train/")
    message = str(err)
    assert message.startswith(f"cannot connect to {wrong} for s3://bkt/train/")
    assert "Connection refused" in message and f"{attempt.calls} attempt(s)" in message
    assert "most likely a wrong endpoint" in message and "AWS_ENDPOINT_URL" in message
    assert pickle.loads(pickle.dumps(err)).endpoint == wrong


@pytest.mark.anyio
async def test_an_endpoint_that_answered_once_is_ridden_out(moving):
    """The same failures at an endpoint that has answered are an outage: retried to the deadline."""
    attempt = Flaky([error_answers.unreachable(ENDPOINT, "bkt", "k")] * 1000)
    started = moving.now
    with anyio.fail_after(DEADLINE), pytest.raises(EndpointUnreachableError, match="deadline of 120 s"):
        await call_with_retries(attempt, RetryPolicy(), clock=moving)
    assert moving.now - started > 60


@pytest.mark.anyio
async def test_an_error_answer_counts_as_contact(moving):
    """A 404 (any answer) proves the endpoint right: later connect failures are an outage."""
    elsewhere = "http://127.0.0.1:9001"
    error_answers.error_for_answer("NoSuchKey", 404, bucket="b", key="k", endpoint=elsewhere)
    assert contact.has_answered(elsewhere)
    attempt = Flaky([error_answers.unreachable(elsewhere, "b", "k")] * 20)
    with anyio.fail_after(DEADLINE):
        assert await call_with_retries(attempt, RetryPolicy(**FAST), clock=moving) == "ok"
