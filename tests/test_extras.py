"""A missing optional extra is named, with the command that installs it, wherever it is needed.

The inventory test reads the package's source: every import of a library that only an extra
installs must sit in a ``try`` that handles ``ImportError`` (or in the one backend module that is
itself imported that way), so a new unguarded import fails here rather than with a bare
``No module named ...`` in a user's hands. The other tests hide each library and check the advice.
"""

from __future__ import annotations

import ast
import importlib
import io
import sys
from pathlib import Path

import pytest

from loader import AsyncS3Dataset, ConfigError, SampleError, decode_sample
from loader._version import DISTRIBUTION

from fakes import FakeStore, reusable

PACKAGE = Path(__file__).resolve().parent.parent / "loader"
# import name -> the extra that installs it
OPTIONAL = {"obstore": "obstore", "PIL": "image", "numpy": "image", "simplejpeg": "image",
            "zstandard": "zstd", "torchdata": "stateful"}
# modules imported only through a guard elsewhere (stores._obstore_backend)
GUARDED_MODULES = {"s3/obstore_store.py"}


def optional_imports(tree: ast.AST):
    """``(node, name)`` for each import of an optional library, with its enclosing nodes."""
    parents: dict[ast.AST, ast.AST] = {}
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            parents[child] = parent
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            if name.split(".")[0] in OPTIONAL:
                yield node, name.split(".")[0], parents


def guarded(node: ast.AST, parents: dict) -> bool:
    """Whether ``node`` sits in the body of a ``try`` with an ``except ImportError``."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.Try) and child in parent.body:
            for handler in parent.handlers:
                caught = handler.type
                names = [caught] if not isinstance(caught, ast.Tuple) else caught.elts
                if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
                       for n in names):
                    return True
        child, parent = parent, parents.get(parent)
    return False


def test_every_optional_import_is_guarded():
    unguarded = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in GUARDED_MODULES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, name, parents in optional_imports(tree):
            if not guarded(node, parents):
                unguarded.append(f"loader/{relative}:{node.lineno} imports {name}")
    assert not unguarded, ("imports of optional libraries outside a try/except ImportError that "
                           f"names the extra: {unguarded}")


def hint(extra: str) -> str:
    return rf"pip install '{DISTRIBUTION}\[{extra}\]'"


@pytest.fixture
def hide(monkeypatch):
    """``hide("PIL", ...)``: those imports fail as when the library is not installed."""

    def hide(*names: str) -> None:
        for name in names:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                monkeypatch.delitem(sys.modules, loaded)
            monkeypatch.setitem(sys.modules, name, None)

    return hide


def test_obstore_backend_names_the_fast_extra(hide, monkeypatch):
    hide("obstore")
    monkeypatch.delitem(sys.modules, "loader.s3.obstore_store", raising=False)
    # an earlier import left the module as an attribute of its package, which `from . import` finds
    monkeypatch.delattr(importlib.import_module("loader.s3"), "obstore_store", raising=False)
    with pytest.raises(ConfigError, match=hint("obstore")):
        AsyncS3Dataset.from_keys("bucket", ["a.jpg"], store="obstore")


def jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="JPEG")
    return out.getvalue()


def test_decode_without_pillow_names_the_image_extra(hide):
    data = jpeg()
    decode = importlib.import_module("loader.decode")
    decode._pillow.cache_clear()
    decode._simplejpeg.cache_clear()
    hide("PIL", "numpy", "simplejpeg")
    try:
        with pytest.raises(ImportError, match=hint("image")):
            decode_sample({"__key__": "a", "jpg": data})
    finally:
        decode._pillow.cache_clear()
        decode._simplejpeg.cache_clear()


def test_a_missing_extra_behind_a_transform_is_not_skipped_by_on_error(hide):
    """on_error="skip" skips faults of one sample; a library missing would skip them all."""
    data = jpeg()
    decode = importlib.import_module("loader.decode")
    decode._pillow.cache_clear()
    decode._simplejpeg.cache_clear()
    hide("PIL", "numpy", "simplejpeg")
    fake = FakeStore.with_objects("bucket", {f"t/{i}.jpg": data for i in range(3)})
    ds = AsyncS3Dataset.from_keys("bucket", [f"t/{i}.jpg" for i in range(3)], store=reusable(fake),
                                  transform=decode_sample, on_error="skip")
    try:
        with pytest.raises(SampleError, match=hint("image")):
            list(ds)
    finally:
        decode._pillow.cache_clear()
        decode._simplejpeg.cache_clear()


def test_zstd_shards_without_a_zstd_library_name_the_zstd_extra(hide):
    compression = importlib.import_module("loader.formats.compression")
    hide("zstandard", "compression", "backports")
    with pytest.raises(ConfigError, match=hint("zstd")):
        compression.require_codec("s3://bucket/shards/s-0000.tar.zst")


def test_devserver_without_weed_names_the_devserver_extra(monkeypatch, tmp_path):
    devserver = importlib.import_module("loader.tools.devserver")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=hint("devserver")):
        devserver.find_weed()


def test_demo_without_pillow_names_the_image_extra(hide):
    demo = importlib.import_module("loader.tools.demo")
    hide("PIL", "numpy")
    with pytest.raises(SystemExit, match=hint("image")):
        demo.run_demo(num_samples=1)
