"""``python -m bench.aws_clients``: client CPU per signed GET on the AWS-shaped endpoint, by client.

    python -m bench.aws_clients --objects 1000 --epochs 3 --rounds 2

The endpoint of ``bench.aws``: ``https`` with a private CA, virtual-hosted (``<bucket>.s3.lab.test``),
+20 ms to first byte, ~90 MB/s per connection; and the lab path (plain ``http``, path-style, +20 ms)
for scale. The same SigV4-signed GETs (``SignedGetter.request``) of N ~110 KB objects, 64 in flight;
an *epoch* is one fresh event loop (``asyncio.run``), as a dataset's engine runs one per epoch, and
the figure is the CPU of this process (``time.process_time``: every thread, the AWS CRT's included)
per GET over the epochs after the first. Clients:

- ``http1``: this package's pool (``loader.s3.http1``, TLS by ``loader.s3.tls``): idle TLS
  connections are parked when an epoch's pool closes and taken by the next epoch's.
- ``http1-fresh``: the same with nothing parked: a TLS handshake per connection every epoch.
- ``aiohttp``: a ``ClientSession`` per epoch (as aiobotocore makes one per client), TLS by asyncio.
- ``awscrt``: the AWS Common Runtime's HTTP client (``awscrt.http``, s2n/OpenSSL TLS in native
  threads), a connection per request slot, opened per epoch; included where ``awscrt`` imports
  (it is not a dependency of this package: ``pip install awscrt`` to measure it). Its resolver is
  not Python's, so it connects to 127.0.0.1 with the bucket's host name for TLS and ``Host``.

Runs alternate in rounds; medians. Prints a table; ``--out`` writes it as a results file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import socket
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from .aws import DOMAIN, lab_and_aws
from .harness import RESULTS_DIR, load_faults_module

BUCKET = "awsclients"
INFLIGHT = 64


def resolve_lab_names() -> None:
    """``*.s3.lab.test`` resolves to 127.0.0.1 in this process (Python's resolver only)."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and (host == DOMAIN or host.endswith("." + DOMAIN)):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo


class Epochs:
    """One client's epochs: ``open()`` per epoch (in its loop), ``get(key)``, ``close()``."""

    def __init__(self, open_: Callable[[], Awaitable[Any]], get: Callable[[Any, str], Awaitable[int]],
                 close: Callable[[Any], Awaitable[None]]) -> None:
        self.open, self.get, self.close = open_, get, close

    def epoch(self, keys: list[str]) -> tuple[float, float]:
        """CPU µs per GET and GETs per second of one epoch in a fresh loop."""
        async def run() -> int:
            state = await self.open()
            gate = asyncio.Semaphore(INFLIGHT)

            async def one(key: str) -> int:
                async with gate:
                    return await self.get(state, key)

            try:
                return sum(await asyncio.gather(*(one(key) for key in keys)))
            finally:
                await self.close(state)

        cpu, wall = time.process_time(), time.perf_counter()
        size = asyncio.run(run())
        assert size >= 100_000 * len(keys), size
        return (time.process_time() - cpu) / len(keys) * 1e6, len(keys) / (time.perf_counter() - wall)


def clients(config: Any, ca: str | None) -> dict[str, Epochs]:
    """The clients to compare on ``config``'s endpoint (``ca``: the private CA, for https)."""
    import aiohttp

    from loader.retry import RetryPolicy
    from loader.s3 import tls
    from loader.s3.aioboto3_store import _given_credentials
    from loader.s3.signed_get import SignedGetter, ssl_setting

    credentials = _given_credentials(config)
    assert credentials is not None
    signer = SignedGetter(config, credentials, max_connections=INFLIGHT, retry=RetryPolicy())

    def signed(key: str, keys: Any) -> tuple[str, dict[str, str]]:
        return signer.request(BUCKET, key, None, None, None, keys, datetime.datetime.now(datetime.timezone.utc))

    async def getter_open(fresh: bool) -> Any:
        if fresh:
            tls.PARKED.clear()
        return SignedGetter(config, credentials, max_connections=INFLIGHT, retry=RetryPolicy())

    async def getter_get(getter: Any, key: str) -> int:
        data, _ = await getter.get(BUCKET, key)
        return len(data)

    async def getter_close(getter: Any) -> None:
        await getter.aclose()

    origin = signer._address(BUCKET)[0].origin  # the bucket's scheme, host and port, as signed
    url, host = origin.url, origin.host

    async def aiohttp_open() -> Any:
        context = (ssl_setting(config) or False) if origin.https else False
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=INFLIGHT, ssl=context),
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=30),
            auto_decompress=False, skip_auto_headers=("Accept", "Accept-Encoding"))

    async def aiohttp_get(session: Any, key: str) -> int:
        target, headers = signed(key, await credentials())
        async with session.get(url + target, headers=headers, allow_redirects=False) as answer:
            assert answer.status == 200, answer.status
            return len(await answer.read())

    async def aiohttp_close(session: Any) -> None:
        await session.close()

    found = {
        "http1": Epochs(lambda: getter_open(False), getter_get, getter_close),
        "http1-fresh": Epochs(lambda: getter_open(True), getter_get, getter_close),
        "aiohttp": Epochs(aiohttp_open, aiohttp_get, aiohttp_close),
    }
    crt = _awscrt_client(host, origin, ca, signed, credentials)
    if crt is not None:
        found["awscrt"] = crt
    return found


