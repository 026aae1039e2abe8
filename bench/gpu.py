"""GPU decode, and a ResNet-50 training step fed from S3: ``python -m bench.gpu`` (CUDA, torchvision).

    python -m bench.gpu --objects 4096 --workers 2,4

1. ``decode_images`` of a batch of 256 photo-like JPEGs to 224x224: on the GPU (nvJPEG, one
   call) against the CPU path (one image after another in this process), images/s.
2. ResNet-50 training steps (batch 256, 224 px, bf16 autocast, channels-last, SGD): first on one
   batch already on the GPU, again and again (the step rate the GPU allows), then fed from S3:
   ``AsyncS3Dataset.from_keys`` over the embedded SeaweedFS server with 20 ms added before every
   request (the fault proxy of ``integration/faults``), raw bytes collated by ``collate_raw`` in
   ``num_workers`` DataLoader workers and decoded on the GPU by ``decode_images`` in the training
   loop (in series with the step), or by ``DeviceFeed`` (on a side stream, batches ahead);
   from objects and from shards. The share is the fed step rate over the GPU's own.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import itertools
import os
import statistics
import time
from typing import Any

BATCH = 256
SIZE = (224, 224)


DEVICE = "cuda"  # "cpu" with --dry-run: the same plumbing on a machine without CUDA, a tiny model


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(work: Any, repeats: int) -> float:
    """Median seconds of ``work()`` over ``repeats`` runs after two warm-ups (GPU synchronized)."""
    for _ in range(2):
        work()
    _sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        _sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def decode_rates(images: list[bytes]) -> tuple[float, float]:
    """Images/s of ``decode_images`` on CUDA and on the CPU, one batch of ``len(images)``."""
    from loader.decode import decode_images

    gpu = _timed(lambda: decode_images(images, SIZE, device=DEVICE), 10)
    cpu = _timed(lambda: decode_images(images, SIZE, device="cpu"), 3)
    return len(images) / gpu, len(images) / cpu


def _model() -> tuple[Any, Any, Any]:
    import torch

    if DEVICE == "cuda":
        import torchvision

        model = torchvision.models.resnet50(weights=None)
    else:  # --dry-run: torchvision need not import next to a CPU torch
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 7, stride=8), torch.nn.Flatten(),
                                    torch.nn.Linear(8 * 28 * 28, 1000))
    model = model.to(DEVICE).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mean = torch.tensor([0.485, 0.456, 0.406], device=DEVICE).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=DEVICE).view(1, 3, 1, 1) * 255

    def step(pixels: Any, labels: Any) -> None:
        inputs = ((pixels.float() - mean) / std).contiguous(memory_format=torch.channels_last)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return model, optimizer, step


def gpu_step_rate(images: list[bytes], steps: int) -> float:
    """Training steps/s on one batch already on the GPU."""
    import torch

    from loader.decode import decode_images

    _, _, step = _model()
    pixels = decode_images(images, SIZE, device=DEVICE)
    labels = torch.randint(0, 1000, (len(images),), device=DEVICE)
    return 1.0 / _timed(lambda: step(pixels, labels), steps)


def ram_step_rate(images: list[bytes], steps: int) -> float:
    """Steps/s of the training loop below on JPEG bytes already in memory: decoded on the GPU,
    then the step. The most any loader could feed this loop."""
    import torch

    from loader.decode import decode_images

    _, _, step = _model()
    batches = itertools.cycle([images[at:at + BATCH] for at in range(0, len(images) - BATCH + 1, BATCH)])
    labels = torch.randint(0, 1000, (BATCH,), device=DEVICE)

    def one() -> None:
        step(decode_images(next(batches), SIZE, device=DEVICE), labels)

    return 1.0 / _timed(one, steps)


def ram_feed_rate(images: list[bytes], steps: int) -> tuple[float, str]:
    """Steps/s of the same step fed by ``DeviceFeed`` from JPEG bytes already in memory (decode
    on the side stream, overlapped with the step): the most the stage can give, S3 apart."""
    import torch

    from loader import DeviceFeed

    _, _, step = _model()
    batches = [{"jpg": images[at:at + BATCH]} for at in range(0, len(images) - BATCH + 1, BATCH)]
    raw = [batches[i % len(batches)] for i in range(steps + 4)]
    labels = torch.randint(0, 1000, (BATCH,), device=DEVICE)
    feed = DeviceFeed(raw, SIZE, device=DEVICE, mean=None, std=None, label=None)
    started, done = 0.0, 0
    for index, batch in enumerate(feed):
        if index == 4:  # warm-up apart
            _sync()
            started = time.perf_counter()
        step(batch.images, labels)
        done += index >= 4
    _sync()
    return done / (time.perf_counter() - started), feed.report()


def _proxy(upstream: str, latency: float) -> tuple[Any, str]:
    """The latency proxy in a process of its own (as ``bench.run`` runs it), not in this one,
    whose Python thread would otherwise share the GIL with the training loop."""
    import subprocess
    import sys

    from .harness import REPO

    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from bench.harness import "
            "load_faults_module; f = load_faults_module(); p = f.FaultProxy(sys.argv[2], "
            "f.FaultPlan(latency=float(sys.argv[3])), max_lifetime=3600).start(); "
            "print(p.endpoint_url, flush=True); time.sleep(3600)")
    process = subprocess.Popen([sys.executable, "-c", code, str(REPO), upstream, str(latency)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


STEADY_AFTER = 8  # steps into an epoch after which its rate counts as steady (the DataLoader warmed up)


def fed_step_rate(config: Any, bucket: str, source: dict[str, Any], workers: int, epochs: int,
                  through_feed: bool) -> tuple[float, float, int, str]:
    """Steps/s of the same training step fed from S3, over ``epochs`` after a warm-up epoch:
    decoded in the loop (``decode_images`` then the step, one after the other on one stream) or
    through ``DeviceFeed`` (decode on a side stream, two batches ahead). Also the feed's report."""
    import torch
    from torch.utils.data import DataLoader

    from loader import AsyncS3Dataset, DeviceFeed
    from loader.decode import collate_raw, decode_images

    _, _, step = _model()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if "shards" in source:
        dataset = AsyncS3Dataset.from_shards([f"s3://{bucket}/{key}" for key in source["shards"]],
                                             config=config)
    else:
        dataset = AsyncS3Dataset.from_keys(bucket, source["keys"], config=config)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=collate_raw,
                        persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
                        drop_last=True)
    feed = DeviceFeed(loader, SIZE, device=DEVICE, mean=None, std=None, label=None) if through_feed else None
    done = 0
    started = 0.0
    steady_steps, steady_s = 0, 0.0  # past the first STEADY_AFTER steps of each epoch
    for epoch in range(epochs + 1):
        dataset.set_epoch(epoch)
        if epoch == 1:
            _sync()
            started = time.perf_counter()
        mark = None
        for index, batch in enumerate(feed if feed is not None else loader):
            pixels = batch.images if feed is not None else decode_images(batch["jpg"], SIZE, device=DEVICE)
            labels = torch.randint(0, 1000, (pixels.shape[0],), device=DEVICE)
            step(pixels, labels)
            if epoch:
                done += 1
                steady_steps += index >= STEADY_AFTER
                if index == STEADY_AFTER - 1:
                    _sync()
                    mark = time.perf_counter()
        if mark is not None:
            _sync()
            steady_s += time.perf_counter() - mark
    _sync()
    rate = done / (time.perf_counter() - started)
    steady = steady_steps / steady_s if steady_s else 0.0
    peak = f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:,.0f} MiB" if DEVICE == "cuda" else ""
    if feed is not None:
        feed.close()
    return rate, steady, done, (feed.report() if feed is not None else "in the loop") + peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=4096)
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--decode", default="loop,feed",
                        help="which decodes to measure fed from S3: in the training loop, through DeviceFeed")
    parser.add_argument("--loop-workers", default="",
                        help="worker counts at which to measure the decode in the loop too (default: all)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same plumbing on the CPU with a tiny model (checks the script, measures nothing)")
    args = parser.parse_args()

    import torch

    from loader.testing import DevServer

    from .data import make_shards, photo_jpeg

    global DEVICE
    if args.dry_run:
        DEVICE = "cpu"
    assert DEVICE == "cpu" or torch.cuda.is_available(), "bench.gpu needs a CUDA device (or --dry-run)"
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run)"
    print(f"device: {name}, torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor() as pool:
        images = list(pool.map(photo_jpeg, range(args.objects), chunksize=64))
    print(f"{len(images)} photo-like JPEGs, {statistics.mean(map(len, images)) / 1024:.0f} KiB mean, "
          f"made in {time.perf_counter() - started:.0f} s", flush=True)

    on_gpu, on_cpu = decode_rates(images[:BATCH])
    print(f"decode_images, batch {BATCH} to 224x224: CUDA {on_gpu:,.0f} images/s, CPU (one "
          f"process) {on_cpu:,.0f} images/s, {on_gpu / on_cpu:.1f}x", flush=True)
    own = gpu_step_rate(images[:BATCH], 20)
    print(f"ResNet-50 step, batch {BATCH}, data on the GPU: {own:.2f} steps/s "
          f"({own * BATCH:,.0f} images/s)", flush=True)
    ram = ram_step_rate(images, 16)
    print(f"the same step after decode_images on the GPU, JPEG bytes in memory: {ram:.2f} steps/s "
          f"({ram * BATCH:,.0f} images/s): the most a loader can feed this loop", flush=True)
    fed, fed_report = ram_feed_rate(images, 24)
    print(f"the same step fed by DeviceFeed, JPEG bytes in memory: {fed:.2f} steps/s "
          f"({fed / own:.0%} of the GPU's own rate): the most the stage gives, S3 apart\n  {fed_report}",
          flush=True)

    bucket = "gpu-bench"
    keys = [f"photos/{i:06d}.jpg" for i in range(args.objects)]
    samples = dict(zip(keys, images))
    shards = make_shards(samples, max(1, args.objects // 512))  # ~512 samples, ~25 MB a shard
    with DevServer(buckets=[bucket]) as server:
        client = server.client()
        with concurrent.futures.ThreadPoolExecutor(32) as threads:
            list(threads.map(lambda kv: client.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]),
                             [*samples.items(), *shards.items()]))
        proxy, endpoint = _proxy(server.config.endpoint_url, args.latency)
        try:
            import dataclasses

            config = dataclasses.replace(server.config, endpoint_url=endpoint)
            print(f"| data | decode | workers | steps/s fed from S3 (+{args.latency * 1000:.0f} ms), whole "
                  f"epochs | images/s | share of the GPU's own step rate | steps/s after the first "
                  f"{STEADY_AFTER} of each epoch | share of the GPU's own step rate |")
            print("|---|---|--:|--:|--:|--:|--:|--:|")
            reports = []
            for data, source in (("objects", {"keys": keys}), ("shards", {"shards": sorted(shards)})):
                for workers in (int(w) for w in args.workers.split(",")):
                    loop = "loop" in args.decode.split(",") and (not args.loop_workers or str(workers)
                                                                 in args.loop_workers.split(","))
                    for through_feed in [False] * loop + [True] * ("feed" in args.decode.split(",")):
                        rate, steady, steps, report = fed_step_rate(config, bucket, source, workers,
                                                                    args.epochs, through_feed)
                        how = "DeviceFeed (side stream)" if through_feed else "in the loop"
                        print(f"| {data} | {how} | {workers} | {rate:.2f} ({steps} steps) | "
                              f"{rate * BATCH:,.0f} | {rate / own:.0%} | {steady:.2f} | {steady / own:.0%} |",
                              flush=True)
                        reports.append(f"{data}, {how}, {workers} workers: {report}")
                        gc.collect()  # the last DataLoader's workers end here, not in the next one's fork
            print("\nreport() (DeviceFeed) and peak GPU memory (model, optimizer, batches):")
            for line in reports:
                print(f"- {line}")
            print(f"\nGPU memory held by the feed: at most ahead + 2 = 4 batches of {BATCH}x3x"
                  f"{SIZE[0]}x{SIZE[1]} uint8 ({4 * BATCH * 3 * SIZE[0] * SIZE[1] / 2**20:.0f} MiB)")
        finally:
            proxy.kill()


if __name__ == "__main__":
    main()
