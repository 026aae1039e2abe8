"""Test data for integration tests: small JPEGs, concurrent uploads with the ``minio`` SDK, digests.

Images are tiny (48x48 noise, ~3-4 KB) so a thousand of them encode and upload in a second or
two; each is reproducible from ``(seed, index)``. Uploads go through the ``minio`` SDK on purpose:
the data is then written by a different client than the one under test (boto3/obstore).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

DEFAULT_IMAGE_SIZE = 48
CONTENT_TYPES = {"jpg": "image/jpeg", "jpeg": "image/jpeg", "cls": "text/plain",
                 "txt": "text/plain", "json": "application/json", "tar": "application/x-tar"}


def sha256(data: bytes) -> str:
    """Hex SHA-256 of ``data``: what tests compare instead of whole payloads."""
    return hashlib.sha256(data).hexdigest()


def make_jpeg(seed: int, size: int | tuple[int, int] = DEFAULT_IMAGE_SIZE, quality: int = 85) -> bytes:
    """A small random-noise RGB JPEG, identical for the same ``seed`` and ``size``."""
    import numpy as np
    from PIL import Image

    width, height = (size, size) if isinstance(size, int) else size
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="JPEG", quality=quality)
    return out.getvalue()


def upload_objects(minio_client, bucket: str, items: Mapping[str, bytes], workers: int = 16) -> None:
    """PUT every ``{key: bytes}`` into ``bucket`` with ``workers`` threads; raises the first failure."""

    def put(key: str) -> None:
        data = items[key]
        ext = key.rsplit(".", 1)[-1].lower() if "." in key else ""
        minio_client.put_object(bucket, key, io.BytesIO(data), len(data),
                                content_type=CONTENT_TYPES.get(ext, "application/octet-stream"))

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="upload") as pool:
        for future in [pool.submit(put, key) for key in items]:
            future.result()


def jpeg_dataset(minio_client, bucket: str, prefix: str, n: int, seed: int = 0, *,
                 with_cls: bool = False, size: int | tuple[int, int] = DEFAULT_IMAGE_SIZE,
                 workers: int = 16) -> dict[str, str]:
    """Upload ``n`` JPEGs ``{prefix}{i:06d}.jpg`` (and ``.cls`` = ``str(i % 10)`` if ``with_cls``);
    returns ``{key: sha256}`` for every object uploaded."""
    items: dict[str, bytes] = {}
    for i in range(n):
        stem = f"{prefix}{i:06d}"
        items[f"{stem}.jpg"] = make_jpeg(_sample_seed(seed, i), size)
        if with_cls:
            items[f"{stem}.cls"] = str(i % 10).encode()
    upload_objects(minio_client, bucket, items, workers=workers)
    return {key: sha256(data) for key, data in items.items()}


def _sample_seed(seed: int, index: int) -> int:
    """Distinct, stable per-sample seeds for different data sets (``seed``) and samples."""
    return seed * 1_000_003 + index


_IMPORT_SETUP = "import sys\nfrom torch.utils.data import DataLoader\nfrom loader import AsyncS3Dataset\n"

_IMPORT_PROBE = """
backend = "loader.s3." + {store!r} + "_store"
dataset = getattr(AsyncS3Dataset, {build!r})({uri!r}, shuffle=True, store={store!r})
built = backend in sys.modules
keys = [sample["__key__"] for sample in DataLoader(dataset, batch_size=None, num_workers=2, timeout=120)]
assert len(keys) == len(set(keys)), "a sample read twice"
print(built, backend in sys.modules, len(keys))
"""


def import_probes(forked_probes, s3_server, build: str, uri: str,
                  stores=("aioboto3", "obstore")) -> dict[str, tuple[bool, bool, int] | str]:
    """For each of ``stores``, in a child forked from a fresh interpreter pointed at ``s3_server``
    by the environment that imported only torch's DataLoader and the dataset class: whether the
    store's backend was imported once ``AsyncS3Dataset.<build>(uri)`` returned, whether it was
    after its DataLoader (2 workers, the platform's start method) read every sample, and how many
    it read; or, where the child failed, its exit code and stderr."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}, **s3_server.env}
    results = forked_probes(_IMPORT_SETUP, {store: _IMPORT_PROBE.format(build=build, uri=uri, store=store)
                                            for store in stores}, env=env)
    probed: dict[str, tuple[bool, bool, int] | str] = {}
    for store, (code, out, err) in results.items():
        if code != 0:
            probed[store] = f"exit {code}: {err[-3000:]}"
            continue
        built, after, count = out.split()
        probed[store] = (built == "True", after == "True", int(count))
    return probed
