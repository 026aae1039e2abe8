"""A small forward proxy on 127.0.0.1 for tests: ``CONNECT`` tunnels (https targets) and
absolute-form requests (http targets), each logged, one request per connection to the server.

It resolves the names it is asked for with ``socket.getaddrinfo`` (as a real proxy resolves them
for its clients) and refuses any that is not loopback. ``redirect_once`` makes the first object
GET answer S3's region redirect (301 with ``x-amz-bucket-region``), as AWS answers a request
sent to another region than the bucket's.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import urllib.parse
from typing import NamedTuple

_HEAD_LIMIT = 64 << 10


class Logged(NamedTuple):
    """One request the proxy handled: ``method`` and ``target`` as sent to it, the client's
    ``User-Agent`` (absolute-form requests only: a tunnel's are encrypted)."""

    method: str
    target: str
    user_agent: str


class ForwardProxy:
    """``with ForwardProxy() as proxy:`` listens on ``proxy.url`` until the block ends."""

    def __init__(self, *, redirect_once: str | None = None) -> None:
        self.log: list[Logged] = []
        self.redirect_once = redirect_once
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> ForwardProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def methods(self) -> list[str]:
        with self._lock:
            return [entry.method for entry in self.log]

    # -- one client connection

    def _handle(self, client: socket.socket) -> None:
        head, rest = _read_head(client)
        if head is None:
            return
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {name.strip().lower(): value.strip()
                   for name, _, value in (line.partition(":") for line in lines[1:])}
        with self._lock:
            self.log.append(Logged(method, target, headers.get("user-agent", "")))
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            upstream = _connect(host, int(port))
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            _relay(client, upstream, rest)
            return
        url = urllib.parse.urlsplit(target)
        if url.scheme != "http" or not url.hostname:
            client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        region = self._redirect(method, url)
        if region is not None:
            body = b"<Error><Code>PermanentRedirect</Code></Error>"
            client.sendall(b"HTTP/1.1 301 Moved Permanently\r\nx-amz-bucket-region: "
                           + region.encode() + b"\r\nContent-Length: "
                           + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            return
        upstream = _connect(url.hostname, url.port or 80)
        origin_form = urllib.parse.urlunsplit(("", "", url.path or "/", url.query, ""))
        kept = [line for line in lines[1:] if not line.lower().startswith(("connection:", "proxy-"))]
        upstream.sendall("\r\n".join([f"{method} {origin_form} HTTP/1.1", *kept, "Connection: close", "", ""])
                         .encode("latin-1") + rest)
        # the answer, its head told that this connection closes after it
        answer_head, answer_rest = _read_head(upstream)
        if answer_head is None:
            return
        answer = [line for line in answer_head.decode("latin-1").split("\r\n")
                  if not line.lower().startswith("connection:")]
        client.sendall("\r\n".join([*answer, "Connection: close", "", ""]).encode("latin-1") + answer_rest)
        while data := upstream.recv(1 << 16):
            client.sendall(data)
        upstream.close()

    def _redirect(self, method: str, url: urllib.parse.SplitResult) -> str | None:
        """The region to redirect this request to (the first object GET only), or None."""
        with self._lock:
            if self.redirect_once and method == "GET" and "list-type" not in url.query:
                region, self.redirect_once = self.redirect_once, None
                return region
        return None


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        if not chunk or len(data) > _HEAD_LIMIT:
            return None, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _connect(host: str, port: int) -> socket.socket:
    address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4]
    if address[0] != "127.0.0.1":
        raise ValueError(f"the test proxy reaches loopback only, not {host} ({address[0]})")
    return socket.create_connection(address)


def _relay(client: socket.socket, upstream: socket.socket, first: bytes) -> None:
    """Bytes both ways until either side closes."""
    if first:
        upstream.sendall(first)

    def pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    back.start()
    pump(client, upstream)
    back.join()
    upstream.close()
