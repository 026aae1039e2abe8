"""Images decoded through the DataLoader from a real S3 server, both modes, both recipes:

* in the workers: ``decode_image(..., size)`` as the dataset's transform (the CPU fast path);
* in the training loop: raw bytes through ``collate_raw``, a batch decoded by ``decode_images``
  (on the CPU here; on the device where CUDA and torchvision are present).

And ``loader demo`` end to end: it trains on what it decodes.
"""

from __future__ import annotations

import functools
import io
import math
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, DeviceFeed, decode_sample
from loader.decode import collate_raw, decode_images
from loader.tools.demo import photo_jpeg

from datasets import upload_objects
from shardsets import pack

N = 96
SIZE = (96, 128)
REPO = Path(__file__).resolve().parents[1]


def recipe(data: bytes) -> torch.Tensor:
    """The usual recipe, the fidelity reference."""
    with Image.open(io.BytesIO(data)) as image:
        pixels = np.asarray(image.convert("RGB").resize((SIZE[1], SIZE[0]), Image.Resampling.BILINEAR))
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.float() - b.float()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


@pytest.fixture(scope="module")
def photos(s3_server):
    """N photo-like JPEGs as objects ``img/<n>.jpg`` and in 3 shards ``shards/<i>.tar`` (with a
    ``.cls``); returns (bucket, {sample number: JPEG bytes})."""
    bucket = s3_server.new_bucket("dec")
    images = {n: photo_jpeg(n) for n in range(N)}
    objects = {f"img/{n:04d}.jpg": data for n, data in images.items()}
    for shard in range(3):
        members = {f"s/{n:04d}": {"jpg": images[n], "cls": str(n % 3).encode()}
                   for n in range(shard, N, 3)}
        objects[f"shards/{shard}.tar"] = pack(members)
    upload_objects(s3_server.minio, bucket, objects)
    return bucket, images


def number_of(key: str) -> int:
    return int(key.rsplit("/", 1)[-1])


def datasets(s3_server, bucket: str, **options):
    return {
        "objects": AsyncS3Dataset.from_prefix(f"s3://{bucket}/img/", config=s3_server.config, **options),
        "shards": AsyncS3Dataset.from_shards(f"s3://{bucket}/shards/{{0..2}}.tar", config=s3_server.config,
                                             **options),
    }


@pytest.mark.parametrize("mode", ["objects", "shards"])
def test_decoded_in_the_workers_within_the_fidelity_bound(s3_server, photos, mode):
    bucket, images = photos
    transform = functools.partial(decode_sample, size=SIZE)
    dataset = datasets(s3_server, bucket, shuffle=True, seed=1, transform=transform)[mode]
    loader = DataLoader(dataset, batch_size=16, num_workers=2, timeout=120)
    seen = set()
    for batch in loader:
        assert batch["jpg"].shape[1:] == (3, *SIZE) and batch["jpg"].dtype == torch.uint8
        for key, image in zip(batch["__key__"], batch["jpg"]):
            n = number_of(key)
            assert psnr(image, recipe(images[n])) >= 35, key
            seen.add(n)
        if mode == "shards":
            assert all(label == number_of(key) % 3 for key, label in zip(batch["__key__"], batch["cls"].tolist()))
    assert seen == set(images)


@pytest.mark.parametrize("mode", ["objects", "shards"])
def test_raw_bytes_through_the_dataloader_then_a_batch_decode(s3_server, photos, mode):
    bucket, images = photos
    dataset = datasets(s3_server, bucket)[mode]
    loader = DataLoader(dataset, batch_size=32, num_workers=2, collate_fn=collate_raw, timeout=120)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seen = 0
    for batch in loader:
        assert all(isinstance(data, bytes) for data in batch["jpg"])
        pixels = decode_images(batch["jpg"], SIZE, device)
        assert pixels.shape == (len(batch["jpg"]), 3, *SIZE) and pixels.dtype == torch.uint8
        assert pixels.device.type == device
        for key, image in zip(batch["__key__"], pixels.cpu()):
            assert psnr(image, recipe(images[number_of(key)])) >= 35, key
        if mode == "shards":
            assert batch["cls"] == [str(number_of(key) % 3).encode() for key in batch["__key__"]]
        seen += len(batch["jpg"])
    assert seen == N


