"""A problem the loader reports is said once: with ``on_error="warn"`` as a ``RuntimeWarning``,
with ``"skip"`` as a log line, never both (a warning and a log line both reach the console, so
every message printed twice)."""

from __future__ import annotations

import logging
import warnings

import pytest

from loader import AsyncS3Dataset
from loader.tools.examples import tar_of

from fakes import FakeStore, reusable


def said(caplog, run, needle: str) -> tuple[int, int]:
    """(warnings, log records) that mention ``needle`` while ``run()`` runs."""
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, logger="loader"):
        warnings.simplefilter("always")
        run()
    return (sum(needle in str(w.message) for w in caught),
            sum(needle in r.getMessage() and r.levelno >= logging.WARNING for r in caplog.records))


def truncated_shards() -> FakeStore:
    shards = {f"s/{n}.tar": tar_of({f"k{n}/{i:03d}": {"bin": bytes([i]) * 3000} for i in range(6)})
              for n in range(2)}
    shards["s/1.tar"] = shards["s/1.tar"][: len(shards["s/1.tar"]) // 2 + 100]
    return FakeStore.with_objects("bkt", shards)


@pytest.mark.parametrize("on_error,expected", [("warn", (1, 0)), ("skip", (0, 1))])
def test_a_shard_cut_short_is_said_once(caplog, on_error, expected):
    fake = truncated_shards()
    ds = AsyncS3Dataset.from_shards("s3://bkt/s/{0..1}.tar", store=reusable(fake), on_error=on_error)
    assert said(caplog, lambda: list(ds), "skipping the rest of shard s3://bkt/s/1.tar") == expected


def _fails_on_3(sample):
    if sample["__key__"].endswith("3"):
        raise ValueError("a transform that fails")
    return sample


@pytest.mark.parametrize("on_error,expected", [("warn", (1, 0)), ("skip", (0, 0))])
def test_a_sample_skipped_is_said_once(caplog, on_error, expected):
    fake = FakeStore.with_objects("bkt", {f"t/{i}.bin": b"x" for i in range(6)})
    ds = AsyncS3Dataset.from_keys("bkt", sorted(f"t/{i}.bin" for i in range(6)), store=reusable(fake),
                                  transform=_fails_on_3, on_error=on_error)
    assert said(caplog, lambda: list(ds), "a transform that fails") == expected
