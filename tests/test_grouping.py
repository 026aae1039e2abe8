"""Grouping object keys into samples by stem, and class labels: pure, property-tested."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ConfigError
from loader.formats.objects import build_index, field_of, is_hidden, parent_folder

STEMS = st.lists(st.from_regex(r"[a-c]{1,2}/[0-9]{1,3}", fullmatch=True), min_size=1, max_size=30,
                 unique=True)
EXTS = st.lists(st.sampled_from(["jpg", "cls", "json", "seg.png", ""]), min_size=1, max_size=4,
                unique=True)


@st.composite
def key_lists(draw):
    """Distinct keys, several per stem, in a shuffled order (as a key list may come)."""
    stems = draw(STEMS)
    keys = [f"{stem}.{ext}" if ext else stem for stem in stems for ext in draw(EXTS)]
    return draw(st.permutations(keys))


@settings(max_examples=200, deadline=None)
@given(key_lists())
def test_every_key_in_exactly_one_sample_of_its_stem(keys):
    index = build_index(keys)
    seen = [key for i in range(len(index)) for key in index.objects(i)]
    assert sorted(seen) == sorted(keys)
    stems = {key.split(".", 1)[0] for key in keys}
    assert len(index) == len(stems)
    for i in range(len(index)):
        objects = index.objects(i)
        assert {key.split(".", 1)[0] for key in objects} == {index.stem(i)}
        assert len({field_of(key) for key in objects}) == len(objects)


@settings(max_examples=100, deadline=None)
@given(key_lists())
def test_sample_order_is_first_appearance_and_keys_keep_their_order(keys):
    index = build_index(keys)
    first = list(dict.fromkeys(key.split(".", 1)[0] for key in keys))
    assert [index.stem(i) for i in range(len(index))] == first
    for i in range(len(index)):
        objects = index.objects(i)
        assert list(objects) == [key for key in keys if key in objects]


@settings(max_examples=100, deadline=None)
@given(key_lists())
def test_group_false_is_one_object_per_sample(keys):
    index = build_index(keys, group=False)
    assert [index.objects(i) for i in range(len(index))] == [(key,) for key in keys]


def test_sample_dict_has_one_field_per_object_and_the_first_url():
    index = build_index(["imgs/00001.jpg", "imgs/00002.jpg", "imgs/00001.cls"])
    assert len(index) == 2
    assert index.sample("b", 0, [b"J", b"7"]) == {
        "__key__": "imgs/00001", "__url__": "s3://b/imgs/00001.jpg", "jpg": b"J", "cls": b"7"}
    assert index.sample("b", 1, [b"K"]) == {
        "__key__": "imgs/00002", "__url__": "s3://b/imgs/00002.jpg", "jpg": b"K"}


def test_fields_follow_webdataset_naming():
    assert field_of("a/b.seg.png") == "seg.png"
    assert field_of("a/b") == "data"
    assert field_of("a.b/c.jpg") == "jpg"
    assert is_hidden("train/cat/.DS_Store") and is_hidden("._x.jpg") and not is_hidden("a/.b/c.jpg")
    assert parent_folder("train/cat/1.jpg") == "cat" and parent_folder("1.jpg") is None


def test_duplicate_field_in_a_sample_is_an_error_naming_both_keys():
    with pytest.raises(ConfigError, match=r"'a/1.jpg' and 'a/1.jpg' both give field 'jpg'.*group=False"):
        build_index(["a/1.jpg", "a/1.jpg"])
    assert len(build_index(["a/1.jpg", "a/1.jpg"], group=False)) == 2


def test_reserved_field_is_an_error():
    with pytest.raises(ConfigError, match=r"'a/1.__key__'.*reserved"):
        build_index(["a/1.__key__"])


def test_parent_labels_number_sorted_class_names_like_imagefolder():
    keys = ["train/dog/1.jpg", "train/cat/2.jpg", "train/Zebra/3.jpg", "train/cat/4.jpg"]
    index = build_index(keys, label_from="parent", root="train/")
    assert index.classes == ("Zebra", "cat", "dog")  # sorted(), as ImageFolder: uppercase first
    assert index.class_to_idx == {"Zebra": 0, "cat": 1, "dog": 2}
    assert [index.label(i) for i in range(4)] == [2, 1, 0, 1]
    assert index.sample("b", 0, [b"x"])["cls"] == 2


def test_parent_label_needs_a_class_folder():
    with pytest.raises(ConfigError, match=r"'train/readme.txt' is not in a class folder under s3://b/train/"):
        build_index(["train/cat/1.jpg", "train/readme.txt"], label_from="parent",
                    where="s3://b/train/", root="train/")
    with pytest.raises(ConfigError, match=r"'top.jpg' is not in a class folder"):
        build_index(["top.jpg"], label_from="parent")


def test_label_and_a_cls_object_conflict():
    with pytest.raises(ConfigError, match=r"'c/1.cls' fills the field 'cls'.*label_from='parent'"):
        build_index(["c/1.jpg", "c/1.cls"], label_from="parent")


def test_label_column_names_and_integers():
    names = build_index(["a.jpg", "b.jpg", "b.json"], labels=["dog", None, "cat"], where="m.csv")
    assert names.classes == ("cat", "dog") and list(names.labels) == [1, 0]
    numbers = build_index(["a.jpg", "b.jpg"], labels=[7, 3], where="m.csv")
    assert numbers.classes is None and list(numbers.labels) == [7, 3]
    with pytest.raises(ConfigError, match=r"m.csv: sample 'b' has no label"):
        build_index(["a.jpg", "b.jpg"], labels=[1, None], where="m.csv")
    with pytest.raises(ConfigError, match=r"m.csv: the rows of sample 'a' disagree"):
        build_index(["a.jpg", "a.json"], labels=[1, 2], where="m.csv")
    with pytest.raises(ConfigError, match=r"mix class names and integers"):
        build_index(["a.jpg", "b.jpg"], labels=[1, "x"], where="m.csv")
    with pytest.raises(ConfigError, match=r"label column; label_from='parent'"):
        build_index(["x/a.jpg"], labels=[1], label_from="parent", where="m.csv")


def test_index_pickles_small():
    keys = [f"train/{i:06d}.{ext}" for i in range(1000) for ext in ("jpg", "cls")]
    index = build_index(keys)
    copy = pickle.loads(pickle.dumps(index))
    assert copy.keys == index.keys and list(copy.starts) == list(index.starts) and len(copy) == 1000
