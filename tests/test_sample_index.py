"""The sample index over a packed key list: grouping a sorted listing in one pass is exact."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.datasets.object_samples import build_index
from loader.errors import ConfigError
from loader.formats.grouping import split_key
from loader.listing.keylist import KeyList
from loader.s3.protocol import ObjectInfo

# Few characters, the ones that make stems interleave in sorted order: "-" sorts before ".",
# a dot may sit in a folder name (a/1.d/x.jpg), a key may have no extension at all.
PIECES = st.text(st.sampled_from("a1-./"), min_size=1, max_size=7).filter(
    lambda key: not key.endswith("/") and "//" not in key and not key.startswith("/"))


def reference(keys):
    """Samples as the dict-based grouping forms them: stems by first appearance, keys in order."""
    members: dict[str, list[str]] = {}
    for key in keys:
        members.setdefault(split_key(key)[0], []).append(key)
    return [tuple(group) for group in members.values()]


def samples(index):
    return [index.objects(i) for i in range(len(index))]


def fields_unique(keys) -> bool:
    seen = set()
    for key in keys:
        stem, ext = split_key(key)
        if (stem, ext or "data") in seen or ext in ("__key__", "__url__", "__index__"):
            return False
        seen.add((stem, ext or "data"))
    return True


@settings(max_examples=400, deadline=None)
@given(st.lists(PIECES, max_size=40, unique=True))
def test_a_sorted_listing_groups_exactly_as_the_dict_does(keys):
    keys = sorted(keys)
    if not fields_unique(keys):
        return  # two objects giving one field of a sample: an error either way
    packed = KeyList.from_infos(ObjectInfo(key, len(key), None) for key in keys)
    index = build_index(packed)
    assert samples(index) == reference(keys)
    assert index.keys is packed, "the index reads the packed list, it does not copy the keys"
    assert samples(build_index(list(reversed(keys)))) == reference(list(reversed(keys)))


def test_interleaved_stems_are_reordered_and_plain_runs_are_not():
    keys = ["a/1", "a/1-x.jpg", "a/1.cls", "a/1.d/x.jpg", "a/1.jpg", "a/2.jpg"]
    index = build_index(KeyList.from_keys(keys))
    assert samples(index) == [("a/1", "a/1.cls", "a/1.jpg"), ("a/1-x.jpg",), ("a/1.d/x.jpg",),
                              ("a/2.jpg",)]
    assert index.order is not None
    plain = build_index(KeyList.from_keys(["a/1.cls", "a/1.jpg", "a/2.cls", "a/2.jpg"]))
    assert plain.order is None and samples(plain) == [("a/1.cls", "a/1.jpg"), ("a/2.cls", "a/2.jpg")]


def test_a_pinned_index_reads_each_sample_at_the_version_its_key_list_recorded():
    packed = KeyList.from_infos([ObjectInfo("a/1.cls", 1, "e1"), ObjectInfo("a/1.jpg", 2, "e2"),
                                 ObjectInfo("a/2.jpg", 3, None)])
    index = build_index(packed, pinned=True)
    assert index.pinned and index.keys is packed
    assert [[packed.etag(p) for p in index.positions(i)] for i in range(len(index))] == [["e1", "e2"], [None]]


@pytest.mark.parametrize("keys", [
    ["a/1.jpg", "a/2.__url__", "a/3.jpg"],  # one object per sample: fields checked once each
    ["a/1.cls", "a/1.jpg", "a/2.__url__", "a/3.jpg"],  # grouped samples: checked sample by sample
    ["a/3.jpg", "a/2.__url__", "a/1.jpg"],  # not sorted: grouped through a dict
])
def test_a_reserved_field_is_named_by_its_first_key_whichever_way_keys_are_grouped(keys):
    with pytest.raises(ConfigError, match=r"'a/2.__url__'.* has the extension '__url__', which is a "
                                          r"reserved sample field; rename it"):
        build_index(keys, where="s3://b/a/")


def test_a_cls_object_beside_a_label_is_refused_on_the_one_object_per_sample_path():
    keys = [f"a/{i}.jpg" for i in range(5)] + ["a/5.cls", "a/6.jpg"]
    assert len(build_index(keys)) == 7
    with pytest.raises(ConfigError, match=r"'a/5.cls'.* fills the field 'cls', where the label"):
        build_index(keys, labels=[0] * 7, where="manifest.csv")
