"""Per-object samples: which objects form one sample, its class label, and the job that fetches it.

Objects whose keys share a stem (up to the first dot of the basename, WebDataset's rule) form one
sample, each adding the field its extension names. A ``SampleIndex`` counts samples, not objects,
for partitioning, resume and map-style indices, over the key list as given (a packed ``KeyList``
is not copied); labels come from the parent folder (as ``ImageFolder`` numbers them) or a
manifest. The rules: docs/design/objects.md.
"""

from __future__ import annotations

import dataclasses
import functools
from array import array
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from ..engine.core import run_all
from ..engine.fetch import JobContext, JobFn
from ..errors import ConfigError, NoSuchKeyError, ObjectChangedError, SampleError
from ..formats.grouping import NO_EXTENSION_FIELD, split_key
from ..listing.keyfile import origin
from ..listing.keylist import KeyList
from ..retry import call_with_retries
from ..s3.answer_checks import check_size
from ..s3.listed_reads import reread_listed
from ..s3.protocol import Pin
from ..uri import object_url

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
    """Samples over object keys: sample ``i`` is the keys at ``positions(i)``.

    ``keys`` is the key list as given (a ``KeyList`` stays packed, possibly shared by every
    process of the machine: the index adds ~8 bytes per sample, not a copy of each key);
    ``order`` lists positions sample by sample when grouping had to reorder them (None: samples
    are runs of ``keys``, the usual case for a sorted listing). ``labels`` holds one class index
    per sample when samples carry a label; ``classes`` names them. ``pinned``: each GET must get
    the version ``keys`` recorded (a listing snapshot).
    """

    keys: Sequence[str]
    starts: Sequence[int]  # a range when every sample is one key
    labels: array | None = None
    classes: tuple[str, ...] | None = None
    order: array | None = None
    pinned: bool = False

    def __len__(self) -> int:
        return len(self.starts) - 1

    def positions(self, index: int) -> Sequence[int]:
        """Where the keys of sample ``index`` are in ``keys``, in key order."""
        start, end = self.starts[index], self.starts[index + 1]
        return range(start, end) if self.order is None else self.order[start:end]

    def objects(self, index: int) -> tuple[str, ...]:
        """The keys of sample ``index``, in key order."""
        keys = self.keys
        return tuple(keys[p] for p in self.positions(index))

    def stem(self, index: int) -> str:
        return split_key(self.keys[self.positions(index)[0]])[0]

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
    pinned: bool = False,
) -> SampleIndex:
    """Group ``keys`` into samples (first appearance of each stem decides the sample order).

    ``labels``: one label per key (or None where a row gave none); every sample needs exactly
    one value among its keys. ``where`` names the source in errors (a prefix URL, a manifest).
    ``prefix``: with ``label_from="parent"``, the prefix listed (None for a key list); the
    classes are the folders right under the root it names (``class_root``); objects directly in
    that root have no class folder and are an error (``ImageFolder`` reads only the class
    folders under its root). ``pinned``: see ``SampleIndex``.
    """
    if label_from is not None and label_from not in LABEL_SOURCES:
        raise ConfigError(f"label_from={label_from!r} must be 'parent' or None")
    if label_from is not None and labels is not None:
        raise ConfigError(f"{where} carries a label column; label_from={label_from!r} would "
                          "replace it: use one or the other")
    if labels is not None and len(labels) != len(keys):
        raise ValueError(f"{len(labels)} labels for {len(keys)} keys")
    extensions: set[str] | None = None
    starts: Sequence[int]
    if group:
        order, starts, extensions = saved_groups(keys) or _groups(keys)
    else:
        order, starts = None, range(len(keys) + 1)
    index = SampleIndex(keys, starts, order=order, pinned=pinned)
    label = ("label_from=" + repr(label_from) if label_from else "label column" if labels is not None
             else None)
    if extensions is not None and order is None and len(index) == len(keys):
        # one object per sample (the usual listing): no field can repeat, so only the fields'
        # names need checking, once each rather than once per sample (~1 us a key at 10^6 keys)
        wrong = {field for field in (ext or NO_EXTENSION_FIELD for ext in extensions)
                 if field in RESERVED_FIELDS or (field == LABEL_FIELD and label is not None)}
        if wrong:  # the first such sample says it, as the loop below would
            _check_fields(index, next(i for i, key in enumerate(keys) if field_of(key) in wrong),
                          where, label)
    else:
        for sample in range(len(index)):
            _check_fields(index, sample, where, label)
    if label_from == "parent":
        root = class_root(index.keys, prefix)
        return _with_names(index, [_parent_label(index, i, where, root) for i in range(len(index))])
    if labels is not None:
        per_sample = [_one_label(index, i, [labels[p] for p in index.positions(i)], where)
                      for i in range(len(index))]
        numbers = [label for label in per_sample if isinstance(label, int)]
        names = [label for label in per_sample if isinstance(label, str)]
        if len(numbers) == len(per_sample):
            return dataclasses.replace(index, labels=array("q", numbers))
        if len(names) == len(per_sample):
            return _with_names(index, names)
        raise ConfigError(f"{where}: labels mix class names and integers; use one kind")
    return index


