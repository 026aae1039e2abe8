"""``python -m loader`` / ``loader``: command-line tools around the loader.

Each subcommand is one ``register_*`` function that adds its parser and sets ``run`` to a
function taking the parsed ``argparse.Namespace`` and returning an exit code. To add one (``bench``,
``shard``, ``ls``), write ``register_x(subparsers)`` and append it to ``SUBCOMMANDS``.

Errors a user can fix (bad arguments, ``ConfigError``, a server that does not start) are printed
as ``loader <command>: error: ...`` without a traceback; exit codes: 0 ok, 1 failed, 2 bad usage,
130 interrupted.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, NoReturn

from .errors import LoaderError

if TYPE_CHECKING:
    from .devserver import DevServer

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line: ``loader serve: error: ... (see --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _Stop(Exception):
    """Raised in the main thread by our SIGTERM handler so ``finally`` blocks run."""


# ------------------------------------------------------------------------ serve


def register_serve(subparsers: argparse._SubParsersAction) -> None:
    """``serve``: run the embedded SeaweedFS S3 server until Ctrl-C or SIGTERM."""
    p = subparsers.add_parser(
        "serve", help="run a local S3 server (embedded SeaweedFS) and print its environment",
        description="Start a throwaway S3 server on 127.0.0.1 and print `export ...` lines for "
                    "AWS_ENDPOINT_URL and credentials; runs until Ctrl-C or SIGTERM.",
    )
    p.add_argument("--data-dir", metavar="DIR",
                   help="keep data (and credentials) here across runs; default: a temporary "
                        "directory removed at exit")
    p.add_argument("--port", type=_port, metavar="PORT",
                   help="S3 port on 127.0.0.1 (default: a free port)")
    p.add_argument("--bucket", action="append", default=[], metavar="NAME",
                   help="create this bucket at start (repeatable)")
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Start a ``DevServer``, print export lines to ``out``, wait for a stop signal, stop cleanly."""
    from .devserver import DevServer, weed_version

    out, err = out or sys.stdout, err or sys.stderr
    server = DevServer(data_dir=args.data_dir, port=args.port, buckets=args.bucket)
    with _stop_on_sigterm():
        try:
            version = weed_version()
            server.start()
            _print_exports(server.env, out)
            print(f"# SeaweedFS {version} serving S3 at {server.endpoint_url} "
                  f"(data: {server.root}, log: {server.log_path}); Ctrl-C to stop", file=err, flush=True)
            return _wait_while_running(server, err)
        except (KeyboardInterrupt, _Stop):
            return EXIT_OK
        finally:
            _ignore_stop_signals()
            server.stop()


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


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port; use 1-65535")
    return value


# ------------------------------------------------------------------------ main

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [register_serve]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = _Parser(prog="loader", description="Tools for the async S3 data loader.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.run(args) or EXIT_OK)
    except LoaderError as exc:
        print(f"loader {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
