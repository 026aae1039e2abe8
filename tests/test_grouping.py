"""Grouping object keys into samples by stem, and class labels: pure, property-tested."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import ConfigError
from loader.datasets.object_samples import build_index, class_folder, class_root, field_of, is_hidden

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
    assert class_folder("train/cat/1.jpg", "train/") == "cat" and class_folder("1.jpg", "") is None
    assert class_folder("train/cat/sub/1.jpg", "train/") == "cat"
    assert class_folder("train/1.jpg", "train/") is None and class_folder("val/cat/1.jpg", "train/") is None


def test_duplicate_field_in_a_sample_is_an_error_naming_both_keys():
    with pytest.raises(ConfigError, match=r"'a/1.jpg' and 'a/1.jpg' both give field 'jpg'.*group=False"):
        build_index(["a/1.jpg", "a/1.jpg"])
    assert len(build_index(["a/1.jpg", "a/1.jpg"], group=False)) == 2


def test_reserved_field_is_an_error():
    with pytest.raises(ConfigError, match=r"'a/1.__key__'.*reserved"):
        build_index(["a/1.__key__"])


def test_parent_labels_number_sorted_class_names_like_imagefolder():
    keys = ["train/dog/1.jpg", "train/cat/2.jpg", "train/Zebra/3.jpg", "train/cat/4.jpg"]
    index = build_index(keys, label_from="parent", prefix="train/")
    assert index.classes == ("Zebra", "cat", "dog")  # sorted(), as ImageFolder: uppercase first
    assert index.class_to_idx == {"Zebra": 0, "cat": 1, "dog": 2}
    assert [index.label(i) for i in range(4)] == [2, 1, 0, 1]
    assert index.sample("b", 0, [b"x"])["cls"] == 2


def test_parent_label_needs_a_class_folder():
    with pytest.raises(ConfigError, match=r"'train/readme.txt' is not in a class folder under s3://b/train/"):
        build_index(["train/cat/1.jpg", "train/readme.txt"], label_from="parent",
                    where="s3://b/train/", prefix="train/")
    with pytest.raises(ConfigError, match=r"'top.jpg' is not in a class folder"):
        build_index(["top.jpg"], label_from="parent")


def test_parent_labels_follow_imagefolder_in_nested_folders():
    """The class is the first folder under the root; deeper folders belong to it, so same-named
    subfolders of different classes never merge (``ImageFolder`` gives 2 classes here)."""
    keys = ["train/cat/a.jpg", "train/cat/sub/e.jpg", "train/dog/sub/d.jpg", "train/cat/kitten/f.jpg"]
    for prefix in ("train/", "train", None):  # a folder, the same without its slash, a key list
        index = build_index(keys, label_from="parent", prefix=prefix)
        assert index.classes == ("cat", "dog"), prefix
        assert [index.classes[index.label(i)] for i in range(4)] == ["cat", "cat", "dog", "cat"]
    with pytest.raises(ConfigError, match=r"'train/a.jpg' is not in a class folder under s3://b/train/ "
                                          r"\(expected train/<class>/<file>"):
        build_index(keys + ["train/a.jpg"], label_from="parent", prefix="train/", where="s3://b/train/")


def test_class_root():
    assert class_root(["a/cat/1.jpg"], "a/") == "a/"
    assert class_root(["a/cat/1.jpg", "a/dog/2.jpg"], "a") == "a/"  # the folder a prefix names
    assert class_root(["a/cat/1.jpg", "a-x/dog/2.jpg"], "a") == ""  # siblings: classes 'a', 'a-x'
    assert class_root(["d/a/cat/1.jpg", "d/a-x/2.jpg"], "d/a") == "d/"
    assert class_root(["x/1.jpg"], "") == ""
    assert class_root(["r/cat/1.jpg", "r/dog/x/y/2.jpg"], None) == "r/"
    assert class_root(["r/cat/1.jpg"], None) == "r/"  # one class still has its folder
    assert class_root(["cat/1.jpg", "r/dog/2.jpg"], None) == ""
    assert class_root(["top.jpg", "r/dog/2.jpg"], None) == ""


SEGMENT = st.from_regex(r"[a-z]{1,3}", fullmatch=True)


@given(root=st.lists(SEGMENT, max_size=3),
       files=st.lists(st.tuples(SEGMENT, st.lists(SEGMENT, max_size=3), SEGMENT), min_size=1, max_size=20),
       slash=st.booleans())
def test_every_object_is_labelled_by_its_first_folder_under_the_root(root, files, slash):
    base = "".join(part + "/" for part in root)
    keys = list(dict.fromkeys(base + "/".join([cls, *sub, name]) + ".jpg" for cls, sub, name in files))
    prefix = base if slash or not base else base[:-1]
    index = build_index(keys, label_from="parent", prefix=prefix)
    expected = [key[len(base):].split("/")[0] for key in index.keys]
    assert [index.classes[index.label(i)] for i in range(len(index))] == expected
    assert list(index.classes) == sorted(set(expected))
    if len(set(expected)) > 1:  # a key list finds the same root when two classes show where it is
        listed = build_index(keys, label_from="parent")
        assert listed.classes == index.classes and list(listed.labels) == list(index.labels)


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
