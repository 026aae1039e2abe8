"""``python -m bench.list_requests``: LIST requests of one listing, this project next to boto3's paginator.

Starts the embedded SeaweedFS server on 127.0.0.1, PUTs N empty objects under one flat prefix,
and lists it through the fault proxy (no faults; it counts the requests): boto3's
``list_objects_v2`` paginator, then ``AsyncS3Dataset.from_prefix(...).keys()`` with the aioboto3
and the obstore backend (default ``ListOptions``: 1,000 keys per page, key ranges in parallel).
A job makes one such listing however many ranks and DataLoader workers it has
(``integration/test_list_once.py`` counts that); a script with the paginator makes one per
process that runs it.

    python -m bench.list_requests --keys 100000
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from .harness import load_faults_module
from .listing import BUCKET, boto3_paginator, ensure_keys


def lists(proxy: Any) -> int:
    return sum(1 for method, target, _ in proxy.decisions if method == "GET" and "list-type=2" in target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.list_requests", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000)
    args = parser.parse_args(argv)
    from loader import AsyncS3Dataset
    from loader.tools.devserver import DevServer

    faults = load_faults_module()
    prefix = f"flat-{args.keys}/"  # what ensure_keys fills
    rows = []
    with DevServer(buckets=[BUCKET]) as server:
        ensure_keys(server.config, args.keys)
        with faults.FaultProxy(server.config.endpoint_url, history=10 * args.keys) as proxy:
            config = dataclasses.replace(server.config, endpoint_url=proxy.endpoint_url)
            for name, store in (("boto3 paginator", None), ("ours aioboto3", "aioboto3"),
                                ("ours obstore", "obstore")):
                proxy.reset_counts()
                started = time.perf_counter()
                if store is None:
                    found = boto3_paginator(config, prefix)
                else:
                    found = len(AsyncS3Dataset.from_prefix(f"s3://{BUCKET}/{prefix}", store=store,
                                                           config=config).keys())
                seconds = time.perf_counter() - started
                assert found == args.keys, f"{name} listed {found} keys, not {args.keys}"
                rows.append(f"| {name} | {lists(proxy)} | {seconds:.2f} s |")
    print(f"### LIST requests of one listing, {args.keys:,} flat keys\n\n"
          "| lister | LIST requests | wall (through the proxy) |\n|---|--:|--:|\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
