"""``python -m bench.revisions --base REV [--head REV ...]``: two (or more) git revisions, one run.

The per-object benchmark that catches a regression the day it lands: each revision is checked
out into a temporary worktree (``git worktree add --detach``), and the same measurement
(``bench/revision_child.py``: ``AsyncS3Dataset.from_prefix``, 2 DataLoader workers, 1,000
~110 KiB JPEGs behind a latency proxy adding 20 ms to first byte) runs in a child process whose
``import loader`` finds that revision, against one embedded SeaweedFS server and one data set.
Revisions alternate in rounds (the order flips every round, so neither always goes first);
each round gives one ratio per head against the base, taken minutes apart at most. Reports
medians, the range and the per-round ratios; writes ``bench/results/revisions-<date>.md``/``.json``.

    python -m bench.revisions --base 8e8352e                 # the previous release vs this tree
    python -m bench.revisions --base 8e8352e --head d94c5c2 --head main --head .
    python -m bench.revisions --base main --store aioboto3 --rounds 4
    python -m bench.revisions --base main --mode shards --latency 0   # the same samples in 8 tar shards
"""

from __future__ import annotations

import argparse
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

from .harness import REPO, RESULTS_DIR, load_faults_module
from .run import _floats, _ints, _words

CHILD = Path(__file__).resolve().parent / "revision_child.py"
WORKTREE = "."  # the revision name of this checkout as it is (uncommitted changes included)
CHILD_LIMIT = 300.0  # seconds one measurement may take before it counts as hung
_ENV_DROP = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "S3_ENDPOINT_URL", "AWS_PROFILE",
             "AWS_SESSION_TOKEN", "AWS_DEFAULT_PROFILE", "MINIO_ENDPOINT", "MINIO_ACCESS_KEY",
             "MINIO_SECRET_KEY", "MINIO_SECURE", "LOADER_STORE", "AWS_CA_BUNDLE", "PYTHONPATH")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.revisions", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the revision the others are compared with")
    p.add_argument("--head", action="append",
                   help=f"a revision to compare (repeat for several); {WORKTREE!r} is this checkout "
                        f"as it is, uncommitted changes included (the default)")
    p.add_argument("--store", type=_words(("aioboto3", "obstore")), default=("aioboto3", "obstore"),
                   help="backends, comma-separated (default aioboto3,obstore)")
    p.add_argument("--rounds", type=int, default=8, help="alternated rounds (default 8)")
    p.add_argument("--objects", type=int, default=1000, help="objects read per epoch (default 1000)")
    p.add_argument("--latency", type=_floats, default=(0.02,),
                   help="added time to first byte in seconds (default 0.02)")
    p.add_argument("--workers", type=_ints, default=(2,), help="DataLoader workers (default 2)")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per measurement, median (default 3)")
    p.add_argument("--mode", choices=("objects", "shards"), default="objects",
                   help="objects (from_prefix, the default) or the same samples in tar shards (from_shards)")
    p.add_argument("--shards", type=int, default=8, help="tar shards in --mode shards (default 8)")
    p.add_argument("--max-inflight", type=int, default=64, help="max_inflight (default 64)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"output directory (default {RESULTS_DIR})")
    return p


@contextlib.contextmanager
def checkouts(revisions: list[str], tmp: Path):
    """``{revision: directory}``: a detached worktree per revision (this checkout for ``.``),
    removed afterwards."""
    made: list[Path] = []
    out: dict[str, Path] = {}
    try:
        for rev in revisions:
            if rev == WORKTREE:
                out[rev] = REPO
                continue
            where = tmp / f"rev-{len(made)}"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(where), rev],
                           check=True)
            made.append(where)
            out[rev] = where
        yield out
    finally:
        for where in made:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)],
                           check=False, capture_output=True)


def describe(rev: str) -> str:
    """``rev`` as ``abc1234 subject`` (``.``: this checkout, with a note when it has changes)."""
    if rev == WORKTREE:
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        head = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h"],
                              capture_output=True, text=True).stdout.strip()
        return f"this checkout ({head}{' + uncommitted changes' if dirty else ''})"
    line = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s", rev],
                          capture_output=True, text=True, check=True).stdout.strip()
    return line[:90]


