"""``python moto_main.py -H 127.0.0.1 -p PORT``: moto's S3 server (``moto.server``) with two of its
bugs worked around, so that it answers as AWS S3 does. The one place these workarounds live;
``s3servers.moto_server`` starts it. Each names where moto goes wrong (moto 5.2.5):

1. Signatures: moto checks a SigV4 signature by handing the request's query string, as sent, to
   botocore (``moto/iam/access_control.py``, ``IAMRequestBase._create_aws_request``), so a client
   that percent-encodes an unreserved character (obstore sends ``~`` as ``%7E``) is refused with
   ``SignatureDoesNotMatch``. AWS canonicalises the query first (SigV4, "Create a canonical
   request": decode, then encode everything but ``A-Za-z0-9-_.~``), and so does this patch.
2. ``UploadPart`` to an upload that was aborted or never existed: moto looks the upload up with
   ``bucket.multiparts[upload_id]`` (``moto/s3/models.py``, ``S3Backend.upload_part``) and answers
   500 from the ``KeyError``; AWS answers 404 ``NoSuchUpload``, as this patch does.
"""

from __future__ import annotations

import sys
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit


def canonical_query(url: str) -> str:
    """``url`` with its query re-encoded as SigV4 canonicalises it (keys and values decoded,
    then everything but unreserved characters percent-encoded)."""
    parts = urlsplit(url)
    if not parts.query:
        return url
    pairs = []
    for pair in parts.query.split("&"):
        key, equals, value = pair.partition("=")
        pairs.append(quote(unquote(key), safe="-_.~") + equals + quote(unquote(value), safe="-_.~"))
    return urlunsplit(parts._replace(query="&".join(pairs)))


def patch() -> None:
    """Apply both workarounds to the moto imported in this process."""
    from moto.iam.access_control import IAMRequestBase
    from moto.s3.exceptions import NoSuchUpload
    from moto.s3.models import S3Backend

    create = IAMRequestBase._create_aws_request

    def create_aws_request(self: Any) -> Any:
        request = create(self)
        request.url = canonical_query(request.url)
        return request

    upload_part = S3Backend.upload_part

    def upload_part_or_no_such_upload(self: Any, bucket_name: str, multipart_id: str, *args: Any,
                                      **kwargs: Any) -> Any:
        if multipart_id not in self.get_bucket(bucket_name).multiparts:
            raise NoSuchUpload(upload_id=multipart_id)
        return upload_part(self, bucket_name, multipart_id, *args, **kwargs)

    IAMRequestBase._create_aws_request = create_aws_request  # type: ignore[method-assign]
    S3Backend.upload_part = upload_part_or_no_such_upload  # type: ignore[method-assign]


if __name__ == "__main__":
    patch()
    from moto.server import main

    main(sys.argv[1:])
