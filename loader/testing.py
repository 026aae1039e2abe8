"""A local S3 server for users' own tests: ``DevServer`` (embedded SeaweedFS, extra ``devserver``).

    from loader.testing import DevServer
    with DevServer(buckets=["train"]) as server:
        ds = AsyncS3Dataset.from_prefix("s3://train/", config=server.config)

The stable home of the names below; the implementation lives in ``loader.tools.devserver``.
"""

from __future__ import annotations

from .tools.devserver import DevServer, DevServerError

__all__ = ["DevServer", "DevServerError"]
