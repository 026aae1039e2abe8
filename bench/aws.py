"""``python -m bench.aws``: per object on an AWS-shaped endpoint next to the lab path, with peers.

The lab path is what the other benchmarks measure: plain ``http``, path-style, 127.0.0.1, +20 ms
to first byte (``integration/faults``' ``FaultProxy``). The AWS-shaped endpoint is the path AWS
users take: ``https`` with a private CA (``trustme``), virtual-hosted addressing
(``<bucket>.s3.lab.test``: the embedded SeaweedFS with ``-s3.domainName``), +20 ms to first byte,
~90 MB/s per connection, and GETs beyond S3's per-prefix rate (5,500/s) answered ``503 SlowDown``
with ``Connection: close`` as S3 answers it (the next request pays a new TLS handshake);
``--slowdown P`` answers a share P of all GETs so too, whatever the rate (not S3's shape: its
throttle follows the rate). The lab names resolve to 127.0.0.1 in
the measuring process and its forked workers (``bench/aws_child.py``): that reaches this package
and botocore; obstore (LitData's client too) and the AWS CRT (s3torchconnector) resolve names
themselves, so they read the same proxy path-style at ``https://127.0.0.1``.

Loaders, each run one warm-up and one timed epoch of N ~110 KiB JPEGs, batch 32, in a fresh
process: this tree's ``AsyncS3Dataset.from_keys`` with both backends (``Limits(concurrency=64)``),
the same with the ``--before`` revision's package (both backends: on the lab path, the check that
nothing regressed), LitData's
``StreamingRawDataset`` and s3torchconnector's ``S3MapDataset`` (its epochs capped at
``--peer-cap`` samples: it reads one object per worker at a time). Runs alternate in rounds (the
order flips every round); medians. Writes ``bench/results/aws-<date>.md``/``.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .harness import REPO, RESULTS_DIR, load_faults_module

DOMAIN = "s3.lab.test"
BUCKET = "awsbench"
CHILD = (Path(__file__).resolve().parent / "aws_child.py").read_text()
# the loaders whose clients resolve names in Python (this package's default backend, boto3):
# virtual-hosted on the AWS-shaped endpoint; the others read it path-style at https://127.0.0.1
VIRTUAL_HOSTED = ("ours-aioboto3", "before-aioboto3", "ours-shard-aioboto3", "ours-parquet-aioboto3",
                  "ours-parquet-aioboto3-ungated", "wds")
_ENV_DROP = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "S3_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN",
             "AWS_DEFAULT_PROFILE", "MINIO_ENDPOINT", "MINIO_ACCESS_KEY", "MINIO_SECRET_KEY", "MINIO_SECURE",
             "LOADER_STORE", "AWS_CA_BUNDLE", "PYTHONPATH", "HTTPS_PROXY", "HTTP_PROXY", "https_proxy",
             "http_proxy")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.aws", description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", default="0,2", help="DataLoader workers, comma-separated (default 0,2)")
    p.add_argument("--loaders",
                   default="ours-aioboto3,ours-obstore,before-aioboto3,before-obstore,litdata,s3tc-map")
    p.add_argument("--before", default="1e9950c", help="the revision whose package is 'before'")
    p.add_argument("--after", default=".", help="the revision measured as 'ours' (default: this checkout as it is)")
    p.add_argument("--peer-cap", type=int, default=320, help="samples per epoch of s3torchconnector")
    p.add_argument("--get-rate", type=float, default=5500.0, help="GETs/s before SlowDown (S3's per prefix)")
    p.add_argument("--slowdown", type=float, default=0.0, help="a share of GETs answered SlowDown regardless")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--suffix", default="", help="appended to the result files' names")
    p.add_argument("--profile", default=None,
                   help="write each run's timed epoch as sampled stacks (one line per stack and its count, "
                        "every thread of the measuring process, every 1 ms) to files starting with this path")
    return p


def endpoint_for(loader: str, shape: str, ports: dict[str, int], ca: str, region: str) -> dict[str, Any]:
    """The config a loader gets on ``shape`` ("lab" or "aws"), and the domain to resolve."""
    if shape == "lab":
        return {"config": {"endpoint_url": f"http://127.0.0.1:{ports['lab']}", "region": region}, "domain": None}
    if loader in VIRTUAL_HOSTED:  # resolves in Python: the lab's names
        return {"config": {"endpoint_url": f"https://{DOMAIN}:{ports['aws']}", "region": region,
                           "addressing_style": "virtual", "verify": ca}, "domain": DOMAIN}
    return {"config": {"endpoint_url": f"https://127.0.0.1:{ports['aws']}", "region": region, "verify": ca},
            "domain": None}


def lab_and_aws(stack: contextlib.ExitStack, tmp: Path, bucket: str, objects: int,
                aws_plan: Any, derive: Callable[[dict[str, bytes]], dict[str, bytes]] | None = None,
                ) -> tuple[Any, list[str], dict[str, str], Any, Any]:
    """The two endpoints the AWS-shaped benchmarks compare, over one SeaweedFS server holding
    ``objects`` photo-like samples in ``bucket`` (and what ``derive`` makes of them: shards, files):
    the lab path (plain http, +20 ms) and the
    AWS-shaped one (``aws_plan`` behind TLS with the lab's private CA, names under ``DOMAIN``).
    Returns ``(server, keys, pki, lab proxy, aws proxy)``; ``stack`` closes them."""
    from loader.tools.devserver import DevServer

    from .data import make_samples

    faults = load_faults_module()
    pki = faults.lab_certificates(tmp, DOMAIN)
    server = stack.enter_context(DevServer(data_dir=tmp / "data", buckets=[bucket], domain=DOMAIN))
    client = server.client()
    samples = make_samples(objects)
    for key, body in {**samples, **(derive(samples) if derive else {})}.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(pki["cert"], pki["key"])
    lab = stack.enter_context(faults.FaultProxy(server.endpoint_url, faults.FaultPlan(latency=0.02),
                                                max_lifetime=4 * 3600))
    aws = stack.enter_context(faults.FaultProxy(server.endpoint_url, aws_plan, max_lifetime=4 * 3600, tls=tls))
    return server, sorted(samples), pki, lab, aws


def run_child(tree: Path, spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(spec), cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    loaders = [name.strip() for name in args.loaders.split(",") if name.strip()]
    faults = load_faults_module()


    results: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="loader-aws-")))
        before = tmp / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=REPO, check=True,
                       capture_output=True)
        stack.callback(subprocess.run, ["git", "worktree", "remove", "--force", str(before)], cwd=REPO,
                       capture_output=True)
        after = REPO
        if args.after != ".":  # a committed revision: edits to this checkout during the run do not leak in
            after = tmp / "after"
            subprocess.run(["git", "worktree", "add", "--detach", str(after), args.after], cwd=REPO, check=True,
                           capture_output=True)
            stack.callback(subprocess.run, ["git", "worktree", "remove", "--force", str(after)], cwd=REPO,
                           capture_output=True)
        aws_plan = faults.FaultPlan(latency=0.02, bandwidth=90e6, slowdown=args.slowdown, get_rate=args.get_rate,
                                    slowdown_close=True)
        server, keys, pki, lab, aws = lab_and_aws(stack, tmp, BUCKET, args.objects, aws_plan)
        ports = {"lab": lab.port, "aws": aws.port}
        env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP}
        config = server.config
        env.update(AWS_ACCESS_KEY_ID=config.access_key_id, AWS_SECRET_ACCESS_KEY=config.secret_access_key,
                   AWS_REGION=config.region, AWS_DEFAULT_REGION=config.region)
        runs = [(loader, shape, w) for loader in loaders for shape in ("lab", "aws") for w in workers
                if not (loader == "before-obstore" and shape == "aws")]  # the regression check: lab only
        for round_ in range(args.rounds):
            for loader, shape, w in (runs if round_ % 2 == 0 else list(reversed(runs))):
                where = endpoint_for(loader, shape, ports, pki["ca"], config.region)
                child_env = dict(env)
                # the peers' own clients read the endpoint and the CA from the environment
                child_env.update(AWS_ENDPOINT_URL=where["config"]["endpoint_url"])
                if shape == "aws":
                    child_env.update(AWS_CA_BUNDLE=pki["ca"], SSL_CERT_FILE=pki["ca"])
                spec = dict(loader=loader.replace("before-", "ours-"), bucket=BUCKET, keys=keys, workers=w,
                            config=where["config"], domain=where["domain"],
                            limit=args.peer_cap if loader == "s3tc-map" else None, profile=args.profile)
                tree = before if loader.startswith("before-") else after
                aws.reset_counts()
                lab.reset_counts()
                proxy = aws if shape == "aws" else lab
                before_cpu, server_before = _thread_cpu(proxy), _process_cpu(server.pid)
                accepted = proxy.accepted  # counted since the proxy started: not reset with its counts
                out = run_child(tree, spec, child_env)
                if "samples" in out:  # the server's CPU (weed) per sample, both epochs
                    out["server_cpu"] = (_process_cpu(server.pid) - server_before) / (2 * out["samples"])
                out["slowdowns"] = aws.counts["slowdown"] if shape == "aws" else 0
                # connections the proxy accepted over both epochs (on aws a TLS handshake each)
                out["connections"] = proxy.accepted - accepted
                # the proxy's own CPU (a thread of this process: TLS, pacing) per sample read through
                # it, both epochs: near a core's worth at the rate measured, the proxy was the bound
                if "samples" in out:
                    out["proxy_cpu"] = (_thread_cpu(proxy) - before_cpu) / (2 * out["samples"])
                results.setdefault(f"{loader}|{shape}|{w}", []).append(out)
                rate = out["samples"] / out["seconds"] if "samples" in out else float("nan")
                cpu = out["cpu"] / out["samples"] * 1e6 if "samples" in out else float("nan")
                proxy_us = out.get("proxy_cpu", float("nan")) * 1e6
                print(f"round {round_} {loader:<16} {shape:<4} w={w} {rate:8.0f}/s {cpu:7.0f} us/sample"
                      f"  proxy {proxy_us:5.0f} us/sample ({proxy_us * rate / 1e6:.0%} of a core)"
                      f"  {out['connections']} connections"
                      + (f"  {out['error']}" if "error" in out else ""), flush=True)
    return report(args, loaders, workers, results)


def _thread_cpu(proxy: Any) -> float:
    """CPU seconds of the proxy's thread so far."""
    import psutil

    native = proxy._thread.native_id
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == native)


