"""What the command line's verbs share: exit codes, the help formatter, one-line usage errors, and
the types that parse option values (each error says what to give instead).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import warnings
from typing import TYPE_CHECKING, Any, NoReturn

from ..errors import LoaderError

if TYPE_CHECKING:
    from ..retry import RetryPolicy

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


ENV_HELP = ("Endpoint and credentials come from the environment: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_REGION (or MinIO's names), or AWS_PROFILE and the profiles in "
            "~/.aws, as for the AWS CLI; `loader serve` prints them for a local server.")


class _Formatter(argparse.HelpFormatter):
    """Wraps each paragraph of a description or epilog; keeps lines indented by two spaces
    (examples) as they are."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            if line.startswith("  ") or not line.strip():
                lines.append(indent + line)
            else:
                lines.append(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent))
        return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line: ``loader serve: error: ... (see --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port; use 1-65535")
    return value


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give 0 or more")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):  # also rejects NaN
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _s3_uri(text: str) -> str:
    from ..uri import parse_s3_uri

    try:
        parse_s3_uri(text)
    except LoaderError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _bucket_name(text: str) -> str:
    """A name ``serve`` may create, checked before the server starts (S3's naming rules)."""
    from ..uri import BUCKET_NAME_RULE, bucket_name_problem

    problem = bucket_name_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid bucket name ({problem}); use {BUCKET_NAME_RULE}")
    return text


def _size(text: str) -> int:
    from .sizes import parse_size

    try:
        return parse_size(text)
    except LoaderError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _name_format(text: str) -> str:
    from ..formats.compression import compression_of
    from ..formats.packing import check_name_format

    try:  # its suffix is checked against --compress once both are known (PackOptions)
        kind = compression_of(text.format(0))
    except (IndexError, KeyError, ValueError):
        kind = None  # check_name_format says what is wrong with it
    try:
        return check_name_format(text, kind)
    except LoaderError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_long_run_options(p: argparse.ArgumentParser) -> None:
    """What the long-running verbs (``shard``, ``index``) share: ``--progress``, and the hidden
    ``--part-size``/``--stop-after`` that tests use to read small shards in parts and to stop early."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    p.add_argument("--part-size", type=_size, default=None, help=argparse.SUPPRESS)
    p.add_argument("--stop-after", type=_positive_int, default=None, help=argparse.SUPPRESS)


def add_deprecated_alias(p: argparse.ArgumentParser, old: str, new: str, dest: str,
                         **kwargs: Any) -> None:
    """``old``, the spelling of an earlier release, still sets ``dest`` (the flag ``new`` sets),
    for one release, with a DeprecationWarning and a line on stderr that name ``new``; hidden
    from ``--help``. ``kwargs`` as for ``add_argument`` (none: a flag without a value)."""
    flag = not kwargs

    class Alias(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                     values: Any, option_string: str | None = None) -> None:
            message = f"{old} is deprecated and will be removed in the next release: use {new}"
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            print(f"loader: {message}", file=sys.stderr)
            setattr(namespace, dest, True if flag else values)

    p.add_argument(old, action=Alias, dest=dest, nargs=0 if flag else None, help=argparse.SUPPRESS,
                   default=argparse.SUPPRESS, **kwargs)


RETRY_DEADLINE_OPTION = "--retry-deadline"


def add_retry_options(p: argparse.ArgumentParser) -> None:
    """``--retry-deadline``, for every verb that talks to the store: how long a failing request is
    retried (``RetryPolicy(deadline=...)``), since the library's advice to raise it must be
    followable from a shell."""
    p.add_argument(RETRY_DEADLINE_OPTION, type=_seconds, default=None, metavar="SECONDS",
                   help="how long a request failing with errors the server may recover from (5xx, "
                        "SlowDown, resets) is retried before the command fails (default: 120, "
                        "RetryPolicy's); an endpoint that never answered fails within seconds")


def retry_policy(args: argparse.Namespace) -> RetryPolicy | None:
    """The policy ``--retry-deadline`` asks for; None: the library's default."""
    from ..retry import RetryPolicy

    deadline = getattr(args, "retry_deadline", None)
    return None if deadline is None else RetryPolicy(deadline=deadline)
