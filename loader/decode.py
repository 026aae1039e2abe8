"""From raw sample dicts to training inputs: ``transform`` application, stock decoders, fast images.

``apply_transform`` turns a transform's failure into a ``SampleError`` naming the object.
``decode_sample`` decodes fields by extension (images, ``json``, text, class ids). Images on the
CPU: ``decode_image`` (libjpeg-turbo at the smallest DCT scale covering ``size``, then torch's
antialiased resize); on a GPU: ``collate_raw`` in the DataLoader and ``decode_images`` per batch
(nvJPEG). Both ways, and why: docs/design/decode.md.
"""

from __future__ import annotations

import functools
import io
import json
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._version import install_hint
from .errors import SampleError

Transform = Callable[[dict[str, Any]], Any]
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp")
TEXT_EXTENSIONS = ("txt", "text", "caption")
INT_EXTENSIONS = ("cls", "cls2", "index", "label")
#: output modes of the image decoders and their channel counts
MODES = {"RGB": 3, "L": 1, "RGBA": 4}
JPEG_MAGIC = b"\xff\xd8\xff"
_SIMPLEJPEG_COLORSPACE = {"RGB": "RGB", "L": "GRAY", "RGBA": "RGBA"}
# what a JPEG's header says that libjpeg-turbo cannot turn into RGB itself: Pillow does it
_PILLOW_ONLY_COLORSPACES = ("CMYK", "YCCK")
_EXIF_ORIENTATION = 0x0112
_INSTALL_HINT = install_hint("image")


def apply_transform(transform: Transform | None, sample: dict[str, Any]) -> Any:
    """``transform(sample)``; a failure is re-raised as ``SampleError`` naming the object."""
    if transform is None:
        return sample
    try:
        return transform(sample)
    except Exception as exc:
        raise SampleError(
            f"transform {getattr(transform, '__name__', transform)!r} failed on "
            f"{sample.get('__url__')} (key {sample.get('__key__')!r}): "
            f"{type(exc).__name__}: {exc}",
            url=sample.get("__url__", ""),
        ) from exc


# ----------------------------------------------------------------------------- libraries


@functools.cache
def _pillow() -> tuple[Any, Any]:
    """``(numpy, PIL.Image)``, or an ImportError that names the extra to install."""
    try:
        import numpy
        from PIL import Image, ImageOps  # noqa: F401  (ImageOps: exif_transpose)
    except ImportError as exc:
        raise ImportError(f"decoding images needs the `image` extra (Pillow, numpy, simplejpeg): "
                          f"{_INSTALL_HINT} ({exc})") from exc
    return numpy, Image


@functools.cache
def _simplejpeg() -> Any:
    """The simplejpeg module, or None: then Pillow decodes JPEGs too (slower, same pixels)."""
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def _check_size(size: Sequence[int] | None) -> tuple[int, int] | None:
    if size is None:
        return None
    try:
        height, width = (int(v) for v in size)
    except (TypeError, ValueError):
        raise ValueError(f"size must be (height, width) or None, got {size!r}") from None
    if height < 1 or width < 1:
        raise ValueError(f"size must be positive (height, width), got {size!r}")
    return height, width


def _check_mode(mode: str) -> int:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    return MODES[mode]


