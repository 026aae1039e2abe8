"""``DeviceFeed``: order, the bound on batches ahead, shutdown, errors in a batch, the state it
reports, and the report's diagnosis. On the CPU (the same code path but the stream); the CUDA
tests at the end run where a device is present."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ConfigError, DeviceFeed, SampleError
from loader.decode import collate_raw, decode_images
from loader.device_feed import FeedStats, diagnose
from loader.tools.demo import photo_jpeg

SIZE = (32, 48)
PHOTOS = [photo_jpeg(n) for n in range(12)]


def raw_batches(count: int, per: int = 3, bad: set[int] = frozenset()) -> list[dict]:
    """``count`` collate_raw batches of ``per`` photos; sample numbers in ``bad`` are not JPEGs."""
    out = []
    for b in range(count):
        samples = [{"__key__": f"s/{n:03d}", "jpg": b"not an image" if n in bad else PHOTOS[n % len(PHOTOS)],
                    "cls": str(n % 10).encode()} for n in range(b * per, (b + 1) * per)]
        out.append(collate_raw(samples))
    return out


class Counting:
    """An iterable of batches that counts what was taken from it and whether it was closed."""

    def __init__(self, batches: list[dict]) -> None:
        self.batches, self.taken, self.closed = batches, 0, False
        self.more = threading.Event()

    def __iter__(self):
        try:
            for batch in self.batches:
                self.taken += 1
                self.more.set()
                yield batch
        finally:
            self.closed = True


def wait_until(predicate, limit: float = 30.0) -> None:
    """Poll ``predicate`` until it holds; a generous limit only guards against a hang."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"  # hang guard
        time.sleep(0.01)


def test_batches_arrive_in_order_decoded_and_normalised():
    batches = raw_batches(5)
    feed = DeviceFeed(batches, SIZE, device="cpu")
    out = list(feed)
    assert [b.keys for b in out] == [b["__key__"] for b in batches]
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
    for got, raw in zip(out, batches):
        images, labels = got  # unpacks as (images, labels)
        expected = (decode_images(raw["jpg"], SIZE, "cpu").float() - mean) / std
        assert images.shape == (3, 3, *SIZE) and images.dtype == torch.float32
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert torch.allclose(images, expected, atol=1e-5)
        assert labels.tolist() == [int(v) for v in raw["cls"]]
    assert feed.steps == 5


def test_uint8_pixels_without_normalisation_and_without_labels():
    feed = DeviceFeed(raw_batches(2), SIZE, device="cpu", mean=None, std=None, label=None,
                      channels_last=False)
    for images, labels in feed:
        assert images.dtype == torch.uint8 and images.is_contiguous() and labels is None


def test_hub_image_values_are_decoded_too():
    batch = {"image": [{"bytes": PHOTOS[0], "path": None}], "label": [3]}
    (images, labels), = DeviceFeed([batch], SIZE, device="cpu", image="image", label="label")
    assert images.shape == (1, 3, *SIZE) and labels.tolist() == [3]


@pytest.mark.parametrize("ahead", [1, 3])
def test_never_more_than_ahead_batches_decoded_before_the_step_asks(ahead):
    source = Counting(raw_batches(20))
    feed = DeviceFeed(source, SIZE, device="cpu", ahead=ahead)
    iterator = iter(feed)
    next(iterator)
    # one batch in the step, ``ahead`` ready in the queue, one decoded and waiting for room;
    # on the host, one raw batch queued for the decoder and one taken and waiting for room
    wait_until(lambda: source.taken == 1 + ahead + 1 + 2)
    time.sleep(0.3)  # room for a wrong producer to take more: the bound must still hold
    assert source.taken == 1 + ahead + 1 + 2
    next(iterator)
    wait_until(lambda: source.taken == 2 + ahead + 1 + 2)
    feed.close()


def test_breaking_out_ends_the_thread_and_closes_the_loader():
    source = Counting(raw_batches(20))
    feed = DeviceFeed(source, SIZE, device="cpu")
    for step, _ in enumerate(feed):
        if step == 2:
            break
    feed.close()
    assert source.closed
    assert not [t for t in threading.enumerate() if t.name == "loader-device-feed"]


def test_a_new_iteration_ends_the_last_one():
    source = Counting(raw_batches(4))
    feed = DeviceFeed(source, SIZE, device="cpu")
    first = iter(feed)
    next(first)
    assert len(list(feed)) == 4  # a whole new pass
    assert source.closed
    assert not [t for t in threading.enumerate() if t.name == "loader-device-feed"]


