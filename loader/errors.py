"""Every error the loader raises, in one tree; each also subclasses the builtin it really is::

    LoaderError
    ├── ConfigError (ValueError)                 a bad setting or variable; raised before any I/O
    │   └── NoCredentialsError                   none anywhere in the chain; lists what was tried
    ├── StoreError                               talking to the object store failed
    │   ├── TransientStoreError                  worth retrying: 5xx, SlowDown, reset, short body
    │   │   ├── BadAnswerError                   not what was asked (status, range, length, ETag, framing)
    │   │   ├── ThrottledError                   SlowDown, 503, 429: the service asks for fewer requests
    │   │   └── EndpointUnreachableError (ConnectionError)
    │   ├── TLSError (ConnectionError)           a certificate that does not verify, or http
    │   ├── AccessDeniedError (PermissionError)  403
    │   ├── NoSuchBucketError (FileNotFoundError)
    │   ├── NoSuchKeyError (FileNotFoundError)
    │   ├── InvalidRangeError (ValueError)
    │   └── ObjectChangedError                   replaced during a read; never retried or spliced
    ├── EmptyDatasetError (ValueError)           a prefix or manifest with nothing in it
    ├── ShardFormatError (ValueError)            a tar shard truncated, corrupt or not a tar
    │   └── ParquetFormatError                   a Parquet file whose footer or pages do not decode
    └── SampleError                              a sample failed after fetching (``transform``)

Backend errors are translated into these in one place per backend (``loader/s3/*``) with
``raise ... from exc``. Messages name the bucket, key (and shard offset) at fault and say what
to do; secrets never appear in them.
"""

from __future__ import annotations

import logging
import warnings


class LoaderError(Exception):
    """Base class of every error raised by this package."""


class ConfigError(LoaderError, ValueError):
    """A setting or environment variable is invalid; the message names it and shows how to fix it."""


