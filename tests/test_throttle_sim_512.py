"""A job of 512 processes (16 requests in flight each, ~11 GET/s each once shared) against one
simulated S3 prefix, each shape of limit (tests/throttle_sim.py): the total near the limit, no
process starved, at most 10 % of GETs answered SlowDown once the job's first burst is past (8,192
requests sent before any answer, against 5,500 a second: that burst and
its aftermath put the share at 9-13 % over 40 s, docs/design/throttle.md). A file of its own: each run is
the suite's longest simulation, and the suite's workers take whole files."""

from __future__ import annotations

import pytest
from throttle_sim import Job, Prefix, simulate

from loader.s3.throttle import RISE_FOUND

SHAPES = {
    "sliding second": Prefix(shape="window"),
    "token bucket": Prefix(shape="bucket"),
    "doubles after 10 s": Prefix(shape="window", rises_after=10.0),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_512_processes_share_a_prefix(shape):
    r = simulate(Job(processes=512, concurrency=16), SHAPES[shape], seconds=30.0)
    assert r.of_limit >= 0.8, r.of_limit
    assert r.slowest_vs_mean >= 0.5, r.slowest_vs_mean
    assert r.slowdown_share_after(2) <= 0.10, (r.slowdown_share, r.slowdown_share_after(2))
    if SHAPES[shape].rises_after is not None:
        found = r.rise_found_after()
        assert found is not None and found <= RISE_FOUND, found
