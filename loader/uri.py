"""``s3://bucket/key`` URIs and WebDataset brace patterns (``train-{00000..00127}.tar``).

Pure string work, so errors here come before any request and name the URI at fault.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from typing import NamedTuple

from .errors import ConfigError

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{2,254}$")
_BRACE_RE = re.compile(r"\{([^{}]*)\}")
_RANGE_RE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
MAX_EXPANSION = 10_000_000


class S3Uri(NamedTuple):
    """A parsed ``s3://bucket/key`` (key may be a prefix or empty)."""

    bucket: str
    key: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def parse_s3_uri(uri: str) -> S3Uri:
    """Split ``s3://bucket/key`` into bucket and key; reject anything else with advice."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ConfigError(f"{uri!r} is not an S3 URI; write it as 's3://bucket/prefix/'")
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not _BUCKET_RE.match(bucket):
        raise ConfigError(
            f"{uri!r}: {bucket!r} is not a valid bucket name "
            "(3-255 lowercase letters, digits, '.', '-', '_')"
        )
    return S3Uri(bucket, key)


BUCKET_NAME_RULE = (
    "3-63 characters of lowercase letters, digits, dots and hyphens, starting and ending with a "
    "letter or digit, no '..', not an IP address"
)
_NEW_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]*[a-z0-9]$")
_IP_RE = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


def bucket_name_problem(name: str) -> str | None:
    """What breaks S3's rules for a *new* bucket's name (``BUCKET_NAME_RULE``), or None.

    Reading accepts more (``parse_s3_uri``: old buckets may hold underscores); creating one
    needs these rules, which S3, MinIO and SeaweedFS enforce alike."""
    if not isinstance(name, str):
        return f"{name!r} is not a string"
    if not 3 <= len(name) <= 63:
        return f"it has {len(name)} character(s)"
    if not _NEW_BUCKET_RE.match(name):
        bad = sorted({c for c in name if not (c.islower() or c.isdigit() or c in ".-") or not c.isascii()})
        return f"it holds {', '.join(map(repr, bad))}" if bad else "it starts or ends with '.' or '-'"
    if ".." in name:
        return "it holds '..'"
    if _IP_RE.match(name):
        return "it is written like an IP address"
    return None


def check_bucket_name(name: str, setting: str = "bucket") -> str:
    """``name`` if it may name a new bucket; else a ``ConfigError`` naming ``setting``, the
    name, what is wrong and the rule (before any server or request is started)."""
    problem = bucket_name_problem(name)
    if problem is not None:
        raise ConfigError(f"{setting} {name!r} is not a valid bucket name ({problem}); use {BUCKET_NAME_RULE}")
    return name


def object_url(bucket: str, key: str) -> str:
    """The ``s3://`` URL of one object (what samples carry as ``__url__``)."""
    return f"s3://{bucket}/{key}"


def expand_braces(pattern: str) -> list[str]:
    """Expand every ``{a..b}`` (zero padding kept) and ``{x,y,z}`` group, left to right.

    >>> expand_braces("s-{00..02}.tar")
    ['s-00.tar', 's-01.tar', 's-02.tar']
    >>> expand_braces("{a,b}-{1..2}")
    ['a-1', 'a-2', 'b-1', 'b-2']
    """
    pieces: list[list[str]] = []
    pos = 0
    total = 1
    for match in _BRACE_RE.finditer(pattern):
        literal = pattern[pos:match.start()]
        if "{" in literal or "}" in literal:
            raise ConfigError(f"{pattern!r} has an unbalanced or nested brace")
        pieces.append([literal])
        options = _expand_group(match.group(1), pattern)
        total *= len(options)
        if total > MAX_EXPANSION:
            raise ConfigError(f"{pattern!r} expands to more than {MAX_EXPANSION:,} names")
        pieces.append(options)
        pos = match.end()
    pieces.append([pattern[pos:]])
    rest = pattern[pos:]
    if "{" in rest or "}" in rest:
        raise ConfigError(f"{pattern!r} has an unbalanced or nested brace")
    return ["".join(parts) for parts in itertools.product(*pieces)]


def _expand_group(body: str, pattern: str) -> list[str]:
    match = _RANGE_RE.match(body)
    if match:
        lo_text, hi_text = match.groups()
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ConfigError(f"{pattern!r}: range {{{body}}} runs backwards; write {{{hi_text}..{lo_text}}}")
        if hi - lo + 1 > MAX_EXPANSION:  # check before building the list, not after
            raise ConfigError(f"{pattern!r} expands to more than {MAX_EXPANSION:,} names")
        # zero padding as in bash and braceexpand: a leading zero on either end pads to the wider end
        padded = any(t.lstrip("-").startswith("0") and t.lstrip("-") != "0" for t in (lo_text, hi_text))
        width = max(len(lo_text), len(hi_text)) if padded else 0
        return [str(i).zfill(width) for i in range(lo, hi + 1)]
    if "," in body:
        return body.split(",")
    raise ConfigError(f"{pattern!r}: {{{body}}} is neither a range {{a..b}} nor a list {{x,y}}")


def sibling_matches(prefix: str, keys: Iterable[str]) -> list[str]:
    """What a folder-like prefix without its trailing slash matched besides its folder.

    ``"train/imgs"`` names the folder ``train/imgs/`` but, as a prefix, matches
    ``train/imgs-shards/...`` and ``train/imgs.txt`` too: those are returned (folders with their
    slash, in sorted order). Nothing is returned when the prefix ends in a slash, when it is no
    folder's full name (``"train/img0"`` is a partial name, meant to match many), or when only
    the folder matched.
    """
    if not prefix or prefix.endswith("/"):
        return []
    folder = prefix + "/"
    others: set[str] = set()
    named_a_folder = False
    for key in keys:
        if key.startswith(folder):
            named_a_folder = True
            continue
        slash = key.find("/", len(prefix))
        others.add(key if slash < 0 else key[:slash + 1])
    return sorted(others) if named_a_folder else []
