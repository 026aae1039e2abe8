"""``python -m bench.tail``: the tail of real S3 through the fault proxy: stragglers and a throttle.

1,000 ~110 KiB JPEGs as objects on the embedded server, read through ``integration/faults``'s
``FaultProxy`` as a new user would: ``AsyncS3Dataset.from_keys(..., shuffle=True)``,
``DataLoader(batch_size=32, num_workers=2)``, defaults otherwise, one epoch per run, each run in
fresh processes. Conditions: clean; 1 % of GETs answered 2 s late (stragglers); GETs beyond 300/s
answered ``503 SlowDown`` (a throttled prefix) in each shape of limit the proxy has: a token bucket
(half a second's worth) keeping the connection or closing it as S3 does, a sliding second, one
limit shared by 2 ranks x 4 DataLoader workers (8 processes, the ranks told theirs by ``RANK``
and ``WORLD_SIZE`` as torchrun tells them; one epoch, four with persistent workers, and four with
workers started anew each epoch, DataLoader's default, forked or spawned), and a
limit that doubles after 20 s of load (12 epochs, persistent workers: the processes that met the
limit are those that meet its rise). "of the limit": samples/s against
the GET/s the limit allows; "rise found": seconds from the rise to the first second in which the
proxy let through 0.8x the new limit. ``--before DIR`` runs the same in another copy of the
package (a checkout of an earlier commit: its ``loader/`` is imported from there), alternating
with this tree, round after round; the medians are reported. Writes ``bench/results/tail-<date>.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from loader.tools.devserver import DevServer

from .data import make_samples

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
BUCKET = "tailbench"
# the conditions of workers started anew each epoch (DataLoader's default), forked or spawned
NEW_FORKED = "throttle: sliding second 300/s, 2 ranks x 4 workers, 4 epochs, new workers each epoch"
NEW_SPAWNED = "throttle: sliding second 300/s, 2 ranks x 4 workers, 4 epochs, new spawned workers each epoch"
NEW_SPAWNED_ONE = "throttle: sliding second 300/s, 4 epochs, new spawned workers each epoch"
CONDITIONS: dict[str, dict[str, Any]] = {
    "clean": {},
    "stragglers: 1 % of GETs 2 s late": {"straggle": 0.01, "straggle_seconds": 2.0},
    "throttle: bucket 300/s, connection kept": {"get_rate": 300.0, "slowdown_close": False},
    "throttle: bucket 300/s, closing": {"get_rate": 300.0},
    "throttle: sliding second 300/s, closing": {"get_rate": 300.0, "throttle": "window"},
    "throttle: sliding second 300/s, 2 ranks x 4 workers": {"get_rate": 300.0, "throttle": "window"},
    "throttle: sliding second 300/s, 2 ranks x 4 workers, 4 epochs": {"get_rate": 300.0, "throttle": "window"},
    NEW_FORKED: {"get_rate": 300.0, "throttle": "window"},
    NEW_SPAWNED: {"get_rate": 300.0, "throttle": "window"},
    NEW_SPAWNED_ONE: {"get_rate": 300.0, "throttle": "window"},
    "throttle: bucket 300/s doubling after 20 s, 12 epochs": {"get_rate": 300.0, "get_rate_rises_after": 20.0},
}
RANKS = {  # processes sharing the limit: ranks x DataLoader workers
    "throttle: sliding second 300/s, 2 ranks x 4 workers": (2, 4),
    "throttle: sliding second 300/s, 2 ranks x 4 workers, 4 epochs": (2, 4),
    NEW_FORKED: (2, 4),
    NEW_SPAWNED: (2, 4),
}
EPOCHS = {  # with persistent workers (the processes that learned the limit read every epoch) unless new
    "throttle: sliding second 300/s, 2 ranks x 4 workers, 4 epochs": 4,
    NEW_FORKED: 4,
    NEW_SPAWNED: 4,
    NEW_SPAWNED_ONE: 4,
    "throttle: bucket 300/s doubling after 20 s, 12 epochs": 12,
}
NEW_WORKERS = {NEW_FORKED, NEW_SPAWNED, NEW_SPAWNED_ONE}  # not persistent: workers started anew every epoch
# spawned (macOS's default; Python 3.14's forkserver alike): a DataLoader's workers start seconds apart
SPAWNED = {NEW_SPAWNED, NEW_SPAWNED_ONE}
RISE_FOUND_SHARE = 0.8  # the rise counts as found in the first second let through this share of the new limit


# One epoch in a fresh process whose `loader` comes from the current directory (this tree or
# the --before copy); prints one JSON line.
CHILD = r"""
import json, sys, time
from torch.utils.data import DataLoader
from loader import AsyncS3Dataset
spec = json.loads(sys.stdin.read())
ds = AsyncS3Dataset.from_keys(spec["bucket"], spec["keys"], shuffle=True, seed=spec["seed"])
loader = DataLoader(ds, batch_size=32, num_workers=spec.get("workers", 2), collate_fn=len,
                    persistent_workers=spec.get("persistent", False),
                    multiprocessing_context=spec.get("start"))
