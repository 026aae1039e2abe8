"""Per-object mode end to end on a real S3 server: exactly once, order, workers, bad input."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
from torch.utils.data import DataLoader

from loader import (
    AccessDeniedError,
    AsyncS3Dataset,
    ConfigError,
    EmptyDatasetError,
    Limits,
    NoSuchBucketError,
    NoSuchKeyError,
    S3Config,
    Store,
)
from loader.engine.fetch import live_engines

from datasets import import_probes, jpeg_dataset, sha256

N = 1200


@pytest.fixture(scope="module")
def jpegs(s3_server):
    """1,200 synthetic JPEGs under train/ in a fresh bucket: (bucket, {key: sha256})."""
    bucket = s3_server.new_bucket()
    return bucket, jpeg_dataset(s3_server.minio, bucket, "train/", N, seed=1)


def digest_of(sample):
    return sample["__url__"].split("/", 3)[3], sha256(sample["jpg"])


def collect(dataset, **loader_options):
    loader = DataLoader(dataset, batch_size=None, timeout=120 if loader_options.get("num_workers") else 0,
                        **loader_options)
    return [digest_of(sample) for sample in loader]


def assert_exactly_once(got, expected):
    keys = [key for key, _ in got]
    assert len(keys) == len(set(keys)), f"{len(keys) - len(set(keys))} duplicates"
    assert dict(got) == expected, "key set or content differs from what was uploaded"


@pytest.mark.parametrize(
    "num_workers,context",
    # spawn once: each spawned worker imports torch again (~35 s for four on two busy cores), and
    # four workers split the epoch as two do (partition.py's property tests, and 4 x fork here)
    [(0, None), (2, "fork"), (4, "fork"), (2, "spawn")],
)
def test_every_object_exactly_once(s3_server, jpegs, num_workers, context):
    bucket, expected = jpegs
    dataset = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", shuffle=True, seed=3,
                                         limits=Limits(concurrency=32), config=s3_server.config)
    options = {"num_workers": num_workers}
    if context:
        options["multiprocessing_context"] = context
    assert_exactly_once(collect(dataset, **options), expected)


def test_epochs_reshuffle_and_seeds_repeat(s3_server, jpegs):
    bucket, expected = jpegs
    uri = f"s3://{bucket}/train/"
    dataset = AsyncS3Dataset.from_prefix(uri, shuffle=True, seed=11, config=s3_server.config)
    orders = []
    for epoch in (0, 1):
        dataset.set_epoch(epoch)
        orders.append([key for key, _ in collect(dataset)])
    assert orders[0] != orders[1]
    assert sorted(orders[0]) == sorted(orders[1]) == sorted(expected)
    again = AsyncS3Dataset.from_prefix(uri, shuffle=True, seed=11, config=s3_server.config)
    again.set_epoch(1)
    assert [key for key, _ in collect(again)] == orders[1]
    # With workers the order within each worker's share is the same; DataLoader interleaves them.
    again.set_epoch(1)
    with_workers = [key for key, _ in collect(again, num_workers=2, multiprocessing_context="fork")]
    assert with_workers == [key for key, _ in collect(again, num_workers=2, multiprocessing_context="fork")]


def test_from_keys_and_manifest(s3_server, jpegs, tmp_path):
    bucket, expected = jpegs
    keys = sorted(expected)[:100]
    manifest = tmp_path / "train.txt"
    manifest.write_text("\n".join(keys) + "\n")
    for dataset in (
        AsyncS3Dataset.from_keys(bucket, keys, config=s3_server.config),
        AsyncS3Dataset.from_manifest(str(manifest), bucket=bucket, config=s3_server.config),
    ):
        assert len(dataset) == 100
        assert_exactly_once(collect(dataset), {key: expected[key] for key in keys})


def test_fork_after_three_in_process_epochs_does_not_hang(s3_server, jpegs):
    """The prototype's hazard: three num_workers=0 epochs, then forked workers in one process."""
    bucket, expected = jpegs
    keys = sorted(expected)[:300]
    dataset = AsyncS3Dataset.from_keys(bucket, keys, shuffle=True, config=s3_server.config)
    for epoch in range(3):
        dataset.set_epoch(epoch)
        assert len(collect(dataset)) == 300
    assert live_engines() == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("loader-")]
    dataset.set_epoch(3)
    got = collect(dataset, num_workers=2, multiprocessing_context="fork")  # timeout=120 inside
    assert sorted(key for key, _ in got) == keys


def test_break_leaves_no_thread_or_engine(s3_server, jpegs):
    bucket, _ = jpegs
    dataset = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", config=s3_server.config)
    dataset.resolve()
    before = threading.active_count()
    for count, _ in enumerate(dataset, start=1):
        if count == 10:
            break
    del _
    deadline = time.monotonic() + 30  # a wait, not a bound: ends as soon as the threads have
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
    assert live_engines() == 0


# ------------------------------------------------------------------------------ bad input
# Each must fail with a clear error, at once (not retried), naming what is wrong, never showing a secret.


