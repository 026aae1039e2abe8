"""One measurement of ``bench.first_sample`` in a fresh process (its ``CHILD_SCRIPT`` calls
``child``). This module imports only ``time`` (loaded with torch already): every import a loader
needs is inside the clock."""

from __future__ import annotations

import time


def child(spec: dict, torch_import: float) -> dict:
    """One measurement in this (fresh) process: the clock starts at the first import after
    torch's (this function's module is imported before it: ``time`` and a few of the standard
    library's modules already loaded by the interpreter, nothing a loader needs)."""
    started = time.perf_counter()
    from torch.utils.data import DataLoader

    uri, workers = spec["uri"], spec["workers"]
    phases: dict[str, float] = {}
    if spec["who"] == "s3tc":
        from s3torchconnector import S3ClientConfig, S3IterableDataset

        imported = time.perf_counter() - started
        dataset: object = S3IterableDataset.from_prefix(
            uri, region=spec["region"], endpoint=spec["endpoint"], enable_sharding=True,
            s3client_config=S3ClientConfig(force_path_style=True))
    else:
        from loader import AsyncS3Dataset
        from loader.config import S3Config
        from loader.listing import inputs

        imported = time.perf_counter() - started
        if workers == 0:  # where the time goes: the listing, timed where it runs
            listed = inputs.list_prefix

            def timed_list(*args: object, **kwargs: object) -> object:
                begun = time.perf_counter()
                try:
                    return listed(*args, **kwargs)
                finally:
                    phases["listing"] = time.perf_counter() - begun

            inputs.list_prefix = timed_list  # type: ignore[assignment]
        constructing = time.perf_counter()
        shuffle = spec.get("shuffle", True)
        if spec.get("saved"):
            dataset = AsyncS3Dataset.from_manifest(spec["saved"], shuffle=shuffle, store=spec["store"],
                                                   config=S3Config.from_env())
        else:
            dataset = AsyncS3Dataset.from_prefix(uri, shuffle=shuffle, store=spec["store"],
                                                 config=S3Config.from_env())
        phases["construct"] = time.perf_counter() - constructing
    loader = DataLoader(dataset, num_workers=workers, batch_size=None)
    batches = iter(loader)  # kept: dropping it would time the loader's shutdown too
    first = next(batches)
    took = time.perf_counter() - started
    assert first is not None
    return {"import": imported, "torch": torch_import, "first": took, **phases}
