"""The package's shape: the layout table (docs/design/layout.md) matches the tree, and folders import one way."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "loader"
# lower layers first: a module may import from its own layer or any layer below it
LAYERS = ("foundation", "s3", "engine", "formats", "listing", "cache", "shard_index", "datasets", "checkpoint",
          "tools")
FOUNDATION = {"config", "uri", "errors", "retry", "decode", "device_feed", "checks", "lifecycle", "topology",
              "_version"}


def modules() -> list[str]:
    return sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    )


def layer(module: str) -> str:
    """``loader.cache.store`` -> ``stores``; top-level foundation modules -> ``foundation``."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in FOUNDATION:
        return "foundation"
    if parts[0] in ("__main__", "testing"):  # the entry point and re-exports of tools/
        return "tools"
    return parts[0]


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name a file imports, at any depth of its code (relative imports resolved)."""
    relative = path.relative_to(ROOT).with_suffix("")
    package = list(relative.parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def imports_of(path: Path) -> set[str]:
    """The ``loader.*`` modules a file imports."""
    return {name for name in imported_modules(path) if name.startswith("loader")}


def module_name(path: Path) -> str:
    """``loader/cache/store.py`` -> ``loader.cache.store``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph() -> dict[str, set[str]]:
    """Every module of the package -> the modules of the package it imports, at any depth of its
    code (``TYPE_CHECKING`` and function-local imports included); ``from pkg import mod`` names
    the module ``pkg.mod``. The lazy public namespace (``loader/__init__.py``) is left out."""
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        if name == "loader":
            continue
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                found.update(f"{module}.{a.name}" if f"{module}.{a.name}" in files else module
                             for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {target for target in found if target in files and target != name}
    return graph


def test_no_import_circle_between_modules():
    """Imports between the package's modules form no circle, not even one that only the type
    checker or a function-local import walks (they hide which module owns what)."""
    import graphlib

    try:
        tuple(graphlib.TopologicalSorter(module_graph()).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError("an import circle: " + " -> ".join(exc.args[1])) from None


def test_the_layout_table_matches_the_tree():
    """docs/design/layout.md lists every module of the package, one line each, under its package."""
    page = (ROOT / "docs" / "design" / "layout.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", page, re.M))
    assert listed == set(modules()), (
        f"docs/design/layout.md is out of date: missing {sorted(set(modules()) - listed)}, "
        f"stale {sorted(listed - set(modules()))}"
    )


def test_the_readme_points_to_the_layout():
    assert "docs/design/layout.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_module_says_what_it_holds():
    """The rule is one concept per module, not a line count: each module of loader/ opens with
    a docstring whose first line says what it holds (the layout table repeats it)."""
    import ast

    silent = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                    if not (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").strip())
    assert silent == [], f"modules without a docstring saying what they hold: {silent}"


def test_imports_between_folders_run_one_way():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue  # the lazy public namespace re-exports from every layer
        here = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mine = LAYERS.index(layer(here))
        for target in imports_of(path):
            if LAYERS.index(layer(target)) > mine:
                wrong.append(f"{here} imports {target}")
    assert not wrong, "imports against the data path's direction:\n" + "\n".join(sorted(wrong))


def test_the_cli_and_the_package_import_without_torch():
    code = "import sys, loader, loader.testing, loader.tools.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_public_names_resolve_lazily():
    import loader

    for name in loader.__all__:
        assert getattr(loader, name) is not None, name
    assert "AsyncS3Dataset" in dir(loader)


def _type_checking_names(path: Path) -> set[str]:
    """The names a module's ``if TYPE_CHECKING:`` block imports (what editors see)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return {alias.asname or alias.name for sub in node.body if isinstance(sub, ast.ImportFrom)
                    for alias in sub.names}
    raise AssertionError(f"{path} has no TYPE_CHECKING block")


def test_the_public_names_are_written_once_and_agree():
    """``_PUBLIC`` (and the public submodules) decide the top level; ``__all__``, ``dir()`` and
    what type checkers see say exactly the same, so no name is public in one and not the other."""
    import loader

    public = set(loader._PUBLIC) | set(loader._SUBMODULES)
    assert sorted(loader.__all__) == loader.__all__ and len(set(loader.__all__)) == len(loader.__all__)
    assert set(loader.__all__) == public
    assert {name for name in dir(loader) if not name.startswith("__")} == public
    assert _type_checking_names(PACKAGE / "__init__.py") == public
    for name, module in loader._PUBLIC.items():
        assert getattr(importlib.import_module(module), name) is getattr(loader, name), name


def test_the_top_level_holds_what_users_touch_and_no_internals():
    import loader

    for name in ("AsyncS3Dataset", "AsyncS3MapDataset", "mix", "S3Config", "RetryPolicy",
                 "ListOptions", "decode_sample", "decode_image", "decode_images", "collate_raw",
                 "checkpoint", "read_index", "read_index_counts", "ObjectChangedError"):
        assert name in loader.__all__, name
    for name in ("FetchEngine", "EngineLimits", "EngineStats", "KeyList", "DevServer", "ObjectStore",
                 "LoaderOptions"):
        assert name not in loader.__all__ and name not in dir(loader), name


def test_every_error_users_catch_imports_from_the_package_without_torch():
    """``from loader import ObjectChangedError`` (and every other error of the tree) works, and
    costs no torch import: an ``except`` clause should not need to know the module layout."""
    import loader.errors

    errors = sorted(name for name, value in vars(loader.errors).items()
                    if isinstance(value, type) and issubclass(value, loader.errors.LoaderError))
    assert "ObjectChangedError" in errors and len(errors) >= 15
    import loader

    assert set(errors) <= set(loader.__all__), sorted(set(errors) - set(loader.__all__))
    code = (f"import sys; from loader import {', '.join(errors)}; import loader.errors as e; "
            f"assert all(getattr(e, n) is globals()[n] for n in {errors!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("name, home", [
    ("DevServer", "loader.testing"),
    ("FetchEngine", "loader.engine.fetch"),
    ("EngineLimits", "loader.engine.fetch"),
    ("EngineStats", "loader.engine.fetch"),
    ("KeyList", "loader.listing.keylist"),
])
def test_names_that_left_the_top_level_still_import_with_a_warning_naming_their_home(name, home):
    """Kept for one release: ``loader.X`` and ``from loader import X`` still give the very same
    object, with a ``DeprecationWarning`` that says where to import it from now."""
    import loader

    with pytest.warns(DeprecationWarning, match=re.escape(f"from {home} import {name}")):
        value = getattr(loader, name)
    assert value is getattr(importlib.import_module(home), name)
    with pytest.warns(DeprecationWarning, match=re.escape(home)):
        namespace: dict[str, object] = {}
        exec(f"from loader import {name}", namespace)
    assert namespace[name] is value
    with pytest.warns(DeprecationWarning):  # every use warns: the name is not cached at the top level
        getattr(loader, name)


def test_an_unknown_name_is_an_attribute_error():
    import loader

    with pytest.raises(AttributeError, match="NoSuchThing"):
        loader.NoSuchThing  # noqa: B018
    with pytest.raises(ImportError):
        exec("from loader import NoSuchThing", {})


def test_the_dev_server_has_a_stable_home_for_users_tests():
    import loader.testing
    import loader.tools.devserver

    assert loader.testing.DevServer is loader.tools.devserver.DevServer
    assert loader.testing.DevServerError is loader.tools.devserver.DevServerError
    assert set(loader.testing.__all__) == {"DevServer", "DevServerError", "MemoryStore", "MultipartUpload"}


def _mentioned_py_files(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w./-])([\w./-]*\w\.py)\b", text))


USER_SCRIPTS = {"train.py"}  # scripts of the user's that examples name, not files of this repository


def test_every_python_file_the_readme_and_docs_name_exists():
    """A path like ``s3/protocol.py`` in README.md, bench/README.md or docs/ names a file of
    the tree: from the repository root, from ``loader/``, or beside the page; a bare ``name.py``
    names some file of the repository. Modules that moved leave no old names in the prose."""
    files = {p.relative_to(ROOT).as_posix() for folder in ("loader", "tests", "integration", "bench")
             for p in (ROOT / folder).rglob("*.py")}
    names = {path.rsplit("/", 1)[-1] for path in files}
    missing = []
    for page in [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for mention in sorted(_mentioned_py_files(page.read_text(encoding="utf-8")) - USER_SCRIPTS):
            if "/" not in mention:
                found = mention in names
            else:
                bases = (ROOT, PACKAGE, page.parent)
                found = any((base / mention).resolve().is_file() for base in bases)
            if not found:
                missing.append(f"{page.relative_to(ROOT)}: {mention}")
    assert missing == [], "pages name files that do not exist:\n" + "\n".join(missing)


def test_test_modules_have_unique_basenames():
    """tests/ and integration/ run in one pytest session without packages: a basename used in both
    makes collection fail with 'import file mismatch'."""
    names = [p.name for folder in ("tests", "integration") for p in (ROOT / folder).glob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_no_test_module_imports_from_a_conftest():
    """Three ``conftest.py`` files share one module name: which one ``from conftest import`` finds
    depends on the order the folders were given (``pytest integration tests`` broke collection).
    Shared helpers live in plainly named modules (``fakes``, ``s3servers``, ...)."""
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("tests", "integration")
        for path in (ROOT / folder).glob("*.py")
        if path.name != "conftest.py" and "conftest" in {m.split(".")[0] for m in imported_modules(path)}
    ]
    assert offenders == []



def test_store_reads_take_the_protocols_parameters_and_no_more():
    """The store protocol is narrow: what only a wrapper needs (the cache's expected versions)
    is given to that wrapper, never added to every read's signature."""
    import inspect

    from loader.cache.store import CachedStore
    from loader.s3.aioboto3_store import Aioboto3Store
    from loader.s3.obstore_store import ObstoreStore
    from loader.s3.protocol import ObjectStore
    from loader.s3.recording import _RecordedStore

    from fakes import FakeStore

    for method in ("get", "get_range", "stream", "get_if_changed", "put", "list"):
        wanted = list(inspect.signature(getattr(ObjectStore, method)).parameters)
        for store in (Aioboto3Store, ObstoreStore, CachedStore, _RecordedStore, FakeStore):
            assert list(inspect.signature(getattr(store, method)).parameters) == wanted, (store, method)
    assert list(inspect.signature(ObjectStore.get).parameters) == ["self", "bucket", "key", "pin"]
