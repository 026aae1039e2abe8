"""Resources end to end on a real S3 server: what an iteration leaves behind, secrets, memory.

* **Nothing survives an iteration**, however it ends (exhausted, ``break``, an exception from
  ``transform``, ``del`` of a half-read iterator), for both backends and both modes: no thread of
  ours (``loader-*``, anyio portals, asyncio executor threads), no extra file descriptors or
  sockets (``psutil``, compared with the same process before, after a warm-up pass that creates
  what lives for the whole process, such as obstore's Rust runtime), no live engine. Each ending
  runs three times, so a leak of one descriptor per pass exceeds the slack.
* **Secrets** never show: a recognisable secret (the embedded server's, set by us) is looked for
  in DEBUG logs of ``loader``/``botocore``/``aiobotocore``/``aiohttp`` (main process *and* forked
  DataLoader workers, through a file handler they inherit), in errors from failing requests with
  their whole ``__cause__`` chain, in reprs of dataset, options and config, in the command line of
  every child process (workers, ``weed``) and in the server's environment and log.
* **A slow consumer bounds memory**: ~1 GB of 5 MB objects passes a consumer that sleeps per
  sample; the peak RSS of the iterating process stays under ``queue_bytes`` + in-flight objects +
  a stated slack (numbers printed with ``pytest -s``).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, NamedTuple

import psutil
import pytest
from torch.utils.data import DataLoader

from loader import AccessDeniedError, AsyncS3Dataset, ConfigError, Limits, NoSuchBucketError, S3Config, SampleError
from loader.engine.fetch import live_engines

from datasets import jpeg_dataset, sha256, upload_objects
from s3servers import S3_VARS
from shardsets import upload_shards

BACKENDS = ("aioboto3", "obstore")
MODES = ("objects", "shards")
ENDINGS = ("exhausted", "break", "exception", "del")
REPEATS = 3
FD_SLACK = 2  # descriptors that may come and go on their own (e.g. a lazily opened /dev/urandom)
SOCKET_SLACK = 0
SETTLE_S = 5.0

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def data(s3_server):
    bucket = s3_server.new_bucket("res")
    objects = jpeg_dataset(s3_server.minio, bucket, "objects/", 120, seed=41)
    samples, _ = upload_shards(s3_server.minio, bucket, "shards/shard-", [60] * 4, payload=3000, seed=42)
    return bucket, objects, samples


def make_dataset(mode: str, bucket: str, config, store: str, **options) -> AsyncS3Dataset:
    if mode == "objects":
        return AsyncS3Dataset.from_prefix(f"s3://{bucket}/objects/", config=config, store=store,
                                          limits=Limits(concurrency=16), **options)
    return AsyncS3Dataset.from_shards(f"s3://{bucket}/shards/", config=config, store=store, **options)


# ------------------------------------------------------------------------------ leftovers


class Snapshot(NamedTuple):
    fds: int
    sockets: int
    threads: dict[int, str]  # ident -> name


def snapshot() -> Snapshot:
    proc = psutil.Process()
    return Snapshot(proc.num_fds(), len(proc.net_connections(kind="all")),
                    {t.ident: t.name for t in threading.enumerate() if t.is_alive()})


def ours(name: str) -> bool:
    """Threads the loader starts: its loop threads, anyio portals, asyncio's executor threads."""
    return name.startswith(("loader-", "asyncio_")) or "-portal-" in name


def leftovers(before: Snapshot) -> list[str]:
    """What is still there that was not before (empty when clean)."""
    now = snapshot()
    found = [f"thread {name!r}" for ident, name in now.threads.items()
             if ident not in before.threads or ours(name)]
    if now.fds > before.fds + FD_SLACK:
        found.append(f"{now.fds - before.fds} more open file descriptors ({before.fds} -> {now.fds})")
    if now.sockets > before.sockets + SOCKET_SLACK:
        found.append(f"{now.sockets - before.sockets} more sockets ({before.sockets} -> {now.sockets})")
    return found


