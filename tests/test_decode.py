"""Stock decoders, transform error wrapping, and the fast image path against the Pillow recipe."""

from __future__ import annotations

import functools
import io
import json
import math
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from loader import SampleError, decode
from loader.decode import (
    apply_transform,
    collate_raw,
    decode_image,
    decode_images,
    decode_sample,
)
from loader.tools.demo import photo_jpeg


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


# ----------------------------------------------------------------------------- fast images

PSNR_BOUND = 35.0


def recipe(data, size, mode="RGB", exif=False):
    """The usual recipe: Pillow full decode -> convert -> resize BILINEAR -> CHW tensor."""
    with Image.open(io.BytesIO(data)) as image:
        if exif:
            image = ImageOps.exif_transpose(image)
        image = image.convert(mode)
        if size is not None:
            image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
        pixels = np.asarray(image)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1)


def psnr(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    mse = (a.float() - b.float()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def encode(image, fmt="JPEG", **kwargs):
    out = io.BytesIO()
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


def scaled_photo(index, width, height):
    """A photo-like JPEG at a chosen size (large ones exercise the 1/2, 1/4, 1/8 DCT scales)."""
    with Image.open(io.BytesIO(photo_jpeg(index))) as image:
        return encode(image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC), quality=90)


@pytest.fixture(params=["simplejpeg", "pillow"])
def backend(request, monkeypatch):
    """Every fast-path test runs with libjpeg-turbo (simplejpeg) and with the Pillow fallback."""
    if request.param == "pillow":
        monkeypatch.setattr(decode, "_simplejpeg", lambda: None)
    else:
        assert decode._simplejpeg() is not None, "simplejpeg is part of the image extra"
    return request.param


PHOTOS = [photo_jpeg(i) for i in range(6)] + [scaled_photo(10, 1000, 900), scaled_photo(11, 2000, 1900),
                                              scaled_photo(12, 230, 300), scaled_photo(13, 120, 90)]


@pytest.mark.parametrize("size", [(224, 224), (160, 256), (96, 96)])
def test_resized_photos_stay_within_the_psnr_bound_of_the_pillow_recipe(backend, size):
    for data in PHOTOS:
        out = decode_image(data, size)
        assert out.shape == (3, *size) and out.dtype == torch.uint8
        assert psnr(out, recipe(data, size)) >= PSNR_BOUND


def test_without_size_the_full_image_comes_back_as_pillow_decodes_it(backend):
    data = photo_jpeg(3)
    out = decode_image(data)
    expected = recipe(data, None)
    assert out.shape == expected.shape and out.dtype == torch.uint8
    assert psnr(out, expected) >= 45  # same libjpeg-turbo underneath; only the IDCT flavour may differ
    out[0, 0, 0] = 7  # memory the caller owns (Pillow's arrays are read-only)


def test_large_jpegs_are_decoded_at_a_reduced_scale(monkeypatch):
    seen = {}
    simplejpeg = decode._simplejpeg()

    class Spy:
        decode_jpeg_header = staticmethod(simplejpeg.decode_jpeg_header)

        @staticmethod
        def decode_jpeg(data, **kwargs):
            array = simplejpeg.decode_jpeg(data, **kwargs)
            seen["shape"] = array.shape
            return array

    monkeypatch.setattr(decode, "_simplejpeg", lambda: Spy)
    out = decode_image(scaled_photo(11, 2000, 1900), (224, 224))
    assert out.shape == (3, 224, 224)
    assert seen["shape"] == (238, 250, 3)  # 1/8 scale: the smallest that still covers 224


@pytest.mark.parametrize("mode, channels", [("RGB", 3), ("L", 1), ("RGBA", 4)])
def test_modes(backend, mode, channels):
    data = photo_jpeg(1)
    out = decode_image(data, (64, 80), mode=mode)
    assert out.shape == (channels, 64, 80) and out.dtype == torch.uint8
    assert psnr(out, recipe(data, (64, 80), mode)) >= PSNR_BOUND


def test_grayscale_jpeg_becomes_three_equal_channels(backend):
    gray = Image.open(io.BytesIO(photo_jpeg(2))).convert("L")
    data = encode(gray, quality=90)
    out = decode_image(data, (100, 120))
    assert out.shape == (3, 100, 120)
    assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])
    assert psnr(out, recipe(data, (100, 120))) >= PSNR_BOUND


