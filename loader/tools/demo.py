"""``python -m loader demo``: the whole product in one minute, on a throwaway local S3 server.

Uploads photo-like JPEGs (as objects and as shards) to the embedded server and trains a small CNN
on both through ``AsyncS3Dataset`` + ``DataLoader``, reporting the training rate; the JPEGs are
cached between runs under the user's cache directory (docs/design/cli.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import random
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from .._version import install_hint
from ..datasets.groups import Limits
from ..datasets.iterable import AsyncS3Dataset
from ..decode import decode_image
from ..shard_index.write import index_shards
from .examples import put_all, tar_of

BUCKET = "demo"
QUALITY = 90
GENERATOR_VERSION = 1  # bump when photo_jpeg or dominant_channel change what they make


def photo_jpeg(index: int, quality: int = QUALITY) -> bytes:
    """A distinct JPEG that decodes like a photo, not like noise: a smooth colour gradient with a
    dozen soft-edged shapes and mild grain, 380-650 px a side, ~50 KiB (noise JPEGs are several
    times costlier to decode and would misstate what decoding costs). Needs Pillow and numpy."""
    try:
        import numpy as np
        from PIL import Image, ImageChops, ImageDraw
    except ImportError as exc:
        raise ImportError(f"making demo JPEGs needs the image extra: {install_hint('image')} ({exc})") from exc

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


def pack_shards(samples: dict[str, bytes], per_shard: int, labels: dict[str, int] | None = None,
                seed: int | None = None) -> Iterator[tuple[str, bytes]]:
    """WebDataset tar shards of ``per_shard`` samples each (``.jpg`` + ``.cls`` members; the class
    id is ``labels[key]``, or a stand-in when no labels are given), in key order, or with
    ``seed`` in a seeded random order as ``loader shard --shuffle`` packs them: keys sorted by
    class would otherwise make every shard one class, and batches drawn from a few shards at a
    time lopsided (docs/design/packing.md, "Mixed batches")."""
    keys = sorted(samples)
    if seed is not None:
        random.Random(seed).shuffle(keys)
    for number, start in enumerate(range(0, len(keys), per_shard)):
        chunk = keys[start:start + per_shard]
        yield f"shards/train-{number:04d}.tar", tar_of({
            key.rsplit(".", 1)[0]: {"jpg": samples[key],
                                    "cls": str(labels[key] if labels is not None else len(key) % 10).encode()}
            for key in chunk})


def cache_home() -> Path:
    """Where the demo keeps its data sets: ``$XDG_CACHE_HOME`` (``~/.cache``; macOS
    ``~/Library/Caches``) + ``s3stream-loader/demo``. Written by hand rather than with
    ``platformdirs``: one path does not justify a dependency."""
    if os.environ.get("XDG_CACHE_HOME"):
        base = Path(os.environ["XDG_CACHE_HOME"])
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path.home() / ".cache"
    return base / "s3stream-loader" / "demo"


def cached_set_path(num_samples: int, cache_dir: Path) -> Path:
    """The file that holds the set made with these parameters (another count, quality or
    generator version is another file)."""
    return cache_dir / f"photos-v{GENERATOR_VERSION}-q{QUALITY}-n{num_samples}.tar"


def make_samples(num_samples: int) -> dict[str, bytes]:
    """``{"train/<class>/<n>.jpg": JPEG}``: ``photo_jpeg(n)`` in the folder of its dominant colour."""
    images = [photo_jpeg(i) for i in range(num_samples)]
    return {f"train/{CLASSES[dominant_channel(data)]}/{i:06d}.jpg": data for i, data in enumerate(images)}


def load_or_make_samples(num_samples: int, cache_dir: Path | None) -> tuple[dict[str, bytes], str]:
    """The demo's samples and where they came from: the cached set when there is a complete one,
    else made now and kept (written to a temporary file, then renamed, so a run stopped
    midway leaves no half set). ``cache_dir=None`` makes them without keeping them."""
    path = None if cache_dir is None else cached_set_path(num_samples, cache_dir)
    if path is not None and path.is_file():
        try:
            with tarfile.open(path) as tar:
                samples = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
            if len(samples) == num_samples:
                return samples, f"read the {num_samples} JPEGs kept by an earlier run from {path}"
        except (OSError, tarfile.TarError):
            pass  # unreadable: made again below and replaced
    started = time.perf_counter()
    samples = make_samples(num_samples)
    made = f"made {num_samples} photo-like JPEGs in {time.perf_counter() - started:.1f}s"
    if path is None:
        return samples, made
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(tar_of({name.rsplit(".", 1)[0]: {"jpg": data} for name, data in samples.items()}))
        os.replace(part, path)
    except OSError as exc:  # a read-only or full disk still runs the demo, only without keeping the set
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)
        return samples, f"{made} (could not keep them in {path.parent}: {exc})"
    return samples, f"{made}; kept in {path} for the next run"


IMAGE_SIZE = (112, 112)
CLASSES = ("red", "green", "blue")  # an image's class: its dominant colour channel


@dataclasses.dataclass(frozen=True)
class DecodeForTraining:
    """The demo's transform, run in the DataLoader workers: a sample -> (uint8 image of ``size``,
    class id). The class comes from the shard's ``.cls`` member, or in per-object mode from the
    key's folder (``train/<class>/<n>.jpg``, the ImageFolder layout)."""

    size: tuple[int, int] = IMAGE_SIZE

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        if "cls" in sample:
            label = int(sample["cls"])
        else:
            label = CLASSES.index(sample["__key__"].rsplit("/", 2)[-2])
        return decode_image(sample["jpg"], self.size), label


