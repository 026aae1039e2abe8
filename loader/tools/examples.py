"""The data the documentation's examples read, in the bucket ``bucket``: what ``loader serve
--examples`` uploads, so that every page runs as written on a fresh machine (the test suite runs
the pages against the same data).

- ``train/000000.jpg`` + ``train/000000.cls`` ... (64 samples: a JPEG and a class id 0-9);
- ``images/cat/``, ``images/dog/`` (class folders, 20 JPEGs each);
- ``wds/train-0000.tar`` ... ``wds/train-0003.tar`` (tar shards of 16 samples, no index);
- ``parquet/train-0000{0,1}-of-00002.parquet`` (40 rows in row groups of 10: a Hub-style image
  column ``{"bytes", "path"}`` and a ``label``).

Needs Pillow and NumPy (the ``image`` extra) and pyarrow (the ``parquet`` extra).
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import S3Config

EXAMPLES_BUCKET = "bucket"
IMAGE_SIZE = 48  # pixels a side: small noise JPEGs, ~5 KiB each


def noise_jpeg(seed: int, size: int = IMAGE_SIZE, quality: int = 85) -> bytes:
    """A small random-noise RGB JPEG, the same for the same ``seed``."""
    try:
        import numpy as np
        from PIL import Image
    except ImportError as exc:
        raise ConfigError("the examples' JPEGs need Pillow and NumPy: "
                          "pip install 's3stream-loader[image]'") from exc

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="JPEG", quality=quality)
    return out.getvalue()


def tar_of(samples: Mapping[str, Mapping[str, bytes]]) -> bytes:
    """One tar holding ``{key: {ext: bytes}}`` as members ``key.ext``, in the mappings' order."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def example_data() -> dict[str, bytes]:
    """``{key: bytes}`` of everything the documentation's examples read (see the module's docstring)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError("the examples' data needs pyarrow and Pillow: "
                          "pip install 's3stream-loader[image,parquet]'") from exc
    items: dict[str, bytes] = {}
    for i in range(64):
        items[f"train/{i:06d}.jpg"] = noise_jpeg(i)
        items[f"train/{i:06d}.cls"] = str(i % 10).encode()
    for n, label in enumerate(("cat", "dog")):
        for i in range(20):
            items[f"images/{label}/{i:03d}.jpg"] = noise_jpeg(1000 * (n + 1) + i)
    for shard in range(4):
        samples = {f"s{shard * 16 + i:04d}": {"cls": str(i % 10).encode(),
                                                 "jpg": noise_jpeg(5000 + shard * 16 + i)} for i in range(16)}
        items[f"wds/train-{shard:04d}.tar"] = tar_of(samples)
    for part in range(2):  # as the Hub publishes images: a struct column of bytes and path, and a label
        rows = range(part * 20, part * 20 + 20)
        table = pa.table({"image": [{"bytes": noise_jpeg(7000 + i), "path": f"{i:05d}.jpg"} for i in rows],
                          "label": pa.array([i % 10 for i in rows], pa.int64())})
        out = io.BytesIO()
        pq.write_table(table, out, row_group_size=10)
        items[f"parquet/train-{part:05d}-of-00002.parquet"] = out.getvalue()
    return items


def put_all(config: S3Config, objects: dict[str, bytes], bucket: str, concurrency: int = 32) -> None:
    """PUT every object concurrently through the project's own store."""
    import functools

    from ..engine.core import run_all
    from ..retry import RetryPolicy
    from ..s3 import open_store
    from ..s3.blocking import run_async

    async def run() -> None:
        store = await open_store("aioboto3", config, max_connections=concurrency, retry=RetryPolicy())
        try:
            await run_all((functools.partial(store.put, bucket, key, data) for key, data in objects.items()),
                          concurrency)
        finally:
            await store.aclose()

    run_async(run)
