"""``python -m bench.first_sample``: time to the first sample, this project next to s3torchconnector.

Starts the embedded SeaweedFS server on 127.0.0.1, PUTs N objects of ~110 KB under one prefix,
and in a fresh process per run measures, from ``from_prefix(...)`` to the first sample out of
``DataLoader(ds, num_workers=w, batch_size=None)``:

* ``AsyncS3Dataset.from_prefix(uri, shuffle=True, store=...)``, aioboto3 and obstore;
* the same unshuffled (``shuffle=False``, aioboto3), read in the listing's order as the peer's
  iterable dataset reads: with ``w=0`` it starts on the first LIST page (``datasets.streamed``);
* the same from a listing saved beforehand (``loader ls --save``): ``from_manifest(path, ...)``,
  which reads the file instead of listing (a restarted job);
* s3torchconnector's ``S3IterableDataset.from_prefix(uri, enable_sharding=True)``: no shuffle
  (it has none), keys in listing order, split over DataLoader workers.

The clock starts before the script's own imports, ours and the peer's alike (torch's excepted:
the DataLoader needs it whoever loads): each child is a bare ``python -c`` script that imports
nothing else before its clock (``import`` reports their share). For this project with ``w=0``
the time is broken down: the dataset's construction, the listing (store opening
and LIST requests, with the backend's import beside them; saved: the file read), and the rest
(the backend's import where nothing was listed, engine start, first GET). Median of
``--repeats``; ratios are ours / s3torchconnector's iterable dataset, same server, same data,
same run. Needs the ``bench`` extra (``make install-bench``).

With ``--base REV`` this project is measured at two revisions in the same run (``REV`` checked
out into a temporary worktree, beside this checkout), in rounds whose order flips every round,
and the report gives each revision's rows and the per-round ratios of this checkout to ``REV``.
``--settle-gc``: each child collects garbage right after torch's import, before the clock (what
torch's import left for the next full collection is then not paid inside the timed window by
whichever loader allocates enough to trigger it; without it, it is, as in a script that builds
the dataset right after ``import torch``).

    python -m bench.first_sample                  # 4,000 objects, w = 0 and 2, ~2 min
    python -m bench.first_sample --objects 4000 --workers 0,2 --repeats 3
    python -m bench.first_sample --base main --repeats 5 --only "ours aioboto3" s3torchconnector
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
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
# ``argv``: the spec, the tree ``loader`` is imported from, this file's child module, and
# whether to collect what torch's import left before the clock (``--settle-gc``).
CHILD_SCRIPT = """
import json, sys, time
started = time.perf_counter()
import torch
torch_import = time.perf_counter() - started
import gc
if sys.argv[4] == "settle":
    gc.collect()
