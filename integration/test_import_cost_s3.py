"""The first sample from a real server imports only what the per-object path uses: the listing's
plain pages need no XML library (nor the ``idna`` codec: the lister resolves an ASCII host as
bytes), the lab endpoint's signed GETs no aiohttp or botocore, and no module of another mode
(shards, Parquet, the disk cache) comes along. Counted in ``sys.modules``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from datasets import upload_objects

UNUSED = ("xml.etree", "encodings.idna", "stringprep", "aiohttp", "aiobotocore", "aioboto3", "botocore", "obstore",
          "pyarrow",
          "loader.datasets.shard_source", "loader.datasets.parquet_source", "loader.shard_index",
          "loader.formats.packing", "loader.formats.shards", "loader.formats.tar", "loader.cache.store",
          "loader.checkpoint", "loader.tools")

PROBE = """
import json, sys
from torch.utils.data import DataLoader
from loader import AsyncS3Dataset
dataset = AsyncS3Dataset.from_prefix(sys.argv[1], shuffle=True, seed=4)
workers = int(sys.argv[2])
first = next(iter(DataLoader(dataset, batch_size=None, num_workers=workers, timeout=120 if workers else 0)))
print(json.dumps({"key": first["__key__"], "size": len(first["bin"]), "modules": sorted(sys.modules)}))
"""


@pytest.fixture(scope="module")
def objects(s3_server):
    bucket = s3_server.new_bucket()
    upload_objects(s3_server.minio, bucket, {f"train/{i:05d}.bin": bytes([i % 256]) * 100 for i in range(1500)})
    return bucket


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_first_sample_imports_no_xml_client_or_other_mode(s3_server, objects, num_workers):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}, **s3_server.env}
    run = subprocess.run([sys.executable, "-c", PROBE, f"s3://{objects}/train/", str(num_workers)], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["key"].startswith("train/") and got["size"] == 100  # two listing pages were read
    assert "loader.s3.http_lister" in got["modules"]  # it listed through the HTTP lister
    imported = [m for m in got["modules"] if any(m == name or m.startswith(name + ".") for name in UNUSED)]
    assert not imported, imported
