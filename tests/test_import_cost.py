"""What starting costs in imports: the package, a per-object dataset and its first sample import
only what that path uses (counted in ``sys.modules`` of a fresh process, never timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# third-party clients and formats no per-object start needs (each costs 3-90 ms to import)
CLIENTS = ("botocore", "aiobotocore", "aioboto3", "aiohttp", "obstore", "pyarrow", "PIL", "simplejpeg")
# this package's modules for other modes: shards (their jobs, tar parser, codecs), the shard index,
# Parquet, the disk cache, checkpoints
OTHER_MODES = ("loader.datasets.shard_source", "loader.datasets.parquet_source", "loader.shard_index",
               "loader.formats.packing", "loader.formats.shards", "loader.formats.tar",
               "loader.formats.compression", "loader.cache.store", "loader.cache.files",
               "loader.checkpoint")  # (the command line: the real-server test; loader.testing imports its dev server)


def imported_after(code: str) -> list[str]:
    """The modules a fresh process holds after running ``code`` (from this checkout)."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def holding(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == name or m.startswith(name + ".") for name in names)]


def test_import_loader_imports_no_client_torch_or_event_loop_library():
    modules = imported_after("import loader")
    assert not holding(modules, (*CLIENTS, "torch", "numpy", "anyio", "asyncio", "xml.etree", "encodings.idna",
                                 "loader.datasets", "loader.s3", "loader.engine")), modules


def test_a_per_object_dataset_reaches_its_first_sample_without_other_modes_or_clients():
    """``from_prefix`` over a user's store, listed and read to its first sample: the shard, Parquet
    and cache modules and every third-party client stay unimported (a user's store lists through
    itself, so no XML either)."""
    modules = imported_after(
        "from loader import AsyncS3Dataset\n"
        "from loader.testing import MemoryStore\n"
        "store = MemoryStore.with_objects('bkt', {f'train/{i:04d}.jpg': bytes([i % 256]) * 64 for i in range(300)})\n"
        "dataset = AsyncS3Dataset.from_prefix('s3://bkt/train/', shuffle=True, seed=1, store=store)\n"
        "first = next(iter(dataset))\n"
        "assert first['__key__'].startswith('train/') and len(first['jpg']) == 64, first\n")
    assert "loader.datasets.object_source" in modules and "loader.engine.fetch" in modules  # it ran
    assert not holding(modules, (*CLIENTS, *OTHER_MODES, "xml.etree")), holding(
        modules, (*CLIENTS, *OTHER_MODES, "xml.etree"))


def test_the_shard_and_cache_modules_still_come_when_asked_for(tmp_path):
    modules = imported_after(
        "from loader import AsyncS3Dataset, Cache, Store\n"
        "from loader.testing import MemoryStore\n"
        "store = MemoryStore.with_objects('bkt', {'s/0.tar': b'', 'o/a.jpg': b'x'})\n"
        "shards = AsyncS3Dataset.from_shards(['s3://bkt/s/0.tar'], store=store)\n"
        f"cache = Store(backend=store, cache=Cache({str(tmp_path)!r}))\n"
        "cached = AsyncS3Dataset.from_keys('bkt', ['o/a.jpg'], store=cache)\n"
        "assert next(iter(cached))['jpg'] == b'x'\n")
    assert {"loader.datasets.shard_source", "loader.cache.store"} <= set(modules)


def test_the_listing_reads_plain_pages_without_elementtree_and_escaped_ones_with_it():
    """The lister's module leaves expat alone until a page needs it (an escape: ``&amp;``)."""
    page = ("<?xml version='1.0' encoding='UTF-8'?><ListBucketResult><Name>bkt</Name><Prefix>p/</Prefix>"
            "<KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>"
            "<Contents><Key>p/{key}</Key><Size>3</Size><ETag>&#34;e&#34;</ETag></Contents></ListBucketResult>")
    modules = imported_after(
        "import loader.s3.http_lister\n"
        "from loader.s3.list_xml import parse_list_page\n"
        f"plain = parse_list_page({page.format(key='a.jpg').encode()!r})\n"
        "assert [(o.key, o.size) for o in plain.objects] == [('p/a.jpg', 3)], plain\n"
        "assert 'xml.etree' not in sys.modules\n"
        f"escaped = parse_list_page({page.format(key='a&amp;b.jpg').encode()!r})\n"
        "assert [(o.key, o.size) for o in escaped.objects] == [('p/a&b.jpg', 3)], escaped\n")
    assert "xml.etree.ElementTree" in modules