def dominant_channel(data: bytes) -> int:
    """Which of R, G, B is largest on average: the index of the image's class in ``CLASSES``."""
    pixels = decode_image(data, (16, 16))
    return int(pixels.float().mean(dim=(1, 2)).argmax())


def small_cnn(classes: int = 3) -> torch.nn.Module:
    """A patchify stem, two strided convolutions and a linear head (~24k parameters): a real
    training step, light enough that a laptop's cores can also fetch and decode."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 4, stride=4), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, classes),
    )


def train(name: str, dataset: AsyncS3Dataset, epochs: int, num_workers: int, total: int) -> dict[str, float]:
    """Train ``small_cnn`` from scratch; returns samples/s over all epochs and the last loss."""
    torch.manual_seed(0)
    # one intra-op thread: the DataLoader workers decode on the other cores; on a machine with few
    # cores a second OpenMP thread fights them for a core and slows every step
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = small_cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = DataLoader(dataset, batch_size=64, num_workers=num_workers,
                        persistent_workers=num_workers > 0)
    samples, correct, started, loss_value = 0, 0, time.perf_counter(), float("nan")
    with tqdm(total=total * epochs, desc=name, unit="img", leave=True) as bar:
        for epoch in range(epochs):
            dataset.set_epoch(epoch)
            for images, labels in loader:
                logits = model(images.float().div_(255))
                loss = torch.nn.functional.cross_entropy(logits, labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                samples += len(labels)
                loss_value = loss.item()
                if epoch == epochs - 1:
                    correct += int((logits.argmax(1) == labels).sum())
                bar.update(len(labels))
                bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
    seconds = time.perf_counter() - started
    torch.set_num_threads(threads)
    return {"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
            "loss": loss_value, "accuracy": correct / max(1, samples // epochs)}


def run_demo(num_samples: int = 1000, epochs: int = 2, num_workers: int = 2,
             cache_dir: Path | None = None, keep: bool = True) -> list[dict[str, Any]]:
    """Start a server, upload, train in both modes, print a report, stop the server.

    The JPEGs come from ``cache_dir`` (default ``cache_home()``) when an earlier run kept them;
    ``keep=False`` makes them afresh and keeps nothing."""
    from .devserver import DevServer

    try:  # the photo-like JPEGs and their decoding need the image extra
        import numpy  # noqa: F401
        import PIL  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"loader demo makes and decodes JPEGs: {install_hint('image')} ({exc})") from exc

    print("starting the embedded S3 server (SeaweedFS) on 127.0.0.1 ...", flush=True)
    with DevServer(buckets=[BUCKET]) as server:
        config = server.config
        print(f"server ready at {config.endpoint_url}; {num_samples} photo-like JPEGs ...", flush=True)
        samples, origin = load_or_make_samples(num_samples, (cache_dir or cache_home()) if keep else None)
        labels = {key: CLASSES.index(key.split("/")[1]) for key in samples}
        # packed in a random order, as ``loader shard --shuffle`` does: the keys are sorted by class
        shards = dict(pack_shards(samples, per_shard=max(1, num_samples // 8), labels=labels, seed=0))
        print(f"{origin} ({sum(map(len, samples.values())) / len(samples) / 1024:.0f} KiB each on average)",
              flush=True)
        started = time.perf_counter()
        put_all(config, {**samples, **shards}, BUCKET)
        mb = sum(map(len, samples.values())) / 1e6
        # what the shard guide asks of every shard set (``loader index``): the sample counts a
        # shuffled epoch needs to be cut into runs spread over the set, not read shard by shard
        index = index_shards(f"s3://{BUCKET}/shards/", config=config)
        print(f"uploaded {len(samples)} objects (train/<class>/<n>.jpg) and {len(shards)} shards "
              f"({mb:.1f} MB of JPEGs) in {time.perf_counter() - started:.1f}s; indexed the shards "
              f"({index.samples} samples) into {index.index_url}", flush=True)

        runs = [
            ("per-object", AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", shuffle=True,
                                                      limits=Limits(concurrency=64), transform=DecodeForTraining(),
                                                      config=config)),
            ("shards", AsyncS3Dataset.from_shards(f"s3://{BUCKET}/shards/", shuffle=True,
                                                  transform=DecodeForTraining(), config=config)),
        ]
        results = []
        for name, dataset in runs:
            result: dict[str, Any] = dict(train(name, dataset, epochs, num_workers, num_samples))
            result.update(mode=name, mb_per_s=result["samples"] * (mb / num_samples) / result["seconds"])
            results.append(result)
    print()
    print(f"Training a small CNN on JPEGs decoded to {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} in the DataLoader "
          f"workers (num_workers={num_workers}, epochs={epochs}):")
    print("| mode       | samples | seconds | samples/s |  MB/s | last loss | accuracy (last epoch) |")
    print("|------------|--------:|--------:|----------:|------:|----------:|----------------------:|")
    for r in results:
        print(f"| {r['mode']:<10} | {r['samples']:>7} | {r['seconds']:>7.1f} | {r['samples_per_s']:>9.0f} "
              f"| {r['mb_per_s']:>5.1f} | {r['loss']:>9.3f} | {r['accuracy']:>21.0%} |")
    print("\nserver stopped. Next: point AWS_ENDPOINT_URL at your own bucket and read README.md.")
    return results


if __name__ == "__main__":
    run_demo(int(os.environ.get("DEMO_SAMPLES", "1000")))
