"""Tar-shard test data: pack samples into WebDataset shards and upload them with the minio SDK."""

from __future__ import annotations

import io
import tarfile

from datasets import sha256


def pack(samples: dict[str, dict[str, bytes]], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    """One tar holding ``{key: {ext: bytes}}`` as members ``key.ext``, in key order."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for key in sorted(samples):
            for ext, data in sorted(samples[key].items()):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def upload_shards(minio, bucket: str, prefix: str, shard_sizes: list[int], *, payload: int = 2000,
                  seed: int = 0) -> tuple[dict[str, str], dict[str, int]]:
    """Upload ``len(shard_sizes)`` shards ``{prefix}{i:04d}.tar``; returns ``({sample key:
    sha256 of its .bin}, {shard url: sample count})``. Payloads differ per sample."""
    expected: dict[str, str] = {}
    counts: dict[str, int] = {}
    number = 0
    for shard, size in enumerate(shard_sizes):
        samples = {}
        for _ in range(size):
            key = f"s{shard:04d}/{number:06d}"
            data = sha256(f"{seed}:{number}".encode()).encode() * (payload // 64 + 1)
            data = data[: payload + number % 97]
            samples[key] = {"bin": data, "cls": str(number % 10).encode()}
            expected[key] = sha256(data)
            number += 1
        body = pack(samples)
        name = f"{prefix}{shard:04d}.tar"
        minio.put_object(bucket, name, io.BytesIO(body), len(body))
        counts[f"s3://{bucket}/{name}"] = size
    return expected, counts