def fails_fast(make, error, match, secret=None):
    started = time.monotonic()
    with pytest.raises(error, match=match) as info:
        list(make())
    assert time.monotonic() - started < 60  # hang guard: retried, it would take the 120 s retry deadline
    if secret:
        assert secret not in str(info.value) and secret not in repr(info.value)
    return info.value


def test_endpoint_without_scheme_from_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:9000")
    with pytest.raises(ConfigError, match=r"AWS_ENDPOINT_URL='127\.0\.0\.1:9000'.*'http://127\.0\.0\.1:9000'"):
        AsyncS3Dataset.from_prefix("s3://bucket/train/")


def test_missing_credentials(s3_server, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MINIO_ACCESS_KEY", "MINIO_SECRET_KEY",
                 "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.config.endpoint_url)
    fails_fast(lambda: AsyncS3Dataset.from_keys("bucket", ["a.jpg"]), ConfigError,
               "no credentials for endpoint.*AWS_ACCESS_KEY_ID")


@pytest.mark.server_sensitive
def test_bucket_that_does_not_exist(s3_server):
    fails_fast(lambda: AsyncS3Dataset.from_prefix("s3://no-such-bucket-here/train/", config=s3_server.config),
               NoSuchBucketError, "bucket 'no-such-bucket-here' does not exist",
               secret=s3_server.config.secret_access_key)


def test_empty_prefix(s3_server, jpegs):
    bucket, _ = jpegs
    fails_fast(lambda: AsyncS3Dataset.from_prefix(f"s3://{bucket}/typo/", config=s3_server.config),
               EmptyDatasetError, f"no objects under s3://{bucket}/typo/")


def test_key_that_does_not_exist(s3_server, jpegs):
    bucket, expected = jpegs
    keys = sorted(expected)[:5] + ["train/missing.jpg"]
    err = fails_fast(lambda: AsyncS3Dataset.from_keys(bucket, keys, config=s3_server.config),
                     NoSuchKeyError, "no object 'train/missing.jpg' in bucket")
    assert err.key == "train/missing.jpg" and err.bucket == bucket


@pytest.mark.parametrize("backend", ["aioboto3", "obstore"])
def test_a_missing_key_caught_in_the_loop_keeps_nothing_of_the_epoch(s3_server, jpegs, backend):
    """In the main process (no workers) the error of a missing key, caught by the user's loop and
    dropped, frees the DataLoader iterator and the dataset at once. Three cycles through its
    traceback had kept them (with the engine's buffer) until a garbage collection: the engine's
    slot holding the error it raised, the store's own error raised ``from`` itself, and a
    recursive helper's closure."""
    import gc
    import weakref

    bucket, expected = jpegs
    keys = sorted(expected)[:20] + ["train/missing.jpg"]
    gc.collect()
    gc.disable()  # a collection now and then would free it anyway: none may hide a cycle
    try:
        dataset = AsyncS3Dataset.from_keys(bucket, keys, config=s3_server.config, store=Store(backend=backend))
        iterator = iter(DataLoader(dataset, batch_size=4, collate_fn=list))
        try:
            for _ in iterator:
                pass
        except NoSuchKeyError as exc:
            assert exc.__cause__ is not exc and exc.key == "train/missing.jpg"
        else:
            raise AssertionError("the missing key was not raised")
        left = weakref.ref(iterator), weakref.ref(dataset)
        del iterator, dataset
        assert [ref() for ref in left] == [None, None], "the iterator or its dataset outlived its last reference"
    finally:
        gc.enable()


def test_wrong_credentials(s3_server, jpegs):
    bucket, expected = jpegs
    secret = "wrong-secret-" + hashlib.sha256(b"x").hexdigest()[:12]
    wrong = S3Config(endpoint_url=s3_server.config.endpoint_url, access_key_id="nobody",
                     secret_access_key=secret)
    fails_fast(lambda: AsyncS3Dataset.from_keys(bucket, sorted(expected)[:3], config=wrong),
               AccessDeniedError, "access denied.*credentials", secret=secret)


def test_unreachable_endpoint_gives_up_with_a_clear_error():
    config = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="a", secret_access_key="b")
    from loader import RetryPolicy

    fails_fast(lambda: AsyncS3Dataset.from_keys("bucket", ["a.jpg"], config=config,
                                                store=Store(retry=RetryPolicy(max_attempts=3, deadline=5))),
               ConnectionError, r"cannot connect to http://127\.0\.0\.1:9.*gave up")


@pytest.fixture(scope="module")
def listed_imports(forked_probes, s3_server, jpegs):
    return import_probes(forked_probes, s3_server, "from_prefix", f"s3://{jpegs[0]}/train/")


@pytest.mark.parametrize("store", ["aioboto3", "obstore"])
def test_a_listed_dataset_imports_its_backend_while_listing_and_its_workers_read_every_object(
        jpegs, listed_imports, store):
    """The backend's import waits for the listing (it runs while the pages arrive), which the
    DataLoader's workers start after, however they start: each still reads its share."""
    _, expected = jpegs
    assert listed_imports[store] == (False, True, len(expected))
