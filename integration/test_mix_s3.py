"""``mix()`` against the real server: a per-object prefix, plain shards and gzip shards mixed
0.5 / 0.3 / 0.2, read by 3 ranks x 2 DataLoader workers started by ``mp.spawn``, stopped, and
resumed on 2 ranks x 3 workers. Together they read exactly the epoch a single process reads,
in the same global order, and every prefix of it holds each source's share within one sample."""

from __future__ import annotations

import collections
import json
import socket
from pathlib import Path

import mix_worker
import pytest
import torch.multiprocessing as mp

from loader import AsyncS3Dataset

from datasets import jpeg_dataset
from shardsets import upload_shards

SAMPLES = 96


@pytest.fixture(scope="module")
def spec(s3_server):
    bucket = s3_server.new_bucket("mix")
    jpeg_dataset(s3_server.minio, bucket, "web/", 40, seed=3)
    _, plain = upload_shards(s3_server.minio, bucket, "plain/p-", [9, 9, 9, 9, 9], payload=200)
    _, gz = upload_shards(s3_server.minio, bucket, "gz/g-", [7, 7, 7, 7], payload=200, seed=1,
                          compression="gzip")
    return {"web": f"s3://{bucket}/web/", "plain": f"s3://{bucket}/plain/", "gz": f"s3://{bucket}/gz/",
            "counts": {**plain, **gz}, "samples": SAMPLES}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(spec, env, out: Path, world: int, workers: int, steps=None, resume=None,
           worker=mix_worker) -> list[dict]:
    """``world`` ranks by ``mp.spawn`` running ``worker.spawned`` (each writes ``rank<r>.json``)."""
    plan = {"spec": spec, "env": env, "init_method": f"tcp://127.0.0.1:{free_port()}", "out": str(out),
            "workers": workers, "steps": steps, "resume": resume}
    mp.spawn(worker.spawned, args=(world, plan), nprocs=world, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def global_order(ranks: list[dict]) -> list[tuple[str, str]]:
    steps = max(len(r["batches"]) for r in ranks)
    return [tuple(s) for step in range(steps) for r in ranks if step < len(r["batches"])
            for s in r["batches"][step]]


def test_three_sources_on_three_ranks_then_resumed_on_two(spec, s3_server, s3_env, tmp_path):
    spec = dict(spec, lanes=6)  # shuffled shards are dealt to the lanes of the 3 x 2 run that starts the epoch
    whole = mix_worker.build(spec, s3_server.config)
    whole.set_epoch(mix_worker.EPOCH)
    whole.resume(epoch=mix_worker.EPOCH, samples_seen=0, lanes=6)  # that order, read by one process
    expected = [(s["__source__"], s["__key__"]) for s in whole]
    assert len(expected) == SAMPLES
    assert collections.Counter(name for name, _ in expected) == {"web": 48, "plain": 29, "gz": 19}

    head = launch(spec, s3_server.env, tmp_path / "head", world=3, workers=2, steps=3)
    assert [len(r["batches"]) for r in head] == [3, 3, 3]
    seen = head[0]["seen"]
    assert seen == 3 * 3 * mix_worker.BATCH
    tail = launch(spec, s3_server.env, tmp_path / "tail", world=2, workers=3, resume=seen)
    lengths = [sum(len(b) for b in r["batches"]) for r in tail]
    assert lengths == [r["length"] for r in tail] and len(set(lengths)) == 1, "equal ranks"
    got = global_order(head) + global_order(tail)
    assert got == expected, "the resumed job reads the rest of the single-process order"

    names = [name for name, _ in got]
    counts = collections.Counter()
    for t, name in enumerate(names, 1):
        counts[name] += 1
        for source, weight in mix_worker.WEIGHTS.items():
            assert abs(counts[source] - weight * t) < 1, f"after {t} samples: {counts}"
    print(f"per source: {dict(collections.Counter(names))}; head ranks {[len(r['batches']) for r in head]} "
          f"batches, tail ranks {lengths} samples")


def test_unindexed_shards_in_a_mix_fail_before_any_worker_starts(spec, s3_server):
    sources = {"web": AsyncS3Dataset.from_prefix(spec["web"], config=s3_server.config),
               "plain": AsyncS3Dataset.from_shards(spec["plain"], config=s3_server.config)}
    from loader import ConfigError, mix

    dataset = mix(sources, config=s3_server.config)
    with pytest.raises(ConfigError, match="mix source 'plain'"):
        len(dataset)