def test_cmyk_jpeg_goes_through_pillow_and_matches_its_conversion(backend):
    cmyk = Image.open(io.BytesIO(photo_jpeg(4))).convert("CMYK")
    data = encode(cmyk, quality=90)
    out = decode_image(data, (128, 128))
    assert out.shape == (3, 128, 128)
    assert psnr(out, recipe(data, (128, 128))) >= PSNR_BOUND


@pytest.mark.parametrize("kind", ["RGBA", "P-transparent", "L", "LA", "I;16"])
def test_pngs(backend, kind):
    base = Image.open(io.BytesIO(photo_jpeg(5))).convert("RGB")
    if kind == "RGBA":
        image = base.convert("RGBA")
        image.putalpha(Image.linear_gradient("L").resize(base.size))
    elif kind == "P-transparent":
        image = base.convert("P", palette=Image.Palette.ADAPTIVE)
        image.info["transparency"] = 0
    elif kind == "I;16":
        image = Image.fromarray(np.asarray(base.convert("L")).astype(np.uint16) * 257)
    else:
        image = base.convert(kind)
    data = encode(image, "PNG")
    for size in (None, (200, 150)):
        out = decode_image(data, size)
        expected = recipe(data, size)
        assert out.dtype == torch.uint8 and out.shape == expected.shape
        assert psnr(out, expected) >= PSNR_BOUND


def exif_jpeg(orientation):
    image = Image.open(io.BytesIO(photo_jpeg(6))).convert("RGB").resize((300, 200))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(image, quality=92, exif=exif.tobytes())


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_on_request_and_ignored_by_default(backend, orientation):
    data = exif_jpeg(orientation)
    upright = decode_image(data, (120, 90), apply_exif_orientation=True)
    assert psnr(upright, recipe(data, (120, 90), exif=True)) >= PSNR_BOUND
    full = decode_image(data, apply_exif_orientation=True)
    assert full.shape == recipe(data, None, exif=True).shape
    as_stored = decode_image(data)
    assert as_stored.shape == (3, 200, 300)  # like Image.open and the usual recipe


