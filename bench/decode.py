"""``python -m bench.decode``: decoding photo-like JPEGs, this project next to its peers, one run.

The usual recipe (Pillow decode -> ``convert("RGB")`` -> ``resize((224, 224), BILINEAR)`` -> uint8
CHW tensor) through webdataset, s3torchconnector and this project, and this project's fast path
(``loader.decode.decode_image(data, (224, 224))``) through the same loaders, on the same shards and
objects, DataLoader(batch_size=32, num_workers=2), no added latency. The data are photo-like JPEGs
(``loader.tools.demo.photo_jpeg``: 380-650 px a side, ~50 KiB), not noise, which would cost several
times more to decode and misstate every ratio. Also reports the fast path's fidelity: PSNR against
the usual recipe over every image of the data set.

Writes ``bench/results/decode-<date>.md`` and ``.json``. About 3-5 minutes on 2 cores.

    python -m bench.decode                                 # ceiling, ours (shards), s3tc-map, wds
    python -m bench.decode --only wds,ours-shard           # also: ours-shard-obstore
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from typing import Any

from .harness import Harness, select_loaders
from .loaders import DECODE_SIZE, LOADERS, WORKLOADS
from .report import best, results_table
from .run import options_from, parser

DECODE_LOADERS = ("ceiling", "ours-shard-aioboto3", "ours-shard-obstore", "s3tc-map", "wds")
DEFAULT_LOADERS = ("ceiling", "ours-shard-aioboto3", "s3tc-map", "wds")  # ~3-5 min on 2 busy cores
RECIPES = {"decode": "usual recipe", "fast": "fast path"}
FAST_VS_WDS = 2.0  # goal: the fast path end to end vs webdataset's usual recipe
USUAL_VS_WDS = 1.0  # goal: the usual recipe through this project vs webdataset's
PSNR_BOUND = 35.0


def fidelity(samples: dict[str, bytes]) -> dict[str, float]:
    """PSNR (dB) of the fast path against the usual recipe, over every image."""
    values = []
    for data in samples.values():
        usual, fast = WORKLOADS["decode"](data), WORKLOADS["fast"](data)
        mse = (usual.float() - fast.float()).pow(2).mean().item()
        values.append(math.inf if mse == 0 else 10 * math.log10(255**2 / mse))
    finite = [v for v in values if math.isfinite(v)] or [math.inf]
    return {"images": len(values), "min_db": min(values), "median_db": statistics.median(values),
            "mean_db": statistics.fmean(finite)}


def summary(results: list[dict[str, Any]], psnr: dict[str, float]) -> list[dict[str, Any]]:
    """The goals: ratios within this run, and the fidelity bound."""
    wds = best(results, "wds", "decode", 0)
    goals = []

    def ratio(text: str, ours: dict[str, Any] | None, target: float) -> None:
        value = ours["samples_per_s"] / wds["samples_per_s"] if ours and wds else None
        goals.append({"goal": text, "target": f">= {target:g}x", "measured": value,
                      "met": value is not None and value >= target,
                      "detail": (f"{ours['loader']} {ours['samples_per_s']:,.0f}/s vs wds "
                                 f"{wds['samples_per_s']:,.0f}/s" if ours and wds else "not measured")})

    ours = [n for n in LOADERS if n.startswith("ours-shard")]
    ratio("fast path (ours, shards) vs webdataset's usual recipe", best(results, ours, "fast", 0), FAST_VS_WDS)
    ratio("usual recipe through ours (shards) vs webdataset's", best(results, ours, "decode", 0), USUAL_VS_WDS)
    goals.append({"goal": "fast path fidelity: min PSNR vs the usual recipe", "target": f">= {PSNR_BOUND:g} dB",
                  "measured": psnr["min_db"], "met": psnr["min_db"] >= PSNR_BOUND,
                  "detail": f"median {psnr['median_db']:.1f} dB over {psnr['images']} images"})
    return goals


def table(results: list[dict[str, Any]]) -> str:
    wds = best(results, "wds", "decode", 0)
    lines = ["| loader | recipe | samples/s | vs wds usual | client CPU µs/sample | server µs/sample | other load (cores) |",
             "|---|---|--:|--:|--:|--:|--:|"]
    for name in DECODE_LOADERS:
        for workload, recipe in RECIPES.items():
            rows = [r for r in results if r["loader"] == name and r["workload"] == workload]
            for r in rows:
                if r.get("error"):
                    lines.append(f"| {name} | {recipe} | error: {r['error'].replace('|', '/')} | | | | |")
                    continue
                vs = f"{r['samples_per_s'] / wds['samples_per_s']:.2f}x" if wds else "–"
                server = f"{r['server_us']:,.0f}" if r.get("server_us") and r["mode"] != "memory" else "–"
                lines.append(f"| {name} | {recipe} | {r['samples_per_s']:,.0f} | {vs} | {r['client_us']:,.0f} "
                             f"| {server} | {r.get('other_cores', 0):.2f} |")
    return "\n".join(lines)


def markdown(results: list[dict[str, Any]], meta: dict[str, Any], goals: list[dict[str, Any]]) -> str:
    goal_lines = "\n".join(
        f"| {g['goal']} | {g['target']} | {'–' if g['measured'] is None else format(g['measured'], '.2f')} "
        f"| {'✅ met' if g['met'] else '❌ missed'} | {g['detail']} |" for g in goals)
    legend = "\n".join(f"- `{name}`: {LOADERS[name].label}" for name in DECODE_LOADERS
                       if any(r["loader"] == name for r in results))
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
    load = ", ".join(f"{x:.1f}" for x in meta.get("load_avg", ()))
    return f"""# Decode benchmark

