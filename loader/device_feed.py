"""The device stage: the DataLoader's raw batches decoded, resized and normalised on the device,
``ahead`` batches before the training step asks for them.

Decoding in the training loop (``decode_images`` then the step) puts the decode in series with
the step on one stream: the GPU idles while it decodes, and the step rate falls to about half of
what the GPU allows (bench/results/gpu-2026-11-28.md). ``DeviceFeed`` moves that work to a thread
of its own and, on CUDA, a stream of its own: nvJPEG decode, resize, normalisation and the
labels' copy from pinned memory run while the step runs, and the step's stream waits on an event
(on the GPU), not the training loop on the decode. A second thread takes the DataLoader's next
batch while one decodes, so the slower of the two limits, not their sum. On a machine without
CUDA the same call decodes on the CPU in that thread, so one training script runs on both.
Design and figures: docs/design/decode.md.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .decode import _check_size, decode_image, decode_images, is_hub_image
from .errors import ConfigError, SampleError

#: ImageNet's channel means and deviations (of pixels scaled to 0-1): torchvision's recipe
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: the share of step time spent waiting under which the stage is said to keep up
KEEPS_UP = 0.05
_POLL_S = 0.1  # how often a blocked producer looks whether the feed was closed


class DeviceBatch(tuple):
    """``(images, labels)``, ready on the device; ``keys`` names the samples (``__key__``)."""

    images: torch.Tensor
    labels: torch.Tensor | None
    keys: list[str] | None

    def __new__(cls, images: torch.Tensor, labels: torch.Tensor | None,
                keys: list[str] | None = None) -> DeviceBatch:
        batch = super().__new__(cls, (images, labels))
        batch.images, batch.labels, batch.keys = images, labels, keys
        return batch


@dataclass
class FeedStats:
    """Where the time went, per stage. ``fetch_s`` is the fetching thread's time waiting for the
    DataLoader (S3, or the workers' hand-off), ``decode_s`` the decoding thread's time on a batch
    (on CUDA: launching its work; ``gpu_pending`` counts the steps whose batch the GPU was still
    decoding when the step was queued); ``wait_s`` is the step waiting for a ready batch (the
    first one apart: ``first_s``), ``step_s`` the time the loop kept its batches."""

    batches: int = 0
    images: int = 0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    wait_s: float = 0.0
    step_s: float = 0.0
    first_s: float | None = None
    gpu_pending: int = 0
    device: str = "cpu"
    ahead: int = 2
    dataset_stats: dict[str, Any] | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        total = self.wait_s + self.step_s
        return {
            "batches": self.batches, "images": self.images, "fetch_s": self.fetch_s,
            "decode_s": self.decode_s, "steps": self.steps, "wait_s": self.wait_s,
            "step_s": self.step_s, "first_batch_s": self.first_s,
            "wait_fraction": self.wait_s / total if total else None,
            "decode_images_per_s": self.images / self.decode_s if self.decode_s else None,
            "gpu_pending": self.gpu_pending,
            "device": self.device, "ahead": self.ahead,
        }


def diagnose(stats: FeedStats) -> str:
    """One paragraph for people: how long the step waited for data, and the stage that limits it
    (the DataLoader's fetch from S3, its workers' hand-off, or the decode), with what helps.

    Pure: the numbers decide. The stage whose time per batch is the larger is the limit: the two
    run in threads of their own, side by side, so the slower sets the pace."""
    if stats.steps == 0:
        return "no batch yet: iterate first (for images, labels in feed: ...)"
    total = stats.wait_s + stats.step_s
    fraction = stats.wait_s / total if total else 0.0
    decode_rate = stats.images / stats.decode_s if stats.decode_s else float("inf")
    head = (f"the step waited for data {fraction:.0%} of its time over {stats.steps} steps "
            f"({stats.wait_s:.2f} s of {total:.2f} s); decode on {stats.device}: "
            + (f"{decode_rate:,.0f} images/s" if stats.decode_s else "no images decoded"))
    if stats.gpu_pending:
        head += (f"; the GPU was still decoding the batch when {stats.gpu_pending} of the steps were "
                 "queued (the step's stream waited for it there)")
    if fraction < KEEPS_UP:
        return head + f". The feed keeps up ({stats.ahead} batches ahead); nothing to change."
    per_fetch = stats.fetch_s / max(1, stats.batches)
    per_decode = stats.decode_s / max(1, stats.batches)
    if per_decode >= per_fetch:
        advice = ("the decode is the limit "
                  f"({per_decode * 1000:.1f} ms a batch against {per_fetch * 1000:.1f} ms waiting for "
                  "the DataLoader): " + ("the GPU's JPEG decoder runs at the rate above beside the "
                                        "step, which shares the GPU and this process with it; "
                                        "images stored near the training size (resized before "
                                        "upload) cost it less"
                                        if stats.device.startswith("cuda") else
                                        "decode in DataLoader workers (transform=decode_sample) so "
                                        "that several cores share it, or on a GPU"))
    else:
        advice = (f"the DataLoader is the limit ({per_fetch * 1000:.1f} ms a batch waiting for it "
                  f"against {per_decode * 1000:.1f} ms of decode): " + _loader_advice(stats.dataset_stats))
    return f"{head}. {advice[0].upper()}{advice[1:]}."


def _loader_advice(dataset: dict[str, Any] | None) -> str:
    """Which side of the DataLoader waits: its workers on S3, or the main process on the
    workers' hand-off (as the dataset's own statistics tell, where it keeps them)."""
    if not dataset or not dataset.get("seconds"):
        return "more DataLoader workers, or ds.report() for where its time goes"
    # waits are summed over the DataLoader's workers, ``seconds`` is the longest worker's
    workers = max(1, int(dataset.get("workers") or 1))
    fetch_share = dataset.get("consumer_wait_s", 0.0) / max(dataset["seconds"] * workers, 1e-9)
    if fetch_share >= 0.3:
        return (f"its workers waited on S3 {fetch_share:.0%} of the time: raise "
                "Limits(concurrency=), or read shards instead of one object per sample")
    return ("its workers rarely wait on S3, so the hand-off of batches out of the workers limits: "
            "more DataLoader workers, or bigger batches")


class DeviceFeed:
    """Iterate a DataLoader's raw batches as decoded tensors on ``device``, ``ahead`` batches early.

        loader = DataLoader(ds, batch_size=256, num_workers=4, collate_fn=collate_raw)
        feed = DeviceFeed(loader, size=(224, 224), device="cuda")
        for images, labels in feed:      # float tensors, normalised, channels-last, on the GPU
            step(images, labels)
        print(feed.report())

    Batches are dicts of lists as ``collate_raw`` makes them: ``image`` names the field of the
    encoded images (``"jpg"``; a Hugging Face image column's ``{"bytes": ...}`` values too) and
    ``label`` the field of the labels (bytes like ``b"7"``, ints, or None for no labels).
    ``mean``/``std`` normalise pixels scaled to 0-1 (None for uint8 pixels), into ``dtype``.

    Memory on the device: at most ``ahead + 2`` decoded batches (``ahead`` ready, one being
    decoded, one in the step); on the host, two raw batches more (taken from the DataLoader while
    another decodes). Order is the DataLoader's. A batch that cannot be decoded raises a
    ``SampleError`` naming the sample when the step reaches it; iteration can go on after it.
    ``state_dict()`` is the loader's state at the last batch the step received (for a
    ``StatefulDataLoader``), ``steps`` the batches it received (for ``ds.samples_seen(steps)``):
    batches decoded ahead are not counted as seen.
    """

    def __init__(self, loader: Iterable[Any], size: Sequence[int], device: str | torch.device | None = None,
                 *, ahead: int = 2, image: str = "jpg", label: str | None = "cls",
                 mean: Sequence[float] | None = IMAGENET_MEAN, std: Sequence[float] | None = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32, channels_last: bool = True, mode: str = "RGB") -> None:
        target = _check_size(size)
        if target is None:
            raise ConfigError("DeviceFeed needs size=(height, width): a batch is one tensor")
        if not isinstance(ahead, int) or isinstance(ahead, bool) or ahead < 1:
            raise ConfigError(f"DeviceFeed(ahead={ahead!r}): ahead must be an integer >= 1 "
                              "(the batches decoded before the step asks; 2 is usual)")
        if (mean is None) != (std is None):
            raise ConfigError("DeviceFeed: give both mean= and std= (to normalise), or neither "
                              "(uint8 pixels)")
        if mean is not None and std is not None and (len(mean) != len(std) or any(s <= 0 for s in std)):
            raise ConfigError(f"DeviceFeed: mean={tuple(mean)!r} and std={tuple(std)!r} must have one "
                              "value per channel each, the deviations positive")
        chosen = torch.device(device if device is not None else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        if chosen.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"DeviceFeed(device={str(chosen)!r}): torch sees no CUDA device; "
                              "pass device='cpu' (or leave device unset to pick one)")
        self.loader = loader
        self.size, self.device, self.ahead = target, chosen, ahead
        self.image, self.label, self.mode = image, label, mode
        self.dtype, self.channels_last = dtype, channels_last
        self._norm = None if mean is None or std is None else (tuple(mean), tuple(std))
        self._scale: tuple[torch.Tensor, ...] | None = None  # the mean and std as device tensors
        self._stats = FeedStats(device=str(chosen), ahead=ahead)
        self._state: Any = None
        self._iteration: _Iteration | None = None

    # ------------------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[DeviceBatch]:
        self.close()  # one iteration at a time: a new one ends the last
        self._stats = FeedStats(device=str(self.device), ahead=self.ahead)
        self._state = None
        # made here, in the caller's thread: a DataLoader starts (forks) its workers in iter()
        self._iteration = _Iteration(self, iter(self.loader))
        return self._iteration

    def close(self) -> None:
        """End the current iteration: the producer thread stops and is joined, the DataLoader's
        iterator is released (its workers shut down)."""
        iteration, self._iteration = self._iteration, None
        if iteration is not None:
            iteration.close()

    def __enter__(self) -> DeviceFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def steps(self) -> int:
        """Batches the training loop has received in this iteration."""
        return self._stats.steps

    def state_dict(self) -> Any:
        """The loader's ``state_dict()`` as it was right after the last batch the step received
        (None before the first, or for a loader without one)."""
        return self._state

    def stats(self) -> dict[str, Any]:
        return self._stats.as_dict()

    def report(self) -> str:
        """Whether the step waited for data, and which stage limits it, with the advice that helps."""
        dataset = getattr(self.loader, "dataset", None)
        stats = getattr(dataset, "stats", None)
        try:
            self._stats.dataset_stats = stats() if callable(stats) else None
        except Exception:  # noqa: BLE001 - a dataset's statistics only refine the advice
            self._stats.dataset_stats = None
        return diagnose(self._stats)

    # ------------------------------------------------------------------------- decoding

    def decode(self, batch: Any) -> DeviceBatch:
        """One raw batch -> a ``DeviceBatch`` on the device (on CUDA: ready when the call returns)."""
        out, ready = self._decode_queued(batch)
        if ready is not None:
            ready.synchronize()
        return out

    def _decode_queued(self, batch: Any) -> tuple[DeviceBatch, Any]:
        """One raw batch -> ``(DeviceBatch, event)``: on CUDA the work is queued on the side stream
        and the event marks its end (the step's stream waits on it); elsewhere done, event None."""
        images, labels, keys = self._fields(batch)
        if self.device.type != "cuda":
            return DeviceBatch(self._images(images, keys), self._labels(labels), keys), None
        stream = _side_stream(self.device)
        with torch.cuda.stream(stream):
            out = DeviceBatch(self._images(images, keys), self._labels(labels), keys)
            ready = torch.cuda.Event()
            ready.record(stream)
        return out, ready

    def _fields(self, batch: Any) -> tuple[list[bytes], Any, list[str] | None]:
        if not isinstance(batch, dict):
            raise ConfigError(f"DeviceFeed takes batches as collate_raw makes them (a dict of lists), "
                              f"got {type(batch).__name__}: pass collate_fn=collate_raw to the DataLoader")
        if self.image not in batch:
            raise ConfigError(f"DeviceFeed(image={self.image!r}): the batch has no such field "
                              f"(fields: {sorted(batch)}); name the field of the encoded images")
        images = [value["bytes"] if is_hub_image(value) else value for value in batch[self.image]]
        labels = None if self.label is None else batch.get(self.label)
        if self.label is not None and labels is None:
            raise ConfigError(f"DeviceFeed(label={self.label!r}): the batch has no such field "
                              f"(fields: {sorted(batch)}); name it, or pass label=None")
        keys = batch.get("__key__")
        return images, labels, list(keys) if keys is not None else None

    def _images(self, images: list[bytes], keys: list[str] | None) -> torch.Tensor:
        try:
            pixels = decode_images(images, self.size, self.device, mode=self.mode)
        except ValueError:
            raise self._culprit(images, keys) from None
        if self.channels_last:
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        if self._norm is None:
            return pixels
        if self._scale is None:  # made once, on the device (a copy per batch would sync each time)
            self._scale = tuple(torch.tensor(v, device=self.device).view(1, -1, 1, 1) * 255
                                for v in self._norm)
        mean, std = self._scale
        return pixels.float().sub_(mean).div_(std).to(self.dtype)

    def _culprit(self, images: list[bytes], keys: list[str] | None) -> SampleError:
        """The error for the first image of a batch that does not decode, naming its sample."""
        for index, data in enumerate(images):
            try:
                decode_image(data, self.size, mode=self.mode)
            except ValueError as exc:
                key = keys[index] if keys is not None else f"#{index} of the batch"
                return SampleError(f"DeviceFeed cannot decode {self.image!r} of sample {key!r}: {exc}")
        return SampleError(f"DeviceFeed cannot decode the batch of samples {keys!r}")

    def _labels(self, labels: Any) -> torch.Tensor | None:
        if labels is None:
            return None
        if isinstance(labels, torch.Tensor):
            values = labels
        else:
            try:
                values = torch.tensor([int(v) for v in labels], dtype=torch.int64)
            except (TypeError, ValueError) as exc:
                raise SampleError(f"DeviceFeed(label={self.label!r}): labels must be integers or "
                                  f"their text (b'7'), got {list(labels)[:3]!r}...: {exc}") from None
        if self.device.type == "cuda":
            return values.pin_memory().to(self.device, non_blocking=True)
        return values.to(self.device)


def _side_stream(device: torch.device) -> Any:
    """One decode stream per device and process, made on first use."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


_STREAMS: dict[torch.device, Any] = {}
_END = object()


@dataclass
class _Failed:
    """An error in the stream of batches, delivered in its place; ``fatal`` ends the iteration."""

    error: BaseException
    fatal: bool


class _Iteration(Iterator[DeviceBatch]):
    """One pass over the loader, in two threads: one takes the DataLoader's batches (and its
    state after each) into a queue of one, the other decodes them into a queue of ``ahead``
    ready batches; ``__next__`` takes them in order and has the step's stream wait, on the GPU,
    for the event that ends each batch's decode."""

    def __init__(self, feed: DeviceFeed, batches: Iterator[Any]) -> None:
        self._feed, self._batches = feed, batches
        self._raw: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=feed.ahead)
        self._stop = threading.Event()
        self._done = False
        self._asked: float | None = None
        self._started = time.perf_counter()
        self._threads = [threading.Thread(target=work, name="loader-device-feed", daemon=True)
                         for work in (self._fetch, self._decode)]
        for thread in self._threads:
            thread.start()

    def _fetch(self) -> None:
        feed, stats, clock = self._feed, self._feed._stats, time.perf_counter
        state_dict = getattr(feed.loader, "state_dict", None)
        try:
            while not self._stop.is_set():
                asked = clock()
                try:
                    batch = next(self._batches)
                except StopIteration:
                    break
                stats.fetch_s += clock() - asked
                state = state_dict() if callable(state_dict) else None
                if not self._put(self._raw, (batch, state)):
                    return
        except BaseException as exc:  # noqa: BLE001 - the loader's own failure: the step sees it
            self._put(self._raw, _Failed(exc, fatal=True))
            return
        self._put(self._raw, _END)

    def _decode(self) -> None:
        feed, stats, clock = self._feed, self._feed._stats, time.perf_counter
        while not self._stop.is_set():
            try:
                item = self._raw.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is _END or isinstance(item, _Failed):
                self._put(self._ready, item)
                return
            batch, state = item
            started = clock()
            try:
                decoded: Any = (*feed._decode_queued(batch), state)
            except Exception as exc:  # noqa: BLE001 - delivered in the batch's place
                decoded = _Failed(exc, fatal=False)
            stats.decode_s += clock() - started
            stats.batches += 1
            stats.images += len(batch.get(feed.image, ())) if isinstance(batch, dict) else 0
            if not self._put(self._ready, decoded):
                return

    def _put(self, into: queue.Queue[Any], item: Any) -> bool:
        """Queue ``item``, waiting for room; False once the feed was closed."""
        while not self._stop.is_set():
            try:
                into.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> DeviceBatch:
        if self._done:
            raise StopIteration
        stats, clock = self._feed._stats, time.perf_counter
        asked = clock()
        if self._asked is not None and stats.steps:
            stats.step_s += asked - self._asked
        item = self._ready.get()
        got = self._asked = clock()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failed):
            if item.fatal:
                self.close()
            raise item.error
        if stats.first_s is None:
            stats.first_s = got - self._started
        else:
            stats.wait_s += got - asked
        stats.steps += 1
        batch, ready, state = item
        self._feed._state = state
        if batch.images.is_cuda:  # the step's stream uses tensors made on the side stream
            current = torch.cuda.current_stream(batch.images.device)
            if not ready.query():
                stats.gpu_pending += 1
            current.wait_event(ready)
            for tensor in (batch.images, batch.labels):
                if tensor is not None:
                    tensor.record_stream(current)
        return batch

    def close(self) -> None:
        if self._done and not any(thread.is_alive() for thread in self._threads):
            return
        self._done = True
        self._stop.set()
        for thread in self._threads:  # a thread waiting for room sees the stop within _POLL_S
            while thread.is_alive():
                self._drain()
                thread.join(timeout=_POLL_S)
        self._drain()
        batches, self._batches = self._batches, iter(())
        shutdown = getattr(batches, "_shutdown_workers", None)
        if callable(shutdown) and not getattr(self._feed.loader, "persistent_workers", False):
            shutdown()  # a DataLoader's multi-process iterator: its workers end now
        # (persistent workers stay: the DataLoader resets that same iterator for the next pass)
        close = getattr(batches, "close", None)
        if callable(close):  # a generator: its finally runs now
            close()

    def _drain(self) -> None:
        for waiting in (self._raw, self._ready):
            try:
                while True:
                    waiting.get_nowait()
            except queue.Empty:
                pass
