"""The real S3 servers the end-to-end tests run against, and how one is chosen; the fixtures that
hand them to tests are in ``conftest.py``. Test modules import helpers from here by name
(``from s3servers import minio_client``), never from ``conftest``: which ``conftest`` module a
plain import finds depends on the order pytest was given its folders."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import os
import secrets
import socket
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest

from loader.config import S3Config
from loader.errors import ConfigError

MINIO_IMAGE = "quay.io/minio/minio:RELEASE.2025-04-22T22-12-26Z"  # same tag as docker/docker-compose.yml
MINIO_PORT = 9000
DOCKER_PING_TIMEOUT = 2.0
RESTART_TIMEOUT = 60.0
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL", "MINIO_ENDPOINT")
# Everything S3Config.from_env() reads for endpoint and credentials; s3_env clears these first,
# and tests that start a child process with a clean environment leave them out.
S3_VARS = ENDPOINT_VARS + (
    "MINIO_SECURE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "MINIO_ACCESS_KEY", "MINIO_SECRET_KEY", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD",
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
)
_LOCAL_DOCKER_SCHEMES = ("unix", "npipe")
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
MOTO_START_TIMEOUT = 60.0
SERVERS_VAR = "LOADER_TEST_SERVERS"
# The names LOADER_TEST_SERVERS takes, and the kind of S3Server each one starts.
KINDS = {"seaweedfs": "seaweedfs-embedded", "moto": "moto", "minio": "minio-testcontainers", "env": "env"}
_bucket_numbers = itertools.count()


@dataclass(frozen=True)
class ServerChoice:
    """Which server the session will use, and the header line that explains why."""

    kind: str
    headline: str


class S3Server:
    """A running S3 server for tests: ``kind``, ``config``, ``env``, a ``minio`` client, helpers."""

    def __init__(self, kind: str, config: S3Config, description: str, devserver: Any = None,
                 container: Any = None) -> None:
        self.kind = kind
        self.config = config
        self.description = description
        self.devserver = devserver  # the loader.tools.devserver.DevServer when kind == "seaweedfs-embedded"
        self.container = container  # the docker-py container when kind == "minio-testcontainers"
        self.name = next(name for name, known in KINDS.items() if known == kind)  # as in test ids
        self.minio = minio_client(config)
        self.created_buckets: list[str] = []

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that make ``S3Config.from_env()`` point at this server."""
        env = self.config.to_env()
        if isinstance(self.config.verify, str):
            env["AWS_CA_BUNDLE"] = self.config.verify
        return env

    @property
    def supports_restart(self) -> bool:
        """Whether ``restart()`` works: for a server this session started, not one from the
        environment."""
        return self.devserver is not None or self.container is not None

    def new_bucket(self, prefix: str = "it") -> str:
        """Create and return a fresh, uniquely named bucket."""
        name = f"{prefix}-{next(_bucket_numbers):03d}-{uuid.uuid4().hex[:10]}"
        self.minio.make_bucket(name)
        self.created_buckets.append(name)
        return name

    def restart(self, *, downtime: float = 0.0, kill: bool = False) -> None:
        """Stop (``kill``: SIGKILL) and start the server on the same data, endpoint and
        credentials, ``downtime`` seconds later. Call from a thread to fault a running loader.
        An endpoint from the environment is someone else's server: the calling test skips."""
        if self.devserver is not None:
            self.devserver.restart(downtime=downtime, kill=kill)
        elif self.container is not None:
            restart_container(self.container, downtime=downtime, kill=kill, ready=self.answers)
        else:
            pytest.skip(f"restart() needs a server this session started; {self.description} is not")

    def answers(self) -> bool:
        """Whether the server answers an authenticated request now."""
        try:
            self.minio.list_buckets()
        except Exception:  # refused, reset, 503 while starting: not yet
            return False
        return True

    def delete_created_buckets(self) -> None:
        """Best effort: empty and delete every bucket ``new_bucket()`` made (for shared servers)."""
        from minio.deleteobjects import DeleteObject

        for bucket in self.created_buckets:
            try:
                names = (DeleteObject(o.object_name) for o in
                         self.minio.list_objects(bucket, recursive=True))
                for error in self.minio.remove_objects(bucket, names):
                    raise RuntimeError(str(error))
                self.minio.remove_bucket(bucket)
            except Exception as exc:
                warnings.warn(f"could not delete test bucket {bucket!r}: {exc}", stacklevel=1)

    def close(self) -> None:
        """Release the minio client's connection pool."""
        self.minio._http.clear()

    def __repr__(self) -> str:
        return f"S3Server(kind={self.kind!r}, endpoint={self.config.endpoint_url!r})"


