"""A fault-injecting HTTP/1.1 reverse proxy that sits in front of a real S3 server on 127.0.0.1.

Tests and benchmarks point a client at ``FaultProxy.endpoint_url`` instead of the server; the proxy
forwards every request byte for byte (the ``Host`` header included, so signed requests still verify
upstream) and, with seeded probabilities per request, injects what a real object store does to a
client on a bad day::

    latency    every request waits ``latency`` seconds before it is forwarded (time to first byte)
    reset      the client connection is torn down with a TCP RST (SO_LINGER 0) before any answer
    slowdown   ``503 SlowDown`` with S3's XML error body, without asking the upstream; as S3 does, it
               closes the connection (``Connection: close``, chunked body) unless ``slowdown_close=False``
    truncate   the real status and headers (true Content-Length), then part of the body, then close
    stall      the real headers and part of the body, then silence for ``stall_seconds``, then close
    straggle   the whole answer, ``straggle_seconds`` late (S3's slow tail)
    get_rate   a throttle: requests beyond this many per second get ``503 SlowDown`` (S3 per prefix),
               shaped as a token bucket or a sliding one-second window (``throttle``), doubling
               after ``get_rate_rises_after`` seconds of sustained load (S3 scales a busy prefix)
    bandwidth  each answer's body paced at this many bytes/s (S3: ~85-90 MB/s per connection)

Usage from a test (the proxy runs its own event loop in a thread)::

    with DevServer(buckets=["train"]) as server, FaultProxy(server.config.endpoint_url,
                                                            FaultPlan(slowdown=0.3, seed=1)) as proxy:
        config = dataclasses.replace(server.config, endpoint_url=proxy.endpoint_url)
        ...
        assert proxy.counts["slowdown"] > 0
        proxy.set_plan(FaultPlan())          # live: from now on everything passes

Faults other than latency hit only GETs of objects by default (``only_methods=("GET",)``,
``objects_only=True``), so uploads, listings and bucket requests stay reliable; both are settings.
A reset or slowdown request never reaches the upstream.

or from a shell, in a process of its own so it does not share the client's GIL::

    PYTHONPATH=integration python -m faults --upstream http://127.0.0.1:8333 --latency 0.02

One job per module: ``plan`` (the plan and its seeded decisions, pure), ``http11`` (where HTTP/1.1
messages end), ``answers`` (the responses the proxy makes up), ``connection`` (one client
connection: forward or inject), ``proxy`` (the thread, the listener, the counts), ``__main__``
(the command line).
"""

from __future__ import annotations

from .certificates import lab_certificates
from .connection import LOOPBACK
from .plan import DEFAULT_STALL_SECONDS, FAULT_KINDS, Decision, FaultDecider, FaultPlan
from .proxy import DEFAULT_MAX_LIFETIME, FaultProxy

__all__ = [
    "DEFAULT_MAX_LIFETIME",
    "DEFAULT_STALL_SECONDS",
    "FAULT_KINDS",
    "LOOPBACK",
    "Decision",
    "FaultDecider",
    "FaultPlan",
    "FaultProxy",
    "lab_certificates",
]
