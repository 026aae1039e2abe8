"""``Tuning``: every number the engine's speed rests on beyond the user's limits, in one record,
each with the measurement that set it. Correctness never depends on these values (the tests
pin the behaviour with other values); only the time to the first sample and the CPU per sample do.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tuning:
    """The engine's start-up and hand-over heuristics (``core.EngineCore`` reads them).

    ``first_job_lead_s``: the first job runs alone until its first item, or this long, counted
    from its first wait. Started together, the first GET shared the server and the loop with 63
    others and the first sample came ~20 ms later on loopback. 5 -> 2 ms kept the loopback gain
    and cost less at 20 ms to first byte (bench/results/first-sample-2026-11-28-b.md, "The lead:
    2 ms against 5 ms"); 3 ms counted from the first wait, because obstore builds its client at
    the first request (~5 ms): obstore's first sample at w=0 1.6x -> 1.3-1.5x s3torchconnector's
    (bench/results/first-sample-2026-11-28-c.md); without it the first sample at w=0 on loopback
    took 1.1-2.1x as long (bench/results/engine-first-sample-2026-11-28.md). Not under a schedule
    (its first item may come from another job); 0 turns it off.

    ``handover_s``: after the lead, the loop idles this long (an asyncio sleep: the loop thread
    waits in its selector, GIL released, other callbacks still run) so that the consumer's
    thread, woken by the first item, runs before 63 jobs start and hold the GIL ~10 ms; without
    it the consumer waited out the 5 ms switch interval (take to sample in hand 5.5-8 -> 1.4-3.4
    ms, bench/results/perf-2026-11-28-b.md; a 0.3 ms sleep rather than a zero one,
    first-sample-2026-11-28-c.md). Without it the first sample at w=0 on loopback took 1.1-2.1x
    as long (bench/results/engine-first-sample-2026-11-28.md). 0 turns it off.

    ``gather_items``/``gather_s``: a consumer that waits on the fetch lets items gather for
    ``gather_s`` unless ``gather_items`` are in: each hand-over is a hop between threads (~90 us
    of CPU across both); hops per 1,000 samples ~170 -> ~85, CPU per sample 200 / 365 -> 185 /
    345 us at w=0 / w=2 (bench/results/perf-2026-11-28.md, "What moved the CPU per sample"; not
    resolved on a busy machine, bench/results/engine-2026-11-28.md). Never for the first item,
    a full buffer, nor while no job runs. ``gather_s=0`` turns it off.

    ``ahead_places``: jobs that fetch all they hold before their first item (``Job.reads_ahead``,
    Parquet row groups) may run this many times ``max_inflight`` under interleaved delivery:
    each lane's next job fetches while the lane's job is delivered
    (bench/results/parquet-loopback-readahead-2026-11-27.md, parquet-s3like-readahead-2026-11-27.md).

    ``lane_lookahead``: under interleaved delivery, once the first item is delivered, a lane's
    next job may start (send its request) while the lane's last items are delivered, instead
    of the lane waiting out the server's first byte at every shard: shards w=0 at +20 ms
    5,100-5,600 -> 6,100-7,100 samples/s, loopback +4% (bench/results/shards-2026-11-28-lanes.md;
    w=0 on loopback, against the base: 0.89-0.91x without it, 0.95-1.08x with it,
    bench/results/engine-2026-11-28.md).
    """

    first_job_lead_s: float = 0.003
    handover_s: float = 0.0003
    gather_items: int = 16
    gather_s: float = 0.004
    ahead_places: int = 2
    lane_lookahead: bool = True


TUNING = Tuning()
"""What every engine uses unless it is given another (tests pass their own)."""