class Photos(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, n: int) -> dict:
        return {"__key__": f"s/{n:03d}", "jpg": PHOTOS[n], "cls": str(n).encode()}


@pytest.mark.parametrize("persistent", [False, True])
def test_epochs_after_a_whole_pass_and_after_a_break_over_dataloader_workers(persistent):
    """A DataLoader with workers, persistent or not: a second pass after a whole one, and a
    whole one after a break, each give every batch in order (the feed must not end workers
    the DataLoader keeps for its next pass)."""
    loader = torch.utils.data.DataLoader(Photos(), batch_size=3, num_workers=1, collate_fn=collate_raw,
                                         persistent_workers=persistent)
    feed = DeviceFeed(loader, SIZE, device="cpu")
    whole = [batch.labels.tolist() for batch in feed]
    assert whole == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert [batch.labels.tolist() for batch in feed] == whole
    for step, _ in enumerate(feed):
        if step == 1:
            break
    assert [batch.labels.tolist() for batch in feed] == whole
    feed.close()


def test_a_batch_that_does_not_decode_names_its_sample_and_the_rest_follow():
    feed = DeviceFeed(raw_batches(4, bad={7}), SIZE, device="cpu")
    iterator = iter(feed)
    got = [next(iterator).keys for _ in range(2)]
    with pytest.raises(SampleError, match=r"'s/007'.*cannot decode"):
        next(iterator)
    got.append(next(iterator).keys)  # the batch after it
    with pytest.raises(StopIteration):
        next(iterator)
    assert got == [["s/000", "s/001", "s/002"], ["s/003", "s/004", "s/005"], ["s/009", "s/010", "s/011"]]
    assert feed.steps == 3


def test_the_loaders_own_failure_reaches_the_step_after_the_batches_before_it():
    def failing():
        yield from raw_batches(2)
        raise RuntimeError("DataLoader worker 1 died")

    feed = DeviceFeed(failing(), SIZE, device="cpu")
    iterator = iter(feed)
    assert len([next(iterator), next(iterator)]) == 2
    with pytest.raises(RuntimeError, match="worker 1 died"):
        next(iterator)
    with pytest.raises(StopIteration):
        next(iterator)
    assert not [t for t in threading.enumerate() if t.name == "loader-device-feed"]


class StatefulList:
    """A loader with ``state_dict()``, as torchdata's StatefulDataLoader has: batches yielded."""

    def __init__(self, batches: list[dict]) -> None:
        self.batches, self.yielded = batches, 0

    def __iter__(self):
        for batch in self.batches[self.yielded:]:
            self.yielded += 1
            yield batch

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}


def test_state_is_the_loaders_at_the_last_batch_the_step_received_not_at_the_read_ahead():
    loader = StatefulList(raw_batches(10))
    feed = DeviceFeed(loader, SIZE, device="cpu", ahead=3)
    iterator = iter(feed)
    for _ in range(4):
        next(iterator)
    wait_until(lambda: loader.yielded >= 8)  # the producer read ahead
    assert feed.state_dict() == {"yielded": 4} and feed.steps == 4
    feed.close()


