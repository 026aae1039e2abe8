"""An unshuffled pass on one process reads a prefix as its pages arrive, on the real server:
the first object GET goes out before the last LIST page is asked for (counted in the order the
fault proxy saw the requests, not by the clock), and the samples are the whole listing's."""

from __future__ import annotations

import dataclasses

import pytest
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset, ListOptions, Store

from datasets import upload_objects
from faults import FaultPlan, FaultProxy

PAGE = 50
N = 300


@pytest.fixture(scope="module")
def nested(s3_server):
    """``N`` samples under ``train/``: a ``.jpg`` each and a ``.cls`` for every fourth, a folder
    named like a sample (``train/0007/``) and one beside it (``train/0007-x/``), which a server
    listing by directory orders apart from byte order."""
    bucket = s3_server.new_bucket("stream")
    items = {f"train/{i:04d}.jpg": f"jpg {i}".encode() for i in range(N)}
    items.update({f"train/{i:04d}.cls": str(i % 7).encode() for i in range(0, N, 4)})
    items.update({f"train/0007/{i}.jpg": b"in" for i in range(3)})
    items.update({f"train/0007-x/{i}.jpg": b"beside" for i in range(3)})
    upload_objects(s3_server.minio, bucket, items)
    return bucket, items


def test_the_first_get_goes_out_before_the_last_list_page(s3_server, nested):
    bucket, items = nested
    try:
        proxy = FaultProxy(s3_server.config.endpoint_url, FaultPlan())
    except ValueError as exc:
        pytest.skip(f"the fault proxy needs a loopback http server: {exc}")
    with proxy:
        config = dataclasses.replace(s3_server.config, endpoint_url=proxy.endpoint_url)
        dataset = AsyncS3Dataset.from_prefix(f"s3://{bucket}/train/", config=config,
                                             store=Store(listing=ListOptions(page_size=PAGE)))
        streamed = [(sample["__key__"], sorted(sample)) for sample in DataLoader(dataset, batch_size=None)]
        requests = [("LIST" if "list-type=2" in target else "GET", target)
                    for method, target, _ in proxy.decisions if method == "GET"]
        listed, before = [kind for kind, _ in requests].count("LIST"), len(proxy.decisions)
        whole = [(sample["__key__"], sorted(sample)) for sample in DataLoader(dataset, batch_size=None)]
        again = [target for _, target, _ in proxy.decisions[before:] if "list-type=2" in target]
    assert not again, "the second pass lists nothing: the first kept the key list"
    kinds = [kind for kind, _ in requests]
    assert listed >= len(items) // PAGE, f"{listed} pages of {PAGE} for {len(items)} keys"
    first_get, last_list = kinds.index("GET"), len(kinds) - 1 - kinds[::-1].index("LIST")
    assert first_get < last_list, f"the first GET came after all {listed} LIST pages: {kinds[:20]}"
    assert streamed == whole, "the samples and order of the whole listing"
    assert [key for key, _ in whole][:2] == ["train/0000", "train/0001"]
    assert len(whole) == N + 6 and sum(len(fields) - 2 for _, fields in whole) == len(items)