waits, samples = [], 0
started = asked = time.perf_counter()
for epoch in range(spec.get("epochs", 1)):
    ds.set_epoch(epoch)
    for n in loader:
        got = time.perf_counter()
        waits.append(got - asked)
        samples += n
        asked = time.perf_counter()
seconds = time.perf_counter() - started
stats = {}
try:
    stats = ds.stats()
except Exception:
    pass
waits = sorted(waits[1:])  # the first batch includes starting the workers
pick = lambda q: waits[min(len(waits) - 1, int(q * len(waits)))]
print(json.dumps({"samples": samples, "seconds": seconds, "p50": pick(0.5), "p99": pick(0.99),
                  "hedged": stats.get("hedged"), "throttled": stats.get("throttled"),
                  "requests": stats.get("requests")}))
"""


def run_child(code_dir: Path, spec: dict, s3_env: dict[str, str], ranks: int = 1) -> dict:
    """One run in fresh processes (``ranks`` of them at once, told their rank as torchrun tells
    it: ``RANK`` and ``WORLD_SIZE``, each dataset reading its rank's share of the keys), pointed at
    the proxy by the environment (as a user would); counts summed, the slowest's time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "MINIO_", "LOADER_"))}
    for name in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    env.update(s3_env)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, cwd=code_dir, text=True,
                              env=env if ranks == 1 else {**env, "RANK": str(rank), "WORLD_SIZE": str(ranks)})
             for rank in range(ranks)]
    for proc in procs:  # every rank has its keys before any is waited for: they run at once
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        proc.stdin = None  # written and closed: communicate() only reads
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"child in {code_dir} failed:\n{err[-3000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    merged = dict(outs[0])
    for key in ("samples", "hedged", "throttled", "requests"):
        values = [o[key] for o in outs if o.get(key) is not None]
        merged[key] = sum(values) if values else None
    merged["seconds"] = max(o["seconds"] for o in outs)
    return merged


