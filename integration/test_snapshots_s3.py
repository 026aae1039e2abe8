"""Listing snapshots on the real server: ``loader ls --save`` as a user runs it, read back without
a LIST (counted through the proxy), and objects changed since the snapshot, both backends."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loader import AsyncS3Dataset, AsyncS3MapDataset, NoSuchKeyError
from loader.errors import ObjectChangedError
from loader.listing.keyfile import open_keys, origin

from datasets import upload_objects
from faults import FaultProxy
from s3servers import S3_VARS

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ["aioboto3", "obstore"]


def objects(n: int = 24) -> dict[str, bytes]:
    return {f"snap/{c}/{i:03d}.bin": f"{c}{i}".encode() for c in ("cat", "dog") for i in range(n // 2)}


def listed(proxy: FaultProxy) -> int:
    return sum(1 for method, target, _ in proxy.decisions if method == "GET" and "list-type=2" in target)


def saved_snapshot(s3_server, bucket: str, path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in S3_VARS + ("LOADER_STORE",)}
    env.update(s3_server.env)
    return subprocess.run([sys.executable, "-m", "loader", "ls", "--save", str(path),
                           f"s3://{bucket}/snap/"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


@pytest.mark.server_sensitive
@pytest.mark.parametrize("store", BACKENDS)
def test_a_saved_listing_reads_back_without_a_list_and_changes_are_errors(s3_server, tmp_path, store):
    bucket = s3_server.new_bucket("snap")
    data = objects()
    upload_objects(s3_server.minio, bucket, data)
    path = tmp_path / "train.keys"
    proc = saved_snapshot(s3_server, bucket, path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"saved the listing to {path}" in proc.stdout and "24 objects" in proc.stdout
    # kept beside the keys, so that reading it back goes over no key: none hidden, one per sample
    notes = origin(open_keys(path, verify=True)).notes
    assert notes["hidden"][0] == 0 and len(notes["samples.starts"]) == 0, dict(notes)
    with FaultProxy(s3_server.config.endpoint_url) as proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        dataset = AsyncS3Dataset.from_manifest(str(path), config=config, store=store,
                                               label_from="parent")
        got = {sample["__key__"]: (sample["bin"], sample["cls"]) for sample in dataset}
        assert got == {key[:-4]: (value, int(key.split("/")[1] == "dog")) for key, value in data.items()}
        mapped = AsyncS3MapDataset.from_manifest(str(path), config=config, store=store)
        assert mapped[0]["bin"] == data["snap/cat/000.bin"]
        assert listed(proxy) == 0, "a snapshot is read without any LIST request"
        s3_server.minio.put_object(bucket, "snap/cat/003.bin", _stream(b"a new version"), 13)
        with pytest.raises(ObjectChangedError, match=r"snap/cat/003\.bin was replaced after the "
                                                     r"listing snapshot was saved"):
            list(AsyncS3Dataset.from_manifest(str(path), config=config, store=store))
        with pytest.raises(ObjectChangedError, match=r"snap/cat/003\.bin"):
            AsyncS3MapDataset.from_manifest(str(path), config=config, store=store)[3]
        s3_server.minio.remove_object(bucket, "snap/dog/004.bin")
        skipping = AsyncS3Dataset.from_manifest(str(path), config=config, store=store, on_error="skip")
        with pytest.raises(ObjectChangedError, match=r"snap/cat/003\.bin"):
            list(skipping)  # a changed object is not skipped: the snapshot no longer describes it
        s3_server.minio.put_object(bucket, "snap/cat/003.bin", _stream(data["snap/cat/003.bin"]),
                                   len(data["snap/cat/003.bin"]))
        left = [s["__key__"] for s in skipping]
        assert len(left) == 23 and "snap/dog/004" not in left, "the deleted one is skipped"
        with pytest.raises(NoSuchKeyError, match=r"snap/dog/004\.bin"):
            list(AsyncS3Dataset.from_manifest(str(path), config=config, store=store))
        assert listed(proxy) == 0


def _stream(data: bytes):
    import io

    return io.BytesIO(data)
