"""Stream training data from S3-compatible object stores into PyTorch, many GETs in flight.

    from loader import AsyncS3Dataset
    ds = AsyncS3Dataset.from_prefix("s3://bucket/train/", shuffle=True, max_inflight=64)

Importing this package has no side effects: no thread, connection or hook until iteration.
"""

from . import checkpoint
from .config import S3Config
from .dataset import AsyncS3Dataset, LoaderOptions
from .decode import decode_sample
from .mapdataset import AsyncS3MapDataset
from .packing import read_index, read_index_counts
from .engine import EngineLimits, EngineStats, FetchEngine
from .errors import (
    AccessDeniedError,
    ConfigError,
    EmptyDatasetError,
    EndpointUnreachableError,
    InvalidRangeError,
    LoaderError,
    NoSuchBucketError,
    NoSuchKeyError,
    SampleError,
    ShardFormatError,
    StoreError,
    TransientStoreError,
)
from .retry import RetryPolicy

__all__ = [
    "AccessDeniedError",
    "AsyncS3Dataset",
    "AsyncS3MapDataset",
    "ConfigError",
    "EmptyDatasetError",
    "EndpointUnreachableError",
    "EngineLimits",
    "EngineStats",
    "FetchEngine",
    "InvalidRangeError",
    "LoaderError",
    "LoaderOptions",
    "NoSuchBucketError",
    "NoSuchKeyError",
    "RetryPolicy",
    "S3Config",
    "SampleError",
    "ShardFormatError",
    "StoreError",
    "TransientStoreError",
    "checkpoint",
    "decode_sample",
    "read_index",
    "read_index_counts",
]
__version__ = "0.1.0"
