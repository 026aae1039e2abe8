"""Stream training data from S3-compatible object stores into PyTorch, many GETs in flight.

    from loader import AsyncS3Dataset, Limits
    ds = AsyncS3Dataset.from_prefix("s3://bucket/train/", shuffle=True, limits=Limits(concurrency=64))

The top level holds what users touch: the datasets, their option groups, decode helpers, ``checkpoint``,
the shard index readers and every error to catch. Internals stay in their modules; the dev
server for users' own tests is ``loader.testing``. Names resolve on first use (PEP 562), so
``import loader`` is cheap and never imports torch.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

# public name -> module that defines it
_PUBLIC = {
    "AsyncS3Dataset": "loader.datasets.iterable",
    "AsyncS3MapDataset": "loader.datasets.mapped",
    "mix": "loader.datasets.mix",
    "S3Config": "loader.config",
    "RetryPolicy": "loader.retry",
    "ListOptions": "loader.listing.keylist",
    **{name: "loader.datasets.groups" for name in ("Cache", "Limits", "Reading", "Split", "Store")},
    **{name: "loader.decode" for name in ("collate_raw", "decode_image", "decode_images", "decode_sample")},
    "DeviceFeed": "loader.device_feed",
    "read_index": "loader.shard_index.read",
    "read_index_counts": "loader.shard_index.read",
    **{name: "loader.errors" for name in (
        "AccessDeniedError", "BadAnswerError", "ConfigError", "EmptyDatasetError", "EndpointUnreachableError",
        "InvalidRangeError", "LoaderError", "NoCredentialsError", "NoSuchBucketError",
        "NoSuchKeyError", "ObjectChangedError", "ParquetFormatError", "SampleError", "ShardFormatError", "StoreError",
        "TLSError", "ThrottledError", "TransientStoreError",
    )},
}
# public submodules, imported on first use
_SUBMODULES = ("checkpoint",)
# submodules that resolve as attributes (as they always did) but are not top-level names
_QUIET_SUBMODULES = ("decode",)
# names that left the top level: still importable, with a DeprecationWarning naming their home
_MOVED = {
    "DevServer": "loader.testing",
    "EngineLimits": "loader.engine.fetch",
    "EngineStats": "loader.engine.fetch",
    "FetchEngine": "loader.engine.fetch",
    "KeyList": "loader.listing.keylist",
}
# names retired from the public API: still importable, with a DeprecationWarning naming what replaces them
_RETIRED = {
    "LoaderOptions": ("loader.datasets.options", "the keywords and option groups of the datasets' "
                      "constructors (Limits, Split, Store, Reading) replace the flat LoaderOptions"),
}

__all__ = [  # written out for editors and type checkers; tests/test_layout.py checks it against _PUBLIC
    "AccessDeniedError",
    "AsyncS3Dataset",
    "AsyncS3MapDataset",
    "BadAnswerError",
    "Cache",
    "ConfigError",
    "DeviceFeed",
    "EmptyDatasetError",
    "EndpointUnreachableError",
    "InvalidRangeError",
    "Limits",
    "ListOptions",
    "LoaderError",
    "NoCredentialsError",
    "NoSuchBucketError",
    "NoSuchKeyError",
    "ObjectChangedError",
    "ParquetFormatError",
    "Reading",
    "RetryPolicy",
    "S3Config",
    "SampleError",
    "ShardFormatError",
    "Split",
    "Store",
    "StoreError",
    "TLSError",
    "ThrottledError",
    "TransientStoreError",
    "checkpoint",
    "collate_raw",
    "decode_image",
    "decode_images",
    "decode_sample",
    "mix",
    "read_index",
    "read_index_counts",
]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBMODULES or name in _QUIET_SUBMODULES:
        value = importlib.import_module(f"loader.{name}")
    elif name in _MOVED:
        warnings.warn(f"loader.{name} moved: import it from {_MOVED[name]} "
                      f"(`from {_MOVED[name]} import {name}`); the top-level name will be removed",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)  # not cached: warn each time
    elif name in _RETIRED:
        home, instead = _RETIRED[name]
        warnings.warn(f"loader.{name} is deprecated and will be removed in the next release: {instead}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    else:
        raise AttributeError(f"module 'loader' has no attribute {name!r}")
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


if TYPE_CHECKING:  # what editors and type checkers see
    from . import checkpoint
    from .config import S3Config
    from .datasets.groups import Cache, Limits, Reading, Split, Store
    from .datasets.iterable import AsyncS3Dataset
    from .datasets.mapped import AsyncS3MapDataset
    from .datasets.mix import mix
    from .decode import collate_raw, decode_image, decode_images, decode_sample
    from .device_feed import DeviceFeed
    from .errors import (
        AccessDeniedError,
        BadAnswerError,
        ConfigError,
        EmptyDatasetError,
        EndpointUnreachableError,
        InvalidRangeError,
        LoaderError,
        NoCredentialsError,
        NoSuchBucketError,
        NoSuchKeyError,
        ObjectChangedError,
        ParquetFormatError,
        SampleError,
        ShardFormatError,
        StoreError,
        ThrottledError,
        TLSError,
        TransientStoreError,
    )
    from .listing.keylist import ListOptions
    from .retry import RetryPolicy
    from .shard_index.read import read_index, read_index_counts