def test_bytes_that_are_no_image_are_refused_clearly(backend):
    with pytest.raises(ValueError, match=r"cannot decode 12 bytes \(starting b'not an i'\) as an image"):
        decode_image(b"not an image", (8, 8))
    whole = photo_jpeg(0)
    with pytest.raises(ValueError, match="cannot decode 300 bytes"):
        decode_image(whole[:300], (8, 8))
    with pytest.raises(ValueError, match="truncated"):  # cut mid-scan: refused, not grey-filled
        decode_image(whole[:len(whole) // 2], (8, 8))


def test_bad_arguments_name_the_setting():
    with pytest.raises(ValueError, match=r"mode must be one of 'RGB', 'L', 'RGBA', got 'CMYK'"):
        decode_image(jpeg(), mode="CMYK")
    with pytest.raises(ValueError, match=r"size must be \(height, width\) or None, got 224"):
        decode_image(jpeg(), 224)
    with pytest.raises(ValueError, match=r"size must be positive"):
        decode_image(jpeg(), (0, 4))
    with pytest.raises(ValueError, match=r"decode_images needs size"):
        decode_images([jpeg()], None)


def test_without_the_image_extra_the_error_names_it(monkeypatch):
    data = photo_jpeg(0)
    for name in ("numpy", "PIL", "PIL.Image", "PIL.ImageOps", "simplejpeg"):
        monkeypatch.setitem(sys.modules, name, None)
    decode._pillow.cache_clear()
    decode._simplejpeg.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"needs the `image` extra.*pip install 's3stream-loader\[image\]'"):
            decode_image(data, (8, 8))
    finally:
        decode._pillow.cache_clear()
        decode._simplejpeg.cache_clear()


def test_decode_sample_resizes_images_when_given_a_size():
    sample = {"__key__": "k", "jpg": photo_jpeg(0), "cls": b"3"}
    transform = functools.partial(decode_sample, size=(32, 48))
    out = apply_transform(transform, sample)
    assert out["jpg"].shape == (3, 32, 48) and out["cls"] == 3


# ----------------------------------------------------------------------------- batches


def test_collate_raw_keeps_bytes_and_labels_as_they_are():
    samples = [{"__key__": f"k{i}", "jpg": bytes([i]) * 3, "cls": i} for i in range(3)]
    batch = collate_raw(samples)
    assert batch == {"__key__": ["k0", "k1", "k2"], "jpg": [b"\0" * 3, b"\1" * 3, b"\2" * 3], "cls": [0, 1, 2]}
    assert batch["jpg"][1] is samples[1]["jpg"]
    assert collate_raw([(b"a", 1), (b"b", 2)]) == ([b"a", b"b"], [1, 2])
    assert collate_raw([b"a", b"b"]) == [b"a", b"b"]
    assert collate_raw([]) == []


def test_decode_images_on_the_cpu_matches_decode_image():
    images = [photo_jpeg(0), encode(Image.open(io.BytesIO(photo_jpeg(1))), "PNG"), photo_jpeg(2)]
    batch = decode_images(images, (64, 96))
    assert batch.shape == (3, 3, 64, 96) and batch.dtype == torch.uint8 and batch.device.type == "cpu"
    for out, data in zip(batch, images):
        assert torch.equal(out, decode_image(data, (64, 96)))
    assert decode_images([], (8, 8)).shape == (0, 3, 8, 8)


def test_decode_images_asks_for_cuda_that_is_not_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda'.*no CUDA device.*device='cpu'"):
        decode_images([jpeg()], (8, 8), "cuda")


@pytest.mark.parametrize("failure", [ImportError, RuntimeError, OSError])
def test_a_torchvision_that_does_not_import_means_the_cpu_path(monkeypatch, failure):
    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torchvision":
                raise failure("torchvision does not load next to this torch")

    for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    decode._nvjpeg.cache_clear()
    try:
        assert decode._nvjpeg() is None
    finally:
        decode._nvjpeg.cache_clear()


def fake_nvjpeg():
    """torchvision.io.decode_jpeg's contract (list of uint8 buffers -> list of CHW tensors), done
    by Pillow on the CPU: exercises the batch path's resize and fallbacks without a GPU."""
    class ReadMode:
        RGB, GRAY = "RGB", "L"

    calls = []

    def decode_jpeg(buffers, device, mode, apply_exif_orientation):
        calls.append(len(buffers) if isinstance(buffers, list) else 1)
        many = isinstance(buffers, list)
        out = []
        for buffer in buffers if many else [buffers]:
            data = buffer.numpy().tobytes()
            if Image.open(io.BytesIO(data)).mode == "CMYK":
                raise RuntimeError("nvJPEG: unsupported colour space")
            out.append(recipe(data, None, mode, exif=apply_exif_orientation).to(device))
        return out if many else out[0]

    return decode_jpeg, ReadMode, calls


def test_the_device_batch_path_resizes_and_falls_back_per_image():
    decode_jpeg, read_mode, calls = fake_nvjpeg()
    cmyk = encode(Image.open(io.BytesIO(photo_jpeg(3))).convert("CMYK"), quality=90)
    png = encode(Image.open(io.BytesIO(photo_jpeg(4))), "PNG")
    images = [photo_jpeg(0), scaled_photo(12, 230, 300), cmyk, png, scaled_photo(13, 224, 224)]
    size = (224, 224)
    batch = decode._decode_batch_on_device(images, size, torch.device("cpu"), "RGB", False,
                                           decode_jpeg, read_mode)
    assert batch.shape == (5, 3, 224, 224) and batch.dtype == torch.uint8
    for out, data in zip(batch, images):
        assert psnr(out, recipe(data, size)) >= PSNR_BOUND
    assert calls[0] == 4  # one call for the four JPEGs, then one at a time after the CMYK failure


@settings(max_examples=25)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=6),
       st.tuples(st.integers(1, 24), st.integers(1, 24)))
def test_the_compiled_resize_loop_gives_the_plain_loops_pixels(shapes, target):
    """The batch path's resize runs compiled (without the GIL); it must be the plain loop exactly."""
    generator = torch.Generator().manual_seed(len(shapes))
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator) for h, w in shapes]
    places = list(range(len(images)))[::-1]
    plain, compiled = (torch.zeros((len(images), 3, *target)) for _ in range(2))
    decode.resize_into(images, places, plain)
    decode._resize_loop()(images, places, compiled)
    assert torch.equal(plain, compiled)
    assert decode._resize_loop() is not decode.resize_into  # TorchScript took it, here at least


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_nvjpeg_on_a_cuda_device_matches_the_recipe():
    if decode._nvjpeg() is None:
        pytest.skip("no CUDA device with a loadable torchvision")
    images = PHOTOS + [encode(Image.open(io.BytesIO(photo_jpeg(4))), "PNG")]
    batch = decode_images(images, (224, 224), "cuda")
    assert batch.shape == (len(images), 3, 224, 224) and batch.device.type == "cuda"
    for out, data in zip(batch.cpu(), images):
        assert psnr(out, recipe(data, (224, 224))) >= PSNR_BOUND
