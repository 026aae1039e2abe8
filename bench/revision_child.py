"""One measurement (per object, or tar shards) of whichever ``loader`` is first on ``sys.path`` (``bench.revisions``).

Run as a script (``python bench/revision_child.py``) with the revision's checkout first on
``PYTHONPATH``, so that ``import loader`` finds that revision, not this one. It uses only the
public API every revision has (``AsyncS3Dataset.from_prefix``, ``S3Config``), the standard
library, torch and psutil. Reads a JSON spec on stdin, writes one JSON line on stdout.
Credentials arrive in the environment, never in the spec or the command line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any


def raw(sample: dict[str, Any]) -> bytes:
    """The sample's JPEG bytes, handed through (the ``raw`` workload of ``bench.loaders``)."""
    return bytes(sample["jpg"])


def _cpu_tree() -> float:
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    import loader
    from loader import AsyncS3Dataset, S3Config

    torch.set_num_threads(1)  # as DataLoader workers have (see bench/child.py)
    config = S3Config(endpoint_url=spec["endpoint_url"], region=spec["region"],
                      access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                      secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"], addressing_style="path")
    if spec.get("mode") == "shards":  # the defaults, as bench.shards reads them
        dataset = AsyncS3Dataset.from_shards(spec["uri"], store=spec["store"], config=config, transform=raw)
    else:
        dataset = AsyncS3Dataset.from_prefix(spec["uri"], max_inflight=spec["max_inflight"],
                                             store=spec["store"], config=config, transform=raw)
    dataset.resolve()  # list before the DataLoader forks (bench/README.md says why)
    workers = spec["workers"]
    dl = DataLoader(dataset, batch_size=spec["batch_size"], num_workers=workers,
                    prefetch_factor=2 if workers else None, persistent_workers=workers > 0)
    rates, cpu, firsts = [], [], []
    expected = spec["objects"]
    try:
        for epoch in range(spec["epochs"] + 1):  # epoch 0 warms up (workers start, connections open)
            dataset.set_epoch(epoch)
            batches = iter(dl)
            cpu_before = _cpu_tree()
            began = time.perf_counter()
            count = len(next(batches))
            first = time.perf_counter() - began
            count += sum(len(batch) for batch in batches)
            seconds = time.perf_counter() - began
            used = _cpu_tree() - cpu_before
            if count != expected:
                raise RuntimeError(f"epoch {epoch} yielded {count} samples, expected {expected}")
            if epoch:
                rates.append(count / seconds)
                cpu.append(used / count)
                firsts.append(first)
    finally:
        del dl
    return {"samples_per_s": statistics.median(rates), "rates": rates,
            "client_us": 1e6 * statistics.median(cpu), "first_batch_s": statistics.median(firsts),
            "loader_file": loader.__file__}


def main() -> int:
    spec = json.load(sys.stdin)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to the log, not the result line
    try:
        result = measure(spec)
    except Exception as exc:  # reported as a result: one failing revision must not end the run
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    out.write(json.dumps(result) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