# What a listing snapshot keeps of ``_groups`` (``keyfile`` annotations), so that reading it back
# goes over no key: at 10^6 keys grouping costs ~0.6 s of CPU before the first sample.
STARTS_NOTE, ORDER_NOTE, EXTENSIONS_NOTE = "samples.starts", "samples.order", "samples.extensions"


def sample_notes(keys: KeyList) -> dict[str, bytes | array]:
    """``_groups(keys)`` as a snapshot keeps it: ``starts`` (empty: one key per sample),
    ``order`` (absent: None), ``extensions`` (absent: None; else each NUL-terminated)."""
    order, starts, extensions = _groups(keys)
    notes: dict[str, bytes | array] = {STARTS_NOTE: array("q") if isinstance(starts, range) else array("q", starts)}
    if order is not None:
        notes[ORDER_NOTE] = order
    if extensions is not None:
        notes[EXTENSIONS_NOTE] = b"".join(ext.encode("utf-8", "surrogatepass") + b"\0" for ext in sorted(extensions))
    return notes


def saved_groups(keys: Sequence[str]) -> tuple[array | None, Sequence[int], set[str] | None] | None:
    """``_groups(keys)`` as the snapshot ``keys`` is mapped from kept it (``sample_notes``), or
    None when it kept none (an older snapshot, a listing that is no snapshot)."""
    file = origin(keys)
    notes = {} if file is None else file.notes
    if STARTS_NOTE not in notes:
        return None
    starts: Sequence[int] = array("q", notes[STARTS_NOTE]) if len(notes[STARTS_NOTE]) else range(len(keys) + 1)
    if starts[-1] != len(keys):  # not these keys' grouping (never, for a list read whole from its file)
        return None
    order = array("q", notes[ORDER_NOTE]) if ORDER_NOTE in notes else None
    extensions = None
    if EXTENSIONS_NOTE in notes:
        extensions = {ext.decode("utf-8", "surrogatepass") for ext in bytes(notes[EXTENSIONS_NOTE]).split(b"\0")[:-1]}
    return order, starts, extensions


def _groups(keys: Sequence[str]) -> tuple[array | None, Sequence[int], set[str] | None]:
    """``(order, starts, extensions)`` of the samples: keys sharing a stem, by first appearance;
    ``extensions``: the keys' distinct extensions when the list is sorted (else None).

    A sorted key list (every listing) is grouped in one pass holding only the stems that are
    prefixes of the current key: a stem's keys all start with it, so in sorted order they lie in
    one stretch, which may hold other stems' keys too (``a/1.cls``, ``a/1.d/x.jpg``,
    ``a/1.jpg``): then ``order`` says where each sample's keys are. Any other order is grouped
    through a dict of every stem.
    """
    seen: set[str] = set()
    group_of = _sorted_groups(keys, seen)
    extensions: set[str] | None = seen
    if group_of is None:
        extensions = None
        members: dict[str, int] = {}
        group_of = array("q", (members.setdefault(split_key(key)[0], len(members)) for key in keys))
    count = max(group_of, default=-1) + 1
    if extensions is not None and count == len(group_of):  # sorted, one key per sample: 0, 1, ...
        return None, range(count + 1), extensions
    starts = array("q", [0]) * (count + 1)
    for group in group_of:
        starts[group + 1] += 1
    for group in range(count):
        starts[group + 1] += starts[group]
    if all(a <= b for a, b in zip(group_of, group_of[1:])):
        return None, starts, extensions  # every sample is a run of keys in their own order
    order = array("q", [0]) * len(group_of)
    filled = array("q", starts[:-1])
    for position, group in enumerate(group_of):
        order[filled[group]] = position
        filled[group] += 1
    return order, starts, extensions


