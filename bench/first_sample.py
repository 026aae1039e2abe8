"""``python -m bench.first_sample``: time to the first sample, this project next to s3torchconnector.

Starts the embedded SeaweedFS server on 127.0.0.1, PUTs N objects of ~110 KB under one prefix,
and in a fresh process per run measures, from ``from_prefix(...)`` to the first sample out of
``DataLoader(ds, num_workers=w, batch_size=None)``:

* ``AsyncS3Dataset.from_prefix(uri, shuffle=True, store=...)``, aioboto3 and obstore;
* the same from a listing saved beforehand (``loader ls --save``): ``from_manifest(path, ...)``,
  which reads the file instead of listing (a restarted job);
* s3torchconnector's ``S3IterableDataset.from_prefix(uri, enable_sharding=True)``.

The clock starts before the script's own imports, ours and the peer's alike (torch's excepted:
the DataLoader needs it whoever loads): each child is a bare ``python -c`` script that imports
nothing else before its clock (``import`` reports their share). For this project with ``w=0``
the time is broken down: the dataset's construction, the listing (store opening
and LIST requests, with the backend's import beside them; saved: the file read), and the rest
(the backend's import where nothing was listed, engine start, first GET). Median of
``--repeats``; ratios are ours / s3torchconnector's iterable dataset, same server, same data,
same run. Needs the ``bench`` extra (``make install-bench``).

    python -m bench.first_sample                  # 4,000 objects, w = 0 and 2, ~2 min
    python -m bench.first_sample --objects 4000 --workers 0,2 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

BUCKET = "first"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def upload(config: Any, prefix: str, count: int, empty: bool, concurrency: int = 32) -> None:
    """``count`` objects of 100-120 KB of random bytes (``empty``: of no bytes) under ``prefix``."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET, endpoint=config.endpoint_url, access_key_id=config.access_key_id,
                    secret_access_key=config.secret_access_key, region=config.region,
                    virtual_hosted_style_request=False, client_options={"allow_http": True})

    async def main() -> None:
        pending = iter(range(count))

        async def runner() -> None:
            for i in pending:
                data = b"" if empty else os.urandom(100_000 + (i * 7919) % 20_000)
                await obstore.put_async(store, f"{prefix}{i:07d}.jpg", data, use_multipart=False)

        await asyncio.gather(*(runner() for _ in range(concurrency)))

    asyncio.run(main())


# The child: nothing but ``json``, ``sys`` and ``time`` before torch and then the clock; its
# module imports nothing more (this one's imports, asyncio's among them, would be paid unseen).
CHILD_SCRIPT = """
import json, sys, time
started = time.perf_counter()
import torch
torch_import = time.perf_counter() - started
sys.path.insert(0, sys.argv[2])
from bench.first_sample_child import child
print(json.dumps(child(json.loads(sys.argv[1]), torch_import)))
"""



