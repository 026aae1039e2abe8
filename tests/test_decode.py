"""Stock decoders and transform error wrapping."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from loader import SampleError
from loader.decode import apply_transform, decode_sample


def jpeg(width=8, height=6):
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 30)).save(out, format="JPEG")
    return out.getvalue()


def test_decode_sample_by_extension():
    sample = {"__key__": "k", "__url__": "s3://b/k.tar", "jpg": jpeg(), "seg.png": _png(),
              "json": json.dumps({"a": 1}).encode(), "txt": "héllo".encode(), "cls": b" 7\n",
              "bin": b"\x00\x01"}
    out = decode_sample(sample)
    assert out["__key__"] == "k" and out["__url__"] == "s3://b/k.tar"
    assert out["jpg"].dtype == torch.uint8 and out["jpg"].shape == (3, 6, 8)
    assert out["seg.png"].shape == (3, 2, 3)
    assert out["json"] == {"a": 1} and out["txt"] == "héllo" and out["cls"] == 7
    assert out["bin"] == b"\x00\x01"


def _png():
    out = io.BytesIO()
    Image.new("L", (3, 2), 9).save(out, format="PNG")
    return out.getvalue()


def test_a_failing_transform_names_the_object_and_keeps_the_cause():
    sample = {"__key__": "train/1", "__url__": "s3://b/train/1.jpg", "jpg": b"not an image"}
    with pytest.raises(SampleError, match=r"decode_sample.*s3://b/train/1\.jpg.*train/1") as info:
        apply_transform(decode_sample, sample)
    assert info.value.__cause__ is not None and info.value.url == "s3://b/train/1.jpg"


def test_no_transform_returns_the_sample_itself():
    sample = {"__key__": "k"}
    assert apply_transform(None, sample) is sample
