"""What users need to test their own training code against the loader (see docs/testing.md):

* ``MemoryStore``: an in-memory object store with injectable latency and faults, and counters of
  what it was asked; a dataset or a checkpoint takes it as ``store=``, no server involved::

      from loader.testing import MemoryStore
      store = MemoryStore.with_objects("train", {"a/0.bin": b"x"}, latency=0.005)
      ds = AsyncS3Dataset.from_prefix("s3://train/a/", store=store)

* ``DevServer``: a real local S3 server (embedded SeaweedFS, extra ``devserver``; implemented in
  ``loader.tools.devserver``)::

      from loader.testing import DevServer
      with DevServer(buckets=["train"]) as server:
          ds = AsyncS3Dataset.from_prefix("s3://train/", config=server.config)

The stable home of these names: ``MemoryStore`` lives in ``loader.s3.memory_store`` (its
docstring has every option and counter), ``DevServer`` in ``loader.tools.devserver``.
"""

from __future__ import annotations

from .s3.memory_store import MemoryStore, MultipartUpload
from .tools.devserver import DevServer, DevServerError

__all__ = ["DevServer", "DevServerError", "MemoryStore", "MultipartUpload"]