{meta.get('started', '')}, {meta.get('total_seconds', 0):.0f} s. {meta.get('samples')} photo-like JPEGs
(`loader.tools.demo.photo_jpeg`, 380-650 px a side, {meta.get('mean_kib', 0):.0f} KiB mean) as objects and in
{meta.get('shards')} WebDataset tar shards, embedded SeaweedFS {meta.get('seaweedfs')} on 127.0.0.1, no added latency.
DataLoader(batch_size=32, num_workers=2, prefetch_factor=2, persistent_workers=True), empty training
step, one warm-up epoch (capped at {meta.get('warmup_seconds')} s), then the median of {meta.get('epochs')} full timed epochs
(every loader reads every sample of each).

- **usual recipe**: Pillow decode → `convert("RGB")` → `resize((224, 224), BILINEAR)` → uint8 CHW tensor
  (`bench/loaders.py: decode`), the same function for every loader;
- **fast path**: `loader.decode.decode_image(data, (224, 224))`: libjpeg-turbo (simplejpeg) decoding at
  the smallest DCT scale that covers 224, then torch's antialiased uint8 bilinear resize.

Client CPU = the iterating process and its DataLoader workers (psutil), per delivered sample.
**{meta.get('cpus')} CPUs shared by client and server (load average at start: {load}); compare ratios within
this run only.** Versions: Python {meta.get('python')}, {versions}.

## Goals

| goal | target | measured | status | detail |
|---|---|--:|---|---|
{goal_lines}

## Runs

{table(results)}

Loaders:
{legend}

## Every run (the harness's columns)

{results_table(results)}
"""


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.prog = "python -m bench.decode"
    p.set_defaults(latency=(0.0,), workload=("decode", "fast"))
    args = p.parse_args(argv)
    loaders = select_loaders(args.only, peers=not args.no_peers,
                             names=DECODE_LOADERS if args.only else DEFAULT_LOADERS)
    if not loaders:
        raise SystemExit(f"--only {args.only!r} matches no loader of the decode section")
    args.samples = args.samples or 600
    args.decode_samples = args.samples  # one data set: every recipe reads all of it
    args.workers = args.workers or (2,)
    # every loader runs full epochs here (the same work for all; the cap exists for slow
    # per-object peers at +20 ms, which this section does not run)
    args.epoch_seconds = args.epoch_seconds or 60.0
    options = options_from(args, loaders)
    options.images = "photo"
    harness = Harness(options, progress=not args.no_progress)
    results = harness.run()
    print("measuring the fast path's fidelity ...", file=sys.stderr, flush=True)
    psnr = fidelity(harness.samples)
    goals = summary(results, psnr)
    harness.meta.update(psnr=psnr, decode_size=list(DECODE_SIZE))
    print()
    print(table(results))
    print()
    for g in goals:
        measured = "–" if g["measured"] is None else f"{g['measured']:.2f}"
        print(f"  [{'met' if g['met'] else 'missed':>6}] {g['goal']}: {measured} (target {g['target']}; {g['detail']})")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"decode-{time.strftime('%Y-%m-%d')}"
    stem.with_suffix(".md").write_text(markdown(results, harness.meta, goals))
    stem.with_suffix(".json").write_text(json.dumps({"meta": harness.meta, "goals": goals, "results": results},
                                                    indent=1, default=str))
    print(f"\nwrote {stem}.md and {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
