"""Key list files: the format round-trips, damage is named, and mapped lists pickle as they should."""

from __future__ import annotations

import copy
import os
import pickle
from multiprocessing.context import set_spawning_popen

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ConfigError
from loader.listing import keyfile, nodeshare
from loader.listing.keyfile import is_keyfile, open_keys, parse_keys, read_header, to_bytes, write_keys
from loader.listing.keylist import KeyList
from loader.s3.protocol import ObjectInfo

KEYS = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
ETAGS = st.one_of(st.none(), st.just("d41d8cd98f00b204e9800998ecf8427e"),
                  st.from_regex(r"[0-9a-f]{32}-[0-9]{1,3}", fullmatch=True))


@st.composite
def key_lists(draw):
    keys = draw(st.lists(KEYS, max_size=60, unique=True))
    kind = draw(st.sampled_from(["plain", "sizes", "infos"]))
    if kind == "plain":
        return KeyList.from_keys(keys)
    if kind == "sizes":
        return KeyList.from_keys(keys, [len(k) * 7 for k in keys])
    etags = draw(st.lists(ETAGS, min_size=len(keys), max_size=len(keys)))
    return KeyList.from_infos(ObjectInfo(k, i, e) for i, (k, e) in enumerate(zip(keys, etags)))


@pytest.fixture(autouse=True)
def share_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(nodeshare.SHARE_DIR_ENV, str(tmp_path / "share"))
    (tmp_path / "share").mkdir()
    return tmp_path / "share"


@settings(max_examples=150, deadline=None)
@given(key_lists())
def test_a_written_list_maps_back_equal_with_sizes_and_etags(tmp_path_factory, keys):
    path = tmp_path_factory.mktemp("k") / "list.keys"
    written = write_keys(keys, path, source={"bucket": "b", "prefix": "p/"})
    mapped = open_keys(path, verify=True)
    assert mapped == keys and list(mapped) == list(keys) and len(mapped) == len(keys)
    assert mapped.nbytes == keys.nbytes
    if keys._sizes is not None:
        assert [mapped.size(i) for i in range(len(keys))] == list(keys._sizes)
    assert mapped.etags() == keys.etags()
    assert mapped._origin.id == written.id and read_header(path).uri == "s3://b/p/"
    assert parse_keys(path.read_bytes()) == keys and to_bytes(mapped) == path.read_bytes()
    again = pickle.loads(pickle.dumps(mapped))  # not starting a process: self-contained
    assert again == keys and again._origin is None and again.etags() == keys.etags()


def test_a_mapped_list_reads_the_file_without_copying_it(tmp_path):
    keys = KeyList.from_keys([f"train/{i:07d}.jpg" for i in range(20_000)])
    write_keys(keys, tmp_path / "k")
    mapped = open_keys(tmp_path / "k")
    assert not isinstance(mapped._blob, bytes), "the keys are a map of the file, not a copy"
    assert mapped[12_345] == "train/0012345.jpg" and mapped[-1] == "train/0019999.jpg"
    assert copy.deepcopy(mapped) is mapped and copy.copy(keys) is keys
    assert mapped[10:12] == ["train/0000010.jpg", "train/0000011.jpg"]


def test_damaged_or_foreign_files_are_named_errors(tmp_path):
    keys = KeyList.from_infos(ObjectInfo(f"k{i}", i, "d41d8cd98f00b204e9800998ecf8427e") for i in range(500))
    path = tmp_path / "list.keys"
    write_keys(keys, path)
    data = path.read_bytes()
    (tmp_path / "short").write_bytes(data[:-100])
    with pytest.raises(ConfigError, match=r"'.*short' is truncated: section 'etag_ends'"):
        open_keys(tmp_path / "short")
    flipped = bytearray(data)
    flipped[keyfile.ALIGN + 10] ^= 0xFF  # a key of the first section
    (tmp_path / "flipped").write_bytes(bytes(flipped))
    open_keys(tmp_path / "flipped")  # mapping does not read everything...
    with pytest.raises(ConfigError, match=r"is corrupt: section 'keys' does not match its checksum"):
        open_keys(tmp_path / "flipped", verify=True)  # ...verifying does
    (tmp_path / "text.txt").write_text("train/1.jpg\n")
    assert not is_keyfile(tmp_path / "text.txt") and is_keyfile(path)
    with pytest.raises(ConfigError, match=r"not a key list file .*loader ls --save"):
        open_keys(tmp_path / "text.txt")
    future = bytearray(data)
    future[8] = 99
    (tmp_path / "future").write_bytes(bytes(future))
    with pytest.raises(ConfigError, match=r"format version 99; this loader reads version 1"):
        open_keys(tmp_path / "future")
    with pytest.raises(FileNotFoundError, match=r"key list file '.*nothing' does not exist"):
        open_keys(tmp_path / "nothing")


