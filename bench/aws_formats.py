"""``python -m bench.aws_formats``: shards and Parquet on the AWS-shaped endpoint next to the lab
path, both backends, with the peers of each format in the same run.

The endpoints are ``bench.aws``'s (``lab_and_aws``): the lab path (plain ``http``, path-style,
+20 ms to first byte) and the AWS-shaped one (``https`` with a private CA, +20 ms, ~90 MB/s per
connection, SlowDown beyond S3's per-prefix rate closing the connection; virtual-hosted for the
clients that resolve names in Python: this package's default backend and boto3 under webdataset;
path-style at ``https://127.0.0.1`` for obstore, LitData's obstore and pyarrow's AWS SDK, which
resolve names themselves). The same N ~110 KiB JPEGs, stored three ways:

- WebDataset tar shards (``--shards`` of them): ``AsyncS3Dataset.from_shards`` (both backends,
  ``shuffle=True``: its shuffle buffer of 1,000), webdataset's tar expander over boto3 streaming
  bodies with ``wds.shuffle(1000)``;
- LitData's ``optimize()`` chunks of the same size as a shard, read by its ``StreamingDataset``
  (``shuffle=True``) from the same server;
- Parquet files (as many as shards, row groups of 100 rows, an ``image`` struct column as the
  Hub's): ``AsyncS3Dataset.from_parquet`` (both backends, ``shuffle=True``) and ``pyarrow.dataset``
  over pyarrow's ``S3FileSystem`` (each DataLoader worker every n-th file).

Each run: a fresh process, one warm-up and one timed epoch, batch 32, ``num_workers`` w, the image
bytes of each sample handed through; client CPU of the process and its workers over the timed
epoch. Runs alternate in rounds (the order flips every round); medians. Writes
``bench/results/aws-formats-<date>.md``/``.json`` (``--suffix`` appended).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from .aws import _ENV_DROP, BUCKET, _median, _span, _thread_cpu, endpoint_for, lab_and_aws, run_child
from .harness import REPO, RESULTS_DIR, load_faults_module

FORMATS = {  # loader -> (format, what it is)
    "ours-shard-aioboto3": ("shards", "AsyncS3Dataset.from_shards, aioboto3 (default backend)"),
    "ours-shard-obstore": ("shards", "AsyncS3Dataset.from_shards, obstore"),
    "wds": ("shards", "webdataset tar expander over boto3 streaming bodies"),
    "litdata-opt": ("shards", "LitData StreamingDataset over its optimize() chunks"),
    "ours-parquet-aioboto3": ("parquet", "AsyncS3Dataset.from_parquet, aioboto3 (default backend)"),
    "ours-parquet-aioboto3-ungated": ("parquet", "the same, its ranged GETs not gated (s3/request_gate.py): "
                                      "what the Parquet reader did before the gate"),
    "ours-parquet-obstore": ("parquet", "AsyncS3Dataset.from_parquet, obstore"),
    "pyarrow": ("parquet", "pyarrow.dataset over pyarrow's S3FileSystem"),
}
DEFAULT = {"shards": "ours-shard-aioboto3", "parquet": "ours-parquet-aioboto3"}
LITDATA_PREFIX = "litdata/"
PARQUET_PREFIX = "parquet/"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.aws_formats", description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=2000)
    p.add_argument("--shards", type=int, default=8, help="tar shards, LitData chunks and Parquet files")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", default="0,2")
    p.add_argument("--loaders", default=",".join(FORMATS))
    p.add_argument("--get-rate", type=float, default=5500.0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--suffix", default="")
    return p


def _litdata_item(path: str) -> dict[str, Any]:
    """One sample for LitData's ``optimize``: the JPEG's bytes and a class id, as in the shards."""
    return {"jpg": Path(path).read_bytes(), "cls": len(Path(path).name) % 10}


def litdata_chunks(samples: dict[str, bytes], chunk_bytes: int, where: Path) -> dict[str, bytes]:
    """The samples through LitData's ``optimize()`` (chunks of ``chunk_bytes``): its files by key."""
    from litdata import optimize

    raw = where / "raw"
    raw.mkdir(parents=True)
    paths = []
    for key, body in sorted(samples.items()):
        path = raw / key.replace("/", "_")
        path.write_bytes(body)
        paths.append(str(path))
    out = where / "optimized"
    with contextlib.redirect_stdout(io.StringIO()):
        optimize(fn=_litdata_item, inputs=paths, output_dir=str(out), chunk_bytes=chunk_bytes, num_workers=1,
                 reorder_files=False, start_method="fork")
    return {LITDATA_PREFIX + path.name: path.read_bytes() for path in sorted(out.iterdir()) if path.is_file()}