full = []  # the full collections inside the clock's window: (start, seconds)
gc.callbacks.append(lambda phase, info: info["generation"] == 2 and full.append((phase, time.perf_counter())))
sys.path.insert(0, sys.argv[2])
import importlib.util
spec = importlib.util.spec_from_file_location("first_sample_child", sys.argv[3])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
result = module.child(json.loads(sys.argv[1]), torch_import)
result["loader_file"] = getattr(sys.modules.get("loader"), "__file__", None)
result["full_gc"] = sum(b - a for (p, a), (q, b) in zip(full[::2], full[1::2]))
print(json.dumps(result))
"""
CHILD_MODULE = os.path.join(REPO, "bench", "first_sample_child.py")


def run_child(spec: dict[str, Any], env: dict[str, str], tree: str = REPO, settle: bool = False) -> dict[str, Any]:
    """One measurement in a fresh process, ``loader`` imported from ``tree`` (checked)."""
    out = subprocess.run([sys.executable, "-c", CHILD_SCRIPT, json.dumps(spec), tree, CHILD_MODULE,
                          "settle" if settle else "as-is"], env=dict(env, PYTHONPATH=tree), cwd=tree,
                         capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{spec}: exit {out.returncode}\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    where = result.pop("loader_file")
    if where is not None and not where.startswith(os.path.join(tree, "")):
        raise RuntimeError(f"{spec}: imported loader from {where}, not from {tree}")
    return result


RUNS = [("ours aioboto3", "ours", "aioboto3"), ("ours obstore", "ours", "obstore"),
        ("ours aioboto3, unshuffled", "ours", "aioboto3"),
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
    parser.add_argument("--base", default=None,
                        help="also measure this project at this git revision, alternated with this checkout")
    parser.add_argument("--settle-gc", action="store_true",
                        help="collect garbage after torch's import, before the clock, in every child")
    args = parser.parse_args(argv)
    from .revisions import WORKTREE, checkouts, describe

    workers = [int(w) for w in args.workers.split(",")]
    revisions = [WORKTREE] if args.base is None else [args.base, WORKTREE]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="first-sample-")))
        trees = {rev: str(path) for rev, path in stack.enter_context(checkouts(revisions, tmp)).items()}
        for tree in trees.values():
            compile_loader(tree)
        results = measure_all(args, workers, revisions, trees)
    tags = {rev: ("" if rev == WORKTREE else f" @ {args.base}") for rev in revisions}
    print(report(args.objects, workers, {(name + tags[rev], w): runs for (name, rev, w), runs in results.items()
                                         if name != "sequential"}, [tags[rev] for rev in revisions]))
    if args.base is not None:
        print(f"\nRevisions: {args.base} = {describe(args.base)}; this checkout = {describe(WORKTREE)}")
        print(per_round(results, workers, args.base))
    if args.settle_gc:
        print("\nEach child collected garbage after torch's import, before the clock (--settle-gc).")
    sequential = statistics.median(r["seconds"] for r in results[("sequential", WORKTREE, 0)])
    print(f"\nThe same prefix listed page after page (list_all, aioboto3, parallel=1): {sequential:.3f} s")
    return 0


def measure_all(args: argparse.Namespace, workers: list[int], revisions: list[str],
                trees: dict[str, str]) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    """Every run of every round: ``{(run name, revision, w): [result, ...]}`` (the peer's under
    this checkout's revision; ``("sequential", ., 0)``: the page-after-page listing's seconds)."""
    from loader.tools.devserver import DevServer

    from .revisions import rounds_order

    results: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
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
        results[("sequential", revisions[-1], 0)] = [{"seconds": sequential}]
        for round_ in range(args.repeats):
            for w in workers:
                for name, who, store in RUNS:
                    if args.only is not None and not any(word in name for word in args.only):
                        continue
                    spec = {"who": who, "store": store, "workers": w, "uri": f"s3://{BUCKET}/{prefix}",
                            "endpoint": config.endpoint_url, "region": config.region,
                            "saved": saved if "saved" in name else None, "shuffle": "unshuffled" not in name}
                    for rev in (rounds_order(revisions, round_) if who == "ours" else revisions[-1:]):
                        result = run_child(spec, env, trees[rev], args.settle_gc)
                        results.setdefault((name, rev, w), []).append(result)
                        print(f"  {name} {rev} w={w}: {result['first']:.3f} s", file=sys.stderr, flush=True)
    return results


def per_round(results: dict[tuple[str, str, int], list[dict[str, Any]]], workers: list[int], base: str) -> str:
    """This checkout over ``base``, round by round (the same round's runs, minutes apart at most)."""
    from .revisions import WORKTREE

    lines = ["", "| loader | w | this checkout / base, per round | median |", "|---|--:|---|--:|"]
    for name, who, _ in RUNS:
        for w in workers:
            mine, theirs = results.get((name, WORKTREE, w)), results.get((name, base, w))
            if who != "ours" or not mine or not theirs:
                continue
            ratios = [a["first"] / b["first"] for a, b in zip(mine, theirs)]
            lines.append(f"| {name} | {w} | {', '.join(f'{r:.2f}' for r in ratios)} | "
                         f"{statistics.median(ratios):.2f}x |")
    return "\n".join(lines)


def compile_loader(tree: str) -> None:
    """Write the bytecode of ``tree``'s ``loader``, as an installed package has it: with
    ``PYTHONDONTWRITEBYTECODE`` set, a module changed since its last ``.pyc`` would otherwise be
    compiled again in every child, inside the timed construction and first iteration."""
    import compileall

    compileall.compile_dir(os.path.join(tree, "loader"), quiet=1)


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


def report(objects: int, workers: list[int], results: dict[tuple[str, int], list[dict[str, Any]]],
           tags: tuple[str, ...] | list[str] = ("",)) -> str:
    """The tables: every run (``name + tag``: one per revision) against the peer's, and at w=0
    where this project's time goes."""
    def med(name: str, w: int, field: str) -> float | None:
        values = [r[field] for r in results.get((name, w), []) if field in r]
        return statistics.median(values) if values else None

    names = [(name + tag, who) for name, who, _ in RUNS for tag in (tags if who == "ours" else ("",))]
    lines = [f"### Time to first sample, {objects:,} objects", "",
             "| loader | w | script's imports to first sample | vs s3torchconnector | of which imports "
             "| of which full garbage collections |",
             "|---|--:|--:|--:|--:|--:|"]
    for w in workers:
        theirs = med(RUNS[-1][0], w, "first") or float("nan")
        for name, _ in names:
            if (name, w) not in results:
                continue
            first = med(name, w, "first") or float("nan")
            lines.append(f"| {name} | {w} | {first:.3f} s | {first / theirs:.2f}x | "
                         f"{med(name, w, 'import') or 0:.3f} s | {med(name, w, 'full_gc') or 0:.3f} s |")
    if 0 in workers:
        lines += ["", "Where the time goes at w=0 (this project, medians):", "",
                  "| backend | construct | listing (store open + LIST, backend import beside; saved: file read) "
                  "| rest (the imports, engine, first GET; saved: backend import) | total |",
                  "|---|--:|--:|--:|--:|"]
        for name, who in names:
            if who != "ours" or (name, 0) not in results:
                continue
            construct, listing, total = (med(name, 0, f) or 0.0 for f in ("construct", "listing", "first"))
            lines.append(f"| {name} | {construct:.3f} s | {listing:.3f} s | "
                         f"{total - construct - listing:.3f} s | {total:.3f} s |")
    return "\n".join(lines)

if __name__ == "__main__":
    raise SystemExit(main())
