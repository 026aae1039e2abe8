"""What is measured: the two workloads and every loader under test, built the same way.

Every loader hands the DataLoader one value per sample: the JPEG's bytes (``raw``) or a decoded
``uint8`` tensor of shape (3, 224, 224), by the usual recipe (``decode``) or this project's fast
path (``fast``), through the very same function. Everything
here is module-level and picklable, so DataLoader workers can be forked or spawned.

Loaders (``LOADERS``):

* ``ours-obj-aioboto3``, ``ours-obj-obstore``: ``AsyncS3Dataset.from_prefix``, ``limits=Limits(concurrency=64)``;
* ``ours-shard-aioboto3``, ``ours-shard-obstore``: ``AsyncS3Dataset.from_shards`` (defaults);
* ``s3tc-map``: s3torchconnector ``S3MapDataset.from_prefix`` (one GET per ``__getitem__``);
* ``s3tc-iter``: s3torchconnector ``S3IterableDataset.from_prefix(enable_sharding=True)``;
* ``wds``: webdataset's own tar expander (``tar_file_expander`` + ``group_by_keys``) over a boto3
  streaming body per shard, split by worker (no ``pipe:`` URL: that puts secrets in ``ps``);
* ``ceiling``: an in-memory ``IterableDataset`` over the same bytes (what the DataLoader and the
  workload alone allow).
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

DECODE_SIZE = (224, 224)
BATCH_SIZE = 32
PREFETCH_FACTOR = 2
MAX_INFLIGHT = 64


# ----------------------------------------------------------------------------- workloads


def raw(data: bytes) -> bytes:
    """Bytes handed through untouched."""
    return bytes(data)


def decode(data: bytes) -> torch.Tensor:
    """The usual recipe: PIL decode -> RGB -> resize 224x224 BILINEAR -> uint8 CHW tensor."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        pixels = np.asarray(image.convert("RGB").resize(DECODE_SIZE, Image.Resampling.BILINEAR))
    # HWC -> CHW in numpy: no torch op, so no intra-op thread pool is involved (see child.py)
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def fast(data: bytes) -> torch.Tensor:
    """This project's fast path: ``loader.decode.decode_image(data, (224, 224))``."""
    from loader.decode import decode_image

    return decode_image(data, DECODE_SIZE)


WORKLOADS: dict[str, Callable[[bytes], Any]] = {"raw": raw, "decode": decode, "fast": fast}


@dataclasses.dataclass(frozen=True)
class FromSample:
    """A WebDataset-convention sample dict -> workload(sample["jpg"]) (ours, webdataset)."""

    workload: str

    def __call__(self, sample: dict[str, Any]) -> Any:
        return WORKLOADS[self.workload](sample["jpg"])


@dataclasses.dataclass(frozen=True)
class FromReader:
    """An s3torchconnector ``S3Reader`` -> workload(reader.read())."""

    workload: str

    def __call__(self, reader: Any) -> Any:
        return WORKLOADS[self.workload](reader.read())


