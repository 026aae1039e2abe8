"""Every code block of the README and the guides, run as written against the real server.

Each page runs in its own empty folder, its python blocks in page order in one namespace, its
bash blocks in a shell (with this environment's ``python`` and ``loader`` first on the PATH),
all with the server's endpoint and keys in the environment and the bucket ``bucket`` reset to
what the pages start from (see ``starting_data``). A block the suite cannot run carries a
one-line reason (``<!-- not run: ... -->``, see ``docs_blocks``) and is compiled or checked
with ``bash -n`` instead, so it still cannot hold a syntax error.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from loader.tools.examples import example_data

from datasets import upload_objects
from docs_blocks import LANGUAGES, RUN_LANGUAGES, Block, blocks, pages

BUCKET = "bucket"  # the name the pages use: `s3://bucket/...` runs exactly as written


def starting_data() -> dict[str, bytes]:
    """What every page may read: what ``loader serve --examples`` uploads (``loader.tools.examples``:
    ``train/`` 64 JPEGs with a ``.cls`` class id each, ``images/{cat,dog}/`` class folders,
    ``wds/train-{0000..0003}.tar`` and ``parquet/train-{00000..00001}-of-00002.parquet``), so the
    pages run here on exactly the data a reader gets on a fresh machine."""
    return example_data()


@pytest.fixture(scope="module")
def data(s3_server) -> dict[str, bytes]:
    """The bucket the pages read, created once for the module (and deleted at the end on a
    server the session did not start)."""
    if not s3_server.minio.bucket_exists(BUCKET):
        s3_server.minio.make_bucket(BUCKET)
        s3_server.created_buckets.append(BUCKET)
    elif s3_server.kind == "env":
        pytest.fail(f"the examples need their own bucket {BUCKET!r}, and the server at "
                    f"{s3_server.config.endpoint_url} already has one: remove it or run against another server")
    return starting_data()


@pytest.fixture
def page_bucket(s3_server, s3_env, data, tmp_path, monkeypatch) -> Path:
    """``bucket`` holding exactly the starting data (what an earlier page wrote or overwrote is
    removed or put back), and an empty working folder."""
    from minio.deleteobjects import DeleteObject

    listed = {o.object_name: o.etag for o in s3_server.minio.list_objects(BUCKET, recursive=True)}
    extra = [DeleteObject(key) for key in listed if key not in data]
    for error in s3_server.minio.remove_objects(BUCKET, extra):
        raise AssertionError(f"could not remove {error.name}: {error.message}")
    # what is missing or was overwritten (a single PUT's ETag is its body's MD5)
    stale = {key: body for key, body in data.items()
             if listed.get(key, "").strip('"') != hashlib.md5(body).hexdigest()}
    upload_objects(s3_server.minio, BUCKET, stale, workers=8)
    monkeypatch.chdir(tmp_path)
    return tmp_path


OURS_DEPRECATED = r".*will be removed in the next release"  # how our DeprecationWarnings all say it


def run_python(block: Block, namespace: dict) -> None:
    """Run one block; a spelling of ours that is deprecated fails it (the docs show the new ones)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=OURS_DEPRECATED, category=DeprecationWarning)
            exec(compile(block.code, block.where, "exec"), namespace)
    except Exception as exc:  # name the block, keep the traceback
        raise AssertionError(f"{block.where}: the python block failed:\n{block.code}") from exc


def run_bash(block: Block, folder: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # python, loader
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (f"{block.where}: the bash block exited {proc.returncode}:\n{block.code}\n"
                                  f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    assert not re.search(OURS_DEPRECATED, proc.stderr), (
        f"{block.where}: the block uses a deprecated spelling:\n{proc.stderr}")


def check_not_run(block: Block) -> None:
    """A block the suite cannot run still parses."""
    if block.language == "python":
        compile(block.code, block.where, "exec")
    else:
        proc = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
        assert proc.returncode == 0, f"{block.where}: bash -n: {proc.stderr}"


def page_id(page: Path) -> str:
    return page.name if page.parent.name != "guides" else f"guides/{page.name}"


def test_every_block_is_runnable_or_says_why():
    """Only python, bash and output (text) blocks; a reason is one line of words; scripts are python."""
    for page in pages():
        for block in blocks(page):
            assert block.language in LANGUAGES, f"{block.where}: a ```{block.language} block (use one of {LANGUAGES})"
            if block.not_run is not None:
                assert block.language in RUN_LANGUAGES and len(block.not_run.split()) >= 3, block.where
                check_not_run(block)
            if block.file is not None:
                assert block.language == "python", f"{block.where}: a script is a python block"


@pytest.mark.parametrize("page", pages(), ids=page_id)
def test_page_examples_run_as_written(page: Path, page_bucket: Path):
    namespace: dict = {"__name__": "__main__"}
    ran = 0
    try:
        for block in blocks(page):
            if block.language not in RUN_LANGUAGES or block.not_run is not None:
                continue
            if block.file is not None:
                (page_bucket / block.file).write_text(block.code, encoding="utf-8")
            elif block.language == "python":
                run_python(block, namespace)
            else:
                run_bash(block, page_bucket)
            ran += 1
    finally:  # a page that failed before its `loader serve --stop` leaves no server running
        for pidfile in page_bucket.glob("*.pid"):
            subprocess.run([sys.executable, "-m", "loader", "serve", "--stop", str(pidfile)],
                           capture_output=True, timeout=60)
        # what the page made goes now, as a script's globals do at its exit: the page's functions
        # hold the namespace that holds them (a cycle), so a DataLoader it left mid-epoch would
        # otherwise end its workers in a later garbage collection, 5 s a worker in torch's finalizer
        namespace.clear()
    assert ran, f"{page.name}: no block ran"


def test_starting_data_is_what_the_pages_say():
    """The data the pages describe: 64 + 40 objects, four shards of 16 samples, 40 Parquet rows."""
    data = starting_data()
    assert sum(key.startswith("train/") for key in data) == 128
    assert sum(key.startswith("images/") for key in data) == 40
    assert io.BytesIO(data["wds/train-0000.tar"]).read(512)[257:262] == b"ustar"
    assert sum(pq.read_metadata(io.BytesIO(body)).num_rows for key, body in data.items()
               if key.startswith("parquet/")) == 40