# ---------------------------------------------------------------- choosing the server


@functools.lru_cache(maxsize=1)
def chosen_servers() -> tuple[str, ...]:
    """The servers of this session, by name (``KINDS``), the first one for the whole suite and
    every one for the server-sensitive tests (marker ``server_sensitive``): ``$LOADER_TEST_SERVERS``
    (e.g. ``seaweedfs,moto``, ``minio``, ``env``), else the automatic choice (``choose_server``)
    followed by moto."""
    text = os.environ.get(SERVERS_VAR, "").strip()
    if not text:
        first = next(name for name, kind in KINDS.items() if kind == choose_server().kind)
        return (first,) if first == "moto" else (first, "moto")
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in KINDS]
    if unknown or not names:
        raise pytest.UsageError(f"{SERVERS_VAR}={text!r}: use a comma-separated list of {sorted(KINDS)}, "
                                "e.g. 'seaweedfs,moto'; the first runs the whole suite")
    return names


def servers_headline() -> str:
    """The header line: which servers run what, and why."""
    names = chosen_servers()
    why = (f"from ${SERVERS_VAR}" if os.environ.get(SERVERS_VAR, "").strip()
           else f"{choose_server().headline}; set ${SERVERS_VAR} to choose")
    return (f"S3 servers: {names[0]} for every test, {', '.join(names)} for the server-sensitive "
            f"tests ({why})")


@functools.lru_cache(maxsize=1)
def choose_server() -> ServerChoice:
    """Environment endpoint, else MinIO in Docker, else embedded SeaweedFS (decided once)."""
    for name in ENDPOINT_VARS:
        if os.environ.get(name):
            return ServerChoice("env", f"S3 server: {os.environ[name]} from ${name} (environment)")
    answers, why = docker_engine_answers()
    if answers:
        return ServerChoice("minio-testcontainers",
                            f"S3 server: MinIO {MINIO_IMAGE} via testcontainers (Docker engine {why})")
    return ServerChoice("seaweedfs-embedded", f"S3 server: {_embedded_name()} (no Docker engine answered: {why})")


@functools.lru_cache(maxsize=1)
def docker_engine_answers(timeout: float = DOCKER_PING_TIMEOUT) -> tuple[bool, str]:
    """``(True, where)`` if a local Docker engine answers a ping within ``timeout`` s, else
    ``(False, reason)``. Remote engines (DOCKER_HOST=tcp://other-host) are not used unless
    LOADER_TEST_REMOTE_DOCKER=1, since the tests only talk to this machine."""
    host = os.environ.get("DOCKER_HOST", "")
    if host and not _is_local_docker_host(host) and os.environ.get("LOADER_TEST_REMOTE_DOCKER") != "1":
        return False, f"DOCKER_HOST={host!r} is not on this machine (set LOADER_TEST_REMOTE_DOCKER=1 to use it)"
    try:
        import docker
    except ImportError:
        return False, "the docker SDK is not installed (pip install docker)"
    try:
        client = docker.from_env(timeout=timeout)
        try:
            client.ping()
            where = client.api.base_url
        finally:
            client.close()
    except Exception as exc:
        reason = _one_line(exc)
    else:
        return True, f"answered at {where}"
    with warnings.catch_warnings():  # the SDK drops its half-open socket when no engine answers
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    return False, reason