def _from_readonly(array: Any) -> torch.Tensor:
    """A tensor over a read-only numpy array, without torch's "not writable" warning: the pixels
    are only read (resized into a new tensor); ``decode_image`` copies when it returns them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


# ----------------------------------------------------------------------------- one image (CPU)


def decode_image(data: bytes, size: Sequence[int] | None = None, *, mode: str = "RGB",
                 apply_exif_orientation: bool = False) -> torch.Tensor:
    """Image bytes -> ``torch.uint8`` tensor of shape (C, H, W): C = 3 for ``mode="RGB"``,
    1 for ``"L"``, 4 for ``"RGBA"``.

    ``size=(H, W)`` resizes to exactly that (bilinear, antialiased like Pillow's ``resize``), and
    lets JPEGs be decoded at a reduced scale first (any of 1/8 ... 7/8 with libjpeg-turbo; 1/2, 1/4
    or 1/8 through Pillow). The result is laid out
    channels-last in memory (strides (1, W*C, C)); ``.contiguous()`` gives the planar layout, and
    ``torch.stack`` (the DataLoader's collate) copies anyway. ``apply_exif_orientation`` turns the
    image upright as its EXIF Orientation tag says; by default the tag is ignored, like
    ``Image.open``, ``torchvision.io.decode_jpeg`` and every usual recipe.

    Raises ``ValueError`` for bytes that are not an image Pillow or libjpeg-turbo can read and
    ``ImportError`` (naming the ``image`` extra) when the libraries are missing.
    """
    channels = _check_mode(mode)
    target = _check_size(size)
    simplejpeg = _simplejpeg() if bytes(memoryview(data)[:3]) == JPEG_MAGIC else None
    decoded = None
    if simplejpeg is not None:  # its arrays are ours: writable, nothing else refers to them
        decoded = _decode_turbo(simplejpeg, data, target, mode, apply_exif_orientation)
        owned = True
    if decoded is None:  # Pillow's arrays are read-only views of its own buffer
        decoded = _decode_pillow(data, target, mode, apply_exif_orientation)
        owned = False
    pixels, extent = decoded
    if pixels.shape[2] != channels:
        raise ValueError(f"decoded {pixels.shape[2]} channels where mode {mode!r} has {channels}")
    return _resize(pixels, extent, target, owned)


def _resize(pixels: torch.Tensor, extent: tuple[float, float], target: tuple[int, int] | None,
            owned: bool) -> torch.Tensor:
    """(H, W, C) uint8 -> (C, h, w) uint8: torch's antialiased bilinear kernel, which on uint8
    channels-last input matches Pillow's ``resize(BILINEAR)`` at a fraction of its cost.

    ``extent`` is the original image's size in these pixels. After a DCT-scaled decode it is
    fractional (a 1,001 px side at 1/8 is 125.125 px, decoded as 126, the last one partial): the
    scale factors then come from the extent, not the pixel count, and the surplus row or column
    is cut off, so the picture is not stretched by up to 7/8 of a pixel (PSNR 33 -> 42 dB at 96 px).
    """
    chw = pixels.permute(2, 0, 1)
    height, width = chw.shape[1:]
    if target is None or (height, width) == target:
        return chw if owned else chw.clone()  # hand out memory the caller may write to
    if (height, width) == extent:
        out = torch.nn.functional.interpolate(chw.unsqueeze(0), size=target, mode="bilinear",
                                              antialias=True, align_corners=False)
        return out[0]
    # 1 + 1e-9: floor(pixels * factor) must not fall one short of the target by rounding
    factors = (target[0] / extent[0] * (1 + 1e-9), target[1] / extent[1] * (1 + 1e-9))
    out = torch.nn.functional.interpolate(chw.unsqueeze(0), scale_factor=factors, mode="bilinear",
                                          antialias=True, align_corners=False,
                                          recompute_scale_factor=False)
    return out[0, :, :target[0], :target[1]]


def _eighths_for(height: int, width: int, target: tuple[int, int] | None) -> int:
    """The smallest M of libjpeg-turbo's DCT scales M/8 whose output still covers ``target``
    (output sides are rounded up: ceil(side * M / 8)); 8 (full size) without a target.
    Photos keep PSNR ~40-47 dB against the full-decode recipe at 1-3 fewer CPU per pixel."""
    if target is None:
        return 8
    for eighths in range(1, 8):
        if -(-height * eighths // 8) >= target[0] and -(-width * eighths // 8) >= target[1]:
            return eighths
    return 8


def _orientation(data: bytes) -> int:
    """The EXIF Orientation tag (1-8; 1 when absent), read from the header only."""
    _, Image = _pillow()
    try:
        with Image.open(io.BytesIO(data)) as image:
            return int(image.getexif().get(_EXIF_ORIENTATION, 1) or 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block: the decoder says what is wrong, if anything
        return 1


def _orient(pixels: torch.Tensor, extent: tuple[float, float],
            orientation: int) -> tuple[torch.Tensor, tuple[float, float]]:
    """(H, W, C) and its extent turned upright, as ``PIL.ImageOps.exif_transpose`` turns images."""
    turned = _turn(pixels, orientation)
    return turned, (extent if orientation < 5 else (extent[1], extent[0]))


def _turn(pixels: torch.Tensor, orientation: int) -> torch.Tensor:
    if orientation in (2, 4):
        return pixels.flip(1 if orientation == 2 else 0)
    if orientation == 3:
        return pixels.flip(0, 1)
    if orientation == 5:  # TRANSPOSE
        return pixels.transpose(0, 1)
    if orientation == 6:  # ROTATE_270 (90° clockwise)
        return pixels.transpose(0, 1).flip(1)
    if orientation == 7:  # TRANSVERSE
        return pixels.transpose(0, 1).flip(0, 1)
    if orientation == 8:  # ROTATE_90 (90° counter-clockwise)
        return pixels.transpose(0, 1).flip(0)
    return pixels


def _decode_turbo(simplejpeg: Any, data: bytes, target: tuple[int, int] | None, mode: str,
                  exif: bool) -> tuple[torch.Tensor, tuple[float, float]] | None:
    """libjpeg-turbo via simplejpeg -> ((H, W, C) uint8, extent), or None where Pillow must do it."""
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None  # Pillow reads it or says precisely why not
    if colorspace in _PILLOW_ONLY_COLORSPACES:
        return None
    orientation = _orientation(data) if exif else 1
    wanted = target if target is None or orientation < 5 else (target[1], target[0])
    eighths = _eighths_for(height, width, wanted)
    scaled = (-(-height * eighths // 8), -(-width * eighths // 8))
    try:
        # fastupsample: chroma upsampled without smoothing; the resize that follows averages
        # it away (fidelity to the Pillow recipe unchanged, ~10% less CPU)
        array = simplejpeg.decode_jpeg(
            data, colorspace=_SIMPLEJPEG_COLORSPACE[mode], fastdct=False,
            fastupsample=target is not None,
            min_height=scaled[0], min_width=scaled[1])
    except ValueError:
        return None
    if array.ndim == 2:
        array = array[:, :, None]
    if array.shape[:2] != scaled:  # not a scale we know the extent of: Pillow decodes it
        return None
    return _orient(torch.from_numpy(array), (height * eighths / 8, width * eighths / 8), orientation)


def _decode_pillow(data: bytes, target: tuple[int, int] | None, mode: str,
                   exif: bool) -> tuple[torch.Tensor, tuple[float, float]]:
    """Pillow -> ((H, W, C) uint8, extent); JPEGs drafted at a reduced scale where ``target``
    allows (``draft`` returns the original's extent in the reduced pixels)."""
    numpy, Image = _pillow()
    try:
        with Image.open(io.BytesIO(data)) as image:
            orientation = int(image.getexif().get(_EXIF_ORIENTATION, 1) or 1) if exif else 1
            extent: tuple[float, float] = (image.height, image.width)
            if target is not None and image.format == "JPEG":
                wanted = target if orientation < 5 else (target[1], target[0])
                drafted = image.draft("L" if mode == "L" else None, (wanted[1], wanted[0]))
                if drafted is not None:
                    extent = (drafted[1][3], drafted[1][2])
            converted = image if image.mode == mode else image.convert(mode)
            array = numpy.asarray(converted)
    except Exception as exc:
        head = bytes(memoryview(data)[:8])
        raise ValueError(f"cannot decode {len(data)} bytes (starting {head!r}) as an image: "
                         f"{type(exc).__name__}: {exc}") from exc
    if array.ndim == 2:
        array = array[:, :, None]
    return _orient(_from_readonly(array), extent, orientation)


# ----------------------------------------------------------------------------- batches (GPU)


def collate_raw(batch: list[Any]) -> Any:
    """A DataLoader ``collate_fn`` that leaves values as they are: sample dicts become one dict of
    lists (``{"jpg": [bytes, ...], "cls": [b"7", ...], "__key__": [...]}``), tuples a tuple of
    lists, anything else a list. Nothing is converted, stacked or copied, so JPEG bytes reach the
    training loop for ``decode_images`` on the device."""
    if not batch:
        return batch
    first = batch[0]
    if isinstance(first, dict):
        return {key: [sample[key] for sample in batch] for key in first}
    if isinstance(first, tuple):
        return tuple(list(column) for column in zip(*batch))
    return list(batch)


def decode_images(images: Sequence[bytes], size: Sequence[int], device: str | torch.device | None = None,
                  *, mode: str = "RGB", apply_exif_orientation: bool = False) -> torch.Tensor:
    """A batch of image bytes -> one ``torch.uint8`` tensor (N, C, H, W) on ``device``.

    On a CUDA device with torchvision, JPEGs are decoded there in one nvJPEG call
    (``torchvision.io.decode_jpeg(..., device=...)``) and resized on the device; images it cannot
    take (PNG, CMYK, ``mode="RGBA"``) are decoded on the CPU and moved. Anywhere else, and when
    torchvision cannot be imported, each image goes through ``decode_image`` on the CPU: the
    same shape and dtype, pixels within the same fidelity bound.
    """
    target = _check_size(size)
    if target is None:
        raise ValueError("decode_images needs size=(height, width): a batch is one tensor")
    channels = _check_mode(mode)
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"decode_images(device={str(device)!r}): torch sees no CUDA device "
                             "(torch.cuda.is_available() is False); pass device='cpu'")
        nvjpeg = _nvjpeg()
        if nvjpeg is not None and mode != "RGBA":
            return _decode_batch_on_device(images, target, device, mode, apply_exif_orientation, *nvjpeg)
    out = torch.empty((len(images), channels, *target), dtype=torch.uint8,
                      pin_memory=device.type == "cuda")
    for index, data in enumerate(images):
        out[index] = decode_image(data, target, mode=mode, apply_exif_orientation=apply_exif_orientation)
    return out if device.type == "cpu" else out.to(device, non_blocking=True)


@functools.cache
def _nvjpeg() -> tuple[Any, Any] | None:
    """``(torchvision.io.decode_jpeg, ImageReadMode)``, or None where torchvision is missing or
    does not load next to this torch (a CPU torch with a CUDA torchvision raises at import)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception:  # noqa: BLE001 - ImportError, or RuntimeError/OSError from its operators
        return None
    return decode_jpeg, ImageReadMode


def _decode_batch_on_device(images: Sequence[bytes], target: tuple[int, int], device: torch.device,
                            mode: str, exif: bool, decode_jpeg: Any, read_mode: Any) -> torch.Tensor:
    """nvJPEG for the JPEGs of the batch (one call), the CPU path for the rest; then an
    antialiased bilinear resize on the device (``resize_into``), rounded back to uint8 once."""
    pixels = torch.empty((len(images), MODES[mode], *target), dtype=torch.float32, device=device)
    jpegs = [i for i, data in enumerate(images) if bytes(memoryview(data)[:3]) == JPEG_MAGIC]
    decoded: dict[int, torch.Tensor] = {}
    if jpegs:
        with warnings.catch_warnings():  # bytes are read-only; nvJPEG only reads them
            warnings.simplefilter("ignore", UserWarning)
            buffers = [torch.frombuffer(images[i], dtype=torch.uint8) for i in jpegs]
        kind = read_mode.RGB if mode == "RGB" else read_mode.GRAY
        try:
            batch = decode_jpeg(buffers, device=device, mode=kind, apply_exif_orientation=exif)
            decoded = dict(zip(jpegs, batch))
        except RuntimeError:  # one image nvJPEG refuses (CMYK, ...) fails the call: one at a time
            for i, buffer in zip(jpegs, buffers):
                try:
                    decoded[i] = decode_jpeg(buffer, device=device, mode=kind, apply_exif_orientation=exif)
                except RuntimeError:
                    pass
    for index, data in enumerate(images):
        if index not in decoded:
            pixels[index] = decode_image(data, target, mode=mode, apply_exif_orientation=exif).to(device)
    places = sorted(decoded)
    _resize_loop()([decoded[i] for i in places], places, pixels)
    return pixels.round_().clamp_(0, 255).to(torch.uint8)


def resize_into(images: list[torch.Tensor], places: list[int], out: torch.Tensor) -> None:
    """Each (C, H, W) uint8 image, resized (antialiased bilinear) into ``out[place]`` (float)."""
    height, width = out.shape[2], out.shape[3]
    for at in range(len(images)):
        image = images[at]
        if image.shape[1] == height and image.shape[2] == width:
            out[places[at]].copy_(image)  # the copy converts to float: exact for uint8
        else:
            out[places[at]].copy_(torch.nn.functional.interpolate(
                image.unsqueeze(0).float(), size=[height, width], mode="bilinear",
                align_corners=False, antialias=True)[0])


@functools.cache
def _resize_loop() -> Any:
    """``resize_into`` compiled by TorchScript, else as it is. Three small ops an image make a
    batch a thousand calls: in Python each takes the GIL, which the training step's own thread
    wants too (``DeviceFeed`` decodes beside it); the compiled loop runs without the GIL, 2.6x
    the batches beside a busy Python thread. TorchScript is deprecated: where it is gone or
    refuses, the plain loop does the same work (same pixels, tests/test_decode.py)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(resize_into)
    except Exception:  # noqa: BLE001 - any failure to compile leaves the plain loop
        return resize_into


# ----------------------------------------------------------------------------- samples


def decode_field(ext: str, data: bytes, size: Sequence[int] | None = None, *, mode: str = "RGB") -> Any:
    """One field by its extension (the last part after a dot decides: ``seg.png`` is an image)."""
    kind = ext.rsplit(".", 1)[-1].lower()
    if kind in IMAGE_EXTENSIONS:
        return decode_image(data, size, mode=mode)
    if kind == "json":
        return json.loads(data)
    if kind in TEXT_EXTENSIONS:
        return data.decode("utf-8")
    if kind in INT_EXTENSIONS:
        return int(data)
    return data


def decode_sample(sample: dict[str, Any], size: Sequence[int] | None = None, *,
                  mode: str = "RGB") -> dict[str, Any]:
    """A transform that decodes every field it knows and leaves the rest as bytes; images are
    resized to ``size=(H, W)`` when given: ``transform=functools.partial(decode_sample,
    size=(224, 224))``. A Hugging Face image column's value (``{"bytes": ..., "path": ...}``, as
    ``from_parquet`` gives it) is decoded as an image; other values that are not bytes stay."""
    out: dict[str, Any] = {}
    for key, value in sample.items():
        if key.startswith("__") or not isinstance(value, (bytes, bytearray, dict)):
            out[key] = value
        elif isinstance(value, dict):
            out[key] = decode_image(value["bytes"], size, mode=mode) if is_hub_image(value) else value
        else:
            out[key] = decode_field(key, bytes(value), size, mode=mode)
    return out


def is_hub_image(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face ``Image`` feature's value as Parquet stores it."""
    return (isinstance(value, dict) and set(value) <= {"bytes", "path"}
            and isinstance(value.get("bytes"), (bytes, bytearray)))