def measure(directory: Path, spec: dict[str, Any], env: dict[str, str], log: Any) -> dict[str, Any]:
    """One child: ``spec`` measured with ``loader`` imported from ``directory``."""
    child_env = dict(env, PYTHONPATH=str(directory))
    try:
        done = subprocess.run([sys.executable, str(CHILD)], cwd=directory, env=child_env,
                              input=json.dumps(spec), capture_output=True, text=True,
                              timeout=CHILD_LIMIT, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        log.write(f"--- hung after {CHILD_LIMIT:.0f}s: {spec}\n{exc.stderr or ''}\n")
        return {"error": f"no result in {CHILD_LIMIT:.0f}s"}
    log.write(done.stderr)
    lines = done.stdout.strip().splitlines()
    if not lines:
        return {"error": f"child exited {done.returncode} without a result"}
    result = json.loads(lines[-1])
    where = result.pop("loader_file", "")
    if "error" not in result and not where.startswith(str(directory)):
        result = {"error": f"imported loader from {where}, not from {directory}"}
    return result  # the check done, no machine path goes into the results


def rounds_order(revisions: list[str], round_: int) -> list[str]:
    """Forward in even rounds, backward in odd ones: each revision runs first as often."""
    return list(revisions) if round_ % 2 == 0 else list(reversed(revisions))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from loader.tools.devserver import DevServer

    from . import data

    heads = args.head or [WORKTREE]
    revisions = [args.base, *[h for h in heads if h != args.base]]
    labels = {rev: describe(rev) for rev in revisions}
    faults = load_faults_module()
    results: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "bench.log"
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="loader-revisions-") as tmp:
        where = stack.enter_context(checkouts(revisions, Path(tmp)))
        print(f"revisions: {', '.join(labels[r] for r in revisions)}", file=sys.stderr)
        server = stack.enter_context(DevServer(buckets=[data.BUCKET]))
        config = server.config
        samples = data.make_samples(args.objects)
        from loader.tools.examples import put_all as upload

        if args.mode == "shards":
            samples = data.make_shards(samples, args.shards)
            uri = f"s3://{data.BUCKET}/{data.SHARDS_PREFIX}train-{{0000..{args.shards - 1:04d}}}.tar"
        else:
            uri = f"s3://{data.BUCKET}/{data.OBJECTS_PREFIX}"
        upload(config, samples, bucket=data.BUCKET)
        endpoints = {}
        for latency in args.latency:
            if latency > 0:
                proxy = stack.enter_context(faults.FaultProxy(
                    config.endpoint_url, faults.FaultPlan(latency=latency), max_lifetime=6 * 3600))
                endpoints[latency] = proxy.endpoint_url
            else:
                endpoints[latency] = config.endpoint_url
        env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP}
        env.update(AWS_ACCESS_KEY_ID=config.access_key_id, AWS_SECRET_ACCESS_KEY=config.secret_access_key,
                   AWS_REGION=config.region, AWS_DEFAULT_REGION=config.region)
        cases = [(store, latency, workers) for store in args.store for latency in args.latency
                 for workers in args.workers]
        total = len(cases) * args.rounds * len(revisions)
        began = time.perf_counter()
        with open(log_path, "a") as log:
            log.write(f"\n=== bench.revisions {time.ctime()} ===\n")
            for round_ in range(args.rounds):
                for store, latency, workers in cases:
                    for rev in rounds_order(revisions, round_):
                        spec = dict(endpoint_url=endpoints[latency], region=config.region,
                                    uri=uri, mode=args.mode, store=store,
                                    workers=workers, epochs=args.epochs, batch_size=32,
                                    max_inflight=args.max_inflight, objects=args.objects)
                        result = measure(where[rev], spec, env, log)
                        results.append(dict(result, rev=rev, round=round_, store=store,
                                            latency_ms=round(latency * 1000), workers=workers))
                        shown = (f"{result['samples_per_s']:7.0f}/s" if "error" not in result
                                 else result["error"])
                        print(f"[{len(results)}/{total} {time.perf_counter() - began:5.0f}s] round {round_} "
                              f"{store} {round(latency * 1000)}ms w{workers} {rev}: {shown}",
                              file=sys.stderr, flush=True)
                        log.flush()
    meta = dict(started=time.strftime("%Y-%m-%d %H:%M"), base=args.base, mode=args.mode, shards=args.shards, revisions=revisions,
                labels=labels, objects=args.objects, epochs=args.epochs, rounds=args.rounds,
                max_inflight=args.max_inflight, cpus=os.cpu_count(), load_avg=os.getloadavg(),
                seconds=time.perf_counter() - began)
    return dict(meta=meta, results=results)


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, revision): median samples/s, range, and the per-round ratio to the base."""
    meta, results = report["meta"], report["results"]
    base = meta["base"]
    rows = []
    cases = sorted({(r["store"], r["latency_ms"], r["workers"]) for r in results})
    for store, ms, workers in cases:
        mine = [r for r in results if (r["store"], r["latency_ms"], r["workers"]) == (store, ms, workers)]
        by_round = {(r["rev"], r["round"]): r for r in mine if "error" not in r}
        for rev in meta["revisions"]:
            rates = [r["samples_per_s"] for r in mine if r["rev"] == rev and "error" not in r]
            cpu = [r["client_us"] for r in mine if r["rev"] == rev and "error" not in r]
            firsts = [r["first_batch_s"] for r in mine if r["rev"] == rev and "first_batch_s" in r]
            errors = [r["error"] for r in mine if r["rev"] == rev and "error" in r]
            ratios = [by_round[(rev, k)]["samples_per_s"] / by_round[(base, k)]["samples_per_s"]
                      for k in range(meta["rounds"]) if (rev, k) in by_round and (base, k) in by_round]
            rows.append(dict(store=store, latency_ms=ms, workers=workers, rev=rev,
                             label=meta["labels"][rev], runs=len(rates),
                             median=statistics.median(rates) if rates else None,
                             low=min(rates, default=None), high=max(rates, default=None),
                             client_us=statistics.median(cpu) if cpu else None,
                             first_batch_s=statistics.median(firsts) if firsts else None,
                             ratio=statistics.median(ratios) if ratios and rev != base else None,
                             faster=sum(x > 1 for x in ratios), pairs=len(ratios), errors=errors))
    return rows


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    if meta.get("mode") == "shards":
        mode_title, what = "Tar shards", f"{meta['objects']} samples (~110 KiB JPEGs) in {meta['shards']} tar shards"
    else:
        mode_title, what = "Per-object", f"{meta['objects']} objects (~110 KiB JPEGs)"
    lines = [
        f"# {mode_title}, revisions side by side ({meta['started']})", "",
        f"`python -m bench.revisions`: {what}, batch 32, "
        f"max_inflight {meta['max_inflight']}, {meta['epochs']} timed epochs per measurement (median), "
        f"{meta['rounds']} alternated rounds; one embedded SeaweedFS server, one data set, latency "
        f"proxy in the harness process. {meta['cpus']} cores, load average at the end "
        f"{', '.join(f'{x:.1f}' for x in meta['load_avg'])}; {meta['seconds'] / 60:.1f} min.", "",
        "| backend | latency | workers | revision | samples/s median (min-max) | client CPU/sample "
        "| first batch | vs base, median of per-round ratios | faster in |",
        "|---|--:|--:|---|---|--:|--:|--:|--:|",
    ]
    for row in summarize(report):
        rate = ("error: " + row["errors"][0]) if row["median"] is None else (
            f"{row['median']:,.0f} ({row['low']:,.0f}-{row['high']:,.0f})")
        ratio = "base" if row["rev"] == meta["base"] else (
            f"{row['ratio']:.3f}x" if row["ratio"] is not None else "-")
        faster = "" if row["rev"] == meta["base"] else f"{row['faster']} of {row['pairs']}"
        cpu = f"{row['client_us']:,.0f} us" if row["client_us"] is not None else "-"
        first = f"{row['first_batch_s'] * 1000:,.0f} ms" if row["first_batch_s"] is not None else "-"
        lines.append(f"| {row['store']} | {row['latency_ms']} ms | {row['workers']} | `{row['label']}` "
                     f"| {rate} | {cpu} | {first} | {ratio} | {faster} |")
    lines += ["", "Client CPU: the measuring process and its DataLoader workers (user + system), per "
              "sample. First batch: from iter(loader) to the first batch of a timed epoch (median). "
              "Ratios are taken within a round (the same minutes), then their median."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.rounds < 1 or args.objects < 32 or args.epochs < 1:
        raise SystemExit("--rounds and --epochs must be at least 1, --objects at least 32")
    report = run(args)
    stamp = time.strftime("%Y-%m-%d-%H%M")
    md = markdown(report)
    (args.out / f"revisions-{stamp}.md").write_text(md)
    (args.out / f"revisions-{stamp}.json").write_text(json.dumps(report, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