def _is_local_docker_host(host: str) -> bool:
    parts = urlsplit(host)
    return parts.scheme in _LOCAL_DOCKER_SCHEMES or (parts.hostname or "") in _LOCAL_HOSTS


def _embedded_name() -> str:
    try:
        from loader.tools.devserver import weed_version

        return f"embedded SeaweedFS {weed_version()}"
    except Exception as exc:
        return f"embedded SeaweedFS, unavailable: {_one_line(exc)}"


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- starting it


def minio_client(config: S3Config):
    """A ``minio.Minio`` client for ``config`` with a pool big enough for 16+ upload threads."""
    import urllib3
    from minio import Minio

    parts = urlsplit(config.endpoint_url or "https://s3.amazonaws.com")
    verify = config.verify
    http = urllib3.PoolManager(
        maxsize=32,
        timeout=urllib3.Timeout(connect=10, read=120),
        retries=urllib3.Retry(total=3, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
        cert_reqs="CERT_REQUIRED" if verify else "CERT_NONE",
        **({"ca_certs": verify} if isinstance(verify, str) else {}),
    )
    return Minio(parts.netloc, access_key=config.access_key_id, secret_key=config.secret_access_key,
                 session_token=config.session_token, secure=parts.scheme == "https",
                 region=config.region, http_client=http)


def server_from_env() -> S3Server:
    """The endpoint and credentials the environment names."""
    config = S3Config.from_env()
    if not config.has_credentials:  # the tests' own minio client needs the keys themselves
        raise ConfigError(f"the tests' S3 server {config.endpoint_url} from the environment needs "
                          "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set (e.g. from docker/minio.env)")
    return S3Server("env", config, f"{config.endpoint_url} from the environment")


@contextlib.contextmanager
def minio_container(image: str = MINIO_IMAGE) -> Iterator[S3Server]:
    """MinIO in a testcontainer, published on 127.0.0.1 only, with random credentials."""
    try:
        from testcontainers.community.minio import MinioContainer
    except ImportError:  # testcontainers < 4.10
        from testcontainers.minio import MinioContainer

    access, secret = "it" + secrets.token_hex(8), secrets.token_urlsafe(24)
    container = MinioContainer(image=image, port=MINIO_PORT, access_key=access, secret_key=secret)
    container.with_env("MINIO_ROOT_USER", access).with_env("MINIO_ROOT_PASSWORD", secret)
    # A fixed free port on loopback: Docker may give a published random port a new number when
    # the container restarts, and restart() must keep the endpoint.
    container.ports[str(MINIO_PORT)] = ("127.0.0.1", free_port())
    with container:
        host = container.get_container_host_ip()
        host = "127.0.0.1" if host == "localhost" else host
        port = container.get_exposed_port(MINIO_PORT)
        config = S3Config(endpoint_url=f"http://{host}:{port}", access_key_id=access,
                          secret_access_key=secret, addressing_style="path")
        server = S3Server("minio-testcontainers", config, f"MinIO {image} at {config.endpoint_url}",
                          container=container.get_wrapped_container())
        try:
            yield server
        finally:
            server.close()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def restart_container(container: Any, *, downtime: float, kill: bool, ready: Callable[[], bool],
                      timeout: float = RESTART_TIMEOUT) -> None:
    """Stop a docker-py ``container`` (``kill``: SIGKILL, else a graceful stop), start it again
    ``downtime`` seconds later, and wait until ``ready()``; its filesystem, so the data, stays."""
    if kill:
        container.kill()
    else:
        container.stop(timeout=10)
    time.sleep(downtime)
    container.start()
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"container {container.name} did not answer within {timeout:.0f} s "
                               "of its restart")
        time.sleep(0.2)


