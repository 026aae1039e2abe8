"""From raw sample dicts to training inputs: ``transform`` application and stock decoders.

Samples arrive as ``{"__key__": ..., "__url__": ..., ext: bytes}``. ``apply_transform`` runs a
user's transform and turns its failure into a ``SampleError`` naming the object (with the
original exception as ``__cause__``). ``decode_sample`` is a ready-made transform that decodes
fields by extension: images to uint8 CHW tensors (Pillow), ``json``, text and class ids.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

from .errors import SampleError

Transform = Callable[[dict[str, Any]], Any]
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp")
TEXT_EXTENSIONS = ("txt", "text", "caption")
INT_EXTENSIONS = ("cls", "cls2", "index", "label")


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


def decode_image(data: bytes) -> Any:
    """Image bytes → ``torch.uint8`` tensor of shape (3, H, W), RGB."""
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        array = np.asarray(image.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


def decode_field(ext: str, data: bytes) -> Any:
    """One field by its extension (the last part after a dot decides: ``seg.png`` is an image)."""
    kind = ext.rsplit(".", 1)[-1].lower()
    if kind in IMAGE_EXTENSIONS:
        return decode_image(data)
    if kind == "json":
        return json.loads(data)
    if kind in TEXT_EXTENSIONS:
        return data.decode("utf-8")
    if kind in INT_EXTENSIONS:
        return int(data)
    return data


def decode_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """A transform that decodes every field it knows and leaves the rest as bytes."""
    return {key: value if key.startswith("__") else decode_field(key, value)
            for key, value in sample.items()}
