"""The README's runnable examples, executed against the real server so the docs cannot rot.

Every ```python block whose first line is ``# runnable`` runs, in README order, in one shared
namespace, with the server's environment set and a bucket ``readme`` holding ``train/`` (JPEGs
with class ids), ``pets/{cat,dog}/`` (class folders), ``shards/`` (tar shards) and ``parquet/``
(a Parquet file with a Hub-style image column) ready.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datasets import jpeg_dataset, make_jpeg
from shardsets import pack

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"```python\n# runnable\n(.*?)```", re.S)


def runnable_blocks() -> list[str]:
    return BLOCK.findall(README.read_text(encoding="utf-8"))


def test_readme_has_runnable_examples():
    assert len(runnable_blocks()) >= 4


@pytest.fixture
def readme_bucket(s3_server, s3_env, monkeypatch, tmp_path):
    bucket = "readme"
    try:
        s3_server.minio.make_bucket(bucket)
    except Exception:  # already there from an earlier test in this session
        pass
    jpeg_dataset(s3_server.minio, bucket, "train/", 64, seed=5, with_cls=True)
    for label in ("dog", "cat"):
        jpeg_dataset(s3_server.minio, bucket, f"pets/{label}/", 8, seed=len(label))
    samples = {f"s{i:04d}": {"jpg": make_jpeg(i), "cls": str(i % 10).encode()} for i in range(64)}
    keys = sorted(samples)
    for number in range(4):
        body = pack({k: samples[k] for k in keys[number * 16:(number + 1) * 16]})
        s3_server.minio.put_object(bucket, f"shards/train-{number:04d}.tar", io.BytesIO(body), len(body))
    table = pa.table({"image": [{"bytes": make_jpeg(i), "path": f"{i}.jpg"} for i in range(16)],
                      "label": list(range(16))})
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=4)
    s3_server.minio.put_object(bucket, "parquet/train-0.parquet", io.BytesIO(out.getvalue()), len(out.getvalue()))
    monkeypatch.chdir(tmp_path)
    return bucket


def test_readme_examples_run(readme_bucket):
    namespace: dict = {"__name__": "readme"}
    for number, block in enumerate(runnable_blocks(), start=1):
        try:
            exec(compile(block, f"README.md runnable block {number}", "exec"), namespace)
        except Exception as exc:  # name the block, keep the traceback
            raise AssertionError(f"README runnable block {number} failed:\n{block}") from exc
