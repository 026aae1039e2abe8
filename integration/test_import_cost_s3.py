"""The first sample from a real server imports only what the per-object path uses: the listing's
plain pages need no XML library (nor the ``idna`` codec: the lister resolves an ASCII host as
bytes), the lab endpoint's signed GETs no aiohttp or botocore, and no module of another mode
(shards, Parquet, the disk cache) comes along. Counted in ``sys.modules``."""

from __future__ import annotations

import json
import os

import pytest

from datasets import upload_objects

UNUSED = ("xml.etree", "encodings.idna", "stringprep", "aiohttp", "aiobotocore", "aioboto3", "botocore", "obstore",
          "pyarrow",
          "loader.datasets.shard_source", "loader.datasets.parquet_source", "loader.shard_index",
          "loader.formats.packing", "loader.formats.shards", "loader.formats.tar", "loader.cache.store",
          "loader.checkpoint", "loader.tools")

# each case runs in a child forked from a fresh interpreter that ran only these imports
SETUP = "import json, sys\nfrom torch.utils.data import DataLoader\nfrom loader import AsyncS3Dataset\n"

PROBE = """
dataset = AsyncS3Dataset.from_prefix({uri!r}, shuffle=True, seed=4)
workers = {workers}
first = next(iter(DataLoader(dataset, batch_size=None, num_workers=workers, timeout=120 if workers else 0)))
print(json.dumps({{"key": first["__key__"], "size": len(first["bin"]), "modules": sorted(sys.modules)}}))
"""


@pytest.fixture(scope="module")
def objects(s3_server):
    bucket = s3_server.new_bucket()
    upload_objects(s3_server.minio, bucket, {f"train/{i:05d}.bin": bytes([i % 256]) * 100 for i in range(1500)})
    return bucket


@pytest.fixture(scope="module")
def probed(forked_probes, s3_server, objects) -> dict[int, tuple[int, str, str]]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}, **s3_server.env}
    results = forked_probes(SETUP, {str(workers): PROBE.format(uri=f"s3://{objects}/train/", workers=workers)
                                    for workers in (0, 2)}, env=env)
    return {int(workers): result for workers, result in results.items()}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_first_sample_imports_no_xml_client_or_other_mode(probed, num_workers):
    code, out, err = probed[num_workers]
    assert code == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["key"].startswith("train/") and got["size"] == 100  # two listing pages were read
    assert "loader.s3.http_lister" in got["modules"]  # it listed through the HTTP lister
    imported = [m for m in got["modules"] if any(m == name or m.startswith(name + ".") for name in UNUSED)]
    assert not imported, imported