def _process_cpu(pid: int | None) -> float:
    """CPU seconds of process ``pid`` so far (0 when it is gone)."""
    import psutil

    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.Error, ValueError):
        return 0.0
    return times.user + times.system


def _median(runs: list[dict[str, Any]], what: str) -> float | None:
    good = [r for r in runs if "samples" in r and r["samples"]]
    if not good:
        return None
    if what == "rate":
        return statistics.median(r["samples"] / r["seconds"] for r in good)
    return statistics.median(r["cpu"] / r["samples"] * 1e6 for r in good)


def _span(runs: list[dict[str, Any]]) -> str:
    rates = sorted(r["samples"] / r["seconds"] for r in runs if "samples" in r and r["samples"])
    return f"{rates[0]:,.0f}-{rates[-1]:,.0f}" if rates else "-"


def report(args: argparse.Namespace, loaders: list[str], workers: list[int],
           results: dict[str, list[dict[str, Any]]]) -> int:
    lines = ["| loader | endpoint | w | samples/s (median) | range | client CPU µs/sample | vs its lab rate | "
             "vs its lab CPU |", "|---|---|--:|--:|--:|--:|--:|--:|"]
    for loader in loaders:
        for w in workers:
            for shape in ("lab", "aws"):
                runs = results.get(f"{loader}|{shape}|{w}", [])
                rate, cpu = _median(runs, "rate"), _median(runs, "cpu")
                lab_rate = _median(results.get(f"{loader}|lab|{w}", []), "rate")
                lab_cpu = _median(results.get(f"{loader}|lab|{w}", []), "cpu")
                errors = {r["error"] for r in runs if "error" in r}
                if not runs:
                    continue  # not run on this endpoint
                if rate is None:
                    lines.append(f"| {loader} | {shape} | {w} | - | - | - | - | - |"
                                 + (f" {'; '.join(errors)}" if errors else ""))
                    continue
                vs_rate = f"{rate / lab_rate:.2f}x" if shape == "aws" and lab_rate else ""
                vs_cpu = f"{cpu / lab_cpu:.2f}x" if shape == "aws" and lab_cpu and cpu else ""
                lines.append(f"| {loader} | {shape} | {w} | {rate:,.0f} | {_span(runs)} | {cpu:,.0f} | {vs_rate} | "
                             f"{vs_cpu} |")
    ratios = ["", "| ours (default backend) against | endpoint | w | ratio of medians |", "|---|---|--:|--:|"]
    for peer in [name for name in loaders if name not in ("ours-aioboto3",)]:
        for shape in ("lab", "aws"):
            for w in workers:
                ours = _median(results.get(f"ours-aioboto3|{shape}|{w}", []), "rate")
                theirs = _median(results.get(f"{peer}|{shape}|{w}", []), "rate")
                if ours and theirs:
                    ratios.append(f"| {peer} | {shape} | {w} | {ours / theirs:.2f}x |")
    regression = ["", "| this tree against the base revision, same backend | endpoint | w | ratio of medians | "
                  "CPU per sample, after / before |", "|---|---|--:|--:|--:|"]
    for backend in ("aioboto3", "obstore"):
        for shape in ("lab", "aws"):
            for w in workers:
                after = results.get(f"ours-{backend}|{shape}|{w}", [])
                before = results.get(f"before-{backend}|{shape}|{w}", [])
                ours, theirs = _median(after, "rate"), _median(before, "rate")
                ours_cpu, their_cpu = _median(after, "cpu"), _median(before, "cpu")
                if ours and theirs and ours_cpu and their_cpu:
                    regression.append(f"| {backend} | {shape} | {w} | {ours / theirs:.2f}x | {ours_cpu / their_cpu:.2f}x |")
    proxy = ["", "| proxy thread (TLS, pacing: in the harness process) and server (weed) | endpoint | w | "
             "proxy µs per sample | share of a core at the median rate | server µs per sample | "
             "client + proxy + server µs per sample |", "|---|---|--:|--:|--:|--:|--:|"]
    for loader in loaders:
        for shape in ("lab", "aws"):
            for w in workers:
                runs = [r for r in results.get(f"{loader}|{shape}|{w}", []) if "proxy_cpu" in r]
                rate, client = _median(runs, "rate"), _median(runs, "cpu")
                if runs and rate:
                    cost = statistics.median(r["proxy_cpu"] for r in runs) * 1e6
                    weed = statistics.median(r.get("server_cpu", 0.0) for r in runs) * 1e6
                    proxy.append(f"| {loader} | {shape} | {w} | {cost:,.0f} | {cost * rate / 1e6:.0%} | {weed:,.0f} | "
                                 f"{(client or 0) + cost + weed:,.0f} |")
    made = ["", "| connections the proxy accepted, warm-up and timed epoch (median) | endpoint | w | connections |",
            "|---|---|--:|--:|"]
    for loader in loaders:
        for shape in ("lab", "aws"):
            for w in workers:
                counted = [r["connections"] for r in results.get(f"{loader}|{shape}|{w}", []) if "connections" in r]
                if counted:
                    made.append(f"| {loader} | {shape} | {w} | {statistics.median(counted):,.0f} |")
    table = "\n".join(lines + ratios + regression + (proxy if len(proxy) > 3 else [])
                      + (made if len(made) > 3 else [])) + "\n"
    print()
    print(table)
    stamp = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"aws-{stamp}{args.suffix}.md"
    path.write_text(
        f"# Per object on an AWS-shaped endpoint and on the lab path, {stamp}\n\n"
        f"`python -m bench.aws --objects {args.objects} --rounds {args.rounds} --workers {args.workers}"
        f" --get-rate {args.get_rate:g} --slowdown {args.slowdown:g}"
        f" --before {args.before} --after {args.after}`: {args.objects} ~110 KiB JPEGs on the embedded SeaweedFS. **lab**: plain http, "
        "path-style, 127.0.0.1, +20 ms to first byte. **aws**: https with a private CA, +20 ms to first byte, "
        f"90 MB/s per connection, GETs beyond {args.get_rate:,.0f}/s (S3's per-prefix rate) and {args.slowdown:.0%} of "
        "all GETs answered 503 SlowDown with Connection: close; "
        f"virtual-hosted (`<bucket>.{DOMAIN}`, resolved to 127.0.0.1 in the measuring process) for this "
        "package's default backend (`ours-aioboto3`, and `before-aioboto3`: the same dataset with the package "
        f"of {args.before}, `before-obstore` likewise), path-style at https://127.0.0.1 for the clients that resolve names themselves "
        "(obstore: `ours-obstore`, LitData; the AWS CRT: s3torchconnector). One warm-up and one timed epoch per "
        f"run, batch 32, fresh process; s3torchconnector's epochs capped at {args.peer_cap} samples. Client CPU: "
        "the measuring process and its DataLoader workers over the timed epoch. Runs alternate in "
        f"{args.rounds} rounds; medians. The machine (2 cores) was shared with other work: compare rows of "
        "this table, not absolutes across runs.\n\n" + table)
    (args.out / f"aws-{stamp}{args.suffix}.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
