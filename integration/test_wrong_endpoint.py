"""A mistyped endpoint (nothing listening there) fails within seconds with the fix named, in
every entry point: the CLI, an iterable dataset with ``num_workers=0`` and 2, the map dataset,
``from_keys`` (no listing: the engine's GETs), both backends. The limit is
``loader.retry.FIRST_CONTACT_DEADLINE`` (tests/test_retry.py holds the retry loop to it on a fake
clock); here the errors must be the first-contact one, after a handful of attempts where riding
out the deadline took ~50. An endpoint that has answered is ridden out (tests/test_retry.py).

The command line keeps the defaults (a shell user's mistyped ``AWS_ENDPOINT_URL``: the default
policy gives up after the first-contact deadline); the datasets set a 1 s ``RetryPolicy`` deadline,
as a user may (``store=Store(retry=...)``, which reaches the DataLoader's workers with the
dataset): the first contact gives up at the shorter of the two, with the same error, so they prove
the same without waiting out 5 s each.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
import traceback

import pytest
from test_cli_s3 import REPO, cli_env, loader_cmd
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, AsyncS3MapDataset, EndpointUnreachableError, RetryPolicy, Store
from loader import retry as contact

MAX_ATTEMPTS = 20  # full-jitter backoff makes ~8-12 attempts in FIRST_CONTACT_DEADLINE
HANG_GUARD = 90  # seconds: only a guard against a hang (the old behaviour took 120-235 s)
QUICK = RetryPolicy(deadline=1.0)  # the datasets' first contact gives up after 1 s, not 5
TRIED = re.compile(r"gave up after (\d+) attempt\(s\) over (\d+\.\d)s: nothing at (\S+) has answered")


def closed_port() -> int:
    """A port on 127.0.0.1 with nothing listening (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def wrong(s3_server):
    """A config whose endpoint is a closed port on loopback, in a process that has not talked to it."""
    endpoint = f"http://127.0.0.1:{closed_port()}"
    contact.forget()
    yield endpoint, dataclasses.replace(s3_server.config, endpoint_url=endpoint)
    contact.forget()


def assert_fast_and_named(message: str, endpoint: str) -> None:
    match = TRIED.search(message)
    assert match, message
    attempts, seconds, named = int(match.group(1)), float(match.group(2)), match.group(3)
    assert named == endpoint
    # a handful of attempts, where riding out the 120 s deadline took ~50; how long they took is
    # the library's own report (FIRST_CONTACT_DEADLINE, plus one attempt), not asserted here
    assert 2 <= attempts <= MAX_ATTEMPTS and seconds > 0
    assert "AWS_ENDPOINT_URL" in message and "wrong endpoint" in message


def test_the_cli_names_the_wrong_endpoint(s3_server, wrong):
    endpoint, _ = wrong
    proc = subprocess.run(loader_cmd("ls", "s3://train/objects/"), capture_output=True, text=True,
                          timeout=HANG_GUARD, cwd=REPO, env=cli_env(s3_server, AWS_ENDPOINT_URL=endpoint))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert_fast_and_named(lines[0], endpoint)


def drop(info: pytest.ExceptionInfo) -> None:
    """Let go of a DataLoader's error now: its traceback's frames hold the iterator (and torch's
    ``reraise`` frame the error itself, a cycle), so the iterator would end its workers only when
    a garbage collection found it, and torch finalized there waits 5 s for each. Cleared, it
    ends them at once, as a script dropping the error does."""
    traceback.clear_frames(info.tb)


@pytest.mark.parametrize("store", ["aioboto3", "obstore"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_dataset_names_the_wrong_endpoint(wrong, store, num_workers):
    endpoint, config = wrong
    dataset = AsyncS3Dataset.from_prefix("s3://train/objects/", config=config, store=Store(backend=store, retry=QUICK))
    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)
    with pytest.raises(EndpointUnreachableError) as info:
        next(iter(loader))
    message = str(info.value)
    drop(info)
    assert_fast_and_named(message, endpoint)


@pytest.mark.parametrize("store", ["aioboto3", "obstore"])
def test_the_engine_gets_name_the_wrong_endpoint(wrong, store):
    """No listing at all (a key list): the first GETs are the first contact."""
    endpoint, config = wrong
    dataset = AsyncS3Dataset.from_keys("train", [f"objects/{i:04d}.bin" for i in range(8)], config=config,
                                       store=Store(backend=store, retry=QUICK))
    with pytest.raises(EndpointUnreachableError) as info:
        next(iter(dataset))
    assert_fast_and_named(str(info.value), endpoint)


def test_the_map_dataset_names_the_wrong_endpoint(wrong):
    endpoint, config = wrong
    with pytest.raises(EndpointUnreachableError) as info:
        dataset = AsyncS3MapDataset.from_keys("train", ["objects/0000.bin"], config=config, store=Store(retry=QUICK))
        dataset[0]
    assert_fast_and_named(str(info.value), endpoint)


@pytest.mark.parametrize("entry", ["from_prefix", "from_shards", "from_parquet"])
def test_forked_workers_report_the_listings_error_without_the_library_frames_under_it(wrong, entry):
    """With ``num_workers=2`` the listing runs in this process just before the workers fork,
    and each worker raises its error; the DataLoader prints the worker's traceback into the
    message. It holds the error's advice, and only frames of the loader and torch, not the
    refused connection deep in the HTTP library that the error was made from."""
    endpoint, config = wrong
    dataset = getattr(AsyncS3Dataset, entry)(f"s3://train/{entry}/", config=config, store=Store(retry=QUICK))
    with pytest.raises(EndpointUnreachableError) as info:
        next(iter(DataLoader(dataset, batch_size=None, num_workers=2)))
    message = str(info.value)
    drop(info)
    assert_fast_and_named(message, endpoint)
    assert "no worker listed again" in message
    frames = re.findall(r'File "([^"]+)"', message)
    assert frames and all("/loader/" in path or "/torch/" in path for path in frames), frames


def test_forked_workers_report_the_engines_error_without_the_connection_frames_under_it(wrong):
    """``from_keys`` with ``num_workers=2``: no listing, each worker's own GETs fail to connect.
    The message the DataLoader builds from the worker's traceback leads with the package's frames
    and errors, not asyncio's frames and ``OSError`` of the refused connect they were made from;
    the reason (refused, and where) stays in the error's text."""
    endpoint, config = wrong
    dataset = AsyncS3Dataset.from_keys("train", [f"objects/{i:04d}.bin" for i in range(8)], config=config,
                                       store=Store(retry=QUICK))
    with pytest.raises(EndpointUnreachableError) as info:
        next(iter(DataLoader(dataset, batch_size=None, num_workers=2)))
    message = str(info.value)
    drop(info)
    assert_fast_and_named(message, endpoint)
    assert f"Connection refused at {endpoint.removeprefix('http://')}" in message, message
    frames = re.findall(r'File "([^"]+)"', message)
    assert frames and not [path for path in frames if "/asyncio/" in path], frames
    raised = re.findall(r"^(\w[\w.]*(?:Error|Failed)): ", message, re.MULTILINE)
    assert raised and all(name.startswith("loader.") for name in raised), raised
