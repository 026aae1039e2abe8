"""Listing snapshots users keep: a prefix's packed listing in a file, read back without a LIST.

``loader ls --save PATH s3://b/p/`` and ``from_prefix(uri, snapshot=PATH)`` write one;
``from_manifest(PATH)`` and ``from_prefix(uri, snapshot=PATH)`` read it back. The file is the
``listing.keyfile`` format (keys, sizes, ETags, the bucket and prefix it came from), mapped, not
loaded. A dataset reading a snapshot asks each GET for the version the snapshot recorded
(``If-Match``), so an object replaced since is an error naming it, and one deleted since is a
``NoSuchKeyError`` (or skipped with ``on_error``): never other bytes under the old name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from ..errors import ConfigError
from ..uri import parse_s3_uri
from .keyfile import Annotations, is_keyfile, open_keys, read_header, write_keys
from .keylist import KeyList


class Snapshot(NamedTuple):
    """A dataset's snapshot file; ``create``: list and write it when it does not exist yet."""

    path: str
    create: bool


def snapshot_option(path: str | os.PathLike[str] | None, setting: str = "snapshot=") -> Snapshot | None:
    """``snapshot=`` of ``from_prefix`` (or the option ``setting`` names), checked now."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ConfigError(f"{setting}{path!r} must be a file path")
    where = Path(path).expanduser().absolute()
    if where.is_dir():
        raise ConfigError(f"{setting}{str(path)!r} is a directory; give a file path")
    if where.exists() and not is_keyfile(where):
        raise ConfigError(f"{setting}{str(path)!r} exists but is not a listing snapshot; "
                          "give a new path (it is written on the first listing) or a file "
                          "that `loader ls --save` wrote")
    return Snapshot(str(where), create=True)


def saved_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """A snapshot file that must exist (``from_manifest``): read, never listed again."""
    return Snapshot(str(Path(path).expanduser().absolute()), create=False)


def is_snapshot(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a listing snapshot (not a text, CSV or JSON lines manifest)."""
    return is_keyfile(path)


def snapshot_uri(path: str | os.PathLike[str], bucket: str | None = None) -> str:
    """``s3://bucket/prefix`` a snapshot was listed from; ``bucket``, if given, must be it."""
    header = read_header(path)
    if header.uri is None:
        raise ConfigError(f"{str(path)!r} holds a key list but not where it was listed from; "
                          "save it with `loader ls --save PATH s3://bucket/prefix/`")
    if bucket is not None and header.source and header.source["bucket"] != bucket:
        raise ConfigError(f"snapshot {str(path)!r} lists bucket {header.source['bucket']!r}, "
                          f"not {bucket!r}")
    return header.uri


def load_snapshot(path: str, uri: str) -> KeyList:
    """The key list in snapshot ``path`` (mapped, checksums verified), which must have been
    listed from ``uri``."""
    keys = open_keys(path, verify=True)
    saved = snapshot_uri(path)
    if saved != uri:
        raise ConfigError(f"snapshot {path!r} was listed from {saved}, not {uri}; pass that "
                          "URI, or a new snapshot path to list this one")
    return keys


def save_snapshot(keys: KeyList, path: str, uri: str,
                  annotate: Callable[[KeyList], Annotations] | None = None) -> KeyList:
    """Write ``keys``, listed from ``uri``, to ``path`` (atomically, durably); the mapped copy.
    ``annotate``: what to keep beside the keys (``keyfile.write_keys``' ``notes``), so that
    reading the snapshot back need not derive it again (how keys group into samples)."""
    bucket, prefix = parse_s3_uri(uri)
    target = Path(path)
    if not target.parent.is_dir():
        raise ConfigError(f"cannot save the snapshot {path!r}: {str(target.parent)!r} is not a "
                          "directory")
    write_keys(keys, target, source={"bucket": bucket, "prefix": prefix}, durable=True,
               notes=None if annotate is None else annotate(keys))
    return open_keys(target)
