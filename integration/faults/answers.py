"""The answers the proxy writes itself instead of the upstream's: S3's ``503 SlowDown`` with its
XML error body, and plain-text 400/502 for what cannot be relayed."""

from __future__ import annotations

import email.utils
import itertools
from xml.sax.saxutils import escape

SLOWDOWN_MESSAGE = "Please reduce your request rate."

_request_ids = itertools.count(1)


def slowdown_response(target: str, *, head_only: bool, close: bool) -> bytes:
    """S3's ``503 SlowDown``; closing, it is framed as S3 frames it (``Connection: close`` and a
    chunked body), else with a ``Content-Length`` on a connection kept open."""
    request_id = f"FAULTPROXY{next(_request_ids):012d}"
    resource = target.split("?", 1)[0]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>SlowDown</Code><Message>{SLOWDOWN_MESSAGE}</Message>"
        f"<Resource>{escape(resource)}</Resource><RequestId>{request_id}</RequestId></Error>"
    ).encode()
    framing = "Transfer-Encoding: chunked\r\nConnection: close\r\n" if close else f"Content-Length: {len(body)}\r\n"
    head = (
        "HTTP/1.1 503 Slow Down\r\n"
        f"Date: {email.utils.formatdate(usegmt=True)}\r\n"
        "Server: FaultProxy\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        "Content-Type: application/xml\r\n"
        + framing
        + "\r\n"
    ).encode()
    if head_only:
        return head
    return head + (b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if close else body)


def simple_response(status: str, message: str) -> bytes:
    body = message.encode()
    return (
        f"HTTP/1.1 {status}\r\nServer: FaultProxy\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
