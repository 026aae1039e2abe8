"""The disk cache's settings (``cache_dir=``, ``cache_limit=``, ``cache_validate=``), checked
where a dataset is built, before any I/O."""

from __future__ import annotations

import os
from typing import Any

from ..checks import check_int
from ..errors import ConfigError

DEFAULT_CACHE_LIMIT = 10 << 30
VALIDATE_RULES = ("listing", "always", "never")
DEFAULT_VALIDATE = "listing"
MIN_CACHE_LIMIT = 4096


def check_cache_options(
    cache_dir: Any, cache_limit: Any, cache_validate: Any = DEFAULT_VALIDATE
) -> tuple[str | None, int | None]:
    """Validate ``cache_dir=``/``cache_limit=``/``cache_validate=``; return the absolute
    directory and the limit.

    No I/O: the directory is created by the first ``DiskCache`` (in the process that iterates).
    """
    check_validate(cache_validate)
    if cache_dir is None:
        if cache_limit is not None:
            raise ConfigError(f"cache_limit={cache_limit!r} needs cache_dir= (the directory to cache in)")
        return None, None
    check_dir(cache_dir, "cache_dir")
    limit = DEFAULT_CACHE_LIMIT if cache_limit is None else cache_limit
    check_limit(limit, "cache_limit")
    return os.path.abspath(os.path.expanduser(os.fspath(cache_dir))), limit


def check_dir(folder: Any, name: str) -> None:
    """A cache's folder: a non-empty path (created by the first ``DiskCache``, not here)."""
    if not isinstance(folder, (str, os.PathLike)) or not os.fspath(folder):
        raise ConfigError(f"{name}={folder!r} must be a directory path (str or os.PathLike)")


def check_validate(validate: Any, name: str = "cache_validate") -> None:
    """``validate`` must be one of ``VALIDATE_RULES``: ``"listing"`` checks entries against the
    ETags the key list gave, ``"always"`` asks the server, ``"never"`` trusts them (docs/design/cache.md)."""
    if validate not in VALIDATE_RULES:
        raise ConfigError(
            f"{name}={validate!r} must be one of {VALIDATE_RULES}: 'listing' checks cache entries "
            "against the ETags a listing gave, 'always' asks the server with a conditional GET, "
            "'never' trusts them"
        )


def check_limit(limit: Any, name: str) -> int:
    """A cache's size limit in bytes: an int of at least ``MIN_CACHE_LIMIT``."""
    return check_int(name, limit, minimum=MIN_CACHE_LIMIT,
                     must=f"a number of bytes, at least {MIN_CACHE_LIMIT} (e.g. 200 << 30 for 200 GiB)")