def of_the_limit(plan: dict, out: dict) -> tuple[float, float | None]:
    """Samples/s against the GET/s the limit allowed over the run (twice ``get_rate`` after its
    rise), and seconds from the rise to the first second let through ``RISE_FOUND_SHARE`` of the
    new limit (None: no rise, or not found)."""
    rate, seconds, rose = plan["get_rate"], out["seconds"], out["rose_after"]
    allowed = rate * seconds if rose is None else rate * min(rose, seconds) + 2 * rate * max(0.0, seconds - rose)
    found = None
    if rose is not None:
        for second, passed in enumerate(out["passed"]):
            if second >= rose and passed >= RISE_FOUND_SHARE * 2 * rate:
                found = second + 1 - rose
                break
    return out["samples"] / allowed, found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tail", description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", type=Path, help="a copy of an earlier tree (its loader/ is imported)")
    p.add_argument("--before-label", default="before")
    p.add_argument("--only", action="append",
                   help="run only conditions whose name starts with this, or is this where it ends "
                        "with $ (repeatable; default: all)")
    p.add_argument("--out", type=Path, help="where to write the table (default: bench/results/tail-<date>.md)")
    args = p.parse_args(argv)
    conditions = {name: plan for name, plan in CONDITIONS.items()
                  if not args.only or any(name == only[:-1] if only.endswith("$") else name.startswith(only)
                                          for only in args.only)}
    sys.path.insert(0, str(ROOT / "integration"))
    from faults import FaultPlan, FaultProxy

    trees = {"after": ROOT} if args.before is None else {args.before_label: args.before, "after": ROOT}
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as root, DevServer(data_dir=root, buckets=[BUCKET]) as server:
        client = server.client()
        samples = make_samples(args.samples)
        for key, body in samples.items():
            client.put_object(Bucket=BUCKET, Key=key, Body=body)
        keys = sorted(samples)
        with FaultProxy(server.config.endpoint_url, FaultPlan(), max_lifetime=3600) as proxy:
            s3_env = dataclasses.replace(server.config, endpoint_url=proxy.endpoint_url).to_env()
            for round_ in range(args.rounds):
                for condition, plan in conditions.items():
                    for label, tree in (trees.items() if round_ % 2 == 0 else reversed(trees.items())):
                        proxy.set_plan(FaultPlan(seed=round_, **plan))
                        proxy.reset_counts()
                        ranks, workers = RANKS.get(condition, (1, 2))
                        spec: dict[str, Any] = {"bucket": BUCKET, "keys": keys, "seed": round_, "workers": workers,
                                "epochs": EPOCHS.get(condition, 1),
                                "persistent": EPOCHS.get(condition, 1) > 1 and condition not in NEW_WORKERS,
                                "start": "spawn" if condition in SPAWNED else None}
                        out = run_child(tree, spec, s3_env, ranks)
                        counts = proxy.counts
                        out["rose_after"], out["passed"] = proxy.throttle_timeline()
                        out["proxy_requests"] = counts["requests"]
                        out["slowdowns"] = counts["slowdown"]
                        out["straggles"] = counts["straggle"]
                        assert out["samples"] == len(keys) * spec["epochs"], out  # each sample once an epoch
                        if "get_rate" in plan:
                            out["of_limit"], out["rise_found"] = of_the_limit(plan, out)
                        results.setdefault((condition, label), []).append(out)
                        print(f"round {round_} {condition:<38} {label:<8} {out['samples'] / out['seconds']:7.0f}/s "
                              f"p50 {out['p50'] * 1000:6.1f} ms p99 {out['p99'] * 1000:7.1f} ms "
                              f"SlowDown {out['slowdowns']}/{out['proxy_requests']} hedged {out['hedged']}",
                              flush=True)

    lines = ["| condition | tree | samples/s | vs clean | of the limit | rise found | batch wait p50 | p99 | "
             "GETs answered SlowDown | hedged (stats) |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for condition in conditions:
        for label in trees:
            runs = results[(condition, label)]
            base = results.get(("clean", label), runs)
            clean = statistics.median(r["samples"] / r["seconds"] for r in base)
            rate = statistics.median(r["samples"] / r["seconds"] for r in runs)
            p50 = statistics.median(r["p50"] for r in runs) * 1000
            p99 = statistics.median(r["p99"] for r in runs) * 1000
            share = statistics.median(r["slowdowns"] / r["proxy_requests"] for r in runs)
            hedged = [r["hedged"] for r in runs if r["hedged"] is not None]
            requests = [r["requests"] for r in runs if r["requests"]]
            hedge_text = (f"{statistics.median(hedged):.0f} of {statistics.median(requests):,.0f}"
                          if hedged and requests else "-")
            of_limit = statistics.median(r["of_limit"] for r in runs) if "get_rate" in CONDITIONS[condition] else None
            found = [r["rise_found"] for r in runs if r.get("rose_after") is not None]
            found_text = "-" if not found else (
                "not" if None in found else f"{statistics.median(found):.0f} s")
            lines.append(f"| {condition} | {label} | {rate:,.0f} | {rate / clean:.2f}x | "
                         f"{'-' if of_limit is None else f'{of_limit:.2f}x'} | {found_text} | {p50:.0f} ms | "
                         f"{p99:.0f} ms | {share:.0%} | {hedge_text} |")
    table = "\n".join(lines) + "\n"
    print()
    print(table)
    stamp = datetime.date.today().isoformat()
    RESULTS.mkdir(exist_ok=True)
    out_path = args.out or RESULTS / f"tail-{stamp}.md"
    trees_text = ", ".join(f"`{label}`" for label in trees)
    out_path.write_text(
        f"# The tail of S3 through the fault proxy, {stamp}\n\n"
        f"`python -m bench.tail --samples {args.samples} --rounds {args.rounds}"
        + (f" --before <checkout> --before-label {args.before_label}" if args.before else "")
        + f"`: {args.samples} ~110 KiB JPEGs as objects on the embedded SeaweedFS (127.0.0.1) behind "
        "`integration/faults`' FaultProxy (a thread of the benchmark's process); each run one epoch of "
        "`AsyncS3Dataset.from_keys(..., shuffle=True)` through `DataLoader(batch_size=32, num_workers=2)` "
        "(or as the condition says: ranks as processes at once, each its share of the keys; several epochs "
        "with `persistent_workers=True` unless it says new workers each epoch), defaults otherwise, in "
        "fresh processes; trees "
        f"{trees_text} alternate round after round, medians "
        f"of {args.rounds}. Batch wait: how long the loop waited for each batch after the first. "
        "The machine (2 cores) was shared with other work: compare rows of one table, not absolutes.\n\n"
        + table)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
