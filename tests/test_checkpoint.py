"""``loader.checkpoint`` over the in-memory store: round trips, bounded parallel parts,
backpressure, retries, and that every failure aborts the multipart upload and names the URI."""

from __future__ import annotations

import io
import signal
import threading
import time

import anyio
import pytest
import torch

from loader import Limits, RetryPolicy, Store, checkpoint
from loader.errors import (
    AccessDeniedError,
    ConfigError,
    NoSuchBucketError,
    NoSuchKeyError,
    TransientStoreError,
)

from fakes import FakeStore, reusable

pytestmark = pytest.mark.usefixtures("no_leaked_threads")

BUCKET = "ckpt-bucket"
URI = f"s3://{BUCKET}/runs/a/step-100.pt"
KEY = "runs/a/step-100.pt"
PART = 4096  # FakeStore accepts parts this small (min_part_size=1); S3 needs 5 MiB


def state_dict(seed: int = 0, n: int = 6, numel: int = 3000) -> dict:
    """A deterministic state dict: several dtypes, a view sharing storage, nesting."""
    g = torch.Generator().manual_seed(seed)
    sd: dict = {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)}
    sd["int"] = torch.randint(0, 1000, (777,), generator=g, dtype=torch.int64)
    sd["half"] = torch.randn(513, generator=g).half()
    sd["view"] = sd["layer0.weight"][10:20]  # shares layer0's storage
    sd["nested"] = {"step": 100, "lr": [0.1, torch.tensor(3.5)]}
    return sd


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def nothing_left(fake: FakeStore) -> None:
    """No open multipart upload, asked the way a user would (``list_multipart_uploads``)."""
    async def listed() -> list[tuple[str, str]]:
        store = await reusable(fake)()
        try:
            return await store.list_multipart_uploads(BUCKET, "")
        finally:
            await store.aclose()

    assert anyio.run(listed) == []
    assert fake.uploads == {}


def new_fake(**options) -> FakeStore:
    return FakeStore(buckets=[BUCKET], **options)


# ------------------------------------------------------------------------------ round trips


def test_small_checkpoint_is_one_put_and_round_trips():
    fake = new_fake()
    sd = {"w": torch.arange(10.0), "step": 3}
    checkpoint.save(sd, URI, store=reusable(fake))
    assert (fake.puts, fake.multipart_created) == (1, 0)
    assert_same(checkpoint.load(URI, store=reusable(fake)), sd)
    assert fake.closed