def parquet_files(samples: dict[str, bytes], files: int) -> dict[str, bytes]:
    """The samples in ``files`` Parquet files of 100-row groups (``image: struct<bytes, path>``, ``label``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys = sorted(samples)
    per = -(-len(keys) // files)
    out = {}
    for number in range(files):
        chunk = keys[number * per:(number + 1) * per]
        table = pa.table({"image": [{"bytes": samples[key], "path": key} for key in chunk],
                          "label": pa.array([len(key) % 10 for key in chunk], pa.int64())})
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=100)
        out[f"{PARQUET_PREFIX}train-{number:05d}.parquet"] = sink.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    loaders = [name.strip() for name in args.loaders.split(",") if name.strip()]
    faults = load_faults_module()
    results: dict[str, list[dict[str, Any]]] = {}
    sizes: dict[str, int] = {}

    def derive(samples: dict[str, bytes]) -> dict[str, bytes]:
        from .data import make_shards

        shards = make_shards(samples, args.shards)
        chunk = max(len(body) for body in shards.values())
        made = {**shards, **parquet_files(samples, args.shards),
                **litdata_chunks(samples, chunk, tmp / "litdata")}
        sizes.update({"shards": sum(len(b) for k, b in shards.items()),
                      "parquet": sum(len(b) for k, b in made.items() if k.startswith(PARQUET_PREFIX)),
                      "litdata": sum(len(b) for k, b in made.items() if k.startswith(LITDATA_PREFIX))})
        keys["shards"] = sorted(shards)
        keys["parquet"] = sorted(k for k in made if k.startswith(PARQUET_PREFIX))
        return made

    keys: dict[str, list[str]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="loader-aws-formats-")))
        aws_plan = faults.FaultPlan(latency=0.02, bandwidth=90e6, get_rate=args.get_rate, slowdown_close=True)
        server, _, pki, lab, aws = lab_and_aws(stack, tmp, BUCKET, args.objects, aws_plan, derive)
        ports = {"lab": lab.port, "aws": aws.port}
        env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP}
        config = server.config
        env.update(AWS_ACCESS_KEY_ID=config.access_key_id, AWS_SECRET_ACCESS_KEY=config.secret_access_key,
                   AWS_REGION=config.region, AWS_DEFAULT_REGION=config.region)
        runs = [(loader, shape, w) for loader in loaders for shape in ("lab", "aws") for w in workers]
        for round_ in range(args.rounds):
            for loader, shape, w in (runs if round_ % 2 == 0 else list(reversed(runs))):
                where = endpoint_for(loader, shape, ports, pki["ca"], config.region)
                child_env = dict(env, AWS_ENDPOINT_URL=where["config"]["endpoint_url"])
                if shape == "aws":
                    child_env.update(AWS_CA_BUNDLE=pki["ca"], SSL_CERT_FILE=pki["ca"])
                fmt = FORMATS[loader][0]
                spec = dict(loader=loader, bucket=BUCKET, workers=w, config=where["config"], domain=where["domain"],
                            keys=[LITDATA_PREFIX] if loader == "litdata-opt" else keys[fmt],
                            cache_bytes=sizes["litdata"] // 2)
                aws.reset_counts()
                lab.reset_counts()
                proxy = aws if shape == "aws" else lab
                before_cpu = _thread_cpu(proxy)
                accepted = proxy.accepted  # counted since the proxy started: not reset with its counts
                out = run_child(REPO, spec, child_env)
                out["connections"] = proxy.accepted - accepted
                out["requests"] = proxy.counts["requests"]
                out["slowdowns"] = aws.counts["slowdown"] if shape == "aws" else 0
                if out.get("samples"):
                    out["proxy_cpu"] = (_thread_cpu(proxy) - before_cpu) / (2 * out["samples"])
                results.setdefault(f"{loader}|{shape}|{w}", []).append(out)
                rate = out["samples"] / out["seconds"] if out.get("samples") else float("nan")
                cpu = out["cpu"] / out["samples"] * 1e6 if out.get("samples") else float("nan")
                print(f"round {round_} {loader:<22} {shape:<4} w={w} {rate:8.0f}/s {cpu:7.0f} us/sample "
                      f"{out.get('samples', 0)} samples {out['requests']} requests {out['connections']} connections"
                      + (f"  {out['error']}" if "error" in out else ""), flush=True)
    return report(args, loaders, workers, results, sizes)


def report(args: argparse.Namespace, loaders: list[str], workers: list[int],
           results: dict[str, list[dict[str, Any]]], sizes: dict[str, int]) -> int:
    per_sample = {"shards": sizes.get("shards", 0), "parquet": sizes.get("parquet", 0)}
    lines = ["| loader | format | endpoint | w | samples/s (median) | range | MB/s | client CPU µs/sample | "
             "vs its lab rate | vs its lab CPU |", "|---|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for loader in loaders:
        fmt = FORMATS[loader][0]
        for w in workers:
            for shape in ("lab", "aws"):
                runs = results.get(f"{loader}|{shape}|{w}", [])
                rate, cpu = _median(runs, "rate"), _median(runs, "cpu")
                lab_rate = _median(results.get(f"{loader}|lab|{w}", []), "rate")
                lab_cpu = _median(results.get(f"{loader}|lab|{w}", []), "cpu")
                if rate is None or cpu is None:
                    errors = "; ".join(sorted({r["error"].split(":", 1)[0] for r in runs if "error" in r}))
                    lines.append(f"| {loader} | {fmt} | {shape} | {w} | - | - | - | - | {errors or '-'} | - |")
                    continue
                size = (sizes["litdata"] if loader == "litdata-opt" else per_sample[fmt]) / args.objects
                vs_rate = f"{rate / lab_rate:.2f}x" if shape == "aws" and lab_rate else ""
                vs_cpu = f"{cpu / lab_cpu:.2f}x" if shape == "aws" and lab_cpu else ""
                lines.append(f"| {loader} | {fmt} | {shape} | {w} | {rate:,.0f} | {_span(runs)} | "
                             f"{rate * size / 1e6:,.0f} | {cpu:,.0f} | {vs_rate} | {vs_cpu} |")
    ratios = ["", "| ours against | format | endpoint | w | ratio of medians (rate) | CPU per sample, ours / theirs |",
              "|---|---|---|--:|--:|--:|"]
    for loader in loaders:
        fmt = FORMATS[loader][0]
        if loader == DEFAULT[fmt]:
            continue
        for shape in ("lab", "aws"):
            for w in workers:
                mine = results.get(f"{DEFAULT[fmt]}|{shape}|{w}", [])
                theirs = results.get(f"{loader}|{shape}|{w}", [])
                rates = _median(mine, "rate"), _median(theirs, "rate")
                cpus = _median(mine, "cpu"), _median(theirs, "cpu")
                if rates[0] and rates[1] and cpus[0] and cpus[1]:
                    ratios.append(f"| {loader} | {fmt} | {shape} | {w} | {rates[0] / rates[1]:.2f}x | "
                                  f"{cpus[0] / cpus[1]:.2f}x |")
    for loader in loaders:  # a variant of ours against it, round by round (the same minutes)
        if loader.endswith("-ungated") and loader.removesuffix("-ungated") in loaders:
            ratios += ["", f"| {loader.removesuffix('-ungated')} / {loader}, per round | endpoint | w | "
                       "rate | median |", "|---|---|--:|---|--:|"]
            for shape in ("lab", "aws"):
                for w in workers:
                    pairs = zip(results.get(f"{loader.removesuffix('-ungated')}|{shape}|{w}", []),
                                results.get(f"{loader}|{shape}|{w}", []))
                    each = [a["samples"] / a["seconds"] / (b["samples"] / b["seconds"]) for a, b in pairs
                            if a.get("samples") and b.get("samples")]
                    if each:
                        ratios.append(f"| | {shape} | {w} | {', '.join(f'{r:.2f}' for r in each)} | "
                                      f"{statistics.median(each):.2f}x |")
    made = ["", "| requests and connections the proxy took, both epochs (median) | endpoint | w | requests | "
            "connections | SlowDown |", "|---|---|--:|--:|--:|--:|"]
    for loader in loaders:
        for shape in ("lab", "aws"):
            for w in workers:
                runs = results.get(f"{loader}|{shape}|{w}", [])
                if runs:
                    made.append(f"| {loader} | {shape} | {w} | {statistics.median(r['requests'] for r in runs):,.0f}"
                                f" | {statistics.median(r['connections'] for r in runs):,.0f}"
                                f" | {statistics.median(r['slowdowns'] for r in runs):,.0f} |")
    table = "\n".join(lines + ratios + made) + "\n"
    print()
    print(table)
    stamp = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"aws-formats-{stamp}{args.suffix}.md"
    described = "\n".join(f"- `{name}`: {FORMATS[name][1]}" for name in loaders)
    path.write_text(
        f"# Shards and Parquet on an AWS-shaped endpoint and on the lab path, {stamp}\n\n"
        f"`python -m bench.aws_formats --objects {args.objects} --shards {args.shards} --rounds {args.rounds} "
        f"--workers {args.workers} --get-rate {args.get_rate:g}`: see the module's docstring.\n\n{described}\n\n"
        f"Sizes: shards {sizes.get('shards', 0) / 1e6:,.0f} MB, LitData chunks {sizes.get('litdata', 0) / 1e6:,.0f} MB, "
        f"Parquet {sizes.get('parquet', 0) / 1e6:,.0f} MB in all.\n\n" + table)
    (args.out / f"aws-formats-{stamp}{args.suffix}.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
