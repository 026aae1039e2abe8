"""The synthetic data set: distinct 512x512 JPEGs of ~110 KB, as objects and as tar shards.

``synthetic_jpeg`` draws a smooth per-image pattern plus grain, near the size of a typical
ImageNet JPEG and cheap to make; ``images="photo"`` uses the demo's smaller photo-like
``loader.tools.demo.photo_jpeg`` instead.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path

import numpy as np

from loader.tools.demo import pack_shards, photo_jpeg

BUCKET = "bench"
OBJECTS_PREFIX = "objects/"
SHARDS_PREFIX = "shards/"
SMALL_PREFIX = "small/"  # the smaller copy used by the decode workload
IMAGE_SIZE = 512
GRAIN = 30  # noise amplitude: ~110 KB per JPEG at quality 85
QUALITY = 85


def synthetic_jpeg(index: int, size: int = IMAGE_SIZE) -> bytes:
    """A distinct, real JPEG: a per-index low-frequency colour pattern plus grain."""
    from PIL import Image

    rng = np.random.default_rng(index)
    axis = np.arange(size, dtype=np.float32) / size
    freq = rng.uniform(1, 6, (3, 2))
    phase = rng.uniform(0, 2 * np.pi, (3, 2))
    across = np.sin(2 * np.pi * freq[:, :1] * axis[None, :] + phase[:, :1])  # (3, size)
    down = np.cos(2 * np.pi * freq[:, 1:] * axis[None, :] + phase[:, 1:])  # (3, size)
    base = (128 + 60 * down[:, :, None] * across[:, None, :]).astype(np.int16).transpose(1, 2, 0)
    grain = rng.integers(-GRAIN, GRAIN + 1, (size, size, 1), dtype=np.int16)
    pixels = np.clip(base + grain, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=QUALITY)
    return out.getvalue()


IMAGES = ("synthetic", "photo")  # synthetic_jpeg (512 px, grainy, ~110 KB) or demo.photo_jpeg (~50 KiB)


def make_samples(count: int, prefix: str = "", images: str = "synthetic") -> dict[str, bytes]:
    """``{prefix}objects/000000.jpg`` ... -> JPEG bytes (``images``: one of ``IMAGES``)."""
    make = {"synthetic": synthetic_jpeg, "photo": photo_jpeg}[images]
    return {f"{prefix}{OBJECTS_PREFIX}{i:06d}.jpg": make(i) for i in range(count)}


def make_shards(samples: dict[str, bytes], num_shards: int, prefix: str = "") -> dict[str, bytes]:
    """The same samples in ``num_shards`` WebDataset tar shards (``.jpg`` + ``.cls`` members),
    named ``{prefix}shards/train-0000.tar`` ... (``loader.tools.demo.pack_shards``)."""
    per_shard = -(-len(samples) // num_shards)
    shards = {f"{prefix}{key}": tar for key, tar in pack_shards(samples, per_shard)}
    assert all(key.startswith(prefix + SHARDS_PREFIX) for key in shards)
    return shards


@dataclasses.dataclass(frozen=True)
class DataSet:
    """One uploaded copy of the samples: objects under ``objects_prefix``, the same samples in
    ``shard_keys``, and their bytes in a local ``blob`` for the in-memory ceiling."""

    objects_prefix: str
    shard_keys: tuple[str, ...]
    blob: str
    num_samples: int
    mean_size: float
    shard_mb: float


def prepare(samples: dict[str, bytes], num_shards: int, prefix: str, directory: Path) -> tuple[DataSet, dict[str, bytes]]:
    """Rename ``samples`` under ``prefix``, pack them into shards, write the blob; returns the
    description and every object to upload."""
    objects = {f"{prefix}{key}": value for key, value in samples.items()}
    shards = make_shards(objects, num_shards, prefix)
    where = directory / (prefix.strip("/") or "full")
    where.mkdir(parents=True, exist_ok=True)
    blob = write_blob(objects, where)
    described = DataSet(objects_prefix=prefix + OBJECTS_PREFIX, shard_keys=tuple(sorted(shards)),
                        blob=str(blob), num_samples=len(objects),
                        mean_size=sum(map(len, objects.values())) / len(objects),
                        shard_mb=sum(map(len, shards.values())) / len(shards) / 1e6)
    return described, {**objects, **shards}


def write_blob(samples: dict[str, bytes], directory: Path) -> Path:
    """The sample bytes in one local file (+ offsets), for the in-memory ceilings."""
    blob = directory / "samples.bin"
    offsets = []
    with open(blob, "wb") as f:
        for key in sorted(samples):
            offsets.append([f.tell(), len(samples[key])])
            f.write(samples[key])
    (directory / "samples.json").write_text(json.dumps(offsets))
    os.chmod(blob, 0o600)
    return blob


def read_blob(blob: str | Path) -> list[bytes]:
    blob = Path(blob)
    offsets = json.loads(blob.with_suffix(".json").read_text())
    data = blob.read_bytes()
    return [data[start:start + size] for start, size in offsets]