# ----------------------------------------------------------------------------- context


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a loader reads from: an endpoint (the server, or a latency proxy in front of it)."""

    endpoint_url: str
    region: str
    bucket: str
    objects_prefix: str
    shard_keys: tuple[str, ...]
    blob: str  # local file with the same sample bytes, for the in-memory ceiling

    def s3_config(self) -> Any:
        """Our ``S3Config``: credentials from the environment (never from arguments)."""
        from loader.config import S3Config

        return S3Config(endpoint_url=self.endpoint_url, region=self.region,
                        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                        addressing_style="path")

    @property
    def objects_uri(self) -> str:
        return f"s3://{self.bucket}/{self.objects_prefix}"

    @property
    def shard_uris(self) -> list[str]:
        return [f"s3://{self.bucket}/{key}" for key in self.shard_keys]


# ----------------------------------------------------------------------------- builders


def ours_objects(target: Target, workload: str, store: str) -> Any:
    from loader import AsyncS3Dataset, Limits

    return AsyncS3Dataset.from_prefix(target.objects_uri, limits=Limits(concurrency=MAX_INFLIGHT), store=store,
                                      config=target.s3_config(), transform=FromSample(workload))


def ours_shards(target: Target, workload: str, store: str) -> Any:
    from loader import AsyncS3Dataset

    return AsyncS3Dataset.from_shards(target.shard_uris, store=store, config=target.s3_config(),
                                      transform=FromSample(workload))


def _s3tc_kwargs(target: Target, workload: str) -> dict[str, Any]:
    from s3torchconnector import S3ClientConfig

    # credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment (its only ways)
    return dict(region=target.region, endpoint=target.endpoint_url, transform=FromReader(workload),
                s3client_config=S3ClientConfig(force_path_style=True))


def s3tc_map(target: Target, workload: str) -> Any:
    from s3torchconnector import S3MapDataset

    return S3MapDataset.from_prefix(target.objects_uri, **_s3tc_kwargs(target, workload))


def s3tc_iterable(target: Target, workload: str) -> Any:
    from s3torchconnector import S3IterableDataset

    return S3IterableDataset.from_prefix(target.objects_uri, enable_sharding=True,
                                         **_s3tc_kwargs(target, workload))


@dataclasses.dataclass
class Boto3ShardOpener:
    """A webdataset pipeline stage: ``{"url": "s3://b/k"}`` -> ``{"url", "stream"}`` where the
    stream is boto3's streaming body. One client per process, made on first use (fork-safe);
    credentials come from the environment, so nothing secret is in a URL or a command line."""

    endpoint_url: str
    region: str

    def __post_init__(self) -> None:
        self._client: Any = None
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint_url, "region": self.region, "_client": None, "_pid": None}

    def client(self) -> Any:
        if self._client is None or self._pid != os.getpid():
            import boto3
            from botocore.config import Config

            self._client = boto3.client("s3", endpoint_url=self.endpoint_url, region_name=self.region,
                                        config=Config(s3={"addressing_style": "path"}))
            self._pid = os.getpid()
        return self._client

    def __call__(self, source: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for item in source:
            bucket, _, key = item["url"][len("s3://"):].partition("/")
            body = self.client().get_object(Bucket=bucket, Key=key)["Body"]
            try:
                yield {**item, "stream": body}
            finally:
                body.close()


def _wds_expand(source: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """webdataset's own tar expander and key grouping (``tarfile_samples`` minus ``gopen``)."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    return group_by_keys(tar_file_expander(source))


def webdataset_shards(target: Target, workload: str) -> Any:
    import webdataset as wds

    return wds.DataPipeline(
        wds.SimpleShardList(target.shard_uris),
        wds.split_by_worker,
        Boto3ShardOpener(target.endpoint_url, target.region),
        _wds_expand,
        wds.map(FromSample(workload)),
    )


class InMemory(IterableDataset):
    """The ceiling: the same bytes from RAM, split across workers, through the same workload."""

    def __init__(self, blob: str, workload: str) -> None:
        from .data import read_blob

        self.items = read_blob(blob)
        self.workload = workload

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        fn = WORKLOADS[self.workload]
        for data in self.items[worker::workers]:
            yield fn(data)


def ceiling(target: Target, workload: str) -> Any:
    return InMemory(target.blob, workload)


@dataclasses.dataclass(frozen=True)
class Loader:
    name: str
    family: str  # "ours", "peer" or "ceiling"
    mode: str  # "objects", "shards" or "memory"
    label: str
    build: Callable[..., Any]
    args: tuple[Any, ...] = ()

    def dataset(self, target: Target, workload: str) -> Any:
        return self.build(target, workload, *self.args)

    @property
    def uses_network(self) -> bool:
        return self.mode != "memory"


LOADERS: dict[str, Loader] = {loader.name: loader for loader in (
    Loader("ceiling", "ceiling", "memory", "in-memory ceiling (DataLoader + workload only)", ceiling),
    Loader("ours-obj-aioboto3", "ours", "objects", "AsyncS3Dataset.from_prefix, aioboto3, 64 in flight",
           ours_objects, ("aioboto3",)),
    Loader("ours-obj-obstore", "ours", "objects", "AsyncS3Dataset.from_prefix, obstore, 64 in flight",
           ours_objects, ("obstore",)),
    Loader("ours-shard-aioboto3", "ours", "shards", "AsyncS3Dataset.from_shards, aioboto3",
           ours_shards, ("aioboto3",)),
    Loader("ours-shard-obstore", "ours", "shards", "AsyncS3Dataset.from_shards, obstore",
           ours_shards, ("obstore",)),
    Loader("s3tc-map", "peer", "objects", "s3torchconnector S3MapDataset.from_prefix", s3tc_map),
    Loader("s3tc-iter", "peer", "objects",
           "s3torchconnector S3IterableDataset.from_prefix(enable_sharding=True)", s3tc_iterable),
    Loader("wds", "peer", "shards", "webdataset tar expander over boto3 streaming bodies",
           webdataset_shards),
)}


def dataloader_kwargs(workers: int) -> dict[str, Any]:
    """The one set of DataLoader settings every loader gets."""
    return dict(batch_size=BATCH_SIZE, num_workers=workers,
                prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
                persistent_workers=workers > 0)
