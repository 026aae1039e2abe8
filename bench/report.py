"""Turn results into ``results.md`` (tables + goals), ``results.json`` and ``chart.png``."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .loaders import LOADERS

PEERS = ("s3tc-map", "s3tc-iter", "wds")
S3TC = ("s3tc-map", "s3tc-iter")


def ok(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if not r.get("error") and r.get("samples_per_s")]


def best(results: list[dict[str, Any]], loaders: str | Iterable[str], workload: str, latency_ms: int,
         workers: int | None = None, min_workers: int = 0) -> dict[str, Any] | None:
    """The fastest successful run among ``loaders`` for this workload/latency (any or given workers)."""
    names = (loaders,) if isinstance(loaders, str) else tuple(loaders)
    pool = [r for r in ok(results) if r["loader"] in names and r["workload"] == workload
            and (r["latency_ms"] == latency_ms or LOADERS[r["loader"]].mode == "memory")
            and (workers is None or r["workers"] == workers) and r["workers"] >= min_workers]
    return max(pool, key=lambda r: r["samples_per_s"], default=None)


@dataclasses.dataclass
class Goal:
    text: str
    target: str
    measured: str
    status: str  # "met", "missed" or "n/a"
    detail: str = ""


def _where(r: dict[str, Any] | None) -> str:
    if r is None:
        return "–"
    return f"{r['loader']} w={r['workers']}: {r['samples_per_s']:,.0f}/s"


def _ratio_goal(text: str, ours: dict[str, Any] | None, ref: dict[str, Any] | None, target: float,
                percent: bool = False) -> Goal:
    goal_text = f"≥{target:.0%}" if percent else f"≥{target:g}×"
    if ours is None or ref is None:
        return Goal(text, goal_text, "–", "n/a", "not measured (or failed)")
    ratio = ours["samples_per_s"] / ref["samples_per_s"]
    shown = f"{ratio:.1%}" if percent else f"{ratio:.2f}×"
    return Goal(text, goal_text, shown, "met" if ratio >= target else "missed",
                f"{_where(ours)} vs {_where(ref)}{_noise(ours, ref)}")


NOISY_CORES = 0.5


def _noise(*runs: dict[str, Any]) -> str:
    """A warning when other people's jobs took a sizeable share of the CPUs during a run."""
    loads = [r.get("other_cores") or 0.0 for r in runs]
    if max(loads) < NOISY_CORES:
        return ""
    return " ⚠ noisy: other load " + " / ".join(f"{x:.1f}" for x in loads) + " cores"


def goals(results: list[dict[str, Any]]) -> list[Goal]:
    out: list[Goal] = []
    peer_raw = best(results, PEERS, "raw", 0)
    # the raw ceiling is the DataLoader moving bytes out of workers: with w=0 nothing moves at all
    ceiling_raw = best(results, "ceiling", "raw", 0, min_workers=1) or best(results, "ceiling", "raw", 0)
    ceiling_decode = best(results, "ceiling", "decode", 0)
    s3tc_raw = best(results, S3TC, "raw", 0)
    for backend in ("aioboto3", "obstore"):
        shard = best(results, f"ours-shard-{backend}", "raw", 0)
        out.append(_ratio_goal(f"shard raw 0 ms ({backend}) vs best peer", shard, peer_raw, 1.2))
        out.append(_ratio_goal(f"shard raw 0 ms ({backend}) vs DataLoader raw ceiling", shard, ceiling_raw,
                               0.9, percent=True))
    out.append(_ratio_goal("per-object raw 0 ms obstore vs best s3torchconnector",
                           best(results, "ours-obj-obstore", "raw", 0), s3tc_raw, 1.2))
    out.append(_ratio_goal("per-object raw 0 ms aioboto3 vs best s3torchconnector",
                           best(results, "ours-obj-aioboto3", "raw", 0), s3tc_raw, 0.6))
    s3tc_map_20 = best(results, "s3tc-map", "raw", 20, workers=2)
    out.append(_ratio_goal("per-object raw 20 ms w=2, best backend vs s3torchconnector map w=2",
                           best(results, ("ours-obj-obstore", "ours-obj-aioboto3"), "raw", 20, workers=2),
                           s3tc_map_20, 15))
    for backend in ("obstore", "aioboto3"):
        out.append(_ratio_goal(f"per-object raw 20 ms w=2 ({backend}) vs s3torchconnector map w=2",
                               best(results, f"ours-obj-{backend}", "raw", 20, workers=2), s3tc_map_20, 10))
    for backend in ("aioboto3", "obstore"):
        out.append(_ratio_goal(f"shard decode 0 ms ({backend}) vs decode ceiling",
                               best(results, f"ours-shard-{backend}", "decode", 0), ceiling_decode, 0.95,
                               percent=True))
    for backend, limit in (("obstore", 250), ("aioboto3", 700)):
        text = f"client CPU per sample, per-object raw 0 ms, {backend} (w=0)"
        row = best(results, f"ours-obj-{backend}", "raw", 0, workers=0)
        fastest = best(results, f"ours-obj-{backend}", "raw", 0)
        if row is None or row.get("client_us") is None:
            out.append(Goal(text, f"≤{limit} µs", "–", "n/a", "not measured (or failed)"))
            continue
        detail = f"at w=0 ({row['samples_per_s']:,.0f}/s){_noise(row)}"
        if fastest is not None and fastest is not row and fastest.get("client_us") is not None:
            detail += (f"; at the fastest setting w={fastest['workers']}: {fastest['client_us']:.0f} µs "
                       "incl. DataLoader worker hand-off")
        out.append(Goal(text, f"≤{limit} µs", f"{row['client_us']:.0f} µs",
                        "met" if row["client_us"] <= limit else "missed", detail))
    return out