def settled(before: Snapshot) -> list[str]:
    """``leftovers`` after up to ``SETTLE_S`` for connections closed by another thread to go."""
    deadline = time.monotonic() + SETTLE_S
    while (found := leftovers(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


class Boom:
    """A transform that raises on the 10th sample it sees."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, sample: dict[str, Any]) -> Any:
        self.seen += 1
        if self.seen == 10:
            raise ValueError("transform failed on purpose")
        return sample


def end_iteration(dataset: AsyncS3Dataset, ending: str) -> None:
    if ending == "exhausted":
        assert sum(1 for _ in dataset) > 0
    elif ending == "break":
        for number, _ in enumerate(dataset):
            if number == 5:
                break
    elif ending == "exception":
        with pytest.raises(SampleError, match="transform failed on purpose") as info:
            for _ in dataset:
                pass
        assert isinstance(info.value.__cause__, ValueError)
    else:
        iterator = iter(dataset)
        next(iterator)
        next(iterator)
        del iterator


_warmed: set[tuple[str, str]] = set()


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("store", BACKENDS)
def test_an_ended_iteration_leaves_nothing_behind(s3_server, data, store, mode, ending):
    bucket, _, _ = data
    transform = Boom() if ending == "exception" else None
    dataset = make_dataset(mode, bucket, s3_server.config, store, transform=transform)
    dataset.resolve()
    if (store, mode) not in _warmed:  # what lives as long as the process (imports, runtimes)
        _warmed.add((store, mode))
        list(make_dataset(mode, bucket, s3_server.config, store))
    gc.collect()
    before = snapshot()
    assert not [name for name in before.threads.values() if ours(name)], before.threads
    for repeat in range(REPEATS):
        if transform is not None:
            transform.seen = 0
        end_iteration(dataset, ending)
        assert live_engines() == 0, f"pass {repeat + 1}: an engine is still running"
        running = [t.name for t in threading.enumerate() if ours(t.name)]
        assert not running, f"pass {repeat + 1}: threads of ours still running: {running}"
    found = settled(before)
    assert not found, f"after {REPEATS} passes ending by {ending}: {found}"


# ------------------------------------------------------------------------------ secrets


SECRET_LOGGERS = ("loader", "botocore", "aiobotocore", "aiohttp", "urllib3", "s3transfer")


@pytest.fixture
def canary_server(tmp_path):
    """The embedded server with credentials we chose: a secret we can recognise anywhere."""
    from loader.tools.devserver import DevServer

    secret = "CanarySecret-" + secrets.token_hex(12)
    root = tmp_path / "canary"
    root.mkdir(mode=0o700)
    identities = {"identities": [{
        "name": "canary", "credentials": [{"accessKey": "CANARYACCESSKEY0001", "secretKey": secret}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}
    (root / "s3-identities.json").write_text(json.dumps(identities))
    os.chmod(root / "s3-identities.json", 0o600)
    try:
        server = DevServer(data_dir=root, buckets=["canary"]).start()
    except ConfigError as exc:
        pytest.fail(f"the embedded SeaweedFS (a test dependency) did not start: {exc}")
    try:
        assert server.config.secret_access_key == secret, "DevServer did not keep our identities file"
        yield server, secret
    finally:
        server.stop()


def test_the_secret_appears_nowhere(canary_server, monkeypatch, caplog, tmp_path):
    from torch.utils.data import _utils

    from s3servers import minio_client

    # after a worker raised, torch waits this long per worker before ending them (see
    # test_reliability.py's quick_worker_exit)
    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.5)
    server, secret = canary_server
    minio = minio_client(server.config)
    keys = jpeg_dataset(minio, "canary", "data/", 40, seed=43)
    minio._http.clear()
    for name in S3_VARS:  # configured the way users do: from the environment
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)

    texts: dict[str, str] = {}  # where -> text that must not hold the secret
    log_file = tmp_path / "workers.log"
    handler = logging.FileHandler(log_file)  # forked workers inherit it: their records land here
    handler.setFormatter(logging.Formatter("%(process)d %(name)s %(levelname)s %(message)s"))
    handler.setLevel(logging.DEBUG)
    logging.getLogger().addHandler(handler)
    for name in SECRET_LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name)
    caplog.set_level(logging.INFO, logger="loader.stats")  # the workers' stats lines too
    try:
        # 1. an epoch with two forked workers; every child's argv read while they run (the parent
        # lists before it forks them: the workers' own records are their stats lines)
        dataset = AsyncS3Dataset.from_prefix("s3://canary/data/", shuffle=True, limits=Limits(concurrency=8))
        argv: dict[int, list[str]] = {}
        got = []
        for number, sample in enumerate(DataLoader(dataset, batch_size=None, num_workers=2,
                                                   multiprocessing_context="fork", timeout=60)):
            got.append(sample["__url__"])
            if number == 5:
                for child in psutil.Process().children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        argv[child.pid] = child.cmdline()
        assert sorted(got) == sorted(f"s3://canary/{key}" for key in keys)
        assert len([a for a in argv.values() if a and "weed" not in a[0]]) >= 2, argv

        # 2. in-process epochs with both backends (their DEBUG records go to caplog)
        for store in ("aioboto3", "obstore"):
            in_process = AsyncS3Dataset.from_prefix("s3://canary/data/", store=store)
            assert len(list(in_process)) == len(keys)
            texts[f"repr/str of the {store} dataset"] = f"{in_process!r} {in_process} {vars(in_process)!r}"
            texts[f"{store} options, config, stats"] = (
                f"{in_process.options!r} {in_process.options.config!r} {in_process.options.config} "
                f"{in_process.options.store.retry!r} {in_process.stats()!r}")

        # 3. failing requests: the whole chain of causes, as a traceback prints it
        for store in ("aioboto3", "obstore"):
            missing = AsyncS3Dataset.from_keys("no-such-bucket-canary", ["x.jpg"], store=store)
            with pytest.raises(NoSuchBucketError) as info:
                list(missing)
            texts[f"wrong bucket, {store}"] = "".join(traceback.format_exception(info.value))
            unknown = S3Config(endpoint_url=server.endpoint_url, access_key_id="NOSUCHACCESSKEY",
                               secret_access_key=secret)
            wrong = AsyncS3Dataset.from_keys("canary", [sorted(keys)[0]], store=store, config=unknown)
            with pytest.raises(AccessDeniedError) as info:
                list(wrong)
            texts[f"unknown access key, {store}"] = "".join(traceback.format_exception(info.value))
        # ... and raised in a worker: torch re-raises it with the worker's traceback as text
        missing = AsyncS3Dataset.from_keys("no-such-bucket-canary", ["x.jpg", "y.jpg"])
        with pytest.raises(NoSuchBucketError) as info:
            list(DataLoader(missing, batch_size=None, num_workers=2, multiprocessing_context="fork",
                            timeout=60))
        assert "DataLoader worker" in str(info.value)
        texts["wrong bucket, raised in a worker"] = "".join(traceback.format_exception(info.value))
        del info
        gc.collect()  # ends the failed DataLoader's workers now, under the shortened wait below
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()

    worker_log = log_file.read_text()
    texts["DEBUG log of the main process (caplog)"] = caplog.text + "".join(
        f"{record.getMessage()} {record.args!r}" for record in caplog.records)
    texts["DEBUG log of the DataLoader workers"] = worker_log
    for pid, args in argv.items():
        texts[f"argv of child {pid}"] = " ".join(args)
    weed = psutil.Process(server.pid)
    texts["argv of weed"] = " ".join(weed.cmdline())
    texts["environment of weed"] = repr(weed.environ())
    texts["log of weed"] = server.log_path.read_text(errors="replace")

    # the search is not vacuous: the data path logged (listings and requests of loader, and of
    # botocore where a backend still goes through it), the workers logged too
    assert any(record.name.startswith(SECRET_LOGGERS) for record in caplog.records)
    assert any(record.name.startswith("loader") for record in caplog.records)
    assert any(line.split(" ", 1)[0] not in ("", str(os.getpid())) for line in worker_log.splitlines()), \
        "no record from a worker reached the log file"
    leaks = [where for where, text in texts.items() if secret in text]
    assert not leaks, f"the secret appears in: {leaks}"
    print(f"\nsecret looked for in {len(texts)} places, {len(caplog.records)} main-process and "
          f"{len(worker_log.splitlines())} worker log records: nowhere")


# ------------------------------------------------------------------------------ memory

OBJECT_SIZE = 5 << 20
OBJECTS = 100  # 500 MB uploaded once and read twice: ~1 GB through the loader
EPOCHS = 2
MAX_INFLIGHT = 8
QUEUE_BYTES = 64 << 20
# glibc raises its mmap threshold each time a large mmapped block is freed, so after the first
# 5 MB body later ones come from its heaps, and freed ones stay there: RSS then measures what the
# allocator keeps (it drifted 208-388 MB here, run to run), not what the loader holds. A fixed
# threshold makes every body its own mapping, returned on free, so RSS follows live memory.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
# Interpreter, aiohttp chunk buffers and heap slack on top of the live bound.
SLACK = 200 << 20
CONSUMER_SLEEP = 0.01  # per 5 MB sample: slower than the server, so the buffer fills and stays full

# Runs in a fresh interpreter, so that no earlier test's freed-but-kept memory blurs the baseline;
# it samples its own RSS in a thread while it iterates and prints the numbers as JSON.
_RSS_SAMPLER = """
gc.collect()
proc = psutil.Process()
baseline = peak = proc.memory_info().rss
stop = threading.Event()

def sample():
    global peak
    while not stop.is_set():
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.005)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
"""  # the consumers below watch their own RSS from here on, every 5 ms

_CONSUMER = """
import gc, hashlib, json, sys, threading, time
import psutil
from loader import AsyncS3Dataset

bucket, store, epochs, max_inflight, queue_bytes, pause = sys.argv[1:]
epochs, max_inflight, queue_bytes, pause = int(epochs), int(max_inflight), int(queue_bytes), float(pause)
dataset = AsyncS3Dataset.from_prefix(f"s3://{bucket}/big/", store=store, shuffle=True,
                                     max_inflight=max_inflight, queue_bytes=queue_bytes)
keys = dataset.keys()
list(AsyncS3Dataset.from_keys(bucket, keys[:1], store=store))  # imports, client, runtime
""" + _RSS_SAMPLER + """
moved, ends, peak_buffered, epochs_seen = 0, [], 0, []
for epoch in range(epochs):
    dataset.set_epoch(epoch)
    digests = {}
    for sample_ in dataset:
        digests[sample_["__url__"]] = hashlib.sha256(sample_["bin"]).hexdigest()
        moved += len(sample_["bin"])
        time.sleep(pause)
    del sample_
    epochs_seen.append(digests)
    peak_buffered = max(peak_buffered, dataset.stats()["peak_buffered_bytes"])
    ends.append(proc.memory_info().rss - baseline)
stop.set()
sampler.join()
print(json.dumps(dict(baseline=baseline, peak=peak, ends=ends, moved=moved,
                      peak_buffered=peak_buffered, epochs=epochs_seen)))
"""


@pytest.fixture(scope="module")
def big_objects(s3_server):
    bucket = s3_server.new_bucket("rss")
    blob = os.urandom(OBJECT_SIZE + OBJECTS)
    items = {f"big/{i:03d}.bin": blob[i:i + OBJECT_SIZE] for i in range(OBJECTS)}
    upload_objects(s3_server.minio, bucket, items, workers=8)
    digests = {f"s3://{bucket}/{key}": sha256(value) for key, value in items.items()}
    del items, blob
    return bucket, digests


@pytest.mark.parametrize("store", BACKENDS)
def test_a_slow_consumer_keeps_memory_bounded(s3_server, big_objects, store):
    bucket, digests = big_objects
    env = {**os.environ, **s3_server.env, **FIXED_MMAP_THRESHOLD}
    for name in S3_VARS:
        if name not in s3_server.env:
            env.pop(name, None)
    args = [bucket, store, EPOCHS, MAX_INFLIGHT, QUEUE_BYTES, CONSUMER_SLEEP]
    run = subprocess.run([sys.executable, "-c", _CONSUMER, *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=90, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for epoch, seen in enumerate(result["epochs"]):
        assert seen == digests, f"epoch {epoch}: samples or bytes differ"

    mb = 1 << 20
    growth = result["peak"] - result["baseline"]
    in_flight = MAX_INFLIGHT * OBJECT_SIZE
    # the engine's bound (queue_bytes + requests in flight), as much again for bodies being read
    # (the HTTP client holds a body's pieces while it joins them into one bytes object), the
    # sample in hand and the one behind it, and interpreter/allocator slack
    limit = QUEUE_BYTES + in_flight + in_flight + 2 * OBJECT_SIZE + SLACK
    report = (f"{store}: {result['moved'] / 1e9:.2f} GB through a consumer sleeping "
              f"{CONSUMER_SLEEP * 1e3:.0f} ms per 5 MB sample; RSS baseline {result['baseline'] // mb} MB, "
              f"peak growth {growth // mb} MB, after each epoch {[e // mb for e in result['ends']]} MB; "
              f"peak buffered {result['peak_buffered'] // mb} MB; limit {limit // mb} MB = queue_bytes "
              f"{QUEUE_BYTES // mb} + max_inflight x object {in_flight // mb} + bodies being read "
              f"{in_flight // mb} + 2 objects {2 * OBJECT_SIZE // mb} + slack {SLACK // mb}; "
              f"an unbounded buffer would hold up to an epoch, {OBJECTS * OBJECT_SIZE // mb} MB")
    print("\n" + report)
    assert result["moved"] >= EPOCHS * OBJECTS * OBJECT_SIZE
    assert result["peak_buffered"] >= QUEUE_BYTES // 2, f"the buffer never filled: {report}"
    assert result["peak_buffered"] <= QUEUE_BYTES + 2 * OBJECT_SIZE, report
    assert growth <= limit, report
    # with the allocator returning freed bodies, what an epoch leaves behind is small: nothing kept
    assert max(result["ends"]) <= SLACK // 2, f"memory not given back after an epoch: {report}"


# ------------------------------------------------------------------------------ one memory budget

BUDGETS = (64 << 20, 128 << 20)
# On top of the budget: the interpreter's and the HTTP clients' own buffers, the sample in the
# consumer's hand and the one the engine may always deliver, and allocator slack.
BUDGET_MARGIN = 32 << 20
STALL_S = 4.0  # the consumer stops this long after a few samples: every buffer fills
SHARD_SAMPLE = 1 << 20
SHARD_SIZES = [40] * 4  # 4 shards of 40 x 1 MiB samples: 160 MiB, well over the budget

_BUDGET_CONSUMER = """
import gc, json, sys, threading, time
import psutil
from loader import AsyncS3Dataset

bucket, store, mode, budget, stall, pause = sys.argv[1:]
budget, stall, pause = int(budget), float(stall), float(pause)
if mode == "objects":
    make = lambda **kw: AsyncS3Dataset.from_prefix(f"s3://{bucket}/big/", store=store, **kw)
else:
    make = lambda **kw: AsyncS3Dataset.from_shards(f"s3://{bucket}/budget-shards/", store=store, **kw)
dataset = make(shuffle=True, memory_budget=budget or None)  # 0: no budget (to compare)
dataset.resolve()
warm = make(shuffle=False)  # imports, client, runtime: what lives as long as the process
for number, _ in enumerate(warm):
    if number == 2:
        break
del warm, _
""" + _RSS_SAMPLER + """
keys, moved = [], 0
for number, item in enumerate(dataset):
    keys.append(item["__key__"])
    moved += len(item["bin"])
    if number == 3:
        time.sleep(stall)
    else:
        time.sleep(pause)
del item
stop.set()
sampler.join()
stats = dataset.stats()
print(json.dumps(dict(baseline=baseline, peak=peak, keys=keys, moved=moved,
                      peak_buffered=stats["peak_buffered_bytes"],
                      peak_reserved=stats.get("peak_reserved_bytes", 0),
                      queue_bytes=dataset.options.queue_bytes,
                      shard_options=repr(getattr(dataset.source, "shard_options", None)))))
"""


@pytest.fixture(scope="module")
def budget_data(s3_server, big_objects):
    """``big/``: 100 objects of 5 MB (shared with the test above); ``budget-shards/``: 4 tar
    shards of 40 incompressible 1 MiB samples."""
    from shardsets import pack

    bucket, digests = big_objects
    blob = os.urandom(SHARD_SAMPLE + 200)
    shard_keys = []
    for shard, count in enumerate(SHARD_SIZES):
        samples = {f"s{shard}/{i:04d}": {"bin": blob[shard * 40 + i:][:SHARD_SAMPLE]}
                   for i in range(count)}
        shard_keys.extend(samples)
        body = pack(samples)
        s3_server.minio.put_object(bucket, f"budget-shards/shard-{shard:04d}.tar", io.BytesIO(body), len(body))
    return bucket, sorted(url.split("/", 3)[3].rsplit(".", 1)[0] for url in digests), sorted(shard_keys)


def run_budget_consumer(s3_server, bucket: str, store: str, mode: str, budget: int) -> dict:
    env = {**os.environ, **s3_server.env, **FIXED_MMAP_THRESHOLD}
    for name in S3_VARS:
        if name not in s3_server.env:
            env.pop(name, None)
    args = [bucket, store, mode, budget, STALL_S, 0.005]
    run = subprocess.run([sys.executable, "-c", _BUDGET_CONSUMER, *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def budget_report(store: str, mode: str, budget: int | None, result: dict) -> str:
    mb = 1 << 20
    growth = result["peak"] - result["baseline"]
    return (f"{store}, {mode}: memory_budget {budget // mb if budget else None} MiB, RSS growth "
            f"{growth / mb:.0f} MiB (limit: budget + {BUDGET_MARGIN // mb} MiB margin); queue_bytes "
            f"{result['queue_bytes'] // mb} MiB, peak buffered {result['peak_buffered'] / mb:.0f} MiB, "
            f"peak reserved for bodies in flight {result['peak_reserved'] / mb:.0f} MiB; "
            f"{result['shard_options']}; {result['moved'] / mb:.0f} MiB moved")


# Each backend with each budget and each mode with each budget (a pairwise cover of backend x
# mode x budget: four cells of ~7 s instead of eight).
BUDGET_CELLS = [("aioboto3", "objects", BUDGETS[0]), ("aioboto3", "shards", BUDGETS[1]),
                ("obstore", "objects", BUDGETS[1]), ("obstore", "shards", BUDGETS[0])]


@pytest.mark.parametrize("store, mode, budget", BUDGET_CELLS,
                         ids=[f"{store}-{mode}-{budget >> 20}MiB" for store, mode, budget in BUDGET_CELLS])
def test_memory_budget_bounds_rss_with_a_stalled_consumer(s3_server, budget_data, store, mode, budget):
    bucket, object_keys, shard_keys = budget_data
    result = run_budget_consumer(s3_server, bucket, store, mode, budget)
    expected = object_keys if mode == "objects" else shard_keys
    assert sorted(result["keys"]) == expected, "samples lost or repeated"
    report = budget_report(store, mode, budget, result)
    print("\n" + report)
    assert result["peak_buffered"] >= result["queue_bytes"] // 2, f"the queue never filled: {report}"
    assert result["peak"] - result["baseline"] <= budget + BUDGET_MARGIN, report


def test_without_a_budget_the_same_consumer_grows_past_it(s3_server, budget_data):
    """The control: the defaults (queue_bytes 256 MiB, 4 shards x 4 parts x 16 MiB) let the same
    stalled consumer's process grow well past budget + margin, so the test above can fail."""
    bucket, _, shard_keys = budget_data
    result = run_budget_consumer(s3_server, bucket, "aioboto3", "shards", 0)
    assert sorted(result["keys"]) == shard_keys
    report = budget_report("aioboto3", "shards", None, result)
    print("\n" + report)
    assert result["peak"] - result["baseline"] > max(BUDGETS) + BUDGET_MARGIN, report
