"""Jobs of 2 to 512 processes against one simulated S3 prefix (tests/throttle_sim.py: the
library's own ``ThrottleControl`` for every process, on a simulated clock): the job's total
near the limit, no process starved, few SlowDowns, a rise found; and the two ways a rebuilt
control once failed through the real proxy: a DataLoader worker that starts after the other
meets a token bucket the first one emptied, and one process on a busy machine whose requests
go out late and bunched. Simulated seconds, not wall-clock ones: the table in
docs/design/throttle.md comes from ``python tests/throttle_sim.py``."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
from throttle_sim import SHAPES, Job, Prefix, simulate

from loader.s3.throttle import RISE_FOUND

# in flight per process: enough that the job can send past the prefix's 5,500 GET/s
JOBS = {2: Job(processes=2, concurrency=256), 8: Job(processes=8, concurrency=64),
        64: Job(processes=64, concurrency=16)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("processes", list(JOBS))
def test_a_job_shares_a_prefix(processes, shape):
    rises = SHAPES[shape].rises_after is not None
    r = simulate(JOBS[processes], SHAPES[shape], seconds=40.0 if rises else 20.0)
    assert r.of_limit >= 0.8, r.of_limit  # the job's total near what the prefix allows
    assert r.slowest_vs_mean >= 0.5, r.slowest_vs_mean  # no process starved
    assert r.slowdown_share <= 0.10, r.slowdown_share  # TARGET_SHARE, plus what a probe oversends
    if rises:  # 20 s at the limit, then 20 at twice it
        found = r.rise_found_after()
        assert found is not None and found <= RISE_FOUND, found


# The proxy of bench.tail, simulated: 300 GET/s, two DataLoader workers of 64 requests in flight
# whose batches the DataLoader takes in turn, answers in ~10 ms, a machine so busy that each
# process runs only every 0.1 s (what it has to do waits for then and goes out bunched).
PROXY = dict(concurrency=64, latency=0.01, jitter=0.01, stall=0.1)


@pytest.mark.parametrize("reconnect", [0.0, 0.005], ids=["connection kept", "closing"])
@pytest.mark.parametrize("starts", [0.1, 0.3])
def test_a_worker_that_starts_late_takes_its_share_of_a_token_bucket(starts, reconnect):
    """The second worker starts ``starts`` s after the first and meets the bucket it emptied:
    answered nothing, it waits the full limit out and goes back to its limit (it had fallen to
    what it was answered, nearly nothing: the job at 0.78-0.81x of the limit here, 0.67-0.86x
    through the real proxy, p99 batch waits of 3-4 s)."""
    job = Job(processes=2, samples=1500, starts=starts, reconnect=reconnect, lead=96, **PROXY)
    r = simulate(job, Prefix(rate=300.0, shape="bucket"), seconds=60.0)
    assert r.of_limit >= 0.9, r.of_limit
    assert r.slowdown_share <= 0.10, r.slowdown_share


def test_two_workers_meet_a_sliding_second_near_its_rate():
    """bench.tail's closing sliding second, simulated (300 GET/s, two workers, 1,000 samples;
    five runs, their mean): the first burst fills the second, and a worker that meets the full
    second waits until what it got through has left it, then sends at what got through: 0.79x
    of the limit (0.73x when it grew back from nothing, sending into the closed second)."""
    job = Job(processes=2, samples=500, starts=0.1, reconnect=0.005, lead=96, **PROXY)
    runs = [simulate(job, Prefix(rate=300.0, shape="window"), seconds=60.0, seed=seed) for seed in range(5)]
    assert statistics.fmean(r.of_limit for r in runs) >= 0.74, [r.of_limit for r in runs]
    # most of it the first burst: both workers' 128 requests in flight when it filled the second
    assert max(r.slowdown_share for r in runs) <= 0.20, [r.slowdown_share for r in runs]


@pytest.mark.parametrize("stall", [0.05, 0.1, 0.2])
def test_one_process_on_a_busy_machine_stays_under_a_throttle(stall):
    """integration/test_tail_s3.py's closing token bucket (100 GET/s, 64 requests in flight, 400
    objects) on a machine where the process runs every ``stall`` s: at most its 15 % of GETs
    answered SlowDown (the job's first burst, 64 requests before any answer, is most of them).
    Turns that came due while the loop was away had been voided by every grown limit, so none
    went, the limit grew on, and all went at once: 22-41 % SlowDown here."""
    job = Job(processes=1, samples=400, reconnect=0.005, **dict(PROXY, stall=stall))
    r = simulate(job, Prefix(rate=100.0, shape="bucket"), seconds=60.0)
    assert r.slowdown_share <= 0.15, r.slowdown_share
    assert r.of_limit >= 0.8, r.of_limit


def test_eight_processes_start_into_a_sliding_second_with_fewer_slowdowns():
    """bench.tail's 2 ranks x 4 workers, simulated without the busy machine (300 GET/s as a
    sliding second, 125 samples each, five runs): every process starting with 64 requests in
    flight sent 512 into a second that allows 300 (409-414 SlowDowns in the first second); with
    ``START_WINDOW`` (16) in flight until answers come, 245-303 (32: 308-317). The rate must not
    fall for it: a first cut that measured only what the window let out left a late worker at
    6 GET/s (0.35x of the limit; 0.70-0.72x now, 0.90x with 64 at once)."""
    job = Job(processes=8, samples=125, starts=0.1, reconnect=0.005, lead=96, concurrency=64,
              latency=0.01, jitter=0.01)
    runs = [simulate(job, Prefix(rate=300.0, shape="window"), seconds=60.0, seed=seed) for seed in range(5)]
    first_second = [r.per_second[0][1] for r in runs]
    assert statistics.median(first_second) <= 300, first_second
    assert min(r.of_limit for r in runs) >= 0.65, [r.of_limit for r in runs]


@pytest.mark.parametrize("shape", ["window", "bucket"])
def test_the_next_epochs_workers_start_at_the_limit_the_last_ones_found(shape):
    """The same 8 processes as a later epoch of a job whose DataLoader workers are new every
    epoch (``persistent_workers=False``, the default): each starts at the share of the limit the
    last epoch's workers held (``loader.s3.handoff``: 0.8 x 300 / 8 after a cut, up to 300 / 8),
    not with its start window: 2-4 % of GETs answered SlowDown at 0.79-1.1x of the limit, where
    starting cold sent 22-26 % (sliding second) and 14-16 % (bucket) into SlowDown every epoch. A
    handed limit above the prefix's (the limit fell since) is cut as any other: 6 % / 11 %."""
    prefix = Prefix(rate=300.0, shape=shape)
    job = Job(processes=8, samples=125, starts=0.1, reconnect=0.005, lead=96, concurrency=64,
              latency=0.01, jitter=0.01)
    cold = statistics.median(simulate(job, prefix, seconds=60.0, seed=seed).slowdown_share for seed in range(5))
    for handed in (0.8 * 300 / 8, 300 / 8, 1.5 * 300 / 8):
        runs = [simulate(dataclasses.replace(job, handed=handed), prefix, seconds=60.0, seed=seed)
                for seed in range(5)]
        share = statistics.median(r.slowdown_share for r in runs)
        assert min(r.of_limit for r in runs) >= 0.75, (handed, [r.of_limit for r in runs])
        assert min(r.slowest_vs_mean for r in runs) >= 0.5, (handed, [r.slowest_vs_mean for r in runs])
        if handed <= 300 / 8:  # what the last epoch's workers held
            assert share <= 0.05 and share < cold / 2, (handed, share, cold)
        else:
            assert share < cold, (handed, share, cold)