def test_a_file_replaced_under_a_reference_is_an_error(tmp_path):
    path = tmp_path / "snap.keys"
    first = write_keys(KeyList.from_keys(["a", "b"]), path)
    write_keys(KeyList.from_keys(["a", "c"]), path)
    with pytest.raises(ConfigError, match=r"was replaced since this job read it"):
        open_keys(path, expect_id=first.id)


class _Starting:
    """What ``multiprocessing`` sets while it pickles a process being started."""


def pickled_for_a_new_process(obj):
    set_spawning_popen(_Starting())
    try:
        return pickle.dumps(obj)
    finally:
        set_spawning_popen(None)


def test_into_a_process_being_started_a_mapped_list_travels_as_its_file(tmp_path):
    keys = KeyList.from_keys(["a/1.jpg", "a/2.jpg"])
    write_keys(keys, tmp_path / "k")
    mapped = open_keys(tmp_path / "k")
    blob = pickled_for_a_new_process(mapped)
    assert len(blob) < 200 and b"a/1.jpg" not in blob, "a reference, not the keys"
    arrived = pickle.loads(blob)
    assert arrived == keys and arrived._origin.id == mapped._origin.id
    write_keys(keys, tmp_path / "k")  # the same keys, but another file: refused
    with pytest.raises(ConfigError, match="was replaced"):
        pickle.loads(blob)


def test_a_large_list_in_memory_moves_to_a_shared_file_when_a_process_starts(share_dir, monkeypatch):
    monkeypatch.setattr(nodeshare, "SPILL_MIN", 1000)
    small = KeyList.from_keys(["x"])
    big = KeyList.from_infos(ObjectInfo(f"train/{i:06d}.jpg", i, f"{i:032x}") for i in range(200))
    assert pickle.loads(pickled_for_a_new_process(small)) == small  # small: bytes, no file
    assert list(share_dir.iterdir()) == []
    blob = pickled_for_a_new_process(big)
    assert len(blob) < 300
    files = sorted(p.name for p in share_dir.iterdir())
    assert [n for n in files if n.endswith(".keys")] and any(f".h{os.getpid()}-" in n for n in files)
    assert big._origin is not None, "the list now reads from the shared file"
    arrived = pickle.loads(blob)
    assert arrived == big and arrived.etags() == big.etags()
    nodeshare.release(nodeshare.process_ident(os.getpid()))  # what this process does at exit
    assert list(share_dir.iterdir()) == []
    assert keyfile.origin(big) is not None and big[199] == "train/000199.jpg", "still mapped"


def test_notes_kept_beside_the_keys_map_back_and_travel_with_a_shared_copy(tmp_path):
    """Annotations (bytes or i64 arrays) are sections of the file: mapped back, checked by the
    CRC like the keys, and kept when the list is published for the machine's other processes."""
    import array

    keys = KeyList.from_keys(["a/1.jpg", "a/2.jpg"])
    notes = {"x.bytes": b"jpg\0", "x.numbers": array.array("q", [0, 2, 5]), "x.empty": array.array("q")}
    write_keys(keys, tmp_path / "k.keys", notes=notes)
    mapped = open_keys(tmp_path / "k.keys", verify=True)
    got = keyfile.origin(mapped).notes
    assert bytes(got["x.bytes"]) == b"jpg\0"
    assert list(got["x.numbers"]) == [0, 2, 5] and len(got["x.empty"]) == 0
    shared = nodeshare.NodeFile("notes-test").publish(mapped, anchor=os.getpid())
    assert keyfile.origin(shared).path != keyfile.origin(mapped).path
    assert list(keyfile.origin(shared).notes["x.numbers"]) == [0, 2, 5]
    again = tmp_path / "again.keys"
    write_keys(mapped, again, notes=got)  # a note read back (a map) is written as it came
    assert list(keyfile.origin(open_keys(again)).notes["x.numbers"]) == [0, 2, 5]
    with pytest.raises(ValueError, match="array\\('q'\\)"):
        write_keys(keys, tmp_path / "bad.keys", notes={"x": array.array("i", [1])})
    blob = bytearray((tmp_path / "k.keys").read_bytes())
    blob[-1] ^= 0xFF  # the last section written: a note's
    (tmp_path / "k.keys").write_bytes(bytes(blob))
    with pytest.raises(ConfigError, match="corrupt: section 'note:"):
        open_keys(tmp_path / "k.keys", verify=True)