def test_multipart_round_trip_is_exact():
    fake = new_fake()
    sd = state_dict()
    checkpoint.save(sd, URI, store=reusable(fake), part_size=PART, limits=Limits(concurrency=3))
    size = len(fake.objects[BUCKET, KEY])
    assert size > 10 * PART
    assert fake.multipart_created == fake.completed == 1 and fake.puts == 0
    assert fake.parts_uploaded == -(-size // PART)
    nothing_left(fake)
    loaded = checkpoint.load(URI, store=reusable(fake), part_size=PART, limits=Limits(concurrency=3))
    assert_same(loaded, sd)
    # storage sharing survives, as with torch.load from a file
    assert loaded["view"].untyped_storage().data_ptr() == loaded["layer0.weight"].untyped_storage().data_ptr()


def test_size_exactly_a_multiple_of_part_size():
    """The last part is full: it goes up as an ordinary part, and completion still happens."""
    for pad in range(0, 4000, 64):
        sd = {"w": torch.arange(5000.0), "pad": torch.zeros(pad, dtype=torch.uint8)}
        size = len(_saved_bytes(sd))
        parts = next((n for n in range(2, 17) if size % n == 0), None)
        if parts:
            break
    else:  # pragma: no cover
        pytest.fail("no padding gave a size with a small divisor")
    fake = new_fake()
    checkpoint.save(sd, URI, store=reusable(fake), part_size=size // parts)
    assert len(fake.objects[BUCKET, KEY]) == size and fake.parts_uploaded == parts
    assert_same(checkpoint.load(URI, store=reusable(fake)), sd)


def _saved_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_part_size_doubles_every_step(monkeypatch):
    """Past PARTS_PER_SIZE_STEP parts the part size doubles, so 10,000 parts go a long way."""
    monkeypatch.setattr(checkpoint.upload, "PARTS_PER_SIZE_STEP", 2)  # read where parts are sized
    sizes: dict[int, int] = {}
    fake = new_fake()
    real = fake.upload_part

    async def recording(bucket, key, upload_id, number, data):
        sizes[number] = len(data)
        return await real(bucket, key, upload_id, number, data)

    fake.upload_part = recording
    sd = state_dict(n=8, numel=4000)
    checkpoint.save(sd, URI, store=reusable(fake), part_size=1000)
    ordered = [sizes[n] for n in sorted(sizes)]
    assert ordered[:6] == [1000, 1000, 2000, 2000, 4000, 4000]
    assert_same(checkpoint.load(URI, store=reusable(fake)), sd)


def test_load_options_pass_through_to_torch():
    fake = new_fake()
    checkpoint.save({"w": torch.ones(4, dtype=torch.float64)}, URI, store=reusable(fake))
    out = checkpoint.load(URI, store=reusable(fake), map_location=lambda storage, loc: storage)
    assert out["w"].dtype == torch.float64


def test_weights_only_refuses_arbitrary_objects_and_names_the_uri():
    fake = new_fake()
    checkpoint.save({"obj": Opaque(3)}, URI, store=reusable(fake))
    with pytest.raises(Exception) as info:
        checkpoint.load(URI, store=reusable(fake))
    assert any(URI in note for note in info.value.__notes__)
    assert checkpoint.load(URI, store=reusable(fake), weights_only=False)["obj"].value == 3


class Opaque:
    def __init__(self, value: int) -> None:
        self.value = value


# ------------------------------------------------------------------------------ concurrency


@pytest.mark.parametrize("inflight", [1, 2, 5])
def test_save_keeps_parts_inflight(inflight):
    fake = new_fake(latency=0.005)
    sd = state_dict(n=8)
    checkpoint.save(sd, URI, store=reusable(fake), part_size=PART, limits=Limits(concurrency=inflight))
    assert fake.peak_parts_inflight == inflight
    assert_same(checkpoint.load(URI, store=reusable(fake)), sd)


@pytest.mark.parametrize("inflight", [1, 3])
def test_load_keeps_requests_inflight(inflight):
    fake = new_fake()
    sd = {"big": torch.randn(50_000, generator=torch.Generator().manual_seed(1))}
    checkpoint.save(sd, URI, store=reusable(fake), part_size=PART)
    fake.latency = 0.005
    fake.reset_counters()
    out = checkpoint.load(URI, store=reusable(fake), part_size=PART, limits=Limits(concurrency=inflight))
    assert_same(out, sd)
    assert fake.peak_inflight == inflight
    size = len(fake.objects[BUCKET, KEY])
    # the 200 KB tensor comes straight from ranged GETs of one part each: about one GET per part
    assert fake.requests <= size // PART + 2 * inflight + 2


def test_save_blocks_the_writer_when_every_slot_is_busy(monkeypatch):
    """Backpressure: with uploads held, torch.save stops after parts_inflight + 1 parts."""
    inflight = 2
    release = threading.Event()

    async def hold(number: int) -> None:
        while not release.is_set():
            await anyio.sleep(0.005)

    writers: list = []
    original = checkpoint._PartWriter

    class Recorded(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            writers.append(self)

    monkeypatch.setattr(checkpoint, "_PartWriter", Recorded)
    fake = new_fake(on_part=hold)
    sd = state_dict(n=8)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            checkpoint.save(sd, URI, store=reusable(fake), part_size=PART, limits=Limits(concurrency=inflight))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 60  # a wait, not a bound: ends once the parts have started
        while fake.parts_started < inflight and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.2)  # the writer would run ahead here if nothing held it back
        assert fake.parts_started == inflight
        assert writers[0].tell() <= (inflight + 1) * PART
    finally:
        release.set()
        thread.join(timeout=30)
    assert not errors
    assert_same(checkpoint.load(URI, store=reusable(fake)), sd)


# ------------------------------------------------------------------------------ retries


def test_transient_part_faults_are_retried():
    fake = new_fake(part_fail={2: [TransientStoreError("503"), TransientStoreError("reset")]})
    sd = state_dict()
    checkpoint.save(sd, URI, store=reusable(fake), part_size=PART)
    assert fake.parts_started == fake.parts_uploaded + 2
    assert_same(checkpoint.load(URI, store=reusable(fake)), sd)


def test_transient_read_faults_are_retried():
    fake = new_fake()
    sd = state_dict()
    checkpoint.save(sd, URI, store=reusable(fake), part_size=PART)
    fake.fail[KEY] = [TransientStoreError("slow down"), TransientStoreError("reset")]
    assert_same(checkpoint.load(URI, store=reusable(fake), part_size=PART), sd)


# ------------------------------------------------------------------------------ failures abort


def test_permanent_part_failure_aborts_and_names_the_uri():
    fake = new_fake(part_fail={3: AccessDeniedError("403 on part 3")}, latency=0.002)
    with pytest.raises(AccessDeniedError, match="403 on part 3") as info:
        checkpoint.save(state_dict(), URI, store=reusable(fake), part_size=PART)
    assert URI in str(info.value)
    assert fake.multipart_created == fake.aborted == 1 and fake.completed == 0
    assert (BUCKET, KEY) not in fake.objects
    nothing_left(fake)


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this one")


def test_torch_save_raising_aborts_and_names_the_uri():
    fake = new_fake()
    sd = {**state_dict(), "bad": Unpicklable()}
    with pytest.raises(RuntimeError, match="cannot pickle this one") as info:
        checkpoint.save(sd, URI, store=reusable(fake), part_size=PART)
    assert any(URI in note for note in info.value.__notes__)
    assert fake.completed == 0 and (BUCKET, KEY) not in fake.objects
    nothing_left(fake)


def test_keyboard_interrupt_midway_aborts(sigint_raises):
    """A real SIGINT to the main thread while part 3 uploads: the upload is aborted."""

    def interrupt(number: int) -> None:
        if number == 3:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    assert threading.current_thread() is threading.main_thread()
    fake = new_fake(on_part=interrupt, latency=0.01)
    with pytest.raises(KeyboardInterrupt) as info:
        checkpoint.save(state_dict(n=12), URI, store=reusable(fake), part_size=PART, limits=Limits(concurrency=2))
    assert any(URI in note for note in info.value.__notes__)
    assert fake.multipart_created == fake.aborted == 1 and fake.completed == 0
    assert fake.parts_started < 30  # it stopped early, not after writing everything
    assert (BUCKET, KEY) not in fake.objects
    nothing_left(fake)


def test_failing_completion_aborts():
    fake = new_fake(multipart_fail={"complete": AccessDeniedError("no complete for you")})
    with pytest.raises(AccessDeniedError) as info:
        checkpoint.save(state_dict(), URI, store=reusable(fake), part_size=PART)
    assert URI in str(info.value)
    assert fake.aborted == 1
    nothing_left(fake)


def test_part_size_below_the_stores_minimum_is_refused_before_any_upload():
    """A store that enforces S3's 5 MiB minimum (FakeStore can) is checked before uploading."""
    fake = new_fake(min_part_size=5 << 20)
    with pytest.raises(ConfigError, match="part_size=4096 is below"):
        checkpoint.save(state_dict(), URI, store=reusable(fake), part_size=PART)
    assert fake.multipart_created == 0 and fake.closed


def test_failed_abort_is_reported_on_the_error():
    fake = new_fake(part_fail={2: AccessDeniedError("denied")},
                    multipart_fail={"abort": AccessDeniedError("abort denied too")})
    with pytest.raises(AccessDeniedError) as info:
        checkpoint.save(state_dict(), URI, store=reusable(fake), part_size=PART)
    notes = " ".join(info.value.__notes__)
    assert "could not abort multipart upload" in notes and "abort denied too" in notes


def test_missing_bucket_on_save_names_the_uri():
    fake = FakeStore()
    with pytest.raises(NoSuchBucketError) as info:
        checkpoint.save(state_dict(), URI, store=reusable(fake), part_size=PART)
    assert URI in str(info.value)
    assert fake.uploads == {}


# ------------------------------------------------------------------------------ load errors


def test_load_missing_key_and_bucket():
    fake = new_fake()
    fake.objects[BUCKET, KEY + ".bak"] = b"other"  # same prefix, different key
    with pytest.raises(NoSuchKeyError) as info:
        checkpoint.load(URI, store=reusable(fake))
    assert URI in str(info.value)
    with pytest.raises(NoSuchBucketError) as info:
        checkpoint.load("s3://no-such-bucket/x.pt", store=reusable(fake))
    assert "s3://no-such-bucket/x.pt" in str(info.value)


def test_load_read_failure_names_the_uri():
    fake = new_fake()
    checkpoint.save(state_dict(), URI, store=reusable(fake), part_size=PART)
    fake.fail[KEY] = AccessDeniedError("denied")
    with pytest.raises(AccessDeniedError) as info:
        checkpoint.load(URI, store=reusable(fake), part_size=PART)
    assert URI in str(info.value)
    assert fake.closed


def test_load_of_a_non_checkpoint_names_the_uri():
    fake = new_fake()
    fake.objects[BUCKET, KEY] = b"not a zip file at all" * 100
    with pytest.raises(Exception) as info:
        checkpoint.load(URI, store=reusable(fake))
    assert any(URI in note for note in getattr(info.value, "__notes__", ()))


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: checkpoint.save({}, "s3://bucket-x/", store=reusable(new_fake())), "names no object"),
        (lambda: checkpoint.load("http://bucket-x/a.pt", store=reusable(new_fake())), "not an S3 URI"),
        (lambda: checkpoint.save({}, URI, part_size=0, store=reusable(new_fake())), "part_size=0"),
        (lambda: checkpoint.save({}, URI, part_size=6 << 30, store=reusable(new_fake())), "part_size="),
        (lambda: checkpoint.load(URI, limits=Limits(concurrency=0), store=reusable(new_fake())),
         "Limits.concurrency=0"),
        (lambda: checkpoint.load(URI, limits=Limits(memory=8 << 20), part_size=4 << 20,
                                 store=reusable(new_fake())), r"Limits\(memory=8388608\) holds no part"),
        (lambda: checkpoint.save({}, URI, store=Store(backend=reusable(new_fake()), cache="/tmp/c")),
         "checkpoints are not cached"),
        (lambda: checkpoint.save({}, URI, store="s3fs"), "store='s3fs' is not a known backend"),
    ],
)
def test_bad_arguments_fail_before_any_io(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_store_without_multipart_is_refused():
    class PutOnly:
        async def put(self, bucket, key, data):  # pragma: no cover - never reached
            raise AssertionError

        async def aclose(self):
            pass

    async def factory():
        return PutOnly()

    with pytest.raises(ConfigError, match="no multipart upload"):
        checkpoint.save({}, URI, store=factory)


def test_obstore_backend_means_aioboto3_for_checkpoints():
    from loader.config import S3Config

    config = S3Config(endpoint_url="http://127.0.0.1:1", access_key_id="a", secret_access_key="b")
    given = checkpoint._NOT_GIVEN
    *_, factory = checkpoint._prepare(URI, config, Limits(concurrency=4), "obstore", given, given, 8 << 20,
                                      per_part=1, spare=1)
    assert factory.args[0] == "aioboto3" and factory.keywords["max_connections"] == 5


def test_save_while_handling_an_interrupt_reports_its_own_error():
    """Saving from ``except KeyboardInterrupt:`` is common; that interrupt is not ours."""
    fake = new_fake(part_fail={2: AccessDeniedError("denied")})
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        with pytest.raises(AccessDeniedError):
            checkpoint.save(state_dict(), URI, store=reusable(fake), part_size=PART)
        checkpoint.save({"w": torch.ones(2)}, URI, store=reusable(fake))
    assert_same(checkpoint.load(URI, store=reusable(fake)), {"w": torch.ones(2)})
    nothing_left(fake)


def test_cause_finds_an_interrupt_that_torch_reported_as_runtime_error():
    """An interrupt landing on entry to ``write`` reaches us as torch's RuntimeError."""
    interrupt = KeyboardInterrupt()
    echo = RuntimeError("[enforce fail at inline_container.cc] unexpected pos 1 vs 2")
    echo.__context__ = interrupt
    assert checkpoint._cause(echo, None, None) is interrupt
    recorded = AccessDeniedError("denied")
    assert checkpoint._cause(echo, recorded, None) is recorded
    handled_by_caller = KeyboardInterrupt()
    plain = ValueError("bad")
    plain.__context__ = handled_by_caller
    assert checkpoint._cause(plain, None, handled_by_caller) is plain
    escaped = OSError("disk on fire")
    echo2 = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 10 vs 8")
    echo2.__context__ = escaped
    assert checkpoint._cause(echo2, None, None) is escaped
    unrelated = RuntimeError("some other torch failure")
    unrelated.__context__ = escaped
    assert checkpoint._cause(unrelated, None, None) is unrelated


def test_a_forked_child_can_checkpoint_after_the_parent_did():
    """Nothing of ours (thread, loop, client) survives a call, so forking afterwards is safe."""
    import multiprocessing

    fake = new_fake()
    sd = state_dict()
    checkpoint.save(sd, URI, store=reusable(fake), part_size=PART)
    assert_same(checkpoint.load(URI, store=reusable(fake), part_size=PART), sd)
    child = multiprocessing.get_context("fork").Process(target=_child_round_trip, args=(fake,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():  # pragma: no cover - a hang is the failure this test looks for
        child.kill()
        child.join()
        pytest.fail("the forked child hung")
    assert child.exitcode == 0


def _child_round_trip(fake: FakeStore) -> None:
    sd = state_dict(seed=5)
    checkpoint.save(sd, URI, store=reusable(fake), part_size=PART)
    assert_same(checkpoint.load(URI, store=reusable(fake), part_size=PART), sd)


# ------------------------------------------------------------------------------ killed saves


@pytest.mark.parametrize("multipart", [False, True])
def test_the_next_save_aborts_what_a_killed_save_left_open(caplog, multipart):
    """A save killed outright (SIGKILL: nothing runs to abort) leaves its multipart upload open,
    parts stored and billed out of sight; the next save of that key aborts it, and says so.
    Another key's open upload (someone else's save) is left alone."""
    fake = new_fake()

    async def left_open() -> None:
        store = await reusable(fake)()
        try:
            await store.create_multipart(BUCKET, KEY)  # the killed save's
            await store.create_multipart(BUCKET, KEY + ".other")  # another key's
        finally:
            await store.aclose()

    anyio.run(left_open)
    sd = state_dict() if multipart else {"w": torch.arange(10.0)}
    with caplog.at_level("WARNING", logger="loader.checkpoint"):
        checkpoint.save(sd, URI, store=reusable(fake), part_size=PART)
    assert_same(checkpoint.load(URI, store=reusable(fake)), sd)
    assert [(upload.key) for upload in fake.uploads.values()] == [KEY + ".other"]
    assert fake.aborted == 1
    assert [r.getMessage() for r in caplog.records if "unfinished" in r.getMessage()] == [
        f"aborted 1 unfinished multipart upload(s) of {URI} left by an earlier save that was killed "
        "before it could abort (their parts were stored and billed out of sight); a bucket lifecycle "
        "rule AbortIncompleteMultipartUpload cleans up those of keys never saved again (docs/design/checkpoint.md)"]


# ------------------------------------------------------------------------------ the old spellings


def test_the_old_spellings_still_work_and_name_the_new_ones():
    """``parts_inflight=`` and ``retry=`` were the datasets' old spellings too: they still land
    where they did, with a DeprecationWarning naming ``Limits`` and ``Store``."""
    fake = new_fake(latency=0.005)
    sd = state_dict(n=8)
    with pytest.warns(DeprecationWarning, match=r"parts_inflight= .* limits=Limits\(concurrency=\.\.\.\)"):
        checkpoint.save(sd, URI, store=reusable(fake), part_size=PART, parts_inflight=2)
    assert fake.peak_parts_inflight == 2
    fake.reset_counters()
    with pytest.warns(DeprecationWarning, match=r"retry= .* store=Store\(retry=\.\.\.\)"):
        out = checkpoint.load(URI, store=reusable(fake), part_size=PART, retry=RetryPolicy(max_attempts=2))
    assert_same(out, sd)
    with pytest.raises(ConfigError, match="parts_inflight=0"), pytest.warns(DeprecationWarning):
        checkpoint.load(URI, parts_inflight=0, store=reusable(fake))


def test_the_groups_set_parts_and_retries():
    """``Limits(concurrency=)`` is the parts in flight, ``Limits(memory=)`` lowers them to fit
    (a save holds ``parts + 1`` parts), ``Store(retry=)`` the retry policy."""
    fake = new_fake(latency=0.005)
    sd = state_dict(n=8)
    checkpoint.save(sd, URI, store=Store(backend=reusable(fake)), part_size=PART,
                    limits=Limits(concurrency=5, memory=3 * PART + (8 << 20)))
    assert fake.peak_parts_inflight == 5, "memory enough for more: concurrency decides"
    big = {"big": torch.randn(6 << 18, generator=torch.Generator().manual_seed(2))}  # 6 MiB
    checkpoint.save(big, URI, store=reusable(fake), part_size=1 << 20)
    fake.reset_counters()
    out = checkpoint.load(URI, store=Store(backend=reusable(fake), retry=RetryPolicy(max_attempts=1)),
                          part_size=1 << 20, limits=Limits(memory=8 << 20))
    assert_same(out, big)
    assert fake.peak_inflight == 2, "a load holds about 3 parts per GET in flight: 2 of 1 MiB fit in 8 MiB"
