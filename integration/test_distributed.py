"""Several real ranks (torch.multiprocessing + gloo) x 2 DataLoader workers on the real server."""

from __future__ import annotations

import itertools
import pickle
import socket
import subprocess
import sys
import textwrap

import pytest
import torch.multiprocessing as mp

from datasets import jpeg_dataset, upload_objects
from ddp_worker import run_rank
from shardsets import upload_shards

WORLD = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks_read(s3_server):
    """One ``mp.spawn`` of 3 ranks reads every case of the tests below, one after another: the rank
    processes and their process group start once, not once per case (each spawned process imports
    torch again, seconds on a small machine). ``{case: {"keys", "length", "errors"}}``."""
    bucket = s3_server.new_bucket()
    # 7 shards of uneven sizes, 600 samples: fewer shards than the 6 slots' worth would balance.
    shard_samples, counts = upload_shards(s3_server.minio, bucket, "shards/train-",
                                          [130, 40, 95, 110, 60, 85, 80], payload=300)
    upload_objects(s3_server.minio, bucket, {f"train/{i:04d}.bin": bytes([i % 256]) * 64 for i in range(200)})
    objects = {"mode": "objects", "uri": f"s3://{bucket}/train/"}
    cases = {"shards": {"mode": "shards", "uri": f"s3://{bucket}/shards/train-{{0000..0006}}.tar", "counts": counts},
             "pad": {**objects, "pad_policy": "pad"}, "drop": {**objects, "pad_policy": "drop"}}
    manager = mp.Manager()
    try:
        out = manager.dict()
        mp.spawn(run_rank, args=(WORLD, free_port(), cases, s3_server.env, out), nprocs=WORLD, join=True)
        results = dict(out)
    finally:
        manager.shutdown()
    results["shards"]["expected"] = shard_samples
    return results


def case(ranks_read, name):
    """``(keys per rank, len() on rank 0)`` of one case; a failure on any rank fails the test."""
    result = ranks_read[name]
    errors = [error for error in result["errors"] if error]
    assert not errors, f"{len(errors)} rank(s) failed; the first:\n{errors[0]}"
    return result["keys"], result["length"]


def test_shard_ranks_split_the_data_set_exactly_with_equal_lengths(ranks_read):
    keys, length = case(ranks_read, "shards")
    assert {len(rank_keys) for rank_keys in keys} == {200} and length == 200
    flat = list(itertools.chain(*keys))
    assert len(flat) == len(set(flat)) and set(flat) == set(ranks_read["shards"]["expected"])


@pytest.mark.parametrize("pad_policy", ["pad", "drop"])
def test_object_ranks_pad_or_drop_the_remainder(ranks_read, pad_policy):
    """200 objects over 3 ranks found from the process group: "pad" repeats one sample so every
    rank reads 67, "drop" leaves out two so every rank reads 66 and none twice."""
    keys, length = case(ranks_read, pad_policy)
    flat = list(itertools.chain(*keys))
    stems = {f"train/{i:04d}" for i in range(200)}
    assert set(flat) <= stems
    if pad_policy == "drop":
        assert {len(rank_keys) for rank_keys in keys} == {66} and length == 66
        assert len(flat) == len(set(flat)) == 198, "drop repeated a sample or lost more than the remainder"
    else:
        assert {len(rank_keys) for rank_keys in keys} == {67} and length == 67
        assert set(flat) == stems and len(flat) - len(set(flat)) == 1, "pad should repeat exactly one sample"


RESUME = textwrap.dedent('''
    import pickle, sys
    from torchdata.stateful_dataloader import StatefulDataLoader
    from loader import AsyncS3Dataset, S3Config
    spec = pickle.load(open(sys.argv[1], "rb"))
    config = S3Config(**spec["config"])
    if spec["mode"] == "objects":
        ds = AsyncS3Dataset.from_prefix(spec["uri"], shuffle=True, seed=9, config=config)
    else:
        ds = AsyncS3Dataset.from_shards(spec["uri"], shuffle=True, seed=9, config=config,
                                        shuffle_buffer=40)
    ds.set_epoch(2)
    dl = StatefulDataLoader(ds, batch_size=10, num_workers=2, multiprocessing_context="fork",
                            collate_fn=lambda b: [s["__key__"] for s in b], timeout=120)
    if spec["state"] is not None:
        dl.load_state_dict(spec["state"])
    keys = []
    for batch in dl:
        keys.extend(batch)
        if spec["stop"] is not None and len(keys) >= spec["stop"]:
            break
    out = {"keys": keys, "state": dl.state_dict() if spec["stop"] is not None else None}
    pickle.dump(out, open(sys.argv[2], "wb"))
''')


def run_part(tmp_path, name, spec):
    source, result = tmp_path / f"{name}.in", tmp_path / f"{name}.out"
    source.write_bytes(pickle.dumps(spec))
    script = tmp_path / "resume.py"
    script.write_text(RESUME)
    subprocess.run([sys.executable, str(script), str(source), str(result)], check=True, timeout=300)
    return pickle.loads(result.read_bytes())


@pytest.mark.parametrize("mode", ["objects", "shards"])
def test_statefuldataloader_resume_in_a_fresh_process(s3_server, tmp_path, mode):
    bucket = s3_server.new_bucket()
    if mode == "objects":
        expected = {k.rsplit(".", 1)[0] for k in jpeg_dataset(s3_server.minio, bucket, "train/", 400, seed=3)}
        uri = f"s3://{bucket}/train/"
    else:
        expected = set(upload_shards(s3_server.minio, bucket, "shards/", [90, 110, 100, 100], payload=200)[0])
        uri = f"s3://{bucket}/shards/"
    config = {f: getattr(s3_server.config, f) for f in
              ("endpoint_url", "region", "access_key_id", "secret_access_key")}
    stop = int(len(expected) * 0.37)
    first = run_part(tmp_path, "first", {"mode": mode, "uri": uri, "config": config, "state": None, "stop": stop})
    second = run_part(tmp_path, "second", {"mode": mode, "uri": uri, "config": config,
                                           "state": first["state"], "stop": None})
    together = first["keys"] + second["keys"]
    assert len(first["keys"]) >= stop
    assert len(together) == len(set(together)), "a sample was delivered twice across the resume"
    assert set(together) == expected, "a sample was lost across the resume"
