"""One measurement of ``bench.aws`` in a fresh process: a loader, an endpoint, a worker count.

Reads a JSON spec on stdin; prints one JSON line: samples/s of the timed epoch (after a warm-up
epoch), and the CPU of this process and its DataLoader workers per sample over that epoch.
Where the spec names a ``domain``, names under it resolve to 127.0.0.1 here and in forked
workers (``socket.getaddrinfo`` wrapped): what reaches the clients that resolve in Python
(this package, botocore), not those with resolvers of their own (obstore, the AWS CRT).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

import psutil
from torch.utils import data as torch_data
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
    if name in FORMATS:
        return FORMATS[name](spec), False
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
        from litdata import StreamingRawDataset

        _litdata_client_options(spec)
        prefix = os.path.commonprefix(keys).rsplit("/", 1)[0]
        dataset = StreamingRawDataset(f"s3://{bucket}/{prefix}/", cache_dir=tempfile.mkdtemp(),
                                      transform=raw)
        return dataset, True
    raise ValueError(f"unknown loader {name!r}")


def _ours_shards(spec: dict[str, Any]) -> Any:
    from loader import AsyncS3Dataset, S3Config

    return AsyncS3Dataset.from_shards([f"s3://{spec['bucket']}/{key}" for key in spec["keys"]], shuffle=True,
                                      seed=0, config=S3Config(**spec["config"]), store=spec["loader"].split("-")[2],
                                      transform=from_sample)


def _ours_parquet(spec: dict[str, Any]) -> Any:
    from loader import AsyncS3Dataset, S3Config

    if spec["loader"].endswith("-ungated"):  # the same, its ranged GETs not gated (request_gate)
        import loader.formats.parquet as parquet

        async def ungated(store: Any, limit: int, call: Any) -> Any:
            return await call()

        parquet.gated = ungated  # (forked DataLoader workers inherit it)
    return AsyncS3Dataset.from_parquet([f"s3://{spec['bucket']}/{key}" for key in spec["keys"]],
                                       columns=["image", "label"], shuffle=True, seed=0,
                                       config=S3Config(**spec["config"]), store=spec["loader"].split("-")[2],
                                       transform=image_bytes)


def image_bytes(row: dict[str, Any]) -> bytes:
    return bytes(row["image"]["bytes"])


class Boto3Opener:
    """webdataset's stage from a shard URL to its streaming body: boto3, one client a process,
    addressed as the spec says (virtual-hosted on the AWS-shaped endpoint: boto3 resolves in Python)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._client: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "_client": None}

    def __call__(self, source: Any) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client("s3", endpoint_url=self.config["endpoint_url"],
                                        region_name=self.config["region"], verify=self.config.get("verify"),
                                        config=Config(s3={"addressing_style": self.config.get(
                                            "addressing_style", "path")}))
        for item in source:
            bucket, _, key = item["url"][len("s3://"):].partition("/")
            body = self._client.get_object(Bucket=bucket, Key=key)["Body"]
            try:
                yield {**item, "stream": body}
            finally:
                body.close()


def _expand(source: Any) -> Any:
    from webdataset.tariterators import group_by_keys, tar_file_expander

    return group_by_keys(tar_file_expander(source))


def _webdataset(spec: dict[str, Any]) -> Any:
    import webdataset as wds

    return wds.DataPipeline(wds.SimpleShardList([f"s3://{spec['bucket']}/{key}" for key in spec["keys"]]),
                            wds.split_by_worker, Boto3Opener(spec["config"]), _expand, wds.shuffle(1000),
                            wds.map(from_sample))


def _litdata_optimized(spec: dict[str, Any]) -> Any:
    from litdata import StreamingDataset

    _litdata_client_options(spec)
    # a cache smaller than the data set: chunks are deleted once read, every epoch reads the server
    # (with room for all of them, the timed epoch would read the local disk)
    return StreamingDataset(f"s3://{spec['bucket']}/{spec['keys'][0]}", cache_dir=tempfile.mkdtemp(),
                            shuffle=True, seed=0, transform=_litdata_jpg, max_cache_size=spec["cache_bytes"])


