"""``loader serve``'s work: a ``DevServer`` in the foreground until Ctrl-C or SIGTERM, its exports
printed for a shell; ``--background``/``--stop`` go through ``tools.background``.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import IO, TYPE_CHECKING

from .arguments import EXIT_FAILED, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from .devserver import DevServer


class _Stop(Exception):
    """Raised in the main thread by our SIGTERM handler so ``finally`` blocks run."""


def serve(args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Start a ``DevServer``, print export lines to ``out``, wait for a stop signal, stop cleanly.

    ``--background`` and ``--stop``: see ``tools.background``."""
    from . import background
    from .devserver import DEFAULT_START_TIMEOUT, DevServer, weed_version

    out, err = out or sys.stdout, err or sys.stderr
    if args.stop:
        background.stop(Path(args.stop).absolute(), err)
        return EXIT_OK
    pidfile = Path(args.pidfile).absolute() if args.pidfile else None
    if (args.background or args.detached) and pidfile is None:
        print("loader serve: error: --background needs --pidfile FILE, the file "
              "`loader serve --stop FILE` stops it by (see `loader serve --help`)", file=err)
        return EXIT_USAGE
    if args.background and pidfile is not None:
        exports, status = background.start_detached(_serve_argv(args), pidfile,
                                                    timeout=DEFAULT_START_TIMEOUT + 30)
        out.write(exports)
        out.flush()
        err.write(status.replace("Ctrl-C to stop", f"stop it with `loader serve --stop {pidfile}`"))
        return EXIT_OK
    examples = getattr(args, "examples", False)
    if examples:
        from .examples import EXAMPLES_BUCKET, example_data

        data = example_data()  # before the server starts: a missing extra fails at once
    buckets = [*args.bucket, EXAMPLES_BUCKET] if examples and EXAMPLES_BUCKET not in args.bucket else args.bucket
    server = DevServer(data_dir=args.data_dir, port=args.port, buckets=buckets)
    with _stop_on_sigterm():
        try:
            version = weed_version()
            server.start()
            if examples:
                from .examples import put_all

                put_all(server.config, data, EXAMPLES_BUCKET)
                print(f"# s3://{EXAMPLES_BUCKET}/ holds the examples' data: {len(data)} objects under "
                      "train/, images/, wds/ and parquet/", file=err, flush=True)
            if args.detached and pidfile is not None:
                background.write_pidfile(pidfile, server.endpoint_url)
            _print_exports(server.env, out)
            print(f"# SeaweedFS {version} serving S3 at {server.endpoint_url} "
                  f"(data: {server.root}, log: {server.log_path}); Ctrl-C to stop", file=err, flush=True)
            if args.detached:
                background.detach_stdio()  # the caller's $(...) returns now
            return _wait_while_running(server, err)
        except (KeyboardInterrupt, _Stop):
            return EXIT_OK
        finally:
            _ignore_stop_signals()
            server.stop()
            if args.detached and pidfile is not None:
                background.remove_pidfile(pidfile)


def _serve_argv(args: argparse.Namespace) -> list[str]:
    """The options of this ``serve`` again, for the detached process."""
    argv = ["--data-dir", str(Path(args.data_dir).absolute())] if args.data_dir else []
    if args.port:
        argv += ["--port", str(args.port)]
    for bucket in args.bucket:
        argv += ["--bucket", bucket]
    if getattr(args, "examples", False):
        argv.append("--examples")
    return argv


def _print_exports(env: dict[str, str], out: IO[str]) -> None:
    """``export NAME=value`` lines, shell-quoted, flushed so a reader sees them at once."""
    for name, value in env.items():
        print(f"export {name}={shlex.quote(value)}", file=out)
    out.flush()


def _wait_while_running(server: DevServer, err: IO[str]) -> int:
    """Sleep until a signal arrives; fail if the server process dies on its own."""
    idle = threading.Event()
    while server.running:
        idle.wait(0.5)
    print(f"loader serve: error: the server exited unexpectedly; see {server.log_path}", file=err)
    return EXIT_FAILED


class _stop_on_sigterm:
    """Turn SIGTERM into ``_Stop`` in the main thread for the duration of a ``with`` block."""

    def __enter__(self) -> None:
        self._old = signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _raise_stop)

    def __exit__(self, *exc_info: object) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old)
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def _ignore_stop_signals() -> None:
    """While stopping, a second Ctrl-C/SIGTERM must not interrupt the cleanup."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