# ----------------------------------------------------------------------------- markdown


def _fmt(value: Any, spec: str = ",.0f", dash: str = "–") -> str:
    return dash if value is None else format(value, spec)


def _ttfb(r: dict[str, Any]) -> str:
    return "RAM" if LOADERS[r["loader"]].mode == "memory" else f"+{r['latency_ms']} ms"


def _sort_key(r: dict[str, Any]) -> tuple:
    order = list(LOADERS)
    return (r["workload"] != "raw", r["latency_ms"], order.index(r["loader"]), r["workers"])


def results_table(results: list[dict[str, Any]]) -> str:
    lines = ["| loader | workload | TTFB | w | samples/s | MB/s | client µs/sample | server µs/sample "
             "| proxy µs/sample | other load (cores) | note |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in sorted(results, key=_sort_key):
        if r.get("error"):
            lines.append(f"| {r['loader']} | {r['workload']} | {_ttfb(r)} | {r['workers']} | error | | | | | "
                         f"| {r['error'].replace('|', '/')} |")
            continue
        note = r.get("note") or ""
        if r.get("complete_epochs", 0) < len(r.get("rates", [])):
            note = (note + "; " if note else "") + f"capped epochs ({r['samples_timed']} samples timed)"
        lines.append(
            f"| {r['loader']} | {r['workload']} | {_ttfb(r)} | {r['workers']} | {r['samples_per_s']:,.0f} | "
            f"{r['mb_per_s']:,.0f} | {_fmt(r.get('client_us'))} | {_fmt(r.get('server_us'))} | "
            f"{_fmt(r.get('proxy_us'))} | {_fmt(r.get('other_cores'), '.2f')} | {note} |")
    return "\n".join(lines)


def best_table(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    conditions = [(w, lat) for w in meta.get("workloads", ("raw", "decode"))
                  for lat in (round(x * 1000) for x in meta.get("latencies", (0, 0.02)))]
    head = " | ".join(f"{w} +{lat} ms" for w, lat in conditions)
    lines = [f"| loader | {head} |", "|---|" + "--:|" * len(conditions)]
    present = {r["loader"] for r in results}
    for name in LOADERS:
        if name not in present:
            continue
        cells = []
        for workload, lat in conditions:
            r = best(results, name, workload, lat)
            if name == "ceiling":  # as in goals(): the w=0 "ceiling" moves nothing between processes
                r = best(results, name, workload, lat, min_workers=1) or r
            if LOADERS[name].mode == "memory" and lat != 0:
                cells.append("")
            elif r is None:
                errors = [x for x in results if x["loader"] == name and x["workload"] == workload
                          and x["latency_ms"] == lat and x.get("error")]
                cells.append("error" if errors else "–")
            else:
                cells.append(f"{r['samples_per_s']:,.0f} (w={r['workers']})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals_table(items: list[Goal]) -> str:
    mark = {"met": "✅ met", "missed": "❌ missed", "n/a": "– n/a"}
    lines = ["| goal | target | measured | status | detail |", "|---|---|--:|---|---|"]
    for g in items:
        lines.append(f"| {g.text} | {g.target} | {g.measured} | {mark[g.status]} | {g.detail} |")
    return "\n".join(lines)


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    items = goals(results)
    met = sum(g.status == "met" for g in items)
    measured = sum(g.status != "n/a" for g in items)
    legend = "\n".join(f"- `{name}`: {loader.label}" for name, loader in LOADERS.items()
                       if any(r["loader"] == name for r in results))
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
    load = ", ".join(f"{x:.1f}" for x in meta.get("load_avg", ()))
    return f"""# Benchmark results

{meta.get('started', '')} — {'quick' if meta.get('quick') else 'full'} run, {meta.get('total_seconds', 0):.0f} s.
{meta.get('samples')} synthetic 512×512 JPEGs ({meta.get('mean_kib', 0):.0f} KiB mean) as objects, and the same
samples in {meta.get('shards')} WebDataset tar shards ({meta.get('shard_mb', 0):.1f} MB each), on the embedded
SeaweedFS {meta.get('seaweedfs')} server on 127.0.0.1. The decode workload reads a copy of the first
{meta.get('decode_samples')} samples (objects, and {meta.get('shards')} shards of {meta.get('decode_shard_mb', 0):.1f} MB), so
that its full epochs stay short. "+20 ms" = through `integration/faults/`'s
`FaultProxy(FaultPlan(latency=0.02))` (20 ms before each request is forwarded; the proxy runs in the
harness process, its CPU is the "proxy" column).

DataLoader(batch_size=32, num_workers=w, prefetch_factor=2 if w else None, persistent_workers=w>0), empty
training step, one warm-up epoch (capped at {meta.get('warmup_seconds')} s), then the median of
{meta.get('epochs')} timed epochs. Epochs of the peers and the ceiling are capped at {meta.get('epoch_seconds')} s (a loader doing 40
samples/s is measured on what it delivered by then; it reads ahead only prefetch_factor × workers
batches, so a cap wastes nothing); this project's loaders always run full epochs, because they read
ahead up to 1,024 samples and a capped epoch would throw that work away. "raw" = the JPEG bytes handed
through; "decode" = PIL decode → RGB → resize 224×224 → uint8 CHW tensor, the same function for every
loader.

**{meta.get('cpus')} CPUs shared by client, server and proxy (load average at start: {load}); other
people's jobs may run on this machine at the same time ("other load" = cores busy with processes that
are not ours during the run; ⚠ marks goals where it exceeded {NOISY_CORES} cores). Compare ratios within
this run, never absolute numbers.**

Versions: Python {meta.get('python')}, {versions}.

## Goals ({met} of {measured} measured met; {len(items) - measured} of {len(items)} not measured in this run)

{goals_table(items)}

## Best worker count per loader (samples/s)

{best_table(results, meta)}

## All runs

Client CPU = the process that iterates plus its DataLoader workers (psutil, user+system), per delivered
sample; server CPU = the `weed` process; proxy = the harness process that runs the latency proxy.
MB/s counts JPEG payload bytes.

{results_table(results)}

Loaders:
{legend}
"""


# ----------------------------------------------------------------------------- chart


def chart(results: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = meta.get("workloads", ["raw", "decode"])
    latencies = [round(x * 1000) for x in meta.get("latencies", [0, 0.02])]
    workers = sorted(meta.get("workers", [0, 2, 4]))
    names = [n for n in LOADERS if n != "ceiling" and any(r["loader"] == n for r in results)]
    fig, axes = plt.subplots(len(workloads), len(latencies), figsize=(6.5 * len(latencies), 4.2 * len(workloads)),
                             squeeze=False)
    width = 0.8 / max(1, len(workers))
    for i, workload in enumerate(workloads):
        # as in goals(): with w=0 no bytes cross a process boundary, so that is no ceiling
        ceiling = best(results, "ceiling", workload, 0, min_workers=1) or best(results, "ceiling", workload, 0)
        for j, lat in enumerate(latencies):
            ax = axes[i][j]
            for k, w in enumerate(workers):
                values = []
                for n in names:
                    r = best(results, n, workload, lat, workers=w)
                    values.append(r["samples_per_s"] if r else 0.0)
                xs = [x + (k - (len(workers) - 1) / 2) * width for x in range(len(names))]
                ax.bar(xs, values, width, label=f"w={w}")
            if ceiling is not None:
                ax.axhline(ceiling["samples_per_s"], color="black", linestyle="--", linewidth=1,
                           label="in-memory ceiling (best w>0)")
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
            where = (f"; ceiling {ceiling['samples_per_s']:,.0f}/s at w={ceiling['workers']}"
                     if ceiling is not None else "")
            ax.set_title(f"{workload}, +{lat} ms to first byte{where}", fontsize=10)
            ax.set_ylabel("samples/s" + (" (log)" if lat > 0 else ""))
            if lat > 0:
                ax.set_yscale("log")
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"samples/s, {meta.get('samples')} JPEGs ~{meta.get('mean_kib', 0):.0f} KiB, batch 32 "
                 f"({meta.get('cpus')} CPUs shared with the server: ratios only)", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def write_all(results: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"md": out_dir / "results.md", "json": out_dir / "results.json", "png": out_dir / "chart.png"}
    _atomic_text(paths["md"], markdown(results, meta))
    _atomic_text(paths["json"], json.dumps({"meta": meta, "goals": [dataclasses.asdict(g) for g in goals(results)],
                                            "results": results}, indent=1))
    try:
        partial = paths["png"].with_name(paths["png"].name + ".tmp")
        chart(results, meta, partial)
        os.replace(partial, paths["png"])
    except ImportError as exc:  # matplotlib is in the bench extra; the tables still stand
        paths.pop("png")
        print(f"no chart: {exc} (pip install matplotlib)")
    return paths


def _atomic_text(path: Path, text: str) -> None:
    """Write ``path`` through ``path.tmp`` and a rename: a reader never sees half a report."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    os.replace(partial, path)