def _sorted_groups(keys: Sequence[str], extensions: set[str]) -> array | None:
    """The group of every key of a sorted list (see ``_groups``), adding each key's extension
    to ``extensions``; None if it is not sorted."""
    group_of = array("q")
    stack: list[tuple[str, int]] = []  # open stems, each a prefix of the next
    previous = None
    groups = 0
    for key in keys:
        if previous is not None and key <= previous:
            return None
        previous = key
        while stack and not key.startswith(stack[-1][0]):
            stack.pop()
        # split_key inlined (a third of this loop's time as a call): the stem ends at the
        # basename's first dot
        dot = key.find(".", key.rfind("/") + 1)
        if dot < 0:
            stem = key
            extensions.add("")
        else:
            stem = key[:dot]
            extensions.add(key[dot + 1:])
        if stack and stack[-1][0] == stem:
            group_of.append(stack[-1][1])
        else:
            stack.append((stem, groups))
            group_of.append(groups)
            groups += 1
    return group_of


def _check_fields(index: SampleIndex, sample: int, where: str, label: str | None) -> None:
    """One field per object of a sample, none reserved, and no ``cls`` beside a label."""
    fields: dict[str, str] = {}
    for key in index.objects(sample):
        field = field_of(key)
        if field in RESERVED_FIELDS:
            raise ConfigError(f"{_object(where, key)} has the extension {field!r}, which is a "
                              "reserved sample field; rename it")
        if field in fields:
            raise ConfigError(
                f"{_object(where, key)} and {fields[field]!r} both give field {field!r} of "
                f"sample {split_key(key)[0]!r}; rename one, or pass group=False to read every "
                "object as a sample of its own")
        if field == LABEL_FIELD and label is not None:
            raise ConfigError(
                f"{_object(where, key)} fills the field {LABEL_FIELD!r}, where the label "
                f"({label}) goes; use the objects or the label, not both")
        fields[field] = key


def _with_names(index: SampleIndex, names: list[str]) -> SampleIndex:
    classes = tuple(sorted(set(names)))
    number = {name: i for i, name in enumerate(classes)}
    return dataclasses.replace(index, labels=array("q", (number[name] for name in names)),
                               classes=classes)


def _parent_label(index: SampleIndex, i: int, where: str, root: str) -> str:
    key = index.objects(i)[0]
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


def object_job(bucket: str, key: str, position: int, size: int | None = None,
               etag: str | None = None) -> JobFn:
    """Fetch ``s3://bucket/key`` with one GET (retried) and emit ``(position, sample)``.

    One request cannot mix versions, so nothing is pinned. ``size`` and ``etag``: what the
    listing gave (``listed``), which a body of another size is held to (``reread_listed``).
    """

    async def job(ctx: JobContext) -> None:
        data = await call_with_retries(lambda: ctx.store.get(bucket, key), ctx.retry,
                                       on_retry=ctx.retried)
        if size is not None and len(data) != size:
            data = await reread_listed(ctx.store, bucket, key, size, etag, ctx.retry, ctx.retried)
        await ctx.emit((position, object_sample(bucket, key, data)), len(data))

    return job


def listed(keys: Sequence[str], at: int) -> tuple[int | None, str | None]:
    """The size and ETag a listing gave key ``at`` of ``keys`` (None where it gave none)."""
    if isinstance(keys, KeyList) and keys.has_sizes:
        return keys.size(at), keys.etag(at)
    return None, None


async def fetch_all(ctx: JobContext, bucket: str, keys: Sequence[str],
                    etags: Sequence[str | None] | None = None,
                    listings: Sequence[tuple[int | None, str | None]] | None = None) -> list[bytes]:
    """Every object of ``keys`` (one GET each, retried), concurrently; the first failure
    cancels the others and is raised as itself (not wrapped in an exception group).

    One request cannot mix versions, so nothing is pinned, unless ``etags`` (a snapshot's, one
    per key) asks each GET for that version (``get_pinned``). ``listings``: the size and ETag
    the listing gave each key (``listed``), which each body is held to.
    """

    async def get(slot: int) -> bytes:
        key, pin = keys[slot], etags[slot] if etags else None
        size, etag = listings[slot] if listings else (None, None)
        if pin is None:
            data = await call_with_retries(lambda: ctx.store.get(bucket, key), ctx.retry,
                                           on_retry=ctx.retried)
            if size is not None and len(data) != size:
                data = await reread_listed(ctx.store, bucket, key, size, etag, ctx.retry, ctx.retried)
            return data
        return await call_with_retries(lambda: get_pinned(ctx.store, bucket, key, pin, size), ctx.retry,
                                       on_retry=ctx.retried)

    if len(keys) == 1:
        return [await get(0)]
    out: list[Any] = [None] * len(keys)

    async def one(slot: int) -> None:
        out[slot] = await get(slot)

    await run_all(functools.partial(one, slot) for slot in range(len(keys)))
    return out


