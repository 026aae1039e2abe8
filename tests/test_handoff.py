"""The limit a DataLoader's workers found, handed to its next epoch's workers (``loader.s3.handoff``):
written by the store wrapper after answers while limited, at most once per window, read back as
each new worker's share of their sum, held for the DataLoader's process and gone with it."""

from __future__ import annotations

import asyncio
import math
import os

import pytest

from loader import topology
from loader.errors import ThrottledError
from loader.listing import nodeshare
from loader.s3 import handoff, throttle
from loader.s3.throttle import RATE_WINDOW, ThrottleControl, ThrottledStore


@pytest.fixture
def worker(monkeypatch, share_dir):
    """As if inside worker 0 of 4 of a DataLoader run by this process (one rank)."""
    monkeypatch.setattr(topology, "in_worker", lambda: True)
    monkeypatch.setattr(topology, "parent_pid", lambda: os.getpid())
    monkeypatch.setattr(topology, "worker", lambda: (0, 4))
    return share_dir


def test_outside_a_dataloader_worker_nothing_is_handed(share_dir):
    assert handoff.for_this_process("http://s3", "bucket", every=RATE_WINDOW) is None
    assert throttle.control_for("http://s3", "bucket").rate is None


def test_the_workers_limits_are_summed_and_read_as_each_workers_share(tmp_path):
    now = [0.0]
    base = tmp_path / "limit"
    first = handoff.Handoff(base, worker=0, workers=2, every=1.0, clock=lambda: now[0])
    second = handoff.Handoff(base, worker=1, workers=2, every=1.0, clock=lambda: now[0])
    assert first.read() is None  # nothing found yet
    first.note(None)  # no limit: nothing to hand on
    assert not list(tmp_path.iterdir())
    first.note(100.0)  # alone for a while, it held the whole limit
    assert second.read() == 50.0  # a worker that starts late takes its share of it
    second.note(40.0)
    now[0] = 0.5
    first.note(60.0)  # within the window: not yet
    assert first.read() == 70.0
    now[0] = 1.0
    first.note(60.0)
    assert first.read() == second.read() == 50.0  # the next epoch's: half of 60 + 40 each
    assert handoff.Handoff(base, worker=0, workers=4, every=1.0).read() == 25.0  # more workers: each less
    # a DataLoader with fewer workers than wrote does not read the ids it no longer has
    assert handoff.Handoff(base, worker=0, workers=1, every=1.0).read() == 60.0


@pytest.mark.parametrize("text", ["", "nan", "inf", "-3", "0", "thirty"])
def test_a_file_that_says_no_usable_limit_hands_none(tmp_path, text):
    (tmp_path / "limit.w0.rate").write_text(text)
    assert handoff.Handoff(tmp_path / "limit", worker=0, workers=2, every=1.0).read() is None


def test_a_workers_control_starts_at_the_limit_the_last_epochs_workers_wrote(worker):
    first = throttle.control_for("http://s3", "bucket")
    assert first.rate is None and first.handoff is not None  # the first epoch: nothing known
    first.handoff.note(None)
    assert not os.listdir(worker)  # a worker never limited leaves nothing on the machine
    first.handoff.note(100.0)  # worker 0 of 4 found 100/s
    throttle.CONTROLS.by_key = {}  # the next epoch's worker: a new process
    second = throttle.control_for("http://s3", "bucket")
    assert second.rate == second.known == 25.0  # limited from its first request, at its share
    assert throttle.control_for("http://s3", "other").rate is None  # another bucket: its own
    # held for the DataLoader's process: gone when it exits
    names = sorted(os.listdir(worker))
    assert any(n.endswith(".rate") for n in names) and any(".h" in n for n in names), names
    nodeshare.release(nodeshare.process_ident(os.getpid()))
    assert not any(n.endswith(".rate") for n in os.listdir(worker))


def test_a_handed_limit_paces_from_the_first_request_and_probes_up():
    now = [100.0]
    control = ThrottleControl(lambda: now[0], window=64, limit=10.0)
    turns = [control.turn() for _ in range(30)]  # 3 s of turns at 10/s
    assert [t.due - 100.0 for t in turns[:4]] == pytest.approx([0.0, 0.1, 0.2, 0.3])  # paced, no burst
    assert control.congested()  # a limited process does not hedge into its limit
    now[0] = 101.5
    for t in turns:
        if control.take(t):
            control.on_answer(t.generation)  # 16 taken and answered well
    now[0] = 102.0
    control.turn()
    assert control.rate is not None and control.rate > 10.0  # held back and answered well: it probed up


class Answers:
    """A store whose reads are answered SlowDown while ``throttled`` is set."""

    _endpoint = "http://answers"

    def __init__(self) -> None:
        self.throttled = False

    async def get(self, bucket, key, *, pin=None):
        if self.throttled:
            raise ThrottledError(f"s3://{bucket}/{key}: SlowDown")
        return b"x"


def test_the_store_wrapper_hands_on_what_its_control_holds(worker):
    inner = Answers()
    store = ThrottledStore(inner)

    async def read(n):
        for i in range(n):
            try:
                await store.get("bucket", f"k{i}")
            except ThrottledError:
                pass

    asyncio.run(read(3))
    control = store.control("bucket")
    assert control.rate is None  # answered well: no limit to hand on
    assert not any(n.endswith(".rate") for n in os.listdir(worker))
    inner.throttled = True
    asyncio.run(read(4))  # SlowDowns: the control cuts ...
    assert control.rate is not None
    (path,) = [worker / n for n in os.listdir(worker) if n.endswith(".rate")]
    # ... and the limit it held then is handed on; once in the window
    written = float(path.read_text())
    assert path.name.endswith(".w0.rate") and written == control.handoff.written
    assert math.isfinite(written) and written >= throttle.MIN_RATE


def test_a_limit_growing_back_after_a_full_one_is_handed_on_as_what_gets_through(worker):
    """Just after a full limit's cut the rate is near nothing while the control grows back fast
    to what it knows gets through: the next epoch starts at the latter."""
    control = throttle.control_for("http://s3", "bucket")
    control.rate, control.known = 1.0, 40.0
    throttle._hand_on(control)
    assert control.handoff.written == 40.0
