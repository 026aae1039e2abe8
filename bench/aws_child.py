"""One measurement of ``bench.aws`` in a fresh process: a loader, an endpoint, a worker count.

Reads a JSON spec on stdin; prints one JSON line: samples/s of the timed epoch (after a warm-up
epoch), and the CPU of this process and its DataLoader workers per sample over that epoch.
Where the spec names a ``domain``, names under it resolve to 127.0.0.1 here and in forked
workers (``socket.getaddrinfo`` wrapped): what reaches the clients that resolve in Python
(this package, botocore), not those with resolvers of their own (obstore, the AWS CRT).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

import psutil
from torch.utils.data import DataLoader

BATCH_SIZE = 32


def resolve_to_loopback(domain: str) -> None:
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if isinstance(name, str) and (name == domain or name.endswith("." + domain)):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo


def raw(data: Any) -> bytes:
    return bytes(data)


def from_sample(sample: dict[str, Any]) -> bytes:
    return bytes(sample["jpg"])


def from_reader(reader: Any) -> bytes:
    return reader.read()


def build(spec: dict[str, Any]) -> tuple[Any, bool]:
    """The dataset, and whether the DataLoader shuffles (map-style peers) or it does itself."""
    name, bucket, keys = spec["loader"], spec["bucket"], spec["keys"]
    if name.startswith("ours-"):
        from loader import AsyncS3Dataset, Limits, S3Config

        config = S3Config(**spec["config"])
        dataset = AsyncS3Dataset.from_keys(bucket, keys, config=config, store=name.split("-", 1)[1],
                                           shuffle=True, seed=0, transform=from_sample,
                                           limits=Limits(concurrency=64))
        return dataset, False
    if name == "s3tc-map":
        from s3torchconnector import S3ClientConfig, S3MapDataset

        uris = [f"s3://{bucket}/{key}" for key in keys]
        dataset = S3MapDataset.from_objects(uris, region=spec["config"]["region"],
                                            endpoint=spec["config"]["endpoint_url"], transform=from_reader,
                                            s3client_config=S3ClientConfig(force_path_style=True))
        return dataset, True
    if name == "litdata":
        import litdata.streaming.downloader as downloader
        from litdata import StreamingRawDataset

        options = dict(downloader._OBSTORE_CLIENT_OPTIONS)
        if spec["config"]["endpoint_url"].startswith("http://"):
            options["allow_http"] = True  # LitData's obstore options leave http out
        if isinstance(spec["config"].get("verify"), str):
            with open(spec["config"]["verify"]) as ca:
                options["root_certificate"] = ca.read()
        downloader._OBSTORE_CLIENT_OPTIONS = options
        prefix = os.path.commonprefix(keys).rsplit("/", 1)[0]
        dataset = StreamingRawDataset(f"s3://{bucket}/{prefix}/", cache_dir=tempfile.mkdtemp(),
                                      transform=raw)
        return dataset, True
    raise ValueError(f"unknown loader {name!r}")


def tree_cpu(process: psutil.Process) -> float:
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def main() -> None:
    spec = json.loads(sys.stdin.read())
    if spec.get("domain"):
        resolve_to_loopback(spec["domain"])
    dataset, shuffle = build(spec)
    workers = spec["workers"]
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=shuffle, num_workers=workers,
                        persistent_workers=workers > 0, collate_fn=len, timeout=300 if workers else 0)
    me = psutil.Process()
    out: dict[str, Any] = {}
    for epoch in range(2):  # a warm-up epoch (workers, connections, an index), then the timed one
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        cpu, began = tree_cpu(me), time.perf_counter()
        samples = 0
        for count in loader:
            samples += count
            if spec.get("limit") and samples >= spec["limit"]:
                break  # a peer that reads one object per worker at a time: a capped epoch
        seconds = time.perf_counter() - began
        out = {"samples": samples, "seconds": seconds, "cpu": tree_cpu(me) - cpu}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
