"""``python -m loader demo``: the whole product in one minute, on a throwaway local S3 server.

Starts the embedded SeaweedFS server, uploads a synthetic JPEG data set (one object per sample,
and the same samples packed into tar shards), then trains a toy model on both through
``AsyncS3Dataset`` + ``DataLoader`` with a progress bar, and reports samples/s and MB/s.
"""

from __future__ import annotations

import io
import os
import random
import tarfile
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from ..config import S3Config
from ..datasets.iterable import AsyncS3Dataset
from ..stores.blocking import run_async
from ..stores import open_store
from ..retry import RetryPolicy

BUCKET = "demo"


def photo_jpeg(index: int, quality: int = 90) -> bytes:
    """A distinct JPEG that decodes like a photo, not like noise: a smooth colour gradient with a
    dozen soft-edged shapes and mild grain, 380-650 px a side, ~50 KiB (noise JPEGs are several
    times costlier to decode and would misstate what decoding costs). Needs Pillow and numpy."""
    import numpy as np
    from PIL import Image, ImageChops, ImageDraw

    rng = np.random.default_rng(index)
    width, height = (int(v) for v in rng.integers(380, 651, 2))
    # drawn at a third of the size and scaled up: soft edges for a fraction of a blur's cost
    w, h = width // 3, height // 3
    down = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    across = np.linspace(0, 1, w, dtype=np.float32)[None, :, None]
    start, slope_x, slope_y = rng.uniform(40, 215, 3), rng.uniform(-100, 100, 3), rng.uniform(-100, 100, 3)
    image = Image.fromarray(np.clip(start + slope_x * across + slope_y * down, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(6, 14))):
        x0, y0 = rng.uniform(-0.2, 1.0) * w, rng.uniform(-0.2, 1.0) * h
        x1, y1 = x0 + rng.uniform(0.05, 0.6) * w, y0 + rng.uniform(0.05, 0.6) * h
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=fill)
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    grain = Image.fromarray(rng.integers(128 - 5, 128 + 6, (height, width), dtype=np.uint8))
    image = ImageChops.add(image, grain.convert("RGB"), scale=1.0, offset=-128)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def pack_shards(samples: dict[str, bytes], per_shard: int) -> Iterator[tuple[str, bytes]]:
    """WebDataset tar shards of ``per_shard`` samples each (``.jpg`` + ``.cls`` members)."""
    keys = sorted(samples)
    for number, start in enumerate(range(0, len(keys), per_shard)):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for key in keys[start:start + per_shard]:
                stem = key.rsplit(".", 1)[0]
                for name, data in ((f"{stem}.jpg", samples[key]), (f"{stem}.cls", str(len(key) % 10).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        yield f"shards/train-{number:04d}.tar", out.getvalue()


def upload(config: S3Config, objects: dict[str, bytes], bucket: str = BUCKET,
           concurrency: int = 32) -> None:
    """PUT every object concurrently through the project's own store."""
    import anyio

    async def run() -> None:
        store = await open_store("aioboto3", config, max_connections=concurrency, retry=RetryPolicy())
        limiter = anyio.Semaphore(concurrency)
        try:
            async with anyio.create_task_group() as tg:
                for key, data in objects.items():
                    async def put(key: str = key, data: bytes = data) -> None:
                        async with limiter:
                            await store.put(bucket, key, data)
                    tg.start_soon(put)
        finally:
            await store.aclose()

    run_async(run)


def decode(sample: dict[str, Any]) -> torch.Tensor:
    """The demo's "transform": JPEG bytes → a small uint8 tensor (what a real pipeline does)."""
    return torch.frombuffer(bytearray(sample["jpg"][:1024].ljust(1024, b"\0")), dtype=torch.uint8)


def train(name: str, dataset: AsyncS3Dataset, epochs: int, num_workers: int, total: int) -> dict[str, float]:
    """A toy training loop; returns samples/s and MB/s over all epochs."""
    model = torch.nn.Linear(1024, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=64, num_workers=num_workers,
                        persistent_workers=num_workers > 0)
    samples, started = 0, time.perf_counter()
    with tqdm(total=total * epochs, desc=name, unit="img", leave=True) as bar:
        for epoch in range(epochs):
            dataset.set_epoch(epoch)
            for batch in loader:
                loss = model(batch.float() / 255).logsumexp(dim=1).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                samples += len(batch)
                bar.update(len(batch))
    seconds = time.perf_counter() - started
    return {"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds}


def run_demo(num_samples: int = 2000, epochs: int = 2, num_workers: int = 2) -> list[dict[str, Any]]:
    """Start a server, upload, train in both modes, print a report, stop the server."""
    from .devserver import DevServer

    print("starting the embedded S3 server (SeaweedFS) on 127.0.0.1 ...", flush=True)
    with DevServer(buckets=[BUCKET]) as server:
        config = server.config
        print(f"server ready at {config.endpoint_url}; making {num_samples} synthetic JPEGs ...", flush=True)
        samples = {f"train/{i:06d}.jpg": synthetic_jpeg(i) for i in range(num_samples)}
        shards = dict(pack_shards(samples, per_shard=max(1, num_samples // 8)))
        started = time.perf_counter()
        upload(config, {**samples, **shards})
        mb = sum(map(len, samples.values())) / 1e6
        print(f"uploaded {len(samples)} objects and {len(shards)} shards ({mb:.1f} MB of JPEGs) "
              f"in {time.perf_counter() - started:.1f}s", flush=True)

        runs = [
            ("per-object", AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", shuffle=True,
                                                      max_inflight=64, transform=decode, config=config)),
            ("shards", AsyncS3Dataset.from_shards(f"s3://{BUCKET}/shards/", shuffle=True,
                                                  transform=decode, config=config)),
        ]
        results = []
        for name, dataset in runs:
            result = train(name, dataset, epochs, num_workers, num_samples)
            result.update(mode=name, mb_per_s=result["samples"] * (mb / num_samples) / result["seconds"])
            results.append(result)
    print()
    print(f"| mode       | samples | seconds | samples/s |  MB/s |  (num_workers={num_workers}, epochs={epochs})")
    print("|------------|--------:|--------:|----------:|------:|")
    for r in results:
        print(f"| {r['mode']:<10} | {r['samples']:>7} | {r['seconds']:>7.1f} | {r['samples_per_s']:>9.0f} "
              f"| {r['mb_per_s']:>5.1f} |")
    print("\nserver stopped. Next: point AWS_ENDPOINT_URL at your own bucket and read README.md.")
    return results


if __name__ == "__main__":
    run_demo(int(os.environ.get("DEMO_SAMPLES", "2000")))