@contextlib.contextmanager
def embedded_server() -> Iterator[S3Server]:
    """The embedded SeaweedFS ``DevServer`` in a temporary directory."""
    from loader.tools.devserver import DevServer

    with DevServer() as server:
        description = f"embedded SeaweedFS at {server.endpoint_url} (started in {server.start_seconds:.1f} s)"
        yield S3Server("seaweedfs-embedded", server.config, description, devserver=server)


@contextlib.contextmanager
def moto_server(timeout: float = MOTO_START_TIMEOUT, *, certfile: str | None = None,
                keyfile: str | None = None, cafile: str | None = None) -> Iterator[S3Server]:
    """moto's S3 server (``moto[server]``: AWS's semantics, in memory) in a child process on
    127.0.0.1, so that its Python does not share this process's interpreter lock (or patch the
    botocore of the tests). Any credentials are accepted; AWS's bucket rules apply. Its log (a
    line per request) goes to a temporary file: a pipe nobody reads fills and stalls the server.
    ``certfile``/``keyfile``: serve https with them instead, ``cafile`` being what clients trust."""
    import tempfile

    port = free_port()
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moto_main.py")  # two bugs patched
    command = [sys.executable, launcher, "-H", "127.0.0.1", "-p", str(port)]
    if certfile is not None and keyfile is not None:
        command += ["--ssl-cert", certfile, "--ssl-key", keyfile]
    scheme = "http" if certfile is None else "https"
    config = S3Config(endpoint_url=f"{scheme}://127.0.0.1:{port}", verify=cafile or True,
                      access_key_id="it" + secrets.token_hex(8), secret_access_key=secrets.token_urlsafe(24),
                      region="us-east-1", addressing_style="path")
    with tempfile.TemporaryFile() as log:
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(_MOTO_SETUP_CALLS)}
        for name in S3_VARS:
            env.pop(name, None)
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        try:
            started = time.monotonic()
            while not _listening(port):
                if process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"moto's server exited with {process.returncode} "
                                       "(pip install 'moto[server]'): "
                                       f"{_one_line(Exception(log.read().decode(errors='replace')))}")
                if time.monotonic() - started > timeout:
                    raise TimeoutError(f"moto's server did not listen on port {port} within {timeout:.0f} s")
                time.sleep(0.05)
            config = _moto_user(config)
            server = S3Server("moto", config, f"moto {_moto_version()} at {config.endpoint_url} "
                              f"(started in {time.monotonic() - started:.1f} s)")
            try:
                yield server
            finally:
                server.close()
        finally:
            process.kill()  # it keeps nothing worth a clean stop, which took ~5 s under load
            process.wait()


_MOTO_SETUP_CALLS = 3


def _moto_user(config: S3Config) -> S3Config:
    """Create a moto IAM user allowed everything on S3 (``_MOTO_SETUP_CALLS`` requests, before
    moto starts checking signatures) and return ``config`` with its keys."""
    import json

    import boto3

    iam = boto3.client("iam", endpoint_url=config.endpoint_url, region_name=config.region,
                       aws_access_key_id="setup", aws_secret_access_key="setup", verify=config.verify)
    try:
        iam.create_user(UserName="loader-tests")
        policy = {"Version": "2012-10-17",
                  "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="loader-tests", PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="loader-tests")["AccessKey"]
    finally:
        iam.close()
    return dataclasses.replace(config, access_key_id=key["AccessKeyId"],
                               secret_access_key=key["SecretAccessKey"])


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _moto_version() -> str:
    from importlib.metadata import version

    return version("moto")


def fault_proxy(s3_server: S3Server, plan: Any) -> Any:
    """A ``faults.FaultProxy`` in front of ``s3_server`` (which must be plain HTTP on 127.0.0.1)
    with ``plan`` (a ``faults.FaultPlan``)."""
    from faults import FaultProxy

    try:
        return FaultProxy(s3_server.config.endpoint_url, plan)
    except ValueError as exc:
        pytest.fail(f"the fault proxy needs a plain-http server on 127.0.0.1 (point the tests at one): {exc}")
