"""Stream training data from S3-compatible object stores into PyTorch, many GETs in flight.

    from loader import AsyncS3Dataset
    ds = AsyncS3Dataset.from_prefix("s3://bucket/train/", shuffle=True, max_inflight=64)

The package is laid out along the data path; arrows run one way (tools → datasets → formats →
engine → stores → foundation):

* ``config``, ``uri``, ``errors``, ``retry``: the foundation every layer uses;
* ``stores/``: the ``ObjectStore`` protocol, its backends and the wrappers that are stores too;
* ``engine/``: many requests in flight in one background loop, a buffer bounded by bytes;
* ``formats/``: how bytes become samples (tar shards, one object per sample) and shard packing;
* ``datasets/``: the PyTorch datasets, their options, partitioning, shuffling and stats;
* ``decode``, ``checkpoint``: images to tensors, and ``torch.save``/``load`` through S3;
* ``tools/``: the ``python -m loader`` command line, never imported by the data path.

Importing this package is cheap and has no side effects: public names resolve on first use
(PEP 562), so the command line's verbs that need no torch never import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

# public name -> module that defines it
_PUBLIC = {
    "AsyncS3Dataset": "loader.datasets.iterable",
    "AsyncS3MapDataset": "loader.datasets.mapped",
    "LoaderOptions": "loader.datasets.options",
    "S3Config": "loader.config",
    "RetryPolicy": "loader.retry",
    "ListOptions": "loader.stores.listing",
    "KeyList": "loader.stores.listing",
    "EngineLimits": "loader.engine.fetch",
    "EngineStats": "loader.engine.fetch",
    "FetchEngine": "loader.engine.fetch",
    "decode_sample": "loader.decode",
    "mix": "loader.datasets.mix",
    "read_index": "loader.datasets.shard_index",
    "read_index_counts": "loader.datasets.shard_index",
    "DevServer": "loader.tools.devserver",
    **{name: "loader.errors" for name in (
        "AccessDeniedError", "ConfigError", "EmptyDatasetError", "EndpointUnreachableError",
        "InvalidRangeError", "LoaderError", "NoCredentialsError", "NoSuchBucketError",
        "NoSuchKeyError", "ObjectChangedError", "SampleError",
        "ShardFormatError", "StoreError", "TLSError", "TransientStoreError",
    )},
}
_SUBMODULES = ("checkpoint", "decode")

__all__ = [
    "AccessDeniedError",
    "AsyncS3Dataset",
    "AsyncS3MapDataset",
    "ConfigError",
    "DevServer",
    "EmptyDatasetError",
    "EndpointUnreachableError",
    "EngineLimits",
    "EngineStats",
    "FetchEngine",
    "InvalidRangeError",
    "KeyList",
    "ListOptions",
    "LoaderError",
    "LoaderOptions",
    "NoCredentialsError",
    "NoSuchBucketError",
    "NoSuchKeyError",
    "ObjectChangedError",
    "RetryPolicy",
    "S3Config",
    "SampleError",
    "ShardFormatError",
    "StoreError",
    "TLSError",
    "TransientStoreError",
    "checkpoint",
    "decode",
    "decode_sample",
    "mix",
    "read_index",
    "read_index_counts",
]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"loader.{name}")
    else:
        raise AttributeError(f"module 'loader' has no attribute {name!r}")
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # what editors and type checkers see
    from . import checkpoint, decode
    from .config import S3Config
    from .datasets.iterable import AsyncS3Dataset
    from .datasets.mapped import AsyncS3MapDataset
    from .datasets.mix import mix
    from .datasets.options import LoaderOptions
    from .datasets.shard_index import read_index, read_index_counts
    from .decode import decode_sample
    from .engine.fetch import EngineLimits, EngineStats, FetchEngine
    from .errors import (
        AccessDeniedError,
        ConfigError,
        EmptyDatasetError,
        EndpointUnreachableError,
        InvalidRangeError,
        LoaderError,
        NoCredentialsError,
        NoSuchBucketError,
        NoSuchKeyError,
        ObjectChangedError,
        SampleError,
        ShardFormatError,
        StoreError,
        TLSError,
        TransientStoreError,
    )
    from .retry import RetryPolicy
    from .stores.listing import KeyList, ListOptions
    from .tools.devserver import DevServer
