"""Every dotted name that a docstring of ``loader`` or a page of the docs writes in backticks
(``loader.s3.signing``, ``partition.block_positions``, ``KeyList.from_keys``), or that the API
reference renders (``::: loader.Limits``), names something that exists: a module of this
package or of ``bench/``, a name defined in one, or a module that imports. A module renamed or a
function removed fails here until its mentions follow."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import pathlib
import re
import warnings
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "loader"
DOTTED = re.compile(r"`{1,2}([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\([^`]*\))?`{1,2}")
REFERENCE = re.compile(r"^::: ([\w.]+)", re.M)  # a page of the API reference (mkdocstrings)
FILE_ENDINGS = {"com", "json", "toml", "txt", "md", "py", "keys", "tar", "gz", "zst", "tgz", "parquet", "pt",
                "yml", "yaml", "csv", "jsonl", "jpg", "cls", "png", "bin", "lock", "html", "idx", "npy"}
# names of other libraries written by their usual short head, and where they live
ELSEWHERE = {"BlockingPortal": "anyio.from_thread", "Image": "PIL", "S3Backend": "moto.s3.models"}
# names that cannot be checked in this environment, and why they still exist
UNCHECKED = {
    "compression.zstd": "the standard library's zstd, from Python 3.14",
    "backports.zstd": "the same module for older Pythons, not installed here",
    "aws.isVirtualHostableS3Bucket": "a function of botocore's endpoint rules language",
}
# heads that are a value in an example or an explanation, not a module: ``ds.set_epoch``
NOT_MODULES = {"ds", "dataset", "dl", "slot", "index", "server", "key", "err", "imgs", "seg", "task", "pin",
               "portal", "clock", "mp", "monkeypatch", "train", "objects", "store", "self", "exc",
               "sample", "batch", "model", "state", "s3_server", "args", "info", "response", "job",
               "engine", "ctx", "loader_", "dist", "np", "tv", "options", "config", "mds", "feed",
               "part", "client", "stats", "page", "shard", "worker", "result", "limits", "read",
               "write", "format", "files", "tar", "retry", "aws"}


def docstrings(path: pathlib.Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            yield node.value.value


def mentions() -> Iterator[tuple[str, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        for text in docstrings(path):
            for match in DOTTED.finditer(text):
                yield str(path.relative_to(ROOT)), match.group(1)
    for path in sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]):
        for match in (*DOTTED.finditer(path.read_text()), *REFERENCE.finditer(path.read_text())):
            yield str(path.relative_to(ROOT)), match.group(1)


@functools.cache
def modules_named() -> dict[str, list[str]]:
    """Every module and package of ``loader`` and ``bench`` by its last name: ``signing`` ->
    ``loader.s3.signing``."""
    named: dict[str, list[str]] = {}
    for top in ("loader", "bench"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            named.setdefault(parts[-1], []).append(".".join(parts))
    return named


@functools.cache
def defined_names() -> dict[str, list[str]]:
    """Every class and function defined at the top of a ``loader`` module, by name."""
    named: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                named.setdefault(node.name, []).append(module)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(target, ast.Name):
                        named.setdefault(target.id, []).append(module)
    return named


def resolves(module: str, attributes: list[str]) -> bool:
    """Whether ``module`` imports and holds ``attributes`` in turn (a submodule counts)."""
    try:
        value = importlib.import_module(module)
    except ImportError:
        return False
    for name in attributes:
        if hasattr(value, name):
            value = getattr(value, name)
            continue
        try:  # a submodule not imported yet, or a module-level name only annotated
            value = importlib.import_module(f"{value.__name__}.{name}")
        except (ImportError, AttributeError):
            return name in getattr(value, "__annotations__", {}) or _declared_in_class(value, name)
    return True


def _declared_in_class(value: object, name: str) -> bool:
    """A dataclass field or attribute set in ``__init__``, which ``hasattr`` on the class misses."""
    if not isinstance(value, type):
        return False
    import inspect

    try:
        source = inspect.getsource(value)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(name)}\b|^\s+{re.escape(name)}\s*:", source, re.M) is not None


def exists(dotted: str) -> bool:
    head, *rest = dotted.split(".")
    if dotted in UNCHECKED or (rest and rest[-1] in FILE_ENDINGS):
        return True  # a file's or a host's name: index.json, pyproject.toml, s3.amazonaws.com
    if head in ELSEWHERE:
        return resolves(ELSEWHERE[head], [head, *rest])
    if head == "torchvision" and importlib.util.find_spec(head) is None:
        return True  # an optional dependency (decode on the device), not installed here
    if head == "loader" or head == "bench":
        return any(resolves(".".join(dotted.split(".")[:cut]), dotted.split(".")[cut:])
                   for cut in range(len(dotted.split(".")), 0, -1))
    if head in modules_named():
        return any(resolves(module, rest) for module in modules_named()[head])
    if head in defined_names():
        return any(resolves(module, [head, *rest]) for module in defined_names()[head])
    if head in NOT_MODULES:
        return True
    if importlib.util.find_spec(head) is not None:
        return resolves(head, []) and _resolves_outside(dotted)
    return False


def _resolves_outside(dotted: str) -> bool:
    """A third-party or standard name: the longest importable module, then attributes."""
    parts = dotted.split(".")
    return any(resolves(".".join(parts[:cut]), parts[cut:]) for cut in range(len(parts), 0, -1))


def test_every_dotted_name_in_docstrings_and_docs_exists():
    with warnings.catch_warnings():  # a deprecated name still exists (the table of old spellings)
        warnings.simplefilter("ignore", DeprecationWarning)
        missing = sorted({f"{where}: {dotted}" for where, dotted in mentions() if not exists(dotted)})
    assert not missing, "names that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(("dotted", "real"), [
    ("loader.s3.signing.sign_v4", True), ("partition.block_positions", True), ("KeyList.from_keys", True),
    ("sources.read_manifest", False), ("stores.keyfile", False), ("loader.s3.direct", False),
    ("signing.no_such_function", False), ("os.no_such_name", False), ("index.json", True),
])
def test_the_check_tells_a_real_name_from_a_gone_one(dotted, real):
    assert exists(dotted) == real
