"""Per-object samples: which objects form one sample, its class label, and the job that fetches it.

Objects whose keys share a stem (up to the first dot of the basename, WebDataset's rule) form one
sample, each adding the field its extension names. A ``SampleIndex`` counts samples, not objects,
for partitioning, resume and map-style indices; labels come from the parent folder (as
``ImageFolder`` numbers them) or a manifest. The rules: docs/objects.md.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import anyio

from ..engine.fetch import Job, JobContext
from ..errors import ConfigError, NoSuchKeyError, SampleError
from ..retry import call_with_retries
from ..uri import object_url
from .grouping import NO_EXTENSION_FIELD, split_key

LabelFrom = Literal["parent"]
LABEL_SOURCES = ("parent",)
LABEL_FIELD = "cls"
RESERVED_FIELDS = ("__key__", "__url__", "__index__")
Label = int | str


def field_of(key: str) -> str:
    """The sample field an object fills: its extension (``"data"`` when it has none)."""
    return split_key(key)[1] or NO_EXTENSION_FIELD


def is_hidden(key: str) -> bool:
    """Whether the basename starts with a dot (``.DS_Store``, ``._x.jpg``): never a sample."""
    return key.startswith(".", key.rfind("/") + 1)


def class_folder(key: str, root: str) -> str | None:
    """The class of ``key`` under the folder ``root`` (``""`` or ending in ``/``), as
    ``ImageFolder`` reads it: the first folder below the root (``"a/cat/x/1.jpg"``, ``"a/"`` ->
    ``"cat"``); None for a key directly in the root or outside it."""
    if not key.startswith(root):
        return None
    folder, slash, _ = key[len(root):].partition("/")
    return folder if slash and folder else None


def class_root(keys: Sequence[str], prefix: str | None) -> str:
    """The folder whose subfolders are the classes.

    For a listed ``prefix``, the folder it names: itself when it ends in ``/``; ``prefix + "/"``
    when every key lies in that folder (``s3://b/train`` reads as ``s3://b/train/``); else the
    folder it sits in (it matched siblings too, each read as a class folder of that folder).
    For a key list (``prefix`` None), the deepest folder that still leaves every key inside a
    class folder below it (``a/cat/1.jpg`` + ``a/dog/x/2.jpg`` -> ``"a/"``).
    """
    if prefix is not None:
        if prefix.endswith("/") or not prefix:
            return prefix
        folder = prefix + "/"
        if all(key.startswith(folder) for key in keys):
            return folder
        return prefix[: prefix.rfind("/") + 1]
    common: list[str] | None = None  # the folders above every key's own folder, shared by all
    for key in keys:
        above = key.split("/")[:-2]
        if common is None:
            common = above
        else:
            n = 0
            while n < min(len(common), len(above)) and common[n] == above[n]:
                n += 1
            del common[n:]
        if not common:
            return ""
    return "".join(part + "/" for part in common or ())


@dataclasses.dataclass(frozen=True, eq=False)
class SampleIndex:
    """Samples over object keys: sample ``i`` is ``keys[starts[i]:starts[i + 1]]``.

    ``labels`` holds one class index per sample when the samples carry a label; ``classes``
    names the classes (index -> name) when labels came from names.
    """

    keys: tuple[str, ...]
    starts: array
    labels: array | None = None
    classes: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return len(self.starts) - 1

    def objects(self, index: int) -> tuple[str, ...]:
        """The keys of sample ``index``, in key order."""
        return self.keys[self.starts[index]:self.starts[index + 1]]

    def stem(self, index: int) -> str:
        return split_key(self.keys[self.starts[index]])[0]

    def label(self, index: int) -> int | None:
        return None if self.labels is None else self.labels[index]

    @property
    def class_to_idx(self) -> dict[str, int] | None:
        return None if self.classes is None else {name: i for i, name in enumerate(self.classes)}

    def sample(self, bucket: str, index: int, bodies: Sequence[bytes]) -> dict[str, Any]:
        """The sample dict of ``index`` from its objects' bodies (in ``objects(index)`` order)."""
        keys = self.objects(index)
        out: dict[str, Any] = {"__key__": split_key(keys[0])[0], "__url__": object_url(bucket, keys[0])}
        for key, body in zip(keys, bodies):
            out[field_of(key)] = body
        if self.labels is not None:
            out[LABEL_FIELD] = self.labels[index]
        return out


def build_index(
    keys: Sequence[str],
    *,
    group: bool = True,
    label_from: LabelFrom | None = None,
    labels: Sequence[Label | None] | None = None,
    where: str = "",
    prefix: str | None = None,
) -> SampleIndex:
    """Group ``keys`` into samples (first appearance of each stem decides the sample order).

    ``labels``: one label per key (or None where a row gave none); every sample needs exactly
    one value among its keys. ``where`` names the source in errors (a prefix URL, a manifest).
    ``prefix``: with ``label_from="parent"``, the prefix listed (None for a key list); the
    classes are the folders right under the root it names (``class_root``); objects directly in
    that root have no class folder and are an error (``ImageFolder`` reads only the class
    folders under its root).
    """
    if label_from is not None and label_from not in LABEL_SOURCES:
        raise ConfigError(f"label_from={label_from!r} must be 'parent' or None")
    if label_from is not None and labels is not None:
        raise ConfigError(f"{where} carries a label column; label_from={label_from!r} would "
                          "replace it: use one or the other")
    if labels is not None and len(labels) != len(keys):
        raise ValueError(f"{len(labels)} labels for {len(keys)} keys")
    members: dict[str, list[int]] = {}
    if group:
        for position, key in enumerate(keys):
            members.setdefault(split_key(key)[0], []).append(position)
    groups = list(members.values()) if group else [[position] for position in range(len(keys))]
    ordered: list[str] = []
    starts = array("q", [0])
    for positions in groups:
        fields: dict[str, str] = {}
        for position in positions:
            key = keys[position]
            field = field_of(key)
            if field in RESERVED_FIELDS:
                raise ConfigError(f"{_object(where, key)} has the extension {field!r}, which is a "
                                  "reserved sample field; rename it")
            if field in fields:
                raise ConfigError(
                    f"{_object(where, key)} and {fields[field]!r} both give field {field!r} of "
                    f"sample {split_key(key)[0]!r}; rename one, or pass group=False to read every "
                    "object as a sample of its own")
            if field == LABEL_FIELD and (label_from is not None or labels is not None):
                raise ConfigError(
                    f"{_object(where, key)} fills the field {LABEL_FIELD!r}, where the label "
                    f"({'label_from=' + repr(label_from) if label_from else 'label column'}) goes; "
                    "use the objects or the label, not both")
            fields[field] = key
            ordered.append(key)
        starts.append(len(ordered))
    index = SampleIndex(tuple(ordered), starts)
    if label_from == "parent":
        root = class_root(index.keys, prefix)
        return _with_names(index, [_parent_label(index, i, where, root) for i in range(len(index))])
    if labels is not None:
        order = [position for positions in groups for position in positions]
        per_sample = [_one_label(index, i, [labels[p] for p in order[index.starts[i]:index.starts[i + 1]]],
                                 where) for i in range(len(index))]
        numbers = [label for label in per_sample if isinstance(label, int)]
        names = [label for label in per_sample if isinstance(label, str)]
        if len(numbers) == len(per_sample):
            return dataclasses.replace(index, labels=array("q", numbers))
        if len(names) == len(per_sample):
            return _with_names(index, names)
        raise ConfigError(f"{where}: labels mix class names and integers; use one kind")
    return index


def _with_names(index: SampleIndex, names: list[str]) -> SampleIndex:
    classes = tuple(sorted(set(names)))
    number = {name: i for i, name in enumerate(classes)}
    return dataclasses.replace(index, labels=array("q", (number[name] for name in names)),
                               classes=classes)


def _parent_label(index: SampleIndex, i: int, where: str, root: str) -> str:
    key = index.keys[index.starts[i]]
    name = class_folder(key, root)
    if name is None:
        inside = f" under {where}" if where else ""
        raise ConfigError(
            f"label_from='parent': {key!r} is not in a class folder{inside} (expected "
            f"{root}<class>/<file>, as ImageFolder reads them); move it into one, or list only "
            "the class folders")
    return name


def _one_label(index: SampleIndex, i: int, given: list[Label | None], where: str) -> Label:
    values = {label for label in given if label is not None}
    if len(values) == 1:
        return values.pop()
    stem = index.stem(i)
    if not values:
        raise ConfigError(f"{where}: sample {stem!r} has no label; give every row a label")
    raise ConfigError(f"{where}: the rows of sample {stem!r} disagree on its label "
                      f"({sorted(map(repr, values))}); give them one")


def _object(where: str, key: str) -> str:
    return f"{where}: object {key!r}" if where else f"object {key!r}"


# ----------------------------------------------------------------------------- fetching

OnError = Literal["raise", "skip", "warn"]
ON_ERROR = ("raise", "skip", "warn")


class Skipped(NamedTuple):
    """Emitted instead of a sample that ``on_error`` skipped: what failed, for the warning."""

    url: str
    reason: str


def skippable(exc: BaseException) -> bool:
    """Whether ``on_error`` may skip past ``exc``: a fault of one sample (an object gone since
    the listing, a transform that raised on it), not one every sample would meet next (a missing
    library behind a transform, memory running out), which would skip the whole epoch."""
    if isinstance(exc, NoSuchKeyError):
        return True
    return isinstance(exc, SampleError) and not isinstance(exc.__cause__, (ImportError, MemoryError))


def object_sample(bucket: str, key: str, data: bytes) -> dict[str, Any]:
    """``{"__key__": "train/000123", "__url__": "s3://b/train/000123.jpg", "jpg": b"..."}``."""
    stem, ext = split_key(key)
    return {"__key__": stem, "__url__": object_url(bucket, key), ext or NO_EXTENSION_FIELD: data}


def object_job(bucket: str, key: str, position: int) -> Job:
    """Fetch ``s3://bucket/key`` with one GET (retried) and emit ``(position, sample)``.

    One request cannot mix versions, so nothing is pinned.
    """

    async def job(ctx: JobContext) -> None:
        data = await call_with_retries(lambda: ctx.store.get(bucket, key), ctx.retry,
                                       on_retry=ctx.retried)
        await ctx.emit((position, object_sample(bucket, key, data)), len(data))

    return job


async def fetch_all(ctx: JobContext, bucket: str, keys: Sequence[str]) -> list[bytes]:
    """Every object of ``keys`` (one GET each, retried), concurrently; the first failure
    cancels the others and is raised as itself (not wrapped in an exception group).

    One request cannot mix versions, so nothing is pinned.
    """

    async def get(key: str) -> bytes:
        return await call_with_retries(lambda: ctx.store.get(bucket, key), ctx.retry,
                                       on_retry=ctx.retried)

    if len(keys) == 1:
        return [await get(keys[0])]
    out: list[Any] = [None] * len(keys)
    failures: list[Exception] = []

    async def one(slot: int, key: str) -> None:
        try:
            out[slot] = await get(key)
        except Exception as exc:  # noqa: BLE001 - the first one ends the sample; cancellation passes by
            failures.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for slot, key in enumerate(keys):
            tg.start_soon(one, slot, key)
    if failures:
        raise failures[0]
    return out


def sample_job(index: SampleIndex, bucket: str, sample: int, position: int,
               on_error: OnError = "raise") -> Job:
    """Fetch the objects of sample ``sample`` concurrently and emit ``(position, sample dict)``.

    With ``on_error`` other than ``"raise"``, an object gone since the listing (404) emits
    ``(position, Skipped)`` instead, so the position still counts as delivered. Errors that
    would hit every sample (credentials, bucket, endpoint) are raised whatever ``on_error`` says.
    """
    first = index.starts[sample]
    if index.starts[sample + 1] - first == 1:
        return _one_object_job(index, bucket, sample, position, on_error, first)
    return _objects_job(index, bucket, sample, position, on_error)


def _objects_job(index: SampleIndex, bucket: str, sample: int, position: int,
                 on_error: OnError) -> Job:
    """``sample_job`` for a sample of several objects, fetched concurrently."""
    keys = index.objects(sample)

    async def job(ctx: JobContext) -> None:
        try:
            bodies = await fetch_all(ctx, bucket, keys)
        except NoSuchKeyError as exc:
            if on_error == "raise":
                raise
            await ctx.emit((position, Skipped(object_url(bucket, exc.key or keys[0]), str(exc))), 0)
            return
        await ctx.emit((position, index.sample(bucket, sample, bodies)), sum(map(len, bodies)))

    return job


def _one_object_job(index: SampleIndex, bucket: str, sample: int, position: int, on_error: OnError,
                    at: int) -> Job:
    """``sample_job`` for a sample of one object, the usual case: one GET, without the task group
    and key maps that several objects need (about half the CPU per sample).

    With ``on_error="raise"`` the coroutine has no exception handler, awaits no coroutine of its
    own and, without a label, keeps no body in a local: each of these made the garbage collector
    run several times as often (figures: bench/results/docstring-figures.md)."""
    key = index.keys[at]
    label = None if index.labels is None else index.labels[sample]
    if on_error == "raise":
        if label is None:
            return object_job(bucket, key, position)  # the leanest: no local holds the body

        async def job(ctx: JobContext) -> None:
            data = await call_with_retries(
                lambda: ctx.store.get(bucket, key), ctx.retry, on_retry=ctx.retried
            )
            out = object_sample(bucket, key, data)
            if label is not None:
                out[LABEL_FIELD] = label
            await ctx.emit((position, out), len(data))

        return job

    async def skipping_job(ctx: JobContext) -> None:
        try:
            data = await call_with_retries(
                lambda: ctx.store.get(bucket, key), ctx.retry, on_retry=ctx.retried
            )
        except NoSuchKeyError as exc:
            await ctx.emit((position, Skipped(object_url(bucket, key), str(exc))), 0)
            return
        out = object_sample(bucket, key, data)
        if label is not None:
            out[LABEL_FIELD] = label
        await ctx.emit((position, out), len(data))

    return skipping_job