def _litdata_jpg(item: dict[str, Any]) -> bytes:
    return bytes(item["jpg"])


def _litdata_client_options(spec: dict[str, Any]) -> None:
    """LitData's obstore options, opened to an http endpoint and the lab's CA."""
    import litdata.streaming.downloader as downloader

    options = dict(downloader._OBSTORE_CLIENT_OPTIONS)
    if spec["config"]["endpoint_url"].startswith("http://"):
        options["allow_http"] = True  # LitData's obstore options leave http out
    if isinstance(spec["config"].get("verify"), str):
        with open(spec["config"]["verify"]) as ca:
            options["root_certificate"] = ca.read()
    downloader._OBSTORE_CLIENT_OPTIONS = options


class ParquetRows(torch_data.IterableDataset):
    """``pyarrow.dataset`` over pyarrow's ``S3FileSystem`` (path-style: its AWS SDK resolves names
    itself), each DataLoader worker reading every n-th file; the image bytes of each row."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def __iter__(self) -> Any:
        import pyarrow.dataset as pads
        from pyarrow import fs

        config = self.spec["config"]
        scheme, _, where = config["endpoint_url"].partition("://")
        extra = {"tls_ca_file_path": config["verify"]} if isinstance(config.get("verify"), str) else {}
        s3 = fs.S3FileSystem(access_key=os.environ["AWS_ACCESS_KEY_ID"],
                             secret_key=os.environ["AWS_SECRET_ACCESS_KEY"], endpoint_override=where,
                             scheme=scheme, region=config["region"], force_virtual_addressing=False, **extra)
        paths = [f"{self.spec['bucket']}/{key}" for key in self.spec["keys"]]
        info = torch_data.get_worker_info()
        if info is not None:
            paths = paths[info.id::info.num_workers]
        dataset = pads.dataset(paths, format="parquet", filesystem=s3)
        for batch in dataset.to_batches(columns=["image"]):
            for image in batch.column(0).to_pylist():
                yield image["bytes"]


FORMATS = {
    "ours-shard-aioboto3": _ours_shards, "ours-shard-obstore": _ours_shards, "wds": _webdataset,
    "litdata-opt": _litdata_optimized,
    "ours-parquet-aioboto3": _ours_parquet, "ours-parquet-aioboto3-ungated": _ours_parquet,
    "ours-parquet-obstore": _ours_parquet, "pyarrow": ParquetRows,
}


def tree_cpu(process: psutil.Process) -> float:
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class Sampler:
    """Where this process's threads are, every ``interval`` s (``--profile``: a stand-in for a
    sampling profiler): ``collapsed`` gives one line per distinct stack, root first, and its count."""

    def __init__(self, interval: float = 0.001) -> None:
        import collections
        import threading

        self.interval, self.counts = interval, collections.Counter[tuple[str, ...]]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import threading

        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        while not self._stop.wait(self.interval):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack: list[str] = []
                while frame is not None:
                    code = frame.f_code
                    stack.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})")
                    frame = frame.f_back
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                self.counts[(names.get(ident, "?"), *reversed(stack))] += 1

    def collapsed(self) -> str:
        return "".join(f"{';'.join(stack)} {n}\n" for stack, n in self.counts.most_common())


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
        sampler = Sampler() if spec.get("profile") and epoch == 1 else None
        with sampler or contextlib.nullcontext():
            for count in loader:
                samples += count
                if spec.get("limit") and samples >= spec["limit"]:
                    break  # a peer that reads one object per worker at a time: a capped epoch
        seconds = time.perf_counter() - began
        if sampler is not None:
            with open(f"{spec['profile']}-{spec['loader']}-{spec['config']['endpoint_url'].split(':')[0]}"
                      f"-w{workers}-{os.getpid()}.txt", "w") as out_file:
                out_file.write(sampler.collapsed())
        out = {"samples": samples, "seconds": seconds, "cpu": tree_cpu(me) - cpu}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
