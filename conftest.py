"""Fixtures shared by ``tests/`` and ``integration/``."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections.abc import Iterator

import pytest
from hypothesis import settings

# No hypothesis deadlines anywhere: how long one example takes says nothing about its correctness,
# and a busy machine (or the first example's imports) made a quick one fail (DeadlineExceeded).
# A test's own @settings(...) inherits this, so a test that forgets deadline=None is covered too.
settings.register_profile("loader", deadline=None)
settings.load_profile("loader")


@pytest.fixture(autouse=True, scope="session")
def aws_profiles_of_our_own() -> Iterator[None]:
    """Keep the developer's ``~/.aws`` and any cloud metadata service out of every test.

    The credential chain reads the shared credentials and config files and, last, asks the
    instance metadata service, whose address is not on this machine. Tests (and the servers and
    CLIs they start, which inherit the environment) see empty profile files in a temporary
    directory and the metadata service switched off, as a user off EC2 would set it. Tests that
    need a profile or the metadata lookup set these variables themselves.
    """
    with tempfile.TemporaryDirectory(prefix="aws-profiles-") as home, pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.path.join(home, "credentials"))
        mp.setenv("AWS_CONFIG_FILE", os.path.join(home, "config"))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
            mp.delenv(name, raising=False)
        yield


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` in the main thread during the test.

    A process started in the background by a non-interactive shell inherits SIGINT ignored,
    and Python then installs no handler of its own: a test that sends itself SIGINT would see
    nothing happen. This puts Python's default handler in place and restores what was there.
    """
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves a thread of ours running after it returns."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    for thread in leaked:
        thread.join(timeout=5)
    leaked = [t.name for t in leaked if t.is_alive()]
    assert not leaked, f"threads left running: {leaked}"


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> int:
    """Lower the floor of ``part_size`` (1 MiB for users) to 1 KiB for this test, so that test
    shards of a few KiB are read as many ranged parts; returns the floor in force."""
    from loader.formats import shards

    monkeypatch.setattr(shards, "MIN_PART_SIZE", 1024)
    return shards.MIN_PART_SIZE
