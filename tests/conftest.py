"""Unit-test helpers live in ``fakes.py`` (importable by name); the fixtures shared with
``integration/`` (``no_leaked_threads``, ``sigint_raises``) are in the repository's ``conftest.py``."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def fresh_throttle_controls(monkeypatch):
    """Each test starts as a new process does: no rate limit learned and no start window grown by
    the tests that ran before it in this worker (the fakes share one endpoint and bucket name, and
    the controls are per process), so what a test sees does not hang on the order tests ran in."""
    from loader.s3 import throttle

    monkeypatch.setattr(throttle.CONTROLS, "by_key", {})


@pytest.fixture
def share_dir(tmp_path, monkeypatch):
    """A machine's key-list directory of its own (``$LOADER_SHARE_DIR``); what this process
    still holds there is released at the end."""
    from loader.listing import nodeshare

    where = tmp_path / "node-a"
    where.mkdir()
    monkeypatch.setenv(nodeshare.SHARE_DIR_ENV, str(where))
    yield where
    nodeshare.release(nodeshare.process_ident(os.getpid()))