class NoCredentialsError(ConfigError):
    """No credentials in S3Config, the environment, the profile files or the instance's role.

    ``tried`` names each source looked at (never a value), so a caller such as the CLI can
    give its own advice.
    """

    def __init__(self, message: str, *, endpoint: str = "", tried: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.tried = tried

    def __reduce__(self):
        return (_rebuild_no_credentials, (type(self), str(self), self.endpoint, self.tried))


def _rebuild_no_credentials(cls, message, endpoint, tried):
    return cls(message, endpoint=endpoint, tried=tried)


class StoreError(LoaderError):
    """A request to the object store failed; ``bucket`` and ``key`` say for what."""

    def __init__(self, message: str, *, bucket: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.key = key

    def __reduce__(self):  # keep bucket/key when crossing a DataLoader worker boundary
        return (_rebuild_store_error, (type(self), str(self), self.bucket, self.key))


def _rebuild_store_error(cls, message, bucket, key):
    return cls(message, bucket=bucket, key=key)


class TransientStoreError(StoreError):
    """A fault that may go away on its own (5xx, SlowDown, reset, timeout, truncated body).
    ``endpoint``: the endpoint whose answer it is, where one answered (the final error names it)."""

    def __init__(self, message: str, *, bucket: str | None = None, key: str | None = None,
                 endpoint: str = "") -> None:
        super().__init__(message, bucket=bucket, key=key)
        self.endpoint = endpoint

    def __reduce__(self):  # the endpoint too: a DataLoader worker's error reaches the parent pickled
        return (_rebuild_transient, (type(self), str(self), self.bucket, self.key, self.endpoint))


def _rebuild_transient(cls, message, bucket, key, endpoint):
    return cls(message, bucket=bucket, key=key, endpoint=endpoint)


class BadAnswerError(TransientStoreError):
    """The server answered, but not what was asked for: another status, range, length, ETag or
    coding, or an answer that broke HTTP's framing. Nothing of it is used; it is retried a few
    times (a proxy or cache may have mixed answers up), not for the whole deadline, then raised
    naming the request and what came back (docs/design/stores.md)."""


class ThrottledError(TransientStoreError):
    """The service asked for fewer requests (SlowDown, 503, 429): retried, and the engine sends
    fewer requests to that endpoint and bucket for a while (docs/design/retry.md).
    ``retry_after``: the seconds its ``Retry-After`` asked for, when it sent one."""

    def __init__(self, message: str, *, bucket: str | None = None, key: str | None = None,
                 endpoint: str = "", retry_after: float | None = None) -> None:
        super().__init__(message, bucket=bucket, key=key, endpoint=endpoint)
        self.retry_after = retry_after

    def __reduce__(self):  # Retry-After too, as the other fields cross a worker boundary
        return (_rebuild_throttled, (type(self), str(self), self.bucket, self.key, self.endpoint,
                                     self.retry_after))


def _rebuild_throttled(cls, message, bucket, key, endpoint, retry_after):
    return cls(message, bucket=bucket, key=key, endpoint=endpoint, retry_after=retry_after)


class EndpointUnreachableError(TransientStoreError, ConnectionError):
    """Nothing answered at the endpoint (``endpoint``). Transient until the retry deadline passes
    once the endpoint has answered; before that (its first contact), it is given up within seconds,
    since a wrong endpoint is far likelier than an outage (docs/design/retry.md)."""


class TLSError(StoreError, ConnectionError):
    """The TLS handshake failed (certificate not trusted, wrong host name, expired, or a
    plain-http server behind an https:// endpoint). Permanent: the fix is configuration."""


class AccessDeniedError(StoreError, PermissionError):
    """403: the credentials are wrong, expired or lack permission for this bucket/key."""


class NoSuchBucketError(StoreError, FileNotFoundError):
    """The bucket does not exist at this endpoint."""


class NoSuchKeyError(StoreError, FileNotFoundError):
    """The key does not exist in the bucket."""


class InvalidRangeError(StoreError, ValueError):
    """A ranged GET asked for bytes past the end of the object."""


class ObjectChangedError(StoreError):
    """The object was overwritten while a read that spans several requests was under way.

    Such a read pins the ETag of its first response and sends it as ``If-Match`` with every
    later request; the server's 412 PreconditionFailed (or a response with another ETag) means
    the bytes read so far belong to a version that no longer exists. The read stops rather
    than assemble anything from two versions; reading the object again gets the new version.
    """


class EmptyDatasetError(LoaderError, ValueError):
    """A prefix listing or manifest produced no objects."""


class ShardFormatError(LoaderError, ValueError):
    """A tar shard is truncated, corrupt or not a tar at all; names the shard URL and byte offset."""

    def __init__(self, message: str, *, url: str = "", offset: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.offset = offset

    def __reduce__(self):
        return (_rebuild_shard_error, (type(self), str(self), self.url, self.offset))


def _rebuild_shard_error(cls, message, url, offset):
    return cls(message, url=url, offset=offset)


class ParquetFormatError(ShardFormatError):
    """A Parquet file whose footer is corrupt or truncated, or whose pages do not decode; names the
    file (and the row group). A kind of shard error, so ``on_error`` treats a row group as a shard."""


class SampleError(LoaderError):
    """Turning a fetched object into a sample failed (e.g. ``transform`` raised); names the key
    (``url``) and keeps the original error as ``__cause__``."""

    def __init__(self, message: str, *, url: str = "") -> None:
        super().__init__(message)
        self.url = url

    def __reduce__(self):
        return (_rebuild_sample_error, (type(self), str(self), self.url, self.__cause__))


def _rebuild_sample_error(cls, message, url, cause):
    err = cls(message, url=url)
    err.__cause__ = cause
    return err


def say_skipped(message: str, on_error: str, log: logging.Logger, *, level: int = logging.WARNING,
                stacklevel: int = 1) -> None:
    """Say what ``on_error="skip"`` or ``"warn"`` dropped, once: a ``RuntimeWarning`` for
    ``"warn"`` (``stacklevel`` counted from the caller), else a log line at ``level``."""
    if on_error == "warn":
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    else:
        log.log(level, message)
