"""Command line: run the proxy in a process of its own, so that it does not share the client's GIL
(benchmarks): ``PYTHONPATH=integration python -m faults --upstream http://127.0.0.1:8333 ...``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from . import __doc__ as package_doc
from .connection import LOOPBACK
from .plan import DEFAULT_ONLY_METHODS, DEFAULT_STALL_SECONDS, FAULT_KINDS, THROTTLE_SHAPES, FaultPlan
from .proxy import DEFAULT_MAX_LIFETIME, FaultProxy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=package_doc.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help=f"http://{LOOPBACK}:<port> of the S3 server")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free one)")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added before forwarding")
    for kind in FAULT_KINDS:
        parser.add_argument(f"--{kind}", type=float, default=0.0, help=f"probability of {kind} per request")
    parser.add_argument("--stall-seconds", type=float, default=DEFAULT_STALL_SECONDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only-methods", default=",".join(DEFAULT_ONLY_METHODS),
                        help="comma-separated methods faults apply to, or '*' for all")
    parser.add_argument("--all-paths", action="store_true",
                        help="let faults hit bucket requests (listings) too, not only objects")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="bytes/s each answer's body is served at (default: no limit)")
    parser.add_argument("--get-rate", type=float, default=None, help="GETs/s answered; beyond, 503 SlowDown")
    parser.add_argument("--throttle", choices=THROTTLE_SHAPES, default="bucket",
                        help="the limit's shape: a token bucket or a sliding one-second window")
    parser.add_argument("--get-rate-rises-after", type=float, default=None,
                        help="seconds of sustained load after which the limit doubles")
    parser.add_argument("--slowdown-keep-alive", action="store_true",
                        help="keep the connection open after a SlowDown (S3 closes it)")
    parser.add_argument("--max-lifetime", type=float, default=DEFAULT_MAX_LIFETIME)
    args = parser.parse_args(argv)
    methods = None if args.only_methods == "*" else tuple(m for m in args.only_methods.split(",") if m)
    try:
        plan = FaultPlan(latency=args.latency, reset=args.reset, slowdown=args.slowdown, truncate=args.truncate,
                         stall=args.stall, stall_seconds=args.stall_seconds, seed=args.seed, only_methods=methods,
                         objects_only=not args.all_paths, bandwidth=args.bandwidth, get_rate=args.get_rate,
                         throttle=args.throttle, get_rate_rises_after=args.get_rate_rises_after,
                         slowdown_close=not args.slowdown_keep_alive)
        proxy = FaultProxy(args.upstream, plan, max_lifetime=args.max_lifetime, port=args.port)
    except ValueError as exc:
        parser.error(str(exc))
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    with proxy:
        print(proxy.endpoint_url, flush=True)
        while proxy.running and not done.wait(0.2):
            pass
        counts = proxy.counts
    print(dict(counts), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