def run_demo(tmp_path, *argv: str) -> str:
    """``python -m loader demo ARGV`` as a user runs it, its cache home in ``tmp_path``; stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "MINIO_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, "-m", "loader", "demo", *argv], check=False, cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    # a first run says nothing to fix: no warning about the demo's own data (its shards indexed)
    assert "Warning" not in done.stderr, done.stderr[-3000:]
    out = done.stdout
    assert "indexed the shards (96 samples) into s3://demo/shards/index.json" in out, out
    assert "Training a small CNN on JPEGs decoded to 112x112" in out, out
    rows = [line for line in out.splitlines() if line.startswith(("| per-object", "| shards"))]
    assert len(rows) == 2, out
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1] == "192" and float(cells[3]) > 0  # 96 samples x 2 epochs, a rate
        assert math.isfinite(float(cells[5]))  # a loss: the model was trained on these samples
    return out


def test_the_demo_trains_on_decoded_images_and_keeps_them_for_the_next_run(tmp_path):
    """``loader demo`` on a few samples: its own server, both modes, a table of training runs.
    The JPEGs it made are kept under the user's cache home, keyed by their parameters: the
    second run reads them instead of making them again, and trains on the same images."""
    kept = tmp_path / "cache" / "s3stream-loader" / "demo" / "photos-v1-q90-n96.tar"
    first = run_demo(tmp_path, "--samples", "96", "--epochs", "2")
    assert "made 96 photo-like JPEGs in " in first and f"kept in {kept} for the next run" in first
    with tarfile.open(kept) as tar:
        names = sorted(tar.getnames())
    assert len(names) == 96 and all(re.fullmatch(r"train/(red|green|blue)/\d{6}\.jpg", n) for n in names)
    second = run_demo(tmp_path, "--samples", "96", "--epochs", "2")
    assert f"read the 96 JPEGs kept by an earlier run from {kept}" in second and "made 96" not in second
    sizes = [re.search(r"uploaded 96 objects .*\(([\d.]+ MB) of JPEGs\)", out).group(1) for out in (first, second)]
    assert sizes[0] == sizes[1]  # the same images
    assert sorted(p.name for p in kept.parent.iterdir()) == [kept.name]  # no partial file left


def test_the_device_feed_reads_a_whole_epoch_from_the_workers_shards_with_labels(s3_server, photos):
    """``DeviceFeed`` over a DataLoader of 2 workers (the start method users get): every sample
    once, decoded within the fidelity bound, labels from the shards' ``.cls``."""
    bucket, images = photos
    dataset = datasets(s3_server, bucket, shuffle=True, seed=3)["shards"]
    loader = DataLoader(dataset, batch_size=16, num_workers=2, collate_fn=collate_raw, timeout=120)
    seen = []
    with DeviceFeed(loader, SIZE, mean=None, std=None) as feed:
        for batch in feed:
            assert batch.images.shape[1:] == (3, *SIZE)
            assert batch.labels.tolist() == [number_of(key) % 3 for key in batch.keys]
            for key, image in zip(batch.keys, batch.images.cpu()):
                assert psnr(image, recipe(images[number_of(key)])) >= 35, key
            seen += [number_of(key) for key in batch.keys]
    assert sorted(seen) == list(range(N))
    assert "over 6 steps" in feed.report()


def test_a_run_stopped_after_the_feed_read_ahead_resumes_exactly(s3_server, photos):
    """The feed decodes batches before the step takes them; what a checkpoint saves is the steps
    the loop took (``feed.steps``), so the resumed run reads exactly the samples it never got."""
    bucket, _ = photos
    first = datasets(s3_server, bucket, shuffle=True, seed=5, batch_size=8)["objects"]
    loader = DataLoader(first, batch_size=8, num_workers=2, collate_fn=collate_raw, timeout=120)
    taken = []
    feed = DeviceFeed(loader, SIZE, label=None, ahead=3)
    for batch in feed:
        taken += batch.keys
        if feed.steps == 3:
            break
    seen = first.samples_seen(feed.steps)
    feed.close()
    assert seen == 24 == len(taken)
    second = datasets(s3_server, bucket, shuffle=True, seed=5, batch_size=8)["objects"]
    second.resume(epoch=0, samples_seen=seen)
    rest = []
    loader = DataLoader(second, batch_size=8, num_workers=2, collate_fn=collate_raw, timeout=120)
    for batch in DeviceFeed(loader, SIZE, label=None):
        rest += batch.keys
    assert sorted(taken + rest) == sorted(f"img/{n:04d}" for n in range(N))
