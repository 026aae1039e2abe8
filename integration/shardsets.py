"""Tar-shard test data: pack samples into WebDataset shards and upload them with the minio SDK."""

from __future__ import annotations

import gzip
import io
import tarfile

import zstandard

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


SUFFIXES = {None: ".tar", "gzip": ".tar.gz", "tgz": ".tgz", "zstd": ".tar.zst"}


def compress(body: bytes, kind: str | None) -> bytes:
    """A tar compressed as ``kind`` (None: as it is; "tgz" is gzip too)."""
    if kind in ("gzip", "tgz"):
        return gzip.compress(body, mtime=0)
    if kind == "zstd":
        return zstandard.ZstdCompressor(write_checksum=True).compress(body)
    return body


def upload_shards(minio, bucket: str, prefix: str, shard_sizes: list[int], *, payload: int = 2000,
                  seed: int = 0, compression: str | None = None) -> tuple[dict[str, str], dict[str, int]]:
    """Upload ``len(shard_sizes)`` shards ``{prefix}{i:04d}.tar`` (``.tar.gz``, ``.tgz`` or
    ``.tar.zst`` with ``compression``); returns ``({sample key: sha256 of its .bin}, {shard url:
    sample count})``. Payloads differ per sample."""
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
        body = compress(pack(samples), compression)
        name = f"{prefix}{shard:04d}{SUFFIXES[compression]}"
        minio.put_object(bucket, name, io.BytesIO(body), len(body))
        counts[f"s3://{bucket}/{name}"] = size
    return expected, counts