_STALE_SNAPSHOT = ("so the snapshot no longer describes the data: save a new one (`loader ls "
                   "--save`, or delete the snapshot file to list again)")


async def get_pinned(store: Any, bucket: str, key: str, etag: str | None,
                     size: int | None = None) -> bytes:
    """One GET of the version ``etag`` that a listing snapshot recorded (any version without
    one): an object replaced since is an ``ObjectChangedError`` naming it, never other bytes;
    that version is the ``size`` the snapshot recorded, when given."""
    if etag is None:
        return await store.get(bucket, key)
    try:
        return check_size(await store.get(bucket, key, pin=Pin(etag)), size, bucket, key)
    except ObjectChangedError as exc:
        raise ObjectChangedError(
            f"s3://{bucket}/{key} was replaced after the listing snapshot was saved (it recorded "
            f"ETag {etag}; the server no longer has that version), {_STALE_SNAPSHOT}",
            bucket=bucket, key=key) from exc
    except NoSuchKeyError as exc:
        raise NoSuchKeyError(
            f"s3://{bucket}/{key} was deleted after the listing snapshot was saved (it recorded "
            f"ETag {etag}), {_STALE_SNAPSHOT}; on_error='skip' reads on past deleted objects",
            bucket=bucket, key=key) from exc


def sample_job(index: SampleIndex, bucket: str, sample: int, position: int,
               on_error: OnError = "raise") -> JobFn:
    """Fetch the objects of sample ``sample`` concurrently and emit ``(position, sample dict)``.

    With ``on_error`` other than ``"raise"``, an object gone since the listing (404) emits
    ``(position, Skipped)`` instead, so the position still counts as delivered. Errors that
    would hit every sample (credentials, bucket, endpoint) are raised whatever ``on_error`` says.
    """
    first = index.starts[sample]
    if index.starts[sample + 1] - first == 1 and not index.pinned:
        at = first if index.order is None else index.order[first]
        return _one_object_job(index, bucket, sample, position, on_error, at)
    return _objects_job(index, bucket, sample, position, on_error)


def _objects_job(index: SampleIndex, bucket: str, sample: int, position: int,
                 on_error: OnError) -> JobFn:
    """``sample_job`` for a sample of several objects, fetched concurrently, or of a pinned
    index (a snapshot's key list, whose ETags each GET asks for)."""
    keys = index.objects(sample)
    listed_keys = index.keys
    etags = ([listed_keys.etag(p) for p in index.positions(sample)]
             if index.pinned and isinstance(listed_keys, KeyList) else None)
    listings = ([listed(listed_keys, p) for p in index.positions(sample)]
                if isinstance(listed_keys, KeyList) and listed_keys.has_sizes else None)

    async def job(ctx: JobContext) -> None:
        try:
            bodies = await fetch_all(ctx, bucket, keys, etags, listings)
        except NoSuchKeyError as exc:
            if on_error == "raise":
                raise
            await ctx.emit((position, Skipped(object_url(bucket, exc.key or keys[0]), str(exc))), 0)
            return
        await ctx.emit((position, index.sample(bucket, sample, bodies)), sum(map(len, bodies)))

    return job


def _one_object_job(index: SampleIndex, bucket: str, sample: int, position: int, on_error: OnError,
                    at: int) -> JobFn:
    """``sample_job`` for a sample of one object, the usual case: one GET, without the task group
    and key maps that several objects need (about half the CPU per sample).

    With ``on_error="raise"`` the coroutine has no exception handler, awaits no coroutine of its
    own and, without a label, keeps no body in a local: each of these made the garbage collector
    run several times as often (figures: bench/results/docstring-figures.md)."""
    key = index.keys[at]
    size, etag = listed(index.keys, at)
    label = None if index.labels is None else index.labels[sample]
    if on_error == "raise":
        if label is None:
            return object_job(bucket, key, position, size, etag)  # the leanest: no local holds the body

        async def job(ctx: JobContext) -> None:
            data = await call_with_retries(
                lambda: ctx.store.get(bucket, key), ctx.retry, on_retry=ctx.retried
            )
            if size is not None and len(data) != size:
                data = await reread_listed(ctx.store, bucket, key, size, etag, ctx.retry, ctx.retried)
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
            if size is not None and len(data) != size:
                data = await reread_listed(ctx.store, bucket, key, size, etag, ctx.retry, ctx.retried)
        except NoSuchKeyError as exc:
            await ctx.emit((position, Skipped(object_url(bucket, key), str(exc))), 0)
            return
        out = object_sample(bucket, key, data)
        if label is not None:
            out[LABEL_FIELD] = label
        await ctx.emit((position, out), len(data))

    return skipping_job
