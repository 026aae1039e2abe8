"""Settings users combine wrongly, on a real S3 server: each is refused with the fix, or named
where it skips something, never silently ignored (a skipped sample, a shuffle buffer that
would not apply)."""

from __future__ import annotations

import io
import re
import warnings

import pytest

from loader import AsyncS3Dataset, ConfigError, Reading

from shardsets import upload_shards


def fails_on_every_fifth(sample):
    if int(sample["__key__"].rsplit("/", 1)[1]) % 5 == 0:
        raise ValueError("a corrupt sample")
    return sample["__key__"]


def keys_of(batch):
    return [sample["__key__"] for sample in batch]


@pytest.fixture(scope="module")
def data(s3_server):
    """One bucket with 2 shards of 12 samples and 24 plain objects."""
    bucket = s3_server.new_bucket("usage")
    expected, counts = upload_shards(s3_server.minio, bucket, "shards/", [12, 12], payload=300)
    for number in range(24):
        body = f"object {number}".encode()
        s3_server.minio.put_object(bucket, f"objects/{number:04d}.txt", io.BytesIO(body), len(body))
    return bucket, sorted(expected), counts


def test_a_skipped_sample_is_named_and_its_shard_goes_on(s3_server, data):
    bucket, expected, _ = data
    dataset = AsyncS3Dataset.from_shards(f"s3://{bucket}/shards/", on_error="warn",
                                         transform=fails_on_every_fifth, config=s3_server.config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(dataset)
    skipped = [key for key in expected if int(key.rsplit("/", 1)[1]) % 5 == 0]
    assert sorted(got) == sorted(set(expected) - set(skipped)), "the rest of each shard was read"
    messages = [str(w.message) for w in caught if "on_error='warn'" in str(w.message)]
    assert len(messages) == len(skipped) == 5
    for key in skipped:
        assert any(re.match(rf"skipping sample '{re.escape(key)}' of shard s3://{bucket}/shards/\d+\.tar, "
                            r"going on with the rest of the shard", text) for text in messages), key
    assert dataset.stats()["samples_skipped"] == 5


def test_a_shuffle_buffer_that_would_not_apply_is_refused(s3_server, data):
    bucket, _, counts = data
    with pytest.raises(ConfigError, match=r"shuffle_buffer=200 cannot be used with batch_size="):
        AsyncS3Dataset.from_shards(f"s3://{bucket}/shards/", shuffle=True, batch_size=4,
                                   reading=Reading(shuffle_buffer=200), config=s3_server.config)