def run_child(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", CHILD_SCRIPT, json.dumps(spec), REPO], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{spec}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


RUNS = [("ours aioboto3", "ours", "aioboto3"), ("ours obstore", "ours", "obstore"),
        ("ours aioboto3, saved listing", "ours", "aioboto3"), ("ours obstore, saved listing", "ours", "obstore"),
        ("s3torchconnector iterable", "s3tc", None)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.first_sample",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=4000, help="objects under the prefix (default 4000)")
    parser.add_argument("--workers", default="0,2", help="num_workers values (default 0,2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case, median (default 3)")
    parser.add_argument("--empty", action="store_true",
                        help="empty objects (quick to make by the 100,000)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="runs whose name holds one of these words (default all; e.g. saved s3torchconnector)")
    args = parser.parse_args(argv)
    from loader.tools.devserver import DevServer

    compile_loader()
    workers = [int(w) for w in args.workers.split(",")]
    with DevServer(buckets=[BUCKET]) as server:
        config = server.config
        prefix = f"objects-{args.objects}/"
        started = time.perf_counter()
        upload(config, prefix, args.objects, args.empty)
        print(f"{args.objects:,} objects PUT in {time.perf_counter() - started:.0f} s",
              file=sys.stderr, flush=True)
        sequential = sequential_listing(config, prefix)
        saved = save_listing(config, f"s3://{BUCKET}/{prefix}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "MINIO_"))}
        env.update(config.to_env())
        env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = config.access_key_id or "", config.secret_access_key or ""
        results: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for _ in range(args.repeats):
            for w in workers:
                for name, who, store in RUNS:
                    if args.only is not None and not any(word in name for word in args.only):
                        continue
                    spec = {"who": who, "store": store, "workers": w, "uri": f"s3://{BUCKET}/{prefix}",
                            "endpoint": config.endpoint_url, "region": config.region,
                            "saved": saved if "saved" in name else None}
                    result = run_child(spec, env)
                    results.setdefault((name, w), []).append(result)
                    print(f"  {name} w={w}: {result['first']:.3f} s", file=sys.stderr, flush=True)
    print(report(args.objects, workers, results))
    print(f"\nThe same prefix listed page after page (list_all, aioboto3, parallel=1): {sequential:.3f} s")
    return 0


def compile_loader() -> None:
    """Write this project's bytecode, as an installed package has it: with
    ``PYTHONDONTWRITEBYTECODE`` set, a module changed since its last ``.pyc`` would otherwise be
    compiled again in every child, inside the timed construction and first iteration."""
    import compileall

    import loader

    compileall.compile_dir(os.path.dirname(loader.__file__), quiet=1)


def save_listing(config: Any, uri: str) -> str:
    """``loader ls --save``'s listing snapshot of ``uri``, in a temporary file (kept: a bench run)."""
    import tempfile

    from loader.tools.ls import list_uri

    path = os.path.join(tempfile.mkdtemp(prefix="first-sample-"), "listing.keys")
    list_uri(uri, config=config, save=path)
    return path


def sequential_listing(config: Any, prefix: str) -> float:
    """Seconds to list ``prefix`` page after page, as this project did before key ranges."""
    from loader.listing.keylist import ListOptions, list_all
    from loader.retry import RetryPolicy
    from loader.s3 import open_store

    async def main() -> float:
        store = await open_store("aioboto3", config, max_connections=1, retry=RetryPolicy())
        try:
            await list_all(store, BUCKET, "none/", RetryPolicy())  # imports, connection
            started = time.perf_counter()
            await list_all(store, BUCKET, prefix, RetryPolicy(), options=ListOptions(concurrency=1))
            return time.perf_counter() - started
        finally:
            await store.aclose()

    return asyncio.run(main())


def report(objects: int, workers: list[int], results: dict[tuple[str, int], list[dict[str, Any]]]) -> str:
    def med(name: str, w: int, field: str) -> float | None:
        values = [r[field] for r in results.get((name, w), []) if field in r]
        return statistics.median(values) if values else None

    lines = [f"### Time to first sample, {objects:,} objects", "",
             "| loader | w | script's imports to first sample | vs s3torchconnector | of which imports |",
             "|---|--:|--:|--:|--:|"]
    for w in workers:
        theirs = med(RUNS[-1][0], w, "first") or float("nan")
        for name, *_ in RUNS:
            if (name, w) not in results:
                continue
            first = med(name, w, "first") or float("nan")
            lines.append(f"| {name} | {w} | {first:.3f} s | {first / theirs:.1f}x | "
                         f"{med(name, w, 'import') or 0:.3f} s |")
    if 0 in workers:
        lines += ["", "Where the time goes at w=0 (this project, medians):", "",
                  "| backend | construct | listing (store open + LIST, backend import beside; saved: file read) "
                  "| rest (the imports, engine, first GET; saved: backend import) | total |",
                  "|---|--:|--:|--:|--:|"]
        for name, who, _ in RUNS:
            if who != "ours" or name not in {n for n, _ in results}:
                continue
            construct, listing, total = (med(name, 0, f) or 0.0 for f in ("construct", "listing", "first"))
            lines.append(f"| {name} | {construct:.3f} s | {listing:.3f} s | "
                         f"{total - construct - listing:.3f} s | {total:.3f} s |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
