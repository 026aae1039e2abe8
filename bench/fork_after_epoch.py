"""``python -m bench.fork_after_epoch``: DataLoader workers forked right after an https epoch.

What a user's script does between two epochs: one epoch read in the main process
(``num_workers=0``, a validation pass, say), then a ``DataLoader`` with forked workers over the
same dataset, at once. Both read the embedded SeaweedFS over ``https`` (a private CA) with
virtual-hosted addressing (``<bucket>.s3.lab.test``, resolved to 127.0.0.1 in the measuring
process and its forks), 40 objects of ~4-60 KB, 2 workers, on a machine kept busy by ``--load``
processes that only spin (a thread's end is slowest to come when the CPUs are taken). Workers
start as DataLoader starts them by default on Linux: forked.

A worker that delivers nothing within ``--timeout`` s counts as hung (the DataLoader raises; the
run goes on). Two conditions, each in its own fresh process, alternating in rounds:

* ``joined to the OS``: this tree as it is (``lifecycle.join_thread``);
* ``plain join``: the same with ``Thread.join`` alone where the package joins its threads (the
  loop thread, the first-page thread): the loop thread may still be in its C-level exit (OpenSSL's
  handlers, under a process-wide lock) when the DataLoader forks.

Writes ``bench/results/fork-after-epoch-<date>.md``.

    python -m bench.fork_after_epoch                        # 4 rounds x 100 epochs each way, ~10 min
    python -m bench.fork_after_epoch --rounds 2 --epochs 50
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .harness import REPO, RESULTS_DIR, load_faults_module

DOMAIN = "s3.lab.test"
BUCKET = "forks"
OBJECTS = 40
CONDITIONS = ("joined to the OS", "plain join")


def child(condition: str, epochs: int, timeout: float, spec: dict) -> dict:
    """``epochs`` times: an epoch in this process, then one through 2 forked workers."""
    from torch.utils.data import DataLoader

    from loader import AsyncS3Dataset, S3Config

    from .aws_child import resolve_to_loopback

    if condition == "plain join":
        from loader.engine import loopthread
        from loader.s3 import http_lister

        def join(thread, most=0.0):  # type: ignore[no-untyped-def]
            thread.join()

        loopthread.join_thread = join  # type: ignore[assignment]
        http_lister.join_thread = join  # type: ignore[assignment]
    resolve_to_loopback(DOMAIN)
    config = S3Config(**spec)
    hangs = samples = 0
    started = time.monotonic()
    for epoch in range(epochs):
        dataset = AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/train/", config=config, shuffle=True, seed=epoch)
        samples += sum(len(batch) for batch in DataLoader(dataset, batch_size=8, collate_fn=list))
        dataset.set_epoch(1)
        loader = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=list, timeout=timeout)
        try:
            samples += sum(len(batch) for batch in loader)
        except RuntimeError as exc:
            if "timed out" not in str(exc):
                raise
            hangs += 1
    return {"condition": condition, "epochs": epochs, "hangs": hangs, "samples": samples,
            "seconds": time.monotonic() - started}


def upload(server, count: int) -> None:  # type: ignore[no-untyped-def]
    """``count`` objects of 4-60 KB under ``train/``, through the server's own setup client."""
    client = server.client()
    try:
        rng = random.Random(5)
        for i in range(count):
            client.put_object(Bucket=BUCKET, Key=f"train/{i:04d}.bin", Body=rng.randbytes(rng.randint(4_000, 60_000)))
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=100, help="per condition per round")
    parser.add_argument("--load", type=int, default=2, help="spinning processes beside the run")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds without a batch: hung")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        condition, spec = json.loads(args.child)
        print(json.dumps(child(condition, args.epochs, args.timeout, spec)))
        return

    from loader.tools.devserver import DevServer

    faults = load_faults_module()
    tmp = Path(tempfile.mkdtemp(prefix="fork-after-epoch-"))
    pki = faults.lab_certificates(tmp, DOMAIN)
    rows: dict[str, list[dict]] = {c: [] for c in CONDITIONS}
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        with DevServer(certfile=pki["cert"], keyfile=pki["key"], cafile=pki["ca"], domain=DOMAIN) as server:
            server.create_bucket(BUCKET)
            upload(server, OBJECTS)
            base = server.config
            spec = {"endpoint_url": f"https://{DOMAIN}:{server.ports.s3_https}", "region": base.region,
                    "access_key_id": base.access_key_id, "secret_access_key": base.secret_access_key,
                    "addressing_style": "virtual", "verify": base.verify}
            for r in range(args.rounds):
                order = CONDITIONS if r % 2 == 0 else CONDITIONS[::-1]
                for condition in order:
                    proc = subprocess.run(
                        [sys.executable, "-m", "bench.fork_after_epoch", "--epochs", str(args.epochs),
                         "--timeout", str(args.timeout), "--child", json.dumps([condition, spec])],
                        capture_output=True, text=True, cwd=REPO, timeout=3600)
                    if proc.returncode != 0:
                        raise SystemExit(f"{condition}: exited {proc.returncode}\n{proc.stderr[-3000:]}")
                    row = json.loads(proc.stdout.strip().splitlines()[-1])
                    rows[condition].append(row)
                    print(f"round {r + 1} {condition}: {row['hangs']} hung of {row['epochs']} "
                          f"({row['seconds']:.0f} s)", flush=True)
    finally:
        for proc in load:
            proc.kill()
    report(args, rows)


def report(args: argparse.Namespace, rows: dict[str, list[dict]]) -> None:
    lines = [f"# DataLoader workers forked right after an https epoch ({datetime.date.today()})", "",
             f"`python -m bench.fork_after_epoch --rounds {args.rounds} --epochs {args.epochs} "
             f"--load {args.load}` on {os.cpu_count()} CPUs: each epoch read in the process, then "
             "through 2 forked workers, over https, virtual-hosted; alternated rounds.", "",
             "| threads joined | epochs | epochs with a worker hung | per round | runs without a hang read every sample |",
             "|---|--:|--:|---|---|"]
    for condition, runs in rows.items():
        epochs = sum(r["epochs"] for r in runs)
        hangs = sum(r["hangs"] for r in runs)
        exact = all(r["samples"] == 2 * OBJECTS * r["epochs"] for r in runs if r["hangs"] == 0)
        lines.append(f"| {condition} | {epochs} | {hangs} | {', '.join(str(r['hangs']) for r in runs)} "
                     f"| {'yes' if exact else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"fork-after-epoch-{datetime.date.today()}.md"
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