def test_options_are_checked_with_advice():
    with pytest.raises(ConfigError, match="ahead must be an integer >= 1"):
        DeviceFeed([], SIZE, ahead=0)
    with pytest.raises(ConfigError, match="give both mean= and std="):
        DeviceFeed([], SIZE, std=None)
    with pytest.raises(ConfigError, match="size="):
        DeviceFeed([], None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="collate_fn=collate_raw"):
        list(DeviceFeed([[b"x"]], SIZE, device="cpu"))
    with pytest.raises(ConfigError, match=r"image='png'.*fields: \['__key__', 'cls', 'jpg'\]"):
        list(DeviceFeed(raw_batches(1), SIZE, device="cpu", image="png"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            DeviceFeed([], SIZE, device="cuda")


def test_the_report_after_a_pass_names_the_share_waited_and_the_decode_rate():
    feed = DeviceFeed(raw_batches(6), SIZE, device="cpu")
    for _ in feed:
        pass
    text = feed.report()
    assert "over 6 steps" in text and "images/s" in text
    stats = feed.stats()
    assert stats["batches"] == 6 and stats["images"] == 18 and stats["steps"] == 6


def stats(**values) -> FeedStats:
    return FeedStats(**{"batches": 100, "images": 25_600, "steps": 100, **values})


def test_diagnosis_names_the_decode_when_it_is_the_slower_stage():
    text = diagnose(stats(wait_s=5.0, step_s=5.0, fetch_s=1.0, decode_s=9.0, device="cuda:0"))
    assert "waited for data 50%" in text and "The decode is the limit" in text
    assert "GPU's JPEG decoder" in text and "2,844 images/s" in text


def test_diagnosis_names_s3_or_the_hand_off_from_the_datasets_statistics():
    slow_s3 = diagnose(stats(wait_s=3.0, step_s=7.0, fetch_s=9.0, decode_s=1.0,
                             dataset_stats={"seconds": 10.0, "consumer_wait_s": 6.0}))
    assert "The DataLoader is the limit" in slow_s3 and "waited on S3 60%" in slow_s3
    handoff = diagnose(stats(wait_s=3.0, step_s=7.0, fetch_s=9.0, decode_s=1.0,
                             dataset_stats={"seconds": 10.0, "consumer_wait_s": 0.5}))
    assert "hand-off" in handoff and "more DataLoader workers" in handoff
    # waits are summed over workers: 8 workers waiting 48 s in a 10 s epoch waited 60 % each
    workers = diagnose(stats(wait_s=3.0, step_s=7.0, fetch_s=9.0, decode_s=1.0,
                             dataset_stats={"seconds": 10.0, "consumer_wait_s": 48.0, "workers": 8}))
    assert "waited on S3 60%" in workers


def test_diagnosis_says_nothing_to_change_when_the_step_barely_waits():
    assert "nothing to change" in diagnose(stats(wait_s=0.1, step_s=9.9, fetch_s=9.0, decode_s=1.0))
    assert "no batch yet" in diagnose(FeedStats())


@settings(deadline=None)
@given(wait=st.floats(0, 100), step=st.floats(0.001, 100), fetch=st.floats(0, 100),
       decode=st.floats(0.001, 100))
def test_diagnosis_always_names_the_slower_stage_once_the_step_waits(wait, step, fetch, decode):
    text = diagnose(stats(wait_s=wait, step_s=step, fetch_s=fetch, decode_s=decode))
    if wait / (wait + step) < 0.05:
        assert "nothing to change" in text
    elif decode >= fetch:
        assert "The decode is the limit" in text
    else:
        assert "The DataLoader is the limit" in text


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")


@cuda
def test_on_cuda_batches_are_ready_on_the_device_and_match_the_cpu_path():
    batches = raw_batches(4)
    on_gpu = [(images.cpu(), labels.cpu()) for images, labels in DeviceFeed(batches, SIZE, device="cuda")]
    on_cpu = list(DeviceFeed(batches, SIZE, device="cpu"))
    for (gi, gl), (ci, cl) in zip(on_gpu, on_cpu):
        assert gl.tolist() == cl.tolist()
        assert (gi - ci).abs().mean() < 0.1  # nvJPEG and libjpeg-turbo round differently


@cuda
def test_on_cuda_a_batch_is_not_overwritten_while_the_step_still_reads_it():
    """The step's stream keeps reading a batch after the feed decoded the next ones: with
    ``record_stream`` their memory is not handed to the next decode before the step is done."""
    feed = DeviceFeed(raw_batches(8), SIZE, device="cuda", ahead=2)
    snapshots = []
    for images, _ in feed:
        torch.cuda._sleep(50_000_000)  # a long kernel on the step's stream, before it reads
        snapshots.append((images.sum().item(), images.clone()))
    for total, copy in snapshots:
        assert copy.sum().item() == total


@cuda
def test_on_cuda_the_step_never_reads_a_batch_the_side_stream_is_still_decoding(monkeypatch):
    """The decoding thread does not wait for the GPU: the step's stream waits on the batch's
    event. With the side stream held busy long after each call returns, every batch read on the
    step's stream still holds the decoded pixels, and the feed counts those steps."""
    feed = DeviceFeed(raw_batches(4), SIZE, device="cuda", mean=None, std=None)
    decode = feed._images

    def slow(images, keys):
        pixels = decode(images, keys)
        late = torch.zeros_like(pixels)
        torch.cuda._sleep(200_000_000)  # the side stream busy long after the call returns,
        return late.copy_(pixels)  # and the pixels written only after that

    monkeypatch.setattr(feed, "_images", slow)
    expected = [batch.images for batch in DeviceFeed(raw_batches(4), SIZE, device="cpu", mean=None, std=None)]
    got = [batch.images.cpu() for batch in feed]
    assert len(got) == len(expected)
    for on_gpu, on_cpu in zip(got, expected):
        assert (on_gpu.float() - on_cpu.float()).abs().mean() < 1.0
    assert feed.stats()["gpu_pending"] > 0
