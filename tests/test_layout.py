"""The package's shape: the README's module table matches the tree, and folders import one way."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "loader"
# lower layers first: a module may import from its own layer or any layer below it
LAYERS = ("foundation", "stores", "engine", "formats", "datasets", "checkpoint", "tools")
FOUNDATION = {"config", "uri", "errors", "retry", "decode", "checks", "lifecycle", "_version"}


def modules() -> list[str]:
    return sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    )


def layer(module: str) -> str:
    """``loader.stores.cache`` -> ``stores``; top-level foundation modules -> ``foundation``."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in FOUNDATION:
        return "foundation"
    if parts[0] in ("__main__", "cli"):
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
    """``loader/stores/cache.py`` -> ``loader.stores.cache``; a package's ``__init__.py`` -> the package."""
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


def test_readme_module_table_matches_the_tree():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("| module | its one job |"):]
    section = section[: section.index("\n\n")]
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", section, re.M))
    assert listed == set(modules()), (
        f"README module table is out of date: missing {sorted(set(modules()) - listed)}, "
        f"stale {sorted(listed - set(modules()))}"
    )


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
    code = "import sys, loader, loader.cli, loader.tools.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_public_names_resolve_lazily():
    import loader

    for name in loader.__all__:
        assert getattr(loader, name) is not None, name
    assert "AsyncS3Dataset" in dir(loader)


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


def test_typed_constructor_keywords_match_the_options():
    """``LoaderKwargs`` (what editors see) lists exactly ``LoaderOptions``' fields, and
    ``ShardKwargs`` adds exactly ``ShardOptions``' fields and ``sample_counts``."""
    import dataclasses

    from loader.datasets.options import LoaderKwargs, LoaderOptions, ShardKwargs
    from loader.formats.shards import ShardOptions

    loader_fields = {f.name for f in dataclasses.fields(LoaderOptions)}
    assert set(LoaderKwargs.__annotations__) == loader_fields
    shard_fields = {f.name for f in dataclasses.fields(ShardOptions)}
    assert set(ShardKwargs.__optional_keys__) == loader_fields | shard_fields | {"sample_counts"}


def test_map_dataset_keywords_are_the_options_a_sampler_leaves_to_it():
    import dataclasses

    from loader.datasets import mapped
    from loader.datasets.options import LoaderOptions, MapKwargs

    fields = {f.name for f in dataclasses.fields(LoaderOptions)}
    assert set(MapKwargs.__optional_keys__) == fields - set(mapped._SAMPLER_DECIDES) - set(mapped._NO_QUEUE)


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

    from loader.stores.aioboto3_store import Aioboto3Store
    from loader.stores.base import ObjectStore
    from loader.stores.cache import CachedStore
    from loader.stores.obstore_store import ObstoreStore
    from loader.stores.recording import _RecordedStore

    from fakes import FakeStore

    for method in ("get", "get_range", "stream", "get_if_changed", "put", "list"):
        wanted = list(inspect.signature(getattr(ObjectStore, method)).parameters)
        for store in (Aioboto3Store, ObstoreStore, CachedStore, _RecordedStore, FakeStore):
            assert list(inspect.signature(getattr(store, method)).parameters) == wanted, (store, method)
    assert list(inspect.signature(ObjectStore.get).parameters) == ["self", "bucket", "key", "pin"]