def _awscrt_client(host: str, origin: Any, ca: str | None, signed: Callable[..., Any],
                   credentials: Callable[[], Awaitable[Any]]) -> Epochs | None:
    try:
        from awscrt import http, io  # type: ignore[import-not-found]
    except ImportError:
        return None
    group = io.EventLoopGroup(1)
    bootstrap = io.ClientBootstrap(group, io.DefaultHostResolver(group))
    options = None
    if origin.https:
        tls_options = io.TlsContextOptions()
        if ca:
            tls_options.override_default_trust_store_from_path(None, ca)
        options = io.ClientTlsContext(tls_options).new_connection_options()
        options.set_server_name(host)

    async def open_() -> Any:
        futures = [http.HttpClientConnection.new(host_name="127.0.0.1", port=origin.port, bootstrap=bootstrap,
                                                 tls_connection_options=options) for _ in range(INFLIGHT)]
        connections = [await asyncio.wrap_future(future) for future in futures]
        return asyncio.Queue(), connections

    async def get(state: Any, key: str) -> int:
        idle, connections = state
        connection = connections.pop() if connections else await idle.get()
        target, headers = signed(key, await credentials())
        body = bytearray()
        try:
            stream = connection.request(http.HttpRequest("GET", target, http.HttpHeaders(list(headers.items()))),
                                        on_body=lambda http_stream, chunk, **_: body.extend(chunk))
            stream.activate()
            status = await asyncio.wrap_future(stream.completion_future)
            assert status == 200, status
        finally:
            idle.put_nowait(connection)
        return len(body)

    async def close(state: Any) -> None:
        idle, connections = state
        while not idle.empty():
            connections.append(idle.get_nowait())
        for connection in connections:
            await asyncio.wrap_future(connection.close())

    return Epochs(open_, get, close)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.aws_clients", description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is not counted")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="a folder to write aws-clients-<date>.md in")
    args = parser.parse_args(argv)
    faults = load_faults_module()
    from loader import S3Config


    resolve_lab_names()
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="loader-aws-clients-")))
        server, keys, pki, lab, aws = lab_and_aws(stack, tmp, BUCKET, args.objects,
                                                  faults.FaultPlan(latency=0.02, bandwidth=90e6))
        base = server.config
        keys_of: dict[str, Any] = dict(region=base.region, access_key_id=base.access_key_id,
                                       secret_access_key=base.secret_access_key)
        shapes = {
            "aws": (S3Config(endpoint_url=f"https://{DOMAIN}:{aws.port}", addressing_style="virtual",
                             verify=pki["ca"], **keys_of), pki["ca"]),
            "lab": (S3Config(endpoint_url=f"http://127.0.0.1:{lab.port}", **keys_of), None),
        }
        by_shape = {shape: clients(config, ca) for shape, (config, ca) in shapes.items()}
        runs = [(shape, name) for shape, found in by_shape.items() for name in found
                if not (shape == "lab" and name == "http1-fresh")]  # nothing is parked on plain http
        for round_ in range(args.rounds):
            for shape, name in (runs if round_ % 2 == 0 else list(reversed(runs))):
                epochs = [by_shape[shape][name].epoch(keys) for _ in range(args.epochs)][1:]
                rows.setdefault((shape, name), []).extend(epochs)
                print(f"round {round_} {shape} {name:12s} " + "  ".join(
                    f"{cpu:5.0f} us/GET {rate:5.0f}/s" for cpu, rate in epochs), flush=True)
    lab_cpu = {name: statistics.median(cpu for cpu, _ in rows[("lab", name)])
               for shape, name in rows if shape == "lab"}
    lines = ["| client | endpoint | client CPU µs per GET (median) | range | GETs/s (median) | CPU vs its lab |",
             "|---|---|--:|--:|--:|--:|"]
    for (shape, name), measured in rows.items():
        cpus = sorted(cpu for cpu, _ in measured)
        cpu = statistics.median(cpus)
        rate = statistics.median(rate for _, rate in measured)
        lab = lab_cpu.get(name.replace("-fresh", ""))
        versus = f"{cpu / lab:.2f}x" if shape == "aws" and lab else ""
        lines.append(f"| {name} | {shape} | {cpu:,.0f} | {cpus[0]:,.0f}-{cpus[-1]:,.0f} | {rate:,.0f} | {versus} |")
    table = "\n".join(lines) + "\n"
    print()
    print(table)
    if args.out is not None:
        stamp = datetime.date.today().isoformat()
        path = (args.out or RESULTS_DIR) / f"aws-clients-{stamp}.md"
        path.write_text(f"# Client CPU per signed GET on the AWS-shaped endpoint, {stamp}\n\n"
                        f"`python -m bench.aws_clients --objects {args.objects} --epochs {args.epochs} "
                        f"--rounds {args.rounds}` (see the module's docstring for what each client is).\n\n"
                        + table)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
